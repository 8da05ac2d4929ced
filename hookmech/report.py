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
import json
import math
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import HookmechError, UsageError, unknown
from .fileio import atomic_path, write_text_atomic

SWEPT = ("d_model", "lr", "seed")
POSITIONS = ("key", "value", "query")
N_BOOTSTRAP = 1000


# -- tables --------------------------------------------------------------------------------
def grid_keys(runs_dir: Path, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Return the sweep's grid keys (from sweep.json, else the columns between run_id and status)."""
    sweep_file = runs_dir / "sweep.json"
    if sweep_file.exists():
        return list(json.loads(sweep_file.read_text())["grid"])
    columns = list(rows[0]) if rows else []
    return columns[1 : columns.index("status")] if "status" in columns else []


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
    d_model ascending."""
    finished = [r for r in rows if r["status"] == "finished"]
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

    plt.rcParams.update({"figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3, "font.size": 9})
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
            points = [e for e in summary if e["series"] == name and f"{key}_acc" in e]
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


def plot_heatmap(records: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Site (rows) × position (columns) attribution heatmap, values written in the cells."""
    plt = _pyplot()
    sites = list(dict.fromkeys(r["site"] for r in records))
    positions = list(dict.fromkeys(r["pos"] for r in records))
    grid = np.full((len(sites), len(positions)), np.nan)
    for record in records:
        if record["attribution"] is not None:
            grid[sites.index(record["site"]), positions.index(record["pos"])] = record["attribution"]
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
    ax.set_xticks(range(len(positions)), positions)
    ax.set_yticks(range(len(sites)), sites)
    ax.set_xlabel("patched position")
    ax.set_ylabel("patched site")
    ax.grid(False)
    fig.colorbar(image, ax=ax, label="attribution")
    ax.set_title(title, fontsize=9)
    _save(fig, path)


def plot_dynamics(metrics: Sequence[dict[str, Any]], path: Path, title: str) -> bool:
    """Loss, dev accuracy and attributions against the training step; False (no file) when the
    metrics hold no attributions."""
    steps_attr = [m for m in metrics if any(k.startswith("attr:") for k in m)]
    if not steps_attr:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(6.5, 7), sharex=True)
    steps = [m["step"] for m in metrics]
    axes[0].plot(steps, [m["loss"] for m in metrics], color="black", label="train loss")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("train loss")
    axes[1].plot(steps, [m["dev_acc"] for m in metrics], color="tab:red", label="dev accuracy")
    axes[1].plot(steps, [m["dev_p_answer"] for m in metrics], color="tab:purple", linestyle="--", label="dev p(answer)")
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].set_ylabel("dev accuracy")
    keys = list(dict.fromkeys(k for m in steps_attr for k in m if k.startswith("attr:")))
    for key in keys:
        points = [(m["step"], m[key]) for m in steps_attr if m.get(key) is not None]
        axes[2].plot([p[0] for p in points], [p[1] for p in points], marker=".", label=key[5:])
    axes[2].set_ylabel("attribution")
    axes[2].set_xlabel("training step")
    for ax in axes:
        ax.legend(fontsize=7)
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)
    return True


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
            e["series"],
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
    examples drawn with `seed` (`mech.mech_batch`), kept in the run folder's heatmap.json and read
    from there when it holds the same n and seed."""
    cached = run_dir / "heatmap.json"
    if cached.exists():
        data = json.loads(cached.read_text())
        if data.get("n") == n and data.get("seed") == seed:
            return data["records"]
    from . import tasks
    from .checkpoint import load
    from .mech import evaluate_mechanism, mech_batch

    checkpoint = run_dir / "model.safetensors"
    model, task = load(checkpoint), tasks.from_checkpoint(checkpoint)
    batch = mech_batch(task, seed, n)
    positions = [role for role in ("key", "value", "query", "divider") if role in batch.roles]
    records, _ = evaluate_mechanism(model, batch, ["all"], positions)
    write_text_atomic(cached, json.dumps({"n": n, "seed": seed, "records": records}))
    return records


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Return the lines of a run's metrics.jsonl as dicts ([] when the file does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_report(
    runs_dir: str | Path,
    out_dir: str | Path,
    *,
    runs: Sequence[str] | None = None,
    n: int = 320,
    seed: int = 0,
    heatmaps: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write the figures and ``report.md`` of the sweep in `runs_dir` into `out_dir`; return the
    report's path. `runs` names the runs that get a heatmap and a dynamics figure (default: the
    best run of each series); heatmaps patch `n` examples drawn with `seed`.

    Every input is checked before anything is drawn. The report is built in a temporary folder
    beside `out_dir` and renamed onto it when complete, so `out_dir` holds a whole report or is
    left as it was; an existing `out_dir` is replaced only if it is empty or a report folder
    (report.md and PNGs), else a UsageError names what it holds.
    """
    from .sweep import read_results

    runs_dir, out_dir = Path(runs_dir), Path(out_dir)
    log = log or (lambda message: None)
    if n < 1:
        raise UsageError(f"n must be >= 1 examples per heatmap, got {n}")
    rows = read_results(runs_dir / "results.csv")
    if not rows:
        raise HookmechError(f"{runs_dir}/results.csv has no runs")
    by_id = {row["run_id"]: row for row in rows}
    missing = [r for r in runs or () if r not in by_id]
    if missing:
        raise unknown("run", missing[0], by_id)
    _check_report_folder(out_dir)
    with _fresh_folder(out_dir) as building:
        _write_report(runs_dir, building, rows, runs=runs, n=n, seed=seed, heatmaps=heatmaps, log=log)
    return out_dir / "report.md"


#: what a report folder holds (`_check_report_folder` replaces nothing else)
REPORT_FILES = ("report.md", "*.png")


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
    (replacing the folder there), else remove it and leave `path` as it was."""
    path = Path(os.path.abspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        os.chmod(building, 0o777 & ~_umask())  # mkdtemp makes 0700; give what mkdir would
        yield building
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_report(
    runs_dir: Path,
    out_dir: Path,
    rows: list[dict[str, Any]],
    *,
    runs: Sequence[str] | None,
    n: int,
    seed: int,
    heatmaps: bool,
    log: Callable[[str], None],
) -> None:
    """Draw the figures and write report.md of `rows` into the existing folder `out_dir`."""
    keys = grid_keys(runs_dir, rows)
    title = (
        json.loads((runs_dir / "sweep.json").read_text())["name"]
        if (runs_dir / "sweep.json").exists()
        else runs_dir.name
    )
    summary = summarise(rows, keys)
    site = attribution_site(rows)
    counts: defaultdict[str, int] = defaultdict(int)
    for row in rows:
        counts[row["status"]] += 1
    lines = [
        f"# Report: {title}",
        "",
        f"{len(rows)} runs in `{runs_dir}` ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}). "
        f"Series: {', '.join(k for k in keys if k not in SWEPT) or '—'}; swept: "
        f"{', '.join(k for k in keys if k in SWEPT) or '—'}. Best lr per (series, d_model) by mean dev accuracy.",
        "",
    ]
    if summary:
        lines += ["## Headline", "", headline_table(summary), ""]
        if site is not None:
            lines += [
                f"Attributions: `{site}` at each position, mean over the best-lr seeds that pass the filter "
                "(p_clean − p_corrupt > threshold); value = induction, query = direct retrieval in layer 0, "
                "key = in layer 1 (paper 000 §5.1).",
                "",
            ]
        plot_accuracy(summary, out_dir / "accuracy_vs_d_model.png", title)
        plot_lr_sensitivity(rows, keys, out_dir / "lr_sensitivity.png", title)
        lines += [
            "## Accuracy",
            "",
            "![accuracy vs d_model](accuracy_vs_d_model.png)",
            "",
            "![learning-rate sensitivity](lr_sensitivity.png)",
            "",
        ]
    if site is not None and summary:
        plot_value_vs_query(rows, keys, site, out_dir / "attribution_value_vs_query.png", title)
        plot_attribution_summary(rows, keys, site, out_dir / "attribution_summary.png", title)
        lines += [
            "## Mechanisms",
            "",
            "![value vs query](attribution_value_vs_query.png)",
            "",
            "![attribution summary](attribution_summary.png)",
            "",
        ]
    by_id = {row["run_id"]: row for row in rows}
    if runs:
        selected = [by_id[r] for r in runs]
    else:
        selected = select_runs(rows, keys)
    detail = []
    for row in selected:
        run_dir = runs_dir / row["run_id"]
        label = f"{series_of(row, keys)}, d_model {row.get('d_model')}, lr {row.get('lr')}, seed {row.get('seed')}"
        if heatmaps and row["status"] == "finished" and (run_dir / "model.safetensors").exists():
            log(f"heatmap {row['run_id']}")
            records = heatmap_records(run_dir, n, seed)
            name = f"heatmap_{row['run_id']}.png"
            plot_heatmap(
                records,
                out_dir / name,
                f"{title}: {label} (dev acc {row['dev_acc']:.3f})\nattribution per site × position, {n} examples",
            )
            detail += [f"![heatmap {row['run_id']}]({name})", ""]
        name = f"dynamics_{row['run_id']}.png"
        if plot_dynamics(
            read_metrics(run_dir / "metrics.jsonl"), out_dir / name, f"{title}: {label}: training dynamics"
        ):
            detail += [f"![dynamics {row['run_id']}]({name})", ""]
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
    write_text_atomic(out_dir / "report.md", "\n".join(lines).rstrip() + "\n")
