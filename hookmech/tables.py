"""Plain-text tables for terminal output."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from typing import Any


def format_cell(value: Any) -> str:
    """Render one cell: floats with 4 decimals, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Return a left-aligned text table with a header rule."""
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)
    return "\n".join(lines)


PATCH_COLUMNS = ("site", "pos", "attribution", "p_clean", "p_corrupt", "p_patched", "n", "passes_filter")


def format_records(records: Sequence[dict[str, Any]]) -> str:
    """Return patching records as a table (one row per site × position; path patches: per sender ×
    receiver, with the route); AtP records checked with `verify_top` get an `exact` column beside the estimate."""
    headers = ["site", "pos", "attrib", "p_clean", "p_corrupt", "p_patched", "n", "filter"]
    columns = list(PATCH_COLUMNS)
    if any("via" in r for r in records):  # path patches: sender -> receiver along via
        headers[:2] = ["sender", "receiver", "via"]
        columns[:2] = ["sender", "receiver", "via"]
    if any("attribution_exact" in r for r in records):
        headers.insert(3, "exact")
        columns.insert(3, "attribution_exact")
    return format_table(headers, [[r.get(c) for c in columns] for r in records])


def csv_cell(value: Any) -> str:
    """Render one CSV cell: every digit of a float, None and NaN empty, bools true/false, lists as JSON."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return json.dumps(value, sort_keys=True)


def format_csv(records: Sequence[dict[str, Any]]) -> str:
    """Return records as CSV: a header of their fields in first-appearance order (per-row lists
    left out), then one line per record (`csv_cell`)."""
    fields = list(
        dict.fromkeys(key for record in records for key, value in record.items() if not isinstance(value, list))
    )
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(fields)
    for record in records:
        writer.writerow([csv_cell(record.get(field)) for field in fields])
    return out.getvalue().rstrip("\n")
