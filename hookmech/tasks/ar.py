"""Associative recall (paper 000 §2–3): BOS, key–value pairs, divider, query key -> value.

    BOS k₀ v₀ k₁ v₁ … k₍ₙ₋₁₎ v₍ₙ₋₁₎ DIV k_q   ->  v_q

Keys come from the first half of the content vocabulary and values from the second,
both drawn without replacement per document. The corrupted twin replaces the in-context
key k_q (at role `key`) by a key that does not occur in the document, which removes the
information the answer needs (paper 000 §4).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import UsageError
from .base import Task
from .batch import Batch
from .draws import check_split, held_out, split_allows

#: rows drawn per chunk when sampling without replacement (bounds memory for big vocabularies)
CHUNK_ELEMENTS = 1 << 22


def rng_for(seed: int | Sequence[int]) -> np.random.Generator:
    """Return a numpy Generator for an int seed or a tuple of ints (e.g. (seed, step))."""
    entropy = [seed] if isinstance(seed, int) else list(seed)
    if any(s < 0 for s in entropy):
        raise UsageError(f"seeds must be >= 0, got {seed}")
    return np.random.default_rng(np.random.SeedSequence(entropy))


def distinct_draws(rng: np.random.Generator, n_rows: int, k: int, population: int) -> np.ndarray:
    """Return ``[n_rows, k]`` ints in [0, population), distinct within each row and a
    uniform random ordered sample without replacement."""
    if population >= 8 * k * k:
        return _distinct_by_rejection(rng, n_rows, k, population)
    return _distinct_by_ranking(rng, n_rows, k, population)


def _distinct_by_rejection(rng: np.random.Generator, n_rows: int, k: int, population: int) -> np.ndarray:
    # Sparse case (k² ≪ population): i.i.d. draws, redrawing rows that hold a repeat;
    # accepted rows are uniform over ordered distinct samples. Few rows repeat (< 1/16).
    out = rng.integers(0, population, size=(n_rows, k))
    redo = np.arange(n_rows)
    while len(redo):
        rows = np.sort(out[redo], axis=1)
        redo = redo[(rows[:, 1:] == rows[:, :-1]).any(axis=1)]
        out[redo] = rng.integers(0, population, size=(len(redo), k))
    return out


def _distinct_by_ranking(rng: np.random.Generator, n_rows: int, k: int, population: int) -> np.ndarray:
    # Dense case: the k smallest of i.i.d. uniform scores, in the order of their scores.
    out = np.empty((n_rows, k), dtype=np.int64)
    chunk = max(1, CHUNK_ELEMENTS // population)
    for start in range(0, n_rows, chunk):
        scores = rng.random((min(chunk, n_rows - start), population))
        picked = np.argpartition(scores, k - 1, axis=1)[:, :k] if k < population else np.argsort(scores, axis=1)
        order = np.argsort(np.take_along_axis(scores, picked, axis=1), axis=1)
        out[start : start + len(picked)] = np.take_along_axis(picked, order, axis=1)
    return out


class AssociativeRecall(Task):
    """AR with `num_kv_pairs` pairs over `vocab_size` content tokens (keys: first half).

    Token ids: content 0..vocab_size-1, then pad, BOS, divider.
    Roles: `key` (k_q in context), `value` (v_q), `divider`, `query` (the final k_q).

    Options beyond the paper's default (tinylang `language/ar.py`):
    `query_by="value"` asks a value and answers its key (the document keeps its
    k v k v … order, so role `key` — the queried token in context — now follows its
    partner at role `value`); `split="train"|"dev"|"test"` restricts which pairs may be
    queried: a fixed 20% of all (key, value) type pairs, chosen by `split_seed`, are
    queried only in test (documents still hold them anywhere as distractors).
    """

    name = "ar"
    roles = ("key", "value", "query", "divider")

    def __init__(
        self,
        vocab_size: int = 8192,
        num_kv_pairs: int = 16,
        corrupt: str = "key",
        query_by: str = "key",
        split: str | None = None,
        split_seed: int = 0,
    ):
        if vocab_size < 4 or vocab_size % 2:
            raise UsageError(f"ar: vocab_size must be even and >= 4, got {vocab_size}")
        if num_kv_pairs < 1:
            raise UsageError(f"ar: num_kv_pairs must be >= 1, got {num_kv_pairs}")
        if num_kv_pairs + 1 > vocab_size // 2:
            raise UsageError(
                f"ar: num_kv_pairs {num_kv_pairs} needs vocab_size >= {2 * (num_kv_pairs + 1)} "
                "(distinct keys plus one absent key for the corruption)"
            )
        if corrupt not in ("key", "value"):
            raise UsageError(f"ar: corrupt must be 'key' or 'value', got {corrupt!r}")
        if query_by not in ("key", "value"):
            raise UsageError(f"ar: query_by must be 'key' or 'value', got {query_by!r}")
        check_split("ar", split)
        if split_seed < 0:
            raise UsageError(f"ar: split_seed must be >= 0, got {split_seed}")
        self.vocab_size, self.num_kv_pairs, self.corrupt = vocab_size, num_kv_pairs, corrupt
        self.query_by, self.split, self.split_seed = query_by, split, split_seed
        self.pad_id, self.bos_id, self.divider_id = vocab_size, vocab_size + 1, vocab_size + 2

    @property
    def spec(self) -> dict[str, Any]:
        spec = {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "num_kv_pairs": self.num_kv_pairs,
            "corrupt": self.corrupt,
        }
        # options at their defaults stay out, so specs (and run folders) made before they existed still match
        if self.query_by != "key":
            spec["query_by"] = self.query_by
        if self.split is not None:
            spec.update(split=self.split, split_seed=self.split_seed)
        return spec

    @property
    def d_vocab(self) -> int:
        return self.vocab_size + 3

    @property
    def n_ctx(self) -> int:
        return 2 * self.num_kv_pairs + 3

    def sample(self, n: int, seed: int | Sequence[int]) -> Batch:
        """Return `n` AR rows; deterministic in (spec, n, seed)."""
        if n < 1:
            raise UsageError(f"ar: number of examples must be >= 1, got {n}")
        rng = rng_for(seed)
        pairs, half = self.num_kv_pairs, self.vocab_size // 2
        # one key more than the document needs: the spare is absent, the key corruption
        keys = distinct_draws(rng, n, pairs + 1, half)
        # likewise a spare value, for corrupt="value"
        values = distinct_draws(rng, n, pairs + 1, half) + half
        if self.split is None:
            queried = rng.integers(0, pairs, size=n)
        else:
            queried = self._draw_split_queries(rng, keys, values)
        rows = np.arange(n)

        tokens = np.empty((n, self.n_ctx), dtype=np.int64)
        tokens[:, 0] = self.bos_id
        tokens[:, 1 : 2 * pairs + 1 : 2] = keys[:, :pairs]
        tokens[:, 2 : 2 * pairs + 2 : 2] = values[:, :pairs]
        tokens[:, 2 * pairs + 1] = self.divider_id
        if self.query_by == "key":
            tokens[:, 2 * pairs + 2] = keys[rows, queried]
            answers = values[rows, queried]
            key_pos = 1 + 2 * queried
            value_pos = key_pos + 1
        else:
            tokens[:, 2 * pairs + 2] = values[rows, queried]
            answers = keys[rows, queried]
            value_pos = 1 + 2 * queried
            key_pos = value_pos + 1

        # the corrupted position gets the spare token of its own class (absent from the document)
        corrupt = tokens.copy()
        corrupt_pos = key_pos if self.corrupt == "key" else value_pos
        holds_key = corrupt_pos % 2 == 1
        corrupt[rows, corrupt_pos] = np.where(holds_key, keys[:, pairs], values[:, pairs])

        def as_tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))

        return Batch(
            tokens=as_tensor(tokens),
            corrupt_tokens=as_tensor(corrupt),
            answers=as_tensor(answers),
            lengths=torch.full((n,), self.n_ctx, dtype=torch.int64),
            doc_index=torch.arange(n, dtype=torch.int64),
            roles={
                "key": as_tensor(key_pos),
                "value": as_tensor(value_pos),
                "query": torch.full((n,), self.n_ctx - 1, dtype=torch.int64),
                "divider": torch.full((n,), self.n_ctx - 2, dtype=torch.int64),
            },
        )

    def _draw_split_queries(self, rng: np.random.Generator, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Return ``[n]`` queried pair indices allowed by the split, redrawing (in place) the
        documents that hold no allowed pair."""
        pairs, half = self.num_kv_pairs, self.vocab_size // 2
        if half * half <= 1 << 20:
            every = np.arange(half * half)
            if not split_allows(held_out(every // half, every % half, self.split_seed), self.split).any():
                raise UsageError(f"ar: vocab_size {self.vocab_size} leaves no pair for split {self.split!r}")
        redo = np.arange(len(keys))
        while True:
            allowed = split_allows(held_out(keys[:, :pairs], values[:, :pairs] - half, self.split_seed), self.split)
            redo = redo[~allowed[redo].any(axis=1)]
            if not len(redo):
                break
            keys[redo] = distinct_draws(rng, len(redo), pairs + 1, half)
            values[redo] = distinct_draws(rng, len(redo), pairs + 1, half) + half
        scores = np.where(allowed, rng.random(allowed.shape), -1.0)
        return scores.argmax(axis=1)

    def chance(self) -> float:
        """Return 1 / num_kv_pairs: a uniform guess among the document's values (all distinct)."""
        return 1 / self.num_kv_pairs

    def describe_tokens(self, tokens: list[int]) -> str:
        names = {self.pad_id: "PAD", self.bos_id: "BOS", self.divider_id: "DIV"}
        half = self.vocab_size // 2
        return " ".join(names.get(t, f"k{t}" if t < half else f"v{t - half}") for t in tokens)
