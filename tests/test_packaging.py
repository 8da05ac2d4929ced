"""Packaging: the declared Python version is the one the code needs."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_declared_python_is_the_one_the_code_needs_and_the_readme_says():
    declared = _pyproject()["project"]["requires-python"]
    match = re.fullmatch(r">=(\d+)\.(\d+)", declared)
    assert match, declared
    minimum = (int(match[1]), int(match[2]))
    if any(re.search(r"^\s*import tomllib", path.read_text(), re.M) for path in (REPO / "hookmech").rglob("*.py")):
        assert minimum >= (3, 11), "hookmech imports tomllib (Python >= 3.11)"
    assert f"Python ≥ {minimum[0]}.{minimum[1]}" in (REPO / "README.md").read_text()
