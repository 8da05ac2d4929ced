"""`hookmech evaluate` end to end on a shrunken quick suite (`tiny_suite`: the quick suite's three
tasks at 40 steps, two learning rates, 24 measured rows), with a mixer written outside the
repository (docs/your_mixer.md's) and with a built-in one.

References: the card's attributions against the plain `run_with_hooks` loop
(hookmech.oracles.plain_loop_patch) on the best checkpoint at ENGINE_TOL; its verdict against
`verdict` of those numbers; its best run against the results table; a rerun against the first
card byte for byte; the budget's plan against a hand count. The quick suite at full length
runs in the slow test (and is the bundled references' own command)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
from helpers import ENGINE_TOL, REPO, run_cli
from test_your_mixer import page_mixer_source

import hookmech.evaluate.runner as runner
from hookmech.errors import UsageError
from hookmech.evaluate import evaluate, suite
from hookmech.evaluate.card import task_rows

TINY_STEPS = 40
TINY_ROWS = 24


def tiny(name: str):
    """The suite `name` at TINY_STEPS steps, its first two learning rates, small dev sets."""
    full = suite(name)
    train = {"steps": TINY_STEPS, "eval_every": 20, "ckpt_every": 20, "n_dev": 32, "n_train": 0}
    tasks = tuple(
        dataclasses.replace(t, train={**{k: v for k, v in t.train.items() if k != "epochs"}, **train}, lrs=t.lrs[:2])
        for t in full.tasks
    )
    return dataclasses.replace(full, tasks=tasks)


@pytest.fixture
def tiny_suite(monkeypatch):
    monkeypatch.setattr(runner, "suite", tiny)
    monkeypatch.setattr(runner, "MECH_N", TINY_ROWS)


@pytest.fixture
def smear(tmp_path):
    folder = tmp_path / "mixers"
    folder.mkdir()
    (folder / "smear.py").write_text(page_mixer_source())
    return f"{folder / 'smear.py'}:SmearAttention"


def test_a_mixer_outside_the_repository_is_evaluated_by_one_command(tiny_suite, smear, tmp_path, capsys):
    out = tmp_path / "eval"
    code, stdout, err = run_cli(["evaluate", "--mixer", smear, "--threads", "1", "-o", out], capsys)
    assert code == 0, err
    card = json.loads((out / "card.json").read_text())
    assert card["model"] == {"mixer": str((tmp_path / "mixers" / "smear.py").resolve()) + ":SmearAttention"}
    assert [task["task"] for task in card["tasks"]] == ["ar", "mqar", "atr"]
    for task in card["tasks"]:
        rows = task_rows(out / task["task"])
        assert sorted(row["lr"] for row in rows) == [1e-3, 3e-3] and all(r["status"] == "finished" for r in rows)
        most_accurate = max(rows, key=lambda row: (row["dev_acc"], -row["lr"]))  # ties: the smaller rate
        assert task["best"] == most_accurate["run_id"]
        by_lr = sorted(rows, key=lambda row: row["lr"])
        assert [run["dev_acc"] for run in task["runs"]] == [row["dev_acc"] for row in by_lr]
        assert (out / task["view"]).is_file()
        assert f"{task['task']}: {task['verdict']['label']}\n" in stdout
    assert "## mqar" in (out / "card.md").read_text()
    assert str(out / "card.md") in stdout


def test_the_cards_numbers_are_the_plain_loops(tiny_suite, tmp_path):
    """The card's L1.block_in attributions of each task's best run, recomputed by the plain loop."""
    from hookmech import tasks
    from hookmech.checkpoint import load, read_metadata
    from hookmech.mech import mech_batch
    from hookmech.oracles import plain_loop_patch

    card = evaluate(tmp_path / "e", mixer="attention", mixer_options={"L0.window": 2}, views=False, threads=1)
    for task in card["tasks"]:
        ckpt = tmp_path / "e" / task["task"] / task["best"] / "model.safetensors"
        model, spec = load(ckpt), read_metadata(ckpt)["task"]
        batch = mech_batch(tasks.from_spec(spec), 0, TINY_ROWS).trimmed()
        reference = plain_loop_patch(model, batch, ["L1.block_in"], ["key", "value", "query"])
        numbers = task["verdict"]["numbers"]
        compared = 0
        for (_hook, pos), record in reference.items():
            moved = record["p_patched"] - record["p_corrupt"]
            effect = record["p_clean"] - record["p_corrupt"]
            # attribution × effect = p_patched − p_corrupt: well conditioned however small the effect
            assert abs(numbers["effect"] - effect) <= 2 * ENGINE_TOL  # contract: engine vs plain loop
            assert abs(numbers[pos] * numbers["effect"] - moved) <= 3 * ENGINE_TOL, (task["task"], pos)
            compared += 1
        assert compared == 3


def test_a_rerun_trains_nothing_and_writes_the_same_card(tiny_suite, tmp_path):
    import torch

    threads = torch.get_num_threads()
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    first = evaluate(tmp_path / "e", mixer="attention", views=False, threads=threads + 1)
    # the runs trained in this process: the caller keeps its threads and its random stream
    assert torch.get_num_threads() == threads and torch.equal(torch.rand(2), expected)
    before = (tmp_path / "e" / "card.json").read_bytes()
    messages = []
    again = evaluate(tmp_path / "e", mixer="attention", views=False, threads=1, log=messages.append)
    assert again == first and (tmp_path / "e" / "card.json").read_bytes() == before
    assert sum("2 already done, 0 to run" in message for message in messages) == 3


def test_another_evaluation_in_the_same_folder_is_refused(tiny_suite, tmp_path):
    evaluate(tmp_path / "e", mixer="attention", views=False, threads=1)
    with pytest.raises(UsageError, match="holds the evaluation of attention on suite quick, not mamba on suite quick"):
        evaluate(tmp_path / "e", mixer="mamba", views=False)
    with pytest.raises(UsageError, match="not attention L0.window=2 on suite quick"):
        evaluate(tmp_path / "e", mixer="attention", mixer_options={"L0.window": 2}, views=False)
    assert json.loads((tmp_path / "e" / "evaluate.json").read_text())["model"] == {"mixer": "attention"}


def test_the_budget_keeps_runs_in_priority_order_and_the_card_lists_the_rest(tiny_suite, tmp_path, monkeypatch):
    # 10 ms a step: a 40-step run is estimated at 40 * 0.01 * OVERHEAD = 0.5 s
    monkeypatch.setattr(runner, "step_seconds", lambda run, device="cpu", threads=None: 0.01)
    budget = 1.2 / 3600  # room for two runs: ar and mqar at the first rate (3e-3)
    card = evaluate(tmp_path / "e", mixer="attention", budget_hours=budget, views=False, threads=1)
    kept = {task["task"]: [run["lr"] for run in task["runs"]] for task in card["tasks"]}
    assert kept == {"ar": [3e-3], "mqar": [3e-3], "atr": []}
    assert {task["task"]: task["left_out"] for task in card["tasks"]} == {
        "ar": [1e-3], "mqar": [1e-3], "atr": [1e-3, 3e-3]}
    text = (tmp_path / "e" / "card.md").read_text()
    assert "Left out by the budget: lr 0.001, 0.003." in text and "No run finished: no verdict." in text
    # the same budget again: finished runs cost nothing, so the next two in priority order fit
    card = evaluate(tmp_path / "e", mixer="attention", budget_hours=budget, views=False, threads=1)
    assert {task["task"]: task["left_out"] for task in card["tasks"]} == {"ar": [], "mqar": [1e-3], "atr": [1e-3]}


def test_the_paper_suite_bundles_the_six_architectures_with_the_papers_numbers(tiny_suite, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "step_seconds", lambda run, device="cpu", threads=None: 1.0)
    card = evaluate(tmp_path / "e", mixer="attention", suite_name="paper", budget_hours=1e-3, views=False)
    ar = card["tasks"][0]
    assert ar["runs"] == [] and ar["left_out"] == [1e-3, 3e-3]  # nothing fits, nothing trains
    labels = {ref["label"]: (ref["verdict"]["label"], ref["paper_acc"]) for ref in ar["references"]}
    assert labels == {
        "attention": ("induction at layer 1", 1.0),
        "Based (BaseConv + Based)": ("induction at layer 1", 0.9906),
        "Mamba": ("direct retrieval at layer 1", 0.8062),
        "H3": ("neither", 0.0188),
        "Hyena": ("neither", 0.0281),
        "BaseConv (short + long conv)": ("neither", 0.0375),
    }
    for ref in ar["references"]:
        assert (REPO / ref["record"] / "summary.json").is_file()
    # ATR: each of the six is either a bundled run or listed as pending, never both, with the paper's number
    atr = card["tasks"][1]
    bundled = {ref["label"] for ref in atr["references"]}
    pending = {entry["label"] for entry in atr["references_pending"]}
    assert bundled | pending == set(labels) and not bundled & pending
    assert all(entry["paper_acc"] > 0.8 for entry in [*atr["references"], *atr["references_pending"]])
    text = (tmp_path / "e" / "card.md").read_text()
    assert ("Not bundled yet (their runs have not finished): " in text) == bool(pending)


def test_a_mixer_without_the_suites_options_runs_without_them(tiny_suite, smear, tmp_path, monkeypatch):
    """The paper suite's `bias = false` is zoology's option of the built-in mixers; a mixer of your
    own without a `bias` option is evaluated without it, and the card says so."""
    monkeypatch.setattr(runner, "step_seconds", lambda run, device="cpu", threads=None: 1.0)
    card = evaluate(tmp_path / "e", mixer=smear, suite_name="paper", budget_hours=1e-4, views=False)
    assert [task["not_applied"] for task in card["tasks"]] == [["bias"], ["bias"]]
    assert "The suite's mixer options `bias` were not applied" in (tmp_path / "e" / "card.md").read_text()
    assert all(task["runs"] == [] for task in card["tasks"])  # nothing fits 0.36 s


def test_the_references_are_what_the_committed_records_give():
    import runpy

    script = runpy.run_path(str(REPO / "scripts" / "evaluate_references.py"))
    bundled = REPO / "hookmech" / "evaluate" / "references.json"
    assert script["build"]() == bundled.read_text()


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (the dist extra)")
def test_ray_gives_the_same_card(tiny_suite, tmp_path):
    local = evaluate(tmp_path / "local", mixer="attention", views=False, threads=1)
    on_ray = evaluate(tmp_path / "ray", mixer="attention", views=False, engine="ray", workers=2, threads=1)

    def without_times(card):
        for task in card["tasks"]:
            for run in task["runs"]:
                run.pop("seconds")
        return card

    assert without_times(on_ray) == without_times(local)


@pytest.mark.slow
def test_the_quick_suite_on_attention(tmp_path):
    """The full quick suite (about 15 minutes on one core): attention recalls AR by induction."""
    card = evaluate(tmp_path / "e", mixer="attention", mixer_options={"L0.window": 2}, views=False, threads=1)
    ar = card["tasks"][0]
    assert ar["verdict"]["mechanism"] == "induction" and max(run["dev_acc"] for run in ar["runs"]) > 0.9
