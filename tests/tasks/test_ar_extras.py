"""AR options beyond the paper's default: value-first queries and the held-out pair split."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hookmech import tasks
from hookmech.errors import UsageError
from hookmech.tasks.draws import HELD_OUT_FRACTION, held_out

SETTINGS = settings(max_examples=20, deadline=None)


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
