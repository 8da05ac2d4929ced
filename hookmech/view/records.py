"""What the page of a ``hookmech patch --json`` file shows: its records as a site × position
heatmap (path-patching records: sender × receiver) and as a table, with the numbers of every
record. The file is read as JSON only, checked field by field; a file that is not a list of
patch records is one HookmechError naming what is wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import HookmechError

#: the fields every record of ``patch --json`` carries (docs/formats.md)
REQUIRED = ("site", "pos", "attribution", "p_clean", "p_corrupt", "p_patched", "n", "passes_filter")
#: the fields a path-patching record adds
PATH_FIELDS = ("sender", "receiver", "via")
#: the fields the table shows after the record's place, when any record has them
SHOWN = ("hook", "method", "metric", "direction", "via")


def records_page_data(path: str | Path) -> dict[str, Any]:
    """Return the page data of the ``patch --json`` file `path`: ``{"kind": "records", "title",
    "about": {"source", "records", "paths"}, "records": [...], "columns": [...]}``. Records keep
    their fields; path-patching records are drawn sender × receiver (``site`` / ``pos`` of the
    drawn record are the sender and the receiver, ``receiver_site`` / ``receiver_pos`` keep the
    file's)."""
    path = Path(path)
    records = _read_records(path)
    paths = any("sender" in record for record in records)
    drawn = [_as_path_cell(record) if paths else dict(record) for record in records]
    columns = [field for field in (*PATH_FIELDS, *SHOWN) if any(field in record for record in records)]
    return {
        "kind": "records",
        "title": path.name,
        "about": {"source": str(path), "records": len(records), "paths": paths},
        "records": drawn,
        "columns": columns,
    }


def _as_path_cell(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "receiver_site": record["site"], "receiver_pos": record["pos"],
            "site": str(record["sender"]), "pos": str(record["receiver"])}  # fmt: skip


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The records of `path`, checked: a JSON list of objects with every REQUIRED field."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) else f"not valid JSON ({error})"
        raise HookmechError(f"{path}: {reason}") from None
    if not isinstance(data, list) or not data:
        raise HookmechError(f"{path}: expected a JSON list of patch records (hookmech patch --json), got {_kind(data)}")
    for index, record in enumerate(data):
        if not isinstance(record, dict):
            raise HookmechError(f"{path}: record {index} is {_kind(record)}, not an object")
        missing = [field for field in REQUIRED if field not in record]
        if missing:
            raise HookmechError(
                f"{path}: record {index} lacks {', '.join(missing)} (not a hookmech patch --json record)"
            )
        for field in ("attribution", "p_clean", "p_corrupt", "p_patched"):
            if not _number_or_null(record[field]):
                raise HookmechError(f"{path}: record {index}: {field} is {record[field]!r}, not a number")
    if any("sender" in record for record in data) and not all("sender" in record for record in data):
        raise HookmechError(f"{path}: mixes path-patching records (sender, receiver) with others; give one kind")
    return data


def _number_or_null(value: Any) -> bool:
    if value is None:
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    return {dict: "an object", str: "a string", type(None): "null"}.get(type(value), type(value).__name__)
