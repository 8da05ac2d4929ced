"""What the page of a sweep folder shows, as JSON-able data: the numbers of every figure of
`hookmech report` (`hookmech.report` computes them; its PNGs and this page draw the same).

- the headline table and accuracy vs d_model at the best lr (`report.summarise`);
- learning-rate sensitivity (`report.lr_curves`);
- attribution at the value against the query, one point per run passing the filter
  (`report.value_query_points`);
- mean attribution per position and series with 95% bootstrap intervals (`report.attribution_bars`);
- site × position heatmaps of the selected runs (`report.heatmap_records`, computed here: nothing
  is written into the sweep folder), or why a run has none (`report.no_heatmap_reason`);
- training dynamics of the selected runs trained with ``--mech-every`` (their metrics.jsonl).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import unknown
from ..report import (
    SELECTION_RULE,
    attribution_bars,
    attribution_site,
    grid_keys,
    heatmap_records,
    lr_curves,
    no_heatmap_reason,
    read_metrics,
    read_sweep_results,
    select_runs,
    series_of,
    summarise,
    sweep_title,
    value_query_points,
)
from ..run_weights import run_weights
from ..seeds import EXAMPLES_SEED

#: the metrics.jsonl fields the dynamics panels draw (besides ``step`` and ``attr:*``)
DYNAMICS_FIELDS = ("loss", "dev_acc", "dev_p_answer")


def sweep_page_data(
    runs_dir: str | Path,
    *,
    runs: Sequence[str] | None = None,
    n: int = 320,
    seed: int = EXAMPLES_SEED,
    heatmaps: bool = True,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Return the page data of the sweep in `runs_dir` (its results.csv): ``{"kind": "sweep",
    "title", "about", "keys", "site", "summary", "lr_curves", "value_query", "bars", "selected"}``.

    ``selected`` holds, for each run of `runs` (default: the best run of each series,
    `report.select_runs`), its label, its heatmap records (`n` examples drawn with `seed`; only
    with `heatmaps` and a finished run with a model file, else ``no_heatmap`` says why, also to
    `log`) and its dynamics (metrics.jsonl lines that carry attributions: ``step``,
    `DYNAMICS_FIELDS` and ``attr:*``, as lists). Reads the folder, writes nothing into it;
    its files are checked as `hookmech report` checks them (`report.read_sweep_results`).
    `progress(done, total)` is called before the first selected run and as each is done.
    """
    runs_dir = Path(runs_dir)
    log = log or (lambda message: None)
    rows = read_sweep_results(runs_dir)
    by_id = {row["run_id"]: row for row in rows}
    missing = [run for run in runs or () if run not in by_id]
    if missing:
        raise unknown("run", missing[0], by_id)
    keys = grid_keys(runs_dir, rows)
    title = sweep_title(runs_dir)
    site = attribution_site(rows)
    chosen = [by_id[run] for run in runs] if runs else select_runs(rows, keys)
    if progress is not None:
        progress(0, len(chosen))
    selected = []
    for index, row in enumerate(chosen):
        selected.append(_selected_run(runs_dir, row, keys, f"{index + 1}/{len(chosen)}", n, seed, heatmaps, log))
        if progress is not None:
            progress(index + 1, len(chosen))
    return {
        "kind": "sweep",
        "title": title,
        "about": {
            "runs_dir": str(runs_dir),
            "runs": len(rows),
            "status": dict(sorted(Counter(str(row["status"]) for row in rows).items())),
            "heatmap_examples": n,
            "heatmap_seed": seed,
            "selection": "the runs given" if runs else f"the best run of each series ({SELECTION_RULE})",
        },
        "keys": keys,
        "site": site,
        "summary": summarise(rows, keys),
        "lr_curves": lr_curves(rows, keys),
        "value_query": value_query_points(rows, keys, site) if site is not None else [],
        "bars": attribution_bars(rows, keys, site) if site is not None else [],
        "selected": selected,
    }


def _selected_run(runs_dir: Path, row, keys, counter: str, n: int, seed, heatmaps: bool, log) -> dict[str, Any]:
    """Return one selected run's entry of the page: its label, its heatmap records (`n` examples
    drawn with `seed`, when `heatmaps` and its weights are found; else ``no_heatmap`` says why, also
    to `log`) and its dynamics; `counter` ("2/5") numbers the heatmap's log line."""
    run_dir = runs_dir / row["run_id"]
    entry: dict[str, Any] = {
        "run_id": row["run_id"],
        "series": series_of(row, keys),
        "d_model": row.get("d_model"),
        "lr": row.get("lr"),
        "seed": row.get("seed"),
        "dev_acc": row.get("dev_acc"),
        "heatmap": None,
        "no_heatmap": no_heatmap_reason(run_dir, row) if heatmaps else None,
        "dynamics": None,
    }
    if entry["no_heatmap"] is not None:
        log(f"no heatmap for {row['run_id']}: {entry['no_heatmap']}")
    elif heatmaps:
        weights = run_weights(run_dir)
        fixture = weights.name if weights is not None and weights.parent != run_dir else None
        if fixture is not None:
            entry["weights"] = f"the bundled fixture {fixture} (the run's folder keeps no weights)"
        log(f"heatmap {counter}: {row['run_id']}" + (f" from {fixture}" if fixture else ""))
        entry["heatmap"] = heatmap_records(run_dir, n, seed)
    entry["dynamics"] = dynamics(read_metrics(run_dir / "metrics.jsonl"))
    return entry


def dynamics(metrics: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Return the training curves of a run's metrics.jsonl lines, ``{"step": [...], "loss": [...],
    ..., "attr": {"<site>@<pos>": [...]}}`` (None where a line lacks a value), or None when no line
    carries attributions (a run trained without ``--mech-every``), as `report.plot_dynamics` decides."""
    if not any(key.startswith("attr:") for line in metrics for key in line):
        return None
    names = list(dict.fromkeys(key for line in metrics for key in line if key.startswith("attr:")))
    return {
        "step": [line["step"] for line in metrics],
        **{field: [line.get(field) for line in metrics] for field in DYNAMICS_FIELDS},
        "attr": {name[5:]: [line.get(name) for line in metrics] for name in names},
    }
