"""Long causal convolutions by FFT, and Hyena's implicitly parametrised filter.

Shared by `baseconv`, `hyena` and `h3` (zoology's ``mixers/convolution.py`` and
``mixers/hyena.py``; Poli et al. 2023, "Hyena Hierarchy", §3.3).

A causal convolution over L positions, ``y_t = Σ_{s=0..t} h_s u_{t-s}``, is a pointwise
product in the frequency domain once both signals are zero-padded to at least 2L-1 points.
With less padding the FFT computes a *circular* convolution, which wraps the end of the
sequence onto its start, i.e. leaks the future into the past; we pad to 2L as zoology does.

The implicit filter (Hyena eq. 7) is ``h_t = FFN(PositionalEmbedding(t)) · Window(t)``: a
small MLP with sine activations reads a fixed positional embedding of t and an exponential
decay (different rate per channel) windows its output. It depends on positions only, never
on the input, so its hook has no position axis.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import UsageError
from .base import kept


def fft_causal_conv(u: Tensor, k: Tensor) -> Tensor:
    """Return the causal convolution ``y[:, t] = Σ_{s=0..t} k[s] · u[:, t-s]``, shaped like `u`.

    `u` is ``[batch, pos, *channels]``; `k` is ``[lag, *channels]`` (its channel axes broadcast
    against u's). Lags of `k` beyond ``pos - 1`` are ignored; missing lags count as zero.
    Computed in (at least) float32, since torch's FFT does not take half precision on CPU.
    """
    n_pos = u.shape[1]
    fft_size = 2 * n_pos  # >= 2L-1: linear, not circular, convolution (see module docstring)
    dtype = torch.promote_types(u.dtype, torch.float32)
    u_f = torch.fft.rfft(u.to(dtype), n=fft_size, dim=1)
    k_f = torch.fft.rfft(k[:n_pos].to(dtype), n=fft_size, dim=0)
    return torch.fft.irfft(u_f * k_f, n=fft_size, dim=1)[:, :n_pos].to(u.dtype)


#: windows of at most this many positions convolve their change directly (`toeplitz_causal_conv`):
#: on CPU (one thread, 256 rows, 128-256 channels) the direct sums took 1.7-5x less time than the
#: FFT from 14 to 128 positions and about as long below; beyond, the FFT's O(W log W) wins in the end
DIRECT_CONV_MAX_POS = 128


def resumed_causal_conv(
    window: Tensor, base_in: Tensor, base_out: Tensor, k: Tensor, keep: Tensor | None = None
) -> Tensor:
    """Return `fft_causal_conv` by `k` at a window of W positions, ``[B, W, *channels]``, of a run
    whose input is `window` ``[B, W, *channels]`` there and a base run's before it, from that base
    run's convolution input `base_in` and output `base_out` at the window (same shape). With
    `keep` ``[B]`` (window indices): the output there only, ``[B, 1, *channels]``.

    The convolution is linear and the two inputs differ only from the window's start on, so
    the output is the base run's plus the convolution of the change over the window alone,
    however long the run (`k`'s lags beyond W - 1 are not read): directly for a short window,
    else by an FFT of W positions; at `keep`, one sum over the window.
    """
    change = window - base_in
    if keep is not None:
        return kept(base_out, keep) + causal_conv_at(change, k, keep)
    if window.shape[1] <= DIRECT_CONV_MAX_POS:
        return base_out + toeplitz_causal_conv(change, k)
    return base_out + fft_causal_conv(change, k)


def toeplitz_causal_conv(u: Tensor, k: Tensor) -> Tensor:
    """Return `fft_causal_conv` (same arguments, same shape) as sums over positions: a ``[pos,
    pos]`` Toeplitz matrix of `k` per channel times `u`, O(pos²) but cheaper for a short `u`."""
    n_pos = u.shape[1]
    positions = torch.arange(n_pos, device=u.device)
    dtype = torch.promote_types(u.dtype, torch.float32)
    taps = lag_taps(k.to(dtype), positions[:, None] - positions)  # [t, s, *k's channels]: k[t - s]
    matrix = taps.expand(n_pos, n_pos, *u.shape[2:]).reshape(n_pos, n_pos, -1)
    out = torch.einsum("tsc,bsc->btc", matrix, u.to(dtype).reshape(*u.shape[:2], -1))
    return out.view(u.shape).to(u.dtype)


def causal_conv_at(u: Tensor, k: Tensor, at: Tensor) -> Tensor:
    """Return the causal convolution of `u` ``[B, W, *channels]`` by `k` ``[lag, *channels]`` at
    index ``at[i]`` of each row only, ``Σ_{s <= at} k[at - s] · u[:, s]``: ``[B, 1, *channels]``
    (lags beyond `k`'s count as zero, as in `fft_causal_conv`)."""
    dtype = torch.promote_types(u.dtype, torch.float32)
    taps = lag_taps(k.to(dtype), at[:, None] - torch.arange(u.shape[1], device=u.device))  # [B, W, ...]
    return (taps * u.to(dtype)).sum(1, keepdim=True).to(u.dtype)


def lag_taps(k: Tensor, lags: Tensor) -> Tensor:
    """Return `k` ``[lag, *channels]`` at `lags` (any shape), ``[*lags.shape, *channels]``: zero
    where a lag is negative (the future) or beyond `k`'s last."""
    reached = ((lags >= 0) & (lags < len(k))).view(*lags.shape, *([1] * (k.dim() - 1)))
    return k[lags.clamp(0, len(k) - 1)] * reached


def positional_embedding(l_max: int, emb_dim: int) -> tuple[Tensor, Tensor]:
    """Return Hyena's filter input ``z [l_max, emb_dim]`` and normalised time ``t [l_max, 1]``.

    ``z = [t, Re e^{-i f w}, Im e^{-i f w}]`` with ``t = linspace(0, 1, l_max)``,
    ``w = 2π·position/l_max`` and ``(emb_dim-1)/2`` frequencies ``f = linspace(1e-4, bands-1, bands)``
    (zoology's `PositionalEmbedding`, constants included).
    """
    bands = (emb_dim - 1) // 2
    t = torch.linspace(0, 1, l_max)[:, None]
    w = 2 * math.pi * torch.arange(l_max, dtype=torch.float32)[:, None] / l_max
    f = torch.linspace(1e-4, bands - 1, bands)[None, :]
    return torch.cat([t, torch.cos(f * w), -torch.sin(f * w)], dim=-1), t


class ImplicitFilter(nn.Module):
    """A long filter ``h [pos, channels]`` computed from positions by a sine-activated MLP.

    ``h_t = (Linear ∘ (sin ∘ Linear)^(1+num_inner_mlps))(z_t) · (exp(-|δ_c| t) + shift)``.
    The sine frequency is one trainable vector shared by every activation (zoology reuses one
    `Sin` module); ``t`` and the decay rates ``δ`` are fixed and recomputed from `l_max` at
    construction, so they are not part of the state dict. So is ``z`` by default; ``train_z=True``
    makes it a parameter (``z`` in the state dict), as zoology's Hyena does: it registers ``z`` as
    a parameter meant for lr 1e-5, which an optimizer over all parameters at one learning rate
    (paper 000's code) trains at that rate. zoology's BaseConv freezes it.
    """

    # buffers (z may be a parameter instead)
    z: Tensor
    t: Tensor
    deltas: Tensor

    def __init__(
        self,
        channels: int,
        l_max: int,
        order: int = 16,
        emb_dim: int = 3,
        frequency: float = 1.0,
        num_inner_mlps: int = 2,
        fast_decay_pct: float = 0.3,
        slow_decay_pct: float = 1.5,
        target: float = 1e-2,
        shift: float = 0.0,
        train_z: bool = False,
    ):
        super().__init__()
        if l_max < 1:
            raise UsageError(f"implicit filter: l_max must be >= 1, got {l_max}")
        if emb_dim < 3 or emb_dim % 2 == 0:
            raise UsageError(f"implicit filter: emb_dim must be odd and >= 3 (time, cos, sin), got {emb_dim}")
        if order < 1:
            raise UsageError(f"implicit filter: order (MLP width) must be >= 1, got {order}")
        self.l_max, self.shift = l_max, shift
        z, t = positional_embedding(l_max, emb_dim)
        if train_z:
            self.z = nn.Parameter(z)
        else:
            self.register_buffer("z", z, persistent=False)
        self.register_buffer("t", t, persistent=False)
        # Decay rates spread over channels so that some filters stay long and others are short:
        # the window reaches `target` at fraction `fast_decay_pct`..`slow_decay_pct` of l_max.
        deltas = torch.linspace(math.log(target) / slow_decay_pct, math.log(target) / fast_decay_pct, channels)
        self.register_buffer("deltas", deltas, persistent=False)
        widths = [emb_dim] + [order] * (num_inner_mlps + 1)
        self.implicit_filter = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True))
        self.implicit_filter.append(nn.Linear(order, channels, bias=False))
        self.freq = nn.Parameter(frequency * torch.ones(order))

    def forward(self, n_pos: int) -> Tensor:
        """Return the filter ``[n_pos, channels]`` for the first `n_pos` lags (n_pos <= l_max)."""
        if n_pos > self.l_max:
            raise UsageError(f"sequence of {n_pos} positions exceeds the filter's l_max {self.l_max}")
        h = self.z[:n_pos]
        for layer in self.implicit_filter[:-1]:
            h = torch.sin(self.freq * layer(h))
        h = self.implicit_filter[-1](h)
        return h * (torch.exp(-self.t[:n_pos] * self.deltas.abs()) + self.shift)
