"""ATR: grammar invariants, tree (parent_pos), queries, corruption, splits, sampling weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, reject, settings, strategies as st

from hookmech import tasks
from hookmech.errors import HookmechError, UsageError
from hookmech.tasks.atr import TreeBatch, atr_statistics
from hookmech.tasks.draws import held_out

SETTINGS = settings(max_examples=20, deadline=None)


@st.composite
def atr_tasks(draw, **fixed):
    options = dict(
        num_terminals=draw(st.sampled_from([2, 5, 20, 300])),
        num_nonterminals=draw(st.integers(1, 12)),
        max_depth=draw(st.integers(1, 6)),
        max_rhs_len=draw(st.integers(2, 6)),
        max_rules_per_nt=draw(st.integers(1, 4)),
        head=draw(st.sampled_from(["right", "left"])),
        terminal_weight=draw(st.sampled_from([0.0, 1.0, 20.0])),
        grammar_seed=draw(st.integers(0, 1000)),
        max_length=draw(st.sampled_from([8, 40, 1024])),
        query=draw(st.sampled_from(["parent", "sibling"])),
        corrupt=draw(st.sampled_from(["key", "value"])),
    )
    return tasks.make("atr", **(options | fixed))


def sample(task, n, seed):
    """Sample, skipping drawn grammars that cannot yield a usable document (tested below)."""
    try:
        return task.sample(n, seed)
    except HookmechError:
        reject()


def documents(batch):
    """Yield (row, document tokens, parents within the document) in document coordinates (0-based)."""
    for row in range(len(batch)):
        n = int(batch.lengths[row]) - 3
        yield row, batch.tokens[row, 1 : n + 1].tolist(), [p - 1 if p >= 0 else -1 for p in batch.parent_pos[row, 1 : n + 1].tolist()]


def check_tree(parents, head):
    """The parent relation is a tree whose root is the document's last (first) symbol, and
    every head is the rightmost (leftmost) symbol of the span it heads; returns the depth."""
    n = len(parents)
    root = n - 1 if head == "right" else 0
    assert [i for i, p in enumerate(parents) if p < 0] == [root]
    depth = [0] * n
    for i in range(n):  # follow parents to the root (no cycles: at most n steps)
        j, steps = i, 0
        while parents[j] >= 0:
            j, steps = parents[j], steps + 1
            assert steps <= n
        depth[i] = steps + 1
    for p in set(parents) - {-1}:  # descendants of p: a contiguous span ending (starting) at p
        span = [i for i in range(n) if _descends(i, p, parents)]
        assert span == (list(range(p - len(span) + 1, p + 1)) if head == "right" else list(range(p, p + len(span))))
    return max(depth)


def _descends(i, p, parents):
    while i >= 0:
        if i == p:
            return True
        i = parents[i]
    return False


@SETTINGS
@given(task=atr_tasks(), seed=st.integers(0, 2**16))
def test_documents_are_trees_within_bounds(task, seed):
    batch = sample(task, 12, seed)
    assert isinstance(batch, TreeBatch) and batch.parent_pos.shape == batch.tokens.shape
    for row, doc, parents in documents(batch):
        assert 3 <= len(doc) <= task.max_length
        assert all(0 <= t < task.num_terminals for t in doc)
        # at most max_depth levels of rules; a rule's body sits one level below its head in the terminal tree
        assert check_tree(parents, task.head) <= task.max_depth + 1
    outside = torch.arange(batch.tokens.shape[1])[None, :] > batch.lengths[:, None] - 3
    outside[:, 0] = True
    assert (batch.parent_pos[outside] == -1).all()


@SETTINGS
@given(task=atr_tasks(), seed=st.integers(0, 2**16))
def test_roles_answers_and_padding(task, seed):
    batch = sample(task, 12, seed)
    rows = torch.arange(len(batch))
    key, value, query, divider = (batch.role(r) for r in ("key", "value", "query", "divider"))
    assert (batch.tokens[:, 0] == task.bos_id).all() and (batch.tokens[rows, divider] == task.divider_id).all()
    assert (query == divider + 1).all() and (batch.lengths == query + 1).all()
    assert (batch.tokens[rows, query] == batch.tokens[rows, key]).all()
    assert (batch.answers == batch.tokens[rows, value]).all()
    pad = torch.arange(batch.tokens.shape[1])[None, :] >= batch.lengths[:, None]
    assert (batch.tokens[pad] == task.pad_id).all() and (batch.tokens[~pad] != task.pad_id).all()
    for row, doc, parents in documents(batch):
        k, v = int(key[row]) - 1, int(value[row]) - 1
        assert doc[k] not in doc[k + 1 :]  # the rightmost occurrence of the queried terminal
        assert parents[k] >= 0  # never the root head
        if task.query == "parent":
            assert v == parents[k]
        else:  # the rightmost symbol sharing the key's parent (possibly the key itself)
            assert v == max(i for i, p in enumerate(parents) if p == parents[k])


@SETTINGS
@given(task=atr_tasks(), seed=st.integers(0, 2**16))
def test_corruption_only_at_its_role_and_absent(task, seed):
    batch = sample(task, 12, seed)
    rows = torch.arange(len(batch))
    where = batch.role(task.corrupt)
    changed = batch.tokens != batch.corrupt_tokens
    assert (changed.sum(1) == 1).all() and changed[rows, where].all()
    for row, doc, _ in documents(batch):
        new = int(batch.corrupt_tokens[row, where[row]])
        assert 0 <= new < task.num_terminals and new != doc[int(where[row]) - 1]
        if len(set(doc)) < task.num_terminals:
            assert new not in doc


def test_a_grammar_without_usable_documents_is_a_clear_error():
    # one nonterminal whose rules are `X -> t h`: every yield has 2 symbols
    with pytest.raises(HookmechError, match="no usable document"):
        tasks.make("atr", num_nonterminals=1, max_rhs_len=2).sample(5, 0)


def test_grammar_has_no_recursion_and_respects_its_bounds():
    for seed in range(5):
        task = tasks.make("atr", grammar_seed=seed, max_rhs_len=10, num_terminals=30)
        g = task.grammar
        assert ((g.depth_score >= 1) & (g.depth_score <= task.max_depth)).all()
        assert ((g.num_rules >= 1) & (g.num_rules <= task.max_rules_per_nt)).all()
        assert ((g.rule_len >= 1) & (g.rule_len <= task.max_rhs_len - 1)).all()
        # normalised probabilities: float64 round-off of their sums (np.allclose's defaults)
        assert np.allclose(np.add.reduceat(g.rule_prob, g.rule_offset[:-1]), 1)
        assert np.allclose(g.head_prob.sum(1), 1)
        for nt in range(g.num_nonterminals):
            body = g.rule_body[g.rule_offset[nt] : g.rule_offset[nt + 1]]
            inner = body[body >= g.num_terminals] - g.num_terminals
            assert (g.depth_score[inner] > g.depth_score[nt]).all()


def test_deterministic_by_seed_and_spec_roundtrip():
    task = tasks.make("atr", grammar_seed=3)
    a, b, c = task.sample(40, (1, 2)), task.sample(40, (1, 2)), task.sample(40, (1, 3))
    for name in ("tokens", "corrupt_tokens", "answers", "parent_pos"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.tokens[:, :5], c.tokens[:, :5])
    rebuilt = tasks.from_spec(task.spec)
    assert torch.equal(rebuilt.sample(40, (1, 2)).tokens, a.tokens)
    assert not torch.equal(tasks.make("atr", grammar_seed=4).sample(40, (1, 2)).tokens[:, :5], a.tokens[:, :5])
    assert task.d_vocab == 23 and task.n_ctx == 1027


def test_tree_batch_select_and_to_keep_parents():
    batch = tasks.make("atr").sample(10, 0)
    part = batch.select(torch.tensor([3, 1]))
    assert isinstance(part, TreeBatch) and torch.equal(part.parent_pos, batch.parent_pos[[3, 1]])
    assert torch.equal(batch.select(slice(2, 4)).parent_pos, batch.parent_pos[2:4])
    assert torch.equal(batch.to("cpu").parent_pos, batch.parent_pos)


@pytest.mark.parametrize("query", ["parent", "sibling"])
def test_split_pairs_are_disjoint(query):
    seen = {}
    for split in ("train", "dev", "test"):
        task = tasks.make("atr", split=split, split_seed=5, query=query)
        batch = task.sample(300, 0)
        rows = torch.arange(len(batch))
        keys, answers = batch.tokens[rows, batch.role("key")].numpy(), batch.answers.numpy()
        held = held_out(answers, keys, 5)
        assert held.all() if split == "test" else not held.any()
        seen[split] = set(zip(answers.tolist(), keys.tolist(), strict=True))
    assert not (seen["train"] | seen["dev"]) & seen["test"]


def test_queries_are_inverse_to_the_parents_child_count():
    # a parent is chosen uniformly, then a child: P(parent with the most eligible children) = 1/#parents,
    # where sampling children uniformly would give (its children) / (all eligible children)
    batch = tasks.make("atr", num_terminals=50, max_rhs_len=8).sample(4000, 0)
    hits, inverse, uniform = [], [], []
    for row, doc, parents in documents(batch):
        eligible = [i for i in range(len(doc)) if parents[i] >= 0 and doc[i] not in doc[i + 1 :]]
        children = {}
        for i in eligible:
            children.setdefault(parents[i], []).append(i)
        biggest = max(children, key=lambda p: (len(children[p]), -p))
        hits.append(parents[int(batch.role("key")[row]) - 1] == biggest)
        inverse.append(1 / len(children))
        uniform.append(len(children[biggest]) / len(eligible))
    hits, inverse, uniform = np.mean(hits), np.mean(inverse), np.mean(uniform)
    error = 4 * np.sqrt(inverse * (1 - inverse) / len(batch))
    assert abs(hits - inverse) < error and abs(hits - uniform) > 2 * error


def test_statistics_report_the_paper_quantities():
    stats = atr_statistics(tasks.make("atr"), n=500, seed=0)
    assert 3 <= stats["length_mean"] <= stats["length_max"] <= 1024
    assert 1 <= stats["depth_mean"] <= stats["depth_max"] <= 10
    assert stats["kv_distance_mean"] > 0  # right-headed: the parent follows its child
    assert 1 <= stats["eligible_mean"] <= stats["eligible_max"] <= 20
    assert 0 <= stats["redrawn_fraction"] < 1


@pytest.mark.parametrize("options", [dict(head="middle"), dict(query="child"), dict(split="val"), dict(max_rhs_len=1),
                                     dict(terminal_weight=-1), dict(max_rhs_len=30, max_depth=20)])  # fmt: skip
def test_bad_options_are_usage_errors(options):
    with pytest.raises(UsageError):
        tasks.make("atr", **options)
