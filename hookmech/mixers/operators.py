"""Sequence operations as matrices over positions: the pieces the mixers' `effective_attention`
share (see `EffectiveAttentionMap.effective_attention` and `hookmech.effective_attention`).

Two kinds of causal operator occur:

* a recurrence with a decay, h_t = a_t h_{t-1} + ..., contributes Π_{r=s+1..t} a_r from position
  s to t: `causal_decay` forms it from cumulative sums of log a, masked before exp so that it
  stays in [0, 1] however long the sequence (a product exp(c_t) · exp(-c_s) would overflow);
* a convolution y_t = Σ_s h_{t-s} u_s is the Toeplitz matrix T[t, s] = h_{t-s}: `toeplitz`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_decay(log_to_query: Tensor, log_to_key: Tensor, strict: bool = False) -> Tensor:
    """Return ``exp(log_to_query[..., t] - log_to_key[..., s])`` where s <= t (s < t with
    `strict`) and 0 elsewhere, ``[..., query_pos, key_pos]``.

    With cumulative sums c_t = Σ_{r<=t} log a_r for both arguments this is the decay
    Π_{r=s+1..t} a_r from key s to query t; `log_to_query` ``[..., pos]`` and `log_to_key`
    ``[..., pos]`` broadcast against each other.
    """
    n_pos = log_to_query.shape[-1]
    positions = torch.arange(n_pos, device=log_to_query.device)
    reach = positions[None, :] < positions[:, None] if strict else positions[None, :] <= positions[:, None]
    log_decay = log_to_query[..., :, None] - log_to_key[..., None, :]
    return torch.exp(log_decay.masked_fill(~reach, float("-inf")))


def toeplitz(kernel: Tensor, n_pos: int) -> Tensor:
    """Return the causal convolution by `kernel` ``[lag, *channels]`` as a matrix per channel,
    ``[*channels, query_pos, key_pos]``: ``T[..., t, s] = kernel[t - s]`` for 0 <= t - s < lags,
    0 elsewhere (`long_conv.fft_causal_conv`'s operator)."""
    positions = torch.arange(n_pos, device=kernel.device)
    lag = positions[:, None] - positions[None, :]
    inside = (lag >= 0) & (lag < kernel.shape[0])
    taps = kernel[lag.clamp(0, kernel.shape[0] - 1)]  # [t, s, *channels]
    taps = taps * inside.view(n_pos, n_pos, *([1] * (kernel.dim() - 1)))
    return taps.movedim((0, 1), (-2, -1))
