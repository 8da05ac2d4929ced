"""Paper-style reports of a sweep: PNG figures and a ``report.md`` that embeds them.

From ``RUNS/results.csv`` (and the run folders) `build_report` draws

- ``accuracy_vs_d_model.png`` — dev (and test, where the task has a split) accuracy at the best
  learning rate per (series, d_model), mean and min–max over seeds (paper 000 fig. 3a, 5a);
- ``lr_sensitivity.png`` — dev accuracy against the learning rate, one panel per series, one
  line per d_model, mean and min–max over seeds (paper 003 fig. 1);
- ``attribution_value_vs_query.png`` — every run passing the filter, attribution at the value
  (induction) against the query (direct retrieval in layer 0) (paper 000 fig. 3b);
- ``attribution_summary.png`` — mean attribution per position and series with 95% bootstrap
  intervals over runs (paper 000 fig. 4b, 6b);
- ``heatmap_<run-id>.png`` — site × position attributions of the best run of each series
  (`SELECTION_RULE`: highest dev accuracy; ties: smallest lr, then largest d_model);
- ``dynamics_<run-id>.png`` — loss, accuracy and attributions against the step, for selected
  runs trained with ``--mech-every`` (paper 003 §5).

A *series* is one value of the grid keys other than d_model, lr and seed (e.g. one arch).
File names depend only on the runs; figures are drawn with fixed seeds and no timestamps.
"""

from __future__ import annotations

import contextlib
import csv
import html
import io
import json
import math
import os
import shutil
import tempfile
import urllib.parse
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import HookmechError, UsageError, unknown
from .fileio import (
    TEMP_NAME,
    atomic_path,
    naming,
    read_json,
    sha256_of,
    temp_owner_gone,
    temp_prefix,
    write_text_atomic,
)
from .mech import evaluate_mechanism, mech_batch
from .run_weights import run_weights
from .seeds import EXAMPLES_SEED
from .sweep import read_results

# matplotlib, .tasks and .checkpoint are imported where used: reading and tabulating results loads neither
# matplotlib nor torch

SWEPT = ("d_model", "lr", "seed")
POSITIONS = ("key", "value", "query")
N_BOOTSTRAP = 1000


# -- reading a sweep folder ----------------------------------------------------------------
#: the columns every results.csv has (`sweep.result_columns`)
REQUIRED_COLUMNS = ("run_id", "status", "dev_acc")
#: columns whose cells are numbers or empty (with every ``attr:<site>@<pos>`` column)
NUMBER_COLUMNS: tuple[str, ...] = ("dev_acc", "dev_p_answer", "test_acc", "test_p_answer", "steps", "seconds")
NUMBER_COLUMNS += ("mech_n", "mech_p_clean", "mech_p_corrupt", "d_model", "lr", "seed")
#: columns whose numbers are accuracies or probabilities, in [0, 1]
UNIT_COLUMNS = ("dev_acc", "dev_p_answer", "test_acc", "test_p_answer", "mech_p_clean", "mech_p_corrupt")


def read_sweep_results(runs_dir: str | Path) -> list[dict[str, Any]]:
    """Return the rows of ``runs_dir/results.csv`` as `sweep.read_results` reads them, checked
    first, with each run_id as written (the folder ``007``, not the number 7).

    A HookmechError names the file, the line and the column of the first fault: text that is not
    UTF-8 or not CSV, a missing column (`REQUIRED_COLUMNS`), a row with more or fewer cells than
    the header, a run_id that is empty, repeated or not a plain folder name, a status that is not
    text, a cell
    of a number column (`NUMBER_COLUMNS`, ``attr:*``) that is not a finite number, an accuracy
    or probability outside [0, 1], a finished run without dev_acc, or no runs at all.

    results.csv has a d_model column only when the grid varies it; without one, each row gets
    its run's d_model from ``runs_dir/<run_id>/run.json`` (`runs_d_model`), so that a sweep of
    one width reports it.
    """
    path = Path(runs_dir) / "results.csv"
    if not path.is_file():
        raise HookmechError(f"{path} does not exist (run `hookmech sweep` first)")
    lines, run_ids = _checked_run_ids(path, _csv_table(path))
    rows = read_results(path)
    for line, row, run_id in zip(lines, rows, run_ids, strict=True):
        row["run_id"] = run_id
        _check_row(path, line, row)
    if "d_model" not in rows[0]:
        for row, d_model in zip(rows, runs_d_model(runs_dir, run_ids), strict=True):
            row["d_model"] = d_model
    return rows


def runs_d_model(runs_dir: str | Path, run_ids: Sequence[str]) -> list[int | None]:
    """Return the d_model of each run, ``model_config.d_model`` of ``runs_dir/<run_id>/run.json``,
    None for a run without a run.json (not started); a HookmechError naming a run.json that is
    not JSON or whose d_model is not a positive integer."""
    found: list[int | None] = []
    for run_id in run_ids:
        path = Path(runs_dir) / run_id / "run.json"
        if not path.is_file():
            found.append(None)
            continue
        run = read_json(path)
        config = run.get("model_config") if isinstance(run, dict) else None
        d_model = config.get("d_model") if isinstance(config, dict) else None
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise HookmechError(
                f"{path}: model_config.d_model {d_model!r} is not a positive integer; is it a run.json "
                "written by `hookmech train`?"
            )
        found.append(d_model)
    return found


def _csv_table(path: Path) -> list[tuple[int, list[str]]]:
    """Return (line number, cells) of each line of a CSV file, header first, blank lines left out;
    a HookmechError naming the file if it is not UTF-8 CSV."""
    try:
        reader = csv.reader(io.StringIO(path.read_bytes().decode("utf-8"), newline=""))
        table = [(reader.line_num, cells) for cells in reader if cells]
    except UnicodeDecodeError as error:
        line = error.object.count(b"\n", 0, error.start) + 1
        raise HookmechError(
            f"{path}: not a results table (line {line}: byte {error.object[error.start]:#04x} is not UTF-8 text)"
        ) from None
    except csv.Error as error:
        raise HookmechError(f"{path}: not a results table ({error})") from None
    if not table:
        raise HookmechError(f"{path} is empty: no header and no runs")
    return table


def _checked_run_ids(path: Path, table: list[tuple[int, list[str]]]) -> tuple[list[int], list[str]]:
    """Return the line numbers and the run_id cells of the rows of `table` (`_csv_table`), after
    checking its header, the number of cells of each row and the ids."""
    header = table[0][1]
    missing = [column for column in REQUIRED_COLUMNS if column not in header]
    if missing:
        raise HookmechError(
            f"{path} lacks the column {missing[0]} (its header: {', '.join(header)[:200]}); "
            "is it a results.csv written by `hookmech sweep`?"
        )
    rows = table[1:]
    if not rows:
        raise HookmechError(f"{path} has no runs")
    where = header.index("run_id")
    seen: set[str] = set()
    for line, cells in rows:
        if len(cells) != len(header):
            raise HookmechError(f"{path} line {line}: {len(cells)} cells, the header has {len(header)}")
        run_id = cells[where]
        if not run_id or run_id in (".", "..") or any(char in run_id for char in "/\\\0"):
            raise HookmechError(f"{path} line {line}: run_id {run_id!r} is not the name of a run folder")
        if run_id in seen:
            raise HookmechError(f"{path} line {line}: run_id {run_id!r} appears twice")
        seen.add(run_id)
    return [line for line, _ in rows], [cells[where] for _, cells in rows]


def _check_row(path: Path, line: int, row: dict[str, Any]) -> None:
    """Raise a HookmechError naming `path`, `line` and the column of the first bad cell of `row`."""
    where = f"{path} line {line} (run {row['run_id']})"
    if not isinstance(row["status"], str):
        raise HookmechError(f"{where}: status {row['status']!r} is not a run status (finished, nan, error, ...)")
    for column, value in row.items():
        if column not in NUMBER_COLUMNS and not column.startswith("attr:"):
            continue
        if value is not None and (isinstance(value, (bool, str)) or not math.isfinite(value)):
            raise HookmechError(f"{where}: {column} {value!r} is not a number")
        if column in UNIT_COLUMNS and value is not None and not 0 <= value <= 1:
            raise HookmechError(f"{where}: {column} {value!r} is outside [0, 1]")
    if row["status"] == "finished" and row["dev_acc"] is None:
        raise HookmechError(f"{where}: a finished run without dev_acc")
    if not isinstance(row.get("mech_passes"), (bool, type(None))):
        raise HookmechError(f"{where}: mech_passes {row['mech_passes']!r} is not true or false")


def read_sweep_json(runs_dir: str | Path) -> dict[str, Any] | None:
    """Return ``runs_dir/sweep.json`` (the sweep file `hookmech sweep` keeps), or None where there
    is none; a HookmechError naming it if it is not a JSON object whose ``grid`` is an object
    and whose ``name``, if any, is a string."""
    path = Path(runs_dir) / "sweep.json"
    if not path.exists():
        return None
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("grid"), dict):
        raise HookmechError(f"{path}: expected a JSON object with a grid object, as `hookmech sweep` writes")
    if not isinstance(data.get("name", ""), str):
        raise HookmechError(f"{path}: name {data['name']!r} is not a string")
    return data


def sweep_title(runs_dir: str | Path) -> str:
    """Return the sweep's name: sweep.json's ``name``, else the folder's name."""
    data = read_sweep_json(runs_dir)
    return data["name"] if data is not None and data.get("name") else Path(runs_dir).name


def grid_keys(runs_dir: Path, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Return the sweep's grid keys (from sweep.json, else the columns between run_id and status);
    a HookmechError when sweep.json names a key results.csv has no column for."""
    data = read_sweep_json(runs_dir)
    columns = list(rows[0]) if rows else []
    if data is None:
        return columns[1 : columns.index("status")] if "status" in columns else []
    keys = list(data["grid"])
    missing = [key for key in keys if key not in columns]
    if missing:
        raise HookmechError(
            f"{runs_dir}/results.csv has no column {missing[0]}, a grid key of {runs_dir}/sweep.json: "
            "are they of the same sweep?"
        )
    return keys


# -- tables --------------------------------------------------------------------------------
def series_of(row: dict[str, Any], keys: Sequence[str]) -> str:
    """Return a row's series label: the values of the non-swept grid keys ("all" if none)."""
    own = [key for key in keys if key not in SWEPT]
    if not own:
        return "all"
    if len(own) == 1:
        return str(row[own[0]])
    return ", ".join(f"{key}={row[key]}" for key in own)


def bootstrap_interval(
    values: Sequence[float], level: float = 0.95, n_boot: int = N_BOOTSTRAP, seed: int = 0
) -> tuple[float, float]:
    """Return the percentile bootstrap interval of the mean of `values` (fixed seed)."""
    data = np.asarray(values, dtype=float)
    if len(data) == 0:
        return (math.nan, math.nan)
    if len(data) == 1:
        return (float(data[0]), float(data[0]))
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, len(data), size=(n_boot, len(data)))].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def attribution_site(rows: Sequence[dict[str, Any]]) -> str | None:
    """Return the site whose key/value/query attributions the report shows: ``L1.block_in``
    when measured, else the first measured site; None without attribution columns."""
    sites = []
    for key in rows[0] if rows else []:
        if key.startswith("attr:"):
            site = key[5:].rsplit("@", 1)[0]
            if site not in sites:
                sites.append(site)
    if not sites:
        return None
    return "L1.block_in" if "L1.block_in" in sites else sites[0]


def summarise(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Return one headline row per (series, d_model): the best lr by mean dev accuracy over seeds,
    dev (and test) accuracy mean/sd/min/max at that lr, and mean attributions at key, value and
    query over its seeds that pass the filter."""
    site = attribution_site(rows)
    groups: dict[tuple, dict[Any, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["status"] == "finished":
            groups[(series_of(row, keys), row.get("d_model"))][row.get("lr")].append(row)
    table = []
    for (series, d_model), by_lr in groups.items():
        best_lr = max(by_lr, key=lambda lr: (np.mean([r["dev_acc"] for r in by_lr[lr]]), -(lr or 0)))
        chosen = by_lr[best_lr]
        dev = np.array([r["dev_acc"] for r in chosen])
        entry = {
            "series": series,
            "d_model": d_model,
            "lr": best_lr,
            "n_seeds": len(chosen),
            "dev_acc": dev.mean(),
            "dev_sd": dev.std(),
            "dev_min": dev.min(),
            "dev_max": dev.max(),
        }
        if any(r.get("test_acc") is not None for r in chosen):
            test = np.array([r["test_acc"] for r in chosen if r.get("test_acc") is not None])
            entry.update(test_acc=test.mean(), test_min=test.min(), test_max=test.max())
        if site is not None:
            passing = [r for r in chosen if r.get("mech_passes")]
            entry["n_pass"] = len(passing)
            for pos in POSITIONS:
                values = [r[f"attr:{site}@{pos}"] for r in passing if r.get(f"attr:{site}@{pos}") is not None]
                entry[f"attr_{pos}"] = float(np.mean(values)) if values else None
        table.append(entry)
    order = {s: i for i, s in enumerate(dict.fromkeys(series_of(r, keys) for r in rows))}
    return sorted(table, key=lambda e: (order[e["series"]], e["d_model"] if e["d_model"] is not None else 0))


# -- what the figures show (the PNGs here and `hookmech view` draw the same numbers) ----------
def lr_curves(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Return dev accuracy against the learning rate of the finished runs: one entry per
    (series, d_model) with runs, ``{"series", "d_model", "points"}``, each point ``{"lr", "mean",
    "min", "max", "n"}`` over seeds, lrs ascending; series in order of first appearance,
    d_model ascending. Runs without an lr (a results.csv without the column) have no curve."""
    finished = [r for r in rows if r["status"] == "finished" and r.get("lr") is not None]
    series = list(dict.fromkeys(series_of(r, keys) for r in finished))
    d_models = sorted({r.get("d_model") for r in finished}, key=lambda d: d or 0)
    curves = []
    for name in series:
        for d_model in d_models:
            by_lr: dict[float, list[float]] = defaultdict(list)
            for row in finished:
                if series_of(row, keys) == name and row.get("d_model") == d_model:
                    by_lr[row["lr"]].append(row["dev_acc"])
            if not by_lr:
                continue
            points = [
                {
                    "lr": lr,
                    "mean": float(np.mean(by_lr[lr])),
                    "min": min(by_lr[lr]),
                    "max": max(by_lr[lr]),
                    "n": len(by_lr[lr]),
                }
                for lr in sorted(by_lr)
            ]
            curves.append({"series": name, "d_model": d_model, "points": points})
    return curves


def value_query_points(rows: Sequence[dict[str, Any]], keys: Sequence[str], site: str) -> list[dict[str, Any]]:
    """Return one point per finished run passing the filter with attributions of `site` at the
    value and the query: ``{"series", "run_id", "d_model", "lr", "seed", "value", "query"}``."""
    return [
        {
            "series": series_of(r, keys),
            "run_id": r["run_id"],
            "d_model": r.get("d_model"),
            "lr": r.get("lr"),
            "seed": r.get("seed"),
            "value": r[f"attr:{site}@value"],
            "query": r[f"attr:{site}@query"],
        }
        for r in rows
        if r["status"] == "finished"
        and r.get("mech_passes")
        and r.get(f"attr:{site}@value") is not None
        and r.get(f"attr:{site}@query") is not None
    ]


def attribution_bars(rows: Sequence[dict[str, Any]], keys: Sequence[str], site: str) -> list[dict[str, Any]]:
    """Return per series (every series of `rows`, in order) ``{"series", "n", "positions"}``:
    ``n`` finished runs passing the filter, and per position of `POSITIONS` ``{"mean", "low",
    "high", "n"}``: the mean attribution of `site` over those runs and its 95% percentile
    bootstrap interval (`bootstrap_interval`); None (mean, low, high) where no run has one."""
    series = list(dict.fromkeys(series_of(r, keys) for r in rows))
    passing = [r for r in rows if r["status"] == "finished" and r.get("mech_passes")]
    bars = []
    for name in series:
        mine = [r for r in passing if series_of(r, keys) == name]
        positions = {}
        for pos in POSITIONS:
            values = [r[f"attr:{site}@{pos}"] for r in mine if r.get(f"attr:{site}@{pos}") is not None]
            low, high = bootstrap_interval(values)
            positions[pos] = {
                "mean": float(np.mean(values)) if values else None,
                "low": low if values else None,
                "high": high if values else None,
                "n": len(values),
            }
        bars.append({"series": name, "n": len(mine), "positions": positions})
    return bars


# -- figures -------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # text.parse_math off: titles hold the sweep's and runs' names, whose "$" is no formula
    plt.rcParams.update(
        {"figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3, "font.size": 9, "text.parse_math": False}
    )
    return plt


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", metadata={"Software": None}, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)


def _colors(series: Sequence[str]) -> dict[str, Any]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    return {name: cmap(index % 10) for index, name in enumerate(series)}


def plot_accuracy(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    """Dev (and test) accuracy vs d_model at the best lr per series, mean with min–max bars."""
    plt = _pyplot()
    series = list(dict.fromkeys(e["series"] for e in summary))
    colors = _colors(series)
    has_test = any("test_acc" in e for e in summary)
    fig, axes = plt.subplots(1, 2 if has_test else 1, figsize=(10 if has_test else 5.5, 4), squeeze=False, sharey=True)
    for ax, (key, label) in zip(
        axes[0], [("dev", "dev"), ("test", "test (held-out pairs)")], strict=False
    ):  # no test axis without test runs
        for name in series:
            points = [e for e in summary if e["series"] == name and f"{key}_acc" in e and e["d_model"] is not None]
            if not points:
                continue
            x = [e["d_model"] for e in points]
            y = np.array([e[f"{key}_acc"] for e in points])
            low, high = np.array([e[f"{key}_min"] for e in points]), np.array([e[f"{key}_max"] for e in points])
            ax.errorbar(x, y, yerr=[y - low, high - y], marker="o", capsize=3, label=name, color=colors[name])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_model")
        ax.set_ylabel(f"{label} accuracy at best lr")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{title}: {label} accuracy vs d_model")
        ax.legend(title="series", fontsize=8)
    _save(fig, path)


def plot_lr_sensitivity(rows: Sequence[dict[str, Any]], keys: Sequence[str], path: Path, title: str) -> None:
    """Dev accuracy vs lr, one panel per series, one line per d_model (mean, min–max band; `lr_curves`)."""
    plt = _pyplot()
    finished = [r for r in rows if r["status"] == "finished"]
    series = list(dict.fromkeys(series_of(r, keys) for r in finished))
    d_models = sorted({r.get("d_model") for r in finished}, key=lambda d: d or 0)
    curves = lr_curves(rows, keys)
    cmap = plt.get_cmap("viridis")
    n_cols = min(3, len(series))
    n_rows = math.ceil(len(series) / n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(4 * n_cols, 3.2 * n_rows), squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, series, strict=False):  # a grid may have spare axes
        for curve in curves:
            if curve["series"] != name:
                continue
            points = curve["points"]
            lrs = [p["lr"] for p in points]
            color = cmap(d_models.index(curve["d_model"]) / max(1, len(d_models) - 1))
            ax.plot(lrs, [p["mean"] for p in points], marker="o", color=color, label=f"d_model {curve['d_model']}")
            ax.fill_between(lrs, [p["min"] for p in points], [p["max"] for p in points], color=color, alpha=0.2)
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("learning rate")
        ax.set_ylabel("dev accuracy")
        ax.set_title(name)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(series) :]:
        ax.set_visible(False)
    fig.suptitle(f"{title}: learning-rate sensitivity (mean, min–max over seeds)")
    fig.tight_layout()
    _save(fig, path)


def plot_value_vs_query(rows: Sequence[dict[str, Any]], keys: Sequence[str], site: str, path: Path, title: str) -> None:
    """Scatter of attribution at the value (x) vs the query (y), one point per run passing the
    filter (`value_query_points`)."""
    plt = _pyplot()
    passing = value_query_points(rows, keys, site)
    series = list(dict.fromkeys(series_of(r, keys) for r in rows))
    colors = _colors(series)
    markers = "osD^v<>px*"
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for index, name in enumerate(series):
        points = [p for p in passing if p["series"] == name]
        ax.scatter(
            [p["value"] for p in points],
            [p["query"] for p in points],
            color=colors[name],
            marker=markers[index % len(markers)],
            alpha=0.8,
            label=f"{name} ({len(points)} runs)",
        )
    ax.plot([0, 1], [1, 0], color="grey", linestyle=":", linewidth=1)
    ax.set_xlim(-0.1, 1.1)
    ax.set_ylim(-0.1, 1.1)
    ax.set_xlabel(f"attribution at value ({site}) — induction")
    ax.set_ylabel(f"attribution at query ({site}) — direct retrieval (layer 0)")
    ax.set_title(f"{title}: value vs query, runs passing the filter")
    ax.legend(fontsize=7, loc="upper right")
    _save(fig, path)


def plot_attribution_summary(
    rows: Sequence[dict[str, Any]], keys: Sequence[str], site: str, path: Path, title: str
) -> None:
    """Grouped bars: mean attribution at key/value/query per series over passing runs, 95%
    bootstrap CI (`attribution_bars`)."""
    plt = _pyplot()
    bars = attribution_bars(rows, keys, site)
    series = [bar["series"] for bar in bars]
    width = 0.8 / len(POSITIONS)
    fig, ax = plt.subplots(figsize=(max(5.5, 1.2 * len(series)), 4))
    pos_colors = {"key": "tab:orange", "value": "tab:blue", "query": "tab:green"}
    for offset, pos in enumerate(POSITIONS):
        cells = [bar["positions"][pos] for bar in bars]
        means = [math.nan if c["mean"] is None else c["mean"] for c in cells]
        lows = [0 if c["mean"] is None else c["mean"] - c["low"] for c in cells]
        highs = [0 if c["mean"] is None else c["high"] - c["mean"] for c in cells]
        x = np.arange(len(series)) + (offset - 1) * width
        ax.bar(x, means, width, yerr=[lows, highs], capsize=2, label=pos, color=pos_colors[pos])
    ax.set_xticks(np.arange(len(series)), [f"{bar['series']}\n(n={bar['n']})" for bar in bars], fontsize=8)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel(f"attribution at {site}")
    ax.set_title(f"{title}: attribution by position (mean, 95% bootstrap CI over runs passing the filter)", fontsize=9)
    ax.legend(title="position")
    _save(fig, path)


def plot_heatmap(
    records: Sequence[dict[str, Any]], path: str | Path, title: str, *, rows: str = "site", columns: str = "pos"
) -> None:
    """Site (rows) × position (columns) attribution heatmap, values written in the cells, as a
    PNG at `path`. `rows` and `columns` name the record fields laid out (a path patch's
    ``"sender"`` and ``"receiver"``); an empty cell is a pair without a record or attribution."""
    plt = _pyplot()
    sites = list(dict.fromkeys(r[rows] for r in records))
    positions = list(dict.fromkeys(r[columns] for r in records))
    grid = np.full((len(sites), len(positions)), np.nan)
    for record in records:
        if record["attribution"] is not None:
            grid[sites.index(record[rows]), positions.index(record[columns])] = record["attribution"]
    fig, ax = plt.subplots(figsize=(1.2 * len(positions) + 2.5, 0.4 * len(sites) + 1.5))
    image = ax.imshow(grid, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        if not np.isnan(value):
            ax.text(
                j,
                i,
                f"{value:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if abs(value) > 0.6 else "black",
            )
    ax.set_xticks(range(len(positions)), positions, rotation=90 if columns != "pos" else 0)
    ax.set_yticks(range(len(sites)), sites)
    ax.set_xlabel("patched position" if columns == "pos" else columns)
    ax.set_ylabel("patched site" if rows == "site" else rows)
    ax.grid(False)
    fig.colorbar(image, ax=ax, label="attribution")
    ax.set_title(title, fontsize=9)
    _save(fig, Path(path))


def plot_dynamics(metrics: Sequence[dict[str, Any]], path: Path, title: str) -> bool:
    """Loss, dev accuracy and attributions against the training step; False (no file) when the
    metrics hold no attributions."""
    steps_attr = [m for m in metrics if any(k.startswith("attr:") for k in m)]
    if not steps_attr:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(6.5, 7), sharex=True)
    axes[0].plot(*_curve(metrics, "loss"), color="black", label="train loss")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("train loss")
    axes[1].plot(*_curve(metrics, "dev_acc"), color="tab:red", label="dev accuracy")
    axes[1].plot(*_curve(metrics, "dev_p_answer"), color="tab:purple", linestyle="--", label="dev p(answer)")
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].set_ylabel("dev accuracy")
    keys = list(dict.fromkeys(k for m in steps_attr for k in m if k.startswith("attr:")))
    for key in keys:
        axes[2].plot(*_curve(steps_attr, key), marker=".", label=key[5:])
    axes[2].set_ylabel("attribution")
    axes[2].set_xlabel("training step")
    for ax in axes:
        ax.legend(fontsize=7)
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)
    return True


def _curve(metrics: Sequence[dict[str, Any]], field: str) -> tuple[list[int], list[float]]:
    """Return (steps, values) of the metrics lines that hold a number in `field`."""
    points = [(m["step"], m[field]) for m in metrics if isinstance(m.get(field), (int, float))]
    return [step for step, _ in points], [value for _, value in points]


# -- the report ----------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-2 and value != 0 else f"{value:.{digits}f}"
    return str(value)


def headline_table(summary: Sequence[dict[str, Any]]) -> str:
    """Return the markdown headline table: accuracy and value/query/key attribution per series and d_model."""
    has_test = any("test_acc" in e for e in summary)
    has_attr = any("n_pass" in e for e in summary)
    header = ["series", "d_model", "best lr", "dev acc (mean ± sd)"]
    header += ["test acc"] if has_test else []
    header += ["attr value", "attr query", "attr key", "pass filter"] if has_attr else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for e in summary:
        cells = [
            _md(e["series"]),
            _fmt(e["d_model"]),
            _fmt(e["lr"]),
            f"{e['dev_acc']:.3f} ± {e['dev_sd']:.3f} (n={e['n_seeds']})",
        ]
        cells += [_fmt(e.get("test_acc"))] if has_test else []
        if has_attr:
            cells += [
                _fmt(e.get("attr_value")),
                _fmt(e.get("attr_query")),
                _fmt(e.get("attr_key")),
                f"{e.get('n_pass', 0)}/{e['n_seeds']}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: how `select_runs` picks the best run of a series (also said in report.md)
SELECTION_RULE = "highest dev accuracy; ties: smallest lr, then largest d_model, then first in results.csv"


def select_runs(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Return the best finished run of each series, in order of each series' first row: highest
    dev accuracy; ties go to the smallest lr, then the largest d_model, then the first in `rows`
    (`SELECTION_RULE`)."""
    best: dict[str, tuple[tuple, dict[str, Any]]] = {}
    for row in rows:
        if row["status"] != "finished":
            continue
        name = series_of(row, keys)
        rank = (row["dev_acc"], -(row.get("lr") or 0), row.get("d_model") or 0)
        if name not in best or rank > best[name][0]:
            best[name] = (rank, row)
    return [entry[1] for entry in best.values()]


def heatmap_records(run_dir: Path, n: int, seed: int) -> list[dict[str, Any]]:
    """Return the records of every block-level site patched at every role of the run's task on `n`
    examples drawn with `seed` (`mech.mech_batch`), from the run's weights (`run_weights.run_weights`:
    the folder's model.safetensors or the bundled fixture that holds them). Nothing is written
    (`hookmech report` keeps them in its own folder: `_report_heatmap`)."""
    from . import tasks
    from .checkpoint import load

    checkpoint = run_weights(run_dir)
    if checkpoint is None:
        raise HookmechError(f"{run_dir}: no weights ({no_heatmap_reason(run_dir, {'status': 'finished'})})")
    model, task = load(checkpoint), tasks.from_checkpoint(checkpoint)
    batch = mech_batch(task, seed, n)
    positions = [role for role in ("key", "value", "query", "divider") if role in batch.roles]
    records, _ = evaluate_mechanism(model, batch, ["all"], positions)
    return records


def no_heatmap_reason(run_dir: Path, row: dict[str, Any]) -> str | None:
    """Return why the run of `row` (in `run_dir`) can have no heatmap, a phrase for "no heatmap
    for RUN: ...", or None when it can have one (a finished run with its model file)."""
    if not run_dir.is_dir():
        return f"results.csv names it but {run_dir} does not exist"
    if row["status"] != "finished":
        return f"its status is {row['status']}, not finished"

    if run_weights(run_dir) is None:
        return (
            f"{run_dir / 'model.safetensors'} does not exist and no bundled fixture holds this run's weights "
            "(retrain it, or view its checkpoint with hookmech view --ckpt FILE)"
        )
    return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Return the lines of a run's metrics.jsonl as dicts ([] when the file does not exist); a
    HookmechError naming the file and line where a line is not a JSON object with an integer step."""
    if not path.exists():
        return []
    lines = []
    for number, text in enumerate(path.read_bytes().decode("utf-8", errors="replace").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as error:
            raise HookmechError(f"{path} line {number}: not valid JSON ({error.msg}); fix or delete the line") from None
        if not isinstance(line, dict) or isinstance(line.get("step"), bool) or not isinstance(line.get("step"), int):
            raise HookmechError(f"{path} line {number}: expected a JSON object with an integer step")
        lines.append(line)
    return lines


def build_report(
    runs_dir: str | Path,
    out_dir: str | Path,
    *,
    runs: Sequence[str] | None = None,
    n: int = 320,
    seed: int = EXAMPLES_SEED,
    heatmaps: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write the figures and ``report.md`` of the sweep in `runs_dir` into `out_dir`; return the
    report's path. `runs` names the runs that get a heatmap and a dynamics figure (default: the
    best run of each series); heatmaps patch `n` examples drawn with `seed`. A selected run that
    can have no heatmap (`no_heatmap_reason`) is named in `log` and in report.md.

    Nothing is written into `runs_dir`. Every input is checked before anything is drawn
    (`read_sweep_results`). The report is built in a temporary folder beside `out_dir` and
    renamed onto it when complete, so `out_dir` holds a whole report or is left as it was; an
    existing `out_dir` is replaced only if it is empty or a report folder (`REPORT_FILES`), else
    a UsageError names what it holds. The temporary folders of killed earlier reports into
    `out_dir` are removed first (`_remove_stale_report_folders`). Each heatmap's records are kept
    beside its PNG (``heatmap_<run>.json``) and reused by the next report into `out_dir` when
    they are of the same model file, `n` and `seed`.
    """
    runs_dir, out_dir = Path(runs_dir), Path(out_dir)
    log = log or (lambda message: None)
    if n < 1:
        raise UsageError(f"n must be >= 1 examples per heatmap, got {n}")
    rows = read_sweep_results(runs_dir)
    by_id = {row["run_id"]: row for row in rows}
    missing = [r for r in runs or () if r not in by_id]
    if missing:
        raise unknown("run", missing[0], by_id)
    _check_report_folder(out_dir)
    earlier = out_dir if out_dir.is_dir() else None
    with _fresh_folder(out_dir) as building:
        report = _Report(runs_dir, building, earlier, n, seed, log)
        report.write(rows, runs=runs, heatmaps=heatmaps)
    return out_dir / "report.md"


#: what a report folder holds (`_check_report_folder` replaces nothing else)
REPORT_FILES = ("report.md", "*.png", "heatmap_*.json")


def _check_report_folder(out_dir: Path) -> None:
    """Raise a UsageError unless `out_dir` is missing, empty or a report folder."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise UsageError(f"-o {out_dir} is not a folder; give a report folder")
    if not out_dir.exists():
        return
    others = sorted(
        entry.name
        for entry in out_dir.iterdir()
        if not (entry.is_file() and not entry.is_symlink() and any(entry.match(pattern) for pattern in REPORT_FILES))
    )
    if others:
        raise UsageError(
            f"-o {out_dir} exists and is not a report folder (it holds {others[0]}"
            f"{f' and {len(others) - 1} more' if len(others) > 1 else ''}); "
            "give a new folder or an earlier report's"
        )


@contextlib.contextmanager
def _fresh_folder(path: Path) -> Iterator[Path]:
    """Yield a new empty folder beside `path`; when the block succeeds, rename it onto `path`
    (replacing the folder there), else remove it and leave `path` as it was.

    The folder is ``.<name>.<pid>@<host>.<random>.tmp`` (`fileio.TEMP_NAME`), and the earlier
    `path`, for the moment between the two renames, ``... .old``: so that the next call can tell
    a killed report's folders from a running one's (`_remove_stale_report_folders`)."""
    path = Path(os.path.abspath(path))
    with naming(path):  # a read-only folder: name the -o folder, not the one being built
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_report_folders(path)
        building = Path(tempfile.mkdtemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent))
    try:
        os.chmod(building, 0o777 & ~_umask())  # mkdtemp makes 0700; give what mkdir would
        yield building
        if path.exists():
            with naming(path):
                old = Path(tempfile.mkdtemp(prefix=temp_prefix(path), suffix=".old", dir=path.parent))
            os.replace(path, old)  # onto the empty folder just made
            try:
                os.replace(building, path)
            except BaseException:
                os.replace(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(building, path)
    finally:
        if building.exists():
            shutil.rmtree(building, ignore_errors=True)


def _remove_stale_report_folders(path: Path) -> list[Path]:
    """Remove the folders `_fresh_folder` made beside `path` in processes of this host that are
    no longer running (a report killed while building); return them.

    Only folders named for `path` in `_fresh_folder`'s pattern are touched, never a live
    process's. A killed report's ``.tmp`` is removed; its ``.old`` (the earlier report) is
    removed when `path` exists, else renamed back onto `path` (killed between the two renames).
    """
    removed = []
    for entry in sorted(path.parent.iterdir()):
        stem, _, suffix = entry.name.rpartition(".")
        match = TEMP_NAME.match(f"{stem}.tmp")
        if suffix not in ("tmp", "old") or match is None or match["name"] != path.name:
            continue
        if entry.is_symlink() or not entry.is_dir() or not temp_owner_gone(entry.name):
            continue
        if suffix == "old" and not path.exists():
            os.replace(entry, path)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _md(text: Any) -> str:
    """Return `text` for report.md's prose and tables: markup characters as entities, so that a
    name holding ``<!--`` or ``|`` shows as written instead of hiding or splitting what follows."""
    escaped = html.escape(str(text), quote=False)
    return escaped.replace("|", "\\|").replace("[", "\\[").replace("]", "\\]")


def _md_image(alt: str, name: str) -> str:
    """Return report.md's image line of the file `name` in the report folder."""
    return f"![{_md(alt)}]({urllib.parse.quote(name)})"


class _Report:
    """One report being written into `out_dir` (`build_report`): the sweep's tables, figures and
    report.md; heatmap records reused from the `earlier` report folder where they match."""

    def __init__(
        self, runs_dir: Path, out_dir: Path, earlier: Path | None, n: int, seed: int, log: Callable[[str], None]
    ):
        self.runs_dir, self.out_dir, self.earlier = runs_dir, out_dir, earlier
        self.n, self.seed, self.log = n, seed, log
        self.title = sweep_title(runs_dir)

    def write(self, rows: list[dict[str, Any]], *, runs: Sequence[str] | None, heatmaps: bool) -> None:
        """Draw the figures and write report.md of `rows` into the existing folder `out_dir`."""
        keys = grid_keys(self.runs_dir, rows)
        counts: defaultdict[str, int] = defaultdict(int)
        for row in rows:
            counts[row["status"]] += 1
        statuses = ", ".join(f"{count} {_md(status)}" for status, count in sorted(counts.items()))
        lines = [
            f"# Report: {_md(self.title)}",
            "",
            f"{len(rows)} runs in {_md(self.runs_dir)} ({statuses}). "
            f"Series: {', '.join(_md(k) for k in keys if k not in SWEPT) or '—'}; swept: "
            f"{', '.join(k for k in keys if k in SWEPT) or '—'}. Best lr per (series, d_model) by mean dev accuracy.",
            "",
        ]
        summary = summarise(rows, keys)
        if summary:
            lines += self._headline(rows, keys, summary)
        site = attribution_site(rows)
        if site is not None and summary:
            lines += self._mechanisms(rows, keys, site)
        selected = [{row["run_id"]: row for row in rows}[r] for r in runs] if runs else select_runs(rows, keys)
        detail = [line for row in selected for line in self._selected_run(row, keys, heatmaps)]
        if detail:
            chosen = "the runs given" if runs else f"the best run of each series ({SELECTION_RULE})"
            lines += [
                "## Selected runs",
                "",
                f"Runs: {chosen}. Heatmaps: every block-level site × role, one patch each. "
                "Dynamics: runs trained with `--mech-every` (or `[mech] every`).",
                "",
                *detail,
            ]
        write_text_atomic(self.out_dir / "report.md", "\n".join(lines).rstrip() + "\n")

    def _headline(self, rows: list[dict[str, Any]], keys: list[str], summary: list[dict[str, Any]]) -> list[str]:
        """Return report.md's headline and accuracy sections; draw the accuracy figures."""
        lines = ["## Headline", "", headline_table(summary), ""]
        site = attribution_site(rows)
        if site is not None:
            lines += [
                f"Attributions: `{site}` at each position, mean over the best-lr seeds that pass the filter "
                "(p_clean − p_corrupt > threshold); value = induction, query = direct retrieval in layer 0, "
                "key = in layer 1 (paper 000 §5.1).",
                "",
            ]
        figures = []
        if any(entry["d_model"] is not None for entry in summary):
            plot_accuracy(summary, self.out_dir / "accuracy_vs_d_model.png", self.title)
            figures += [_md_image("accuracy vs d_model", "accuracy_vs_d_model.png"), ""]
        else:
            figures += ["No accuracy-vs-d_model figure: neither results.csv nor the runs' run.json give a d_model.", ""]
        if lr_curves(rows, keys):
            plot_lr_sensitivity(rows, keys, self.out_dir / "lr_sensitivity.png", self.title)
            figures += [_md_image("learning-rate sensitivity", "lr_sensitivity.png"), ""]
        else:
            figures += ["No learning-rate figure: results.csv has no lr.", ""]
        return lines + ["## Accuracy", "", *figures]

    def _mechanisms(self, rows: list[dict[str, Any]], keys: list[str], site: str) -> list[str]:
        """Return report.md's mechanism section; draw its figures."""
        plot_value_vs_query(rows, keys, site, self.out_dir / "attribution_value_vs_query.png", self.title)
        plot_attribution_summary(rows, keys, site, self.out_dir / "attribution_summary.png", self.title)
        return [
            "## Mechanisms",
            "",
            _md_image("value vs query", "attribution_value_vs_query.png"),
            "",
            _md_image("attribution summary", "attribution_summary.png"),
            "",
        ]

    def _selected_run(self, row: dict[str, Any], keys: list[str], heatmaps: bool) -> list[str]:
        """Return report.md's lines of one selected run (its heatmap, its dynamics, or why it has
        no heatmap); draw its figures."""
        run_id, run_dir = row["run_id"], self.runs_dir / row["run_id"]
        label = f"{series_of(row, keys)}, d_model {row.get('d_model')}, lr {row.get('lr')}, seed {row.get('seed')}"
        lines = []
        reason = no_heatmap_reason(run_dir, row) if heatmaps else None
        if reason is not None:
            self.log(f"no heatmap for {run_id}: {reason}")
            lines += [f"No heatmap for {_md(run_id)}: {_md(reason)}.", ""]
        elif heatmaps:
            self.log(f"heatmap {run_id}")
            name = f"heatmap_{run_id}.png"
            plot_heatmap(
                self._heatmap(run_dir, run_id),
                self.out_dir / name,
                f"{self.title}: {label} (dev acc {row['dev_acc']:.3f})\n"
                f"attribution per site × position, {self.n} examples",
            )
            lines += [_md_image(f"heatmap {run_id}", name), ""]
        name = f"dynamics_{run_id}.png"
        metrics = read_metrics(run_dir / "metrics.jsonl")
        if plot_dynamics(metrics, self.out_dir / name, f"{self.title}: {label}: training dynamics"):
            lines += [_md_image(f"dynamics {run_id}", name), ""]
        return lines

    def _heatmap(self, run_dir: Path, run_id: str) -> list[dict[str, Any]]:
        """Return the heatmap records of a run (`heatmap_records`): the earlier report's
        ``heatmap_<run>.json`` when it is of the same model file, n and seed, else computed;
        kept as ``heatmap_<run>.json`` in this report."""
        weights = run_weights(run_dir)  # no_heatmap_reason has checked that it has some
        assert weights is not None
        key = {"n": self.n, "seed": self.seed, "model_sha256": sha256_of(weights)}
        name = f"heatmap_{run_id}.json"
        records = None
        if self.earlier is not None and (self.earlier / name).is_file():
            data = read_json(self.earlier / name)
            if isinstance(data, dict) and {field: data.get(field) for field in key} == key:
                records = data.get("records")
            if records is not None and not isinstance(records, list):
                raise HookmechError(f"{self.earlier / name}: records is not a list; delete the file")
        if records is None:
            records = heatmap_records(run_dir, self.n, self.seed)
        write_text_atomic(self.out_dir / name, json.dumps({**key, "records": records}, sort_keys=True))
        return records
