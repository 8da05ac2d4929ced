"""Build hookmech/evaluate/references.json — the report card's reference architectures — from
the run records committed in results/ (tests/test_evaluate.py rebuilds and compares).

    python scripts/evaluate_references.py            # rewrite the bundled file
    python scripts/evaluate_references.py --check    # exit 1 if it is not what the records give

- quick suite: ``results/evaluate/quick-<arch>/`` — `hookmech evaluate --arch <arch> --suite
  quick` of each of paper 000's six model presets (attention with its CPU calibration, layer 0
  a window of 2 tokens: docs/guide.md §4); per task the best finished run (`card.best_row`).
- paper suite, AR: the d_model-64 runs of docs/results.md at the ``ar-paper-d64`` configuration
  (PAPER_AR_RECORDS), the best of each architecture's, beside paper 000's best cell.
- paper suite, ATR: the runs of results/atr-table at the ``atr-paper-d64`` configuration
  (PAPER_ATR_RECORDS), beside PAPER_ATR_D64; an architecture without a finished run goes to ``pending``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "hookmech" / "evaluate" / "references.json"
ARCHS = ("attention", "based", "mamba", "h3", "hyena", "baseconv")
LABELS = {
    "attention": "attention",
    "based": "Based (BaseConv + Based)",
    "mamba": "Mamba",
    "h3": "H3",
    "hyena": "Hyena",
    "baseconv": "BaseConv (short + long conv)",
}
#: paper 000's AR table, d_model 64, best over its learning rates (docs/results.md), as fractions
PAPER_AR_D64: dict[str, float | None] = {
    "attention": 1.0,
    "based": 0.9906,
    "mamba": 0.8062,
    "h3": 0.0188,
    "hyena": 0.0281,
    "baseconv": 0.0375,
}
#: run records at the ar-paper-d64 configuration (attention: learned positions; the others none)
PAPER_AR_RECORDS = {
    "attention": ["results/ar-paper-d64/attention_lr0.001_s0_9e1ba1"],
    "based": ["results/ar-table/d64-based-lr1e-3-s0-byname/based_lr0.001_s0_c23be3"],
    "mamba": [
        "results/ar-table/d64-mamba-lr1e-2-s0/mamba_lr0.01_s0_432a19",
        "results/ar-table/d64-mamba-lr3e-3-s0/mamba_lr0.003_s0_ce8adf",
    ],
    "h3": ["results/ar-table/d64-h3-lr1e-3-s0/h3_lr0.001_s0_09826e"],
    "hyena": ["results/ar-table/d64-hyena-lr1e-3-s0/hyena_lr0.001_s0_c87741"],
    "baseconv": ["results/ar-table/d64-baseconv-lr1e-3-s0/baseconv_lr0.001_s0_6ae320"],
}
#: paper 000's figure 4(a), L_max 5, |Σ| 20, d_model 64, best over its learning rates (3e-5 … 3e-3), as
#: fractions of its 320 test documents: the table the authors' notebook prints for the figure
#: (tinylang @ 7e9ded8 notebooks/Sweep.ipynb, under "Benchmarking ATR, varying $L$"; docs/results.md)
PAPER_ATR_D64: dict[str, float | None] = {
    "attention": 0.9375,
    "based": 0.9188,
    "mamba": 0.9625,
    "h3": 0.9,
    "hyena": 0.8531,
    "baseconv": 0.825,
}
#: run records at the atr-paper-d64 configuration (results/atr-table)
PAPER_ATR_RECORDS: dict[str, list[str]] = {
    "attention": ["results/atr-table/d64-attention-lr1e-3-s0/attention_lr0.001_s0_9e1ba1"],
    "based": ["results/atr-table/d64-based-lr1e-3-s0/based_lr0.001_s0_c23be3"],
    "baseconv": ["results/atr-table/d64-baseconv-lr1e-3-s0/baseconv_lr0.001_s0_6ae320"],
    "hyena": ["results/atr-table/d64-hyena-lr1e-3-s0/hyena_lr0.001_s0_c87741"],
    "h3": ["results/atr-table/d64-h3-lr1e-3-s0/h3_lr0.001_s0_09826e"],
    "mamba": ["results/atr-table/d64-mamba-lr1e-3-s0/mamba_lr0.001_s0_cb91e7"],
}
VERDICT_SITE = "L1.block_in"
#: why a quick-suite reference stays at chance (the card shows it after the evidence the records
#: give: every rate trained with its dev accuracy, and the last training loss)
ZOOLOGY_MQAR = (
    "zoology's MQAR figure, where Mamba and the gated convolutions recall 4 pairs in 64 tokens at d_model 64, "
    "trains 64 epochs of 100,000 documents at batch 512 — 6.4 million documents, 200 times the quick suite's "
    "32,000 (4000 steps of 32 rows: 8 documents of 4 queries) — and without random tokens between the pairs "
    "and the queries (HazyResearch/zoology, "
    "zoology/experiments/paper_configs/iclr24_zoology_figure2/configs.py)"
)
QUICK_CAUSES = {
    ("mqar", "mamba"): "most likely the quick MQAR's budget rather than the architecture (a longer run was not "
    "measured): " + ZOOLOGY_MQAR
    + "; the same model recalls the quick AR, whose query follows the pairs (0.872)",
    ("mqar", "h3"): "most likely the quick MQAR's budget, as for Mamba: " + ZOOLOGY_MQAR
    + "; the same model recalls the quick AR (0.831); only lr 3e-3 was trained",
    ("mqar", "baseconv"): "BaseConv does not recall AR at this size either (quick AR: at chance; paper 000's AR "
    "cell at d_model 64: 0.037), and the quick MQAR's budget is short of zoology's: " + ZOOLOGY_MQAR,
    ("ar", "baseconv"): "as in paper 000, whose AR cell for BaseConv at d_model 64 is 0.037 (its configuration; "
    "hookmech's run of it: 0.016)",
}


def verdict_columns(columns: dict[str, Any]) -> dict[str, Any]:
    """The columns a verdict reads: the attributions at VERDICT_SITE and the filter's p's."""
    keep = {key: value for key, value in columns.items() if key.startswith(f"attr:{VERDICT_SITE}@")}
    return {**keep, "mech_p_clean": columns["mech_p_clean"], "mech_p_corrupt": columns["mech_p_corrupt"]}


def quick_references() -> dict[str, list[dict[str, Any]]]:
    """Return ``{task: [entry per architecture with a committed evaluation]}`` of the quick suite."""
    from hookmech.evaluate.card import best_row, task_rows
    from hookmech.evaluate.suites import suite
    from hookmech.tasks import from_spec

    by_task: dict[str, list[dict[str, Any]]] = {task.name: [] for task in suite("quick").tasks}
    chance = {task.name: from_spec(task.task).chance() for task in suite("quick").tasks}
    for arch in ARCHS:
        folder = REPO / "results" / "evaluate" / f"quick-{arch}"
        if not folder.is_dir():
            continue
        what = json.loads((folder / "evaluate.json").read_text())
        options = "".join(f", {key} {value}" for key, value in sorted(what["mixer_options"].items()))
        for task in by_task:
            rows = task_rows(folder / task)
            best = best_row(rows)
            if best is None:
                continue
            entry = {
                "label": LABELS[arch] + (f" ({options[2:]})" if options else ""),
                "lr": best["lr"],
                "dev_acc": best["dev_acc"],
                "paper_acc": None,
                "columns": verdict_columns(best),
                "record": str((folder / task / best["run_id"]).relative_to(REPO)),
            }
            why = _why_at_chance(task, arch, rows, folder / task, chance[task])
            by_task[task].append({**entry, **({"why": why} if why else {})})
    return by_task


def _why_at_chance(task: str, arch: str, rows: list[dict[str, Any]], runs_dir: Path, chance: float) -> str | None:
    """Return why the quick reference of `arch` on `task` stays at chance — the evidence of its
    records (every rate's dev accuracy, the last training losses) and QUICK_CAUSES' reason — or
    None when its best run is above chance."""
    import math

    from hookmech.evaluate.card import at_chance, best_row

    best = best_row(rows)
    if best is None or not at_chance(best["dev_acc"], chance):
        return None
    if (task, arch) not in QUICK_CAUSES:
        raise SystemExit(f"{arch} on the quick {task} is at chance: say why in QUICK_CAUSES")
    finished = sorted((row for row in rows if row["status"] == "finished"), key=lambda row: row["lr"])
    rates = ", ".join(f"lr {row['lr']:g} {row['dev_acc']:.3f}" for row in finished)
    losses = []
    for row in finished:
        lines = (runs_dir / row["run_id"] / "metrics.jsonl").read_text().splitlines()
        losses.append(json.loads(lines[-1])["loss"])
    loss = f"{min(losses):.2f}" + (f"–{max(losses):.2f}" if len(losses) > 1 else "")
    n_values = round(1 / chance)
    return (
        f"at chance ({chance:.3f}) at every rate trained ({rates}); last training loss {loss}, where a guess "
        f"among the document's {n_values} values scores ln {n_values} = {math.log(n_values):.2f}. Why: "
        f"{QUICK_CAUSES[task, arch]}."
    )


def paper_references(records: dict[str, list[str]], paper: dict[str, float | None]) -> list[dict[str, Any]]:
    """Return one entry per architecture of `records`: its best committed run, beside `paper`'s number."""
    entries = []
    for arch in ARCHS:
        if arch not in records:
            continue
        runs = []
        for record in records[arch]:
            folder = REPO / record
            summary = json.loads((folder / "summary.json").read_text())
            mech = json.loads((folder / "mech.json").read_text())
            run = json.loads((folder / "run.json").read_text())
            runs.append((summary["dev_acc"], run, mech["columns"], record))
        dev_acc, run, columns, record = max(runs, key=lambda item: item[0])
        entries.append(
            {
                "label": LABELS[arch],
                "lr": run["train"]["lr"],
                "dev_acc": dev_acc,
                "paper_acc": paper.get(arch),
                "columns": verdict_columns(columns),
                "record": record,
            }
        )
    return entries


def paper_pending(records: dict[str, list[str]], paper: dict[str, float | None]) -> list[dict[str, Any]]:
    """Return ``{label, paper_acc}`` of each architecture `paper` reports that `records` lacks."""
    return [
        {"label": LABELS[arch], "paper_acc": paper[arch]} for arch in ARCHS if arch in paper and arch not in records
    ]


def build() -> str:
    """Return the text of references.json."""
    data = {
        "about": "built by scripts/evaluate_references.py from the committed run records; do not edit",
        "suites": {
            "quick": quick_references(),
            "paper": {
                "ar": paper_references(PAPER_AR_RECORDS, PAPER_AR_D64),
                "atr": paper_references(PAPER_ATR_RECORDS, PAPER_ATR_D64),
            },
        },
        "pending": {
            "paper": {
                "ar": paper_pending(PAPER_AR_RECORDS, PAPER_AR_D64),
                "atr": paper_pending(PAPER_ATR_RECORDS, PAPER_ATR_D64),
            }
        },
    }
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def main() -> int:
    from hookmech.fileio import write_text_atomic

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the bundled file differs")
    args = parser.parse_args()
    text = build()
    if args.check:
        same = TARGET.exists() and TARGET.read_text() == text
        print(f"{TARGET.relative_to(REPO)} is {'current' if same else 'stale: rerun without --check'}")
        return 0 if same else 1
    write_text_atomic(TARGET, text)
    print(f"wrote {TARGET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
