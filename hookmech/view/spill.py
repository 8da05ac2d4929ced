"""Per-row arrays of a page that grow with its rows, kept on disk until the page is written.

A `Spill` receives numbers a chunk of rows at a time (`append`), keeps them in a temporary file
and writes them into the page a chunk at a time (`write_json`), as `hookmech.view.encode` would
pack the whole array: the same dtype choice (float32 where every value survives it, else
float64; the narrowest integer type) and the same bytes, so the page's memory does not grow
with its rows. `packed()` returns the value itself (for the in-memory page data).
"""

from __future__ import annotations

import base64
import json
import tempfile
from collections.abc import Iterator
from typing import IO, Any

import numpy as np

from .encode import DTYPES, pack_floats, pack_ints

#: the kinds of spill: packed floats (`pack_floats`), packed integers (`pack_ints`), a JSON list of integers
KINDS = ("floats", "ints", "list")
#: values read back per piece when writing (a multiple of 3, so that each piece's base64 has no padding)
PIECE = 3 * 2**16


class Spill:
    """Numbers of one page array (`kind` in `KINDS`), appended in row order."""

    def __init__(self, kind: str):
        if kind not in KINDS:
            raise ValueError(f"spill kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.stored = np.dtype("<f8") if kind == "floats" else np.dtype("<i8")
        self.file: IO[bytes] = tempfile.TemporaryFile(prefix="hookmech-page-")  # noqa: SIM115 - closed by close()
        self.size = 0
        self.single_exact = True  # floats: every value so far survives float32
        self.low: int | None = None  # ints: the range so far
        self.high: int | None = None

    def append(self, values: Any) -> None:
        """Add `values` (any shape, flattened in C order) after those appended before; return None."""
        array = np.ascontiguousarray(values, dtype=self.stored).ravel()
        if not array.size:
            return
        if self.kind == "floats":
            single = array.astype(np.float32).astype(np.float64)
            self.single_exact &= bool(np.array_equal(single, array, equal_nan=True))
        else:
            low, high = int(array.min()), int(array.max())
            self.low = low if self.low is None else min(self.low, low)
            self.high = high if self.high is None else max(self.high, high)
        self.file.write(array.tobytes())
        self.size += array.size

    def _pieces(self) -> Iterator[np.ndarray]:
        """Yield the values appended, `PIECE` at a time, as stored."""
        self.file.seek(0)
        left = self.size
        while left:
            count = min(PIECE, left)
            yield np.frombuffer(self.file.read(count * self.stored.itemsize), dtype=self.stored)
            left -= count

    def _dtype(self) -> str:
        """The packed array's dtype, as `pack_floats` / `pack_ints` choose it for the whole array."""
        if self.kind == "floats":
            return "f4" if self.single_exact else "f8"
        return pack_ints(np.array([self.low or 0, self.high or 0]))["dtype"]

    def write_json(self, out: IO[str]) -> None:
        """Write the JSON text of the whole array to `out` (what `json.dumps` gives of `packed()`
        with the page's separators), a piece at a time; return None."""
        if self.kind == "list":
            out.write("[")
            for index, piece in enumerate(self._pieces()):
                out.write(("," if index else "") + ",".join(map(str, piece.tolist())))
            out.write("]")
            return
        dtype = self._dtype()
        opening = json.dumps({"dtype": dtype, "b64": ""}, separators=(",", ":"))[:-2]  # up to the string's quote
        out.write(opening)
        for piece in self._pieces():
            out.write(base64.b64encode(piece.astype(DTYPES[dtype]).tobytes()).decode("ascii"))
        out.write('"}')

    def packed(self) -> Any:
        """Return the whole array as the page data holds it: ``pack_floats(values)``,
        ``pack_ints(values)`` or the list of integers."""
        values = np.concatenate([*self._pieces(), np.zeros(0, self.stored)])
        if self.kind == "floats":
            return pack_floats(values)
        if self.kind == "ints":
            return pack_ints(values)
        return values.tolist()

    def close(self) -> None:
        """Delete the temporary file; return None."""
        self.file.close()


def spills_in(data: Any) -> list[Spill]:
    """Return the `Spill`s inside `data` (dicts and lists), in the order JSON writes them."""
    if isinstance(data, Spill):
        return [data]
    if isinstance(data, dict):
        return [spill for value in data.values() for spill in spills_in(value)]
    if isinstance(data, (list, tuple)):
        return [spill for value in data for spill in spills_in(value)]
    return []


def materialize(data: Any) -> Any:
    """Return `data` with every `Spill` replaced by its `packed()` value and closed."""
    if isinstance(data, Spill):
        value = data.packed()
        data.close()
        return value
    if isinstance(data, dict):
        return {key: materialize(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [materialize(value) for value in data]
    return data
