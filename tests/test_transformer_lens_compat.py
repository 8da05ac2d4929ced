"""TransformerLens's own analysis code on hookmech models: `transformer_lens.patching` against
the patching engine (a second implementation: TL's plain loop of full `run_with_hooks` runs),
the derived `cfg` values TL reads (checked against the hooks' shapes and the parameters'
device), and the `hook_attn_out` alias."""
from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest
import torch
from transformer_lens import patching as tl_patching

import hookmech
from hookmech.config import LATER_FIELD_DEFAULTS, ModelConfig, NoModelError, build_config
from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY, SPECS
from hookmech.patching import patch
from hookmech.model_presets import expand_preset
from hookmech.sites import resolve_sites

from helpers import ENGINE_TOL, REPO, head_options, make_model, mixers_with_heads, unit_variance

FIXTURES = {name: REPO / "fixtures" / f"{name}.safetensors" for name in ("attention_ar_cpu", "mamba_ar_cpu", "attention_ar_paper")}
WITH_MLP = [name for name in sorted(SPECS) if SPECS[name].block_mlp]


def p_answer_metric(batch):
    """TL's patching metric: mean p(answer) at each row's query, a scalar (written here plainly)."""
    rows = torch.arange(len(batch))

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[rows, batch.query_pos].float().softmax(-1)[rows, batch.answers].double().mean()

    return metric


def assert_tl_sweep_matches_engine(result: torch.Tensor, model, batch, site: str) -> None:
    """`result` ``[n_layers, pos]`` of a TL ``get_act_patch_*`` sweep equals the engine's
    p_patched of site ``L{layer}.{site}`` at position ``pos`` (patch ``all``)."""
    n_layers, n_pos = model.cfg.n_layers, batch.tokens.shape[1]
    records = patch(model, batch, [f"L*.{site}"], ["all"])
    assert result.shape == (n_layers, n_pos) and len(records) == n_layers * n_pos
    engine = torch.tensor([r["p_patched"] for r in records], dtype=torch.float64).view(n_layers, n_pos)
    # contract: the engine vs a plain run_with_hooks loop, ENGINE_TOL in every p
    torch.testing.assert_close(result.double(), engine, rtol=0, atol=ENGINE_TOL)
    # and the sweep can tell a patch from no patch (a patch TL failed to apply would give p_corrupt)
    assert (engine - records[0]["p_corrupt"]).abs().max() > 2 * ENGINE_TOL


def tl_sweep(sweep, model, batch) -> torch.Tensor:
    _, clean_cache = model.run_with_cache(batch.tokens)
    with torch.no_grad():
        return sweep(model, batch.corrupt_tokens, clean_cache, p_answer_metric(batch))


# -- transformer_lens.patching on every mixer ---------------------------------------------
@pytest.mark.parametrize("mixer", sorted(REGISTRY))
def test_tl_resid_pre_patching_equals_the_engine_on_every_mixer(ar_task, mixer):
    model = unit_variance(make_model(ar_task, mixers=mixer, d_model=16))
    batch = ar_task.sample(8, seed=1)
    assert_tl_sweep_matches_engine(tl_sweep(tl_patching.get_act_patch_resid_pre, model, batch), model, batch, "block_in")


@pytest.mark.parametrize("mixer", WITH_MLP)
def test_tl_resid_mid_and_mlp_out_patching_equal_the_engine(ar_task, mixer):
    model = unit_variance(make_model(ar_task, mixers=mixer, d_model=16))
    assert all(model.cfg.mlp)
    batch = ar_task.sample(8, seed=2)
    assert_tl_sweep_matches_engine(tl_sweep(tl_patching.get_act_patch_resid_mid, model, batch), model, batch, "resid_mid")
    assert_tl_sweep_matches_engine(tl_sweep(tl_patching.get_act_patch_mlp_out, model, batch), model, batch, "mlp_out")


def test_every_block_kind_with_an_mlp_is_covered():
    assert {"attention", "based", "deltanet", "rwkv"} <= set(WITH_MLP)
    assert not {"mamba", "mamba2"} & set(WITH_MLP)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_tl_resid_pre_patching_equals_the_engine_on_the_bundled_fixtures(name):
    path = FIXTURES[name]
    model, task = hookmech.load(path), hookmech.tasks.from_checkpoint(path)
    batch = task.sample(16, seed=3)
    assert_tl_sweep_matches_engine(tl_sweep(tl_patching.get_act_patch_resid_pre, model, batch), model, batch, "block_in")


def test_tl_block_every_on_attention_reads_hook_attn_out(ar_task):
    """`get_act_patch_block_every` patches resid_pre, attn_out (the alias of hook_mixer_out) and mlp_out."""
    model = unit_variance(make_model(ar_task, n_heads=2))
    batch = ar_task.sample(8, seed=4)
    every = tl_sweep(tl_patching.get_act_patch_block_every, model, batch)
    assert every.shape == (3, 2, batch.tokens.shape[1])
    for result, site in zip(every, ["block_in", "mixer_out", "mlp_out"], strict=True):
        assert_tl_sweep_matches_engine(result, model, batch, site)


# -- the derived cfg values -----------------------------------------------------------------
#: options giving each mixer with heads (its spec's `heads`) other heads than its defaults
HEAD_OPTIONS = {name: head_options(name) for name in mixers_with_heads()}


def head_hook_shapes(model, layer: int) -> set[tuple[int, int | None]]:
    """{(size of the head axis, size of its d_head/headdim axis or None)} over layer `layer`'s
    mixer hooks that have a head axis, measured by one forward."""
    _, cache = model.run_with_cache(torch.zeros(1, 5, dtype=torch.long))
    shapes = set()
    for name, point in model.hook_dict.items():
        axes = (getattr(point, "axes", None) or "").split()
        if name.startswith(f"blocks.{layer}.mixer.") and "head" in axes:
            shape = cache[name].shape
            width = next((shape[axes.index(a)] for a in ("d_head", "headdim") if a in axes), None)
            shapes.add((shape[axes.index("head")], width))
    return shapes


@pytest.mark.parametrize("mixer", sorted(REGISTRY))
def test_n_heads_and_d_head_are_what_the_head_hooks_show(ar_task, mixer):
    """Layer 0 with non-default head options, layer 1 with the defaults; mixers without head
    hooks count as one head of width d_model."""
    model = make_model(ar_task, mixers=mixer, d_model=16, layer_options=[HEAD_OPTIONS.get(mixer, {}), {}])
    for layer in range(2):
        n_heads, d_head = model.cfg.head_shape(layer)
        shapes = head_hook_shapes(model, layer)
        if mixer in HEAD_OPTIONS:
            assert {heads for heads, _ in shapes} == {n_heads}, shapes
            assert {width for _, width in shapes} - {None} == {d_head}, shapes
        else:
            assert not shapes and (n_heads, d_head) == (1, 16)
    assert (model.cfg.n_heads, model.cfg.d_head) == model.cfg.head_shape(0)
    if mixer in HEAD_OPTIONS:
        assert model.cfg.head_shape(0) != model.cfg.head_shape(1)  # the options were read


def test_mixed_model_reports_layer_0_and_each_layer_on_request():
    """The `based` preset alternates baseconv (no heads) and based: cfg.n_heads is layer 0's."""
    task = hookmech.tasks.make("mqar", vocab_size=64, num_kv_pairs=4, seq_len=24)
    mixers, options = expand_preset("based", 2)
    options[1] = {**options[1], "num_heads": 2, "num_key_value_heads": 2}
    model = hookmech.HookedLM(build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=mixers, layer_options=options,
                                           d_model=16, n_layers=2)).eval()
    assert model.cfg.mixers == ("baseconv", "based")
    assert (model.cfg.n_heads, model.cfg.d_head) == (1, 16) and not head_hook_shapes(model, 0)
    shapes = head_hook_shapes(model, 1)
    assert model.cfg.head_shape(1) == (2, 8)
    assert {heads for heads, _ in shapes} == {2} and {width for _, width in shapes} - {None} == {8}
    with pytest.raises(UsageError, match="layer must be in 0..1"):
        model.cfg.head_shape(2)


def test_device_is_the_parameters_device_and_follows_the_model(ar_model):
    assert ar_model.cfg.device == ar_model.embed.weight.device == torch.device("cpu")
    moved = copy.deepcopy(ar_model).to("meta")
    assert moved.cfg.device == torch.device("meta") and ar_model.cfg.device == torch.device("cpu")
    unpickled = pickle.loads(pickle.dumps(ar_model))
    assert unpickled.cfg.device == torch.device("cpu") and unpickled.cfg == ar_model.cfg
    ar_model.to("meta")
    assert ar_model.cfg.device == torch.device("meta")


def test_derived_values_are_never_serialised_compared_or_shared(tmp_path, ar_model, ar_task):
    cfg = ar_model.cfg
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    # every field but those added later, which a config at their defaults leaves out (`init` "normal", ...:
    # configs from before them keep their bytes)
    later = set(LATER_FIELD_DEFAULTS)
    assert set(json.loads(cfg.to_json())) == fields - later and not fields & {"n_heads", "d_head", "device"}
    rebuilt = ModelConfig.from_json(cfg.to_json())
    assert rebuilt == cfg and cfg == rebuilt and rebuilt.n_heads == cfg.n_heads
    # a config no model holds has no device: a UsageError that getattr/hasattr read as "none"
    assert getattr(rebuilt, "device", None) is None and not hasattr(rebuilt, "device")
    with pytest.raises(NoModelError, match="belongs to no model"):
        rebuilt.device
    assert issubclass(NoModelError, UsageError)
    # the config a model is built from stays free: two models of one config have their own devices
    first, second = hookmech.HookedLM(rebuilt), hookmech.HookedLM(rebuilt)
    second.to("meta")
    assert (first.cfg.device.type, second.cfg.device.type) == ("cpu", "meta") and not hasattr(rebuilt, "device")
    # checkpoints: the same metadata as the config's JSON, loaded back equal and held by the loaded model
    path = hookmech.save(ar_model, tmp_path / "m.safetensors", task_spec=ar_task.spec)
    assert hookmech.checkpoint.read_metadata(path)["config"] == cfg
    loaded = hookmech.load(path)
    assert loaded.cfg == cfg and loaded.cfg.device == torch.device("cpu")


# -- the hook_attn_out alias ------------------------------------------------------------------
def test_alias_is_no_hook_of_its_own(ar_model):
    attn_out = {f"blocks.{l}.hook_attn_out": f"blocks.{l}.hook_mixer_out" for l in range(2)}
    assert attn_out.items() <= ar_model.hook_aliases.items()  # with TL's attn.hook_* names (test_transformer_lens_analysis)
    assert not any("attn_out" in name for name in ar_model.hook_dict)
    assert len({id(point) for point in ar_model.hook_dict.values()}) == len(ar_model.hook_dict)
    assert not any("attn_out" in hook for hook in resolve_sites(["all"], ar_model.hook_dict))
    assert ar_model.mod_dict["blocks.1.hook_attn_out"] is ar_model.hook_dict["blocks.1.hook_mixer_out"]
    mamba = make_model(hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3), mixers="mamba")
    assert set(mamba.hook_aliases) == {f"blocks.{l}.{name}" for l in range(2) for name in ("hook_attn_out", "mixer.hook_ssm_out")}


def test_alias_fires_once_as_the_hook_it_names(ar_model, ar_task):
    tokens = ar_task.sample(3, seed=5).tokens
    seen = []
    ar_model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_attn_out", lambda act, hook: seen.append((hook.name, act)))])
    _, cache = ar_model.run_with_cache(tokens)
    assert [name for name, _ in seen] == ["blocks.1.hook_mixer_out"]
    torch.testing.assert_close(seen[0][1], cache["blocks.1.hook_mixer_out"], rtol=0, atol=0)  # the same forward
    assert cache["blocks.1.hook_attn_out"] is cache["blocks.1.hook_mixer_out"] and "blocks.1.hook_attn_out" in cache
    assert len(cache) == len(ar_model.hook_dict) and "blocks.1.hook_attn_out" not in cache.keys()
    _, only = ar_model.run_with_cache(tokens, names_filter="blocks.1.hook_attn_out")
    assert list(only.keys()) == ["blocks.1.hook_mixer_out"]
    _, listed = ar_model.run_with_cache(tokens, names_filter=["blocks.0.hook_attn_out", "blocks.0.hook_mlp_out"])
    assert set(listed.keys()) == {"blocks.0.hook_mixer_out", "blocks.0.hook_mlp_out"}
    # a zeroing hook under the alias is a zeroing hook on hook_mixer_out
    zeroed = ar_model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_attn_out", lambda act, hook: act * 0)])
    expected = ar_model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_mixer_out", lambda act, hook: act * 0)])
    torch.testing.assert_close(zeroed, expected, rtol=0, atol=0)  # the same computation
