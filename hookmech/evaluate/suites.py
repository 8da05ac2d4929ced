"""The suites of `hookmech evaluate`: which tasks a mixer is trained on, at which configuration,
over which learning rates.

- ``quick`` — the CPU variants, minutes per run: AR (64 content tokens, 4 pairs: the ``ar-cpu``
  preset's task), MQAR (sequence 32, 4 pairs, 64 tokens) and the easiest ATR (L_max 5, |Σ| 20),
  each 4000 steps on fresh documents (warm-up 50 %), d_model 64, two layers, untied head;
  learning rates 3e-3, 1e-3, 1e-2 in that order of priority.
- ``paper`` — paper 000's code's configurations (the ``ar-paper-d64`` and ``atr-paper-d64``
  presets: 16 and 32 epochs of 3126 steps, d_model 64, two layers, no position embeddings
  for a mixer that is not attention); learning rates 1e-3, 3e-3, 1e-2 (AR) and 1e-3, 3e-4,
  3e-3 (ATR, the paper's range ends at 3e-3).

A learning rate's place in its list is its priority: `--budget-hours` keeps the first rate of
every task before the second of any. `with_rates`, `with_tasks` and `with_steps` make the
variants of `--lr`, `--tasks` and `--steps` (the last two: smoke tests).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError, unknown
from ..sweep import load_preset


@dataclass(frozen=True)
class SuiteTask:
    """One task of a suite: a sweep's [task], [train], [model] and [mixer_options] without the
    mixer, and its learning rates in order of priority."""

    name: str
    task: dict[str, Any]
    train: dict[str, Any]
    model: dict[str, Any]
    lrs: tuple[float, ...]
    mixer_options: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Suite:
    """A named list of tasks."""

    name: str
    about: str
    tasks: tuple[SuiteTask, ...]


_QUICK_TRAIN = {"steps": 4000, "n_train": 0, "warmup_frac": 0.5, "eval_every": 500, "ckpt_every": 1000}
_QUICK_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 1, "tie_embeddings": False}
_QUICK_LRS = (3e-3, 1e-3, 1e-2)


def _quick() -> Suite:
    tasks = (
        ("ar", {"name": "ar", "vocab_size": 64, "num_kv_pairs": 4}),
        ("mqar", {"name": "mqar", "vocab_size": 64, "seq_len": 32, "num_kv_pairs": 4}),
        ("atr", {"name": "atr", "max_rhs_len": 5, "num_terminals": 20}),
    )
    return Suite(
        "quick",
        "CPU variants of AR, MQAR and the easiest ATR, 4000 steps each",
        tuple(SuiteTask(name, task, dict(_QUICK_TRAIN), dict(_QUICK_MODEL), _QUICK_LRS) for name, task in tasks),
    )


def _paper_task(name: str, preset: str, lrs: tuple[float, ...]) -> SuiteTask:
    """A task of the paper suite: preset `preset` without its [grid] (its architectures and rates)."""
    sweep = load_preset(preset)
    model = {key: value for key, value in sweep.model.items() if key not in ("arch", "mixer")}
    return SuiteTask(name, dict(sweep.task), dict(sweep.train), model, lrs, dict(sweep.mixer_options))


def _paper() -> Suite:
    return Suite(
        "paper",
        "paper 000's AR and easiest ATR at its code's configuration (ar-paper-d64, atr-paper-d64)",
        (
            _paper_task("ar", "ar-paper-d64", (1e-3, 3e-3, 1e-2)),
            _paper_task("atr", "atr-paper-d64", (1e-3, 3e-4, 3e-3)),
        ),
    )


SUITE_NAMES = ("quick", "paper")


def suite(name: str) -> Suite:
    """Return suite `name` (``quick`` or ``paper``); another name is a UsageError listing them."""
    if name == "quick":
        return _quick()
    if name == "paper":
        return _paper()
    raise unknown("suite", name, SUITE_NAMES)


def with_rates(chosen: Suite, lrs: Sequence[float]) -> Suite:
    """Return `chosen` with every task's learning rates replaced by `lrs` (in order of
    priority); rates must be finite, > 0 and distinct (UsageError)."""
    if not lrs:
        raise UsageError("--lr: give at least one learning rate")
    for lr in lrs:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
            raise UsageError(f"--lr must be a number > 0, got {lr}")
    if len(set(lrs)) != len(lrs):
        raise UsageError(f"--lr repeats a rate: {', '.join(f'{lr:g}' for lr in lrs)}")
    rates = tuple(float(lr) for lr in lrs)
    return dataclasses.replace(chosen, tasks=tuple(dataclasses.replace(task, lrs=rates) for task in chosen.tasks))


def with_tasks(chosen: Suite, names: Sequence[str]) -> Suite:
    """Return `chosen` with only the tasks `names` (in the suite's order); an unknown or repeated
    name, or none, is a UsageError listing the suite's tasks."""
    known = [task.name for task in chosen.tasks]
    if not names:
        raise UsageError(f"--tasks: give at least one of {', '.join(known)}")
    for name in names:
        if name not in known:
            raise unknown(f"task of suite {chosen.name}", name, known)
    if len(set(names)) != len(names):
        raise UsageError(f"--tasks repeats a task: {', '.join(names)}")
    return dataclasses.replace(chosen, tasks=tuple(task for task in chosen.tasks if task.name in names))


def with_steps(chosen: Suite, steps: int) -> Suite:
    """Return `chosen` with every task trained for `steps` optimizer steps instead of its steps or
    epochs (everything else, the training data included, stays the suite's); `steps` < 1 is a
    UsageError."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"--steps must be an integer >= 1, got {steps}")
    tasks = tuple(
        dataclasses.replace(task, train={**{k: v for k, v in task.train.items() if k != "epochs"}, "steps": steps})
        for task in chosen.tasks
    )
    return dataclasses.replace(chosen, tasks=tasks)
