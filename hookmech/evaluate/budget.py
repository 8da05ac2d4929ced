"""`--budget-hours`: which runs of an evaluation fit, planned from measured step times.

`step_seconds` times a few optimizer steps of a task's model here (after warm-up steps that are
not counted); `plan` keeps runs in priority order — every task's first learning rate, then every
task's second, … — while their estimated times, spread over the workers, fit the budget. Runs
already finished in the folder cost nothing and are always kept.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

#: optimizer steps timed per task, after WARMUP_STEPS uncounted ones
PROBE_STEPS = 20
WARMUP_STEPS = 3
#: a run costs its steps plus evaluations, checkpoints and the end-of-run attributions: the
#: estimate multiplies the steps' time by this (measured: 1.1-1.2 on the quick suite)
OVERHEAD = 1.25


@dataclass(frozen=True)
class Planned:
    """A run of the plan: its task, learning rate, estimated seconds and whether it is kept."""

    task: str
    lr: float
    seconds: float
    done: bool
    kept: bool


def step_seconds(run: dict[str, Any], device: str = "cpu", steps: int = PROBE_STEPS) -> float:
    """Return the measured seconds of one optimizer step of sweep run `run` (a `Run.as_dict()`)
    on `device`: the mean of `steps` steps on fresh documents after WARMUP_STEPS. Restores torch's
    RNG afterwards, so the caller's draws do not depend on whether it planned."""
    import torch

    from ..model import HookedLM
    from ..sweep import build_run
    from ..training import DataStream, answer_loss

    task, model_config, train_config = build_run(run)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = HookedLM(model_config).to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=train_config.lr)
        data = DataStream(task, dataclasses.replace(train_config, n_train=0))
        began = 0.0
        for step in range(WARMUP_STEPS + steps):
            if step == WARMUP_STEPS:
                began = time.perf_counter()
            loss = answer_loss(model, data.batch(step).trimmed().to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return (time.perf_counter() - began) / steps


def plan(runs: Sequence[tuple[str, float, float, bool]], budget_hours: float | None, workers: int = 1) -> list[Planned]:
    """Return the plan of `runs`, given as ``(task, lr, estimated seconds, done)`` in priority
    order, with whether each is kept.

    Without a budget every run is kept. With one, runs are kept in order while the kept
    unfinished runs' estimated seconds divided by `workers` stay within `budget_hours`; a run
    that does not fit is left out, and a later, shorter one may still fit. Finished runs cost
    nothing and are always kept.
    """
    check_budget(budget_hours)
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    left = math.inf if budget_hours is None else budget_hours * 3600 * workers
    planned = []
    for task, lr, seconds, done in runs:
        kept = done or seconds <= left
        if kept and not done:
            left -= seconds
        planned.append(Planned(task, lr, seconds, done, kept))
    return planned


def run_seconds(step_time: float, total_steps: int) -> float:
    """Return the estimated seconds of a run of `total_steps` steps of `step_time` seconds."""
    return step_time * total_steps * OVERHEAD


def check_budget(budget_hours: float | None) -> None:
    """Raise a UsageError unless `budget_hours` is None or a finite number > 0."""
    if budget_hours is not None and not (math.isfinite(budget_hours) and budget_hours > 0):
        raise UsageError(f"--budget-hours must be a number > 0, got {budget_hours}")
