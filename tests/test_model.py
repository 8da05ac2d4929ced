"""The backbone: hook names and shapes, TransformerLens semantics, resume-at-layer, causality."""
from __future__ import annotations

import pytest
import torch
from transformer_lens import ActivationCache, HookedRootModule

from hookmech.config import ModelConfig, build_config
from hookmech.errors import UsageError

from helpers import FLOAT64_SUM_TOL, make_model

BLOCK_HOOKS = ["hook_resid_pre", "hook_mixer_in", "hook_mixer_out", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out", "hook_resid_post"]
ATTENTION_HOOKS = ["q", "k", "v", "attn_scores", "pattern", "z"]


def test_model_is_a_hooked_root_module_with_every_named_hook(ar_model):
    assert isinstance(ar_model, HookedRootModule)
    names = set(ar_model.hook_dict)
    for layer in range(2):
        for hook in BLOCK_HOOKS:
            assert f"blocks.{layer}.{hook}" in names
        for hook in ATTENTION_HOOKS:
            assert f"blocks.{layer}.mixer.hook_{hook}" in names
    assert {"hook_embed", "hook_pos_embed", "ln_final.hook_normalized"} <= names
    assert (ar_model.cfg.n_layers, ar_model.cfg.d_model, ar_model.cfg.d_vocab) == (2, 32, 19)


def test_hook_shapes(ar_model, ar_task):
    tokens = ar_task.sample(5, seed=0).tokens
    n_pos = tokens.shape[1]
    _, cache = ar_model.run_with_cache(tokens)
    assert isinstance(cache, ActivationCache)
    assert cache["blocks.1.hook_resid_pre"].shape == (5, n_pos, 32)
    assert cache["blocks.0.mixer.hook_q"].shape == (5, n_pos, 1, 32)
    assert cache["blocks.0.mixer.hook_pattern"].shape == (5, 1, n_pos, n_pos)
    assert cache["blocks.1.mixer.hook_z"].shape == (5, n_pos, 1, 32)


def test_residual_stream_adds_up(ar_model, ar_task):
    """resid_post = resid_pre + mixer_out + mlp_out, and resid_pre(l+1) = resid_post(l)."""
    _, cache = ar_model.run_with_cache(ar_task.sample(4, seed=1).tokens)
    for layer in range(2):
        total = cache[f"blocks.{layer}.hook_resid_pre"] + cache[f"blocks.{layer}.hook_mixer_out"] + cache[f"blocks.{layer}.hook_mlp_out"]
        # the model's own additions in the same order: exact (torch's fp32 defaults would allow round-off)
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_resid_post"], total, rtol=0, atol=0)
    torch.testing.assert_close(cache["blocks.1.hook_resid_pre"], cache["blocks.0.hook_resid_post"], rtol=0, atol=0)


def test_run_with_hooks_edits_and_removes_hooks(ar_model, ar_task):
    tokens = ar_task.sample(3, seed=2).tokens
    plain = ar_model(tokens)
    zeroed = ar_model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_mixer_out", lambda act, hook: act * 0)])
    assert not torch.allclose(plain, zeroed)
    assert all(not point.fwd_hooks for point in ar_model.hook_points())
    torch.testing.assert_close(ar_model(tokens), plain, rtol=0, atol=0)  # the same forward again: exact


def test_hooks_context_manager_is_temporary(ar_model, ar_task):
    tokens = ar_task.sample(3, seed=2).tokens
    seen = []
    with ar_model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda act, hook: seen.append(hook.name))]):
        ar_model(tokens)
    ar_model(tokens)
    assert seen == ["blocks.0.hook_resid_pre"]


def test_patching_mixer_in_never_changes_the_residual_stream(ar_model, ar_task):
    tokens = ar_task.sample(3, seed=3).tokens
    _, clean = ar_model.run_with_cache(tokens)
    names = ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_mid", "blocks.0.hook_mixer_in"]
    with ar_model.hooks(fwd_hooks=[("blocks.0.hook_mixer_in", lambda act, hook: act + 10.0)]):
        _, patched = ar_model.run_with_cache(tokens, names_filter=names, reset_hooks_end=False)
    ar_model.reset_hooks()
    torch.testing.assert_close(patched["blocks.0.hook_resid_pre"], clean["blocks.0.hook_resid_pre"], rtol=0, atol=0)
    # the mixer saw the edit, the residual entering the mixer's add did not
    assert not torch.allclose(patched["blocks.0.hook_resid_mid"], clean["blocks.0.hook_resid_mid"])
    # (r + m) - r vs m: fp32 round-off of the addition, within torch's float32 defaults
    torch.testing.assert_close(
        patched["blocks.0.hook_resid_mid"] - patched["blocks.0.hook_resid_pre"],
        ar_model.blocks[0].mixer(clean["blocks.0.hook_mixer_in"] + 10.0),
    )


def test_start_at_layer_and_positions_match_the_full_forward(ar_model, ar_task):
    batch = ar_task.sample(6, seed=4)
    full = ar_model(batch.tokens)
    rows = torch.arange(6)
    _, cache = ar_model.run_with_cache(batch.tokens)
    resumed = ar_model(cache["blocks.1.hook_resid_pre"], start_at_layer=1, positions=batch.query_pos)
    # the unembedding of the query rows alone vs of every position: fp32 round-off, torch's float32 defaults
    torch.testing.assert_close(resumed, full[rows, batch.query_pos])
    stopped = ar_model(batch.tokens, stop_at_layer=1)
    torch.testing.assert_close(stopped, cache["blocks.1.hook_resid_pre"], rtol=0, atol=0)  # the same layers: exact


@pytest.mark.parametrize("mixers", ["attention", "mamba"])
def test_tail_at_positions_is_the_full_forward_at_the_positions(ar_task, mixers):
    model = make_model(ar_task, mixers=mixers).double()
    batch = ar_task.sample(6, seed=4)
    rows = torch.arange(6)
    full = model(batch.tokens)[rows, batch.query_pos]
    # the same float64 computation on fewer rows: round-off only
    tail = model(batch.tokens, positions=batch.query_pos, tail_at_positions=True)
    torch.testing.assert_close(tail, full, rtol=0, atol=FLOAT64_SUM_TOL)
    final_in = model(batch.tokens, stop_at_layer=model.cfg.n_layers)
    resumed = model(final_in, start_at_layer=model.cfg.n_layers, positions=batch.query_pos, tail_at_positions=True)
    torch.testing.assert_close(resumed, full, rtol=0, atol=FLOAT64_SUM_TOL)


def test_tail_at_positions_runs_the_last_mlp_at_the_positions_unless_a_hook_there_is_in_use(ar_model, ar_task):
    batch = ar_task.sample(5, seed=2)
    seen = []
    ar_model.blocks[-1].mlp.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    try:
        ar_model(batch.tokens, positions=batch.query_pos, tail_at_positions=True)
        assert seen == [(5, 1, ar_model.cfg.d_model)]
        fired = []
        hooks = [("blocks.1.hook_mlp_out", lambda act, hook: fired.append(tuple(act.shape)))]
        ar_model.run_with_hooks(batch.tokens, positions=batch.query_pos, tail_at_positions=True, fwd_hooks=hooks)
        # a hook after the last mixer sees every position, as without the hint
        assert fired == [(5, batch.tokens.shape[1], ar_model.cfg.d_model)]
        assert seen[1] == (5, batch.tokens.shape[1], ar_model.cfg.d_model)
    finally:
        ar_model.blocks[-1].mlp._forward_hooks.clear()


def test_model_is_causal(ar_model, ar_task):
    tokens = ar_task.sample(4, seed=5).tokens
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 16
    # later tokens enter earlier positions only with weight 0: fp32 round-off at most (torch's defaults)
    torch.testing.assert_close(ar_model(tokens)[:, :6], ar_model(changed)[:, :6])
    assert not torch.allclose(ar_model(tokens)[:, 6:], ar_model(changed)[:, 6:])


def test_window_two_attends_to_current_and_previous_token_only(ar_task):
    model = make_model(ar_task, layer_options=[{"window": 2}, {}])
    _, cache = model.run_with_cache(ar_task.sample(2, seed=0).tokens)
    pattern = cache["blocks.0.mixer.hook_pattern"][0, 0]
    n_pos = pattern.shape[0]
    query, key = torch.meshgrid(torch.arange(n_pos), torch.arange(n_pos), indexing="ij")
    allowed = (key <= query) & (query - key < 2)
    assert torch.all(pattern[~allowed] == 0)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(n_pos))  # a softmax's sum: fp32 round-off
    assert torch.all(cache["blocks.1.mixer.hook_pattern"][0, 0][torch.tril(torch.ones(n_pos, n_pos, dtype=torch.bool))] > 0)


def test_qkv_conv_makes_k_depend_on_the_previous_token(ar_task):
    model = make_model(ar_task, layer_options=[{"qkv_conv": "k", "conv_size": 2}, {}])
    mixer = model.blocks[0].mixer
    x = torch.randn(1, 5, 32)
    changed = x.clone()
    changed[0, 2] += 1.0
    _, a = model.run_with_cache(x, start_at_layer=0, names_filter=["blocks.0.mixer.hook_k", "blocks.0.mixer.hook_q"])
    _, b = model.run_with_cache(changed, start_at_layer=0, names_filter=["blocks.0.mixer.hook_k", "blocks.0.mixer.hook_q"])
    k_diff = (a["blocks.0.mixer.hook_k"] - b["blocks.0.mixer.hook_k"]).abs().sum(dim=(0, 2, 3))
    q_diff = (a["blocks.0.mixer.hook_q"] - b["blocks.0.mixer.hook_q"]).abs().sum(dim=(0, 2, 3))
    assert k_diff[2] > 0 and k_diff[3] > 0 and k_diff[4] == 0 and k_diff[1] == 0  # kernel 2: positions 2 and 3
    assert q_diff[2] > 0 and q_diff[3] == 0
    assert "k" in mixer.convs and "q" not in mixer.convs


def test_initialisation_follows_zoology(ar_task):
    model = make_model(ar_task, d_model=64)
    std = model.blocks[0].mixer.Wqkv.weight.std().item()
    out_std = model.blocks[0].mixer.out_proj.weight.std().item()
    assert 0.017 < std < 0.023
    assert 0.8 * 0.01 < out_std < 1.2 * 0.01  # 0.02 / sqrt(2 * n_layers)
    assert torch.all(model.blocks[0].mixer.Wqkv.bias == 0)


def test_tied_and_untied_heads(ar_task):
    tied = make_model(ar_task)
    untied = make_model(ar_task, tie_embeddings=False)
    # a tied head has no weight of its own: its unembed reads the embedding (saved once, as embed.weight)
    assert not list(tied.unembed.parameters()) and "unembed.weight" in untied.state_dict()
    assert not any(name.startswith("unembed") for name in tied.state_dict())
    x = torch.randn(2, 32)
    torch.testing.assert_close(tied.unembed_resid(x), x @ tied.embed.weight.T, rtol=0, atol=0)  # the same product


def test_position_embedding_defaults(ar_task):
    assert make_model(ar_task).cfg.pos_emb == "learned"
    model = make_model(ar_task, pos_emb="none")
    assert "hook_pos_embed" not in model.hook_dict


def test_config_json_round_trip(ar_model):
    assert ModelConfig.from_json(ar_model.cfg.to_json()) == ar_model.cfg


@pytest.mark.parametrize("bad", [{"mixers": "attentoin"}, {"layer_options": [{"windw": 2}, {}]}, {"d_model": 0}, {"n_layers": -1}])
def test_invalid_configs_are_refused(bad):
    with pytest.raises(UsageError) as error:
        build_config(**{"d_vocab": 10, "n_ctx": 5, **bad})
    message = str(error.value)
    if "mixers" in bad:
        assert "attention" in message
    if "layer_options" in bad:
        assert "attention" in message and "window" in message


def test_sequence_longer_than_context_is_refused(ar_model):
    with pytest.raises(UsageError):
        ar_model(torch.zeros(1, ar_model.cfg.n_ctx + 1, dtype=torch.long))


def test_backbone_init_keeps_the_mixers_marked_initialisation(ar_task):
    """zoology/mamba-ssm convention: a `_no_reinit` parameter (Mamba's dt bias) survives the
    backbone's normal(0.02)/zeros re-initialisation."""
    model = make_model(ar_task, mixers="mamba", d_model=16)
    dt_bias = model.blocks[0].mixer.dt_proj.bias
    dt = torch.nn.functional.softplus(dt_bias)
    assert dt.min() >= 1e-4 - 1e-7 and dt.max() <= 0.1 + 1e-6 and dt.std() > 0  # fp32 round-off of softplus(inverse)
