"""A cache, a model or an argument that would give a silent wrong answer is refused, saying where.

Metadata (attributes, layout, dtypes) is checked when a cache is opened; row data (roles, lengths,
tokens, p(answer), activations) as it is read. Caches of another model are caught by recomputing a
few rows (`CacheFile.check_model`), not by trusting the file's `model_hash`.
"""
from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch

import hookmech
from hookmech.cache import CacheFile, write_cache
from hookmech.errors import HookmechError, UsageError
from hookmech.identity import model_hash
from hookmech.patching import patch, path_patch
from hookmech.probe import fit_probe
from hookmech.sites import resolve_sites

from helpers import CACHE_TOL, make_model

HOOK = "blocks.1.hook_resid_pre"


@pytest.fixture
def cache_path(tmp_path, ar_model, ar_task):
    return write_cache(ar_model, ar_task.sample(12, seed=0), tmp_path / "c.h5", [HOOK], task_spec=ar_task.spec)


def _replace(path, name: str, change) -> None:
    """Rewrite dataset `name` of the file at `path` as `change(its values)` (any dtype)."""
    with h5py.File(path, "r+") as h5:
        values = change(h5[name][()])
        del h5[name]
        h5[name] = values


# -- row data: roles, lengths, tokens, answers -------------------------------------------------
@pytest.mark.parametrize("position", [-1, "T"])
def test_a_role_outside_its_row_is_refused_when_the_rows_are_read(cache_path, ar_model, position):
    """roles/value = -1 used to be read as the last position (attribution 0.0 where the honest
    cache gives 1.0); = T crashed with an IndexError."""
    with h5py.File(cache_path, "r") as h5:
        n_pos = h5["tokens/clean"].shape[1]
    value = n_pos if position == "T" else position
    _replace(cache_path, "roles/value", lambda roles: np.full_like(roles, value))
    with CacheFile(cache_path) as cache:  # metadata is fine: opening reads no rows
        with pytest.raises(HookmechError, match=rf"c\.h5: roles/value row 0 holds {value}, outside the row "
                                                rf"\(length {n_pos}: positions 0\.\.{n_pos - 1}\)"):
            patch(ar_model, cache, ["L1.block_in"], ["value"])


@pytest.mark.parametrize("method", ["exact", "atp"])
def test_a_batch_whose_role_is_outside_its_rows_is_refused(ar_model, ar_task, method):
    """The same check for rows that come from no cache (a Batch built or edited in Python)."""
    batch = ar_task.sample(4, seed=0)
    batch.roles["value"] = torch.full_like(batch.roles["value"], -1)
    with pytest.raises(HookmechError, match=r"the examples: role value of row 0 is -1, outside the row "
                                            r"\(length \d+: positions 0\.\.\d+\)"):
        patch(ar_model, batch, ["L1.block_in"], ["value"], method=method)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("lengths", 0, r"lengths row 0 holds 0, expected 1\.\.\d+"),
    ("answers", -3, r"answers row 0 holds -3, expected a token id 0\.\.\d+"),
    ("tokens/corrupt", 99, r"tokens/corrupt row 0, position 0, holds 99, expected a token id 0\.\.\d+"),
])
def test_row_integers_outside_their_range_are_refused(cache_path, name, value, message):
    _replace(cache_path, name, lambda rows: np.full_like(rows, value))
    with CacheFile(cache_path) as cache, pytest.raises(HookmechError, match=message):
        cache.batch()


# -- dtypes and non-finite values ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int32, np.float64])
def test_an_activation_dtype_the_format_does_not_allow_is_refused_on_opening(cache_path, dtype):
    _replace(cache_path, f"acts/clean/{HOOK}", lambda acts: acts.astype(dtype))
    with pytest.raises(HookmechError, match=rf"acts/clean/{HOOK} is {np.dtype(dtype).name}; "
                                            r"the format stores activations as float32 or float16"):
        CacheFile(cache_path)


def test_a_non_finite_activation_is_refused_naming_the_dataset_and_the_first_place(cache_path, ar_model):
    def damage(acts):
        acts[3, 5, 7], acts[4, 0, 0] = np.inf, np.nan
        return acts

    _replace(cache_path, f"acts/clean/{HOOK}", damage)
    where = rf"acts/clean/{HOOK} holds inf at row 3, index \[3, 5, 7\] \(the first non-finite value\)"
    with CacheFile(cache_path, verify=False) as cache:
        with pytest.raises(HookmechError, match=where):
            cache.read(HOOK, "clean", slice(0, 12))
        cache.read(HOOK, "clean", slice(0, 3))  # rows before it read fine
        with pytest.raises(HookmechError, match=where):
            patch(ar_model, cache, ["L1.block_in"], ["value"])


def test_a_non_finite_p_answer_is_refused(cache_path):
    _replace(cache_path, "p_answer/corrupt", lambda p: np.where(np.arange(len(p)) == 2, np.nan, p).astype(np.float32))
    with CacheFile(cache_path) as cache, pytest.raises(HookmechError, match="p_answer/corrupt row 2 holds nan"):
        cache.p_answer("corrupt")


def test_masked_attention_scores_keep_their_minus_inf(tmp_path, ar_model, ar_task):
    """-inf is what a masked attention score is: caching, verifying and patching it is no error."""
    hooks = ["blocks.0.mixer.hook_attn_scores", HOOK]
    path = write_cache(ar_model, ar_task.sample(6, seed=0), tmp_path / "s.h5", hooks)
    with CacheFile(path) as cache:
        assert np.isneginf(cache["L0.mixer.attn_scores"][()]).any()
        assert patch(ar_model, cache, ["L0.mixer.attn_scores"], ["key"])[0]["n"] == 6


def test_one_position_per_row_is_refused_where_positions_are_not_axis_1(tmp_path, ar_model, ar_task):
    """Attention's scores are [N, head, q, k]: `at`/`gather` (and probes) would read heads as
    positions; they are refused naming the layout, and the dataset itself stays readable."""
    hooks = ["blocks.0.mixer.hook_pattern", HOOK]
    path = write_cache(ar_model, ar_task.sample(6, seed=0), tmp_path / "s.h5", hooks)
    with CacheFile(path) as cache:
        with pytest.raises(UsageError, match=r"stored as \[batch, head, query_pos, key_pos\].*not its position axis"):
            cache.at("L0.mixer.pattern", "value")
        with pytest.raises(UsageError, match="not its position axis"):
            fit_probe(cache, "L0.mixer.pattern", "value")
        assert cache.at(HOOK, "value").shape[0] == 6


# -- writing: no cache of non-finite numbers ------------------------------------------------------
def test_write_cache_refuses_a_model_whose_weights_hold_nan(tmp_path, ar_model, ar_task):
    with torch.no_grad():
        ar_model.blocks[0].mixer.Wqkv.weight[1, 2] = float("nan")
    with pytest.raises(HookmechError, match=r"weight blocks\.0\.mixer\.Wqkv\.weight holds nan at \[1, 2\]"):
        write_cache(ar_model, ar_task.sample(4, seed=0), tmp_path / "c.h5", [HOOK])
    assert list(tmp_path.iterdir()) == []


def test_write_cache_refuses_activations_that_overflow_the_stored_dtype(tmp_path, ar_model, ar_task):
    with torch.no_grad():
        ar_model.embed.weight.mul_(1e8)  # finite weights, residuals far past float16's 65504
    with pytest.raises(HookmechError, match=r"L1\.block_in \(blocks\.1\.hook_resid_pre\) of the clean run holds inf "
                                            r"at row 0, index \[0, 0, \d+\] as float16: not written"):
        write_cache(ar_model, ar_task.sample(4, seed=0), tmp_path / "c.h5", [HOOK], dtype="float16")
    assert list(tmp_path.iterdir()) == []


def test_write_cache_refuses_a_dtype_the_format_does_not_allow(tmp_path, ar_model, ar_task):
    with pytest.raises(UsageError, match="float32 or float16"):
        write_cache(ar_model, ar_task.sample(4, seed=0), tmp_path / "c.h5", [HOOK], dtype="float64")


# -- models whose weights are not finite ----------------------------------------------------------
def _nan_model(model):
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.blocks[1].mlp.fc1.weight[0, 0] = float("nan")
    return broken


@pytest.mark.parametrize("method", ["exact", "atp", "atp-star"])
def test_patching_refuses_a_model_whose_weights_hold_nan(ar_model, ar_task, method):
    """They used to give all-null attributions and no word."""
    with pytest.raises(HookmechError, match=r"weight blocks\.1\.mlp\.fc1\.weight holds nan at \[0, 0\]"):
        patch(_nan_model(ar_model), ar_task.sample(4, seed=0), ["L1.block_in"], ["value"], method=method)


def test_path_patching_and_das_refuse_a_model_whose_weights_hold_nan(ar_model, ar_task, cache_path):
    broken = _nan_model(ar_model)
    with pytest.raises(HookmechError, match="holds nan"):
        path_patch(broken, ar_task.sample(4, seed=0), "L0.block_out@value", "L1.block_in@value", "resid")
    with pytest.raises(HookmechError, match="holds nan"):
        hookmech.das.train(broken, CacheFile(cache_path, verify=False), "L1.block_in", "value", dims=[1], steps=1)


# -- the identity check: recomputing a few rows --------------------------------------------------
def _twin_with_other_weights(model, seed: int = 5):
    """A model of the same config (same shapes, same hooks) and different weights."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return other


def test_a_cache_of_another_model_with_an_edited_hash_is_refused(tmp_path, ar_model, ar_task):
    """Its model_hash attribute says it is this model's; recomputing the rows says otherwise."""
    path = write_cache(_twin_with_other_weights(ar_model), ar_task.sample(12, seed=0), tmp_path / "c.h5", [HOOK])
    with h5py.File(path, "r+") as h5:
        h5.attrs["model_hash"] = model_hash(ar_model)
    with pytest.raises(HookmechError, match=r"c\.h5: p_answer/clean row \d+ is .* in the cache but .* recomputed "
                                            r"with this model \(tolerance 0\.001\)"):
        patch(ar_model, path, ["L1.block_in"], ["value"])
    with CacheFile(path, verify=False) as cache:  # the check can be skipped, and then it is the file's word
        assert patch(ar_model, cache, ["L1.block_in"], ["value"])[0]["n"] == 12


def test_edited_p_answer_values_are_refused(cache_path, ar_model):
    _replace(cache_path, "p_answer/clean", lambda p: np.clip(p + 0.2, 0, 1).astype(np.float32))
    with pytest.raises(HookmechError, match=r"p_answer/clean row \d+ is"):
        patch(ar_model, cache_path, ["L1.block_in"], ["value"])


def test_edited_activations_on_the_checked_rows_are_refused(cache_path, ar_model):
    _replace(cache_path, f"acts/corrupt/{HOOK}", lambda acts: acts * 1.01)
    with pytest.raises(HookmechError, match=rf"acts/corrupt/{HOOK} row \d+ differs from this model's recomputed "
                                            r"activation by"):
        patch(ar_model, cache_path, ["L1.block_in"], ["value"])


def test_honest_caches_pass_the_check(tmp_path, ar_model, ar_task):
    """Written in chunks of 5 rows (the check recomputes 4 rows in one forward), in float16, with
    every block-level site: the check passes and patching gives the numbers it gave without it."""
    batch = ar_task.sample(13, seed=2)
    hooks = resolve_sites(["all"], ar_model.hook_dict)
    for dtype in ("float32", "float16"):
        path = write_cache(ar_model, batch, tmp_path / f"{dtype}.h5", hooks, chunk=5, dtype=dtype)
        with CacheFile(path) as cache:
            cache.check_model(ar_model)  # every stored hook
            checked = patch(ar_model, cache, ["L*.block_in"], ["value"])
        with CacheFile(path, verify=False) as cache:
            unchecked = patch(ar_model, cache, ["L*.block_in"], ["value"])
        assert [r["p_patched"] for r in checked] == pytest.approx([r["p_patched"] for r in unchecked], abs=CACHE_TOL)


def test_the_check_reads_only_the_rows_it_recomputes(cache_path, ar_model, monkeypatch):
    reads = []
    original = h5py.Dataset.__getitem__

    def counting(self, key):
        reads.append((self.name, key))
        return original(self, key)

    with CacheFile(cache_path) as cache:
        monkeypatch.setattr(h5py.Dataset, "__getitem__", counting)
        cache.check_model(ar_model)
    acts = [key for name, key in reads if name.startswith("/acts/")]
    assert len(acts) == 2, reads  # one read of each run, of 4 consecutive rows, nothing more
    assert all(isinstance(key, slice) and key.stop - key.start == 4 for key in acts), reads


def test_a_model_of_another_config_is_refused_by_hash_before_any_forward(cache_path, ar_task):
    with CacheFile(cache_path) as cache, pytest.raises(HookmechError, match="was made from another model"):
        cache.check_model(make_model(ar_task, d_model=16))


# -- arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize("weight_decay", [-1.0, float("nan"), float("inf")])
def test_probe_refuses_a_penalty_that_is_not_a_finite_number_at_least_zero(cache_path, weight_decay):
    with CacheFile(cache_path) as cache, pytest.raises(UsageError, match="weight decay must be a finite number >= 0"):
        fit_probe(cache, "L1.block_in", "value", weight_decay=weight_decay)


def test_probe_refuses_all_nan_activations(cache_path):
    _replace(cache_path, f"acts/clean/{HOOK}", lambda acts: np.full_like(acts, np.nan))
    with CacheFile(cache_path) as cache, pytest.raises(HookmechError, match=f"acts/clean/{HOOK} holds nan at row 0"):
        fit_probe(cache, "L1.block_in", "value")


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_das_and_probe_refuse_seeds_outside_0_to_2_64(cache_path, ar_model, seed):
    # one range for every command's seed (the trainer's too): torch's and numpy's, unsigned 64-bit
    with pytest.raises(UsageError, match=rf"seed must be an integer in 0\.\.{2**64 - 1}, got {seed}"):
        hookmech.das.train(ar_model, cache_path, "L1.block_in", "value", dims=[1], steps=1, seed=seed)
    with CacheFile(cache_path) as cache, pytest.raises(UsageError, match="seed must be an integer"):
        fit_probe(cache, "L1.block_in", "value", seed=seed)


def test_the_largest_seed_is_taken_by_das_and_probe(cache_path, ar_model):
    hookmech.das.train(ar_model, cache_path, "L1.block_in", "value", dims=[1], steps=1, seed=2**64 - 1)
    with CacheFile(cache_path) as cache:
        fit_probe(cache, "L1.block_in", "value", seed=2**64 - 1)
