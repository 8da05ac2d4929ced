"""The figures the README and the guide quote come from docs/performance.md's tables.

The engine's speed-up is measured once, in performance.md's two engine-vs-plain-loop tables
(marked ``<!-- engine-speedup: NAME -->``); README.md and docs/guide.md quote the range of each
table's ratio column, and this test recomputes the range from the table, so a re-measured table
that moves the range fails until the quotes follow.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def table_after(text: str, marker: str) -> list[list[str]]:
    """Return the body rows (cells stripped) of the markdown table right after `marker`."""
    lines = text[text.index(marker) + len(marker) :].lstrip("\n").splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return [row for row in rows[2:]]  # past the header and its --- line


def ratio_range(rows: list[list[str]]) -> str:
    """Return ``"LO–HI×"`` of the rows' ratio column, as the docs write it (one decimal below 10)."""
    header_ratio = 4  # | mixer | cells | plain loop | engine | ratio | ...
    ratios = [float(re.sub(r"[*×]", "", row[header_ratio])) for row in rows]

    def shown(value: float) -> str:
        return f"{value:.1f}" if value < 10 else f"{value:.0f}"

    return f"{shown(min(ratios))}–{shown(max(ratios))}×"


@pytest.mark.parametrize("table", ["paper", "small"])
@pytest.mark.parametrize("page", ["README.md", "docs/guide.md"])
def test_engine_speedup_quotes_come_from_the_performance_table(page: str, table: str) -> None:
    performance = (ROOT / "docs/performance.md").read_text()
    rows = table_after(performance, f"<!-- engine-speedup: {table} -->")
    assert len(rows) >= 9  # every mixer of the table
    quoted = ratio_range(rows)
    assert quoted in (ROOT / page).read_text(), f"{page} should quote the engine's speed-up as {quoted}"


def test_no_other_engine_speedup_is_quoted() -> None:
    """Every "N–M× faster" in README and guide is one of the tables' ranges (4–15× and 4–8× were stale)."""
    performance = (ROOT / "docs/performance.md").read_text()
    allowed = {ratio_range(table_after(performance, f"<!-- engine-speedup: {name} -->")) for name in ("paper", "small")}
    for page in ("README.md", "docs/guide.md"):
        text = (ROOT / page).read_text()
        for match in re.finditer(r"(\d+(?:\.\d+)?–\d+(?:\.\d+)?×) faster", text):
            assert match.group(1) in allowed, f"{page}: {match.group(1)} faster is not performance.md's engine figure"
