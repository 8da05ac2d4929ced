"""`hookmech evaluate`: paper 000's mechanistic evaluation as one command for any mixer.

It trains a mixer (yours: ``module:Class``, ``path/file.py:Class``, an entry point; or a
built-in) on a suite's tasks over a small learning-rate grid, measures the interchange
attributions, and writes a report card: accuracy, the mechanism verdict with its numbers, the
learning-rate window and the reference architectures side by side. The package's files:

    suites.py      the suites (`suite`: quick, paper) and their tasks
    verdict.py     the mechanism verdict of a run's attributions, with its thresholds
    budget.py      `--budget-hours`: measured step times and the plan of runs that fit
    references.py  the bundled reference runs (references.json)
    card.py        card.json and card.md
    runner.py      `evaluate`: the whole evaluation, resumable
"""

from __future__ import annotations

from .card import build_card, card_markdown, write_card
from .runner import evaluate
from .suites import SUITE_NAMES, Suite, SuiteTask, suite
from .verdict import MECHANISMS, MIN_EFFECT, PRESENT, STRONG, verdict

__all__ = [
    "MECHANISMS",
    "MIN_EFFECT",
    "PRESENT",
    "STRONG",
    "SUITE_NAMES",
    "Suite",
    "SuiteTask",
    "build_card",
    "card_markdown",
    "evaluate",
    "suite",
    "verdict",
    "write_card",
]
