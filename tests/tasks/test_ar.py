"""AR task invariants (paper 000 §3): property tests over options and seeds."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hookmech
from hookmech.errors import UsageError

options = st.tuples(st.integers(2, 40), st.integers(1, 8)).filter(lambda t: t[1] + 1 <= t[0]).map(
    lambda t: {"vocab_size": 2 * t[0], "num_kv_pairs": t[1]})


@settings(max_examples=40, deadline=None)
@given(options=options, seed=st.integers(0, 2**31), n=st.integers(1, 50))
def test_ar_invariants(options, seed, n):
    task = hookmech.tasks.make("ar", **options)
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
    task = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    a, b, c = task.sample(20, seed=3), task.sample(20, seed=3), task.sample(20, seed=4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.corrupt_tokens, b.corrupt_tokens)
    assert not torch.equal(a.tokens, c.tokens)
    assert torch.equal(task.sample(5, seed=(3, 1)).tokens, task.sample(5, seed=(3, 1)).tokens)


def test_queries_and_keys_are_spread_uniformly():
    task = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    batch = task.sample(8000, seed=0)
    counts = torch.bincount(batch.roles["key"], minlength=9)[1::2].float()
    assert (counts / 8000 - 0.25).abs().max() < 0.03  # sd sqrt(0.25 * 0.75 / 8000) = 0.005 (seeded)
    key_counts = torch.bincount(batch.tokens[:, 1], minlength=32)[:32].float()
    assert key_counts.min() > 0.5 * key_counts.mean()


def test_value_corruption_mode():
    task = hookmech.tasks.make("ar", vocab_size=32, num_kv_pairs=3, corrupt="value")
    batch = task.sample(50, seed=0)
    rows = torch.arange(50)
    changed = batch.tokens != batch.corrupt_tokens
    assert changed[rows, batch.roles["value"]].all() and (changed.sum(1) == 1).all()


@pytest.mark.parametrize("options", [{"vocab_size": 7}, {"num_kv_pairs": 0}, {"vocab_size": 8, "num_kv_pairs": 4},
                                     {"corrupt": "query"}, {"vocab_sise": 64}])
def test_invalid_options_are_refused(options):
    with pytest.raises(UsageError):
        hookmech.tasks.make("ar", **options)


def test_unknown_task_and_role_suggest_names():
    with pytest.raises(UsageError, match="ar"):
        hookmech.tasks.make("arr")
    batch = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=2).sample(2, seed=0)
    with pytest.raises(UsageError, match="value"):
        batch.role("valeu")


def test_spec_round_trip():
    task = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    rebuilt = hookmech.tasks.from_spec(task.spec)
    assert rebuilt.spec == task.spec
    assert torch.equal(rebuilt.sample(4, seed=0).tokens, task.sample(4, seed=0).tokens)
