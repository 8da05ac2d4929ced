"""`--budget-hours`: which runs of an evaluation fit, planned from measured step times.

`step_seconds` times a few optimizer steps of a task's model here (after warm-up steps that are
not counted); `plan` keeps runs round by round — every task's first learning rate, then every
task's second, … — while their estimated times, spread over the workers, fit the budget; no run
of a later round is kept while a run of an earlier one is left out. Runs already finished in the
folder cost nothing and are always kept. `next_run` names the first run left out and the budget
that would keep it too.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from ..sweep import build_run

# torch, the model and training are imported where used: this module loads without torch

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


def step_seconds(
    run: dict[str, Any], device: str = "cpu", steps: int = PROBE_STEPS, threads: int | None = None
) -> float:
    """Return the measured seconds of one optimizer step of sweep run `run` (a `Run.as_dict()`)
    on `device` with `threads` torch threads (None: as set): the mean of `steps` steps on fresh
    documents after WARMUP_STEPS. Gives the caller back its RNG and thread count."""
    import torch

    from ..model import HookedLM
    from ..training import DataStream, answer_loss

    task, model_config, train_config = build_run(run)
    was_threads = torch.get_num_threads()
    cuda = device.startswith("cuda")

    def now() -> float:
        if cuda:  # kernels run asynchronously: time the work, not its launch
            torch.cuda.synchronize(device)
        return time.perf_counter()

    with torch.random.fork_rng(devices=[torch.device(device).index or 0] if cuda else []):
        try:
            if threads is not None:
                torch.set_num_threads(threads)
            torch.manual_seed(0)
            model = HookedLM(model_config).to(device).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=train_config.lr)
            data = DataStream(task, dataclasses.replace(train_config, n_train=0))
            began = 0.0
            for step in range(WARMUP_STEPS + steps):
                if step == WARMUP_STEPS:
                    began = now()
                loss = answer_loss(model, data.batch(step).trimmed().to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            return (now() - began) / steps
        finally:
            torch.set_num_threads(was_threads)


def plan(runs: Sequence[tuple[str, float, float, bool]], budget_hours: float | None, workers: int = 1) -> list[Planned]:
    """Return the plan of `runs`, given as ``(task, lr, estimated seconds, done)`` in priority
    order (a task's k-th run belongs to round k), with whether each is kept.

    Without a budget every run is kept. With one, runs are kept in order while the estimated
    wall time of the kept unfinished runs (`wall_seconds`: tasks one after another, up to
    `workers` runs of a task at once) stays within `budget_hours`. A run that does not fit is
    left out, and so is every unfinished run of a later round: every task gets its first
    learning rate before any task gets its second (a shorter run of the same round may still
    fit). Finished runs cost nothing and are kept.
    """
    check_budget(budget_hours)
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    limit = math.inf if budget_hours is None else budget_hours * 3600
    pending: list[tuple[str, float]] = []
    planned = []
    rounds: dict[str, int] = defaultdict(int)  # runs of each task seen so far
    gap_round = math.inf  # the first round in which a run was left out
    for task, lr, seconds, done in runs:
        this_round = rounds[task]
        rounds[task] += 1
        fits = this_round <= gap_round and wall_seconds([*pending, (task, seconds)], workers) <= limit
        kept = done or fits
        if not kept:
            gap_round = min(gap_round, this_round)
        if kept and not done:
            pending.append((task, seconds))
        planned.append(Planned(task, lr, seconds, done, kept))
    return planned


def next_run(planned: Sequence[Planned], workers: int = 1) -> tuple[Planned, float] | None:
    """Return the first run `planned` leaves out and the budget in hours (estimated wall time of
    the kept unfinished runs and it) that would keep it too, or None when every run is kept."""
    left = [p for p in planned if not p.kept]
    if not left:
        return None
    kept = [(p.task, p.seconds) for p in planned if p.kept and not p.done]
    return left[0], wall_seconds([*kept, (left[0].task, left[0].seconds)], workers) / 3600


def wall_seconds(runs: Sequence[tuple[str, float]], workers: int) -> float:
    """Return the estimated wall time of `runs` (``(task, seconds)``): tasks run one after
    another, and a task's runs share ``min(workers, its runs)`` workers evenly."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for task, seconds in runs:
        by_task[task].append(seconds)
    return sum(sum(times) / min(workers, len(times)) for times in by_task.values())


def run_seconds(step_time: float, total_steps: int) -> float:
    """Return the estimated seconds of a run of `total_steps` steps of `step_time` seconds."""
    return step_time * total_steps * OVERHEAD


def check_budget(budget_hours: float | None) -> None:
    """Raise a UsageError unless `budget_hours` is None or a finite number > 0."""
    if budget_hours is not None and not (math.isfinite(budget_hours) and budget_hours > 0):
        raise UsageError(f"--budget-hours must be a number > 0, got {budget_hours}")
