"""Rooms and names: a module's name says what it is. The oracles live in `hookmech.oracles`, no
two modules of hookmech share a name (but for the package conventions listed), the old names of
renamed modules are gone (no shim re-exports them), and no module imports another's private name."""
from __future__ import annotations

import ast
import importlib
import sys
from collections import Counter
from pathlib import Path

import pytest

import hookmech

REPO = Path(hookmech.__file__).resolve().parent.parent
PACKAGE = REPO / "hookmech"

#: old names of renamed modules, once thin re-exports with a DeprecationWarning: removed in 0.x
REMOVED = ["hookmech.paths", "hookmech.presets", "hookmech.das.options", "hookmech.reference",
           "hookmech.patching.plain_loop"]
#: file names that several packages use by convention, each in its own package: a package's base
#: classes (mixers, tasks), the records a package writes (patching, das), a checkpoint (the file
#: format, hookmech.checkpoint) vs the page of one (hookmech.view.checkpoint), and a pretrained
#: family's converter (hookmech.pretrained.mamba) vs the mixer it loads into (hookmech.mixers.mamba)
SHARED_BY_CONVENTION = {"base.py", "records.py", "checkpoint.py", "mamba.py", "mamba2.py"}


def _file_of(module: str) -> Path:
    return REPO.joinpath(*module.split(".")).with_suffix(".py")


def test_no_two_modules_share_a_name():
    names = Counter(path.name for path in PACKAGE.rglob("*.py") if path.name != "__init__.py")
    shared = {name for name, count in names.items() if count > 1}
    assert shared <= SHARED_BY_CONVENTION, sorted(shared - SHARED_BY_CONVENTION)


@pytest.mark.parametrize("old", REMOVED)
def test_a_renamed_modules_old_name_is_gone(old):
    assert not _file_of(old).exists()
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert f"::: {old}\n" not in (REPO / "docs" / "api.md").read_text()  # the API page lists the new name


def test_the_api_page_lists_every_module_it_documents_under_its_new_name():
    listed = (REPO / "docs" / "api.md").read_text()
    for module in ("hookmech.hook_names", "hookmech.path_routes", "hookmech.model_presets",
                   "hookmech.das.training_options", "hookmech.oracles", "hookmech.oracles.plain_loop",
                   "hookmech.oracles.path_patching"):
        assert f"::: {module}\n" in listed, module


def _private_imports(path: Path) -> list[str]:
    """The ``from X import _name`` of hookmech's or the CLI's own modules in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hookmech")):
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_module_imports_a_private_name_of_another():
    offenders = [found for folder in ("hookmech", "cli") for path in sorted((REPO / folder).rglob("*.py"))
                 for found in _private_imports(path)]
    assert offenders == []
