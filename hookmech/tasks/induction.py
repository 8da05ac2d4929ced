"""Induction on repeated random tokens: TransformerLens's standard induction test, with roles.

    [BOS] t₀ t₁ … t₍ₛ₋₁₎ t₀ t₁ … tᵢ   ->  tᵢ₊₁

A document is `seq_len` random tokens of the tokenizer (the first half), repeated; a row
ends at the second occurrence of the queried token tᵢ, where an induction head predicts its
successor tᵢ₊₁ by finding tᵢ earlier and copying what followed it. Roles: `key` = the first
occurrence of tᵢ, `value` = its successor tᵢ₊₁ in the first half, `query` = the second
occurrence of tᵢ. The corrupted twin replaces tᵢ at `key` (or tᵢ₊₁ at `value`,
``corrupt="value"``) by a token that occurs nowhere in the document.

TransformerLens draws the tokens with replacement (``torch.randint``); here a document's
tokens are distinct, so that each token's first occurrence, and so the roles, are unique.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import UsageError
from .ar import distinct_draws, rng_for
from .batch import Batch
from .tokenized import TokenizerTask


class Induction(TokenizerTask):
    """Repeated random tokens of a tokenizer, drawn from the ids ``token_range = [low, high)``
    (default: all) that are not special tokens; rows end at the query, right-padded to the
    batch's longest row."""

    name = "induction"
    roles = ("key", "value", "query")

    def __init__(
        self,
        tokenizer: str | None = None,
        tokenizer_sha256: str | None = None,
        seq_len: int = 50,
        token_range: list[int] | None = None,
        corrupt: str = "key",
        bos: bool | str = False,
    ):
        super().__init__(tokenizer, tokenizer_sha256, bos)
        if seq_len < 2:
            raise UsageError(f"induction: seq_len must be >= 2 (a token and its successor), got {seq_len}")
        if corrupt not in ("key", "value"):
            raise UsageError(f"induction: corrupt must be 'key' or 'value', got {corrupt!r}")
        vocab = self.text_tokenizer.vocab_size
        low, high = (0, vocab) if token_range is None else self._check_range(token_range, vocab)
        special = np.array(sorted(self.text_tokenizer.special_ids), dtype=np.int64)
        self.pool = np.setdiff1d(np.arange(low, high, dtype=np.int64), special)
        if len(self.pool) < seq_len + 1:
            raise UsageError(
                f"induction: token_range [{low}, {high}) holds {len(self.pool)} non-special tokens; seq_len "
                f"{seq_len} needs {seq_len + 1} (distinct tokens plus one absent token for the corruption)"
            )
        self.seq_len, self.token_range, self.corrupt = seq_len, [low, high], corrupt

    @staticmethod
    def _check_range(token_range: list[int], vocab: int) -> tuple[int, int]:
        """Return (low, high) of a ``[low, high)`` option inside ``0 .. vocab``; a UsageError otherwise."""
        if len(token_range) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in token_range):
            raise UsageError(f"induction: token_range must be [low, high], two integers; got {token_range}")
        low, high = token_range
        if not 0 <= low < high <= vocab:
            raise UsageError(f"induction: token_range [{low}, {high}) must lie in [0, {vocab}) (the tokenizer's ids)")
        return low, high

    @property
    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            **self.tokenizer_spec(),
            "seq_len": self.seq_len,
            "token_range": list(self.token_range),
            "corrupt": self.corrupt,
        }

    @property
    def n_ctx(self) -> int:
        # the last possible query: the second occurrence of t_(S-2), the last token with a successor
        return len(self.prefix) + 2 * self.seq_len - 1

    def sample(self, n: int, seed: int | Sequence[int]) -> Batch:
        """Return `n` rows of repeated random tokens; deterministic in (spec, n, seed)."""
        if n < 1:
            raise UsageError(f"induction: number of examples must be >= 1, got {n}")
        rng = rng_for(seed)
        length = self.seq_len
        # one token more than the document needs: the spare is absent, the corruption
        drawn = self.pool[distinct_draws(rng, n, length + 1, len(self.pool))]
        first_half, spare = drawn[:, :length], drawn[:, length]
        queried = rng.integers(0, length - 1, size=n)
        rows, start = np.arange(n), len(self.prefix)
        key_pos, query_pos = start + queried, start + length + queried

        tokens = np.full((n, self.n_ctx), self.pad_id, dtype=np.int64)
        tokens[:, :start] = self.prefix
        tokens[:, start : start + length] = first_half
        # the repeat, cut after the query: position start + length + j holds t_j for j <= i
        repeat = np.arange(length - 1)
        inside = repeat[None, :] <= queried[:, None]
        tokens[:, start + length : start + 2 * length - 1] = np.where(inside, first_half[:, :-1], self.pad_id)
        corrupt = tokens.copy()
        corrupt[rows, key_pos if self.corrupt == "key" else key_pos + 1] = spare

        def as_tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))

        return Batch(
            tokens=as_tensor(tokens),
            corrupt_tokens=as_tensor(corrupt),
            answers=as_tensor(first_half[rows, queried + 1]),
            lengths=as_tensor(query_pos + 1),
            doc_index=torch.arange(n, dtype=torch.int64),
            roles={"key": as_tensor(key_pos), "value": as_tensor(key_pos + 1), "query": as_tensor(query_pos)},
        ).trimmed()
