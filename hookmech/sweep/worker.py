"""One run of a sweep, as a worker process does it: train into ``RUNS/<run-id>`` (skipping a
finished run, resuming a broken one), then the test-split accuracy and the end-of-run
attributions, then its results row. The worker holds its run folder's lock meanwhile
(`hookmech.locking`), so two workers never write one folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import HookmechError
from ..fileio import read_json, write_text_atomic
from ..locking import folder_lock
from ..mech import evaluate_mechanism, mech_batch, mech_callback
from ..progress import RunProgress
from .grid import build_run, needs_test_split, training_data
from .results import RESULT_COLUMNS

# torch, the tasks, training and checkpoints are imported where used: this module loads without torch


def _read_json(path: Path) -> Any:
    return read_json(path) if path.exists() else None


def run_is_complete(run: dict[str, Any], runs_dir: str | Path) -> bool:
    """True when the run's folder holds everything its results row needs."""
    out = Path(runs_dir) / run["run_id"]
    summary = _read_json(out / "summary.json")
    if summary is None:
        return False
    if summary.get("status") != "finished":
        return True
    mech = _read_json(out / "mech.json")
    if run["mech"] is not None and (mech is None or mech.get("config") != run["mech"]):
        return False
    return not needs_test_split(run["task"]) or (out / "test.json").exists()


def execute_run(
    run: dict[str, Any],
    runs_dir: str,
    threads: int | None = None,
    device: str = "cpu",
    quiet: bool = True,
    progress: Callable[[RunProgress], Any] | None = None,
) -> dict[str, Any]:
    """Train one run into ``runs_dir/<run_id>`` (skip/resume as its folder says), then add the
    test-split accuracy and the end-of-run attributions; return its results row.

    `progress` gets the run's `RunProgress` events as it trains (the sweep's driver draws them;
    None: nothing is shown). A run stopped by a NaN loss returns its row with ``status = "nan"``.
    """
    import torch

    from ..training import train

    if threads is not None:
        torch.set_num_threads(threads)
    task, model_config, train_config = build_run(run)
    out = Path(runs_dir) / run["run_id"]
    mech_config = run["mech"]
    on_eval = None
    if mech_config is not None and mech_config.get("every"):
        on_eval = mech_callback(
            task,
            model_config,
            sites=mech_config["sites"],
            positions=mech_config["positions"],
            every=mech_config["every"],
            eval_every=train_config.eval_every,
            total_steps=train_config.total_steps(),
            n=mech_config["n"],
            seed=mech_config["seed"],
            threshold=mech_config["threshold"],
            device=device,
        )
    log = (lambda message: None) if quiet else None
    train_set, train_set_sha256 = training_data(run, task, train_config)
    with folder_lock(out, "run folder"):  # training, test.json and mech.json: one process at a time
        try:
            summary = train(
                task,
                model_config,
                train_config,
                out,
                device=device,
                progress=False if progress is None else progress,
                on_eval=on_eval,
                log=log,
                train_set=train_set,
                train_set_sha256=train_set_sha256,
            )
        except HookmechError:
            summary = _read_json(out / "summary.json")
            if summary is None or summary.get("status") != "nan":
                raise
        if summary.get("status") == "finished":
            _finish_run(run, out, task, train_config, device, model_config.mixers)
    return collect_row(run, runs_dir)


def _finish_run(run: dict[str, Any], out: Path, task, train_config, device: str, mixers: tuple[str, ...]) -> None:
    """Write test.json (test-split accuracy) and mech.json (end-of-run attributions) if missing.
    The run's model is loaded back allowing its own `mixers` (the sweep file names them)."""
    from ..checkpoint import load

    model = None
    if needs_test_split(run["task"]) and not (out / "test.json").exists():
        from .. import tasks
        from ..training import evaluate

        model = load(out / "model.safetensors", device=device, allow_mixers=mixers)
        test_task = tasks.from_spec({**run["task"], "split": "test"})
        scores = evaluate(model, test_task.sample(train_config.n_dev, seed=(train_config.seed, 1)))
        write_text_atomic(
            out / "test.json",
            json.dumps({"test_acc": scores["dev_acc"], "test_p_answer": scores["dev_p_answer"]}, indent=1),
        )
    mech_config = run["mech"]
    if mech_config is not None:
        existing = _read_json(out / "mech.json")
        if existing is None or existing.get("config") != mech_config:
            model = model or load(out / "model.safetensors", device=device, allow_mixers=mixers)
            batch = mech_batch(task, mech_config["seed"], mech_config["n"])
            records, columns = evaluate_mechanism(
                model, batch, mech_config["sites"], mech_config["positions"], threshold=mech_config["threshold"]
            )
            write_text_atomic(
                out / "mech.json", json.dumps({"config": mech_config, "columns": columns, "records": records}, indent=1)
            )


def collect_row(run: dict[str, Any], runs_dir: str | Path) -> dict[str, Any]:
    """Return the results row of a run from its folder (``status = "missing"`` if never trained)."""
    out = Path(runs_dir) / run["run_id"]
    row: dict[str, Any] = {"run_id": run["run_id"], **run["point"]}
    summary = _read_json(out / "summary.json") or {"status": "missing"}
    for key in RESULT_COLUMNS:
        row[key] = summary.get(key)
    row.update(_read_json(out / "test.json") or {})
    mech = _read_json(out / "mech.json")
    if mech is not None and summary.get("status") == "finished":
        row.update(mech["columns"])
    return row
