"""RWKV-6 time mixing: shapes, gradients, causality, chunked vs recurrent WKV, an
independent reference forward, inside hooks in a HookedLM, state-patch propagation.

Tolerances: in float64, chunked vs recurrent WKV, the reference forward and hooked vs unhooked
forwards agree to 1e-9..1e-11 (float64 round-off), causality 1e-13; the float32 fast-decay case
1e-5 (float32 round-off); an unpatched prefix uses torch's float64 defaults.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hookmech.config import build_config
from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY, SPECS
from hookmech.mixers import rwkv as rwkv_module
from hookmech.mixers.rwkv import RWKV6, wkv_chunked, wkv_recurrent, wkv_sequential
from hookmech.model import HookedLM

from helpers import (assert_state_built_only_when_hooked, assert_state_edit_propagates, random_state_edits,
                     restarted_reference)

D_MODEL = 32


def randomise(module: nn.Module, seed: int = 0) -> None:
    """Give every parameter a random value: RWKV-6 starts its LoRA A matrices at zero, which
    would hide a broken data-dependent path from the tests."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)


def make_mixer(**kwargs) -> RWKV6:
    torch.manual_seed(0)
    mixer = REGISTRY["rwkv"](d_model=D_MODEL, **kwargs).double()
    randomise(mixer)
    return mixer


def reference_forward(mixer: RWKV6, x: torch.Tensor, replace: dict[int, torch.Tensor] | None = None):
    """RWKV-6 time mixing transcribed from BlinkDL's `RWKV_Tmix_x060` (time shift by
    ZeroPad2d, LoRA by bmm) with the WKV CUDA kernel's loop; `replace` maps a position to a
    state that replaces S_t there (a patch). Returns (out [b, L, C], wkv [b, L, H, K], states)."""
    B, T, C = x.shape
    H, K = mixer.n_heads, mixer.head_size
    xx = nn.ZeroPad2d((0, 0, 1, -1))(x) - x
    xxx = x + xx * mixer.time_maa_x
    xxx = torch.tanh(xxx @ mixer.time_maa_w1).view(B * T, 5, -1).transpose(0, 1)
    xxx = torch.bmm(xxx, mixer.time_maa_w2).view(5, B, T, -1)
    mw, mk, mv, mr, mg = xxx.unbind(dim=0)
    xw = x + xx * (mixer.time_maa_w + mw)
    xk = x + xx * (mixer.time_maa_k + mk)
    xv = x + xx * (mixer.time_maa_v + mv)
    xr = x + xx * (mixer.time_maa_r + mr)
    xg = x + xx * (mixer.time_maa_g + mg)
    r, k, v = xr @ mixer.receptance.weight.T, xk @ mixer.key.weight.T, xv @ mixer.value.weight.T
    g = F.silu(xg @ mixer.gate.weight.T)
    w = mixer.time_decay + torch.tanh(xw @ mixer.time_decay_w1) @ mixer.time_decay_w2
    w = torch.exp(-torch.exp(w.view(B, T, H, K)))
    r, k, v = (t.view(B, T, H, K) for t in (r, k, v))
    u = mixer.time_faaaa
    state = torch.zeros(B, H, K, K, dtype=x.dtype)
    ys, states = [], []
    for t in range(T):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]  # kernel: x = k[i] * v[j]
        ys.append((r[:, t, :, :, None] * (u[None, :, :, None] * kv + state)).sum(-2))
        state = state * w[:, t, :, :, None] + kv
        if replace is not None and t in replace:
            state = replace[t].clone()
        states.append(state)
    wkv = torch.stack(ys, dim=1)
    normed = mixer.ln_x(wkv.reshape(B * T, C)).view(B, T, C)
    return (normed * g) @ mixer.out_proj.weight.T, wkv, torch.stack(states, dim=1)


def test_defaults_and_parameter_names_follow_rwkv6():
    mixer = REGISTRY["rwkv"](d_model=64)
    assert (mixer.n_heads, mixer.head_size) == (4, 16)
    assert SPECS["rwkv"].block_norm == "layernorm" and SPECS["rwkv"].block_mlp is True
    names = {name for name, _ in mixer.named_parameters()}
    assert {"time_maa_x", "time_maa_w", "time_maa_k", "time_maa_v", "time_maa_r", "time_maa_g",
            "time_maa_w1", "time_maa_w2", "time_decay", "time_decay_w1", "time_decay_w2", "time_faaaa",
            "receptance.weight", "key.weight", "value.weight", "gate.weight", "ln_x.weight", "ln_x.bias",
            "out_proj.weight"} == names
    assert mixer.time_maa_w1.shape == (64, 5 * 32) and mixer.time_decay_w1.shape == (64, 64)
    assert mixer(torch.randn(3, 11, 64)).shape == (3, 11, 64)


@pytest.mark.parametrize(
    "options", [{"head_size": 24}, {"head_size": 0}, {"mix_lora": 0}, {"init_depth": 1.5}, {"chunk_size": 0}]
)
def test_invalid_options_raise_usage_error(options):
    with pytest.raises(UsageError, match="rwkv"):
        REGISTRY["rwkv"](d_model=64, **options)


def test_gradients_reach_every_parameter():
    mixer = make_mixer()
    mixer(torch.randn(2, 9, D_MODEL, dtype=torch.double)).pow(2).sum().backward()
    for name, param in mixer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_lora_a_matrices_get_gradient_at_initialisation():
    # At RWKV-6's init the LoRA A matrices are zero; they must still learn from step one.
    torch.manual_seed(0)
    mixer = REGISTRY["rwkv"](d_model=D_MODEL).double()
    nn.init.normal_(mixer.out_proj.weight)
    mixer(torch.randn(2, 9, D_MODEL, dtype=torch.double)).pow(2).sum().backward()
    assert mixer.time_maa_w1.grad.abs().sum() > 0 and mixer.time_decay_w1.grad.abs().sum() > 0


@pytest.mark.parametrize("options", [{}, {"chunk_size": 4}, {"head_size": 8}])
def test_changing_the_future_never_changes_the_past(options):
    mixer = make_mixer(**options)
    x = torch.randn(2, 13, D_MODEL, dtype=torch.double)
    changed = x.clone()
    changed[:, 7:] = torch.randn_like(changed[:, 7:]) * 3
    torch.testing.assert_close(mixer(changed)[:, :7], mixer(x)[:, :7], rtol=0, atol=1e-13)
    assert not torch.allclose(mixer(changed)[:, 7:], mixer(x)[:, 7:])


@pytest.mark.parametrize("chunk_size,n_pos", [(4, 13), (8, 8), (5, 23), (32, 7), (1, 6)])
def test_chunked_wkv_matches_the_sequential_recurrence(chunk_size, n_pos):
    torch.manual_seed(1)
    batch, heads, d_head = 2, 3, 4
    r, k, v = (torch.randn(batch, n_pos, heads, d_head, dtype=torch.double) for _ in range(3))
    # Decays from ~1 down to e^-e^2 ≈ 6e-4 per step: the chunked form must not overflow.
    log_decay = -torch.exp(torch.empty(batch, n_pos, heads, d_head, dtype=torch.double).uniform_(-6, 2))
    u = torch.randn(heads, d_head, dtype=torch.double)
    initial = torch.randn(batch, heads, d_head, d_head, dtype=torch.double)
    out_seq, states_seq = wkv_sequential(r, k, v, log_decay, u, initial)
    out_chunk, states_chunk = wkv_chunked(r, k, v, log_decay, u, chunk_size, initial, return_all_states=True)
    out_fast, final = wkv_chunked(r, k, v, log_decay, u, chunk_size, initial)
    torch.testing.assert_close(out_chunk, out_seq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(states_chunk, states_seq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out_fast, out_seq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, states_seq[:, -1], rtol=1e-10, atol=1e-10)
    # the in-place recurrence (runs without autograd), with and without every state
    out_rec, states_rec = wkv_recurrent(r, k, v, log_decay, u, initial, return_all_states=True)
    out_rec_final, final_rec = wkv_recurrent(r, k, v, log_decay, u, initial)
    torch.testing.assert_close(out_rec, out_seq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(states_rec, states_seq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_rec_final, out_seq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final_rec, states_seq[:, -1], rtol=1e-12, atol=1e-12)


def test_chunked_wkv_survives_fast_decay_in_float32():
    # A factorised exp(b_t)·exp(-b_s) form overflows here (Σ log w over a chunk ≈ -2000).
    torch.manual_seed(2)
    r, k, v = (torch.randn(1, 64, 2, 4) for _ in range(3))
    log_decay = torch.full((1, 64, 2, 4), -60.0)
    u = torch.randn(2, 4)
    out, _ = wkv_chunked(r, k, v, log_decay, u, chunk_size=32)
    expected, _ = wkv_sequential(r, k, v, log_decay, u)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"head_size": 8, "chunk_size": 3}, {"init_depth": 0.0}])
def test_mixer_matches_the_reference_implementation(options):
    mixer = make_mixer(**options)
    x = torch.randn(2, 10, D_MODEL, dtype=torch.double)
    expected, _, _ = reference_forward(mixer, x)
    torch.testing.assert_close(mixer(x), expected, rtol=1e-9, atol=1e-11)


def tiny_model() -> HookedLM:
    torch.manual_seed(0)
    cfg = build_config(d_vocab=20, n_ctx=16, mixers="rwkv", d_model=D_MODEL, n_layers=2)
    model = HookedLM(cfg).double()
    for block in model.blocks:
        randomise(block.mixer)
    return model


def test_inside_hooks_fire_with_documented_shapes():
    model = tiny_model()
    assert model.cfg.mlp == (True, True) and model.cfg.norms == ("layernorm", "layernorm")
    tokens = torch.randint(0, 20, (3, 12))
    logits, cache = model.run_with_cache(tokens)
    mixer = model.blocks[1].mixer
    H, K = mixer.n_heads, mixer.head_size
    expected = {
        "r": (3, 12, H, K), "k": (3, 12, H, K), "v": (3, 12, H, K), "decay": (3, 12, H, K),
        "gate": (3, 12, D_MODEL), "state": (3, 12, H, K, K), "output": (3, 12, H, K),
    }
    for name, shape in expected.items():
        hook = getattr(mixer, f"hook_{name}")
        assert cache[f"blocks.1.mixer.hook_{name}"].shape == shape, name
        assert len(hook.axes.split()) == len(shape) and hook.pos_axis == 1, name
    torch.testing.assert_close(logits, model(tokens), rtol=1e-10, atol=1e-10)
    _, wkv, states = reference_forward(mixer, cache["blocks.1.hook_mixer_in"])
    torch.testing.assert_close(cache["blocks.1.mixer.hook_state"], states, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(cache["blocks.1.mixer.hook_output"], wkv, rtol=1e-9, atol=1e-11)


def test_state_is_not_materialised_without_a_hook(monkeypatch):
    assert_state_built_only_when_hooked(monkeypatch, rwkv_module, "wkv", tiny_model(), "hook_output", "blocks.0.mixer.hook_state")


@pytest.mark.parametrize("style", ["copy", "in_place"])
@pytest.mark.parametrize("edits", [{4: [0, 1]}, {3: [0, 1], 7: [1]}, {0: [0], 11: [0, 1]}])
def test_state_patch_propagates_to_later_positions(edits, style):
    """Edit the layer-0 state at some (position, rows); every later state and output follows
    the recurrence from the edited state, compared with the reference loop."""
    model = tiny_model()
    tokens = torch.randint(0, 20, (2, 12))
    state_shape = model.run_with_cache(tokens)[1]["blocks.0.mixer.hook_state"].shape[2:]
    forward = partial(reference_forward, model.blocks[0].mixer)
    # out of place and in place (the unedited states are then recomputed); the state after position p
    # first shows in the output at p + 1; the edited run rescans every row from the batch's first
    # edit on, so a row edited later recomputes its unedited prefix (round-off, 2e-15 measured)
    assert_state_edit_propagates(
        model, tokens, "blocks.0.mixer.hook_state", "blocks.0.hook_mixer_out",
        random_state_edits(edits, 2, state_shape, seed=5),
        lambda clean, edits: restarted_reference(forward, clean["blocks.0.hook_mixer_in"], edits),
        style=style, lag=1, prefix_atol=1e-12)
