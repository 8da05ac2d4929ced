"""Row chunks: how many rows of a cache a command holds at once, from a memory budget.

Everything that reads a cache (patching, inspect, and the commands that train on one) reads it
in consecutive row slices whose size follows from what one row costs in memory and the budget
the user gave (``--memory MIB``, default `DEFAULT_MEMORY_MIB`). What it holds then stays flat in
the number of rows: a 32,000-row cache is read as ten 3,200-row ones. `shard_rows` splits rows
into equal parts for workers (each of which plans its own chunks inside its part).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from .errors import UsageError

#: the default ``--memory``: MiB of row data (activations read from the cache and what is made
#: from them per row) a command holds at once
DEFAULT_MEMORY_MIB = 256
#: the same default, by the name `probe`, `das` and `view` use: 512 rows of a 1024-token,
#: d_model-64 residual in float32 take 128 MiB, so a chunk of the paper's ATR rows and its float
#: copy fit
MEMORY_MIB = DEFAULT_MEMORY_MIB
MIB = 1 << 20


def memory_bytes(mib: int | float, option: str = "--memory") -> int:
    """Return `mib` MiB in bytes; a UsageError naming `option` unless it is a number > 0."""
    if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not math.isfinite(mib) or mib <= 0:
        raise UsageError(f"{option} must be a number of MiB > 0, got {mib!r}")
    return int(mib * MIB)


def rows_per_chunk(bytes_per_row: int, memory: int) -> int:
    """Return how many rows fit in `memory` bytes at `bytes_per_row` each (at least 1: one row
    is the least a command can read)."""
    if bytes_per_row <= 0:
        raise ValueError(f"bytes_per_row must be > 0, got {bytes_per_row}")
    return max(1, memory // bytes_per_row)


def plan_row_chunks(n_rows: int, bytes_per_row: int, memory: int, rows: slice | None = None) -> list[slice]:
    """Return consecutive slices covering rows ``0..n_rows`` (or the slice `rows` of them), each
    of at most `rows_per_chunk(bytes_per_row, memory)` rows, as even as that allows (a 3,300-row
    cache at 3,200 rows per chunk reads two chunks of 1,650, not 3,200 and 100)."""
    start, stop, _ = (rows or slice(None)).indices(n_rows)
    total = max(0, stop - start)
    if total == 0:
        return []
    parts = math.ceil(total / rows_per_chunk(bytes_per_row, memory))
    return [slice(start + part.start, start + part.stop) for part in shard_rows(total, parts)]


def shard_rows(n_rows: int, parts: int) -> list[slice]:
    """Return `parts` (at most `n_rows`) consecutive slices of ``0..n_rows`` whose sizes differ
    by at most one row."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    parts = min(parts, max(n_rows, 1))
    size, extra = divmod(n_rows, parts)
    slices, start = [], 0
    for part in range(parts):
        stop = start + size + (1 if part < extra else 0)
        slices.append(slice(start, stop))
        start = stop
    return slices


def bytes_per_row(shapes: Iterable[tuple[int, ...]], itemsize: int = 4) -> int:
    """Return the bytes of one row of arrays of per-row `shapes` (each without the row axis) at
    `itemsize` bytes per value (float32 by default: what a cache's values become once read)."""
    return sum(math.prod(shape) * itemsize for shape in shapes)


# -- budgets in MiB (probe, das, view): rows per chunk, at most a cap ----------------------------
def check_memory(memory_mib: float) -> float:
    """Return `memory_mib` if it is a finite number > 0, else raise a UsageError."""
    if isinstance(memory_mib, bool) or not isinstance(memory_mib, (int, float)):
        raise UsageError(f"--memory takes a number of MiB, got {memory_mib!r}")
    if not (math.isfinite(memory_mib) and memory_mib > 0):
        raise UsageError(f"--memory must be a number of MiB > 0, got {memory_mib}")
    return memory_mib


def chunk_rows(bytes_per_row: int, memory_mib: float, *, at_most: int | None = None) -> int:
    """Return the rows per chunk: as many rows of `bytes_per_row` bytes as fit in `memory_mib`
    MiB, at least 1 (one row over the budget is still read: nothing smaller exists), at most
    `at_most` when given."""
    rows = int(check_memory(memory_mib) * 2**20 // max(int(bytes_per_row), 1))
    if at_most is not None:
        rows = min(rows, at_most)
    return max(rows, 1)


def row_chunks(n_rows: int, rows_per_chunk: int) -> Iterator[slice]:
    """Yield slices of at most `rows_per_chunk` (>= 1) rows covering ``range(n_rows)`` in order."""
    if rows_per_chunk < 1:
        raise UsageError(f"rows per chunk must be >= 1, got {rows_per_chunk}")
    for start in range(0, n_rows, rows_per_chunk):
        yield slice(start, min(n_rows, start + rows_per_chunk))
