"""docs/architecture.md's checklist, "Adding a mixer", followed to the letter: a throwaway mixer
written as one module (steps 1-7: its class and its spec, nothing else) in a temporary folder that
joins the package's mixers is registered, built into a model, patched by the engine exactly as the
plain loop patches it, estimated by AtP, and listed by the generated files (site reference,
README.md's list) without any other file being edited."""
from __future__ import annotations

import importlib
import math
import runpy
import sys
import textwrap

import pytest

import hookmech.mixers as mixers
from hookmech.oracles import plain_loop_patch
from hookmech.patching import attribution_patch, patch

from helpers import ENGINE_TOL, REPO, make_model

NAME = "throwaway"

#: steps 1-7 of the checklist: the class (options with defaults, hooks with axes, output
#: projection) and its spec at the end of the module
MODULE = textwrap.dedent('''
    """A throwaway mixer: the running mean of a projection, through an output projection."""

    from __future__ import annotations

    import torch
    from torch import nn

    from hookmech.hooks import AxisHookPoint
    from hookmech.mixers.base import Mixer
    from hookmech.mixers.mixer_spec import MixerSpec


    class RunningMean(Mixer):
        """y_t = W_out (1/(t+1) Σ_{s<=t} W_v x_s)."""

        def __init__(self, d_model: int, bias: bool = False):
            super().__init__()
            self.v_proj = nn.Linear(d_model, d_model, bias=bias)
            self.out_proj = nn.Linear(d_model, d_model, bias=bias)
            self.hook_v = AxisHookPoint("batch pos d_model")
            self.hook_mean = AxisHookPoint("batch pos d_model")

        def forward(self, x):
            v = self.hook_v(self.v_proj(x))
            counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
            return self.out_proj(self.hook_mean(v.cumsum(dim=1) / counts))


    SPEC = MixerSpec(
        name="throwaway",
        mixer=RunningMean,
        heads=None,
        meanings={"v": "the projected input", "mean": "the running mean of v up to each position"},
        output_projections=("out_proj",),
    )
''')


@pytest.fixture
def throwaway(tmp_path, monkeypatch):
    """The checklist's one file, in a folder the package's mixers are collected from as well."""
    (tmp_path / f"{NAME}.py").write_text(MODULE)
    monkeypatch.setattr(mixers, "__path__", [*mixers.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, f"hookmech.mixers.{NAME}", raising=False)
    collected = mixers._collect_specs()  # what `import hookmech.mixers` does with the package's modules
    monkeypatch.setitem(mixers.SPECS, NAME, collected[NAME])
    monkeypatch.setitem(mixers.REGISTRY, NAME, collected[NAME].mixer)
    yield collected[NAME]
    sys.modules.pop(f"hookmech.mixers.{NAME}", None)
    if hasattr(mixers, NAME):  # importing a submodule sets it on the package
        delattr(mixers, NAME)


def test_the_module_alone_registers_the_mixer(throwaway):
    assert mixers.REGISTRY[NAME] is throwaway.mixer
    assert mixers.spec_of(NAME) is throwaway
    assert importlib.import_module(f"hookmech.mixers.{NAME}").SPEC is throwaway


def test_the_engine_and_atp_patch_it_as_the_plain_loop(throwaway, ar_task):
    model = make_model(ar_task, mixers=NAME)
    batch = ar_task.sample(16, seed=1)
    sites, positions = ["L0.mixer.v", "L1.mixer.mean", "L1.block_in"], ["key", "value", "whole"]
    records = patch(model, batch, sites, positions, max_batch=7)
    reference = plain_loop_patch(model, batch, sites, positions)
    assert len(records) == len(reference) == len(sites) * len(positions)
    for record in records:
        want = reference[record["hook"], record["pos"]]
        assert abs(record["p_patched"] - want["p_patched"]) <= ENGINE_TOL, record
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in records) > 2 * ENGINE_TOL  # a patch that moves p
    estimates = attribution_patch(model, batch, sites, positions)
    assert sorted((r["site"], r["pos"]) for r in estimates) == sorted((r["site"], r["pos"]) for r in records)
    assert all(math.isfinite(r["attribution"]) for r in estimates)


def test_the_generated_files_list_it(throwaway):
    script = runpy.run_path(str(REPO / "scripts" / "make_site_reference.py"))
    reference = script["render"]()
    assert "`L0.mixer.mean`" in reference and "the running mean of v up to each position" in reference
    readme = script["render_readme"]((REPO / "README.md").read_text())
    assert f"mamba2, rwkv, {NAME}`" in readme
