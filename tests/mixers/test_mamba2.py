"""Mamba-2 mixer: shapes, gradients, causality, chunked SSD vs the recurrence, an
independent reference forward, inside hooks in a HookedLM, state-patch propagation.

Tolerances (float64): chunked SSD vs the recurrence, the positionwise reference and hooked vs
unhooked forwards agree to 1e-9..1e-11, float64 round-off (the chunked form sums decays as
exp of segment sums); causality 1e-13; an unpatched prefix uses torch's float64 defaults.
"""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch.nn import functional as F

from hookmech.config import build_config
from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY, SPECS
from hookmech.mixers import mamba2 as mamba2_module
from hookmech.mixers.mamba2 import Mamba2, ssd_chunked, ssd_kept_states, ssd_recurrent, ssd_sequential
from hookmech.model import HookedLM

from helpers import (assert_state_built_only_when_hooked, assert_state_edit_propagates, random_state_edits,
                     restarted_reference)

D_MODEL = 32


def make_mixer(**kwargs) -> Mamba2:
    torch.manual_seed(0)
    return REGISTRY["mamba2"](d_model=D_MODEL, **kwargs).double()


def reference_forward(mixer: Mamba2, u: torch.Tensor, initial: dict[int, torch.Tensor] | None = None):
    """Mamba-2 written out position by position from the paper's equations, sharing only
    the parameters with the module. `initial` maps a position to a state that replaces
    h_t there (a patch). Returns (out [b, L, d_model], y [b, L, H, P], states [b, L, H, P, N])."""
    batch, n_pos, _ = u.shape
    H, P, N, G = mixer.n_heads, mixer.headdim, mixer.d_state, mixer.ngroups
    d_inner = mixer.d_inner
    proj = u @ mixer.in_proj.weight.T
    z, xbc, dt = proj[..., :d_inner], proj[..., d_inner:-H], proj[..., -H:]
    if mixer.conv1d is not None:
        kernel = mixer.conv1d.weight.shape[-1]
        xbc = F.conv1d(xbc.transpose(1, 2), mixer.conv1d.weight, mixer.conv1d.bias,
                       padding=kernel - 1, groups=xbc.shape[-1])[..., :n_pos].transpose(1, 2)
    xbc = F.silu(xbc)
    x = xbc[..., :d_inner].reshape(batch, n_pos, H, P)
    B = xbc[..., d_inner : d_inner + G * N].reshape(batch, n_pos, G, N)
    C = xbc[..., d_inner + G * N :].reshape(batch, n_pos, G, N)
    dt = F.softplus(dt + mixer.dt_bias)
    if mixer.dt_limit is not None:  # transformers' time_step_limit: a clamp after the softplus
        low, high = mixer.dt_limit
        dt = torch.maximum(dt, torch.tensor(low, dtype=dt.dtype)) if low is not None else dt
        dt = torch.minimum(dt, torch.tensor(high, dtype=dt.dtype)) if high is not None else dt
    A = -torch.exp(mixer.A_log)
    group_of_head = torch.arange(H) // (H // G)
    h = torch.zeros(batch, H, P, N, dtype=u.dtype)
    ys, states = [], []
    for t in range(n_pos):
        B_t, C_t = B[:, t, group_of_head], C[:, t, group_of_head]  # [b, H, N]
        decay = torch.exp(dt[:, t] * A)  # [b, H]
        h = decay[..., None, None] * h + dt[:, t, :, None, None] * x[:, t, :, :, None] * B_t[:, :, None, :]
        if initial is not None and t in initial:
            h = initial[t].clone()
        states.append(h)
        ys.append((h * C_t[:, :, None, :]).sum(-1) + mixer.D[:, None] * x[:, t])
    y = torch.stack(ys, dim=1)
    # mamba-ssm's gated RMSNorm normalises each group of d_inner / ngroups channels apart.
    gated = (y.reshape(batch, n_pos, d_inner) * F.silu(z)).reshape(batch, n_pos, G, d_inner // G)
    normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + mixer.norm.eps)
    normed = normed.reshape(batch, n_pos, d_inner) * mixer.norm.weight
    return normed @ mixer.out_proj.weight.T, y, torch.stack(states, dim=1)


def test_defaults_follow_mamba2_with_small_heads():
    mixer = REGISTRY["mamba2"](d_model=64)
    assert (mixer.d_inner, mixer.n_heads, mixer.headdim, mixer.d_state) == (128, 8, 16, 64)
    assert SPECS["mamba2"].block_norm == "rmsnorm" and SPECS["mamba2"].block_mlp is False
    names = {name for name, _ in mixer.named_parameters()}
    assert {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
            "norm.weight", "out_proj.weight"} == names
    assert mixer.in_proj.weight.shape == (2 * 128 + 2 * 64 + 8, 64)
    assert mixer(torch.randn(3, 11, 64)).shape == (3, 11, 64)


@pytest.mark.parametrize(
    "options",
    [{"headdim": 24}, {"d_conv": -1}, {"ngroups": 3}, {"d_state": 0}, {"chunk_size": 0}, {"dt_min": 0.0},
     {"dt_limit": [0.1, 0.01]}, {"dt_limit": [None, None]}, {"dt_limit": [0.0, 0.1, 1.0]}, {"norm_eps": 0.0}],
)
def test_invalid_options_raise_usage_error(options):
    with pytest.raises(UsageError, match="mamba2"):
        REGISTRY["mamba2"](d_model=64, **options)


def test_gradients_reach_every_parameter():
    mixer = make_mixer()
    mixer(torch.randn(2, 9, D_MODEL, dtype=torch.double)).pow(2).sum().backward()
    for name, param in mixer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("options", [{}, {"d_conv": 0}, {"chunk_size": 4}])
def test_changing_the_future_never_changes_the_past(options):
    mixer = make_mixer(**options)
    u = torch.randn(2, 13, D_MODEL, dtype=torch.double)
    changed = u.clone()
    changed[:, 7:] = torch.randn_like(changed[:, 7:]) * 3
    torch.testing.assert_close(mixer(changed)[:, :7], mixer(u)[:, :7], rtol=0, atol=1e-13)
    assert not torch.allclose(mixer(changed)[:, 7:], mixer(u)[:, 7:])


@pytest.mark.parametrize("chunk_size,n_pos,ngroups", [(4, 13, 1), (8, 8, 2), (5, 23, 4), (64, 7, 1)])
def test_chunked_ssd_matches_the_sequential_recurrence(chunk_size, n_pos, ngroups):
    torch.manual_seed(1)
    batch, heads, headdim, d_state = 2, 4, 3, 5
    x = torch.randn(batch, n_pos, heads, headdim, dtype=torch.double)
    dt = F.softplus(torch.randn(batch, n_pos, heads, dtype=torch.double))
    A = -torch.rand(heads, dtype=torch.double) * 5
    B = torch.randn(batch, n_pos, ngroups, d_state, dtype=torch.double)
    C = torch.randn(batch, n_pos, ngroups, d_state, dtype=torch.double)
    initial = torch.randn(batch, heads, headdim, d_state, dtype=torch.double)
    y_seq, states_seq = ssd_sequential(x, dt, A, B, C, initial)
    y_chunk, states_chunk = ssd_chunked(x, dt, A, B, C, chunk_size, initial, return_all_states=True)
    y_fast, final = ssd_chunked(x, dt, A, B, C, chunk_size, initial)
    torch.testing.assert_close(y_chunk, y_seq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(states_chunk, states_seq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y_fast, y_seq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, states_seq[:, -1], rtol=1e-10, atol=1e-10)
    # the in-place recurrence (runs without autograd), with and without every state
    y_rec, states_rec = ssd_recurrent(x, dt, A, B, C, initial, return_all_states=True)
    y_rec_final, final_rec = ssd_recurrent(x, dt, A, B, C, initial)
    torch.testing.assert_close(y_rec, y_seq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(states_rec, states_seq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y_rec_final, y_seq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final_rec, states_seq[:, -1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stride,n_pos,ngroups", [(16, 40, 1), (4, 13, 2), (16, 9, 1), (3, 12, 4)])
def test_kept_states_are_every_strideth_state_of_the_sequential_recurrence(stride, n_pos, ngroups):
    """`ssd_kept_states` (the engine's base runs): y and the states after positions stride - 1,
    2 stride - 1, ... of `ssd_sequential` (none for a run shorter than a stride)."""
    torch.manual_seed(2)
    batch, heads, headdim, d_state = 2, 4, 3, 5
    x = torch.randn(batch, n_pos, heads, headdim, dtype=torch.double)
    dt = F.softplus(torch.randn(batch, n_pos, heads, dtype=torch.double))
    A = -torch.rand(heads, dtype=torch.double) * 5
    B = torch.randn(batch, n_pos, ngroups, d_state, dtype=torch.double)
    C = torch.randn(batch, n_pos, ngroups, d_state, dtype=torch.double)
    y_seq, states_seq = ssd_sequential(x, dt, A, B, C)
    y, kept = ssd_kept_states(x, dt, A, B, C, stride)
    torch.testing.assert_close(y, y_seq, rtol=1e-10, atol=1e-10)
    assert kept.shape == (batch, n_pos // stride, heads, headdim, d_state)
    torch.testing.assert_close(kept, states_seq[:, stride - 1 :: stride][:, : n_pos // stride], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("options", [{}, {"ngroups": 2, "chunk_size": 3}])
def test_forward_without_autograd_equals_the_differentiable_one(options):
    # without autograd the mixer runs `ssd_recurrent`; with it, `ssd_chunked`
    mixer = make_mixer(**options)
    u = torch.randn(2, 10, D_MODEL, dtype=torch.double)
    with torch.no_grad():
        fast = mixer(u)
    torch.testing.assert_close(fast, mixer(u), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", [
    {}, {"ngroups": 2, "d_conv": 2, "chunk_size": 3}, {"d_conv": 0},
    {"ngroups": 4, "headdim": 4, "dt_limit": [0.02, 0.06]}, {"dt_limit": [None, 0.03]}, {"dt_limit": [0.05, None]},
    {"ngroups": 2, "norm_eps": 0.5},  # an epsilon large enough to change the output
])
def test_mixer_matches_a_positionwise_reference(options):
    mixer = make_mixer(**options)
    u = torch.randn(2, 10, D_MODEL, dtype=torch.double)
    expected, _, _ = reference_forward(mixer, u)
    torch.testing.assert_close(mixer(u), expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dt_limit", [[0.02, 0.06], [None, 0.03], [0.05, None]])
def test_dt_limit_clamps_delta_after_the_softplus(dt_limit):
    """hook_delta lies within dt_limit, on its bounds where the softplus is beyond them, and equals
    the unclamped Δ elsewhere (a bound of None clamps nothing)."""
    clamped, free = make_mixer(dt_limit=dt_limit), make_mixer()
    u = torch.randn(2, 10, D_MODEL, dtype=torch.double)
    seen = {}
    for name, mixer in (("clamped", clamped), ("free", free)):
        mixer.hook_delta.add_hook(lambda act, hook, name=name: seen.__setitem__(name, act.clone()))
        mixer(u)
        mixer.hook_delta.remove_hooks()
    low, high = (torch.tensor(-math.inf if b is None else b, dtype=torch.double) for b in (dt_limit[0], dt_limit[1]))
    high = torch.tensor(math.inf, dtype=torch.double) if dt_limit[1] is None else high
    torch.testing.assert_close(seen["clamped"], seen["free"].clamp(low, high), rtol=0, atol=0)
    assert ((seen["free"] < low) | (seen["free"] > high)).any(), "the clamp bites somewhere"


def test_no_dt_limit_keeps_the_config_and_the_outputs_of_models_made_before_it():
    """dt_limit defaults to None: no option recorded (the config's JSON unchanged) and no clamp."""
    cfg = build_config(d_vocab=20, n_ctx=16, mixers="mamba2", d_model=D_MODEL, n_layers=1)
    assert "dt_limit" not in cfg.to_json() and make_mixer().dt_limit is None


def tiny_model() -> HookedLM:
    torch.manual_seed(0)
    cfg = build_config(d_vocab=20, n_ctx=16, mixers="mamba2", d_model=D_MODEL, n_layers=2)
    return HookedLM(cfg).double()


def test_inside_hooks_fire_with_documented_shapes():
    model = tiny_model()
    assert model.cfg.mlp == (False, False) and model.cfg.norms == ("rmsnorm", "rmsnorm")
    tokens = torch.randint(0, 20, (3, 12))
    logits, cache = model.run_with_cache(tokens)
    mixer = model.blocks[1].mixer
    H, P, N, d_inner = mixer.n_heads, mixer.headdim, mixer.d_state, mixer.d_inner
    expected = {
        "in_x": (3, 12, d_inner), "gate": (3, 12, d_inner), "conv": (3, 12, d_inner),
        "conv_act": (3, 12, H, P), "delta": (3, 12, H), "B": (3, 12, 1, N), "C": (3, 12, 1, N),
        "ssm_state": (3, 12, H, P, N), "y": (3, 12, H, P),
    }
    for name, shape in expected.items():
        hook = getattr(mixer, f"hook_{name}")
        assert cache[f"blocks.1.mixer.hook_{name}"].shape == shape, name
        assert len(hook.axes.split()) == len(shape) and hook.pos_axis == 1, name
    # Reading the state through its hook must not change the model's output.
    torch.testing.assert_close(logits, model(tokens), rtol=1e-10, atol=1e-10)
    # The cached state is the recurrence's state: check it against the reference.
    mixer_in = cache["blocks.1.hook_mixer_in"]
    _, _, states = reference_forward(mixer, mixer_in)
    torch.testing.assert_close(cache["blocks.1.mixer.hook_ssm_state"], states, rtol=1e-9, atol=1e-11)


def test_state_is_not_materialised_without_a_hook(monkeypatch):
    assert_state_built_only_when_hooked(monkeypatch, mamba2_module, "ssd", tiny_model(), "hook_y", "blocks.0.mixer.hook_ssm_state")


@pytest.mark.parametrize("edits", [{4: [0, 1]}, {3: [0, 1], 7: [1]}, {0: [0], 11: [0, 1]}])
def test_state_patch_propagates_to_later_positions(edits):
    """Edit the layer-0 state at some (position, rows); everything after follows the
    recurrence from the edited state, compared with a position-by-position reference."""
    model = tiny_model()
    tokens = torch.randint(0, 20, (2, 12))
    state_shape = model.run_with_cache(tokens)[1]["blocks.0.mixer.hook_ssm_state"].shape[2:]
    forward = partial(reference_forward, model.blocks[0].mixer)
    # The reference replaces h_t of the edited rows only, then keeps stepping.
    assert_state_edit_propagates(
        model, tokens, "blocks.0.mixer.hook_ssm_state", "blocks.0.hook_mixer_out",
        random_state_edits(edits, 2, state_shape, seed=5),
        lambda clean, edits: restarted_reference(forward, clean["blocks.0.hook_mixer_in"], edits),
        style="in_place_returned")  # in place, as TransformerLens hooks often do
