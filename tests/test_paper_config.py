"""Paper 000's own AR configuration: every mixer takes zoology's `bias`, the defaults still build
the very same parameters, and the ``ar-paper-d64`` presets build the paper's models."""
from __future__ import annotations


import pytest
import torch

from hookmech.config import build_config
from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY, SPECS
from hookmech.model import HookedLM
from hookmech.model_presets import MODEL_PRESETS, expand_preset
from hookmech.sweep import build_run, expand, load_preset

from helpers import assert_same_init, default_mixer_state, default_model_state

PAPER_ARCHS = ["attention", "based", "mamba", "h3", "hyena", "baseconv"]


# Recorded in tests/data/init_fingerprints.json from the code before `bias` existed on every
# mixer (torch's CPU generator, seed 0), re-recorded at 8313c07 (where these tests passed) when the
# 16-hex digests gave way to fingerprints: the default options must keep drawing the same values,
# so that existing checkpoints and seeded results mean the same; the "model:*" entries are whole
# models, the 1/sqrt(2L) scaling of the output projections included, and "ar-paper-d64-pe:*" the
# ``ar-paper-d64-pe`` models (d_model 64, bias false, learned positions, vocab 8192), which were
# the ``ar-paper-d64`` preset then.


# A mixer added later is recorded by ``python scripts/record_init_fingerprints.py`` (new keys only).
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_default_mixer_init_is_bit_identical(name):
    assert_same_init(default_mixer_state(name), name)


@pytest.mark.parametrize("arch", sorted(MODEL_PRESETS))
def test_default_model_init_is_bit_identical(arch):
    assert_same_init(default_model_state(arch), f"model:{arch}")


@pytest.mark.parametrize("arch", PAPER_ARCHS)
def test_paper_d64_model_init_is_bit_identical(arch):
    run = next(run for run in expand(load_preset("ar-paper-d64-pe")) if run.point["arch"] == arch)
    _, config, _ = build_run(run.as_dict())
    torch.manual_seed(0)
    assert_same_init(HookedLM(config).state_dict(), f"ar-paper-d64-pe:{arch}")


def _bias_params(module: torch.nn.Module) -> set[str]:
    return {name for name, _ in module.named_parameters() if name.endswith("bias")}


# zoology's / mamba-ssm's `bias` per mixer (paper 000's code passes bias=False to each): the
# biases that go with bias=False, and those that stay.
ZOOLOGY_BIAS = {
    # MHA(bias): Wqkv only; out_proj always has one
    "attention": ({"Wqkv.bias"}, {"out_proj.bias"}),
    # Hyena(bias): the filter bias D only (a parameter, not named *bias here)
    "hyena": (set(), {"in_proj.bias", "out_proj.bias", "short_filter.bias"}),
    # mamba_ssm Mamba(bias): in_proj and out_proj; conv_bias and dt_proj's bias are separate
    "mamba": ({"in_proj.bias", "out_proj.bias"}, {"conv1d.bias", "dt_proj.bias"}),
    "mamba2": ({"in_proj.bias", "out_proj.bias"}, {"conv1d.bias"}),
    # BaseConv, H3, Based: zoology takes bias into **kwargs and ignores it
    "baseconv": (set(), {"projection.bias", "conv.bias"}),
    "h3": (set(), {"q_proj.bias", "k_proj.bias", "v_proj.bias", "out_proj.bias"}),
    "based": (set(), set()),
}


@pytest.mark.parametrize("name", sorted(ZOOLOGY_BIAS))
def test_bias_means_what_zoology_means(name):
    removed, kept = ZOOLOGY_BIAS[name]
    with_bias = _bias_params(REGISTRY[name](d_model=16, bias=True))
    without = _bias_params(REGISTRY[name](d_model=16, bias=False))
    assert removed <= with_bias and not removed & without
    assert kept <= without and kept <= with_bias
    assert with_bias - without == removed


def test_hyena_bias_is_the_filter_bias():
    assert REGISTRY["hyena"](d_model=8, l_max=16).D is None
    assert REGISTRY["hyena"](d_model=8, l_max=16, bias=False).D is None
    assert REGISTRY["hyena"](d_model=8, l_max=16, bias=True).D.shape == (8,)
    assert REGISTRY["hyena"](d_model=8, l_max=16, filter_bias=True).D.shape == (8,)


def test_attention_out_bias():
    mixer = REGISTRY["attention"](d_model=16, bias=False, out_bias=False)
    assert _bias_params(mixer) == set()


@pytest.mark.parametrize("name", ["deltanet", "rwkv"])
def test_bias_adds_projection_biases_where_the_reference_has_none(name):
    assert _bias_params(REGISTRY[name](d_model=16, bias=False)) == _bias_params(REGISTRY[name](d_model=16))
    mixer = REGISTRY[name](d_model=16, bias=True)
    added = _bias_params(mixer) - _bias_params(REGISTRY[name](d_model=16))
    assert added and all(n.endswith(("proj.bias", "receptance.bias", "key.bias", "value.bias", "gate.bias"))
                         for n in added)
    torch.manual_seed(1)
    assert mixer(torch.randn(2, 5, 16)).shape == (2, 5, 16)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_model_wide_bias_reaches_every_mixer(name):
    for value in (False, True):
        config = build_config(d_vocab=16, n_ctx=12, mixers=name, d_model=16, n_layers=2,
                              layer_options=[{"bias": value}, {"bias": value}])
        assert all(options["bias"] is value for options in config.mixer_kwargs)
    with pytest.raises(UsageError, match="bias"):
        build_config(d_vocab=16, n_ctx=12, mixers=name, d_model=16, n_layers=1, layer_options=[{"bias": "no"}])


# -- the presets ---------------------------------------------------------------------------------
def test_paper_d64_presets_expand_to_the_expected_runs():
    full, pilot = expand(load_preset("ar-paper-d64")), expand(load_preset("ar-paper-d64-pilot"))
    assert [run.point["arch"] for run in full][::3] == PAPER_ARCHS
    assert [run.point["lr"] for run in full[:3]] == [1e-3, 3e-3, 1e-2]
    assert [run.point["lr"] for run in pilot[:3]] == [3e-4, 1e-3, 3e-3]
    assert len(full) == len(pilot) == 18
    assert not {run.run_id for run in full} & {run.run_id for run in pilot}
    for run in full + pilot:
        assert run.task == {"name": "ar", "vocab_size": 8192, "num_kv_pairs": 16}
        assert run.mech["sites"] == ["L1.block_in"] and run.mech["positions"] == ["key", "value", "query"]
        assert run.mech["n"] == 320
    _, _, train = build_run(full[0].as_dict())
    assert (train.total_steps(), train.steps_per_epoch(), train.batch_size, train.warmup_frac) == (50016, 3126, 32, 0.1)
    _, _, train = build_run(pilot[0].as_dict())
    assert (train.total_steps(), train.warmup_frac, train.eval_every) == (5000, 0.1, 5000)


@pytest.mark.parametrize("arch", PAPER_ARCHS)
def test_paper_d64_positions_and_init_as_in_the_papers_table(arch):
    # tinylang experiments/README.md: ar_32 (learned positions) for attention, ar_32_nope for the
    # rest; zoology's _init_weights draws mamba-ssm's scheme for Mamba blocks only, and finds the
    # output projections to scale by name, which misses Based's proj_o
    expected = {"mamba": "mamba", "based": "normal-by-name", "h3": "normal-by-name"}.get(arch, "normal")
    for preset in ("ar-paper-d64", "ar-paper-d64-pilot", "ar-paper", "atr-paper-d64"):
        runs = [run for run in expand(load_preset(preset)) if run.point["arch"] == arch]
        if not runs:
            continue  # atr-paper-d64 runs three of the six
        _, config, _ = build_run(runs[0].as_dict())
        assert config.pos_emb == ("learned" if arch == "attention" else "none"), preset
        assert config.init == expected, preset
    run = next(run for run in expand(load_preset("ar-paper-d64-pe")) if run.point["arch"] == arch)
    _, config, _ = build_run(run.as_dict())
    assert (config.pos_emb, config.init) == ("learned", "normal")


@pytest.mark.parametrize("arch", ["attention", "based", "mamba"])
def test_atr_paper_d64_is_the_ar_model_on_easy_atr(arch):
    # tinylang pcfg_easy(_nope) keep ar_32(_nope)'s model block and change the language and the
    # epochs: the same models, the task's defaults (L_max 5, |Σ| 20), 32 epochs of 3126 steps
    atr = next(run for run in expand(load_preset("atr-paper-d64")) if run.point["arch"] == arch)
    ar = next(run for run in expand(load_preset("ar-paper-d64")) if run.point["arch"] == arch)
    assert atr.task == {"name": "atr"}
    task, atr_config, train = build_run(atr.as_dict())
    _, ar_config, _ = build_run(ar.as_dict())
    assert (task.num_terminals, task.max_rhs_len) == (20, 5)
    assert (train.total_steps(), train.steps_per_epoch()) == (32 * 3126, 3126)
    same = ("d_model", "n_layers", "mixers", "mixer_kwargs", "mlp", "norms", "pos_emb", "init", "tie_embeddings")
    assert {key: getattr(atr_config, key) for key in same} == {key: getattr(ar_config, key) for key in same}
    assert atr_config.pos_emb == ("learned" if arch == "attention" else "none")


@pytest.mark.parametrize("preset", ["ar-paper-d64", "ar-paper-d64-pe"])
@pytest.mark.parametrize("arch", PAPER_ARCHS)
def test_paper_d64_models_have_the_papers_biases(arch, preset):
    run = next(run for run in expand(load_preset(preset)) if run.point["arch"] == arch)
    task, config, _ = build_run(run.as_dict())
    assert config.tie_embeddings
    assert (config.d_model, config.n_layers) == (64, 2)
    assert all(options["bias"] is False for options in config.mixer_kwargs)
    model = HookedLM(config)
    if config.pos_emb == "learned":
        assert model.pos_embed.weight.shape == (task.n_ctx, 64)
    else:
        assert not hasattr(model, "pos_embed")
    assert model.cfg.mlp == ((False, False) if arch == "mamba" else (True, True))
    for name, block in zip(config.mixers, model.blocks, strict=True):
        mixer = block.mixer
        if "l_max" in mixer.__init__.__code__.co_varnames:
            assert mixer.l_max == 1024  # tinylang's n_positions
        biases = _bias_params(mixer)
        if name == "attention":
            assert mixer.Wqkv.bias is None and mixer.out_proj.bias is not None
        elif name == "hyena":
            assert mixer.D is None and {"in_proj.bias", "out_proj.bias"} <= biases
            assert isinstance(mixer.filter_fn.z, torch.nn.Parameter)  # trained, as in tinylang
            assert mixer.short_filter.bias.abs().max() > 0  # nn.Conv1d's bias init
        elif name == "mamba":
            assert mixer.in_proj.bias is None and mixer.out_proj.bias is None
        elif name == "based":
            assert biases == set()
        elif name == "baseconv":
            assert "projection.bias" in biases
            if mixer.kernel_size > 0:
                assert mixer.conv.bias.abs().max() > 0  # nn.Conv1d's bias init
        elif name == "h3":
            assert mixer.ssm_k_kernel.d_state == 1024 and "out_proj.bias" in biases
    assert [name for name in config.mixers] == expand_preset(arch, 2)[0]


def test_short_conv_can_start_as_torch_conv1d():
    from hookmech.mixers.short_conv import ShortConv

    torch.manual_seed(3)
    ours = ShortConv(8, 3, torch_bias_init=True)
    torch.manual_seed(3)
    reference = torch.nn.Conv1d(8, 8, 3, groups=8)
    assert torch.equal(ours.weight, reference.weight) and torch.equal(ours.bias, reference.bias)
    assert torch.count_nonzero(ShortConv(8, 3).bias) == 0
    for name in ("hyena", "baseconv"):
        with pytest.raises(UsageError, match="conv_bias_init"):
            REGISTRY[name](d_model=8, l_max=16, conv_bias_init="kaiming")


def test_hyena_can_train_its_filter_input():
    mixer = REGISTRY["hyena"](d_model=8, l_max=16, train_filter_z=True)
    assert "filter_fn.z" in mixer.state_dict()
    mixer(torch.randn(2, 5, 8)).sum().backward()
    assert mixer.filter_fn.z.grad.abs().sum() > 0
    assert "filter_fn.z" not in REGISTRY["hyena"](d_model=8, l_max=16).state_dict()


def test_paper_hyena_model_round_trips_through_a_checkpoint(tmp_path):
    from hookmech.checkpoint import load, save

    run = next(run for run in expand(load_preset("ar-paper-d64-pilot")) if run.point["arch"] == "hyena")
    task, config, _ = build_run(run.as_dict())
    torch.manual_seed(0)
    model = HookedLM(config)
    with torch.no_grad():
        model.blocks[0].mixer.filter_fn.z.add_(0.5)  # a trained z must come back
    save(model, tmp_path / "model.safetensors", task_spec=task.spec)
    loaded = load(tmp_path / "model.safetensors")
    tokens = task.sample(4, seed=0).tokens
    assert torch.equal(loaded.blocks[0].mixer.filter_fn.z, model.blocks[0].mixer.filter_fn.z)
    assert torch.allclose(loaded(tokens), model(tokens))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_mixers_declare_their_output_projections(name):
    """The backbone scales what a mixer declares; a declared name is a linear layer of the mixer,
    and a layer called out_proj that is not declared would silently keep the unscaled init."""
    options = {"l_max": 64} if "l_max" in REGISTRY[name].__init__.__code__.co_varnames else {}
    mixer = REGISTRY[name](d_model=16, **options)
    for projection in SPECS[name].output_projections:
        assert isinstance(getattr(mixer, projection), torch.nn.Linear), projection
    named = {module_name for module_name, _ in mixer.named_modules() if module_name.endswith("out_proj")}
    assert named <= set(SPECS[name].output_projections)


def test_the_backbone_scales_exactly_the_declared_projections():
    mixers, options = expand_preset("based", 2)
    model = HookedLM(build_config(d_vocab=32, n_ctx=24, mixers=mixers, d_model=16, n_layers=2, layer_options=options))
    assert model.blocks[0].output_projection_weights() == ["mlp.fc2.weight"]  # BaseConv declares none
    assert model.blocks[1].output_projection_weights() == ["mixer.out_proj.weight", "mlp.fc2.weight"]
