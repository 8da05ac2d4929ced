"""The site reference stays generated from the code; model presets expand as the paper's models."""
from __future__ import annotations

import runpy

import pytest

from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY
from hookmech.model_presets import MODEL_PRESETS, expand_preset

from helpers import REPO


def test_site_reference_is_current():
    script = runpy.run_path(str(REPO / "scripts" / "make_site_reference.py"))
    assert (REPO / "docs" / "sites.md").read_text() == script["render"](), \
        "docs/sites.md is stale: run python scripts/make_site_reference.py"


def test_mixer_table_is_current():
    script = runpy.run_path(str(REPO / "scripts" / "make_site_reference.py"))
    page = REPO / "docs" / "mixers.md"
    assert page.read_text() == script["render_mixer_page"](page.read_text()), \
        "the table of docs/mixers.md is stale: run python scripts/make_site_reference.py"
    for name in REGISTRY:
        assert f"| `{name}` |" in page.read_text()


def test_readme_lists_the_registry():
    """README.md's list of mixers is the registry's, written by scripts/make_site_reference.py."""
    script = runpy.run_path(str(REPO / "scripts" / "make_site_reference.py"))
    readme = (REPO / "README.md").read_text()
    assert readme == script["render_readme"](readme), "README.md's mixers are stale: run python scripts/make_site_reference.py"
    assert ("`" + ", ".join(REGISTRY) + "`") in readme


def test_site_reference_lists_every_mixer():
    text = (REPO / "docs" / "sites.md").read_text()
    for name in REGISTRY:
        assert f"## `{name}`" in text


def test_based_model_alternates_baseconv_and_based():
    mixers, options = expand_preset("based", 4)
    assert mixers == ["baseconv", "based", "baseconv", "based"]
    assert options[0] == {"kernel_size": 3} and options[1] == {}
    mixers, options = expand_preset("baseconv", 2)
    assert mixers == ["baseconv", "baseconv"] and [o["kernel_size"] for o in options] == [3, -1]


def test_presets_name_only_registered_mixers_and_registry_is_untouched():
    assert REGISTRY["based"].__name__ == "Based"
    assert MODEL_PRESETS
    for pattern in MODEL_PRESETS.values():
        assert pattern and all(mixer in REGISTRY for mixer, _ in pattern)


def test_unknown_preset_suggests():
    with pytest.raises(UsageError, match="based"):
        expand_preset("basde", 2)
