"""Sweeps: a grid of runs, each a normal resumable `train` into ``RUNS/<run-id>``.

A sweep file (TOML, `spec`) names a task, trainer and model options and a [grid] whose product
is the runs (`grid.expand`). Run ids are a pure function of the grid values, so a re-run of the
same sweep finds its folders: finished runs (``summary.json``) are skipped and broken ones
resume from their last checkpoint. ``RUNS/results.csv`` has one row per run, in grid order
(`results`).

Every option of every run ([mech] sites and positions included) is checked before the first run
trains (`grid.validate`). The sweep holds ``RUNS/.lock`` while it runs (one sweep per runs
folder, `driver.run_sweep`) and each worker holds its run folder's lock while it trains and
evaluates (`worker.execute_run`, `hookmech.locking`). The package's files:

    spec.py      the sweep file format: `Sweep`, `parse_sweep`, `load_sweep`
    grid.py      `Run`, `expand`, `run_id`, `build_run`, `validate`
    worker.py    one run: `execute_run`, `run_is_complete`, `collect_row`
    engines.py   the local and Ray engines that run many runs
    driver.py    `run_sweep`: a whole sweep, locked, resumable
    results.py   results.csv: `result_columns`, `write_results`, `read_results`
    presets.py   the papers' sweeps as TOML text: `PRESETS`, `preset_text`, `load_preset`
"""

from __future__ import annotations

from .driver import run_sweep
from .engines import ENGINES, default_threads
from .grid import Run, build_run, expand, run_id, validate
from .presets import PRESETS, load_preset, preset_text
from .results import (
    BASE_COLUMNS,
    MECH_COLUMNS,
    RESULT_COLUMNS,
    TIMING_COLUMNS,
    read_results,
    result_columns,
    write_results,
)
from .spec import MECH_DEFAULTS, MODEL_DEFAULTS, MODEL_KEYS, Sweep, load_sweep, parse_sweep
from .worker import collect_row, execute_run, run_is_complete

__all__ = [
    "BASE_COLUMNS",
    "ENGINES",
    "MECH_COLUMNS",
    "MECH_DEFAULTS",
    "MODEL_DEFAULTS",
    "MODEL_KEYS",
    "PRESETS",
    "RESULT_COLUMNS",
    "TIMING_COLUMNS",
    "Run",
    "Sweep",
    "build_run",
    "collect_row",
    "default_threads",
    "execute_run",
    "expand",
    "load_preset",
    "load_sweep",
    "parse_sweep",
    "preset_text",
    "read_results",
    "result_columns",
    "run_id",
    "run_is_complete",
    "run_sweep",
    "validate",
    "write_results",
]
