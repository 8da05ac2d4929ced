"""Mamba-1's closed forms for the analyses that read the SSM unrolled: the state path and the
convolution path of path patching (`PathRoutes`) and the effective attention of the view
(`EffectiveAttentionMap`, the form L ∘ C Bᵀ of Dao & Gu 2024 §3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..shapes import EffectiveAttention, Resid, RunActs, RunMask, RunResid
from .capabilities import EffectiveAttentionMap, PathRoutes
from .operators import causal_decay
from .selective_scan import linear_scan
from .short_conv import causal_taps


class MambaRoutes(PathRoutes, EffectiveAttentionMap):
    """`PathRoutes` and `EffectiveAttentionMap` of the Mamba-1 mixer (`mamba.Mamba` inherits them)."""

    if TYPE_CHECKING:  # the Mamba mixer's members these methods read (`mamba.Mamba` defines them)
        in_proj: nn.Linear
        out_proj: nn.Linear
        conv1d: nn.Conv1d
        d_conv: int
        d_inner: int
        d_state: int
        D: nn.Parameter

        def _split(self, projected: Tensor) -> tuple[Tensor, Tensor | None]: ...

        def _ssm_inputs(self, in_x: Tensor, convolved: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...

        def _A(self) -> Tensor: ...

    def effective_attention(self, x: Resid) -> EffectiveAttention:
        """Return M ``[batch, d_inner, query_pos, key_pos]`` (float32): the selective SSM
        unrolled into a matrix per channel (the "attention" form L ∘ C Bᵀ of Dao & Gu 2024 §3,
        with the selective decay and the Δ of B̄ = Δ B):

            M[d, t, s] = Σ_n C_t[n] exp(Σ_{r=s+1..t} Δ_r[d] A[d, n]) Δ_s[d] B_s[n]     (s <= t)

        M leaves out the skip D ⊙ u, and no hook holds the SSM output without it, so what M
        reproduces is ``hook_y[b, t, d] = Σ_s M[b, d, t, s] u[b, s, d] + D[d] u[b, t, d]`` with
        u = ``hook_conv_act``. Built in float64, one state dimension n at a time (the largest
        tensor is one ``[batch, d_inner, pos, pos]``).
        """
        _, delta, B, C = (t.double() for t in self._ssm_inputs(self._split(self.in_proj(x))[0]))
        # Σ_{r<=t} Δ_r A: the decays of every pair of positions are differences of these
        log_decay = torch.cumsum(delta[..., None] * self._A().double(), dim=1).permute(0, 2, 3, 1)  # [b, d, n, t]
        written = delta.transpose(1, 2)[:, :, None, :]  # Δ_s [b, d, 1, s]
        M = x.new_zeros(x.shape[0], self.d_inner, x.shape[1], x.shape[1], dtype=torch.float64)
        for n in range(self.d_state):
            decay = causal_decay(log_decay[:, :, n], log_decay[:, :, n])  # [b, d, t, s]
            M += C[:, None, :, n, None] * decay * written * B[:, None, None, :, n]
        return M.float()

    def state_path(self, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_y`` ``[run, pos, d_inner]`` along the state path: with
        w_t = Δ_t u_t B_tᵀ the write of position t, the state changes by

            ΔH_t = exp(Δ_t A) ⊙ ΔH_{t-1} + [t is a sender] (w_t(clean) − w_t(corrupt))

        (Δ of the corrupt run: its own decays), and the read-out y_t = h_t C_t + D ⊙ u_t by ΔH_t C_t
        (C of the corrupt run). A sender's write reaches its own position and every later one."""
        writes = []
        for x in (clean, corrupt):
            u, delta, B, C = self._ssm_inputs(self._split(self.in_proj(x))[0])
            writes.append((delta * u)[..., None] * B[:, :, None, :])
        # the loop leaves Δ and C of the corrupt run, the last one
        change = torch.where(senders[:, :, None, None], writes[0] - writes[1], torch.zeros_like(writes[1]))
        states = linear_scan(torch.exp(delta[..., None] * self._A()), change)
        return (states @ C[..., None])[..., 0]

    def conv_hooks(self) -> dict[str, tuple[str, ...]]:
        """``{"conv": ("in_x", "conv")}``: the convolution of the SSM branch (none with d_conv 0)."""
        return {"conv": ("in_x", "conv")} if self.d_conv > 0 else {}

    def conv_path(self, receiver: str, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_conv`` ``[run, pos, d_inner]`` when in_x at the `senders`
        positions is the clean run's: the taps (no bias) applied to the clean-minus-corrupt in_x."""
        in_clean, in_corrupt = (self._split(self.in_proj(x))[0] for x in (clean, corrupt))
        change = torch.where(senders[..., None], in_clean - in_corrupt, torch.zeros_like(in_corrupt))
        return causal_taps(change, self.conv1d.weight)
