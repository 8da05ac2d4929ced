"""Tasks on the command line: `data` files and statistics, `train --data`, `patch --data`, ATR
and MQAR trained and patched by the commands, and their one-line errors."""
from __future__ import annotations

import json

import pytest

import hookmech
from hookmech import tasks
from hookmech.datasets import load_dataset, load_dataset_for, save_dataset
from hookmech.fileio import sha256_of
from hookmech.patching import patch

from helpers import ENGINE_TOL, assert_same_rows, make_model, run_cli

ATR = {"num_terminals": 6, "num_nonterminals": 6, "max_depth": 3, "max_rhs_len": 3, "max_length": 24}
ATR_OPTS = [f"{key}={value}" for key, value in ATR.items()]
MQAR_OPTS = ["vocab_size=32", "seq_len=16", "num_kv_pairs=2"]
TINY = ["--n-dev", "16", "--eval-every", "4", "--ckpt-every", "4", "--d-model", "16", "--no-tie-embeddings",
        "--threads", "1"]


def task_opts(options):
    """Return ``["--task-opt", o1, "--task-opt", o2, ...]``."""
    return [arg for option in options for arg in ("--task-opt", option)]


def test_cli_data_train_patch_round_trip(tmp_path, capsys):
    data = tmp_path / "atr.h5"
    code, out, err = run_cli(["data", "atr", *task_opts(ATR_OPTS), "--n", "48", "--seed", "2",
                          "-o", data], capsys)
    assert code == 0, err
    task, rows = load_dataset(data)
    assert_same_rows(rows, tasks.make("atr", **ATR).sample(48, seed=2))
    code, out, err = run_cli(["train", "--data", data, "--epochs", "1", "--batch-size", "16", *TINY, "-o", tmp_path / "run"],
                         capsys)
    assert code == 0, err
    ckpt = tmp_path / "run" / "model.safetensors"
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["task"] == task.spec and record["train"]["n_train"] == 48
    assert record["train_set_sha256"] == sha256_of(data)
    assert hookmech.tasks.from_checkpoint(ckpt).spec == task.spec
    code, out, err = run_cli(["patch", "--ckpt", ckpt, "--data", data, "--site", "L1.block_in", "--pos", "key,value,query,divider",
                          "--json"], capsys)
    assert code == 0, err
    records = json.loads(out)
    reference = patch(hookmech.load(ckpt), rows, ["L1.block_in"], ["key", "value", "query", "divider"])
    assert [r["n"] for r in records] == [48] * 4
    for got, want in zip(records, reference, strict=True):  # the CLI calls patch with its defaults: exact
        assert got["pos"] == want["pos"] and got["p_patched"] == want["p_patched"]


@pytest.mark.parametrize("name,options", [("atr", ATR_OPTS), ("mqar", MQAR_OPTS)])
def test_train_and_patch_atr_and_mqar_from_the_command_line(name, options, tmp_path, capsys):
    task_args = ["--task", name, *task_opts(options)]
    code, out, err = run_cli(["train", *task_args, "--n-train", "0", "--steps", "8", "--batch-size", "8", *TINY,
                          "-o", tmp_path / "run"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["status"] == "finished" and 0 <= summary["dev_acc"] <= 1
    ckpt = tmp_path / "run" / "model.safetensors"
    code, out, err = run_cli(["patch", "--ckpt", ckpt, "--site", "L*.block_in", "--pos", "key,value,query", "--n", "12",
                          "--json", "--threads", "1"], capsys)
    assert code == 0, err
    records = json.loads(out)
    assert len(records) == 6 and all(r["n"] == 12 for r in records)
    # patching the query position at the first block replaces the whole corrupt input there: only
    # the key differs between clean and corrupt, and it precedes the query, so nothing changes
    query = next(r for r in records if r["site"] == "L0.block_in" and r["pos"] == "query")
    assert query["p_patched"] == pytest.approx(query["p_corrupt"], abs=ENGINE_TOL)  # engine vs an unpatched run


def test_mqar_has_no_divider(tmp_path, capsys):
    task = tasks.make("mqar", vocab_size=32, seq_len=16, num_kv_pairs=2)
    ckpt = tmp_path / "m.safetensors"
    hookmech.save(make_model(task, d_model=16), ckpt, task_spec=task.spec)
    code, _, err = run_cli(["patch", "--ckpt", ckpt, "--site", "L1.block_in", "--pos", "divider", "--n", "4"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "divider" in err and "key, value, query" in err


def test_patch_data_with_a_held_out_split(tmp_path, capsys):
    """A model trained on split=train is patched on split=test rows; another task is refused."""
    model_task = tasks.make("ar", vocab_size=16, num_kv_pairs=3, split="train")
    ckpt = tmp_path / "m.safetensors"
    hookmech.save(make_model(model_task, d_model=16), ckpt, task_spec=model_task.spec)
    test_task = tasks.make("ar", vocab_size=16, num_kv_pairs=3, split="test")
    save_dataset(test_task.sample(10, seed=0), test_task, tmp_path / "test.h5")
    assert len(load_dataset_for(tmp_path / "test.h5", model_task)) == 10
    code, out, err = run_cli(["patch", "--ckpt", ckpt, "--data", tmp_path / "test.h5", "--site", "L1.block_in", "--pos", "value",
                          "--json"], capsys)
    assert code == 0 and json.loads(out)[0]["n"] == 10, err
    other = tasks.make("ar", vocab_size=16, num_kv_pairs=2)
    save_dataset(other.sample(4, seed=0), other, tmp_path / "other.h5")
    code, _, err = run_cli(["patch", "--ckpt", ckpt, "--data", tmp_path / "other.h5", "--site", "L1.block_in", "--pos", "value"],
                       capsys)
    assert code == 1 and "num_kv_pairs" in err


def test_data_stats_prints_json(capsys):
    code, out, err = run_cli(["data", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3", "--stats", "--n", "20",
                          "--json"], capsys)
    assert code == 0, err
    stats = json.loads(out)
    assert stats["rows"] == 20 and stats["length"]["mean"] == 9 and stats["task"]["num_kv_pairs"] == 3
    code, out, err = run_cli(["data", "atr", *task_opts(ATR_OPTS), "--stats", "--n", "30"], capsys)
    assert code == 0 and "length_mean:" in out and "kv_abs_distance:" in out


@pytest.mark.parametrize("argv,code,needle", [
    (["data", "ar", "--n", "4"], 2, "--stats"),
    (["data", "ar", "--stats", "-o", "{tmp}/d.h5"], 2, "not both"),
    (["data", "ar", "--json", "-o", "{tmp}/d.h5"], 2, "--json"),
    (["data", "atrr", "--stats"], 2, "atr"),
    (["data", "ar", "--n", "0", "-o", "{tmp}/d.h5"], 2, "--n"),
    (["data", "mqar", "--task-opt", "num_kv_pair=2", "--stats"], 2, "num_kv_pairs"),
    (["train", "--data", "{data}", "--task", "atr", "--steps", "2", "-o", "{tmp}/x"], 2, "--task atr"),
    (["train", "--data", "{data}", "--task-opt", "num_kv_pairs=4", "--steps", "2", "-o", "{tmp}/x"], 2, "num_kv_pairs=4"),
    (["train", "--data", "{data}", "--n-train", "100", "--steps", "2", "-o", "{tmp}/x"], 2, "--n-train"),
    (["train", "--data", "{tmp}/missing.h5", "--steps", "2", "-o", "{tmp}/x"], 1, "no such"),
    (["patch", "--ckpt", "{ckpt}", "--data", "{data}", "--n", "5", "--site", "L1.block_in", "--pos", "value"], 2, "--n"),
    (["patch", "--ckpt", "{ckpt}", "--data", "{data}", "--cache", "{data}", "--site", "L1.block_in", "--pos", "value"], 2,
     "--cache"),
])
def test_data_errors_are_one_line(argv, code, needle, tmp_path, capsys):
    task = tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    data = tmp_path / "ar.h5"
    save_dataset(task.sample(12, seed=0), task, data)
    ckpt = tmp_path / "m.safetensors"
    hookmech.save(make_model(task, d_model=16), ckpt, task_spec=task.spec)
    argv = [a.format(tmp=tmp_path, data=data, ckpt=ckpt) for a in argv]
    got, _, err = run_cli(argv, capsys)
    assert got == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hookmech: error:") and needle in lines[0], err
    assert not (tmp_path / "x").exists() and not (tmp_path / "d.h5").exists()


def test_train_data_accepts_agreeing_task_options(tmp_path, capsys):
    task = tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    data = tmp_path / "ar.h5"
    save_dataset(task.sample(16, seed=0), task, data)
    code, _, err = run_cli(["train", "--data", data, "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "corrupt=key",
                          "--n-train", "16", "--steps", "4", *TINY, "-o", tmp_path / "run"], capsys)
    assert code == 0, err
