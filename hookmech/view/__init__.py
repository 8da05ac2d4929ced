"""`hookmech view`: one self-contained HTML page of a checkpoint, an activation cache or a sweep.

Data collection and rendering are apart: `checkpoint.py` and `sweep.py` collect what a page
shows as JSON-able data (patching records from the engine, per-example probabilities, tokens,
effective attention, induction scores; the numbers of `hookmech report`'s figures),
`encode.py` packs arrays for it, and `page.py` writes the HTML with its inline script
(`view.js`) and stylesheet (`view.css`).

    data = checkpoint_page_data(model, task, task.sample(320, seed=1))
    write_page(data, "page.html", title="attention on AR")
"""

from __future__ import annotations

from .checkpoint import checkpoint_page_data, default_positions
from .encode import pack_floats, pack_ints, unpack
from .page import read_page_data, render_page, write_page
from .sweep import sweep_page_data

__all__ = [
    "checkpoint_page_data",
    "default_positions",
    "pack_floats",
    "pack_ints",
    "read_page_data",
    "render_page",
    "sweep_page_data",
    "unpack",
    "write_page",
]
