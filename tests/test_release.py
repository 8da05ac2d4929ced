"""Release metadata: one version string, read everywhere from hookmech/__init__.py; the license,
citation and changelog agree with it; the tutorial's script and notebook stay a pair."""
from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

import hookmech

from helpers import REPO


def _version_in_init() -> str:
    """The literal `__version__ = "..."` of hookmech/__init__.py, as setuptools reads it
    (statically, without importing the package)."""
    tree = ast.parse((REPO / "hookmech" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
            assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str), \
                "__version__ must stay a string literal (setuptools reads it without importing hookmech)"
            return node.value.value
    raise AssertionError("hookmech/__init__.py has no __version__ assignment")


def test_pyproject_reads_the_version_from_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hookmech.__version__"}
    assert project["project"]["license"] == "MIT"
    assert (REPO / "LICENSE").read_text().startswith("MIT License")


def test_version_is_a_literal_and_importable_without_torch():
    assert hookmech.__version__ == _version_in_init()
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]\d+|rc\d+)?(\.post\d+)?(\.dev\d+)?", hookmech.__version__)
    # torch blocked: `import hookmech` and its version must not need it (the CLI's --help and the build read it)
    code = "import sys; sys.modules['torch'] = None; import hookmech; print(hookmech.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.strip() == hookmech.__version__


def test_checkpoints_and_caches_record_the_package_version(ar_model, ar_task, tmp_path):
    from hookmech import cache, checkpoint, datasets

    for module in (checkpoint, cache, datasets):
        assert module.__version__ is hookmech.__version__
    path = checkpoint.save(ar_model, tmp_path / "m.safetensors", task_spec=ar_task.spec)
    assert checkpoint.read_metadata(path)["version"] == hookmech.__version__


def test_citation_and_changelog_name_the_current_version():
    citation = (REPO / "CITATION.cff").read_text()
    assert re.search(r"^cff-version: 1\.2\.0$", citation, re.M)
    assert re.search(rf'^version: "?{re.escape(hookmech.__version__)}"?$', citation, re.M), \
        "CITATION.cff's version differs from hookmech.__version__"
    assert re.search(r"^license: MIT$", citation, re.M)
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert re.search(rf"^## \[{re.escape(hookmech.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M), \
        "CHANGELOG.md has no section for the current version"


def test_tutorial_notebook_is_paired_with_its_script():
    jupytext = pytest.importorskip("jupytext")
    nbformat = pytest.importorskip("nbformat")
    script = jupytext.read(REPO / "examples" / "tutorial.py")
    notebook = nbformat.read(REPO / "examples" / "tutorial.ipynb", as_version=4)

    def cells(nb):
        return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]

    assert cells(notebook) == cells(script), \
        "examples/tutorial.ipynb differs from examples/tutorial.py: run python scripts/run_tutorial.py --update"
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code, "the notebook has no code cells"
    assert all(cell.get("outputs") for cell in code), "the notebook is stored without its outputs"
    assert not any(o.output_type == "error" for cell in code for o in cell.outputs)
    stored = (REPO / "examples" / "tutorial.ipynb").read_text()
    assert str(REPO) not in stored and "site-packages" not in stored, "the stored outputs name local paths"
