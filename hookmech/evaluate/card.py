"""The report card of an evaluation: per task, its chance level, accuracy and the mechanism
verdict of every learning rate, the best run's verdict with its numbers and its strongest
inside hooks, the learning-rate window (or "at chance" where no rate learned the task), and the
evaluated mixer's best run in one table with the reference architectures (hookmech's own runs,
the paper's number where it has one). ``card.json`` holds the data, ``card.md`` shows it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..fileio import write_text_atomic
from ..sweep import read_results
from .budget import Planned
from .references import pending_references, references
from .suites import Suite
from .verdict import MIN_EFFECT, PATCH_FILTER, PRESENT, STRONG, verdict

# .tasks is imported where used: it loads torch, which this module does not

#: the learning-rate window: the rates whose dev accuracy is within this of the best rate's
WINDOW = 0.05
#: a run is at chance when its dev accuracy is at most the task's chance level plus this (about
#: two standard deviations of an accuracy near 0.25 on the 320 dev documents)
CHANCE_MARGIN = 0.05
#: inside-hook attributions shown per task (largest first)
TOP_INSIDE = 5
#: the site the headline verdict reads (both suites' models have two layers)
VERDICT_SITE = "L1.block_in"


def task_rows(runs_dir: Path) -> list[dict[str, Any]]:
    """Return the rows of a task's ``results.csv`` (none when the task has not run)."""
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


def at_chance(dev_acc: Any, chance: float | None) -> bool:
    """True when `dev_acc` is a number at most `chance` + CHANCE_MARGIN (False without a chance level)."""
    return chance is not None and _number(dev_acc) and dev_acc <= chance + CHANCE_MARGIN


def chance_level(spec: dict[str, Any]) -> float | None:
    """Return the chance accuracy of the task `spec` (`Task.chance`), None where it has none."""
    from .. import tasks

    return tasks.from_spec(spec).chance()


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
    selected: list[str] | None = None,
    steps: int | None = None,
) -> dict[str, Any]:
    """Return the card of the evaluation in `out` (what ``card.json`` holds). `errors` and
    `view_errors` are per task; `not_applied` lists per task the suite's mixer options the
    evaluated mixer does not take; `selected` names the tasks this evaluation ran (``--tasks``;
    None: all); `steps` is ``--steps`` (None: the suite's)."""
    view_errors, not_applied = view_errors or {}, not_applied or {}
    bundled = references().get(chosen.name, {})
    pending = pending_references().get(chosen.name, {})
    tasks = []
    for task in chosen.tasks:
        rows = task_rows(out / task.name)
        best = best_row(rows)
        found = verdict(best, VERDICT_SITE) if best is not None else None
        chance = chance_level(task.task)
        runs = [_run_entry(row, chance) for row in sorted(rows, key=lambda row: row["lr"])]
        view = out / task.name / f"view-{best['run_id']}.html" if best is not None else None
        tasks.append(
            {
                "task": task.name,
                "spec": task.task,
                "chance": chance,
                "at_chance": best is not None and at_chance(best["dev_acc"], chance),
                "ran": selected is None or task.name in selected,
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
                "references": [_reference(entry, chance) for entry in bundled.get(task.name, [])],
                "references_pending": pending.get(task.name, []),
                "view": str(view.relative_to(out)) if view is not None and view.exists() else None,
            }
        )
    rules = {
        "strong": STRONG,
        "present": PRESENT,
        "min_effect": MIN_EFFECT,
        "patch_filter": PATCH_FILTER,
        "window": WINDOW,
        "chance_margin": CHANCE_MARGIN,
    }
    card = {
        "suite": chosen.name,
        "about": chosen.about,
        "model": model_key,
        "mixer_options": options,
        "rules": rules,
        "verdict_site": VERDICT_SITE,
        "tasks": tasks,
    }
    return card if steps is None else {**card, "steps": steps}


def _run_entry(row: dict[str, Any], chance: float | None) -> dict[str, Any]:
    """A run of the evaluated mixer as the card shows it."""
    finished = row.get("status") == "finished"
    return {
        "run_id": row["run_id"],
        "lr": row["lr"],
        "status": row["status"],
        "dev_acc": row.get("dev_acc"),
        "test_acc": row.get("test_acc"),
        "seconds": row.get("seconds"),
        "at_chance": finished and at_chance(row.get("dev_acc"), chance),
        "verdict": verdict(row, VERDICT_SITE) if finished else None,
    }


def _reference(entry: dict[str, Any], chance: float | None) -> dict[str, Any]:
    """A bundled reference run with its verdict by today's rules."""
    return {
        "label": entry["label"],
        "lr": entry["lr"],
        "dev_acc": entry["dev_acc"],
        "at_chance": at_chance(entry["dev_acc"], chance),
        "paper_acc": entry.get("paper_acc"),
        "verdict": verdict(entry["columns"], VERDICT_SITE),
        "record": entry["record"],
        **({"why": entry["why"]} if entry.get("why") else {}),
    }


def write_card(card: dict[str, Any], out: Path) -> None:
    """Write ``out/card.json`` and ``out/card.md`` (atomically)."""
    write_text_atomic(out / "card.json", json.dumps(card, indent=1, sort_keys=True) + "\n")
    write_text_atomic(out / "card.md", card_markdown(card))


def card_markdown(card: dict[str, Any]) -> str:
    """Return the card as Markdown: a section per task (chance, runs, verdict, window or "at
    chance", the mixer beside the references)."""
    model = _model_name(card)
    options = "".join(f", {key}={value}" for key, value in sorted(card["mixer_options"].items()))
    rules = card["rules"]
    patch_filter = rules.get("patch_filter", PATCH_FILTER)  # a card.json written before the field
    lines = [
        f"# Mechanistic evaluation: {model}{options}",
        "",
        f"Suite **{card['suite']}**: {card['about']}. Verdicts read `{card['verdict_site']}` (rules: the model",
        f"must react to the corruption, p_clean − p_corrupt ≥ {rules['min_effect']} (the recall threshold); a position "
        f"holding ≥ {rules['strong']} carries the mechanism, ≥ {rules['present']} a part of it; value → induction, "
        "query → direct retrieval by the layer before, key → direct retrieval by this layer). Attributions in "
        "parentheses are noise: that model does not recall. Where a run passes only the patching filter of "
        f"`hookmech patch` and paper 000 (p_clean − p_corrupt > {patch_filter}), its verdict says what the "
        "positions read there. A run is at chance when its dev accuracy is at most the task's chance level + "
        f"{rules.get('chance_margin', CHANCE_MARGIN)}.",
    ]
    if card.get("steps") is not None:
        lines += [
            "",
            f"**Smoke test**: every run trained {card['steps']} steps (`--steps`), not the suite's; its numbers do "
            "not compare with the references.",
        ]
    for task in card["tasks"]:
        lines += ["", *_task_markdown(task, model)]
    return "\n".join(lines) + "\n"


def _model_name(card: dict[str, Any]) -> str:
    return card["model"].get("mixer") or f"preset {card['model'].get('arch')}"


def _task_markdown(task: dict[str, Any], model: str) -> list[str]:
    """The section of one task."""
    lines = [f"## {task['task']}", "", _spec_text(task["spec"]) + _chance_text(task.get("chance")), ""]
    if not task["runs"] and not task.get("ran", True):
        lines += ["Not run: `--tasks` left it out.", ""]
    else:
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
    return [*lines, "", *_references_table(task, model)]


def _spec_text(spec: dict[str, Any]) -> str:
    return "Task: " + ", ".join(f"{key} {value}" for key, value in spec.items() if key != "name") + "."


def _chance_text(chance: float | None) -> str:
    if chance is None:
        return ""
    return (
        f" Chance: {chance:.3f} (a guess that knows the task's format but not which pair is asked: uniform "
        "among the answers the document offers)."
    )


def _acc_text(acc: Any, chance_flag: bool) -> str:
    if not _number(acc):
        return "–"
    return f"{acc:.3f} (at chance)" if chance_flag else f"{acc:.3f}"


def _runs_table(task: dict[str, Any]) -> list[str]:
    lines = ["| lr | status | dev acc | verdict | value / key / query |", "| --- | --- | --- | --- | --- |"]
    for run in task["runs"]:
        found = run["verdict"]
        label = _verdict_text(found) if found else "–"
        numbers = _numbers_text(found) if found else "–"
        acc = _acc_text(run["dev_acc"], run.get("at_chance", False))
        lines.append(f"| {run['lr']:g} | {run['status']} | {acc} | {label} | {numbers} |")
    return lines


def _verdict_text(found: dict[str, Any]) -> str:
    """The verdict's label, with the patching filter's reading where only that filter passes."""
    reading = (found.get("patch_filter") or {}).get("label")
    if reading is None:
        return found["label"]
    threshold = found["patch_filter"]["threshold"]
    return f"{found['label']} (patching filter > {threshold:g}: {reading})"


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
    trained = len([run for run in task["runs"] if run["status"] == "finished"])
    verdict_text = f"**Verdict: {_verdict_text(found)}** ({found['reason']})"
    if task.get("at_chance"):
        return (
            f"{verdict_text}. **At chance**: the best dev accuracy, {best['dev_acc']:.3f} at lr {best['lr']:g}, is "
            f"within {CHANCE_MARGIN:g} of chance ({task['chance']:.3f}) — no rate of the {trained} trained learned the "
            "task, so there is no learning-rate window and no mechanism to read."
        )
    window = ", ".join(f"{lr:g}" for lr in task["lr_window"])
    return (
        f"{verdict_text}; best dev accuracy {best['dev_acc']:.3f} at lr {best['lr']:g}. Learning-rate window "
        f"(within {WINDOW:g} of the best): {window} — {len(task['lr_window'])} of {trained} rates trained."
    )


def _references_table(task: dict[str, Any], model: str) -> list[str]:
    """The evaluated mixer's best run and the reference architectures in one table."""
    pending = task.get("references_pending") or []  # a card.json written before the field has none
    not_yet = ", ".join(
        f"{entry['label']} (paper {entry['paper_acc']:.3f})" if _number(entry["paper_acc"]) else entry["label"]
        for entry in pending
    )
    lines = [
        "Side by side: this mixer's best run and the references (hookmech's own runs; the paper's best where it "
        "reports one):",
        "",
        "| architecture | lr | dev acc | paper (best lr) | verdict | value / key / query |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    best = next((run for run in task["runs"] if run["run_id"] == task["best"]), None)
    if best is not None and task["verdict"] is not None:
        acc = _acc_text(best["dev_acc"], task.get("at_chance", False))
        lines.append(
            f"| **{model} (this card)** | {best['lr']:g} | {acc} | – | {_verdict_text(task['verdict'])} | "
            f"{_numbers_text(task['verdict'])} |"
        )
    else:
        lines.append(f"| **{model} (this card)** | – | – | – | no run finished | – |")
    for ref in task["references"]:
        paper = f"{ref['paper_acc']:.3f}" if _number(ref["paper_acc"]) else "–"
        acc = _acc_text(ref["dev_acc"], ref.get("at_chance", False))
        lines.append(
            f"| {ref['label']} | {ref['lr']:g} | {acc} | {paper} | {_verdict_text(ref['verdict'])} | "
            f"{_numbers_text(ref['verdict'])} |"
        )
    whys = [f"{ref['label']}: {ref['why']}" for ref in task["references"] if ref.get("why")]
    if whys:
        lines += ["", *(f"- {why}" for why in whys)]
    if not task["references"]:
        return [*lines, "", "No reference runs are bundled for this task."] + (
            [f"The paper reports: {not_yet}."] if pending else []
        )
    if pending:
        lines += ["", f"Not bundled yet (their runs have not finished): {not_yet}."]
    return lines
