"""The reference architectures of the report card: hookmech's own runs of paper 000's six
architectures on each suite's tasks, bundled as ``references.json`` (package data).

The file is built from committed run records by ``scripts/evaluate_references.py`` (a test
rebuilds it and compares): the quick suite's from ``results/evaluate/quick-<arch>/`` (each an
evaluation of a built-in model preset), the paper suite's AR and ATR from the runs of
docs/results.md's d_model-64 tables (sections 5.1 and 5.2), with the paper's best number beside
each. An entry holds what the card
shows: ``label``, ``lr``, ``dev_acc``, ``paper_acc`` (None where the paper has none), the
attribution ``columns`` its verdict is computed from, and ``record`` (its folder in the
repository). ``pending`` lists, per suite and task, the architectures the paper reports whose
run has not finished yet (``label``, ``paper_acc``), so that a card says what it lacks.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Any

from ..errors import HookmechError

FILE = "references.json"


def references() -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Return ``{suite: {task: [entry, …]}}`` from the bundled ``references.json``."""
    return _bundled()["suites"]


def pending_references() -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Return ``{suite: {task: [{label, paper_acc}, …]}}``: the paper's architectures without a
    finished bundled run."""
    return _bundled().get("pending", {})


@functools.cache
def _bundled() -> dict[str, Any]:
    try:
        text = importlib.resources.files("hookmech.evaluate").joinpath(FILE).read_text()
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("suites"), dict):
            raise ValueError("no 'suites' object")
        return data
    except (OSError, ValueError) as error:
        raise HookmechError(
            f"the bundled {FILE} of hookmech.evaluate is unreadable ({error}); reinstall hookmech"
        ) from None
