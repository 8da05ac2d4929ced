"""The PCFG behind Associative Treecall (paper 000 §3.1, appendix A), and a vectorised sampler of its yields.

A rule of nonterminal X in right-Greibach normal form is ``X → Y₁ … Yₘ h``: m ∈ 1..L_max-1
symbols, then the head terminal h (``head="left"``: ``X → h Y₁ … Yₘ``). The head is the
parent of every symbol the rule generates: a terminal Yᵢ directly, a nonterminal Yᵢ
through the head of the rule that rewrites it. The root rule's head has no parent.

Construction, from `grammar_seed` only (where the paper is silent we follow tinylang
`language/pcfg.py`; docs/tasks.md lists every choice):

- depth score d(X) uniform on 1..max_depth; the body of X's rules may hold only
  nonterminals Y with d(Y) > d(X), so there is no recursion and a derivation has at most
  max_depth levels of rules;
- X has R uniform on 1..max_rules_per_nt rules, with probabilities ~ Dirichlet(1, …, 1);
- a rule body has m uniform on 1..max_rhs_len-1 symbols drawn with replacement, each a
  terminal (uniform over Σ) with weight `terminal_weight` (r_Σ) against weight 1 for each
  admissible nonterminal — r_Σ weighs the terminal *class*, so |Σ| does not change the
  tree shapes (paper §5.2: varying |Σ| leaves syntactic complexity alone);
- heads are not part of the rule: every expansion of X draws its head from X's own
  distribution over Σ ~ Dirichlet(1, …, 1) (appendix A.1);
- the start symbol is uniform over the nonterminals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from .ar import rng_for


@dataclass(frozen=True)
class Grammar:
    """A GNF PCFG as arrays. Body symbols: ids < num_terminals are terminals, id
    ``num_terminals + X`` is nonterminal X."""

    num_terminals: int
    num_nonterminals: int
    max_depth: int
    max_rhs_len: int
    head: str
    depth_score: np.ndarray  # [NT] in 1..max_depth
    rule_offset: np.ndarray  # [NT+1]: X's rules are rule_offset[X] .. rule_offset[X+1]-1
    rule_prob: np.ndarray  # [R]
    rule_body: np.ndarray  # [R, max_rhs_len-1] symbol ids, -1 past the body
    rule_len: np.ndarray  # [R] body lengths m
    head_prob: np.ndarray  # [NT, Σ]

    @property
    def num_rules(self) -> np.ndarray:
        """``[NT]`` rules per nonterminal."""
        return np.diff(self.rule_offset)


def make_grammar(
    num_terminals: int,
    num_nonterminals: int,
    max_depth: int,
    max_rhs_len: int,
    max_rules_per_nt: int,
    terminal_weight: float,
    head: str,
    grammar_seed: int,
) -> Grammar:
    """Draw the grammar fixed by `grammar_seed` (see the module docstring)."""
    if max_rhs_len**max_depth >= 2**62:
        raise UsageError(
            f"atr: max_rhs_len ** max_depth must be < 2**62 (yield order keys), got {max_rhs_len}**{max_depth}"
        )
    rng = rng_for(grammar_seed)
    n_t, n_nt = num_terminals, num_nonterminals
    depth_score = rng.integers(1, max_depth + 1, size=n_nt)
    bodies: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    counts = []
    for nt in range(n_nt):
        n_rules = int(rng.integers(1, max_rules_per_nt + 1))
        admissible = np.flatnonzero(depth_score > depth_score[nt])
        weights = np.concatenate([[terminal_weight], np.ones(len(admissible))])
        if weights.sum() == 0:  # r_Σ = 0 and nothing deeper: terminals only
            weights[0] = 1.0
        for _ in range(n_rules):
            m = int(rng.integers(1, max_rhs_len))
            pick = rng.choice(len(weights), size=m, p=weights / weights.sum())
            terminals = rng.integers(0, n_t, size=m)
            nonterminals = n_t + admissible[np.maximum(pick - 1, 0)] if len(admissible) else terminals
            body = np.full(max_rhs_len - 1, -1, dtype=np.int64)
            body[:m] = np.where(pick == 0, terminals, nonterminals)
            bodies.append(body)
        probs.append(rng.dirichlet(np.ones(n_rules)))
        counts.append(n_rules)
    head_prob = rng.dirichlet(np.ones(n_t), size=n_nt)
    rule_body = np.stack(bodies)
    return Grammar(
        num_terminals=n_t,
        num_nonterminals=n_nt,
        max_depth=max_depth,
        max_rhs_len=max_rhs_len,
        head=head,
        depth_score=depth_score,
        rule_offset=np.concatenate([[0], np.cumsum(counts)]),
        rule_prob=np.concatenate(probs),
        rule_body=rule_body,
        rule_len=(rule_body >= 0).sum(axis=1),
        head_prob=head_prob,
    )


@dataclass
class Yields:
    """Accepted derivations, flattened document-major in yield order.

    labels, parent, depth: ``[total]`` (parent: the parent's position *within its
    document*, -1 for the root head; depth: 1 for the root rule's symbols);
    offsets: ``[D+1]``; tried: derivations drawn, including those rejected for length.
    """

    labels: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    offsets: np.ndarray
    tried: int

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def doc(self) -> np.ndarray:
        """``[total]`` document of each symbol."""
        return np.repeat(np.arange(len(self.offsets) - 1), self.lengths)


def _cumulative(probs: np.ndarray) -> np.ndarray:
    # row r's cumulative distribution shifted by r, flattened: one searchsorted samples every row
    cum = np.cumsum(probs, axis=1)
    cum /= cum[:, -1:]
    return (cum + np.arange(len(probs))[:, None]).reshape(-1)


def sample_yields(grammar: Grammar, rng: np.random.Generator, n_docs: int, min_length: int, max_length: int) -> Yields:
    """Derive `n_docs` yields from uniform start symbols, level by level for all documents
    at once; keep those of `min_length`..`max_length` symbols (fewer than `n_docs` come back)."""
    g = grammar
    n_t, base = g.num_terminals, g.max_rhs_len
    head_digit, first_child_digit = (base - 1, 0) if g.head == "right" else (0, 1)
    head_cum = _cumulative(g.head_prob)
    padded_rule_prob = np.zeros((g.num_nonterminals, int(g.num_rules.max())))
    for nt in range(g.num_nonterminals):
        padded_rule_prob[nt, : g.num_rules[nt]] = g.rule_prob[g.rule_offset[nt] : g.rule_offset[nt + 1]]
    rule_cum = _cumulative(padded_rule_prob)

    # frontier: nonterminal instances still to rewrite
    f_doc = np.arange(n_docs)
    f_nt = rng.integers(0, g.num_nonterminals, size=n_docs)
    f_parent = np.full(n_docs, -1, dtype=np.int64)  # leaf id of the head above, -1 at the root
    f_path = np.zeros(n_docs, dtype=np.int64)  # base-`base` digits of the route from the root
    n_symbols = np.zeros(n_docs, dtype=np.int64)
    alive = np.ones(n_docs, dtype=bool)
    leaves: list[tuple[np.ndarray, ...]] = []  # per level: (doc, label, parent id, path, depth, id)
    next_id, level = 0, 0
    while len(f_doc):
        n_f = len(f_doc)
        # rewrite each instance: draw its rule, then its head from its nonterminal's distribution
        rule_in_nt = np.searchsorted(rule_cum, f_nt + rng.random(n_f), side="right") - f_nt * padded_rule_prob.shape[1]
        rule = g.rule_offset[f_nt] + np.minimum(rule_in_nt, g.num_rules[f_nt] - 1)
        head = np.minimum(np.searchsorted(head_cum, f_nt + rng.random(n_f), side="right") - f_nt * n_t, n_t - 1)
        body_len = g.rule_len[rule]
        owner = np.repeat(np.arange(n_f), body_len)
        slot = np.arange(len(owner)) - np.repeat(np.cumsum(body_len) - body_len, body_len)
        symbol = g.rule_body[rule[owner], slot]
        path = f_path[owner] * base + slot + first_child_digit
        is_terminal = symbol < n_t
        t_owner = owner[is_terminal]

        # leaf ids: this level's heads, then its body terminals
        head_id = next_id + np.arange(n_f)
        t_id = next_id + n_f + np.arange(len(t_owner))
        next_id += n_f + len(t_owner)
        depth = np.full(n_f + len(t_owner), level + 1)
        leaves.append(
            (
                np.concatenate([f_doc, f_doc[t_owner]]),
                np.concatenate([head, symbol[is_terminal]]),
                np.concatenate([f_parent, head_id[t_owner]]),
                np.concatenate([f_path * base + head_digit, path[is_terminal]]),
                depth,
                np.concatenate([head_id, t_id]),
            )
        )

        nt_owner = owner[~is_terminal]
        f_doc, f_nt = f_doc[nt_owner], symbol[~is_terminal] - n_t
        f_parent, f_path = head_id[nt_owner], path[~is_terminal]
        # each pending nonterminal yields >= 2 symbols: drop documents already too long
        n_symbols += np.bincount(leaves[-1][0], minlength=n_docs)
        alive &= n_symbols + 2 * np.bincount(f_doc, minlength=n_docs) <= max_length
        keep = alive[f_doc]
        f_doc, f_nt, f_parent, f_path = f_doc[keep], f_nt[keep], f_parent[keep], f_path[keep]
        level += 1

    doc, label, parent_id, path, depth, leaf_id = (np.concatenate(column) for column in zip(*leaves, strict=True))
    accepted = alive & (n_symbols >= min_length) & (n_symbols <= max_length)
    order_key = path * base ** (g.max_depth - depth)  # lexicographic order of routes = yield order
    keep = np.flatnonzero(accepted[doc])
    keep = keep[np.lexsort((order_key[keep], doc[keep]))]
    position_of = np.full(next_id, -1, dtype=np.int64)
    lengths = n_symbols[accepted]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    position_of[leaf_id[keep]] = np.arange(len(keep)) - np.repeat(offsets[:-1], lengths)
    parents = parent_id[keep]
    return Yields(
        labels=label[keep],
        parent=np.where(parents >= 0, position_of[np.maximum(parents, 0)], -1),
        depth=depth[keep],
        offsets=offsets,
        tried=n_docs,
    )
