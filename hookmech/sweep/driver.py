"""`run_sweep`: a whole sweep. It checks every run first, holds the runs folder's lock (one
sweep per folder), skips finished runs, hands the rest to an engine and keeps ``results.csv``
current as runs finish."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import HookmechError, UsageError, unknown
from ..fileio import write_text_atomic
from ..locking import folder_lock
from ..ray_session import check_ray_address, import_ray, ray_session
from .display import SweepDisplay
from .engines import ENGINES, default_threads, run_local, run_ray
from .grid import expand, validate
from .results import write_results
from .spec import Sweep
from .worker import collect_row, run_is_complete


def check_gpus_per_run(gpus_per_run: float, engine: str) -> None:
    """Raise a UsageError unless `gpus_per_run` is a number >= 0, and 0 unless `engine` is "ray"."""
    if not (math.isfinite(gpus_per_run) and gpus_per_run >= 0):
        raise UsageError(f"--gpus-per-run must be a number >= 0, got {gpus_per_run}")
    if gpus_per_run > 0 and engine != "ray":
        raise UsageError("--gpus-per-run needs --engine ray")


def _check_engine(engine: str, workers: int, threads: int | None, gpus_per_run: float, address: str | None) -> int:
    """Return the torch threads per worker (default: cores // workers); raise a UsageError for an
    unknown engine or a count out of range, and, for Ray, when it is absent or `address` does not
    answer (before anything is checked at length or written)."""
    if engine not in ENGINES:
        raise unknown("engine", engine, ENGINES)
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    check_gpus_per_run(gpus_per_run, engine)
    threads = default_threads(workers) if threads is None else threads
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    if engine == "ray":
        import_ray()
        check_ray_address(address)
    return threads


def run_sweep(
    sweep: Sweep,
    runs_dir: str | Path,
    *,
    engine: str = "local",
    workers: int = 1,
    threads: int | None = None,
    device: str = "cpu",
    address: str | None = None,
    gpus_per_run: float = 0.0,
    log: Callable[[str], None] | None = None,
    progress: bool | None = None,
) -> list[dict[str, Any]]:
    """Run every run of `sweep` not yet complete in `runs_dir` and write ``runs_dir/results.csv``.

    `workers` runs go in parallel, each pinned to `threads` torch threads (default: cores //
    workers). Returns the rows in grid order. Runs that fail with anything but a NaN loss get
    ``status = "error"``; the sweep then raises a HookmechError after writing the table.

    Every run is checked (`validate`) before anything is written; a bad option of any run raises
    then, naming the run; so does a Ray that is not installed, or an `address` where nothing
    answers. Raises `hookmech.locking.FolderLocked` if another process holds `runs_dir`.

    While runs train, `log` gets their progress (`display.SweepDisplay`): with `progress` None,
    bars when stderr is a terminal and plain lines otherwise; True bars, False lines. Every
    finished run gets a line with its own training time and the sweep's.
    """
    threads = _check_engine(engine, workers, threads, gpus_per_run, address)
    log = log or (lambda message: print(message, file=sys.stderr))
    runs = expand(sweep)
    validate(runs)
    runs_dir = Path(runs_dir)
    # one sweep at a time in a runs folder (its results.csv is rewritten as runs finish); each
    # worker then locks only its own run folder, so workers never wait for each other
    with folder_lock(runs_dir, "runs folder"):
        as_dicts = [run.as_dict() for run in runs]
        rows = {run["run_id"]: collect_row(run, runs_dir) for run in as_dicts if run_is_complete(run, runs_dir)}
        todo = [run for run in as_dicts if run["run_id"] not in rows]
        # Ray starts (or fails to, in one line) before the sweep writes or says anything
        session = ray_session(workers, threads, address) if engine == "ray" and todo else contextlib.nullcontext()
        with session as ray:
            write_text_atomic(runs_dir / "sweep.json", json.dumps(dataclasses.asdict(sweep), indent=1, sort_keys=True))
            log(
                f"sweep {sweep.name}: {len(runs)} runs, {len(runs) - len(todo)} already done, {len(todo)} to run "
                f"({engine}, {workers} workers x {threads} threads)"
            )
            display = SweepDisplay(sweep.name, len(runs), len(todo), log, tty=progress, workers=workers)

            def done(run: dict[str, Any], row: dict[str, Any]) -> None:
                rows[run["run_id"]] = row
                display.finished(run["run_id"], row)
                write_results([rows[r["run_id"]] for r in as_dicts if r["run_id"] in rows], runs_dir / "results.csv")

            try:
                if todo and engine == "local":
                    run_local(todo, str(runs_dir), workers, threads, device, done, display.update)
                elif todo:
                    run_ray(ray, todo, str(runs_dir), threads, device, done, gpus_per_run, display.update)
            finally:
                display.close()
            ordered = [rows[run["run_id"]] for run in as_dicts]
            write_results(ordered, runs_dir / "results.csv")
            failed = [row["run_id"] for row in ordered if row["status"] == "error"]
            if failed:
                raise HookmechError(
                    f"{len(failed)} of {len(runs)} runs failed ({', '.join(failed[:3])}"
                    f"{', …' if len(failed) > 3 else ''}); results.csv has the rest; rerun to retry"
                )
            return ordered
