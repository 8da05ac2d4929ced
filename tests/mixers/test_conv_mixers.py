"""Convolution-family mixers (baseconv, hyena, h3) and their shared long-convolution kernels.

Each fast path (FFT convolution, SSM kernels) is compared with an independent slow form:
a direct O(L²) convolution loop, the SSM recurrences run step by step, hand-computed numbers.

Tolerances: in float64, FFT vs direct convolution and fast paths vs recurrences agree to 1e-12
(1e-10 for H3's complex diagonal state), the FFT's round-off, and causality holds to 1e-12 (an FFT
mixes every position's round-off into every output); values computed in float32 (positional
embeddings, the shift kernel's start) are compared at 1e-6, hand-computed numbers with torch's defaults.
"""
from __future__ import annotations

import math

import pytest
import torch

from hookmech.config import build_config
from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY
from hookmech.mixers.h3 import DiagonalKernel, ShiftKernel
from hookmech.mixers.long_conv import (
    ImplicitFilter,
    causal_conv_at,
    fft_causal_conv,
    positional_embedding,
    toeplitz_causal_conv,
)
from hookmech.model import HookedLM

# (registry name, options): every configuration the papers use, small enough to be fast
CONFIGS = [
    ("baseconv", {}),
    ("baseconv", {"kernel_size": -1, "l_max": 32}),
    ("baseconv", {"kernel_size": -1, "l_max": 32, "implicit_long_conv": False}),
    ("baseconv", {"kernel_size": 4, "use_act": True}),
    ("hyena", {"l_max": 32}),
    ("hyena", {"l_max": 32, "filter_bias": True}),
    ("h3", {"l_max": 32}),
    ("h3", {"l_max": 32, "d_state": 4, "head_dim": 4}),
]
CONFIG_IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in opts.items()) or 'default'}" for name, opts in CONFIGS]


def direct_causal_conv(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """y[:, t] = Σ_{s<=t} k[s] u[:, t-s], by a plain double loop."""
    y = torch.zeros_like(u)
    for t in range(u.shape[1]):
        for s in range(min(t + 1, k.shape[0])):
            y[:, t] = y[:, t] + k[s] * u[:, t - s]
    return y


def short_conv_loop(conv, x: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv by hand: y_t = Σ_j w_j x_{t-(K-1)+j} + bias."""
    weight, width = conv.weight[:, 0, :], conv.weight.shape[-1]
    y = torch.zeros_like(x) + conv.bias
    for t in range(x.shape[1]):
        for j in range(width):
            source = t - (width - 1) + j
            if source >= 0:
                y[:, t] = y[:, t] + weight[:, j] * x[:, source]
    return y


# -- shared kernels -------------------------------------------------------------------------
@pytest.mark.parametrize("n_lags", [13, 5, 20])
def test_fft_causal_conv_matches_direct_loop(n_lags):
    torch.manual_seed(0)
    u = torch.randn(2, 13, 3, dtype=torch.float64)
    k = torch.randn(n_lags, 3, dtype=torch.float64)
    torch.testing.assert_close(fft_causal_conv(u, k), direct_causal_conv(u, k[:13]), rtol=0, atol=1e-12)


def test_fft_causal_conv_broadcasts_kernel_over_extra_channel_axes():
    torch.manual_seed(0)
    u = torch.randn(2, 9, 3, 2, 2, dtype=torch.float64)
    k = torch.randn(9, 3, dtype=torch.float64)
    expected = direct_causal_conv(u, k[:, :, None, None].expand(9, 3, 2, 2))
    torch.testing.assert_close(fft_causal_conv(u, k[:, :, None, None]), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n_lags", [13, 5, 20])
def test_toeplitz_causal_conv_and_one_position_match_the_direct_loop(n_lags):
    """The resumed windows' convolutions (`long_conv.resumed_causal_conv`): the whole window by
    its Toeplitz matrix, or one position per row; kernels shorter or longer than the window,
    broadcast over extra channel axes as H3's diagonal SSM does."""
    torch.manual_seed(0)
    u = torch.randn(4, 13, 3, 2, 2, dtype=torch.float64)
    k = torch.randn(n_lags, 3, 1, 1, dtype=torch.float64)
    expected = direct_causal_conv(u, k[:13].expand(-1, 3, 2, 2))
    torch.testing.assert_close(toeplitz_causal_conv(u, k), expected, rtol=0, atol=1e-12)
    at = torch.tensor([0, 12, 5, 7])
    torch.testing.assert_close(causal_conv_at(u, k, at), expected[torch.arange(4), at][:, None], rtol=0, atol=1e-12)


def test_fft_causal_conv_does_not_wrap_the_future_into_the_past():
    # A circular convolution of size L would put u[L-1] * k[1] at position 0.
    u = torch.zeros(1, 8, 1, dtype=torch.float64)
    u[0, -1] = 1.0
    y = fft_causal_conv(u, torch.ones(8, 1, dtype=torch.float64))
    assert y[0, :-1].abs().max() < 1e-14 and y[0, -1].item() == pytest.approx(1.0)


def test_positional_embedding_matches_complex_exponential():
    l_max, emb_dim = 20, 5
    z, t = positional_embedding(l_max, emb_dim)
    frequencies = torch.tensor([1e-4, 1.0], dtype=torch.float64)
    angle = 2 * math.pi * torch.arange(l_max, dtype=torch.float64)[:, None] / l_max
    expected = torch.exp(-1j * frequencies * angle)
    torch.testing.assert_close(z[:, 1:3].double(), expected.real, atol=1e-6, rtol=0)
    torch.testing.assert_close(z[:, 3:].double(), expected.imag, atol=1e-6, rtol=0)
    assert t[0].item() == 0.0 and t[-1].item() == pytest.approx(1.0)
    torch.testing.assert_close(z[:, 0:1], t)


def test_implicit_filter_of_a_shorter_sequence_is_a_prefix_and_decays_per_channel():
    torch.manual_seed(0)
    filt = ImplicitFilter(channels=4, l_max=50, order=8).double()
    full = filt(50)
    torch.testing.assert_close(filt(17), full[:17], rtol=0, atol=1e-12)  # the same MLP on fewer rows: float64 round-off
    # The window is exp(-|δ_c| t): undo it on channel 0 and compare with the bare MLP output.
    mlp = filt.z
    for layer in filt.implicit_filter[:-1]:
        mlp = torch.sin(filt.freq * layer(mlp))
    mlp = filt.implicit_filter[-1](mlp)
    slow, fast = math.log(1e-2) / 1.5, math.log(1e-2) / 0.3
    window = torch.exp(-filt.t * torch.linspace(abs(slow), abs(fast), 4, dtype=torch.float64))
    torch.testing.assert_close(full, mlp * window)
    assert window[-1, 0].item() == pytest.approx(math.exp(slow))  # reaches 1e-2 at 1.5 x l_max


def test_shift_kernel_matches_shift_register_recurrence():
    torch.manual_seed(0)
    kernel = ShiftKernel(channels=3, d_state=5).double()
    with torch.no_grad():
        kernel.B.normal_()  # a general B, not only the e_0 it starts from
    u = torch.randn(2, 9, 3, dtype=torch.float64)
    state = torch.zeros(2, 3, 5, dtype=torch.float64)
    outputs = []
    for t in range(9):
        state = torch.cat([torch.zeros(2, 3, 1, dtype=torch.float64), state[..., :-1]], dim=-1)
        state = state + kernel.B * u[:, t, :, None]
        outputs.append((kernel.C * state).sum(-1))
    recurrent = torch.stack(outputs, dim=1)
    torch.testing.assert_close(fft_causal_conv(u, kernel(9)), recurrent, rtol=0, atol=1e-12)


def test_shift_kernel_starts_as_an_explicit_filter():
    kernel = ShiftKernel(channels=3, d_state=6)
    torch.testing.assert_close(kernel(6), kernel.C.T, rtol=0, atol=1e-6)
    assert kernel(9)[6:].abs().max() == 0  # no taps beyond d_state


def diagonal_ssm_parameters(kernel: DiagonalKernel):
    """Ā, B̄, C from the raw parameters by the bilinear rule (written out independently)."""
    dt = torch.exp(kernel.log_dt)[:, None]
    A = torch.complex(-torch.exp(kernel.inv_A_real), kernel.A_imag)
    B = torch.complex(kernel.B[..., 0], kernel.B[..., 1])
    C = torch.complex(kernel.C[..., 0], kernel.C[..., 1])
    A_bar = (1 + dt * A / 2) / (1 - dt * A / 2)
    B_bar = dt * B / (1 - dt * A / 2)
    return A_bar, B_bar, C


def test_diagonal_kernel_matches_step_by_step_recurrence():
    torch.manual_seed(0)
    kernel = DiagonalKernel(channels=3, d_state=8, dt_min=0.05, dt_max=0.5).double()
    u = torch.randn(2, 11, 3, dtype=torch.float64)
    A_bar, B_bar, C = diagonal_ssm_parameters(kernel)
    state = torch.zeros(2, 3, 4, dtype=torch.complex128)
    outputs = []
    for t in range(11):
        state = A_bar * state + B_bar * u[:, t, :, None]
        outputs.append(2 * (C * state).sum(-1).real)
    recurrent = torch.stack(outputs, dim=1)
    torch.testing.assert_close(fft_causal_conv(u, kernel(11)), recurrent, rtol=0, atol=1e-12)


# -- the mixers against independent formulations --------------------------------------------
def test_baseconv_short_conv_hand_computed_tiny_case():
    mixer = REGISTRY["baseconv"](d_model=1, kernel_size=2)
    with torch.no_grad():
        mixer.conv.weight.copy_(torch.tensor([[[0.5, -1.0]]]))  # taps (previous, current)
        mixer.conv.bias.fill_(0.25)
        mixer.projection.weight.fill_(2.0)
        mixer.projection.bias.fill_(1.0)
    u = torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1)
    # conv(u) = -0.75, -1.25, -1.75; projection(u) = 3, 5, 7; y = conv * proj + u
    torch.testing.assert_close(mixer(u).flatten(), torch.tensor([-1.25, -4.25, -9.25]))


def test_baseconv_explicit_long_conv_hand_computed_tiny_case():
    mixer = REGISTRY["baseconv"](d_model=1, kernel_size=-1, l_max=3, implicit_long_conv=False)
    with torch.no_grad():
        mixer.filter.copy_(torch.tensor([[1.0], [0.5], [0.25]]))
        mixer.projection.weight.fill_(1.0)
        mixer.projection.bias.fill_(0.0)
    u = torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1)
    # conv(u) = h * u + u = 2, 4.5, 7.25; y = conv * u + u
    torch.testing.assert_close(mixer(u).flatten(), torch.tensor([3.0, 11.0, 24.75]))


@pytest.mark.parametrize("kernel_size", [3, -1])
def test_baseconv_matches_loop_reference(kernel_size):
    torch.manual_seed(0)
    mixer = REGISTRY["baseconv"](d_model=5, kernel_size=kernel_size, l_max=16).double()
    u = torch.randn(2, 12, 5, dtype=torch.float64)
    if kernel_size == -1:
        conv = direct_causal_conv(u, mixer.conv(12)) + u
    else:
        conv = short_conv_loop(mixer.conv, u)
    expected = conv * (u @ mixer.projection.weight.T + mixer.projection.bias) + u
    torch.testing.assert_close(mixer(u), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("filter_bias", [False, True])
def test_hyena_matches_loop_reference(filter_bias):
    torch.manual_seed(0)
    d_model, n_pos = 4, 12
    mixer = REGISTRY["hyena"](d_model=d_model, l_max=16, filter_order=8, filter_bias=filter_bias).double()
    u = torch.randn(2, n_pos, d_model, dtype=torch.float64)
    projected = short_conv_loop(mixer.short_filter, u @ mixer.in_proj.weight.T + mixer.in_proj.bias)
    x1, x2, v = projected[..., :d_model], projected[..., d_model : 2 * d_model], projected[..., 2 * d_model :]
    gated = x1 * v
    long_conv = direct_causal_conv(gated, mixer.filter_fn(n_pos))
    if filter_bias:
        long_conv = long_conv + mixer.D * gated
    expected = (long_conv * x2) @ mixer.out_proj.weight.T + mixer.out_proj.bias
    torch.testing.assert_close(mixer(u), expected, rtol=0, atol=1e-12)


def h3_recurrent(mixer, u: torch.Tensor) -> torch.Tensor:
    """H3 as an RNN (zoology's `H3.step`): a shift register on k, a complex diagonal state on k⊗v."""
    batch, n_pos, d_model = u.shape
    heads, head_dim = mixer.n_heads, mixer.head_dim
    q, k, v = (proj(u) for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
    shift_B, shift_C = mixer.ssm_k_kernel.B, mixer.ssm_k_kernel.C
    A_bar, B_bar, C = diagonal_ssm_parameters(mixer.kernel)  # [head, mode]
    shift_state = torch.zeros(batch, d_model, shift_B.shape[1], dtype=u.dtype)
    kv_state = torch.zeros(batch, heads, head_dim, head_dim, A_bar.shape[1], dtype=torch.complex128)
    outputs = []
    for t in range(n_pos):
        shift_state = torch.cat([torch.zeros_like(shift_state[..., :1]), shift_state[..., :-1]], dim=-1)
        shift_state = shift_state + shift_B * k[:, t, :, None]
        k_shift = (shift_C * shift_state).sum(-1) + mixer.ssm_k_D * k[:, t]
        kv = k_shift.view(batch, heads, head_dim, 1) * v[:, t].view(batch, heads, 1, head_dim)
        kv_state = A_bar[:, None, None] * kv_state + B_bar[:, None, None] * kv[..., None]
        ssm = 2 * (C[:, None, None] * kv_state).sum(-1).real + mixer.D[:, None, None] * kv
        y = (q[:, t].view(batch, heads, head_dim, 1) * ssm).sum(2)  # [batch, head, d_v]
        outputs.append(mixer.out_proj(y.transpose(1, 2).reshape(batch, d_model)))
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("d_state", [4, 16])  # shorter than the sequence, and longer
def test_h3_matches_recurrent_reference(d_state):
    torch.manual_seed(0)
    mixer = REGISTRY["h3"](d_model=8, l_max=16, d_state=d_state, head_dim=2).double()
    with torch.no_grad():
        mixer.kernel.log_dt.uniform_(math.log(0.05), math.log(0.5))  # visible decay within 10 steps
        mixer.ssm_k_kernel.B.normal_()
    u = torch.randn(2, 10, 8, dtype=torch.float64)
    torch.testing.assert_close(mixer(u), h3_recurrent(mixer, u), rtol=0, atol=1e-10)


def test_h3_defaults_follow_the_papers_code():
    mixer = REGISTRY["h3"](d_model=64)
    assert mixer.ssm_k_kernel.d_state == 1024 and mixer.kernel.A_imag.shape == (32, 512)
    assert REGISTRY["h3"](d_model=64, l_max=40).ssm_k_kernel.d_state == 40  # d_state = l_max


# -- generic mixer properties ---------------------------------------------------------------
@pytest.mark.parametrize("name,options", CONFIGS, ids=CONFIG_IDS)
def test_shape_and_causality_in_float64(name, options):
    torch.manual_seed(0)
    mixer = REGISTRY[name](d_model=8, **options).double()
    u = torch.randn(2, 24, 8, dtype=torch.float64)
    out = mixer(u)
    assert out.shape == u.shape
    for t in (0, 7, 22):
        changed = u.clone()
        changed[:, t + 1 :] = torch.randn_like(changed[:, t + 1 :]) * 10
        torch.testing.assert_close(mixer(changed)[:, : t + 1], out[:, : t + 1], rtol=0, atol=1e-12)
    # Any length up to l_max, and the output of a prefix does not depend on what follows.
    torch.testing.assert_close(mixer(u[:, :9]), out[:, :9], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,options", CONFIGS, ids=CONFIG_IDS)
def test_gradients_reach_every_parameter(name, options):
    torch.manual_seed(0)
    mixer = REGISTRY[name](d_model=8, **options)
    mixer(torch.randn(2, 12, 8)).square().sum().backward()
    for param_name, param in mixer.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name
        assert param.grad.abs().sum() > 0, param_name


def test_long_convolutions_reject_sequences_longer_than_l_max():
    u = torch.randn(1, 9, 4)
    with pytest.raises(UsageError, match="l_max"):
        REGISTRY["hyena"](d_model=4, l_max=8)(u)
    with pytest.raises(UsageError, match="l_max"):
        REGISTRY["baseconv"](d_model=4, l_max=8, kernel_size=-1)(u)
    # H3's SSMs are defined at every length; zoology truncates its kernels to l_max lags.
    assert REGISTRY["h3"](d_model=4, l_max=8)(u).shape == u.shape
    # The short convolution has no length limit at all.
    assert REGISTRY["baseconv"](d_model=4, l_max=8)(u).shape == u.shape


@pytest.mark.parametrize(
    "name,options",
    [
        ("baseconv", {"kernel_size": 0}),
        ("baseconv", {"kernel_size": -2}),
        ("baseconv", {"l_max": 0, "kernel_size": -1}),
        ("hyena", {"short_filter_order": 0}),
        ("hyena", {"filter_order": 0}),
        ("h3", {"head_dim": 3}),
        ("h3", {"d_state": 7}),
        ("h3", {"l_max": 0}),
    ],
)
def test_invalid_options_are_usage_errors(name, options):
    with pytest.raises(UsageError, match=name):
        REGISTRY[name](d_model=8, **options)


# -- hooks inside a HookedLM ----------------------------------------------------------------
BATCH, N_POS, D_MODEL = 3, 10, 64
HEADS = D_MODEL // 2  # h3's default head_dim 2
# mixer -> per-layer options, then {hook: (shape, pos_axis)} per layer
HOOK_SPECS = {
    "baseconv": (
        [{"kernel_size": 3}, {"kernel_size": -1}],  # paper 000's BaseConv model
        [
            {"proj": ((BATCH, N_POS, D_MODEL), 1), "conv": ((BATCH, N_POS, D_MODEL), 1)},
            {
                "proj": ((BATCH, N_POS, D_MODEL), 1),
                "conv": ((BATCH, N_POS, D_MODEL), 1),
                "filter": ((N_POS, D_MODEL), None),
            },
        ],
    ),
    "hyena": (
        [{}, {}],
        [
            {
                "short_conv": ((BATCH, N_POS, 3 * D_MODEL), 1),
                **{n: ((BATCH, N_POS, D_MODEL), 1) for n in ("x1", "x2", "v", "long_conv", "y")},
                "filter": ((N_POS, D_MODEL), None),
            }
        ]
        * 2,
    ),
    "h3": (
        [{}, {}],
        [
            {
                **{n: ((BATCH, N_POS, HEADS, 2), 1) for n in ("q", "k", "v", "shift")},
                **{n: ((BATCH, N_POS, HEADS, 2, 2), 1) for n in ("kv", "ssm")},
                "shift_filter": ((N_POS, HEADS, 2), None),
                "ssm_filter": ((N_POS, HEADS), None),
            }
        ]
        * 2,
    ),
}


def hooked_model(name: str) -> HookedLM:
    layer_options, _ = HOOK_SPECS[name]
    torch.manual_seed(0)
    cfg = build_config(d_vocab=11, n_ctx=N_POS, mixers=name, n_layers=2, layer_options=layer_options)
    return HookedLM(cfg)


@pytest.mark.parametrize("name", sorted(HOOK_SPECS))
def test_every_inside_hook_fires_with_its_documented_shape(name):
    model = hooked_model(name)
    _, specs = HOOK_SPECS[name]
    tokens = torch.randint(0, 11, (BATCH, N_POS))
    _, cache = model.run_with_cache(tokens)
    for layer, spec in enumerate(specs):
        prefix = f"blocks.{layer}.mixer."
        inside = {h[len(prefix) + len("hook_") :] for h in model.hook_dict if h.startswith(prefix)}
        assert inside == set(spec), f"layer {layer}: hooks {sorted(inside)} vs documented {sorted(spec)}"
        for hook, (shape, pos_axis) in spec.items():
            full_name = f"{prefix}hook_{hook}"
            assert tuple(cache[full_name].shape) == shape, full_name
            assert model.hook_dict[full_name].pos_axis == pos_axis, full_name
            assert len(model.hook_dict[full_name].axes.split()) == len(shape), full_name


@pytest.mark.parametrize("name", sorted(HOOK_SPECS))
def test_every_inside_hook_feeds_the_output(name):
    # A hook whose return value were ignored would fire but could not be patched.
    model = hooked_model(name)
    tokens = torch.randint(0, 11, (BATCH, N_POS))
    clean = model(tokens)
    for hook in [h for h in model.hook_dict if ".mixer.hook_" in h]:
        patched = model.run_with_hooks(tokens, fwd_hooks=[(hook, lambda act, hook: torch.zeros_like(act))])
        assert not torch.allclose(patched, clean), hook
