#!/usr/bin/env python
"""Execute the tutorial notebook, checking it or refreshing its stored outputs.

examples/tutorial.py (jupytext percent format, the file to review and edit) and
examples/tutorial.ipynb (the same cells with their outputs, what readers open) are a jupytext pair.

    python scripts/run_tutorial.py            # CI: check the pair, execute the notebook, compare outputs
    python scripts/run_tutorial.py --update   # after editing tutorial.py: execute it, rewrite the .ipynb

The check fails when the .ipynb's cells differ from tutorial.py, when a cell raises, or when a
cell's text output differs from the stored one (images are not compared): stored outputs that
no longer match the code are what a notebook rotting looks like.
"""
from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "examples" / "tutorial.py"
NOTEBOOK = ROOT / "examples" / "tutorial.ipynb"
CELL_TIMEOUT = 600  # seconds per cell


def cells(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]


def text_outputs(nb) -> list[str]:
    """Per code cell: its stdout and text/plain outputs, joined (images and stderr, where
    warnings name local paths, left out)."""
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        parts = []
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                if output.name == "stdout":
                    parts.append(output.text)
            elif output.output_type in ("execute_result", "display_data"):
                if "image/png" not in output.get("data", {}):
                    parts.append(output.get("data", {}).get("text/plain", ""))
            elif output.output_type == "error":
                parts.append(f"{output.ename}: {output.evalue}")
        out.append("".join(parts))
    return out


def execute(nb) -> float:
    """Run every cell in a fresh kernel, in examples/ (as a reader would); return the seconds taken."""
    start = time.perf_counter()
    NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="execute tutorial.py and rewrite tutorial.ipynb with its outputs")
    args = parser.parse_args()

    source = jupytext.read(SOURCE)
    if args.update:
        seconds = execute(source)
        jupytext.write(source, NOTEBOOK)
        print(f"{NOTEBOOK.relative_to(ROOT)}: executed in {seconds:.1f} s and written")
        return 0

    stored = nbformat.read(NOTEBOOK, as_version=4)
    if cells(stored) != cells(source):
        print(f"{NOTEBOOK.relative_to(ROOT)} does not match {SOURCE.relative_to(ROOT)}: "
              "run `python scripts/run_tutorial.py --update`", file=sys.stderr)
        return 1
    executed = nbformat.from_dict(stored)
    for cell in executed.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    seconds = execute(executed)
    failures = 0
    for i, (old, new) in enumerate(zip(text_outputs(stored), text_outputs(executed))):
        if old != new:
            failures += 1
            print(f"code cell {i}: output differs from the stored one", file=sys.stderr)
            sys.stderr.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "stored", "now"))
    if failures:
        print("the stored outputs are stale: run `python scripts/run_tutorial.py --update`", file=sys.stderr)
        return 1
    print(f"{NOTEBOOK.relative_to(ROOT)}: {len(executed.cells)} cells executed in {seconds:.1f} s, outputs as stored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
