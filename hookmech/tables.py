"""Plain-text tables for terminal output."""

from __future__ import annotations

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
