"""The evaluate card's honesty when a model does not learn (issue 45 §2): each task's chance level
against an independent count, "at chance" instead of a learning-rate window, the evaluated
mixer in one table with the references, both filters named, and the smoke-test options
`--tasks` and `--steps`. References: hand counts over sampled documents (a plain loop over ATR's
derivations), the committed run records, `PatchOptions`' own threshold."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import REPO, run_cli
from test_evaluate import tiny_suite  # noqa: F401 - the fixture
from test_evaluate_verdict import committed_columns

import hookmech.evaluate.runner as runner
from hookmech import tasks
from hookmech.errors import UsageError
from hookmech.evaluate import evaluate, suite
from hookmech.evaluate.card import CHANCE_MARGIN, at_chance, card_markdown
from hookmech.evaluate.verdict import MIN_EFFECT, PATCH_FILTER, verdict


# -- chance ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [{"name": "ar", "vocab_size": 64, "num_kv_pairs": 4}, {"name": "mqar", "vocab_size": 64, "seq_len": 32,
     "num_kv_pairs": 4}, {"name": "ar", "vocab_size": 8192, "num_kv_pairs": 16}],  # fmt: skip
)
def test_chance_of_ar_and_mqar_is_one_value_among_the_documents(spec):
    task = tasks.from_spec(spec)
    batch = task.sample(64, seed=3)
    # the distinct values in each document's pairs (AR: after BOS, key-value alternating; MQAR: from 0)
    start = 1 if spec["name"] == "ar" else 0
    pairs = batch.tokens[:, start : start + 2 * spec["num_kv_pairs"]]
    values = pairs[:, 1::2]
    assert all(len(set(row.tolist())) == spec["num_kv_pairs"] for row in values)
    assert all(answer in row.tolist() for answer, row in zip(batch.answers.tolist(), values, strict=True))
    assert task.chance() == 1 / spec["num_kv_pairs"]


def _atr_chance_by_loop(task, n: int, seed: int) -> float:
    """The same definition, one document at a time: eligible keys are symbols with a parent that
    are the rightmost of their terminal; their answers are the parents' labels."""
    from hookmech.tasks.ar import rng_for

    docs = task._documents(rng_for(seed), n).yields
    shares = []
    for d in range(n):
        lo, hi = int(docs.offsets[d]), int(docs.offsets[d + 1])
        labels, parents = docs.labels[lo:hi].tolist(), docs.parent[lo:hi].tolist()
        answers = set()
        for position, (label, parent) in enumerate(zip(labels, parents, strict=True)):
            rightmost = label not in labels[position + 1 :]
            if parent >= 0 and rightmost:
                answers.add(labels[parent])
        assert answers  # every document drawn has an eligible query
        shares.append(1 / len(answers))
    return float(np.mean(shares))


def test_chance_of_atr_is_the_plain_loops():
    task = tasks.from_spec({"name": "atr", "max_rhs_len": 5, "num_terminals": 20})
    assert task.chance(n=300, seed=4) == pytest.approx(_atr_chance_by_loop(task, 300, 4), abs=1e-12)
    # the quick suite's ATR: short documents whose few parents a format-aware guess often hits
    assert 0.5 < task.chance() < 0.6


def test_at_chance_is_within_the_margin_of_chance():
    assert at_chance(0.25 + CHANCE_MARGIN, 0.25) and not at_chance(0.25 + CHANCE_MARGIN + 1e-9, 0.25)
    assert not at_chance(None, 0.25) and not at_chance(0.1, None)


# -- the filters ----------------------------------------------------------------------------------
def test_the_patching_filter_is_patchs_own_threshold():
    from hookmech.patching.options import PatchOptions
    from hookmech.sweep import MECH_DEFAULTS

    assert PATCH_FILTER == PatchOptions().threshold == MECH_DEFAULTS["threshold"] < MIN_EFFECT


def test_a_run_between_the_filters_shows_both_readings():
    # H3 at the paper's AR configuration: p_clean − p_corrupt 0.019, query 0.93 (docs/results.md:
    # "barely passes: direct retrieval at the query"); the card's verdict: does not recall
    found = verdict(committed_columns("ar-table/d64-h3-lr1e-3-s0/h3_lr0.001_s0_09826e"))
    assert found["label"] == "neither" and not found["recalls"]
    assert found["patch_filter"] == {"threshold": PATCH_FILTER, "passes": True, "label": "direct retrieval at layer 0"}
    # below both filters (BaseConv: −0.001) there is nothing to read; above both, one reading
    below = verdict(committed_columns("ar-table/d64-baseconv-lr1e-3-s0/baseconv_lr0.001_s0_6ae320"))
    assert below["patch_filter"] == {"threshold": PATCH_FILTER, "passes": False, "label": None}
    above = verdict(committed_columns("ar-paper-d64/attention_lr0.001_s0_9e1ba1"))
    assert above["patch_filter"]["passes"] and above["patch_filter"]["label"] is None


# -- the card -------------------------------------------------------------------------------------
def _run(lr, acc, value=0.0, key=0.0, query=0.0, p_clean=0.3, p_corrupt=0.3):
    columns = {"attr:L1.block_in@value": value, "attr:L1.block_in@key": key, "attr:L1.block_in@query": query,
               "mech_p_clean": p_clean, "mech_p_corrupt": p_corrupt}  # fmt: skip
    return {"run_id": f"lr{lr}", "lr": lr, "status": "finished", "dev_acc": acc, "test_acc": None, "seconds": 1.0,
            "at_chance": at_chance(acc, 0.25), "verdict": verdict(columns)}  # fmt: skip


def _chance_card() -> dict:
    runs = [_run(1e-3, 0.256), _run(3e-3, 0.231, query=0.9, p_clean=0.3, p_corrupt=0.28), _run(1e-2, 0.27)]
    best = runs[2]
    reference = {"label": "Mamba", "lr": 1e-3, "dev_acc": 0.256, "at_chance": True, "paper_acc": None,
                 "verdict": runs[0]["verdict"], "record": "results/x", "why": "4000 steps are too few"}  # fmt: skip
    attention = {**reference, "label": "attention", "dev_acc": 1.0, "at_chance": False, "why": None,
                 "verdict": verdict({"attr:L1.block_in@value": 1.0, "mech_p_clean": 0.99, "mech_p_corrupt": 0.01})}
    task = {
        "task": "mqar", "spec": {"name": "mqar", "num_kv_pairs": 4}, "chance": 0.25, "at_chance": True, "ran": True,
        "lrs": [1e-3, 3e-3, 1e-2], "runs": runs, "best": best["run_id"], "verdict": best["verdict"], "inside": [],
        "lr_window": [1e-3, 3e-3, 1e-2], "left_out": [], "error": None, "view_error": None, "not_applied": [],
        "references": [attention, reference], "references_pending": [], "view": None,
    }  # fmt: skip
    rules = {"strong": 0.5, "present": 0.25, "min_effect": MIN_EFFECT, "patch_filter": PATCH_FILTER, "window": 0.05,
             "chance_margin": CHANCE_MARGIN}  # fmt: skip
    return {"suite": "quick", "about": "about", "model": {"mixer": "mine.py:M"}, "mixer_options": {}, "rules": rules,
            "verdict_site": "L1.block_in", "tasks": [task]}  # fmt: skip


def test_a_mixer_at_chance_gets_no_window_and_sits_beside_the_references():
    text = card_markdown(_chance_card())
    assert "Chance: 0.250 (a guess that knows the task's format" in text
    assert "Learning-rate window" not in text
    assert "**At chance**: the best dev accuracy, 0.270 at lr 0.01, is within 0.05 of chance (0.250)" in text
    assert "| 0.001 | finished | 0.256 (at chance) | neither |" in text
    # one table: this mixer first, then the references, with a reference's reason for failing
    table = text[text.index("| architecture |") :].splitlines()
    assert table[2].startswith("| **mine.py:M (this card)** | 0.01 | 0.270 (at chance) |")
    assert table[3].startswith("| attention | 0.001 | 1.000 |")
    assert table[4].startswith("| Mamba | 0.001 | 0.256 (at chance)")
    assert "- Mamba: 4000 steps are too few" in text
    # the run between the filters names both
    between = "neither (patching filter > 0.01: direct retrieval at layer 0)"
    assert f"| 0.003 | finished | 0.231 (at chance) | {between} |" in text


def test_a_mixer_that_learns_keeps_its_window():
    card = _chance_card()
    task = card["tasks"][0]
    task["at_chance"] = False
    task["runs"][2] = {**_run(1e-2, 0.97, value=1.0, p_clean=0.95, p_corrupt=0.05), "run_id": "lr0.01"}
    task["verdict"], task["lr_window"] = task["runs"][2]["verdict"], [1e-2]
    text = card_markdown(card)
    assert "Learning-rate window (within 0.05 of the best): 0.01 — 1 of 3 rates trained." in text
    assert "At chance" not in text.replace("(at chance)", "")


# -- the smoke-test options -------------------------------------------------------------------------
def test_tasks_runs_only_those_and_the_card_says_so(tiny_suite, tmp_path):  # noqa: F811
    card = evaluate(tmp_path / "e", mixer="attention", tasks=["mqar"], lrs=[3e-3], views=False, threads=1)
    ran = {task["task"]: [run["lr"] for run in task["runs"]] for task in card["tasks"]}
    assert ran == {"ar": [], "mqar": [3e-3], "atr": []}
    assert [task["ran"] for task in card["tasks"]] == [False, True, False]
    text = (tmp_path / "e" / "card.md").read_text()
    assert text.count("Not run: `--tasks` left it out.") == 2
    assert card["tasks"][1]["chance"] == 0.25


def test_steps_is_another_evaluation(tiny_suite, tmp_path):  # noqa: F811
    card = evaluate(tmp_path / "e", mixer="attention", tasks=["ar"], lrs=[3e-3], steps=3, views=False, threads=1)
    [run] = card["tasks"][0]["runs"]
    assert json.loads((tmp_path / "e" / "ar" / run["run_id"] / "summary.json").read_text())["steps"] == 3
    assert card["steps"] == 3
    assert "**Smoke test**: every run trained 3 steps" in (tmp_path / "e" / "card.md").read_text()
    assert json.loads((tmp_path / "e" / "evaluate.json").read_text())["steps"] == 3
    with pytest.raises(UsageError, match="holds the evaluation of attention on suite quick with --steps 3, not "):
        evaluate(tmp_path / "e", mixer="attention", tasks=["ar"], lrs=[3e-3], views=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "ar,nope"], "unknown task of suite quick 'nope'"),
        (["--tasks", "ar,ar"], "--tasks repeats a task"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
    ],
)
def test_bad_smoke_test_options_are_one_line(tmp_path, capsys, args, message):
    code, _, err = run_cli(["evaluate", "--arch", "attention", *args, "-o", tmp_path / "e"], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "e").exists()


def test_the_budget_says_what_a_run_costs_and_what_the_next_needs(tiny_suite, tmp_path, monkeypatch):  # noqa: F811
    # 10 ms a step: a 40-step run is estimated at 40 * 0.01 * OVERHEAD = 0.5 s
    monkeypatch.setattr(runner, "step_seconds", lambda run, device="cpu", threads=None: 0.01)
    messages: list[str] = []
    evaluate(tmp_path / "e", mixer="attention", budget_hours=1.2 / 3600, views=False, threads=1, log=messages.append)
    assert "ar: 10.0 ms a step here: one run of 40 steps ≈ 0.5 s" in messages
    kept = "--budget-hours 0.000333333 (1.2 s): 2 runs to train, estimated 1.0 s (ar lr 0.003, mqar lr 0.003)"
    assert kept in messages
    assert any("the next, atr lr 0.003, needs ≈ 0.5 s: --budget-hours 0.00042 would keep it" in m for m in messages)


def test_the_quick_suites_references_say_why_they_fail():
    """Every quick-suite reference at chance carries the reason, with its evidence."""
    bundled = json.loads((REPO / "hookmech" / "evaluate" / "references.json").read_text())["suites"]["quick"]
    chance = {task.name: tasks.from_spec(task.task).chance() for task in suite("quick").tasks}
    for name, entries in bundled.items():
        for entry in entries:
            if at_chance(entry["dev_acc"], chance[name]):
                assert entry.get("why"), (name, entry["label"])
