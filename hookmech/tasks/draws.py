"""Seeded draws the recall tasks share: tokens absent from a row, and held-out type pairs.

Both are vectorised over rows (numpy) and deterministic given the caller's Generator
(`absent_tokens`) or `split_seed` (`held_out`).
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError

#: fraction of (key, value) / (answer, query) type pairs held out for the test split (paper 000 §5.3)
HELD_OUT_FRACTION = 0.2

SPLITS = ("train", "dev", "test")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: a bijective, well-scrambled hash of uint64 (wraps on purpose)
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def held_out(first: np.ndarray, second: np.ndarray, split_seed: int, fraction: float = HELD_OUT_FRACTION) -> np.ndarray:
    """Return a bool array: is the type pair (first, second) held out for the test split?

    A fixed pseudo-random ``fraction`` of all pairs, chosen by `split_seed` alone (a hash,
    so no |V|² table is built): the same pair gets the same answer in every batch, task
    and process.
    """
    a = np.asarray(first, dtype=np.int64).astype(np.uint64)
    b = np.asarray(second, dtype=np.int64).astype(np.uint64)
    seed = _mix64(np.array([split_seed], dtype=np.uint64))[0]
    pair = _mix64((a << np.uint64(32)) ^ b ^ seed)
    return pair < np.uint64(int(fraction * 2.0**64))


def check_split(task: str, split: str | None) -> None:
    """Raise a UsageError unless `split` is None or one of SPLITS."""
    if split is not None and split not in SPLITS:
        raise UsageError(f"{task}: split must be one of {', '.join(SPLITS)} (or omitted), got {split!r}")


def split_allows(held: np.ndarray, split: str | None) -> np.ndarray:
    """Which pairs a split may query: train/dev the kept pairs, test the held-out ones."""
    if split is None:
        return np.ones_like(held, dtype=bool)
    return held if split == "test" else ~held


def absent_tokens(
    rng: np.random.Generator, rows: np.ndarray, low: int, high: int, avoid: np.ndarray, which: np.ndarray | None = None
) -> np.ndarray:
    """Return ``[N]`` tokens in [low, high): the i-th absent from row ``which[i]`` of `rows`
    ``[M, T]`` (default: row i; entries outside [low, high), e.g. padding, are ignored);
    where that row holds every token of the range, a uniform token of the range other
    than ``avoid[i]`` (the token being replaced).
    """
    span = high - low
    which = np.arange(len(rows)) if which is None else np.asarray(which)
    # per row, its in-range tokens sorted and offset by row * span: one sorted array
    inside = np.sort(np.where((rows >= low) & (rows < high), rows - low, span), axis=1)
    distinct = (inside < span) & np.concatenate(
        [np.ones((len(rows), 1), bool), inside[:, 1:] != inside[:, :-1]], axis=1
    )
    n_present = distinct.sum(axis=1)[which]
    present = (inside + np.arange(len(rows))[:, None] * (span + 1)).reshape(-1)

    out = np.empty(len(which), dtype=np.int64)
    full = np.flatnonzero(n_present >= span)
    if len(full):  # every token occurs: any token but the one replaced
        other = rng.integers(0, span - 1, size=len(full)) + low
        out[full] = other + (other >= avoid[full])
    todo = np.flatnonzero(n_present < span)
    while len(todo):  # rejection: expected rounds <= span / (number absent)
        out[todo] = rng.integers(low, high, size=len(todo))
        wanted = which[todo].astype(np.int64) * (span + 1) + (out[todo] - low)
        at = np.minimum(np.searchsorted(present, wanted), len(present) - 1)
        todo = todo[present[at] == wanted]
    return out
