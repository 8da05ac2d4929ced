"""``RUNS/results.csv``: one row per run, in grid order; its columns, writing and reading."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any

from ..errors import HookmechError
from ..fileio import atomic_path

#: results.csv columns before the grid-dependent ones
BASE_COLUMNS = ("run_id",)
RESULT_COLUMNS = ("status", "dev_acc", "dev_p_answer", "test_acc", "test_p_answer", "steps", "seconds")
MECH_COLUMNS = ("mech_n", "mech_p_clean", "mech_p_corrupt", "mech_passes")
#: columns that measure time and may differ between two executions of one sweep
TIMING_COLUMNS = ("seconds",)


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(value + 0.0)  # -0.0 -> 0.0
    if isinstance(value, (int, str)):
        return str(value)
    return json.dumps(value, sort_keys=True)


def result_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Return the results.csv header of `rows`: run_id, grid keys, results, mech columns
    (``attr:<site>@<pos>`` in first-appearance order), then ``error`` if any run failed."""
    seen: list[str] = []
    for row in rows:
        for key in row:
            if key not in seen:
                seen.append(key)
    fixed = set(BASE_COLUMNS) | set(RESULT_COLUMNS) | set(MECH_COLUMNS) | {"error"}
    grid = [k for k in seen if k not in fixed and not k.startswith("attr:")]
    optional = [k for k in ("test_acc", "test_p_answer") if any(row.get(k) is not None for row in rows)]
    results = [k for k in RESULT_COLUMNS if k not in ("test_acc", "test_p_answer") or k in optional]
    mech = [k for k in MECH_COLUMNS if k in seen] + [k for k in seen if k.startswith("attr:")]
    return [*BASE_COLUMNS, *grid, *results, *mech, *(["error"] if "error" in seen else [])]


def write_results(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Write `rows` as CSV (atomically); None becomes an empty cell, lists JSON."""
    columns = result_columns(rows)
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(columns)
            for row in rows:
                writer.writerow([_cell(row.get(column)) for column in columns])


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Read a results.csv; numbers become int/float, empty cells None, true/false bools."""
    path = Path(path)
    if not path.exists():
        raise HookmechError(f"{path} does not exist (run `hookmech sweep` first)")
    with open(path, newline="") as handle:
        return [{key: _parse_cell(value) for key, value in row.items()} for row in csv.DictReader(handle)]


def _parse_cell(text: str) -> Any:
    if text == "":
        return None
    if text in ("true", "false"):
        return text == "true"
    if not re.fullmatch(r"[-+0-9.eE]+", text):  # "nan" is a status, not a number
        return text
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
