"""Mamba-1 mixer: mamba-ssm's parameters and init, shapes, gradients, causality, the fast
scan against the sequential reference, equality with mambapy, inside hooks in a HookedLM,
state-patch propagation, and the fused-kernel dispatch.

Tolerances: float64 comparisons of two formulations of one computation (chunked vs sequential
scan, positionwise reference, hooked vs unhooked forward, gradients) use 1e-10..1e-14, float64
round-off over at most 32 positions; causality 1e-14 (the prefix's arithmetic is unchanged).
The float32 peers, mambapy and mamba-ssm's fused CUDA kernels, scan in another order: 1e-4 on
outputs and 1e-3 on gradients, float32 round-off accumulated through the recurrence.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch.nn import functional as F

from hookmech.config import build_config
from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY, SPECS
from hookmech.mixers import mamba as mamba_module
from hookmech.mixers.mamba import Mamba
from hookmech.mixers.selective_scan import linear_scan, selective_scan, selective_scan_ref, strided_selective_scan
from hookmech.model import HookedLM

from helpers import FLOAT64_SUM_TOL, assert_state_edit_propagates

D_MODEL = 32


def make_mixer(dtype=torch.double, **kwargs) -> Mamba:
    torch.manual_seed(0)
    return REGISTRY["mamba"](d_model=D_MODEL, **kwargs).to(dtype)


def scan_inputs(batch=2, n_pos=13, d_inner=6, d_state=4, dtype=torch.double, seed=1):
    torch.manual_seed(seed)
    u = torch.randn(batch, n_pos, d_inner, dtype=dtype)
    delta = F.softplus(torch.randn(batch, n_pos, d_inner, dtype=dtype))
    A = -torch.rand(d_inner, d_state, dtype=dtype) * 4 - 0.1
    B = torch.randn(batch, n_pos, d_state, dtype=dtype)
    C = torch.randn(batch, n_pos, d_state, dtype=dtype)
    return [t.requires_grad_() for t in (u, delta, A, B, C)]


# -- construction ---------------------------------------------------------------------
def test_parameters_are_mamba_ssm_keys_shapes_and_init():
    mixer = REGISTRY["mamba"](d_model=64)
    d_inner, dt_rank, d_state = 128, 4, 16  # expand 2, dt_rank ceil(64 / 16), mamba-ssm defaults
    shapes = {name: tuple(p.shape) for name, p in mixer.state_dict().items()}
    assert shapes == {
        "in_proj.weight": (2 * d_inner, 64),
        "conv1d.weight": (d_inner, 1, 4), "conv1d.bias": (d_inner,),
        "x_proj.weight": (dt_rank + 2 * d_state, d_inner),
        "dt_proj.weight": (d_inner, dt_rank), "dt_proj.bias": (d_inner,),
        "A_log": (d_inner, d_state), "D": (d_inner,),
        "out_proj.weight": (64, d_inner),
    }
    assert mixer.conv1d.groups == d_inner and mixer.conv1d.padding == (3,)
    torch.testing.assert_close(mixer.A_log, torch.log(torch.arange(1.0, 17.0)).expand(d_inner, -1))
    torch.testing.assert_close(mixer.D, torch.ones(d_inner))
    dt = F.softplus(mixer.dt_proj.bias.detach())  # inverse-softplus init: dt in [dt_min, dt_max]
    assert dt.min() >= 0.001 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    assert mixer.dt_proj.weight.abs().max() <= dt_rank**-0.5
    assert SPECS["mamba"].block_norm == "rmsnorm" and SPECS["mamba"].block_mlp is False


def test_state_dict_keys_equal_mambapys():
    mambapy = pytest.importorskip("mambapy.mamba")
    ours = REGISTRY["mamba"](d_model=48, d_state=8, d_conv=3)
    theirs = mambapy.MambaBlock(mambapy.MambaConfig(d_model=48, n_layers=1, d_state=8, d_conv=3))
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


def test_ablations_change_the_parameters():
    no_conv = REGISTRY["mamba"](d_model=D_MODEL, d_conv=0)
    assert not hasattr(no_conv, "conv1d") and not hasattr(no_conv, "hook_conv")
    no_gate = REGISTRY["mamba"](d_model=D_MODEL, gate=False)
    assert no_gate.in_proj.weight.shape == (2 * D_MODEL, D_MODEL) and not hasattr(no_gate, "hook_gate")
    assert REGISTRY["mamba"](d_model=D_MODEL, d_conv=1).conv1d.weight.shape == (2 * D_MODEL, 1, 1)


@pytest.mark.parametrize(
    "options",
    [{"d_conv": 5}, {"d_conv": -1}, {"d_state": 0}, {"expand": 0}, {"dt_rank": "big"},
     {"dt_min": 0.2}, {"dt_init": "zeros"}],
)
def test_invalid_options_raise_usage_error(options):
    with pytest.raises(UsageError, match="mamba"):
        REGISTRY["mamba"](d_model=D_MODEL, **options)


# -- behaviour of the mixer -------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"gate": False}, {"d_conv": 0}, {"d_conv": 1}])
def test_shape_and_gradients_reach_every_parameter(options):
    mixer = make_mixer(**options)
    u = torch.randn(2, 9, D_MODEL, dtype=torch.double)
    out = mixer(u)
    assert out.shape == u.shape
    out.pow(2).sum().backward()
    for name, param in mixer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("options", [{}, {"d_conv": 0}, {"d_conv": 2}, {"gate": False}])
def test_changing_the_future_never_changes_the_past(options):
    mixer = make_mixer(**options)
    u = torch.randn(2, 21, D_MODEL, dtype=torch.double)
    changed = u.clone()
    changed[:, 11:] = torch.randn_like(changed[:, 11:]) * 3
    torch.testing.assert_close(mixer(changed)[:, :11], mixer(u)[:, :11], rtol=0, atol=1e-14)
    assert not torch.allclose(mixer(changed)[:, 11:], mixer(u)[:, 11:])


def reference_forward(mixer: Mamba, x, patches=None):
    """Mamba-1 from the paper's equations, position by position, sharing only the
    parameters. `patches` maps position -> state ``[batch, d_inner, d_state]`` replacing
    h_t there. Returns (out, states)."""
    n_pos = x.shape[1]
    projected = x @ mixer.in_proj.weight.T
    in_x, z = projected.chunk(2, -1) if mixer.gate else (projected, None)
    if mixer.d_conv > 0:
        kernel = mixer.conv1d.weight[:, 0]  # [d_inner, d_conv], last tap = current position
        in_x = torch.stack([
            sum(in_x[:, t - lag] * kernel[:, -1 - lag] for lag in range(mixer.d_conv) if t >= lag)
            + mixer.conv1d.bias
            for t in range(n_pos)
        ], 1)
    u = F.silu(in_x)
    dt, B, C = (u @ mixer.x_proj.weight.T).split([mixer.dt_rank, mixer.d_state, mixer.d_state], -1)
    delta = F.softplus(dt @ mixer.dt_proj.weight.T + mixer.dt_proj.bias)
    A = -torch.exp(mixer.A_log)
    h = x.new_zeros(x.shape[0], mixer.d_inner, mixer.d_state)
    ys, states = [], []
    for t in range(n_pos):
        h = torch.exp(delta[:, t, :, None] * A) * h + (delta[:, t] * u[:, t])[..., None] * B[:, t, None, :]
        if patches and t in patches:
            h = patches[t]
        states.append(h)
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]) + mixer.D * u[:, t])
    y = torch.stack(ys, 1)
    if mixer.gate:
        y = y * F.silu(z)
    return y @ mixer.out_proj.weight.T, torch.stack(states, 1)


@pytest.mark.parametrize("options", [{}, {"d_conv": 3, "gate": False}, {"d_conv": 0}, {"d_state": 3, "expand": 1}])
def test_mixer_matches_a_positionwise_reference(options):
    mixer = make_mixer(**options)
    x = torch.randn(2, 19, D_MODEL, dtype=torch.double)
    expected, _ = reference_forward(mixer, x)
    torch.testing.assert_close(mixer(x), expected, rtol=1e-10, atol=1e-12)


# -- the scan kernels ---------------------------------------------------------------------
@pytest.mark.parametrize("chunk,n_pos", [(1, 7), (4, 13), (16, 13), (5, 40), (16, 64)])
def test_fast_scan_matches_the_sequential_reference_forward_and_backward(chunk, n_pos):
    inputs = scan_inputs(n_pos=n_pos)
    D = torch.randn(inputs[0].shape[-1], dtype=torch.double, requires_grad=True)
    weights = torch.randn(2, n_pos, inputs[0].shape[-1], dtype=torch.double)
    fast = selective_scan(*inputs, D, chunk=chunk)
    fast_grads = torch.autograd.grad((fast * weights).sum(), [*inputs, D])
    slow, _ = selective_scan_ref(*inputs, D)
    slow_grads = torch.autograd.grad((slow * weights).sum(), [*inputs, D])
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    for name, got, want in zip(["u", "delta", "A", "B", "C", "D"], fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("stride,n_pos", [(16, 7), (16, 40), (4, 13), (1, 5)])
def test_strided_scan_gives_the_output_and_every_strideth_state_of_the_sequential_reference(stride, n_pos):
    """`strided_selective_scan` (the engine's base runs): y as the sequential reference's (without
    D) and its states after positions stride - 1, 2 stride - 1, ... (none for a run shorter than a stride)."""
    u, delta, A, B, C = (t.detach() for t in scan_inputs(n_pos=n_pos))
    y, kept = strided_selective_scan(u, delta, A, B, C, stride)
    want, states = selective_scan_ref(u, delta, A, B, C)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    assert kept.shape == (u.shape[0], n_pos // stride, *states.shape[2:])
    torch.testing.assert_close(kept, states[:, stride - 1 :: stride][:, : n_pos // stride], rtol=1e-12, atol=1e-12)


def test_fast_scan_gradients_match_finite_differences():
    inputs = scan_inputs(batch=2, n_pos=9, d_inner=3, d_state=2)
    assert torch.autograd.gradcheck(lambda *a: selective_scan(*a, chunk=4), inputs)


def test_scan_from_an_initial_state_continues_the_sequence():
    """Scanning positions 5.. from the state after position 4 gives the tail of the whole scan;
    the initial state's gradient matches finite differences."""
    inputs = scan_inputs(n_pos=13)
    whole, states = selective_scan_ref(*inputs)
    u, delta, A, B, C = (t.detach() for t in inputs)
    tail = selective_scan(u[:, 5:], delta[:, 5:], A, B[:, 5:], C[:, 5:], chunk=4, h0=states[:, 4].detach())
    torch.testing.assert_close(tail, whole[:, 5:].detach(), rtol=1e-12, atol=1e-12)
    h0 = torch.randn_like(states[:, 4]).requires_grad_()
    assert torch.autograd.gradcheck(lambda h, *a: selective_scan(*a, chunk=3, h0=h),
                                    (h0, u[:, :7], delta[:, :7], A, B[:, :7], C[:, :7]))


@pytest.mark.parametrize("n_pos, batch", [(1, 1), (1, 5), (16, 1), (16, 5), (3, 32)])
def test_the_scans_state_major_read_out_is_the_product_in_the_mixers_layout(n_pos, batch):
    """The forward holds its states transposed ([T, b, d_state, d_inner]); its read-out is the
    product in the mixer's layout ([T, b, d_inner, d_state] times C), also for a batch of one
    product, which it computes in that layout (on this machine both give the same float32 bytes:
    docs/performance.md; across CPUs only the sum's rounding is promised)."""
    from hookmech.mixers.selective_scan import _read_out

    generator = torch.Generator().manual_seed(n_pos * 100 + batch)
    states = torch.randn(n_pos, batch, 64, 16, generator=generator, dtype=torch.float64)
    C = torch.randn(n_pos, batch, 16, generator=generator, dtype=torch.float64)
    in_the_mixers_layout = torch.matmul(states, C[..., None]).squeeze(-1)
    read = _read_out(C, states.transpose(-1, -2).contiguous())
    torch.testing.assert_close(read, in_the_mixers_layout, atol=FLOAT64_SUM_TOL, rtol=0)


def test_linear_scan_matches_a_loop_and_finite_differences():
    torch.manual_seed(0)
    a = torch.rand(2, 8, 3, 2, dtype=torch.double, requires_grad=True)
    b = torch.randn(2, 8, 3, 2, dtype=torch.double, requires_grad=True)
    h, expected = torch.zeros_like(b[:, 0]), []
    for t in range(8):
        h = a[:, t] * h + b[:, t]
        expected.append(h)
    torch.testing.assert_close(linear_scan(a, b), torch.stack(expected, 1), rtol=1e-14, atol=1e-14)
    assert torch.autograd.gradcheck(linear_scan, (a, b))


# -- equality with mambapy ----------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"d_conv": 2, "d_state": 8}])
def test_equals_mambapy_with_the_same_state_dict(options):
    mambapy = pytest.importorskip("mambapy.mamba")
    torch.manual_seed(0)
    ours = REGISTRY["mamba"](d_model=D_MODEL, **options)
    config = mambapy.MambaConfig(d_model=D_MODEL, n_layers=1, **options)
    theirs = mambapy.MambaBlock(config)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 32, D_MODEL)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, out_theirs = ours(x_ours), theirs(x_theirs)
    torch.testing.assert_close(out_ours, out_theirs, rtol=0, atol=1e-4)
    weights = torch.randn_like(out_ours)
    (out_ours * weights).sum().backward()
    (out_theirs * weights).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=0, atol=1e-3)


# -- hooks inside a HookedLM ----------------------------------------------------------------
def tiny_model(n_layers=2, **options) -> HookedLM:
    torch.manual_seed(0)
    cfg = build_config(d_vocab=20, n_ctx=24, mixers="mamba", d_model=D_MODEL, n_layers=n_layers,
                       layer_options=[dict(options) for _ in range(n_layers)])
    return HookedLM(cfg).double()


def test_inside_hooks_fire_with_documented_shapes():
    model = tiny_model()
    assert model.cfg.mlp == (False, False) and model.cfg.norms == ("rmsnorm", "rmsnorm")
    tokens = torch.randint(0, 20, (3, 12))
    logits, cache = model.run_with_cache(tokens)
    d_inner, d_state = 2 * D_MODEL, 16
    expected = {
        "in_x": (3, 12, d_inner), "gate": (3, 12, d_inner), "conv": (3, 12, d_inner),
        "conv_act": (3, 12, d_inner), "delta": (3, 12, d_inner), "B": (3, 12, d_state),
        "C": (3, 12, d_state), "ssm_state": (3, 12, d_inner, d_state), "y": (3, 12, d_inner),
    }
    for layer in (0, 1):
        mixer = model.blocks[layer].mixer
        for name, shape in expected.items():
            assert cache[f"blocks.{layer}.mixer.hook_{name}"].shape == shape, name
            hook = getattr(mixer, f"hook_{name}")
            assert len(hook.axes.split()) == len(shape) and hook.pos_axis == 1, name
    # Reading the state through its hook changes nothing, and it is the recurrence's state.
    torch.testing.assert_close(logits, model(tokens), rtol=1e-12, atol=1e-12)
    mixer_in = cache["blocks.1.hook_mixer_in"]
    out, states = reference_forward(model.blocks[1].mixer, mixer_in)
    torch.testing.assert_close(cache["blocks.1.mixer.hook_ssm_state"], states, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cache["blocks.1.hook_mixer_out"], out, rtol=1e-10, atol=1e-12)


def test_ablated_mixer_has_no_gate_or_conv_hooks():
    model = tiny_model(gate=False, d_conv=0)
    _, cache = model.run_with_cache(torch.randint(0, 20, (2, 8)))
    names = {name.split(".hook_")[-1] for name in cache.keys() if ".mixer.hook_" in name}
    assert names == {"in_x", "conv_act", "delta", "B", "C", "ssm_state", "y"}


def test_states_are_not_built_unless_their_hook_is_used(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the [batch, pos, d_inner, d_state] states were materialised")

    model = tiny_model()
    tokens = torch.randint(0, 20, (2, 10))
    monkeypatch.setattr(mamba_module, "linear_scan", forbidden)
    model(tokens)
    model.run_with_cache(tokens, names_filter=lambda name: not name.endswith("ssm_state"))
    with pytest.raises(AssertionError, match="materialised"):
        model.run_with_cache(tokens, names_filter=lambda name: name.endswith("ssm_state"))


def test_state_patch_propagates_to_later_positions():
    """Patch h at positions 4 (row 0) and 9 (both rows) in layer 1; the mixer output must be
    the sequential recurrence restarted from each patched state."""
    model = tiny_model()
    torch.manual_seed(3)
    tokens = torch.randint(0, 20, (2, 16))
    state_shape = model.run_with_cache(tokens)[1]["blocks.1.mixer.hook_ssm_state"].shape[2:]
    patch_4, patch_9 = torch.randn(state_shape, dtype=torch.double), torch.randn(2, *state_shape, dtype=torch.double)
    edits = {(0, 4): patch_4, (0, 9): patch_9[0], (1, 9): patch_9[1]}

    def reference(clean, edits):
        mixer_in = clean["blocks.1.hook_mixer_in"]  # layer 1's input does not depend on its own state
        # Row 0 restarts at 4 and again at 9; row 1 only at 9.
        row0, _ = reference_forward(model.blocks[1].mixer, mixer_in[:1], {4: patch_4[None], 9: patch_9[:1]})
        row1, _ = reference_forward(model.blocks[1].mixer, mixer_in[1:], {9: patch_9[1:]})
        return torch.cat([row0, row1])

    # in place, as TransformerLens examples do
    assert_state_edit_propagates(model, tokens, "blocks.1.mixer.hook_ssm_state", "blocks.1.hook_mixer_out", edits,
                                 reference, style="in_place_returned", rtol=1e-10, atol=1e-12)


# -- the fused CUDA path ----------------------------------------------------------------------
def fake_causal_conv1d_fn(x, weight, bias=None, activation=None):
    """causal-conv1d's contract: x [batch, channels, pos], weight [channels, width]."""
    width = weight.shape[1]
    out = F.conv1d(F.pad(x, (width - 1, 0)), weight[:, None, :], bias, groups=x.shape[1])
    return F.silu(out) if activation == "silu" else out


def fake_selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """mamba-ssm's contract: u, delta, z [batch, d_inner, pos]; B, C [batch, d_state, pos]."""
    delta = delta + delta_bias[:, None]
    delta = F.softplus(delta) if delta_softplus else delta
    y, _ = selective_scan_ref(u.transpose(1, 2), delta.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D)
    y = y.transpose(1, 2)
    return y if z is None else y * F.silu(z)


@pytest.fixture
def fake_fused(monkeypatch):
    calls = []

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(mamba_module, "fused_kernels_available", lambda x: True)
    monkeypatch.setattr(mamba_module, "causal_conv1d_fn", recording("conv", fake_causal_conv1d_fn))
    monkeypatch.setattr(mamba_module, "selective_scan_fn", recording("scan", fake_selective_scan_fn))
    return calls


@pytest.mark.parametrize(
    "options,expected_calls",
    [({}, ["conv", "scan"]), ({"gate": False, "d_conv": 2}, ["conv", "scan"]),
     ({"d_conv": 1}, ["scan"]), ({"d_conv": 0}, ["scan"])],
)
def test_fused_path_is_taken_without_hooks_and_agrees_with_pure(fake_fused, options, expected_calls):
    fused = make_mixer(**options)
    pure = make_mixer(use_fast_path=False, **options)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.double)
    out = fused(x)
    assert fake_fused == expected_calls
    assert pure(x) is not None and fake_fused == expected_calls  # use_fast_path=False: never fused
    expected, _ = reference_forward(fused, x)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_fused_path_is_skipped_while_an_inside_hook_is_in_use(fake_fused):
    model = tiny_model()
    tokens = torch.randint(0, 20, (2, 8))
    model(tokens)
    assert fake_fused == ["conv", "scan"] * 2
    fake_fused.clear()
    model.run_with_cache(tokens, names_filter=lambda name: name == "blocks.0.mixer.hook_delta")
    assert fake_fused == ["conv", "scan"]  # layer 1 has no hook in use, layer 0 does
    fake_fused.clear()
    model.run_with_hooks(tokens, bwd_hooks=[("blocks.1.mixer.hook_y", lambda grad, hook: None)])
    assert fake_fused == ["conv", "scan"]


def test_fused_kernels_are_never_used_on_cpu():
    assert mamba_module.fused_kernels_available(torch.zeros(1)) is False


def _fused_kernels_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("mamba_ssm", "causal_conv1d"))


@pytest.mark.skipif(not (torch.cuda.is_available() and _fused_kernels_installed()),
                    reason="needs CUDA with mamba-ssm and causal-conv1d installed")
def test_fused_kernels_match_the_pure_path_on_cuda():
    torch.manual_seed(0)
    mixer = REGISTRY["mamba"](d_model=64).cuda()
    x = torch.randn(4, 64, 64, device="cuda", requires_grad=True)
    assert mamba_module.fused_kernels_available(x)
    fused = mixer(x)
    (grad_fused,) = torch.autograd.grad(fused.square().sum(), x)
    mixer.use_fast_path = False
    pure = mixer(x)
    (grad_pure,) = torch.autograd.grad(pure.square().sum(), x)
    torch.testing.assert_close(fused, pure, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(grad_fused, grad_pure, rtol=1e-3, atol=1e-3)


def test_dt_rank_auto_is_ceil_d_model_over_16():
    assert REGISTRY["mamba"](d_model=33).dt_rank == math.ceil(33 / 16) == 3
