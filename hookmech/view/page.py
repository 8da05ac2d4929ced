"""One self-contained HTML page of page data (`checkpoint_page_data`, `sweep_page_data`).

The page needs no network: its stylesheet (`view.css`), its script (`view.js`, hand-written
SVG and canvas drawing, no library) and its data (JSON in a ``<script type="application/json">``
element, arrays packed by `hookmech.view.encode`) are all inline. Same data, same bytes: the
page holds no time stamp.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path
from typing import Any

from .. import __version__
from ..fileio import atomic_path
from .encode import clean_json
from .spill import Spill, spills_in

TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="hookmech {version}">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<header><h1>{title}</h1><div id="about"></div></header>
<main id="page"><p class="note">Drawing the page (it needs JavaScript).</p></main>
<div id="tip" hidden></div>
<script type="application/json" id="hookmech-data">{data}</script>
<script>
{script}
</script>
</body>
</html>
"""


def _asset(name: str) -> str:
    return resources.files("hookmech.view").joinpath(name).read_text(encoding="utf-8")


def page_json(data: dict[str, Any]) -> str:
    """Return `data` as the JSON the page embeds: compact, NaN as null, and every ``<`` written
    ``\\u003c``, so that no string (a sweep's name, a run id, a path) holds ``</script``,
    ``<script`` or ``<!--``: inside a script element the first closes it and the other two
    switch the browser's tokenizer into states where the real ``</script>`` no longer closes it.
    JSON reads the escape back as ``<``."""
    text = json.dumps(clean_json(data), separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c")  # "<" occurs in JSON text only inside strings


def render_page(data: dict[str, Any], title: str) -> str:
    """Return the whole HTML page (a str) showing `data` under `title`."""
    return _fill(TEMPLATE, title, page_json(data))


def _fill(template: str, title: str, data: str) -> str:
    return template.format(
        version=__version__,
        title=html.escape(title),
        css=_asset("view.css").strip(),
        data=data,
        script=_asset("view.js").strip(),
    )


def write_page(data: dict[str, Any], path: str | Path, title: str) -> Path:
    """Write `render_page(data, title)` to `path` (a temporary file renamed into place); return the path.

    `data` may hold `hookmech.view.spill.Spill`s (``checkpoint_page_data(..., spill=True)``): each
    is written from its temporary file a piece at a time, as the array it holds would be, and
    closed, so the page's per-row arrays are never in memory whole."""
    path = Path(path)
    spills = spills_in(data)
    try:
        # every spill becomes a marker string; the JSON text around the markers is small
        markers = {id(spill): f"\x00spill {index}\x00" for index, spill in enumerate(spills)}
        text = page_json(_marked(data, markers))
        head, tail = _fill(TEMPLATE, title, "\x00data\x00").rsplit("\x00data\x00", 1)
        with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as out:
            out.write(head)
            for spill in spills:
                before, text = text.split(json.dumps(markers[id(spill)]), 1)
                out.write(before)
                spill.write_json(out)
            out.write(text + tail)
    finally:
        for spill in spills:
            spill.close()
    return path


def _marked(data: Any, markers: dict[int, str]) -> Any:
    """Return `data` with each `Spill` replaced by its marker string."""
    if isinstance(data, Spill):
        return markers[id(data)]
    if isinstance(data, dict):
        return {key: _marked(value, markers) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_marked(value, markers) for value in data]
    return data


def read_page_data(path: str | Path) -> dict[str, Any]:
    """Return the data embedded in a page written by `write_page` (for tests and scripts)."""
    text = Path(path).read_text(encoding="utf-8")
    start = text.index('<script type="application/json" id="hookmech-data">')
    start = text.index(">", start) + 1
    end = text.index("</script>", start)
    return json.loads(text[start:end])  # JSON reads "\\u003c" as "<"
