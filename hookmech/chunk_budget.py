"""Row chunks sized from a memory budget: how many cache rows an analysis reads at once.

`probe`, `das` and `view` read an activation cache a chunk of rows at a time so that what they
hold does not grow with the cache's N (issue 31). The budget, ``--memory MIB``, bounds the bytes
of the per-row data they hold at once (activations read, their float copies, the forwards'
working tensors, as each caller estimates per row); the model, torch itself and per-row integers
(``[N]`` vectors of a few bytes a row) are outside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from .errors import UsageError

#: the default budget in MiB (``--memory``): 512 rows of a 1024-token, d_model-64 residual in
#: float32 take 128 MiB, so a chunk of the paper's ATR rows and its float copy fit
MEMORY_MIB = 256


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
