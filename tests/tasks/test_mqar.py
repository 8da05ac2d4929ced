"""MQAR (zoology's multiquery_ar): document layout, one row per query, roles, corruption, power law."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hookmech import tasks
from hookmech.errors import UsageError
from hookmech.tasks.mqar import power_law_gaps

SETTINGS = settings(max_examples=25, deadline=None)


@st.composite
def mqar_tasks(draw):
    seq_len = draw(st.sampled_from([8, 16, 32, 64]))
    pairs = draw(st.integers(1, seq_len // 4))
    vocab = draw(st.sampled_from([seq_len + 2, 2 * seq_len, 512]))
    return tasks.make(
        "mqar", vocab_size=vocab, num_kv_pairs=pairs, seq_len=seq_len,
        power_a=draw(st.sampled_from([0.01, 0.5, 1.0])), random_non_queries=draw(st.booleans()),
        corrupt=draw(st.sampled_from(["key", "value"])),
    )  # fmt: skip


@SETTINGS
@given(task=mqar_tasks(), n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_rows_roles_and_documents(task, n, seed):
    batch = task.sample(n, seed)
    pairs, half, context = task.num_kv_pairs, task.vocab_size // 2, 2 * task.num_kv_pairs
    rows = torch.arange(n)
    key, value, query = batch.role("key"), batch.role("value"), batch.role("query")
    assert batch.tokens.shape == (n, task.seq_len) and (batch.lengths == task.seq_len).all()
    assert (batch.tokens < task.vocab_size).all()  # no padding, no specials
    # the queried key in context, its value right after it, the key again at the query position
    assert (key % 2 == 0).all() and (key < context).all() and (value == key + 1).all()
    assert (batch.tokens[rows, query] == batch.tokens[rows, key]).all()
    assert ((batch.tokens[rows, key] >= 1) & (batch.tokens[rows, key] < half)).all()
    assert (batch.answers == batch.tokens[rows, value]).all() and (batch.answers >= half).all()
    assert (query >= context).all() and ((query - context) % 2 == 0).all()
    # documents: ceil(n / pairs), rows of one document share its tokens; each key queried once, in time order
    assert batch.doc_index.tolist() == [i // pairs for i in range(n)]
    for doc in batch.doc_index.unique():
        mine = batch.doc_index == doc
        assert (batch.tokens[mine] == batch.tokens[mine][0]).all()
        assert len(set(key[mine].tolist())) == int(mine.sum())
        assert (query[mine].diff() > 0).all()
        keys_in_context = batch.tokens[mine][0, 0:context:2]
        assert len(set(keys_in_context.tolist())) == pairs
    if not task.random_non_queries:  # the query region holds each key once and the filler 0 elsewhere
        for row in batch.tokens:
            region = row[context:]
            assert sorted(region[region != 0].tolist()) == sorted(row[0:context:2].tolist())

@SETTINGS
@given(task=mqar_tasks(), seed=st.integers(0, 2**16))
def test_corruption_only_at_the_pair_and_absent(task, seed):
    batch = task.sample(30, seed)
    rows = torch.arange(len(batch))
    where = batch.role(task.corrupt)
    changed = batch.tokens != batch.corrupt_tokens
    assert (changed.sum(1) == 1).all() and changed[rows, where].all()
    half = task.vocab_size // 2
    new = batch.corrupt_tokens[rows, where]
    in_key_half = (new >= 1) & (new < half)
    assert in_key_half.all() if task.corrupt == "key" else (new >= half).all()
    for row in range(len(batch)):
        doc = batch.tokens[row].tolist()
        klass = range(1, half) if task.corrupt == "key" else range(half, task.vocab_size)
        if not set(klass) <= set(doc):  # absent wherever an absent token exists
            assert int(new[row]) not in doc


def test_deterministic_by_seed_and_spec_roundtrip():
    task = tasks.make("mqar", vocab_size=256, num_kv_pairs=4, seq_len=64)
    a, b, c = task.sample(20, (0, 7)), task.sample(20, (0, 7)), task.sample(20, (0, 8))
    for name in ("tokens", "corrupt_tokens", "answers", "doc_index"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.tokens, c.tokens)
    rebuilt = tasks.from_spec(task.spec)
    assert rebuilt.spec == task.spec and torch.equal(rebuilt.sample(20, (0, 7)).tokens, a.tokens)
    assert task.d_vocab == 257 and task.n_ctx == 64


def test_no_divider_role_is_a_clear_error():
    batch = tasks.make("mqar", vocab_size=64, num_kv_pairs=2, seq_len=16).sample(4, 0)
    with pytest.raises(UsageError, match="divider"):
        batch.role("divider")


@pytest.mark.parametrize("options", [dict(seq_len=15), dict(seq_len=16, num_kv_pairs=5), dict(seq_len=16, vocab_size=16),
                                     dict(power_a=0.0), dict(corrupt="query")])  # fmt: skip
def test_bad_options_are_usage_errors(options):
    base = dict(vocab_size=64, num_kv_pairs=2, seq_len=16)
    with pytest.raises(UsageError):
        tasks.make("mqar", **(base | options))


def test_power_law_gaps_match_sequential_choice():
    # zoology draws gaps with rng.choice(space, k, replace=False, p=p); compare marginals of each draw
    space, k, a, n = 24, 3, 0.01, 20000
    ours = power_law_gaps(np.random.default_rng(0), n, k, space, a)
    assert (np.sort(ours, axis=1)[:, 1:] != np.sort(ours, axis=1)[:, :-1]).all()
    p = a * np.arange(1, space + 1) ** (a - 1)
    p /= p.sum()
    rng = np.random.default_rng(1)
    reference = np.stack([rng.choice(space, k, replace=False, p=p) for _ in range(n)])
    for draw in range(k):
        ours_hist = np.bincount(ours[:, draw], minlength=space) / n
        ref_hist = np.bincount(reference[:, draw], minlength=space) / n
        # two seeded samples of one distribution: a bin's difference has sd <= sqrt(2 * 0.25 / n) = 0.005
        assert np.abs(ours_hist - ref_hist).max() < 0.02
