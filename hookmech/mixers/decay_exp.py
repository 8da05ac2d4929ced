"""exp(Δ A) for a state-space decay, bit for bit `torch.exp`, without its slow path on underflow.

On the CPU, float32 `exp` of an argument below about -87.3, where the result is subnormal or 0,
costs 6-40 times as much an element as elsewhere (bench/decay_exp.py). A Mamba that does not
learn drives Δ A far below that: in the chance-level models of results/ar-table 23-43 % of the
decays underflow to 0, and exp alone took 40 % of their training step. `decay_exp_` replaces
every argument whose result rounds to 0 by one on the fast path, then writes the 0s; the
arguments with subnormal results (about 1 % there) keep the slow path. Every other element is
exp of its own value, so the bytes are those of `torch.exp` (tests/mixers/test_decay_exp.py checks
every float32 in the boundary range, and the scan's outputs and gradients bit for bit).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: float32 exp is normal (and on its vectorised path) at and above this argument
FAST_PATH_MIN = -87.0
#: float32 exp rounds to exactly 0 below this: under -150 ln 2 = -103.97, exp(x) is less than half
#: the smallest subnormal, 2^-149
ROUNDS_TO_ZERO_BELOW = -104.0


def decay_exp_(x: Tensor, factors: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Return `x` overwritten with exp(x), the bytes `torch.exp` gives, any shape.

    Only a float32 CPU tensor that autograd does not record takes the split; anything else is
    `x.exp_()` itself (the masks would give autograd another graph). When `x` is the broadcast
    product of two `factors` (Δ and A), their extremes bound x from below without reading it (Δ
    is 1/d_state of Δ A); the bound only chooses the path, and both paths give the same bytes.
    """
    if x.dtype != torch.float32 or x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
        return x.exp_()
    if x.numel() == 0 or lowest_value(x, factors) >= ROUNDS_TO_ZERO_BELOW:
        return x.exp_()
    rounds_to_zero = x < ROUNDS_TO_ZERO_BELOW
    return x.masked_fill_(rounds_to_zero, FAST_PATH_MIN).exp_().masked_fill_(rounds_to_zero, 0.0)


def lowest_value(x: Tensor, factors: tuple[Tensor, Tensor] | None) -> float:
    """Return a lower bound of `x`: its minimum, or the least product of its factors' extremes,
    less a margin for the float32 rounding of the products in `x`."""
    if factors is None:
        return float(x.amin())
    a, b = factors
    if a.numel() == 0 or b.numel() == 0:
        return float(x.amin())
    a_low, a_high = (float(v) for v in a.aminmax())
    b_low, b_high = (float(v) for v in b.aminmax())
    bound = min(a_low * b_low, a_low * b_high, a_high * b_low, a_high * b_high)
    return bound - abs(bound) * 1e-6  # each product in x is rounded by at most 2^-24 of itself
