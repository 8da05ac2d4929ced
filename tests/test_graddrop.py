"""AtP*'s backward passes (`hookmech.patching.graddrop.GradientPasses`): the full pass and each
GradDrop pass, started part-way down the model, against backward passes from the metric with the
dropped layer's sublayer inputs detached in the forward (GradDrop as Kramár et al. define it)."""

from __future__ import annotations

import pytest
import torch
from helpers import FLOAT64_SUM_TOL, make_model, unit_variance

from hookmech.errors import HookmechError
from hookmech.hooks import gradients_follow_edits
from hookmech.patching.atp_star import answer_log_odds
from hookmech.patching.graddrop import GradientPasses, relative_place

N_LAYERS = 3


def _forward(model, batch, hooks, fwd_hooks, leaves, outputs=None):
    """λ summed over rows of a corrupt forward with a zero leaf added at each of `hooks` (after
    `fwd_hooks`), recording each hook's returned tensor in `outputs`."""

    def add_leaf(name):
        def add(activation, hook=None):
            if name in hooks:
                leaves[name] = torch.zeros_like(activation, requires_grad=True)
                activation = activation + leaves[name]
            if outputs is not None:
                outputs[name] = activation
            return activation

        return add

    names = list(dict.fromkeys([*hooks, *(outputs or {})]))
    logits = model.run_with_hooks(
        batch.corrupt_tokens,
        positions=batch.query_pos,
        tail_at_positions=True,
        fwd_hooks=[*fwd_hooks, *((name, add_leaf(name)) for name in names)],
    )
    return answer_log_odds(logits, batch.answers).sum()


def _detached(model, batch, hooks, dropped):
    """The reference: ∂λ/∂(each hook) by one backward pass from λ, with block `dropped`'s mixer and
    MLP inputs detached in the forward (None: nothing detached); a leaf at the same hook comes
    after the detach, so it still sees the sublayer's gradient."""
    detach = []
    if dropped is not None:
        names = (f"blocks.{dropped}.hook_mixer_in", f"blocks.{dropped}.hook_mlp_in")
        present = [name for name in names if name in model.hook_dict]
        detach = [(name, lambda activation, hook=None: activation.detach()) for name in present]
    leaves = {}
    with torch.enable_grad(), gradients_follow_edits([model.hook_dict[hook] for hook in hooks]):
        objective = _forward(model, batch, hooks, detach, leaves)
        found = torch.autograd.grad(objective, [leaves[hook] for hook in hooks], allow_unused=True)
    return {hook: torch.zeros_like(leaves[hook]) if g is None else g for hook, g in zip(hooks, found, strict=True)}


def _passes(model, batch, hooks):
    """The variants of `GradientPasses` at `hooks`, with every block dropped in turn."""
    names = ("hook_resid_pre", "hook_mixer_out")
    seeds = {f"blocks.{layer}.{name}": None for layer in range(N_LAYERS) for name in names}
    last_out = f"blocks.{N_LAYERS - 1}.hook_resid_post"
    at_query = torch.arange(len(batch)), batch.query_pos
    final = _detached(model, batch, [last_out], None)[last_out][at_query][:, None]
    leaves, outputs = {}, dict(seeds)
    with torch.enable_grad(), gradients_follow_edits([model.hook_dict[hook] for hook in hooks]):
        objective = _forward(model, batch, hooks, [], leaves, outputs)
        passes = GradientPasses(model, objective, leaves, outputs, range(N_LAYERS), lambda: final, batch.query_pos)
        return passes.gradients(hooks)


TAIL = ("resid_mid", "mlp_in", "mlp_out", "resid_post")


@pytest.mark.parametrize("mixers", ["attention", "mamba", "based", "h3", "mamba,attention,rwkv"])
@pytest.mark.parametrize("mlp", [True, False])
@pytest.mark.parametrize("tail", ["hooked", "at the query"])
def test_graddrop_passes_equal_detached_backward_passes(ar_task, mixers, mlp, tail):
    """Every hook of a 3-layer model (the embeddings, every block-level hook, every hook inside the
    mixers, a recurrent state's gradient following its recurrence), with the last block's MLP and
    the final norm hooked (the tail runs on every position) or not (it runs at the query alone)."""
    layers = mixers.split(",")
    model = unit_variance(make_model(ar_task, mixers=layers if len(layers) > 1 else mixers, n_layers=N_LAYERS, mlp=mlp))
    model = model.double()
    batch = ar_task.sample(6, seed=3)
    last = N_LAYERS - 1
    skipped = set()
    if tail != "hooked":
        skipped = {f"blocks.{last}.hook_{name}" for name in TAIL} | {"ln_final.hook_normalized"}
    hooks = [hook for hook in model.hook_dict if hook not in skipped]
    got = _passes(model, batch, hooks)
    assert set(got) == {None, *range(N_LAYERS)}
    moved = 0
    for dropped in got:
        expected = _detached(model, batch, hooks, dropped)
        for hook in hooks:
            # float64; the passes sum the same products in other orders (the last block's g* is a separate backward)
            torch.testing.assert_close(got[dropped][hook], expected[hook], atol=FLOAT64_SUM_TOL, rtol=0, msg=hook)
            if dropped is not None:
                moved += (got[dropped][hook] - got[None][hook]).abs().max().item() > 1e-3
    assert moved >= 3 * N_LAYERS  # dropping a layer changes gradients: the comparison can fail


def test_relative_place_of_the_block_hooks(ar_task):
    model = make_model(ar_task, n_layers=N_LAYERS)
    places = {
        "hook_embed": "below",
        "blocks.0.hook_resid_post": "below",
        "blocks.1.hook_resid_pre": "skip",
        "blocks.1.hook_mixer_in": "mixer",
        "blocks.1.mixer.hook_q": "mixer",
        "blocks.1.hook_mixer_out": "skip",
        "blocks.1.hook_resid_mid": "skip",
        "blocks.1.hook_mlp_in": "full",
        "blocks.1.hook_mlp_out": "full",
        "blocks.1.hook_resid_post": "skip",
        "blocks.2.mixer.hook_k": "full",
        "ln_final.hook_normalized": "full",
    }
    assert {hook: relative_place(model, hook, 1) for hook in places} == places
    with pytest.raises(HookmechError, match="GradDrop cannot place hook 'blocks.1.hook_custom' in block 1"):
        relative_place(model, "blocks.1.hook_custom", 1)
