"""Rooms and names: a module's name says what it is. The oracles live in `hookmech.oracles`, no
two modules of hookmech share a name (but for the package conventions listed), the old names of
renamed modules that the API reference listed still import, with a DeprecationWarning, and no
module imports another's private name."""
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

#: old module name -> (its new module, names it re-exports): thin re-exports of renamed modules
#: that docs/api.md listed, kept for old imports until a release that breaks them
DEPRECATED = {
    "hookmech.paths": ("hookmech.path_routes", ["PathEnds", "path_ends", "path_change", "VIA"]),
    "hookmech.presets": ("hookmech.model_presets", ["MODEL_PRESETS", "expand_preset"]),
    "hookmech.das.options": ("hookmech.das.training_options", ["DasOptions"]),
    "hookmech.reference": ("hookmech.oracles", ["path_patch_reference", "plain_loop_patch"]),
    "hookmech.patching.plain_loop": ("hookmech.oracles", ["plain_loop_patch"]),
}
#: file names that several packages use by convention, each in its own package: a package's base
#: classes (mixers, tasks), the records a package writes (patching, das), a checkpoint (the file
#: format, hookmech.checkpoint) vs the page of one (hookmech.view.checkpoint), and a pretrained
#: family's converter (hookmech.pretrained.mamba) vs the mixer it loads into (hookmech.mixers.mamba)
SHARED_BY_CONVENTION = {"base.py", "records.py", "checkpoint.py", "mamba.py", "mamba2.py"}


def _file_of(module: str) -> Path:
    return REPO.joinpath(*module.split(".")).with_suffix(".py")


def test_no_two_modules_share_a_name():
    exempt = {_file_of(module) for module in DEPRECATED}
    names = Counter(path.name for path in PACKAGE.rglob("*.py") if path.name != "__init__.py" and path not in exempt)
    shared = {name for name, count in names.items() if count > 1}
    assert shared <= SHARED_BY_CONVENTION, sorted(shared - SHARED_BY_CONVENTION)


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_a_renamed_module_still_imports_under_its_old_name_with_a_warning(old):
    new, names = DEPRECATED[old]
    sys.modules.pop(old, None)
    with pytest.deprecated_call(match=new):
        shim = importlib.import_module(old)
    renamed = importlib.import_module(new)
    for name in names:
        assert getattr(shim, name) is getattr(renamed, name)
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
