"""`RowsFile`: per-row outputs of a patch (``--per-example``) written to disk as row chunks are
done, then joined into one JSON file record by record, so that no more than one record's rows
are in memory at a time however many rows the cache holds."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..fileio import atomic_path, naming, writes_in_place
from .chunked import PER_ROW, record_key


class RowsFile:
    """A `chunked.RowsSink` that appends each record's per-row values (float64) to a file of its
    own in a temporary folder beside `path`, in the order the rows come (chunks and shards are
    added in row order); `write` then writes the records with their lists to `path`. Use it as a
    context manager: the temporary folder is removed at the end."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        # a FIFO or a device is written in place (`atomic_path`): the rows wait in the system's
        # temporary folder then, not beside it
        beside = None if writes_in_place(self.path) else self.path.parent
        with naming(self.path):
            if beside is not None:
                beside.mkdir(parents=True, exist_ok=True)
            self.folder = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.rows.", dir=beside))
        self.files: dict[tuple[tuple, str], Path] = {}

    def add(self, key: tuple, field: str, rows: slice, values: list[float]) -> None:
        """Append `values` (the rows `rows` of field `field` of the record named `key`); return None."""
        name = self.files.setdefault((key, field), self.folder / f"{len(self.files)}.f64")
        with open(name, "ab") as handle:
            np.asarray(values, dtype=np.float64).tofile(handle)

    def write(self, records: list[dict[str, Any]], dumps: Callable[[Any], str]) -> None:
        """Write `records` to `path` as one JSON array (``dumps`` of each record, as
        ``dumps(records)`` would join them), each per-row field that holds None (handed to this
        sink) filled from its file; atomically. Return None."""
        with atomic_path(self.path) as tmp, open(tmp, "w") as out:
            out.write("[")
            for index, record in enumerate(records):
                filled = dict(record)
                for field in PER_ROW:
                    stored = self.files.get((record_key(record), field))
                    if field in filled and filled[field] is None and stored is not None:
                        filled[field] = np.fromfile(stored, dtype=np.float64).tolist()
                out.write((", " if index else "") + dumps(filled))
            out.write("]\n")

    def close(self) -> None:
        """Remove the temporary folder."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> RowsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
