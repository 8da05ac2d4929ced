"""Associative Treecall (paper 000 §3, appendices A, C, D.4): recall over a latent tree.

    BOS y₁ … yₙ DIV k   ->  the parent of the rightmost k in y (or its rightmost sibling)

The document y is the yield of a derivation of the grammar in `pcfg.py` (fixed by
`grammar_seed`, shared by every split); a derivation of fewer than 3 or more than
`max_length` symbols is redrawn (tinylang). The query k is the *rightmost* occurrence of
its terminal (so the question is unambiguous), sampled inversely to its parent's child
count: a parent uniformly among those with an eligible child, then one of those children
uniformly (tinylang's ``sample_first="target"``). Eligible children: every symbol but the
root head, rightmost of its terminal, and — with a split — whose (answer, key) terminal
pair the split allows (a fixed 20% of pairs by `split_seed` only in test, paper §5.3).

`query="sibling"` (appendix D.4) answers the key's rightmost sibling: the rightmost of the
symbols sharing its parent, which may be the key itself.

Token ids: terminals 0..num_terminals-1, then pad, BOS, divider. Rows are right-padded to
the batch's longest; the query is last, so padding never precedes a prediction. Roles:
`key` (the queried symbol in the document), `value` (its parent / rightmost sibling),
`divider`, `query`. The corrupted twin replaces the key (or the value, `corrupt="value"`)
by a terminal absent from the document, or by any other terminal where all occur.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import HookmechError, UsageError
from ..shapes import Tokens
from .ar import rng_for
from .base import Task
from .batch import Batch
from .draws import absent_tokens, check_split, held_out, split_allows
from .pcfg import Grammar, Yields, make_grammar, sample_yields

#: derivations of fewer symbols are redrawn (tinylang: a document needs a parent, a child and one more)
MIN_LENGTH = 3
#: most derivations drawn per round (bounds memory on long documents)
_ROUND_DOCS = 1 << 15
#: derivations drawn without a single usable document before the options are declared unusable
_GIVE_UP = 1 << 17
#: documents `chance` averages over
CHANCE_DOCUMENTS = 10_000


@dataclass
class TreeBatch(Batch):
    """A Batch with the tree: ``parent_pos [N, T]``, the position of each document token's
    parent, -1 for the root head and outside the document (BOS, divider, query, padding)."""

    parent_pos: Tokens = field(kw_only=True)


@dataclass
class _Queries:
    """Documents with their chosen query: yields, key/value positions in the yield, eligible counts."""

    yields: Yields
    key: np.ndarray
    value: np.ndarray
    n_eligible: np.ndarray
    usable_fraction: float  # of all derivations drawn, those with 3..max_length symbols and an eligible query


class AssociativeTreecall(Task):
    """ATR over a right- (or left-) headed GNF PCFG; defaults: the paper's easy setting (table 3b, L_max 5, |Σ| 20)."""

    name = "atr"
    roles = ("key", "value", "query", "divider")

    def __init__(
        self,
        num_terminals: int = 20,
        num_nonterminals: int = 40,
        max_depth: int = 10,
        max_rhs_len: int = 5,
        max_rules_per_nt: int = 5,
        head: str = "right",
        terminal_weight: float = 20.0,
        grammar_seed: int = 0,
        max_length: int = 1024,
        query: str = "parent",
        split: str | None = None,
        split_seed: int = 0,
        corrupt: str = "key",
    ):
        for option, value, least in [
            ("num_terminals", num_terminals, 2), ("num_nonterminals", num_nonterminals, 1), ("max_depth", max_depth, 1),
            ("max_rhs_len", max_rhs_len, 2), ("max_rules_per_nt", max_rules_per_nt, 1),
            ("max_length", max_length, MIN_LENGTH),
        ]:  # fmt: skip
            if value < least:
                raise UsageError(f"atr: {option} must be >= {least}, got {value}")
        if head not in ("right", "left"):
            raise UsageError(f"atr: head must be 'right' or 'left', got {head!r}")
        if not terminal_weight >= 0:
            raise UsageError(f"atr: terminal_weight must be >= 0, got {terminal_weight}")
        if query not in ("parent", "sibling"):
            raise UsageError(f"atr: query must be 'parent' or 'sibling', got {query!r}")
        if corrupt not in ("key", "value"):
            raise UsageError(f"atr: corrupt must be 'key' or 'value', got {corrupt!r}")
        check_split("atr", split)
        if grammar_seed < 0 or split_seed < 0:
            raise UsageError("atr: grammar_seed and split_seed must be >= 0")
        self.num_terminals, self.num_nonterminals, self.max_depth = num_terminals, num_nonterminals, max_depth
        self.max_rhs_len, self.max_rules_per_nt, self.head = max_rhs_len, max_rules_per_nt, head
        self.terminal_weight, self.grammar_seed, self.max_length = float(terminal_weight), grammar_seed, max_length
        self.query, self.split, self.split_seed, self.corrupt = query, split, split_seed, corrupt
        self.pad_id, self.bos_id, self.divider_id = num_terminals, num_terminals + 1, num_terminals + 2
        self.grammar: Grammar = make_grammar(
            num_terminals,
            num_nonterminals,
            max_depth,
            max_rhs_len,
            max_rules_per_nt,
            self.terminal_weight,
            head,
            grammar_seed,
        )
        if split is not None and num_terminals**2 <= 1 << 20:
            every = np.arange(num_terminals**2)
            if not split_allows(held_out(every // num_terminals, every % num_terminals, split_seed), split).any():
                raise UsageError(f"atr: {num_terminals} terminals leave no pair for split {split!r}")

    @property
    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_terminals": self.num_terminals,
            "num_nonterminals": self.num_nonterminals,
            "max_depth": self.max_depth,
            "max_rhs_len": self.max_rhs_len,
            "max_rules_per_nt": self.max_rules_per_nt,
            "head": self.head,
            "terminal_weight": self.terminal_weight,
            "grammar_seed": self.grammar_seed,
            "max_length": self.max_length,
            "query": self.query,
            "split": self.split,
            "split_seed": self.split_seed,
            "corrupt": self.corrupt,
        }

    @property
    def d_vocab(self) -> int:
        return self.num_terminals + 3

    @property
    def n_ctx(self) -> int:
        return self.max_length + 3

    # -- documents and queries ------------------------------------------------------------
    def _eligible(self, yields: Yields) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return (the symbols that may be queried, as indices into the yields; every symbol's
        value position in its document's yield; every symbol's position there)."""
        doc, labels, parent = yields.doc, yields.labels, yields.parent
        pos = np.arange(len(labels)) - yields.offsets[doc]
        # rightmost occurrence of each terminal in each document
        order = np.lexsort((pos, labels, doc))
        last = np.ones(len(order), dtype=bool)
        last[:-1] = (doc[order][1:] != doc[order][:-1]) | (labels[order][1:] != labels[order][:-1])
        rightmost = np.zeros(len(labels), dtype=bool)
        rightmost[order[last]] = True

        if self.query == "parent":
            value = parent
        else:  # the last symbol of each (document, parent) group
            order = np.lexsort((pos, parent, doc))
            boundary = (doc[order][1:] != doc[order][:-1]) | (parent[order][1:] != parent[order][:-1])
            group_end = np.append(boundary, True)[: len(order)]
            group = np.cumsum(np.insert(boundary, 0, False)[: len(order)])
            value = np.empty(len(labels), dtype=np.int64)
            value[order] = pos[order][group_end][group]
        has_parent = parent >= 0
        value_label = labels[yields.offsets[doc] + np.maximum(value, 0)]
        allowed = split_allows(held_out(value_label, labels, self.split_seed), self.split)
        return np.flatnonzero(has_parent & rightmost & allowed), value, pos

    def _choose_queries(self, rng: np.random.Generator, yields: Yields) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return per document (key, value) positions in its yield (-1 where none is eligible)
        and its number of eligible queries."""
        n_docs = len(yields.lengths)
        doc, parent = yields.doc, yields.parent
        eligible, value, pos = self._eligible(yields)

        # a parent uniformly, then one of its eligible children uniformly
        eligible = eligible[np.lexsort((pos[eligible], parent[eligible], doc[eligible]))]
        e_doc, e_parent = doc[eligible], parent[eligible]
        new_group = np.ones(len(eligible), dtype=bool)
        new_group[1:] = (e_doc[1:] != e_doc[:-1]) | (e_parent[1:] != e_parent[:-1])
        starts = np.flatnonzero(new_group)
        sizes = np.diff(np.append(starts, len(eligible)))
        groups_per_doc = np.bincount(e_doc[starts], minlength=n_docs)
        first_group = np.cumsum(groups_per_doc) - groups_per_doc
        u_parent, u_child = rng.random(n_docs), rng.random(n_docs)
        has = groups_per_doc > 0
        group = first_group[has] + (u_parent[has] * groups_per_doc[has]).astype(np.int64)
        chosen = eligible[starts[group] + (u_child[has] * sizes[group]).astype(np.int64)]
        key = np.full(n_docs, -1, dtype=np.int64)
        key[has] = pos[chosen]
        val = np.full(n_docs, -1, dtype=np.int64)
        val[has] = value[chosen]
        return key, val, np.bincount(e_doc, minlength=n_docs)

    def _documents(self, rng: np.random.Generator, n: int) -> _Queries:
        """Draw derivations round by round until `n` documents have an eligible query."""
        parts: list[tuple[Yields, np.ndarray, np.ndarray, np.ndarray]] = []
        have, tried, usable, rate = 0, 0, 0, 0.9
        while have < n:
            n_docs = int(min(_ROUND_DOCS, max(64, np.ceil((n - have) * 1.1 / rate))))
            yields = sample_yields(self.grammar, rng, n_docs, MIN_LENGTH, self.max_length)
            key, value, n_eligible = self._choose_queries(rng, yields)
            ok = np.flatnonzero(key >= 0)[: n - have]
            tried, usable = tried + n_docs, usable + int((key >= 0).sum())
            parts.append((_select_docs(yields, ok), key[ok], value[ok], n_eligible[ok]))
            have += len(ok)
            rate = max(usable / tried, 1e-3)
            if not usable and tried >= _GIVE_UP:
                raise HookmechError(
                    f"atr: no usable document in {tried} derivations (length {MIN_LENGTH}..{self.max_length}"
                    f"{', split ' + repr(self.split) if self.split else ''}); change the grammar options"
                )
        yields = _concat_yields([p[0] for p in parts], tried)
        key, value, n_eligible = (np.concatenate([p[i] for p in parts]) for i in (1, 2, 3))
        return _Queries(yields, key, value, n_eligible, usable_fraction=usable / tried)

    def sample(self, n: int, seed: int | Sequence[int]) -> TreeBatch:
        """Return `n` ATR rows (one document, one query each); deterministic in (spec, n, seed)."""
        if n < 1:
            raise UsageError(f"atr: number of examples must be >= 1, got {n}")
        rng = rng_for(seed)
        docs = self._documents(rng, n)
        yields, lengths = docs.yields, docs.yields.lengths
        width = int(lengths.max()) + 3
        rows = np.arange(n)
        tokens = np.full((n, width), self.pad_id, dtype=np.int64)
        parent_pos = np.full((n, width), -1, dtype=np.int64)
        column = np.arange(len(yields.labels)) - yields.offsets[yields.doc] + 1
        tokens[yields.doc, column] = yields.labels
        parent_pos[yields.doc, column] = np.where(yields.parent >= 0, yields.parent + 1, -1)
        tokens[:, 0] = self.bos_id
        tokens[rows, lengths + 1] = self.divider_id
        key_pos, value_pos = docs.key + 1, docs.value + 1
        tokens[rows, lengths + 2] = tokens[rows, key_pos]

        corrupt = tokens.copy()
        target = key_pos if self.corrupt == "key" else value_pos
        in_doc = np.where(np.arange(width)[None, :] <= lengths[:, None], tokens, -1)
        corrupt[rows, target] = absent_tokens(rng, in_doc, 0, self.num_terminals, tokens[rows, target])

        def as_tensor(array: np.ndarray) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))

        return TreeBatch(
            tokens=as_tensor(tokens),
            corrupt_tokens=as_tensor(corrupt),
            answers=as_tensor(tokens[rows, value_pos]),
            lengths=as_tensor(lengths + 3),
            doc_index=torch.arange(n, dtype=torch.int64),
            roles={
                "key": as_tensor(key_pos),
                "value": as_tensor(value_pos),
                "query": as_tensor(lengths + 2),
                "divider": as_tensor(lengths + 1),
            },
            parent_pos=as_tensor(parent_pos),
        )

    def chance(self, n: int = CHANCE_DOCUMENTS, seed: int = 0) -> float:
        """Return the mean, over `n` documents drawn with `seed`, of 1 / the number of distinct
        answers (value tokens) of the document's eligible queries: a guess that knows which
        symbols may be asked about but not which one is."""
        docs = self._documents(rng_for(seed), n).yields
        eligible, value, _ = self._eligible(docs)
        doc = docs.doc[eligible]
        answer = docs.labels[docs.offsets[doc] + value[eligible]]
        pairs = np.unique(doc * (self.num_terminals + 1) + answer)  # distinct (document, answer)
        per_doc = np.bincount(pairs // (self.num_terminals + 1), minlength=n)
        return float(np.mean(1.0 / per_doc[per_doc > 0]))

    def describe_tokens(self, tokens: list[int]) -> str:
        names = {self.pad_id: "PAD", self.bos_id: "BOS", self.divider_id: "DIV"}
        return " ".join(names.get(t, f"t{t}") for t in tokens)


def _select_docs(yields: Yields, docs: np.ndarray) -> Yields:
    lengths = yields.lengths[docs]
    starts = np.repeat(yields.offsets[docs], lengths)
    index = starts + np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return Yields(yields.labels[index], yields.parent[index], yields.depth[index], offsets, yields.tried)


def _concat_yields(parts: list[Yields], tried: int) -> Yields:
    offsets = [np.zeros(1, dtype=np.int64)]
    total = 0
    for part in parts:
        offsets.append(part.offsets[1:] + total)
        total += part.offsets[-1]
    return Yields(
        labels=np.concatenate([p.labels for p in parts]),
        parent=np.concatenate([p.parent for p in parts]),
        depth=np.concatenate([p.depth for p in parts]),
        offsets=np.concatenate(offsets),
        tried=tried,
    )


def atr_statistics(task: AssociativeTreecall, n: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Return statistics of `n` documents of `task` (paper 000 table 3b settings in docs/tasks.md):
    document length and depth (mean, max), key–value distance (mean and quantiles; value − key
    in positions), eligible queries per document (mean, max), and the fraction of
    derivations redrawn (outside 3..max_length symbols, or with no eligible query)."""
    docs = task._documents(rng_for(seed), n)
    lengths = docs.yields.lengths
    depth = np.maximum.reduceat(docs.yields.depth, docs.yields.offsets[:-1])
    distance = docs.value - docs.key
    quantiles = {f"p{q}": float(np.percentile(np.abs(distance), q)) for q in (10, 50, 90, 99)}
    return {
        "documents": int(n),
        "redrawn_fraction": 1 - docs.usable_fraction,
        "length_mean": float(lengths.mean()),
        "length_max": int(lengths.max()),
        "depth_mean": float(depth.mean()),
        "depth_max": int(depth.max()),
        "kv_distance_mean": float(distance.mean()),
        "kv_abs_distance": quantiles | {"max": int(np.abs(distance).max())},
        "eligible_mean": float(docs.n_eligible.mean()),
        "eligible_max": int(docs.n_eligible.max()),
    }
