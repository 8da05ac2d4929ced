"""The AR task (paper 000 §3): invariants over options and seeds, and the options beyond the
paper's default (value-first queries, the held-out pair split)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hookmech import tasks
from hookmech.errors import UsageError
from hookmech.tasks.draws import HELD_OUT_FRACTION, held_out

SETTINGS = settings(max_examples=20, deadline=None)

options = st.tuples(st.integers(2, 40), st.integers(1, 8)).filter(lambda t: t[1] + 1 <= t[0]).map(
    lambda t: {"vocab_size": 2 * t[0], "num_kv_pairs": t[1]})


@settings(max_examples=40, deadline=None)
@given(options=options, seed=st.integers(0, 2**31), n=st.integers(1, 50))
def test_ar_invariants(options, seed, n):
    task = tasks.make("ar", **options)
    batch = task.sample(n, seed=seed)
    rows = torch.arange(n)
    half, pairs = options["vocab_size"] // 2, options["num_kv_pairs"]
    tokens, corrupt = batch.tokens, batch.corrupt_tokens
    assert tokens.shape == (n, 2 * pairs + 3) and (tokens < task.d_vocab).all()
    assert (tokens[:, 0] == task.bos_id).all() and (tokens[rows, batch.roles["divider"]] == task.divider_id).all()
    keys, values = tokens[:, 1:-2:2], tokens[:, 2:-2:2]
    assert (keys < half).all() and (values >= half).all() and (values < 2 * half).all()
    for row in range(n):  # without replacement
        assert len(set(keys[row].tolist())) == pairs and len(set(values[row].tolist())) == pairs
    assert (tokens[rows, batch.roles["key"]] == tokens[rows, batch.roles["query"]]).all()
    assert (batch.answers == tokens[rows, batch.roles["value"]]).all()
    assert (batch.roles["value"] == batch.roles["key"] + 1).all()
    # corruption: only the key changes, to a key absent from the document
    changed = tokens != corrupt
    assert (changed.sum(1) == 1).all() and changed[rows, batch.roles["key"]].all()
    new_keys = corrupt[rows, batch.roles["key"]]
    assert (new_keys < half).all()
    for row in range(n):
        assert new_keys[row].item() not in tokens[row].tolist()


def test_sampling_is_deterministic_by_seed():
    task = tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    a, b, c = task.sample(20, seed=3), task.sample(20, seed=3), task.sample(20, seed=4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.corrupt_tokens, b.corrupt_tokens)
    assert not torch.equal(a.tokens, c.tokens)
    assert torch.equal(task.sample(5, seed=(3, 1)).tokens, task.sample(5, seed=(3, 1)).tokens)


def test_queries_and_keys_are_spread_uniformly():
    task = tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    batch = task.sample(8000, seed=0)
    counts = torch.bincount(batch.roles["key"], minlength=9)[1::2].float()
    assert (counts / 8000 - 0.25).abs().max() < 0.03  # sd sqrt(0.25 * 0.75 / 8000) = 0.005 (seeded)
    key_counts = torch.bincount(batch.tokens[:, 1], minlength=32)[:32].float()
    assert key_counts.min() > 0.5 * key_counts.mean()


def test_value_corruption_mode():
    task = tasks.make("ar", vocab_size=32, num_kv_pairs=3, corrupt="value")
    batch = task.sample(50, seed=0)
    rows = torch.arange(50)
    changed = batch.tokens != batch.corrupt_tokens
    assert changed[rows, batch.roles["value"]].all() and (changed.sum(1) == 1).all()


@pytest.mark.parametrize("options", [{"vocab_size": 7}, {"num_kv_pairs": 0}, {"vocab_size": 8, "num_kv_pairs": 4},
                                     {"corrupt": "query"}, {"vocab_sise": 64}])
def test_invalid_options_are_refused(options):
    with pytest.raises(UsageError):
        tasks.make("ar", **options)


def test_unknown_task_and_role_suggest_names():
    with pytest.raises(UsageError, match="ar"):
        tasks.make("arr")
    batch = tasks.make("ar", vocab_size=16, num_kv_pairs=2).sample(2, seed=0)
    with pytest.raises(UsageError, match="value"):
        batch.role("valeu")


def test_spec_round_trip():
    task = tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    rebuilt = tasks.from_spec(task.spec)
    assert rebuilt.spec == task.spec
    assert torch.equal(rebuilt.sample(4, seed=0).tokens, task.sample(4, seed=0).tokens)


# -- options beyond the paper's default: value-first queries, the held-out pair split ---------
def test_default_spec_has_no_new_keys():
    # run folders and checkpoints made before the options existed must still match
    assert tasks.make("ar").spec == {"name": "ar", "vocab_size": 8192, "num_kv_pairs": 16, "corrupt": "key"}


@SETTINGS
@given(pairs=st.integers(1, 6), seed=st.integers(0, 2**16), corrupt=st.sampled_from(["key", "value"]))
def test_value_first_roles_answer_and_corruption(pairs, seed, corrupt):
    task = tasks.make("ar", vocab_size=32, num_kv_pairs=pairs, query_by="value", corrupt=corrupt)
    batch = task.sample(64, seed)
    rows = torch.arange(len(batch))
    key, value, query = batch.role("key"), batch.role("value"), batch.role("query")
    half = task.vocab_size // 2
    assert (batch.tokens[rows, query] == batch.tokens[rows, key]).all()
    assert (batch.tokens[rows, key] >= half).all()  # the queried token is a value ...
    assert (value == key - 1).all()  # ... and its partner key precedes it
    assert (batch.answers == batch.tokens[rows, value]).all()
    assert (batch.answers < half).all()
    where = key if corrupt == "key" else value
    changed = batch.tokens != batch.corrupt_tokens
    assert (changed.sum(1) == 1).all() and changed[rows, where].all()
    new = batch.corrupt_tokens[rows, where]
    assert ((new >= half) == (batch.tokens[rows, where] >= half)).all()  # same class
    for row in range(len(batch)):
        assert new[row] not in batch.tokens[row].tolist()
    assert tasks.from_spec(task.spec).spec == task.spec


def test_held_out_fraction_and_seed():
    a, b = np.meshgrid(np.arange(300), np.arange(300))
    held = held_out(a, b, split_seed=3)
    assert abs(held.mean() - HELD_OUT_FRACTION) < 0.01  # 90000 pairs: sd of the fraction below 0.0015
    assert (held == held_out(a, b, split_seed=3)).all()
    assert (held != held_out(a, b, split_seed=4)).mean() > 0.2


@SETTINGS
@given(seed=st.integers(0, 2**16), split_seed=st.integers(0, 100), query_by=st.sampled_from(["key", "value"]))
def test_split_pairs_disjoint(seed, split_seed, query_by):
    seen = {}
    for split in ("train", "dev", "test"):
        task = tasks.make("ar", vocab_size=64, num_kv_pairs=4, split=split, split_seed=split_seed, query_by=query_by)
        batch = task.sample(200, seed)
        rows = torch.arange(len(batch))
        keys = batch.tokens[rows, torch.minimum(batch.role("key"), batch.role("value"))].numpy()
        values = batch.tokens[rows, torch.maximum(batch.role("key"), batch.role("value"))].numpy() - 32
        held = held_out(keys, values, split_seed)
        assert held.all() if split == "test" else not held.any()
        seen[split] = set(zip(keys.tolist(), values.tolist(), strict=True))
    assert not (seen["train"] | seen["dev"]) & seen["test"]


def test_split_is_deterministic_and_bad_split_is_usage_error():
    task = tasks.make("ar", vocab_size=64, num_kv_pairs=4, split="test", split_seed=1)
    a, b = task.sample(50, (1, 2)), task.sample(50, (1, 2))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.corrupt_tokens, b.corrupt_tokens)
    with pytest.raises(UsageError, match="split"):
        tasks.make("ar", split="validation")
    with pytest.raises(UsageError, match="query_by"):
        tasks.make("ar", query_by="both")
