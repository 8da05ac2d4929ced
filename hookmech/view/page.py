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
    return TEMPLATE.format(
        version=__version__,
        title=html.escape(title),
        css=_asset("view.css").strip(),
        data=page_json(data),
        script=_asset("view.js").strip(),
    )


def write_page(data: dict[str, Any], path: str | Path, title: str) -> Path:
    """Write `render_page(data, title)` to `path` (a temporary file renamed into place); return the path."""
    path = Path(path)
    text = render_page(data, title)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def read_page_data(path: str | Path) -> dict[str, Any]:
    """Return the data embedded in a page written by `write_page` (for tests and scripts)."""
    text = Path(path).read_text(encoding="utf-8")
    start = text.index('<script type="application/json" id="hookmech-data">')
    start = text.index(">", start) + 1
    end = text.index("</script>", start)
    return json.loads(text[start:end])  # JSON reads "\\u003c" as "<"
