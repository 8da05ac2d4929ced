"""scripts/heldout_accuracy.py: a run's checkpoint scored on larger dev (and test) sets.

The reference is a row-by-row forward pass of the same documents (no batching, no padding) and
the split's definition (`held_out` of each row's (answer, key) pair).
"""

from __future__ import annotations

import json
import runpy

import numpy as np
import torch
from helpers import ENGINE_TOL, REPO, make_model, unit_variance

import hookmech
from hookmech import tasks
from hookmech.tasks.draws import held_out

script = runpy.run_path(str(REPO / "scripts" / "heldout_accuracy.py"))


def row_by_row(model, batch):
    """Return (accuracy, mean p(answer)) of `batch` from one unpadded forward per row."""
    correct, p_answer = [], []
    for row in range(len(batch.answers)):
        query = int(batch.query_pos[row])
        with torch.no_grad():
            logits = model(batch.tokens[row : row + 1, : query + 1])[0, query]
        correct.append(int(logits.argmax()) == int(batch.answers[row]))
        p_answer.append(float(logits.softmax(-1)[batch.answers[row]]))
    return float(np.mean(correct)), float(np.mean(p_answer))


def assert_scored_as(written, acc, p_answer, n):
    assert 0 < acc < 1
    assert written["acc"] == acc
    assert abs(written["p_answer"] - p_answer) <= ENGINE_TOL  # batched vs one row
    assert abs(written["acc_se"] - np.sqrt(acc * (1 - acc) / n)) <= 1e-12


def test_scores_each_split_as_a_row_by_row_forward_does(tmp_path):
    task = tasks.from_spec({"name": "atr", "split": "train"})
    model = unit_variance(make_model(task, seed=3))  # varied argmaxes: some right, most wrong
    checkpoint = hookmech.save(model, tmp_path / "model.safetensors", task_spec=task.spec)
    assert script["main"]([str(checkpoint), "--n", "64", "--seed", "5"]) == 0
    written = json.loads((tmp_path / "heldout-64.json").read_text())

    for index, split in enumerate(("dev", "test")):
        batch = tasks.from_spec({**task.spec, "split": split}).sample(64, seed=(5, index))
        keys = batch.tokens[torch.arange(64), batch.role("key")].numpy()
        held = held_out(batch.answers.numpy(), keys, 0)
        assert held.all() if split == "test" else not held.any()
        assert_scored_as(written[split], *row_by_row(model, batch), 64)


def test_a_task_without_a_split_is_scored_on_dev_only(tmp_path):
    task = tasks.from_spec({"name": "atr"})
    model = unit_variance(make_model(task, seed=3))
    checkpoint = hookmech.save(model, tmp_path / "model.safetensors", task_spec=task.spec)
    assert script["main"]([str(checkpoint), "--n", "64", "--seed", "5"]) == 0
    written = json.loads((tmp_path / "heldout-64.json").read_text())
    assert set(written) == {"n", "seed", "dev"}
    assert_scored_as(written["dev"], *row_by_row(model, task.sample(64, seed=(5, 0))), 64)


def test_a_checkpoint_without_a_task_is_refused_in_one_line(tmp_path, capsys):
    task = tasks.from_spec({"name": "atr"})
    checkpoint = hookmech.save(make_model(task), tmp_path / "model.safetensors")
    assert script["main"]([str(checkpoint), "--n", "8"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "names no task" in error
    assert not (tmp_path / "heldout-8.json").exists()


def test_results_md_table_of_4096_documents_reads_the_committed_records():
    """Each row of docs/results.md's table "the size of the evaluation sets" names its run folder,
    one row for each run with a heldout-4096.json; its four accuracies are that run's summary.json,
    test.json and heldout-4096.json."""
    text = (REPO / "docs" / "results.md").read_text()
    table = text[text.index("| run (`results/atr-split/NAME.toml`)") :].split("\n\n")[0]
    rows = {row.split("`")[1]: row for row in table.splitlines()[2:]}
    scored_runs = {path.parts[-3] for path in (REPO / "results" / "atr-split").glob("*/*/heldout-4096.json")}
    assert set(rows) == scored_runs  # a row for every run scored, none for a run not scored
    for name, row in rows.items():
        (scored_file,) = (REPO / "results" / "atr-split" / name).glob("*/heldout-4096.json")
        records = scored_file.parent
        dev = json.loads((records / "summary.json").read_text())["dev_acc"]
        test = json.loads((records / "test.json").read_text())["test_acc"]
        scored = json.loads(scored_file.read_text())
        expected = [dev, scored["dev"]["acc"], test, scored["test"]["acc"]]
        shown = [float(cell.strip(" *")) for column in row.split("|")[2:4] for cell in column.split("/")]
        assert shown == [round(value, 3) for value in expected], name
