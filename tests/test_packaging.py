"""Packaging: the declared Python version is the one the code needs; every package and its data
(the demo's fixtures) is in the wheel, and the demo finds them wherever hookmech is installed."""
from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

from helpers import REPO


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


def _package_dirs() -> dict[str, Path]:
    """Return {package name: its source folder} for every package under hookmech/ and under the
    folders pyproject maps into it (package-dir), found by their __init__.py."""
    mapped = {"hookmech": REPO / "hookmech", **{name: REPO / folder for name, folder in
                                                _pyproject()["tool"]["setuptools"].get("package-dir", {}).items()}}
    found = {}
    for root_name, root in mapped.items():
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(root).parts
            found[".".join((root_name, *relative))] = init.parent
    return found


def test_pyproject_lists_every_package_and_its_data():
    setuptools = _pyproject()["tool"]["setuptools"]
    found = _package_dirs()
    assert sorted(setuptools["packages"]) == sorted(found)
    data = setuptools.get("package-data", {})
    for name, folder in found.items():
        for path in folder.iterdir():
            if path.is_file() and path.suffix not in (".py", ".pyc"):
                assert any(path.match(pattern) for pattern in data.get(name, [])), f"{path} is not package data of {name}"


def test_the_demo_finds_the_fixtures_through_the_installed_package():
    import importlib.resources

    from hookmech.demo import FIXTURES, fixture_dir

    assert fixture_dir() == Path(str(importlib.resources.files("hookmech.fixtures")))
    for filename, _, _ in FIXTURES:
        assert (fixture_dir() / filename).is_file()


def test_a_wheel_carries_the_fixtures_and_its_demo_finds_them_outside_the_repository(tmp_path):
    """Build a wheel from a copy of the sources, unpack it (what pip install does) and look the
    fixtures up from another folder, with the unpacked copy first on the path."""
    import shutil
    import subprocess
    import sys
    import zipfile

    pytest.importorskip("setuptools")
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for folder in ("hookmech", "cli", "fixtures"):
        shutil.copytree(REPO / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=source, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = tmp_path / "dist" / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    from hookmech.demo import FIXTURES

    assert {f"hookmech/fixtures/{filename}" for filename, _, _ in FIXTURES} <= names
    look = "import hookmech.demo as demo; print(demo.__file__); print(demo.fixture_dir())"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-c", look], cwd=elsewhere, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert done.returncode == 0, done.stderr[-2000:]
    module, folder = done.stdout.strip().splitlines()[-2:]
    assert Path(module).is_relative_to(tmp_path / "site") and Path(folder) == tmp_path / "site" / "hookmech" / "fixtures"
    for filename, _, _ in FIXTURES:
        assert (Path(folder) / filename).read_bytes() == (REPO / "fixtures" / filename).read_bytes()
