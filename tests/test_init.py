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
    [("mamba", "mamba"), (["mamba", "attention"], "normal"), ("attention", "normal"), ("mamba2", "normal")],
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
