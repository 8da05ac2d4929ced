"""Rotary position embeddings (Su et al. 2021, "RoFormer"), as GPT-NeoX and Pythia apply them:
to the first `dim` channels of each head's queries and keys (a fraction of the head, ``rotary_pct``),
channel i paired with channel i + dim/2 (``rotate_half``, not GPT-J's adjacent pairs), the pair
rotated by angle ``position · base^(-2i/dim)``; the other channels pass unchanged.

The angles are computed in float32 from the positions (never stored: no buffer to cast with the
model's dtype), as transformers' ``GPTNeoXRotaryEmbedding`` does, then cast to the input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import UsageError


def rotary_dim(d_head: int, fraction: float) -> int:
    """Return how many channels of a head of width `d_head` rotate at rotary fraction `fraction`
    (transformers' ``int(head_size * rotary_pct)``): an even number; a UsageError otherwise."""
    if not 0.0 <= fraction <= 1.0:
        raise UsageError(f"attention: rotary_pct must be in [0, 1], got {fraction}")
    dim = int(d_head * fraction)
    if dim % 2:
        raise UsageError(
            f"attention: rotary_pct {fraction} of d_head {d_head} rotates {dim} channels: pairs need an even number"
        )
    return dim


def rotate(x: Tensor, positions: Tensor, dim: int, base: float, turns: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Return `x` ``[..., pos, head, d_head]`` with its first `dim` channels of each head rotated
    for its position: `positions` holds the absolute position of each of x's ``pos`` entries,
    ``[pos]`` or ``[batch, pos]`` (broadcast against x's leading axes). `turns`: `rotation`'s
    (cos, sin) of those positions, when the caller rotates several tensors by them (q and k)."""
    if dim == 0:
        return x
    cos, sin = rotation(positions, dim, base, x) if turns is None else turns
    half = dim // 2
    first, second = x[..., :half], x[..., half:dim]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # channel i turns with channel i + dim/2 (``rotate_half``): x cos + (-x_{i+dim/2}, x_i) sin,
    # written as one difference and one sum per half (the same roundings: a + (-b) is a - b)
    out[..., :half] = first * cos[..., :half] - second * sin[..., :half]
    out[..., half:dim] = second * cos[..., half:] + first * sin[..., half:]
    out[..., dim:] = x[..., dim:]
    return out


def rotation(positions: Tensor, dim: int, base: float, like: Tensor) -> tuple[Tensor, Tensor]:
    """Return (cos, sin) ``[..., pos, 1 (head), dim]`` of the angles of `positions` (as `rotate`
    takes them) in `like`'s dtype and device, each half of the last axis the same."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=like.device) / dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [..., pos, dim/2]
    angles = torch.cat((angles, angles), dim=-1)[..., None, :]  # [..., pos, 1 (head), dim]
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)
