"""One spec per mixer (`hookmech.mixers.mixer_spec.MixerSpec`): every registered mixer has one, and what
it states (the meaning of each inside hook, the head axis, the references the tests use, the
benches' hooks) is what the mixer's class and its forward show; its block (norm, MLP, position
embedding, init, output projections, TransformerLens's names) is stated there only, and is what the
config and the backbone build."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest
import torch

import hookmech.mixers
from hookmech.config import build_config
from hookmech.errors import HookmechError, UsageError
from hookmech.hooks import AxisHookPoint
from hookmech.mixers import REGISTRY, SPECS, Heads, Mixer, MixerSpec, PathRoutes, spec_of
from hookmech.mixers.mixer_spec import BLOCK_FIELDS
from hookmech.model import HookedLM
from hookmech.oracles.mixer_cases import BENCH_HOOKS, examples_of
from hookmech.oracles.state_loops import STATE_LOOPS

from helpers import head_options


def test_every_registered_mixer_has_its_spec():
    assert set(REGISTRY) == set(SPECS)
    for name, spec in SPECS.items():
        assert spec.name == name and REGISTRY[name] is spec.mixer


def test_every_mixer_class_of_the_package_has_a_spec():
    """A mixer written into hookmech/mixers/ without a ``SPEC`` beside it is never registered: caught here."""
    specified = {spec.mixer for spec in SPECS.values()}
    package = hookmech.mixers
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Mixer) and cls is not Mixer and cls.__module__ == module.__name__:
                assert cls in specified, f"{cls.__module__}.{cls.__name__} has no MixerSpec"


def test_a_mixer_registered_without_a_spec_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(REGISTRY, "unspecified", REGISTRY["mamba"])
    with pytest.raises(HookmechError, match="'unspecified' is registered without a spec"):
        build_config(d_vocab=8, n_ctx=8, mixers="unspecified", d_model=16, n_layers=1).head_shape(0)
    with pytest.raises(UsageError, match="unknown mixer 'nosuch'"):
        spec_of("nosuch")


def test_heads_state_a_count_or_a_width():
    with pytest.raises(HookmechError, match="exactly one"):
        Heads()
    with pytest.raises(HookmechError, match="exactly one"):
        Heads(count="n_heads", width="head_size")


def inside_hooks(name: str, options: dict) -> dict[str, AxisHookPoint]:
    """The inside hooks (without "hook_") of a 1-layer d_model-16 model of mixer `name` with `options`."""
    torch.manual_seed(0)
    model = HookedLM(build_config(d_vocab=8, n_ctx=12, mixers=name, d_model=16, n_layers=1, layer_options=[options]))
    prefix = "blocks.0.mixer.hook_"
    return {hook[len(prefix):]: point for hook, point in model.hook_dict.items() if hook.startswith(prefix)}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_spec_gives_every_inside_hook_its_meaning(name):
    spec = SPECS[name]
    seen = set()
    for options in examples_of(name):
        hooks = set(inside_hooks(name, options))
        assert hooks <= set(spec.meanings), (options, hooks - set(spec.meanings))
        seen |= hooks
    assert seen == set(spec.meanings), set(spec.meanings) - seen
    assert set(BENCH_HOOKS[name]) <= seen and BENCH_HOOKS[name], "the benches' hooks are inside hooks"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_head_axis_is_the_one_the_spec_states(name):
    """Hooks with a head axis exist where the spec states heads, and have the stated count (measured
    by one forward, and declared for ``[*]`` sites); d_head is the width of a per-head output."""
    spec = SPECS[name]
    options = head_options(name)
    torch.manual_seed(0)
    cfg = build_config(d_vocab=8, n_ctx=12, mixers=name, d_model=16, n_layers=1, layer_options=[options])
    model = HookedLM(cfg)
    _, cache = model.run_with_cache(torch.zeros(1, 5, dtype=torch.long))
    n_heads, d_head = cfg.head_shape(0)
    headed = {hook: point for hook, point in model.hook_dict.items() if "head" in point.axes.split()}
    assert bool(headed) == (spec.heads is not None)
    if spec.heads is None:
        assert (n_heads, d_head) == (1, 16)
        return
    assert n_heads > 1
    for hook, point in headed.items():
        axes = point.axes.split()
        assert point.sizes["head"] == n_heads, hook
        if hook in cache:
            assert cache[hook].shape[axes.index("head")] == n_heads, hook
    if spec.output_head_axes:
        out_proj = getattr(model.blocks[0].mixer, spec.output_projections[0])
        assert out_proj.in_features == n_heads * d_head


@pytest.mark.parametrize("name", sorted(SPECS))
def test_n_heads_reaches_the_head_count_option_only(name):
    spec = SPECS[name]
    cfg = build_config(d_vocab=8, n_ctx=12, mixers=name, d_model=16, n_layers=1, n_heads=2)
    count = spec.head_count_option()
    assert cfg.mixer_kwargs[0].get(count) == 2 if count else "n_heads" not in cfg.mixer_kwargs[0]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_references_the_tests_need_exist(name):
    """A `state` route's reference loop (path patching: hookmech.oracles.state_loops) exists exactly
    for the mixers with a `state` route, and the per-head output projection input (TransformerLens's
    head results) is in the spec exactly where the mixer's output splits into heads."""
    spec, cls = SPECS[name], SPECS[name].mixer
    has_state_route = issubclass(cls, PathRoutes) and bool(cls.state_readout)
    assert (name in STATE_LOOPS) == has_state_route
    assert (spec.head_results is not None) == bool(spec.output_head_axes)


def test_a_mixer_of_the_package_states_its_block_once_in_its_spec():
    """The block fields live in the spec only: no registered class (nor Mixer) carries one, or the
    aliases' old class attribute, which the package would no longer read."""
    for cls in [Mixer, *REGISTRY.values()]:
        stated = [name for name in (*BLOCK_FIELDS, "block_hook_aliases", "hook_aliases") if hasattr(cls, name)]
        assert not stated, (cls.__name__, stated)
    for spec in SPECS.values():  # TransformerLens's names point at inside hooks the spec describes
        assert set(spec.tl_attention.values()) <= set(spec.meanings), spec.name


def test_the_config_and_the_backbone_read_the_block_from_the_spec(monkeypatch):
    """Every block field, changed in a spec alone, changes what build_config and HookedLM make."""
    spec = dataclasses.replace(
        SPECS["attention"], name="attention_ssm_like", block_norm="rmsnorm", block_mlp=False, default_pos_emb="none",
        reference_init="mamba", output_projections=(), output_head_axes="", tl_attention={"z": "z"},
        tl_mixer_out=("ssm_out",),
    )
    monkeypatch.setitem(SPECS, spec.name, spec)
    monkeypatch.setitem(REGISTRY, spec.name, spec.mixer)
    plain = build_config(d_vocab=8, n_ctx=8, mixers="attention", d_model=16, n_layers=2, init="zoology")
    assert (plain.norms, plain.mlp, plain.pos_emb, plain.init) == (("layernorm",) * 2, (True,) * 2, "learned", "normal")
    cfg = build_config(d_vocab=8, n_ctx=8, mixers=spec.name, d_model=16, n_layers=2, init="zoology")
    assert (cfg.norms, cfg.mlp, cfg.pos_emb, cfg.init) == (("rmsnorm",) * 2, (False,) * 2, "none", "mamba")
    model = HookedLM(cfg)
    assert model.blocks[0].output_projection_weights() == []
    assert HookedLM(plain).blocks[0].output_projection_weights() == ["mixer.out_proj.weight", "mlp.fc2.weight"]
    assert model.hook_aliases == {
        "blocks.0.hook_attn_out": "blocks.0.hook_mixer_out", "blocks.0.attn.hook_z": "blocks.0.mixer.hook_z",
        "blocks.0.mixer.hook_ssm_out": "blocks.0.hook_mixer_out",
        "blocks.1.hook_attn_out": "blocks.1.hook_mixer_out", "blocks.1.attn.hook_z": "blocks.1.mixer.hook_z",
        "blocks.1.mixer.hook_ssm_out": "blocks.1.hook_mixer_out",
    }
    heads = model.blocks[0].head_results(torch.randn(1, 3, 16), torch.randn(1, 3, 16))
    assert heads.shape == (1, 3, 1, 16)  # output_head_axes "": the output is one head
    by_reference_name = dataclasses.replace(SPECS["attention"], reference_scales_output=False)
    monkeypatch.setitem(SPECS, "attention", by_reference_name)
    assert build_config(d_vocab=8, n_ctx=8, mixers="attention", n_layers=1, init="zoology").init == "normal-by-name"


@pytest.mark.parametrize(("options", "rotated"), [({}, False), ({"rotary_pct": 0.5}, True)])
def test_the_hook_aliases_name_the_inside_hooks_the_mixer_has(options, rotated):
    """Attention's TransformerLens names of the rotated q and k exist where its hooks do (rotary)."""
    model = HookedLM(build_config(d_vocab=8, n_ctx=8, d_model=16, n_layers=1, layer_options=[options]))
    tl_names = {alias.removeprefix("blocks.0.attn.") for alias in model.hook_aliases if ".attn." in alias}
    assert tl_names == {"hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"} | (
        {"hook_rot_q", "hook_rot_k"} if rotated else set())
    assert all(target in model.hook_dict for target in model.hook_aliases.values())


def test_model_presets_come_from_the_specs():
    from hookmech.model_presets import MODEL_PRESETS

    assert MODEL_PRESETS == {name: p for spec in SPECS.values() for name, p in spec.model_presets.items()}
    assert MODEL_PRESETS["based"] == (("baseconv", {"kernel_size": 3}), ("based", {}))
