"""Offline analysis of a cache: TransformerLens-like access, lazy reading, and linear probes
that recover a planted linear code (and nothing where none was planted)."""
from __future__ import annotations

import io
import json

import h5py
import numpy as np
import pytest
import torch

import hookmech
from hookmech.cache import CacheFile, write_cache
from hookmech.errors import UsageError
from hookmech.probe import fit_probe, probe_data, split_by_document
from hookmech.sites import resolve_sites

from helpers import CACHE_TOL

KEY_POS, VALUE_POS, QUERY_POS, N_POS = 1, 2, 5, 6
HOOKS = ("blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre")


def write_synthetic_cache(path, n_rows=480, d_model=16, n_keys=8, noise=0.3, seed=0, rows_per_doc=2):
    """A format-v1 cache whose L1.block_in at the value position is a linear code of the key
    token (E[key] + noise) and is noise elsewhere; answers are independent of the key.
    Returns the clean tokens ``[N, T]``."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2 * n_keys, size=(n_rows, N_POS)).astype(np.int32)
    keys = rng.integers(0, n_keys, size=n_rows)
    tokens[:, KEY_POS] = keys
    tokens[:, VALUE_POS] = n_keys + rng.integers(0, n_keys, size=n_rows)
    code = rng.normal(size=(n_keys, d_model))
    acts = rng.normal(scale=noise, size=(n_rows, N_POS, d_model)).astype(np.float32)
    planted = acts.copy()
    planted[:, VALUE_POS] += code[keys]
    with h5py.File(path, "w") as h5:
        h5.attrs.update({"format": "hookmech-cache", "format_version": 1, "model_sha256": "f" * 64,
                         "model_config": json.dumps({"mixers": ["attention"] * 2, "d_model": d_model, "n_layers": 2,
                                                     "d_vocab": 2 * n_keys + 3}),
                         "task": json.dumps({"name": "synthetic"}), "hookmech_version": "test"})
        h5["tokens/clean"] = tokens
        h5["tokens/corrupt"] = tokens
        h5["lengths"] = np.full(n_rows, N_POS, np.int32)
        h5["answers"] = rng.integers(n_keys, 2 * n_keys, size=n_rows).astype(np.int32)
        h5["doc_index"] = (np.arange(n_rows) // rows_per_doc).astype(np.int32)
        for role, position in (("key", KEY_POS), ("value", VALUE_POS), ("query", QUERY_POS)):
            h5[f"roles/{role}"] = np.full(n_rows, position, np.int32)
        for which in ("clean", "corrupt"):
            h5[f"acts/{which}/{HOOKS[0]}"] = acts
            h5[f"acts/{which}/{HOOKS[1]}"] = planted
            h5[f"p_answer/{which}"] = np.full(n_rows, 0.9 if which == "clean" else 0.1, np.float32)
    return tokens


def test_probe_recovers_a_planted_linear_code(tmp_path):
    write_synthetic_cache(tmp_path / "c.h5")
    with hookmech.cache.open(tmp_path / "c.h5") as cache:
        planted = fit_probe(cache, "L1.block_in", "value", target="key")
        assert planted.heldout_accuracy >= 0.95
        assert planted.chance < 0.3 and planted.n_classes == 8 and planted.d_features == 16
        # no code: same site at the query, the layer without the code, an unrelated target
        for site, pos, target in (("L1.block_in", "query", "key"), ("L0.block_in", "value", "key"),
                                  ("L1.block_in", "value", "answer")):
            result = fit_probe(cache, site, pos, target=target)
            assert result.heldout_accuracy < planted.chance + 0.2, (site, pos, target)


def test_probe_is_deterministic_and_holds_out_whole_documents(tmp_path):
    write_synthetic_cache(tmp_path / "c.h5", rows_per_doc=3)
    with hookmech.cache.open(tmp_path / "c.h5") as cache:
        first = fit_probe(cache, "L1.block_in", "value", "key", seed=3)
        assert fit_probe(cache, "L1.block_in", "value", "key", seed=3) == first
        _, _, doc_index = probe_data(cache, "L1.block_in", "value", "key")
    train, heldout = split_by_document(doc_index, 0.25, seed=3)
    assert not set(doc_index[train].tolist()) & set(doc_index[heldout].tolist())
    assert (train ^ heldout).all() and first.n_heldout == int(heldout.sum())
    assert 0.2 <= heldout.double().mean().item() <= 0.3


def test_probe_targets_read_the_right_tokens(tmp_path):
    tokens = write_synthetic_cache(tmp_path / "c.h5")
    with hookmech.cache.open(tmp_path / "c.h5") as cache:
        features, keys, _ = probe_data(cache, "L1.block_in", "value", "key")
        _, values, _ = probe_data(cache, "blocks.1.hook_resid_pre", "-4", "value")
        at_value = cache.at("L1.block_in", "value")
    np.testing.assert_array_equal(keys.numpy(), tokens[:, KEY_POS])
    np.testing.assert_array_equal(values.numpy(), tokens[:, VALUE_POS])
    torch.testing.assert_close(features, at_value, rtol=0, atol=0)  # the same stored numbers, read two ways


def test_probe_errors_name_what_exists(tmp_path):
    write_synthetic_cache(tmp_path / "c.h5")
    with hookmech.cache.open(tmp_path / "c.h5") as cache:
        with pytest.raises(UsageError, match="did you mean: L1.block_in"):
            fit_probe(cache, "L1.block_inn", "value", "key")
        with pytest.raises(UsageError, match="unknown probe target"):
            fit_probe(cache, "L1.block_in", "value", "colour")
        with pytest.raises(UsageError, match="unknown position"):
            fit_probe(cache, "L1.block_in", "divider", "key")
        with pytest.raises(UsageError, match="outside some rows"):
            fit_probe(cache, "L1.block_in", "9", "key")


def test_cache_reads_like_an_activation_cache(tmp_path, ar_model, ar_task):
    batch = ar_task.sample(9, seed=0)
    hooks = resolve_sites(["L*.block_in", "L1.mixer.q"], ar_model.hook_dict)
    path = write_cache(ar_model, batch, tmp_path / "c.h5", hooks[::-1], model_sha256="abc", task_spec=ar_task.spec)
    _, reference = ar_model.run_with_cache(batch.tokens)  # one chunk of 9 rows, as write_cache's: the same computation
    with hookmech.cache.open(path) as cache:
        assert cache.keys() == hooks == list(cache) and len(cache) == 3
        assert "L1.block_in" in cache and "blocks.1.mixer.hook_q" in cache and ("L0.block_in", "corrupt") in cache
        assert "L1.block_out" not in cache and "nonsense" not in cache and ("L1.block_in", "neither") not in cache
        np.testing.assert_array_equal(cache["blocks.1.hook_resid_pre"][()], reference["blocks.1.hook_resid_pre"].numpy())
        np.testing.assert_array_equal(cache["L1.mixer.q"][()], reference["blocks.1.mixer.hook_q"].numpy())
        summary = cache.summary()
    assert summary["n"] == 9 and summary["model_sha256"] == "abc" and summary["task"] == ar_task.spec
    assert summary["roles"] == sorted(batch.roles) and summary["model"]["n_layers"] == 2
    assert [s["site"] for s in summary["sites"]] == ["L0.block_in", "L1.block_in", "L1.mixer.q"]
    assert summary["sites"][2]["shape"] == [9, batch.tokens.shape[1], *reference["blocks.1.mixer.hook_q"].shape[2:]]
    rows = torch.arange(9)
    with torch.no_grad():
        for which, tokens in (("clean", batch.tokens), ("corrupt", batch.corrupt_tokens)):
            probs = ar_model(tokens)[rows, batch.query_pos].softmax(-1)[rows, batch.answers]
            # contract: the fp32 cache's p vs computed from scratch, CACHE_TOL
            assert summary[f"p_{which}"] == pytest.approx(probs.double().mean().item(), abs=CACHE_TOL)


class _CountingFile(io.FileIO):
    """A raw file that counts the bytes h5py reads through it."""

    bytes_read = 0

    def readinto(self, buffer):
        count = super().readinto(buffer)
        _CountingFile.bytes_read += count or 0
        return count

    def read(self, size=-1):
        data = super().read(size)
        _CountingFile.bytes_read += len(data)
        return data


def test_reading_one_slice_reads_a_small_part_of_a_large_cache(tmp_path, monkeypatch):
    """Opening, summarising and reading one slice of a 2 x 25 MB cache reads ~one chunk."""
    path = tmp_path / "big.h5"
    n_rows, n_pos, d_model = 4096, 24, 64
    with h5py.File(path, "w") as h5:
        h5.attrs.update({"format": "hookmech-cache", "format_version": 1, "model_sha256": "", "model_config": "{}",
                         "task": "{}", "hookmech_version": "test"})
        h5["tokens/clean"] = h5["tokens/corrupt"] = np.zeros((n_rows, n_pos), np.int32)
        for name in ("answers", "doc_index", "roles/value", "roles/query"):
            h5[name] = np.full(n_rows, 3, np.int32)
        h5["lengths"] = np.full(n_rows, n_pos, np.int32)  # rows as long as the tokens: position 3 is inside
        h5["p_answer/clean"] = h5["p_answer/corrupt"] = np.zeros(n_rows, np.float32)
        block = np.random.default_rng(0).normal(size=(256, n_pos, d_model)).astype(np.float32)
        for which in ("clean", "corrupt"):
            data = h5.create_dataset(f"acts/{which}/{HOOKS[1]}", (n_rows, n_pos, d_model), "float32",
                                     chunks=(256, n_pos, d_model))
            for start in range(0, n_rows, 256):
                data[start:start + 256] = block
    size = path.stat().st_size
    chunk_bytes = block.nbytes
    original = h5py.File

    def counting_open(name, mode="r", *args, **kwargs):
        return original(_CountingFile(name, "r"), mode, *args, **kwargs)

    monkeypatch.setattr(hookmech.cache.h5py, "File", counting_open)
    with CacheFile(path) as cache:
        cache.summary()
        opened = _CountingFile.bytes_read
        rows = cache["L1.block_in", "corrupt"][5:7]
        sliced = _CountingFile.bytes_read - opened
        at_value = cache.at("L1.block_in", "value")
        gathered = _CountingFile.bytes_read - opened - sliced
    np.testing.assert_array_equal(rows, block[5:7])
    np.testing.assert_array_equal(at_value.numpy()[:256], block[:, 3])
    assert opened < 0.01 * size, opened
    assert sliced <= chunk_bytes + 65536, sliced            # one chunk (and some B-tree nodes)
    assert gathered <= size / 2 + 65536, gathered            # the clean dataset only, not the corrupt one
