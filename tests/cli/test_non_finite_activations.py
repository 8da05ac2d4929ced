"""Finite weights whose activations overflow (the fixture's embedding scaled by 3e37) are refused by
every command that runs the model, naming the first hook where the activations stop being finite,
never printed as nan/null records or drawn as a page."""
from __future__ import annotations

import pytest
import torch
from helpers import ATTENTION_FIXTURE, run_cli

import hookmech
from hookmech.validate import first_non_finite


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """(checkpoint path, the first hook whose activations are not finite, found with run_with_cache)."""
    model = hookmech.load(ATTENTION_FIXTURE)
    with torch.no_grad():
        model.embed.weight.mul_(3e37)
    assert torch.isfinite(model.embed.weight).all()
    task = hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)
    path = hookmech.save(model, tmp_path_factory.mktemp("big") / "big.safetensors", task.spec)
    # every hook, cached by TransformerLens in the order they fire
    _, acts = model.run_with_cache(task.sample(1, seed=0).tokens, return_cache_object=False)
    first = next(hook for hook, value in acts.items() if first_non_finite(value, "attn_scores" in hook) is not None)
    return path, first


PATCH = ["patch", "--site", "L1.block_in", "--pos", "value", "--n", "4"]
COMMANDS = {
    "patch-exact": PATCH,
    "patch-atp": [*PATCH, "--method", "atp"],
    "patch-atp-star": [*PATCH, "--method", "atp-star"],
    "path-patch": ["patch", "--sender", "L0.block_out@key", "--receiver", "L1.block_in@key", "--via", "resid",
                   "--n", "4"],
    "view": ["view", "--n", "4", "--maps", "1", "-o", "{tmp}/v.html"],
    "cache": ["cache", "--n", "4", "-o", "{tmp}/c.h5"],
}


@pytest.mark.parametrize("argv", COMMANDS.values(), ids=COMMANDS.keys())
def test_overflowing_activations_are_refused_naming_the_first_hook(argv, overflowing, tmp_path, capsys):
    checkpoint, first = overflowing
    code, out, err = run_cli([*(arg.format(tmp=tmp_path) for arg in argv), "--ckpt", checkpoint], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and out == "", err
    assert first == "blocks.0.hook_mixer_in"  # the LayerNorm before the first mixer squares ~1e36
    assert f"the clean run's activations are not finite at row 0: L0.mixer_in ({first}) is the first hook" in err
    assert list(tmp_path.iterdir()) == []
