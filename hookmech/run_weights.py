"""Where a run's weights are: its folder's ``model.safetensors``, or — for run records committed
without their weights (``results/``) — the bundled fixture that holds them (``hookmech.fixtures``).

A fixture is a run's when its ``model_hash`` is the one the run's summary.json records (runs
trained since the hash is kept there), or, for older records, when its config, task and final
training numbers (steps, dev accuracy, dev p(answer)) are the run's: a checkpoint records them at
its last step, so equal values mean the run's own final weights. Only checkpoint headers are
read, never tensors.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from .config import ModelConfig
from .errors import HookmechError
from .fileio import read_json

# .checkpoint and .demo are imported where used: they load torch, which this module does not

#: what a fixture's training summary must share with the run's summary.json (older records)
MATCHED_SUMMARY = ("status", "steps", "dev_acc", "dev_p_answer")


def run_weights(run_dir: str | Path, fixtures: str | Path | None = None) -> Path | None:
    """Return the checkpoint of the run in `run_dir`: its ``model.safetensors``, else the fixture
    holding its weights (`fixture_of`), else None."""
    run_dir = Path(run_dir)
    own = run_dir / "model.safetensors"
    if own.is_file():
        return own
    return fixture_of(run_dir, fixtures)


def fixture_of(run_dir: str | Path, fixtures: str | Path | None = None) -> Path | None:
    """Return the checkpoint in folder `fixtures` (default: the bundled fixtures) that holds the
    final weights of the run in `run_dir` (by ``model_hash``, or by config, task and final
    numbers for records without one), or None."""
    run_dir = Path(run_dir)
    summary = _read(run_dir / "summary.json")
    record = _read(run_dir / "run.json")
    if summary is None or summary.get("status") != "finished":
        return None
    wanted = summary.get("model_hash")
    from .demo import fixture_dir

    for path, metadata in _checkpoints(Path(fixtures) if fixtures is not None else fixture_dir()).items():
        if wanted is not None:
            if metadata["model_hash"] == wanted:
                return path
            continue
        if record is not None and _same_run(metadata, record, summary):
            return path
    return None


def _same_run(metadata: dict[str, Any], record: dict[str, Any], summary: dict[str, Any]) -> bool:
    """True when a fixture's header has the run's config, task and final training numbers."""
    fixture_summary = metadata.get("summary") or {}
    try:
        config = ModelConfig.from_json(_json(record.get("model_config")))
    except (HookmechError, TypeError, ValueError):
        return False
    return (
        config == metadata["config"]
        and record.get("task") == metadata.get("task")
        and all(fixture_summary.get(key) == summary.get(key) for key in MATCHED_SUMMARY)
    )


def _json(value: Any) -> str:
    return json.dumps(value)


def _read(path: Path) -> Any:
    try:
        return read_json(path) if path.is_file() else None
    except HookmechError:
        return None


@functools.cache
def _checkpoints(folder: Path) -> dict[Path, dict[str, Any]]:
    """``{path: header metadata}`` of every hookmech checkpoint in `folder` (read once)."""
    from .checkpoint import read_metadata

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            found[path] = read_metadata(path)
        except HookmechError:  # not a hookmech checkpoint: not a candidate
            continue
    return found
