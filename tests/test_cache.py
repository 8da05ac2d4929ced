"""The HDF5 activation cache: format v1, atomic writing, lazy reading, patching from it."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

import hookmech
from hookmech.cache import CacheFile, run_chunks, write_cache
from hookmech.errors import HookmechError
from hookmech.patching import patch
from hookmech.sites import resolve_sites

from helpers import ATTENTION_FIXTURE, CACHE_TOL, FP16_CACHE_TOL, REPO


@pytest.fixture
def cached(tmp_path, ar_model, ar_task):
    batch = ar_task.sample(37, seed=1)
    hooks = resolve_sites(["all"], ar_model.hook_dict)
    path = write_cache(ar_model, batch, tmp_path / "c.h5", hooks, model_sha256="abc", task_spec=ar_task.spec, chunk=16)
    return path, batch, hooks


def chunked_run(model, tokens, chunk: int = 16) -> dict[str, torch.Tensor]:
    """`run_with_cache` on the row chunks `write_cache(chunk=16)` runs: the same computation,
    so a lossless fp32 cache must hold exactly these numbers."""
    parts = [model.run_with_cache(tokens[rows], return_cache_object=False)[1] for rows in run_chunks(len(tokens), chunk)]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


def test_format_v1_layout(cached, ar_model, ar_task):
    path, batch, hooks = cached
    with h5py.File(path, "r") as h5:
        assert h5.attrs["format"] == "hookmech-cache" and h5.attrs["format_version"] == 1
        assert h5.attrs["model_sha256"] == "abc"
        assert json.loads(h5.attrs["task"]) == ar_task.spec
        assert json.loads(h5.attrs["model_config"]) == json.loads(ar_model.cfg.to_json())
        assert "hookmech_version" in h5.attrs
        for name in ("tokens/clean", "tokens/corrupt"):
            assert h5[name].dtype == np.int32 and h5[name].shape == tuple(batch.tokens.shape)
        for name in ("lengths", "answers", "doc_index", *(f"roles/{r}" for r in batch.roles)):
            assert h5[name].dtype == np.int32 and h5[name].shape == (37,)
        for which in ("clean", "corrupt"):
            assert set(h5[f"acts/{which}"]) == set(hooks)
            assert h5[f"acts/{which}/blocks.1.hook_resid_pre"].shape == (37, batch.tokens.shape[1], 32)
            assert h5[f"acts/{which}/blocks.1.hook_resid_pre"].chunks[0] == 16
            assert h5[f"p_answer/{which}"].dtype == np.float32
        np.testing.assert_array_equal(h5["tokens/corrupt"][()], batch.corrupt_tokens.numpy())


def test_cached_activations_match_run_with_cache(cached, ar_model):
    path, batch, _ = cached
    reference = chunked_run(ar_model, batch.corrupt_tokens)
    with hookmech.cache.open(path) as cache:
        stored = cache.read("blocks.1.hook_mlp_out", "corrupt", slice(0, 37))
        torch.testing.assert_close(stored, reference["blocks.1.hook_mlp_out"], rtol=0, atol=0)
        at_value = cache.at("L1.block_in", "value", which="corrupt")
        rows = torch.arange(37)
        torch.testing.assert_close(at_value, reference["blocks.1.hook_resid_pre"][rows, batch.roles["value"]], rtol=0, atol=0)


def test_patching_from_cache_equals_patching_from_scratch(cached, ar_model):
    path, batch, _ = cached
    from_cache = patch(ar_model, path, ["all"], ["key", "value", "query", "divider"])
    from_scratch = patch(ar_model, batch, ["all"], ["key", "value", "query", "divider"])
    assert len(from_cache) == 14 * 4
    for a, b in zip(from_cache, from_scratch, strict=True):
        for key in ("p_clean", "p_corrupt", "p_patched"):  # contract: fp32 cache vs from scratch, CACHE_TOL
            assert a[key] == pytest.approx(b[key], abs=CACHE_TOL)


def test_patching_a_site_the_cache_lacks_computes_it(tmp_path, ar_model, ar_task):
    batch = ar_task.sample(12, seed=2)
    path = write_cache(ar_model, batch, tmp_path / "c.h5", ["blocks.0.hook_resid_pre"])
    from_cache = patch(ar_model, path, ["L1.mixer.z"], ["value"])
    from_scratch = patch(ar_model, batch, ["L1.mixer.z"], ["value"])
    assert from_cache[0]["p_patched"] == pytest.approx(from_scratch[0]["p_patched"], abs=CACHE_TOL)  # contract


def test_failed_write_leaves_no_file(tmp_path, ar_model, ar_task):
    batch = ar_task.sample(4, seed=0)
    with pytest.raises(Exception):
        write_cache(ar_model, batch, tmp_path / "c.h5", ["blocks.9.hook_resid_pre"])
    assert list(tmp_path.iterdir()) == []


def test_block_output_is_stored_once_as_a_link_to_the_next_block_input(cached, ar_model):
    path, batch, _ = cached
    reference = chunked_run(ar_model, batch.tokens)
    with h5py.File(path, "r") as h5:
        for which in ("clean", "corrupt"):
            out, into = h5[f"acts/{which}/blocks.0.hook_resid_post"], h5[f"acts/{which}/blocks.1.hook_resid_pre"]
            assert out.id == into.id  # one object under two names (an HDF5 hard link)
        assert h5["acts/clean/blocks.1.hook_resid_post"].id != h5["acts/clean/blocks.1.hook_resid_pre"].id
        np.testing.assert_array_equal(h5["acts/clean/blocks.0.hook_resid_post"][()],
                                      reference["blocks.0.hook_resid_post"].numpy())


def test_block_output_without_the_next_input_is_stored_itself(tmp_path, ar_model, ar_task):
    batch = ar_task.sample(5, seed=3)
    path = write_cache(ar_model, batch, tmp_path / "c.h5", ["blocks.0.hook_resid_post"])
    _, reference = ar_model.run_with_cache(batch.corrupt_tokens)
    with h5py.File(path, "r") as h5:
        assert set(h5["acts/corrupt"]) == {"blocks.0.hook_resid_post"}
        np.testing.assert_array_equal(h5["acts/corrupt/blocks.0.hook_resid_post"][()],
                                      reference["blocks.0.hook_resid_post"].numpy())


def test_a_failing_background_write_fails_the_cache_and_leaves_no_file(tmp_path, ar_model, ar_task, monkeypatch):
    from hookmech import cache as cache_module

    def broken_write(self, dataset, rows, value):
        raise OSError("disk full")

    monkeypatch.setattr(cache_module._ChunkWriter, "_write", broken_write)
    with pytest.raises(OSError, match="disk full"):
        write_cache(ar_model, ar_task.sample(40, seed=0), tmp_path / "c.h5", ["blocks.1.hook_resid_pre"], chunk=8)
    assert list(tmp_path.iterdir()) == []


def test_reading_one_slice_does_not_read_the_rest(cached, monkeypatch):
    path, _, _ = cached
    reads = []
    original = h5py.Dataset.__getitem__

    def counting(self, key):
        reads.append(self.name)
        return original(self, key)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", counting)
    with CacheFile(path) as cache:
        cache["blocks.1.hook_resid_pre"][0:2]
    assert reads == ["/acts/clean/blocks.1.hook_resid_pre"]


@pytest.mark.parametrize("content", [b"", b"not hdf5 at all"])
def test_non_cache_files_are_refused(tmp_path, content):
    path = tmp_path / "bad.h5"
    path.write_bytes(content)
    with pytest.raises(HookmechError):
        CacheFile(path)


def test_hdf5_of_another_kind_is_refused(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as h5:
        h5["x"] = np.zeros(3)
    with pytest.raises(HookmechError, match="not a hookmech cache"):
        CacheFile(path)


def test_fp16_storage(tmp_path, ar_model, ar_task):
    batch = ar_task.sample(6, seed=0)
    path = write_cache(ar_model, batch, tmp_path / "c.h5", ["blocks.1.hook_resid_pre"], dtype="float16", compression="gzip")
    with h5py.File(path, "r") as h5:
        assert h5["acts/clean/blocks.1.hook_resid_pre"].dtype == np.float16


def test_default_chunk_splits_rows_evenly_under_the_row_and_token_limits():
    from hookmech.cache import default_chunk

    assert default_chunk(320, 11) == 160     # 256 rows at most: two even chunks, not 256 + 64
    assert default_chunk(320, 67) == 107     # 8192 tokens at most: 122 rows, so three chunks
    assert default_chunk(3200, 11) == 247    # 13 chunks
    assert default_chunk(10, 5000) == 1      # one row is the least, however long
    assert default_chunk(7, 11) == 7


@pytest.fixture(scope="module", params=["attention", "mamba"])
def fp32_and_fp16_caches(request, tmp_path_factory):
    """(model, float32 cache path, float16 cache path): the same 64 rows of a bundled trained CPU
    fixture, every block-level site, written once in each storage dtype."""
    checkpoint = ATTENTION_FIXTURE if request.param == "attention" else REPO / "fixtures" / "mamba_ar_cpu.safetensors"
    model, task = hookmech.load(checkpoint), hookmech.tasks.from_checkpoint(checkpoint)
    batch = task.sample(64, seed=1)
    hooks = resolve_sites(["all"], model.hook_dict)
    folder = tmp_path_factory.mktemp(request.param)
    paths = [write_cache(model, batch, folder / f"{dtype}.h5", hooks, dtype=dtype) for dtype in ("float32", "float16")]
    return model, *paths


def test_a_float16_cache_stores_the_float32_values_rounded_and_reads_them_as_float32(fp32_and_fp16_caches):
    """The storage dtype round-trips: each float16 activation is its float32 twin rounded to
    nearest (numpy's rounding, an independent one), `read` returns float32, and the file's
    metadata (the datasets' dtype, `summary`) says float16; p(answer) stays float32."""
    _, path32, path16 = fp32_and_fp16_caches
    with CacheFile(path32) as cache32, CacheFile(path16) as cache16:
        assert cache16.keys() == cache32.keys()
        for hook in cache32.keys():
            for which in ("clean", "corrupt"):
                exact = cache32.read_rows(hook, which, slice(None))
                assert exact.dtype == np.float32
                stored = cache16.read_rows(hook, which, slice(None))
                assert stored.dtype == np.float16
                np.testing.assert_array_equal(stored, exact.astype(np.float16))
                read = cache16.read(hook, which, slice(0, 5))
                assert read.dtype == torch.float32
                assert torch.equal(read, torch.from_numpy(exact[:5].astype(np.float16).astype(np.float32)))
        assert {site["dtype"] for site in cache16.summary()["sites"]} == {"float16"}
        assert {site["dtype"] for site in cache32.summary()["sites"]} == {"float32"}
        for which in ("clean", "corrupt"):
            assert torch.equal(cache16.p_answer(which), cache32.p_answer(which))


def test_attributions_from_a_float16_cache_equal_float32_within_fp16_cache_tol(fp32_and_fp16_caches):
    """Patching from a float16 cache gives the float32 cache's records within FP16_CACHE_TOL (the
    rounding's measured effect, tests/helpers.py), with p_clean and p_corrupt identical (p(answer)
    is stored as float32 in both), and not exactly: the rounding does reach the patches."""
    model, path32, path16 = fp32_and_fp16_caches
    records32 = patch(model, path32, ["all"], ["key", "value", "query"])
    records16 = patch(model, path16, ["all"], ["key", "value", "query"])
    assert max(r["p_clean"] - r["p_corrupt"] for r in records32) > 0.5  # trained: the attributions mean something
    moved = 0.0
    for exact, rounded in zip(records32, records16, strict=True):
        assert (exact["hook"], exact["pos"]) == (rounded["hook"], rounded["pos"])
        assert (exact["p_clean"], exact["p_corrupt"]) == (rounded["p_clean"], rounded["p_corrupt"])
        assert rounded["p_patched"] == pytest.approx(exact["p_patched"], abs=FP16_CACHE_TOL)
        assert rounded["attribution"] == pytest.approx(exact["attribution"], abs=FP16_CACHE_TOL)
        moved = max(moved, abs(rounded["p_patched"] - exact["p_patched"]))
    assert moved > 0
