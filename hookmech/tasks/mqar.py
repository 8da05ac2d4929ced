"""Multi-query associative recall (paper 003 §2, A.2; zoology's `multiquery_ar`).

A document of `seq_len` tokens: `num_kv_pairs` key–value pairs, then a query region in
which every key occurs once more, at an even offset drawn by a power law; the model must
predict that key's value *at the query key's own position* (zoology's labels are the
inputs shifted by one):

    k₀ v₀ k₁ v₁ … k₍ₙ₋₁₎ v₍ₙ₋₁₎ | r r k₂ r k₀ r … k₁ r …     (r: random filler)
                                      ^query: predict v₂ here

As in zoology: keys are distinct draws from 1..vocab_size/2-1 (token 0 is the filler
when `random_non_queries=False`), values distinct draws from the second half; the query
slots are `num_kv_pairs` distinct gaps g ∈ [0, S), S = (seq_len - 2n)/2, drawn without
replacement with p(g) ∝ a·(g+1)^(a-1) (`power_a` = a), key i at offset 2·g_i of the
query region; with `random_non_queries` every other query-region token is uniform over
the whole vocabulary (so fillers may repeat keys or values, zoology's distractors).
There is no BOS and no divider.

A document becomes one row per query, in query order; its rows share `doc_index` and
repeat the document's tokens. Row r's roles: `key` = 2i (k_i in context), `value` = 2i+1,
`query` = 2n + 2·g_i, the position whose next-token prediction is the answer v_i. The
corrupted twin of a row replaces k_i in context (or v_i, `corrupt="value"`) by a key
(value) that occurs nowhere in the document; the other queries of the row are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import UsageError
from .ar import CHUNK_ELEMENTS, distinct_draws, rng_for
from .base import Task
from .batch import Batch
from .draws import absent_tokens


def power_law_gaps(rng: np.random.Generator, n_docs: int, k: int, space: int, power_a: float) -> np.ndarray:
    """Return ``[n_docs, k]`` distinct gaps in [0, space), drawn without replacement with
    p(g) ∝ (g+1)^(a-1), in draw order (as zoology's ``np.random.choice(..., replace=False, p=p)``).

    Exponential races (Efraimidis–Spirakis): the k smallest of E_g / p(g), E_g ~ Exp(1),
    in increasing order, are a sequential weighted sample without replacement.
    """
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    p /= p.sum()
    out = np.empty((n_docs, k), dtype=np.int64)
    chunk = max(1, CHUNK_ELEMENTS // space)
    for start in range(0, n_docs, chunk):
        race = rng.standard_exponential((min(chunk, n_docs - start), space)) / p
        picked = np.argpartition(race, k - 1, axis=1)[:, :k] if k < space else np.argsort(race, axis=1)
        order = np.argsort(np.take_along_axis(race, picked, axis=1), axis=1)
        out[start : start + len(picked)] = np.take_along_axis(picked, order, axis=1)
    return out


class MultiQueryAR(Task):
    """MQAR with `num_kv_pairs` pairs and as many queries in `seq_len` tokens over `vocab_size` content tokens.

    Token ids: content 0..vocab_size-1, then pad. `sample(n)` returns n rows (queries):
    ⌈n / num_kv_pairs⌉ documents, the last one cut short when n is not a multiple.
    """

    name = "mqar"
    roles = ("key", "value", "query")

    def __init__(
        self,
        vocab_size: int = 8192,
        num_kv_pairs: int = 8,
        seq_len: int = 128,
        power_a: float = 0.01,
        random_non_queries: bool = True,
        corrupt: str = "key",
    ):
        # zoology's own asserts, plus room for one absent key / value (the corruption)
        if seq_len < 4 or seq_len % 2:
            raise UsageError(f"mqar: seq_len must be even and >= 4, got {seq_len}")
        if num_kv_pairs < 1 or 4 * num_kv_pairs > seq_len:
            raise UsageError(f"mqar: num_kv_pairs must be in 1..seq_len/4 = {seq_len // 4}, got {num_kv_pairs}")
        if vocab_size % 2 or vocab_size <= seq_len:
            raise UsageError(f"mqar: vocab_size must be even and > seq_len ({seq_len}), got {vocab_size}")
        if not power_a > 0:
            raise UsageError(f"mqar: power_a must be > 0 (1.0 is uniform), got {power_a}")
        if corrupt not in ("key", "value"):
            raise UsageError(f"mqar: corrupt must be 'key' or 'value', got {corrupt!r}")
        self.vocab_size, self.num_kv_pairs, self.seq_len = vocab_size, num_kv_pairs, seq_len
        self.power_a, self.random_non_queries, self.corrupt = float(power_a), bool(random_non_queries), corrupt
        self.pad_id = vocab_size

    @property
    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "num_kv_pairs": self.num_kv_pairs,
            "seq_len": self.seq_len,
            "power_a": self.power_a,
            "random_non_queries": self.random_non_queries,
            "corrupt": self.corrupt,
        }

    @property
    def d_vocab(self) -> int:
        return self.vocab_size + 1

    @property
    def n_ctx(self) -> int:
        return self.seq_len

    def sample(self, n: int, seed: int | Sequence[int]) -> Batch:
        """Return `n` MQAR rows (one per query); deterministic in (spec, n, seed)."""
        if n < 1:
            raise UsageError(f"mqar: number of examples must be >= 1, got {n}")
        rng = rng_for(seed)
        pairs, half, context = self.num_kv_pairs, self.vocab_size // 2, 2 * self.num_kv_pairs
        n_docs = -(-n // pairs)
        keys = distinct_draws(rng, n_docs, pairs, half - 1) + 1
        values = distinct_draws(rng, n_docs, pairs, self.vocab_size - half) + half
        gaps = power_law_gaps(rng, n_docs, pairs, (self.seq_len - context) // 2, self.power_a)

        docs = np.zeros((n_docs, self.seq_len), dtype=np.int64)
        if self.random_non_queries:
            docs[:, context:] = rng.integers(0, self.vocab_size, size=(n_docs, self.seq_len - context))
        docs[:, 0:context:2] = keys
        docs[:, 1:context:2] = values
        query_pos = context + 2 * gaps
        np.put_along_axis(docs, query_pos, keys, axis=1)

        # rows: (document, pair) in query order, cut to n
        by_time = np.argsort(query_pos, axis=1)
        doc_index = np.repeat(np.arange(n_docs), pairs)[:n]
        pair = by_time.reshape(-1)[:n]
        tokens = docs[doc_index]
        key_pos, value_pos = 2 * pair, 2 * pair + 1

        corrupt = tokens.copy()
        rows = np.arange(n)
        if self.corrupt == "key":
            corrupt[rows, key_pos] = absent_tokens(rng, docs, 1, half, tokens[rows, key_pos], which=doc_index)
        else:
            corrupt[rows, value_pos] = absent_tokens(
                rng, docs, half, self.vocab_size, tokens[rows, value_pos], which=doc_index
            )

        def as_tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))

        return Batch(
            tokens=as_tensor(tokens),
            corrupt_tokens=as_tensor(corrupt),
            answers=as_tensor(values[doc_index, pair]),
            lengths=torch.full((n,), self.seq_len, dtype=torch.int64),
            doc_index=as_tensor(doc_index),
            roles={
                "key": as_tensor(key_pos),
                "value": as_tensor(value_pos),
                "query": as_tensor(query_pos[doc_index, pair]),
            },
        )

    def chance(self) -> float:
        """Return 1 / num_kv_pairs: a uniform guess among the document's values (all distinct)."""
        return 1 / self.num_kv_pairs

    def describe_tokens(self, tokens: list[int]) -> str:
        half = self.vocab_size // 2
        return " ".join("PAD" if t == self.pad_id else f"k{t}" if t < half else f"v{t - half}" for t in tokens)
