"""`--task`, `--task-opt` and `--data` (prompts) on cache, patch, view and das: the tokenizer tasks
end to end on a random hookmech model whose d_vocab covers a tokenizer made in the test (no
download, nothing trained), the numbers the library gives for the same rows, the token names of
the view, and each misuse as one line with its exit code."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from tokenizer_files import bpe_tokenizer, saved_random_model

import hookmech
from hookmech import tasks
from hookmech.cache import CacheFile
from hookmech.patching import patch
from hookmech.view import read_page_data, unpack

from helpers import ATTENTION_FIXTURE, CACHE_TOL, run_cli


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(folder, tokenizer folder, checkpoint without a task whose d_vocab covers the tokenizer)."""
    folder = tmp_path_factory.mktemp("tokenizer_tasks")
    tokenizer, _ = bpe_tokenizer(folder / "bpe")
    d_vocab = tasks.make("induction", tokenizer=str(tokenizer)).d_vocab
    # a few ids beyond the tokenizer's, as pretrained models pad their embeddings
    return folder, tokenizer, saved_random_model(folder / "model.safetensors", d_vocab + 3)


def one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and err.startswith("hookmech: error:")


def test_patch_task_nl_ar_end_to_end_is_the_librarys_patch(setup, capsys):
    _, tokenizer, ckpt = setup
    code, out, err = run_cli(
        ["patch", "--ckpt", ckpt, "--task", "nl-ar", "--task-opt", f"tokenizer={tokenizer}", "--task-opt",
         "num_kv_pairs=3", "--site", "L*.block_in", "--pos", "key,value,query", "--n", "12", "--threshold", "0",
         "--json"],
        capsys,
    )
    assert code == 0, err
    records = json.loads(out)
    task = tasks.make("nl-ar", tokenizer=str(tokenizer), num_kv_pairs=3)
    expected = patch(hookmech.load(ckpt), task.sample(12, seed=1), ["L*.block_in"], ["key", "value", "query"],
                     threshold=0)
    assert [(r["site"], r["pos"]) for r in records] == [(s, p) for s in ("L0.block_in", "L1.block_in")
                                                         for p in ("key", "value", "query")]
    for got, want in zip(records, expected, strict=True):
        assert got["n"] == 12 and got["p_patched"] == want["p_patched"]  # the same computation: exact


def test_cache_records_the_tokenizer_and_patch_and_view_read_it(setup, tmp_path, capsys):
    _, tokenizer, ckpt = setup
    cache = tmp_path / "c.h5"
    options = ["--task", "induction", "--task-opt", f"tokenizer={tokenizer}", "--task-opt", "seq_len=6",
               "--task-opt", "bos=true"]
    code, _, err = run_cli(["cache", "--ckpt", ckpt, *options, "--n", "10", "-o", cache], capsys)
    assert code == 0, err
    task = tasks.make("induction", tokenizer=str(tokenizer), seq_len=6, bos=True)
    with CacheFile(cache) as opened:
        assert opened.task == task.spec and opened.task["tokenizer"] == str(tokenizer.resolve())
    nodes = ["--site", "L1.block_in,L0.mixer_out", "--pos", "key,value,query", "--threshold", "0"]
    code, from_cache, err = run_cli(["patch", "--ckpt", ckpt, "--cache", cache, *nodes, "--json"], capsys)
    assert code == 0, err
    code, fresh, err = run_cli(["patch", "--ckpt", ckpt, *options, "--n", "10", *nodes, "--json"], capsys)
    assert code == 0, err
    for a, b in zip(json.loads(from_cache), json.loads(fresh), strict=True):
        assert a["p_patched"] == pytest.approx(b["p_patched"], abs=CACHE_TOL)
    # the view of the cache names tokens by the cache's task: the tokenizer's texts
    code, _, err = run_cli(["view", "--ckpt", ckpt, "--cache", cache, "--pos", "key,query", "-o", tmp_path / "p.html"],
                           capsys)
    assert code == 0, err
    data = read_page_data(tmp_path / "p.html")
    batch = task.sample(10, seed=1)
    assert data["vocab"] == task.token_names(task.d_vocab + 3) and data["vocab"][-1] == f"<unused {task.d_vocab + 2}>"
    assert data["task"] == task.spec
    rows = data["rows"]
    tokens = unpack(rows["tokens"]).reshape(rows["n"], rows["pos"])
    assert np.array_equal(tokens, batch.tokens.numpy())
    shown = "".join(data["vocab"][t] for t in tokens[0, : rows["lengths"][0]])
    assert shown == task.describe_tokens(batch.tokens[0, : batch.lengths[0]].tolist())
    assert shown.startswith("<|endoftext|>")
    # das reads the cache alone: a checkpoint without a task is fine
    code, _, err = run_cli(["das", "--ckpt", ckpt, "--cache", cache, "--site", "L1.block_in", "--pos", "query",
                            "--dim", "2", "--steps", "2", "-o", tmp_path / "das"], capsys)
    assert code == 0, err


def test_prompts_through_patch_cache_and_view(setup, tmp_path, capsys):
    _, tokenizer, ckpt = setup
    lines = []
    for text, key, answer in ((" cat door, tree milk, cat", "cat", " door"), (" owl pear, salt tent, salt", "salt", " tent"),
                              (" sun moon, key ring, key", "key", " ring")):
        start = text.index(key)  # the key in context, replaced by " fish" in the corrupt text
        lines.append({"clean": text, "corrupt": text[:start] + "fish" + text[start + len(key):], "answer": answer,
                      "roles": {"key": [start, start + len(key)]}})
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    prompt_options = ["--task", "prompts", "--data", data, "--task-opt", f"tokenizer={tokenizer}"]
    code, out, err = run_cli(["patch", "--ckpt", ckpt, *prompt_options, "--site", "L1.block_in", "--pos", "key,query",
                              "--threshold", "0", "--json"], capsys)
    assert code == 0, err
    task = tasks.make("prompts", data=str(data), tokenizer=str(tokenizer))
    expected = patch(hookmech.load(ckpt), task.sample(3, seed=0), ["L1.block_in"], ["key", "query"], threshold=0)
    # --n left out: every prompt
    assert [r["n"] for r in json.loads(out)] == [3, 3]
    assert [r["p_patched"] for r in json.loads(out)] == [r["p_patched"] for r in expected]
    code, out, err = run_cli(["patch", "--ckpt", ckpt, *prompt_options, "--n", "2", "--site", "L1.block_in", "--pos",
                              "key", "--threshold", "0", "--json"], capsys)
    assert code == 0 and json.loads(out)[0]["n"] == 2, err
    code, _, err = run_cli(["cache", "--ckpt", ckpt, *prompt_options, "-o", tmp_path / "c.h5"], capsys)
    assert code == 0 and "3 examples" in _, err
    code, _, err = run_cli(["view", "--ckpt", ckpt, *prompt_options, "--site", "L1.block_in", "-o",
                            tmp_path / "p.html"], capsys)
    assert code == 0, err
    page = read_page_data(tmp_path / "p.html")
    assert page["rows"]["n"] == 3 and set(page["rows"]["roles"]) == {"key", "query"}
    code, out, err = run_cli(["data", "prompts", "--task-opt", f"data={data}", "--task-opt", f"tokenizer={tokenizer}",
                              "-o", tmp_path / "d.h5"], capsys)
    assert code == 0 and "3 rows of prompts" in out, err


def test_task_opt_alone_changes_the_checkpoints_own_task(capsys):
    base = ["patch", "--ckpt", ATTENTION_FIXTURE, "--site", "L1.block_in", "--pos", "value", "--n", "20", "--json"]
    code, by_option, err = run_cli([*base, "--task-opt", "corrupt=value"], capsys)
    assert code == 0, err
    code, by_flag, err = run_cli([*base, "--corrupt", "value"], capsys)
    assert code == 0, err
    assert json.loads(by_option) == json.loads(by_flag)


def test_misuse_is_one_line_with_its_exit_code(setup, tmp_path, capsys):
    folder, tokenizer, ckpt = setup
    nodes = ["--site", "L1.block_in", "--pos", "key"]
    tok = ["--task-opt", f"tokenizer={tokenizer}"]
    (tmp_path / "p.jsonl").write_text(json.dumps({"clean": " cat", "corrupt": " cat cat", "answer": " cat"}) + "\n")
    small = saved_random_model(tmp_path / "small.safetensors", d_vocab=50)
    cases = [
        (["patch", "--ckpt", ckpt, *nodes], 2, "stores no task: give one with --task"),
        (["patch", "--ckpt", ckpt, "--task", "nl-ar", *nodes], 2, "nl-ar: needs a tokenizer"),
        (["patch", "--ckpt", ckpt, "--task", "nl_ar", *nodes], 2, "unknown task 'nl_ar'"),
        (["patch", "--ckpt", ckpt, "--task", "nl-ar", *tok, "--cache", tmp_path / "c.h5", *nodes], 2,
         "--cache holds its own examples"),
        (["patch", "--ckpt", ckpt, "--data", tmp_path / "p.jsonl", *nodes], 2, "read with --task prompts"),
        (["cache", "--ckpt", ckpt, "--task", "nl-ar", *tok, "--data", tmp_path / "p.jsonl", "-o", tmp_path / "c.h5"],
         2, "add --task prompts"),
        (["patch", "--ckpt", ckpt, "--task", "prompts", "--data", tmp_path / "p.jsonl", *tok, *nodes], 1,
         "line 1: clean and corrupt texts tokenize to 1 and 2 tokens"),
        (["patch", "--ckpt", small, "--task", "induction", *tok, *nodes], 1, "beyond the model's d_vocab 50"),
        (["view", "--ckpt", ckpt, "--cache", tmp_path / "c.h5", "--task", "induction", "-o", tmp_path / "v.html"], 2,
         "--cache holds its own examples"),
        (["patch", "--ckpt", ckpt, "--task", "induction", *tok, "--task-opt", "seq_len=1", *nodes], 2,
         "seq_len must be >= 2"),
    ]
    for argv, expected_code, message in cases:
        code, _, err = run_cli(argv, capsys)
        assert code == expected_code and one_line(err) and message in err, (argv, err)


def test_a_tokenizer_changed_after_the_cache_is_refused(tmp_path, capsys):
    tokenizer, _ = bpe_tokenizer(tmp_path / "bpe")
    ckpt = saved_random_model(tmp_path / "m.safetensors", tasks.make("induction", tokenizer=str(tokenizer)).d_vocab)
    cache = tmp_path / "c.h5"
    code, _, err = run_cli(["cache", "--ckpt", ckpt, "--task", "induction", "--task-opt", f"tokenizer={tokenizer}",
                            "--n", "4", "-o", cache], capsys)
    assert code == 0, err
    (tokenizer / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    code, _, err = run_cli(["view", "--ckpt", ckpt, "--cache", cache, "-o", tmp_path / "v.html"], capsys)
    assert code == 1 and one_line(err) and "changed since the spec was made" in err


def test_a_missing_tokenizers_library_is_one_line(setup, monkeypatch, capsys):
    _, tokenizer, ckpt = setup
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    code, _, err = run_cli(["patch", "--ckpt", ckpt, "--task", "nl-ar", "--task-opt", f"tokenizer={tokenizer}",
                            "--site", "L1.block_in", "--pos", "key"], capsys)
    assert code == 1 and one_line(err) and "pip install 'hookmech[hf]'" in err


def test_task_names_of_the_command_line_are_the_registry():
    from hookmech.cli.common import TASK_NAMES

    assert TASK_NAMES == tuple(tasks.REGISTRY)
