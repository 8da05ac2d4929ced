"""Model identity: `model_hash` (config + weights, not file bytes), byte-identical checkpoints,
and patching that refuses a cache made from another model."""
from __future__ import annotations

import copy
import hashlib
import json
import re
import warnings
from pathlib import Path

import h5py
import pytest
import torch

import hookmech
from hookmech import cache as cache_module
from hookmech.cache import CacheFile, UnverifiedCacheWarning, write_cache
from hookmech.checkpoint import read_metadata
from hookmech.config import build_config
from hookmech.errors import HookmechError
from hookmech.identity import model_hash
from hookmech.patching import patch
from hookmech.training import TrainConfig, train

from helpers import REPO, make_model

HOOKS = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"]


def _tiny_run(out: Path) -> Path:
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=16, n_layers=2)
    config = TrainConfig(epochs=None, steps=4, n_train=0, n_dev=8, batch_size=8, eval_every=2, ckpt_every=2)
    train(task, model_config, config, out, progress=False)
    return out / "model.safetensors"


def test_identical_training_runs_write_byte_identical_checkpoints(tmp_path):
    first, second = _tiny_run(tmp_path / "a"), _tiny_run(tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()
    # the wall-clock time stays in the run folder's summary.json, out of the model file
    assert "seconds" in json.loads((tmp_path / "a" / "summary.json").read_text())
    assert "seconds" not in read_metadata(first)["summary"]


def test_saving_one_model_twice_gives_the_same_bytes(tmp_path, ar_model, ar_task):
    # safetensors writes its metadata in hash-map order, which changes from call to call
    paths = [hookmech.save(ar_model, tmp_path / f"{i}.safetensors", task_spec=ar_task.spec, summary={"steps": 1, "dev_acc": 0.5})
             for i in range(4)]
    assert len({path.read_bytes() for path in paths}) == 1


def test_checkpoint_records_the_model_hash_of_its_weights(tmp_path, ar_model):
    path = hookmech.save(ar_model, tmp_path / "m.safetensors")
    recorded = read_metadata(path)["model_hash"]
    assert recorded == model_hash(ar_model) == model_hash(hookmech.load(path))
    assert re.fullmatch(r"[0-9a-f]{64}", recorded)


def test_model_hash_follows_config_and_weights(ar_task, ar_model):
    same = make_model(ar_task)  # same seed: same config, same weights
    assert model_hash(same) == model_hash(ar_model)
    with torch.no_grad():
        same.embed.weight[0, 0] += 1e-6
    assert model_hash(same) != model_hash(ar_model)
    wider = make_model(ar_task, d_model=48)
    assert model_hash(wider) != model_hash(ar_model)


def test_model_hash_is_what_the_formats_doc_defines(ar_model):
    digest = hashlib.sha256()
    config = json.loads(ar_model.cfg.to_json())
    digest.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    state = ar_model.state_dict()
    for name in sorted(state):
        tensor = state[name].contiguous()
        header = f"{name}\t{str(tensor.dtype).removeprefix('torch.')}\t{','.join(map(str, tensor.shape))}\n"
        digest.update(header.encode() + tensor.numpy().tobytes())
    assert model_hash(ar_model) == digest.hexdigest()


@pytest.mark.parametrize("name", ["attention_ar_cpu", "mamba_ar_cpu", "attention_ar_paper", "mamba_ar_paper"])
def test_fixtures_record_their_model_hash_and_the_readme_lists_it(name):
    path = REPO / "fixtures" / f"{name}.safetensors"
    recorded = read_metadata(path)["model_hash"]
    assert recorded == model_hash(hookmech.load(path))
    readme = (REPO / "fixtures" / "README.md").read_text()
    assert f"## `{name}.safetensors`\n\nmodel_hash `{recorded}`" in readme
    assert "seconds" not in read_metadata(path)["summary"]


# -- patching refuses a cache of another model ------------------------------------------------
@pytest.fixture
def cache_of_a(tmp_path, ar_model, ar_task):
    return write_cache(ar_model, ar_task.sample(12, seed=0), tmp_path / "a.h5", HOOKS, task_spec=ar_task.spec)


def test_cache_records_the_model_hash(cache_of_a, ar_model):
    with CacheFile(cache_of_a) as cache:
        assert cache.model_hash == model_hash(ar_model)
        assert cache.summary()["model_hash"] == model_hash(ar_model)


@pytest.mark.parametrize("method", ["exact", "atp"])
def test_patch_refuses_a_cache_of_another_model(cache_of_a, ar_task, ar_model, method):
    other = make_model(ar_task, seed=1)
    with pytest.raises(HookmechError, match="made from another model") as error:
        patch(other, cache_of_a, ["L1.block_in"], ["value"], method=method)
    assert model_hash(ar_model) in str(error.value) and model_hash(other) in str(error.value)
    assert str(cache_of_a) in str(error.value)
    with CacheFile(cache_of_a) as cache, pytest.raises(HookmechError, match="made from another model"):
        patch(other, cache, ["L1.block_in"], ["value"], method=method)


def test_verify_top_refuses_a_cache_of_another_model(cache_of_a, ar_task, ar_model):
    from hookmech.patching import verify_top

    records = patch(ar_model, cache_of_a, ["L1.block_in"], ["value"], method="atp")
    with pytest.raises(HookmechError, match="made from another model"):
        verify_top(make_model(ar_task, seed=1), cache_of_a, records, 1)


@pytest.mark.parametrize("method", ["exact", "atp"])
def test_patch_accepts_a_cache_of_an_identical_model(cache_of_a, ar_model, method):
    twin = copy.deepcopy(ar_model)
    assert patch(twin, cache_of_a, ["L1.block_in"], ["value"], method=method) == \
        patch(ar_model, cache_of_a, ["L1.block_in"], ["value"], method=method)


def _strip_model_hash(path: Path) -> Path:
    with h5py.File(path, "r+") as h5:
        del h5.attrs["model_hash"]
    return path


def test_old_cache_without_model_hash_warns_once_and_is_read(cache_of_a, ar_model, monkeypatch):
    monkeypatch.setattr(cache_module, "_warned_unverified", False)
    _strip_model_hash(cache_of_a)
    with CacheFile(cache_of_a) as cache:
        assert cache.model_hash is None and cache.summary()["model_hash"] is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = patch(ar_model, cache_of_a, ["L1.block_in"], ["value"])
        patch(ar_model, cache_of_a, ["L1.block_in"], ["value"], method="atp")
    unverified = [w for w in caught if issubclass(w.category, UnverifiedCacheWarning)]
    assert len(unverified) == 1
    assert "model_hash" in str(unverified[0].message) and str(cache_of_a) in str(unverified[0].message)
    assert first[0]["n"] == 12
