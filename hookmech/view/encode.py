"""Arrays as the page carries them: little-endian bytes in base64, decoded by the page's script
into typed arrays (a JSON list of 842,724 floats is 3-4x larger and slower to parse).

A packed array is ``{"dtype": "f4" | "f8" | "u1" | "u2" | "i4", "b64": "..."}``. Floats are
packed as float32 when that loses nothing (every p(answer) the engine returns is a float32
widened to float64) and as float64 otherwise, so a packed number is the number computed.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

#: the typed array each dtype becomes in the page's script
DTYPES = {"f4": "<f4", "f8": "<f8", "u1": "|u1", "u2": "<u2", "i4": "<i4"}


def pack_floats(values: Sequence[float] | np.ndarray, *, lossy_float32: bool = False) -> dict[str, str]:
    """Return `values` (any shape, flattened in C order) packed as float32 when every value
    survives the round trip (or `lossy_float32`: maps, whose last bits no one reads), else float64."""
    array = np.ascontiguousarray(values, dtype=np.float64).ravel()
    single = array.astype(np.float32)
    exact = lossy_float32 or bool(np.array_equal(single.astype(np.float64), array, equal_nan=True))
    return _pack(single if exact else array, "f4" if exact else "f8")


def pack_ints(values: Sequence[int] | np.ndarray) -> dict[str, str]:
    """Return integer `values` (any shape, flattened in C order) packed in the narrowest of
    uint8, uint16, int32 that holds them all."""
    array = np.ascontiguousarray(values, dtype=np.int64).ravel()
    low, high = (int(array.min()), int(array.max())) if array.size else (0, 0)
    if low >= 0 and high < 1 << 8:
        return _pack(array.astype(np.uint8), "u1")
    if low >= 0 and high < 1 << 16:
        return _pack(array.astype(np.uint16), "u2")
    if -(1 << 31) <= low and high < 1 << 31:
        return _pack(array.astype(np.int32), "i4")
    raise ValueError(f"pack_ints: values {low}..{high} do not fit in int32")


def _pack(array: np.ndarray, dtype: str) -> dict[str, str]:
    data = array.astype(DTYPES[dtype], copy=False).tobytes()
    return {"dtype": dtype, "b64": base64.b64encode(data).decode("ascii")}


def unpack(packed: dict[str, str]) -> np.ndarray:
    """Return the flat numpy array of a packed array (`pack_floats`, `pack_ints`): the inverse
    the page's script computes, for tests and readers of a page's data."""
    return np.frombuffer(base64.b64decode(packed["b64"]), dtype=DTYPES[packed["dtype"]])


def clean_json(value: Any) -> Any:
    """Return `value` with non-finite floats replaced by None (JSON has no NaN), numpy scalars
    as Python numbers, tuples as lists."""
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: clean_json(inner) for key, inner in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(inner) for inner in value]
    return value
