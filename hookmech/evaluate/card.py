"""The report card of an evaluation: per task, accuracy and the mechanism verdict of every
learning rate, the best run's verdict with its numbers and its strongest inside hooks, the
learning-rate window, and the reference architectures beside it (hookmech's own runs, the
paper's number where it has one). ``card.json`` holds the data, ``card.md`` shows it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..fileio import write_text_atomic
from .budget import Planned
from .references import pending_references, references
from .suites import Suite
from .verdict import MIN_EFFECT, PRESENT, STRONG, verdict

#: the learning-rate window: the rates whose dev accuracy is within this of the best rate's
WINDOW = 0.05
#: inside-hook attributions shown per task (largest first)
TOP_INSIDE = 5
#: the site the headline verdict reads (both suites' models have two layers)
VERDICT_SITE = "L1.block_in"


def task_rows(runs_dir: Path) -> list[dict[str, Any]]:
    """Return the rows of a task's ``results.csv`` (none when the task has not run)."""
    from ..sweep import read_results

    return read_results(runs_dir / "results.csv") if (runs_dir / "results.csv").exists() else []


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Return the finished row of highest dev accuracy (ties: the smaller learning rate), or None
    when no run finished (a diverged run is never the best)."""
    finished = [row for row in rows if row.get("status") == "finished" and _number(row.get("dev_acc"))]
    if not finished:
        return None
    return max(finished, key=lambda row: (row["dev_acc"], -row["lr"]))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def lr_window(rows: list[dict[str, Any]]) -> list[float]:
    """Return the learning rates whose finished run is within WINDOW of the best dev accuracy."""
    best = best_row(rows)
    if best is None:
        return []
    return sorted(
        row["lr"]
        for row in rows
        if row.get("status") == "finished"
        and _number(row.get("dev_acc"))
        and row["dev_acc"] >= best["dev_acc"] - WINDOW
    )


def inside_attributions(row: dict[str, Any], top: int = TOP_INSIDE) -> list[dict[str, Any]]:
    """Return the `top` largest attributions of `row` at inside hooks (``L{l}.mixer.*``), as
    ``{"site", "pos", "attribution"}``, largest magnitude first."""
    found: list[tuple[float, str, str]] = []
    for key, value in row.items():
        if key.startswith("attr:L") and ".mixer." in key and _number(value):
            site, _, pos = key[5:].rpartition("@")
            found.append((float(value), site, pos))
    found.sort(key=lambda item: (-abs(item[0]), item[1], item[2]))
    return [{"site": site, "pos": pos, "attribution": value} for value, site, pos in found[:top]]


def build_card(
    out: Path,
    chosen: Suite,
    model_key: dict[str, Any],
    options: dict[str, Any],
    planned: list[Planned],
    errors: dict[str, str],
    view_errors: dict[str, str] | None = None,
    not_applied: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Return the card of the evaluation in `out` (what ``card.json`` holds). `errors` and
    `view_errors` are per task; `not_applied` lists per task the suite's mixer options the
    evaluated mixer does not take."""
    view_errors, not_applied = view_errors or {}, not_applied or {}
    bundled = references().get(chosen.name, {})
    pending = pending_references().get(chosen.name, {})
    tasks = []
    for task in chosen.tasks:
        rows = task_rows(out / task.name)
        best = best_row(rows)
        found = verdict(best, VERDICT_SITE) if best is not None else None
        runs = [
            {
                "run_id": row["run_id"],
                "lr": row["lr"],
                "status": row["status"],
                "dev_acc": row.get("dev_acc"),
                "test_acc": row.get("test_acc"),
                "seconds": row.get("seconds"),
                "verdict": verdict(row, VERDICT_SITE) if row.get("status") == "finished" else None,
            }
            for row in sorted(rows, key=lambda row: row["lr"])
        ]
        view = out / task.name / f"view-{best['run_id']}.html" if best is not None else None
        tasks.append(
            {
                "task": task.name,
                "spec": task.task,
                "lrs": sorted(task.lrs),
                "runs": runs,
                "best": best["run_id"] if best is not None else None,
                "verdict": found,
                # inside hooks of a model that does not recall are noise, like its block numbers
                "inside": inside_attributions(best) if best is not None and found and found["recalls"] else [],
                "lr_window": lr_window(rows),
                "left_out": sorted(p.lr for p in planned if p.task == task.name and not p.kept),
                "error": errors.get(task.name),
                "view_error": view_errors.get(task.name),
                "not_applied": not_applied.get(task.name, []),
                "references": [_reference(entry) for entry in bundled.get(task.name, [])],
                "references_pending": pending.get(task.name, []),
                "view": str(view.relative_to(out)) if view is not None and view.exists() else None,
            }
        )
    return {
        "suite": chosen.name,
        "about": chosen.about,
        "model": model_key,
        "mixer_options": options,
        "rules": {"strong": STRONG, "present": PRESENT, "min_effect": MIN_EFFECT, "window": WINDOW},
        "verdict_site": VERDICT_SITE,
        "tasks": tasks,
    }


def _reference(entry: dict[str, Any]) -> dict[str, Any]:
    """A bundled reference run with its verdict by today's rules."""
    return {
        "label": entry["label"],
        "lr": entry["lr"],
        "dev_acc": entry["dev_acc"],
        "paper_acc": entry.get("paper_acc"),
        "verdict": verdict(entry["columns"], VERDICT_SITE),
        "record": entry["record"],
    }


def write_card(card: dict[str, Any], out: Path) -> None:
    """Write ``out/card.json`` and ``out/card.md`` (atomically)."""
    write_text_atomic(out / "card.json", json.dumps(card, indent=1, sort_keys=True) + "\n")
    write_text_atomic(out / "card.md", card_markdown(card))


def card_markdown(card: dict[str, Any]) -> str:
    """Return the card as Markdown: a section per task (runs, verdict, window, references)."""
    model = card["model"].get("mixer") or f"preset {card['model'].get('arch')}"
    options = "".join(f", {key}={value}" for key, value in sorted(card["mixer_options"].items()))
    rules = card["rules"]
    lines = [
        f"# Mechanistic evaluation: {model}{options}",
        "",
        f"Suite **{card['suite']}**: {card['about']}. Verdicts read `{card['verdict_site']}` (rules: the model",
        f"must react to the corruption, p_clean − p_corrupt ≥ {rules['min_effect']}; a position holding ≥ "
        f"{rules['strong']} carries the mechanism, ≥ {rules['present']} a part of it; value → induction, query → "
        "direct retrieval by the layer before, key → direct retrieval by this layer). Attributions in parentheses "
        "are noise: that model does not recall.",
    ]
    for task in card["tasks"]:
        lines += ["", f"## {task['task']}", "", _spec_text(task["spec"]), ""]
        lines += _runs_table(task)
        lines += ["", _headline(task)]
        if task["inside"]:
            shown = ", ".join(f"`{i['site']}` @ {i['pos']} {i['attribution']:.2f}" for i in task["inside"])
            lines += ["", f"Strongest inside hooks of the best run: {shown}."]
        if task["left_out"]:
            lines += ["", "Left out by the budget: lr " + ", ".join(f"{lr:g}" for lr in task["left_out"]) + "."]
        if task["error"]:
            lines += ["", f"Failed: {task['error']}"]
        if task["not_applied"]:
            shown = ", ".join(f"`{key}`" for key in task["not_applied"])
            lines += ["", f"The suite's mixer options {shown} were not applied: this mixer does not take them."]
        if task["view"]:
            lines += ["", f"Page of the best run: [{task['view']}]({task['view']})."]
        elif task["view_error"]:
            lines += ["", f"No page of the best run: {task['view_error']}"]
        lines += ["", *_references_table(task)]
    return "\n".join(lines) + "\n"


def _spec_text(spec: dict[str, Any]) -> str:
    return "Task: " + ", ".join(f"{key} {value}" for key, value in spec.items() if key != "name") + "."


def _runs_table(task: dict[str, Any]) -> list[str]:
    lines = ["| lr | status | dev acc | verdict | value / key / query |", "| --- | --- | --- | --- | --- |"]
    for run in task["runs"]:
        acc = f"{run['dev_acc']:.3f}" if _number(run["dev_acc"]) else "–"
        found = run["verdict"]
        label = found["label"] if found else "–"
        numbers = _numbers_text(found) if found else "–"
        lines.append(f"| {run['lr']:g} | {run['status']} | {acc} | {label} | {numbers} |")
    return lines


def _numbers_text(found: dict[str, Any]) -> str:
    """value / key / query, in parentheses where the model does not recall (they are noise then)."""
    numbers = found["numbers"]
    text = " / ".join(f"{numbers[pos]:.2f}" for pos in ("value", "key", "query"))
    return text if found["recalls"] else f"({text})"


def _headline(task: dict[str, Any]) -> str:
    found = task["verdict"]
    if found is None:
        return "No run finished: no verdict."
    best = next(run for run in task["runs"] if run["run_id"] == task["best"])
    window = ", ".join(f"{lr:g}" for lr in task["lr_window"])
    trained = len([run for run in task["runs"] if run["status"] == "finished"])
    return (
        f"**Verdict: {found['label']}** ({found['reason']}); best dev accuracy {best['dev_acc']:.3f} at lr "
        f"{best['lr']:g}. Learning-rate window (within {WINDOW:g} of the best): {window} — "
        f"{len(task['lr_window'])} of {trained} rates trained."
    )


def _references_table(task: dict[str, Any]) -> list[str]:
    pending = task.get("references_pending") or []  # a card.json written before the field has none
    not_yet = ", ".join(
        f"{entry['label']} (paper {entry['paper_acc']:.3f})" if _number(entry["paper_acc"]) else entry["label"]
        for entry in pending
    )
    if not task["references"]:
        return ["No reference runs are bundled for this task."] + (
            [f"The paper reports: {not_yet}."] if pending else []
        )
    lines = [
        "References (hookmech's own runs; the paper's best where it reports one):",
        "",
        "| architecture | lr | dev acc | paper (best lr) | verdict | value / key / query |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for ref in task["references"]:
        paper = f"{ref['paper_acc']:.3f}" if _number(ref["paper_acc"]) else "–"
        lines.append(
            f"| {ref['label']} | {ref['lr']:g} | {ref['dev_acc']:.3f} | {paper} | {ref['verdict']['label']} | "
            f"{_numbers_text(ref['verdict'])} |"
        )
    if pending:
        lines += ["", f"Not bundled yet (their runs have not finished): {not_yet}."]
    return lines
