"""`ModelConfig.init`: hookmech's N(0, 0.02) scheme ("normal") and mamba-ssm's ("mamba", which
zoology's `_init_weights` draws for Mamba blocks and so the paper's code ran), recorded in the
checkpoint's config; configs written before the field existed keep their JSON and model_hash."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import assert_same_init

from hookmech.checkpoint import load, save
from hookmech.config import ModelConfig, build_config
from hookmech.errors import UsageError
from hookmech.identity import model_hash
from hookmech.model import HookedLM


def mamba_config(init: str | None = None, n_layers: int = 2) -> ModelConfig:
    return build_config(d_vocab=32, n_ctx=24, mixers="mamba", d_model=16, n_layers=n_layers, init=init)


def drawn(config: ModelConfig, seed: int = 0, initialise: bool = True) -> dict[str, torch.Tensor]:
    """The model's parameters after construction with `seed`; without `initialise`, as each
    module's own constructor drew them (PyTorch's defaults, mamba-ssm's dt init)."""
    torch.manual_seed(seed)
    if initialise:
        return dict(HookedLM(config).named_parameters())
    original = HookedLM._initialise
    HookedLM._initialise = lambda self: None  # type: ignore[method-assign]
    try:
        return dict(HookedLM(config).named_parameters())
    finally:
        HookedLM._initialise = original  # type: ignore[method-assign]


def test_seeded_mamba_init_draws_what_it_drew_when_added():
    # recorded when the option was added (torch's CPU generator, seed 0), as the "normal" inits
    # are in test_paper_config
    torch.manual_seed(0)
    assert_same_init(HookedLM(mamba_config("mamba")).state_dict(), "init-mamba:mamba")


def test_mamba_init_keeps_the_constructors_linear_weights():
    # mamba-ssm's _init_weights does not redraw Linear weights: in_proj, x_proj and dt_proj keep
    # what their constructors drew (an independent reference: the same model with no init pass)
    ours, constructed = drawn(mamba_config("mamba")), drawn(mamba_config("mamba"), initialise=False)
    for layer in range(2):
        for name in ("in_proj.weight", "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "conv1d.weight"):
            key = f"blocks.{layer}.mixer.{name}"
            assert torch.equal(ours[key], constructed[key]), key
        out_proj = f"blocks.{layer}.mixer.out_proj.weight"
        assert not torch.equal(ours[out_proj], constructed[out_proj])


def test_mamba_init_draws_out_proj_and_embeddings_as_mamba_ssm():
    n_layers = 3
    params = drawn(mamba_config("mamba", n_layers=n_layers), seed=1)
    d_inner = 32
    # Kaiming-uniform(a=sqrt(5)) on fan_in d_inner is U(-1/sqrt(fan_in), 1/sqrt(fan_in)); / sqrt(n_layers)
    bound = 1 / math.sqrt(d_inner) / math.sqrt(n_layers)
    for layer in range(n_layers):
        out = params[f"blocks.{layer}.mixer.out_proj.weight"]
        assert out.abs().max() <= bound and out.abs().max() > 0.9 * bound
        # dt_proj: mamba-ssm's own uniform init, std dt_rank^-0.5 (not N(0, 0.02))
        dt_rank = 1
        assert params[f"blocks.{layer}.mixer.dt_proj.weight"].abs().max() <= dt_rank**-0.5
    embed = params["embed.weight"]
    assert abs(embed.std().item() - 0.02) < 0.002  # 512 draws of N(0, 0.02): sd of the sd ~ 0.0006


def test_normal_init_is_unchanged_and_differs_from_mamba():
    normal, default = drawn(mamba_config("normal")), drawn(mamba_config())
    assert all(torch.equal(normal[k], default[k]) for k in normal)
    mamba = drawn(mamba_config("mamba"))
    assert normal["blocks.0.mixer.in_proj.weight"].std() < 0.5 * mamba["blocks.0.mixer.in_proj.weight"].std()


@pytest.mark.parametrize(
    ("mixers", "expected"),
    [
        ("mamba", "mamba"),
        (["mamba", "attention"], "normal"),
        ("attention", "normal"),
        ("mamba2", "normal"),
        (["baseconv", "based"], "normal-by-name"),
        ("h3", "normal-by-name"),
        (["baseconv", "hyena"], "normal"),
    ],
)
def test_zoology_init_follows_the_block_type(mixers, expected):
    config = build_config(d_vocab=32, n_ctx=24, mixers=mixers, d_model=16, n_layers=2, init="zoology")
    assert config.init == expected


def test_unknown_init_is_a_usage_error():
    with pytest.raises(UsageError, match="init"):
        mamba_config("xavier")
    with pytest.raises(UsageError, match="init"):
        ModelConfig.from_json(mamba_config().to_json().replace("{", '{"init": "zoology", ', 1))


def test_config_json_without_init_means_normal():
    config = mamba_config()
    assert "init" not in json.loads(config.to_json())  # written as before the field existed
    assert ModelConfig.from_json(config.to_json()) == config
    assert ModelConfig.from_json(config.to_json()).to_json() == config.to_json()


def test_init_is_recorded_in_the_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = HookedLM(mamba_config("mamba"))
    save(model, tmp_path / "model.safetensors", task_spec={"name": "ar", "vocab_size": 28, "num_kv_pairs": 2})
    loaded = load(tmp_path / "model.safetensors")
    assert loaded.cfg.init == "mamba" and model_hash(loaded) == model_hash(model)
    assert json.loads(loaded.cfg.to_json())["init"] == "mamba"


def test_old_fixture_checkpoints_load_as_normal():
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "mamba_ar_cpu.safetensors"
    model = load(fixture)
    assert model.cfg.init == "normal"
    assert model_hash(model) == "4eda9d885cc4ec583b63e84cde716136f77987141407506450e85b20791344eb"


# -- zoology's rescaling by parameter name ("normal-by-name") ----------------------------------
def based_config(init: str | None) -> ModelConfig:
    return build_config(d_vocab=40, n_ctx=24, mixers=["baseconv", "based"], d_model=64, n_layers=2, init=init)


def zoology_name(model: HookedLM, name: str) -> str:
    """Our parameter `name` as zoology names it: Based's output projection is its ``proj_o``
    (zoology/mixers/based.py @ 0a9c682); every other name we use is zoology's."""
    owner, _, leaf = name.rpartition(".")
    if owner.endswith("mixer.out_proj") and type(model.get_submodule(owner.rpartition(".")[0])).__name__ == "Based":
        return f"{owner.rpartition('.')[0]}.proj_o.{leaf}"
    return name


def zoology_init_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A second implementation of zoology's `_init_weights` (HazyResearch/zoology zoology/model.py
    @ 0cd64f8) on our module tree: every Linear and Embedding N(0, 0.02) with zero biases, in module
    order, then every parameter whose *zoology* name contains "out_proj.weight" or "fc2.weight"
    redrawn N(0, 0.02 / sqrt(2 n_layers)), in parameter order."""
    torch.manual_seed(seed)
    original = HookedLM._initialise
    HookedLM._initialise = lambda self: None  # type: ignore[method-assign]
    try:
        model = HookedLM(config)  # the constructors' draws, the generator where _initialise starts
    finally:
        HookedLM._initialise = original  # type: ignore[method-assign]
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    torch.nn.init.zeros_(module.bias)
        for name, param in model.named_parameters():
            theirs = zoology_name(model, name)
            if "out_proj.weight" in theirs or "fc2.weight" in theirs:
                torch.nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.n_layers))
    return dict(model.named_parameters())


def test_normal_by_name_draws_what_zoology_draws():
    ours = drawn(based_config("normal-by-name"), seed=3)
    reference = zoology_init_weights(based_config("normal-by-name"), seed=3)
    for name, value in reference.items():
        assert torch.equal(ours[name], value), name  # the same draws in the same order: bit-equal


def test_normal_by_name_leaves_based_proj_o_at_zoologys_scale():
    by_name, normal = drawn(based_config("normal-by-name")), drawn(based_config("normal"))
    # 4096 entries: the sample std is within ±4 % of the true one with overwhelming probability
    assert 0.0192 < by_name["blocks.1.mixer.out_proj.weight"].std() < 0.0208
    assert 0.0096 < normal["blocks.1.mixer.out_proj.weight"].std() < 0.0104
    for name in ("blocks.0.mlp.fc2.weight", "blocks.1.mlp.fc2.weight"):
        assert 0.0092 < by_name[name].std() < 0.0108, name  # still scaled: zoology finds fc2 by name
    redrawn_after = {"blocks.1.mixer.out_proj.weight", "blocks.1.mlp.fc2.weight"}  # the generator shifts
    for name in by_name.keys() - redrawn_after:
        assert torch.equal(by_name[name], normal[name]), name


def test_seeded_normal_by_name_init_draws_what_it_drew_when_added():
    torch.manual_seed(0)
    assert_same_init(HookedLM(based_config("normal-by-name")).state_dict(), "init-normal-by-name:based")


def test_normal_by_name_is_recorded_and_other_inits_keep_their_json():
    config = based_config("zoology")
    assert config.init == "normal-by-name"
    assert json.loads(config.to_json())["init"] == "normal-by-name"
    assert ModelConfig.from_json(config.to_json()) == config
    assert "init" not in json.loads(based_config(None).to_json())
