"""Every task through the whole pipeline in the library: dataset files, training on a given set,
ATR and MQAR training and patching, padding invariance, task statistics (the same through the
commands: tests/cli/test_data.py)."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

import hookmech
from hookmech import tasks
from hookmech.config import build_config
from hookmech.datasets import (
    batch_statistics,
    check_fits_model,
    load_dataset,
    read_dataset_header,
    save_dataset,
    task_statistics,
)
from hookmech.errors import HookmechError
from hookmech.patching import patch
from hookmech.tasks.atr import TreeBatch, atr_statistics
from hookmech.training import TrainConfig, answer_loss, evaluate, train

from helpers import ENGINE_TOL, assert_same_rows, make_model


def atr_task(**extra):
    return tasks.make("atr", num_terminals=6, num_nonterminals=6, max_depth=3, max_rhs_len=3, max_length=24, **extra)


# -- dataset files ---------------------------------------------------------------------------
@pytest.mark.parametrize("task", [
    tasks.make("ar", vocab_size=16, num_kv_pairs=3, query_by="value"),
    tasks.make("mqar", vocab_size=32, seq_len=16, num_kv_pairs=2),
    atr_task(query="sibling"),
], ids=["ar", "mqar", "atr"])
def test_dataset_file_round_trips_every_field(task, tmp_path):
    batch = task.sample(37, seed=5)
    save_dataset(batch, task, tmp_path / "d.h5", seed=5)
    loaded_task, loaded = load_dataset(tmp_path / "d.h5")
    assert loaded_task.spec == task.spec
    assert_same_rows(batch, loaded)
    if isinstance(batch, TreeBatch):
        assert torch.equal(loaded.parent_pos, batch.parent_pos)
    header = read_dataset_header(tmp_path / "d.h5")
    assert header["seed"] == 5 and header["n"] == 37 and header["width"] == batch.tokens.shape[1]
    with h5py.File(tmp_path / "d.h5") as h5:  # the documented layout, nothing pickled
        assert h5.attrs["format"] == "hookmech-dataset"
        assert h5["tokens/clean"].dtype == np.int32 and h5["roles/query"].shape == (37,)
        assert json.loads(h5.attrs["task"]) == task.spec


def test_dataset_loader_refuses_bad_files(tmp_path):
    task = atr_task()
    save_dataset(task.sample(8, seed=0), task, tmp_path / "d.h5")
    with h5py.File(tmp_path / "d.h5", "r+") as h5:
        h5["tokens/clean"][0, 1] = task.d_vocab  # one token outside the vocabulary
    with pytest.raises(HookmechError, match="vocabulary"):
        load_dataset(tmp_path / "d.h5")
    save_dataset(task.sample(8, seed=0), task, tmp_path / "d.h5")
    with h5py.File(tmp_path / "d.h5", "r+") as h5:
        del h5["roles/divider"]
    with pytest.raises(HookmechError, match="divider"):
        load_dataset(tmp_path / "d.h5")
    (tmp_path / "junk.h5").write_bytes(b"\x80\x04junk")
    with pytest.raises(HookmechError, match="not an HDF5"):
        load_dataset(tmp_path / "junk.h5")
    with h5py.File(tmp_path / "cache.h5", "w") as h5:
        h5.attrs["format"] = "hookmech-cache"
    with pytest.raises(HookmechError, match="--cache"):
        load_dataset(tmp_path / "cache.h5")


def test_failed_write_leaves_the_previous_file(tmp_path):
    task = tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    path = tmp_path / "d.h5"
    save_dataset(task.sample(4, seed=0), task, path)
    before = path.read_bytes()
    bad = task.sample(4, seed=1)
    bad.roles["key"] = bad.roles["key"][:2]  # a role with too few rows
    with pytest.raises(HookmechError, match="rows"):
        save_dataset(bad, task, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["d.h5"]


def test_checkpoint_fits_data_differing_only_in_split_or_corruption():
    model_task = tasks.make("ar", vocab_size=16, num_kv_pairs=3, split="train")
    check_fits_model(tasks.make("ar", vocab_size=16, num_kv_pairs=3, split="test", corrupt="value"), model_task.spec, "f")
    with pytest.raises(HookmechError, match="num_kv_pairs"):
        check_fits_model(tasks.make("ar", vocab_size=16, num_kv_pairs=4), model_task.spec, "f")
    with pytest.raises(HookmechError, match="atr"):
        check_fits_model(atr_task(), model_task.spec, "f")


# -- training on a given set -------------------------------------------------------------------
def small_run(task, **options):
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=16, n_layers=2, tie_embeddings=False)
    config = TrainConfig(**{"lr": 3e-3, "epochs": 2, "n_train": 24, "n_dev": 16, "batch_size": 8, "eval_every": 3,
                            "ckpt_every": 3, **options})
    return model_config, config


def test_training_on_a_dataset_file_equals_training_on_the_sampled_set(tmp_path):
    """The file holds exactly the set the trainer would sample: the weights agree bit for bit."""
    task = atr_task()
    model_config, config = small_run(task)
    save_dataset(task.sample(24, seed=(config.seed, 0)), task, tmp_path / "d.h5")
    file_task, rows = load_dataset(tmp_path / "d.h5")
    train(task, model_config, config, tmp_path / "sampled", progress=False)
    train(file_task, model_config, config, tmp_path / "file", progress=False, train_set=rows, train_set_sha256="abc")
    sampled = hookmech.load(tmp_path / "sampled" / "model.safetensors").state_dict()
    for name, tensor in hookmech.load(tmp_path / "file" / "model.safetensors").state_dict().items():
        assert torch.equal(tensor, sampled[name]), name
    assert json.loads((tmp_path / "file" / "run.json").read_text())["train_set_sha256"] == "abc"
    assert "train_set_sha256" not in json.loads((tmp_path / "sampled" / "run.json").read_text())


def test_resuming_with_other_training_data_is_refused(tmp_path):
    task = tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model_config, config = small_run(task)

    def stop_at_3(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(task, model_config, config, tmp_path / "run", progress=False, train_set=task.sample(24, seed=1),
              on_step=stop_at_3)
    with pytest.raises(HookmechError, match="other data"):
        train(task, model_config, config, tmp_path / "run", progress=False, train_set=task.sample(24, seed=2))
    with pytest.raises(HookmechError, match="other data"):
        train(task, model_config, config, tmp_path / "run", progress=False)  # sampled set: also other data
    summary = train(task, model_config, config, tmp_path / "run", progress=False, train_set=task.sample(24, seed=1))
    assert summary["status"] == "finished"


def test_training_set_must_match_n_train(tmp_path):
    task = tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model_config, config = small_run(task)
    with pytest.raises(HookmechError, match="24"):
        train(task, model_config, config, tmp_path / "run", progress=False, train_set=task.sample(20, seed=1))
    assert not (tmp_path / "run").exists()


# -- padding ---------------------------------------------------------------------------------
def test_padding_changes_neither_loss_nor_predictions():
    """ATR rows are padded to the batch's longest; extra padding columns change nothing."""
    task = atr_task()
    batch = task.sample(40, seed=3)
    assert (batch.lengths < batch.tokens.shape[1]).any()  # the batch really is ragged
    model = make_model(task, d_model=16, tie_embeddings=False)
    pad = torch.full((len(batch), 7), task.pad_id)
    from dataclasses import replace

    wider = replace(batch, tokens=torch.cat([batch.tokens, pad], 1), corrupt_tokens=torch.cat([batch.corrupt_tokens, pad], 1),
                    parent_pos=torch.cat([batch.parent_pos, torch.full_like(pad, -1)], 1))
    with torch.no_grad():
        # the same causal forward on more columns: fp32 round-off (allclose's rtol 1e-5, plus atol)
        assert torch.allclose(answer_loss(model, batch), answer_loss(model, wider), atol=1e-6)
        assert torch.allclose(answer_loss(model, batch), answer_loss(model, batch.trimmed()), atol=1e-6)
        # each row alone, cut to its own length: the independent reference
        alone = torch.stack([model(batch.tokens[r : r + 1, : int(batch.lengths[r])], positions=batch.query_pos[r : r + 1])[0]
                             for r in range(len(batch))])
        assert torch.allclose(model(wider.tokens, positions=wider.query_pos), alone, atol=1e-5)  # fp32 round-off
    assert evaluate(model, batch) == evaluate(model, wider)  # evaluate trims the padding: the same computation
    narrow = {r["pos"]: r["p_patched"] for r in patch(model, batch, ["L1.block_in"], ["key", "value"])}
    wide = {r["pos"]: r["p_patched"] for r in patch(model, wider, ["L1.block_in"], ["key", "value"])}
    assert narrow == pytest.approx(wide, abs=ENGINE_TOL)  # the engine on two shapes: ENGINE_TOL


# -- statistics ------------------------------------------------------------------------------
def test_ar_and_mqar_statistics_by_hand():
    ar = tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    stats = task_statistics(ar, 50, seed=0)
    assert stats["length"]["min"] == stats["length"]["max"] == 9  # BOS, 3 pairs, DIV, query
    assert stats["kv_distance"]["min"] == stats["kv_distance"]["max"] == 1
    assert stats["answer_in_context"] == 1.0 and stats["documents"] == 50
    mqar = tasks.make("mqar", vocab_size=32, seq_len=16, num_kv_pairs=2)
    batch = mqar.sample(10, seed=0)
    stats = batch_statistics(batch)
    assert stats["documents"] == 5 and stats["kv_distance"]["max"] == 1
    expected = (batch.roles["query"] - batch.roles["key"]).double()
    # a mean of integers computed another way: float64 round-off (pytest.approx's rel 1e-6)
    assert stats["key_query_distance"]["mean"] == pytest.approx(expected.mean().item())
    assert stats["key_query_distance"]["min"] == expected.min().item() >= 2  # k_i at 2i, its query at 2n + 2g


def test_atr_statistics_come_from_the_grammar_function():
    task = atr_task()
    assert {k: v for k, v in task_statistics(task, 200, seed=1).items() if k not in ("task", "seed")} == \
        atr_statistics(task, 200, seed=1)
