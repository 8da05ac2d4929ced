"""`CacheRows`: a window of consecutive rows of an open activation cache, read as a cache.

Code that takes a `CacheFile` (the patching engine, `probe_data`) reads a window exactly as it
reads a whole file, so an analysis can run it a chunk of rows at a time
(`hookmech.chunk_budget`): ``batch()``, ``p_answer``, ``read``, ``read_rows``, ``gather`` and
``at`` return the window's rows only, numbered from 0; error messages name the file's row. The
window shares the open file and what `check_model` has established with the cache it views (the
identity and the seeded rows are checked once, on the whole file), and closing it leaves the file
open.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .cache import CacheFile
from .errors import UsageError
from .shapes import ActsAt
from .tasks.batch import Batch


class CacheRows(CacheFile):
    """Rows ``rows`` (a slice of step 1) of the open `cache`, read as a cache of that many rows."""

    def __init__(self, cache: CacheFile, rows: slice):  # noqa: D107 - the class says it
        start, stop, step = rows.indices(cache.n)
        if step != 1 or stop <= start:
            raise UsageError(f"a cache window is a non-empty slice of consecutive rows, got {rows}")
        # the same open file, metadata and checked set: nothing is reopened or checked again
        self.__dict__.update(cache.__dict__)
        self._whole = cache
        self._start, self._stop = start, stop
        self._shape = (stop - start, cache.n_pos)

    @property
    def first_row(self) -> int:
        """The file's row number of the window's row 0."""
        return self._start

    def _in_file(self, rows: slice) -> slice:
        """Return the file's slice of the window's slice `rows`."""
        start, stop, step = rows.indices(self.n)
        if step != 1:
            raise UsageError(f"read consecutive rows of a cache window, got {rows}")
        return slice(self._start + start, self._start + max(start, stop))

    def _row_numbers(self, rows: slice) -> np.ndarray:
        # every slice reaching the file's datasets here is already the file's (`_in_file`)
        return np.arange(rows.start, rows.stop)

    def _rows(self, rows: slice) -> Batch:
        return super()._rows(self._in_file(rows))

    def _p_answer_rows(self, which: str, rows: slice) -> np.ndarray:
        return super()._p_answer_rows(which, self._in_file(rows))

    def read_rows(self, hook: str, which: str, rows: slice) -> np.ndarray:
        """As `CacheFile.read_rows`, `rows` numbered in the window."""
        return super().read_rows(hook, which, self._in_file(rows))

    def at(self, site: str, role: str, which: str = "clean") -> ActsAt:
        """As `CacheFile.at`: ``[n, ...]``, each of the window's rows at its `role` position."""
        batch = self.batch()  # checks the window's roles against its lengths
        return self.gather(site, batch.role(role).numpy(), which)

    def gather(self, site: str, positions: np.ndarray | Tensor | Sequence[int], which: str = "clean") -> ActsAt:
        """As `CacheFile.gather`: ``[n, ...]``, the window's row i at ``positions[i]`` (``[n]`` ints
        in 0..T-1; another shape or a position outside is a UsageError)."""
        data = self[site, which]  # the file's dataset: its rows are the file's
        hook = data.name.rsplit("/", 1)[-1]
        self._refuse_other_position_axis(hook)
        positions = np.asarray(positions)
        if positions.shape != (self.n,):
            raise UsageError(f"need one position per row ({self.n}), got shape {positions.shape}")
        if positions.size and (positions.min() < 0 or positions.max() >= data.shape[1]):
            raise UsageError(f"positions must be in 0..{data.shape[1] - 1}, got {positions.min()}..{positions.max()}")
        out = np.empty((len(positions), *data.shape[2:]), dtype=data.dtype)
        for position in np.unique(positions):  # h5py reads one list of increasing rows per call
            rows = np.nonzero(positions == position)[0]
            out[rows] = data[(rows + self._start).tolist(), int(position)]
        self._refuse_non_finite(
            hook, which, out, lambda index: [self._start + index[0], int(positions[index[0]]), *index[1:]]
        )
        return torch.from_numpy(out)

    def check_model(self, model, *, checkpoint: str | Path | None = None, hooks: Iterable[str] | None = None) -> None:
        """As `CacheFile.check_model` on the whole file (the same seeded rows, checked once)."""
        self._whole.check_model(model, checkpoint=checkpoint, hooks=hooks)

    def verify_rows(self) -> slice:
        """The whole file's `verify_rows` (file row numbers)."""
        return self._whole.verify_rows()

    def close(self) -> None:
        """Leave the file open: the cache the window views owns it."""
