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


def rotate(x: Tensor, positions: Tensor, dim: int, base: float) -> Tensor:
    """Return `x` ``[..., pos, head, d_head]`` with its first `dim` channels of each head rotated
    for its position: `positions` holds the absolute position of each of x's ``pos`` entries,
    ``[pos]`` or ``[batch, pos]`` (broadcast against x's leading axes)."""
    if dim == 0:
        return x
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [..., pos, dim/2]
    angles = torch.cat((angles, angles), dim=-1)[..., None, :]  # [..., pos, 1 (head), dim]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    turning, passing = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated_half = torch.cat((-turning[..., half:], turning[..., :half]), dim=-1)
    return torch.cat((turning * cos + rotated_half * sin, passing), dim=-1)
