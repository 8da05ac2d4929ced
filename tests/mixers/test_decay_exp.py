"""`decay_exp_`: exp without the CPU's slow path where it rounds to 0, and the bytes of `torch.exp`.

Exact comparisons throughout: the claim is not closeness but that each element is the very value
`torch.exp` computes (exp is elementwise, so moving the arguments that round to 0 onto the fast
path and writing the 0s must reproduce it bit for bit); the Mamba scan and the patching engine's
Mamba paths then compute on the same bytes as with `torch.exp`.
"""
from __future__ import annotations

import pytest
import torch

from hookmech.mixers import mamba as mamba_module
from hookmech.mixers import selective_scan as scan_module
from hookmech.mixers.decay_exp import FAST_PATH_MIN, ROUNDS_TO_ZERO_BELOW, decay_exp_, lowest_value
from hookmech.mixers.selective_scan import selective_scan


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def every_float32_between(low: float, high: float) -> torch.Tensor:
    """Every float32 in [low, high], both negative: their bit patterns are consecutive integers."""
    first, last = (torch.tensor(v, dtype=torch.float32).view(torch.int32).item() for v in (high, low))
    return torch.arange(first, last + 1, dtype=torch.int32).view(torch.float32)


def test_every_float32_across_the_underflow_range_gets_torch_exps_bits():
    x = every_float32_between(-110.0, -80.0)  # normal, subnormal and zero results, ~3.9M values
    assert x.min() < ROUNDS_TO_ZERO_BELOW and x.max() > FAST_PATH_MIN
    assert same_bits(decay_exp_(x.clone()), torch.exp(x))


def test_random_decays_in_every_range_and_a_strided_view_get_torch_exps_bits():
    generator = torch.Generator().manual_seed(0)
    x = -torch.rand(64, 300, generator=generator) * 300  # a third fast, a tenth subnormal, the rest 0
    assert same_bits(decay_exp_(x.clone()), torch.exp(x))
    view = x.clone().t()  # not contiguous
    assert same_bits(decay_exp_(view), torch.exp(x.t()))


def test_special_values_and_the_result_is_the_argument_overwritten():
    x = torch.tensor([float("nan"), float("-inf"), float("inf"), 0.0, -0.0, -87.0, -104.0, -1e30, 3.0])
    want = torch.exp(x)
    out = decay_exp_(x)
    assert out.data_ptr() == x.data_ptr()
    assert same_bits(out, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_are_plain_exp(dtype):
    x = torch.linspace(-800, 5, 1000, dtype=dtype)
    assert torch.equal(decay_exp_(x.clone()), torch.exp(x))


def test_a_tensor_autograd_records_keeps_exps_gradient():
    x = torch.linspace(-120, 2, 500).requires_grad_()
    ours = decay_exp_(x * 1.0)
    ours.sum().backward()
    assert same_bits(ours.detach(), torch.exp(x.detach()))
    assert same_bits(x.grad, torch.exp(x.detach()))


def plain_exp_(x: torch.Tensor, factors=None) -> torch.Tensor:
    return x.exp_()


def underflowing_scan_inputs(n_pos=40, batch=3, d_inner=8, d_state=16):
    """float32 inputs whose Δ A spans the fast, subnormal and zero ranges (as a Mamba at chance has)."""
    generator = torch.Generator().manual_seed(2)
    u = torch.randn(batch, n_pos, d_inner, generator=generator)
    delta = torch.rand(batch, n_pos, d_inner, generator=generator) * 8
    A = -torch.logspace(0, 1.6, d_state)[None, :].expand(d_inner, d_state).contiguous()  # -1 .. -40
    B = torch.randn(batch, n_pos, d_state, generator=generator)
    C = torch.randn(batch, n_pos, d_state, generator=generator)
    log_decay = delta[..., None] * A
    assert (log_decay < ROUNDS_TO_ZERO_BELOW).any() and ((log_decay < FAST_PATH_MIN) & (log_decay >= -104)).any()
    return [t.requires_grad_() for t in (u, delta, A, B, C)]


def scan_output_and_gradients(inputs):
    for t in inputs:
        t.grad = None
    y = selective_scan(*inputs, chunk=7)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return [y.detach()] + [t.grad.clone() for t in inputs]


def test_the_selective_scan_forward_and_backward_have_the_bytes_of_plain_exp(monkeypatch):
    inputs = underflowing_scan_inputs()
    ours = scan_output_and_gradients(inputs)
    monkeypatch.setattr(scan_module, "decay_exp_", plain_exp_)
    plain = scan_output_and_gradients(inputs)
    for name, a, b in zip(["y", "u", "delta", "A", "B", "C"], ours, plain, strict=True):
        assert same_bits(a, b), name


def test_a_mamba_at_chance_runs_the_patching_engine_on_the_bytes_of_plain_exp(monkeypatch):
    from hookmech.mixers import REGISTRY

    torch.manual_seed(0)
    mixer = REGISTRY["mamba"](d_model=16)
    with torch.no_grad():
        mixer.A_log.add_(4.0)  # A ~ -55 .. -870, Δ ~ 0.3 .. 2: most decays underflow, as at chance
        mixer.dt_proj.bias.copy_(torch.linspace(-1.0, 2.0, mixer.d_inner))
    x = torch.randn(2, 12, 16)
    with torch.no_grad():
        in_x, z = mixer._split(mixer.in_proj(x))
        ours = mixer._compute_base_branch(in_x, z)
        monkeypatch.setattr(mamba_module, "decay_exp_", plain_exp_)
        plain = mixer._compute_base_branch(in_x, z)
    decay = ours[3]
    assert (decay == 0).any() and ((decay > 0) & (decay < torch.finfo(torch.float32).tiny)).any()
    for a, b in zip(ours, plain, strict=True):
        assert same_bits(a, b)


def test_the_factors_bound_their_product_from_below_whatever_their_signs():
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        a = torch.randn(5, 7, generator=generator) * 10
        b = torch.randn(7, 3, generator=generator) * 10
        product = a[..., None] * b
        assert lowest_value(product, (a, b)) <= float(product.amin())
    assert lowest_value(product, None) == float(product.amin())


def test_a_bound_from_factors_takes_the_split_and_gives_the_same_bytes():
    delta = torch.linspace(0.0, 9.0, 200)
    A = -torch.linspace(1.0, 30.0, 16)
    x = delta[:, None] * A
    assert lowest_value(x, (delta, A)) < ROUNDS_TO_ZERO_BELOW
    assert same_bits(decay_exp_(x.clone(), factors=(delta, A)), torch.exp(x))
