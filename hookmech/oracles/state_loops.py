"""The recurrences of the mixers' `state` path routes, one position at a time: the reference that
path patching's `state` routes are tested against (`path_patch_reference`), written out plainly.

Each loop is (mixer, acts, senders) -> the mixer's `PathRoutes.state_readout` hook at every
position ``[N, T, ...]`` when the writes of the `senders` positions ``[N, T]`` are the clean run's
and everything else (transitions, other writes, read-outs) the corrupt run's; ``acts(hook, which)``
reads inside hook `hook` (its short name) of run `which` ("clean" or "corrupt"). `STATE_LOOPS`
holds them by mixer name (a mixer with a `state` route and no loop here is refused by the
reference, by name).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..mixers.based import Based
from ..mixers.deltanet import DeltaNet
from ..mixers.gla import GatedLinearAttention
from ..mixers.mamba import Mamba
from ..mixers.mamba2 import Mamba2
from ..mixers.rwkv import RWKV6


def based_state_loop(mixer: Based, acts, senders: Tensor) -> Tensor:
    """The `state` route of Based: S_t = S_{t-1} + φ(k_t) v_tᵀ and z_t = z_{t-1} + φ(k_t), read out
    as φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + eps) (hook_y), one position at a time."""
    phi_q, phi_k, v = (acts(name, "corrupt") for name in ("phi_q", "phi_k", "v"))
    phi_k_l, v_l = acts("phi_k", "clean"), acts("v", "clean")
    S = v.new_zeros(v.shape[0], v.shape[2], phi_k.shape[3], v.shape[3])  # [N, head, feature, d_head]
    z = v.new_zeros(v.shape[0], v.shape[2], phi_k.shape[3])
    out = []
    for t in range(v.shape[1]):
        sender = senders[:, t, None, None]
        S = S + torch.where(
            sender[..., None],
            phi_k_l[:, t, :, :, None] * v_l[:, t, :, None, :],
            phi_k[:, t, :, :, None] * v[:, t, :, None, :],
        )
        z = z + torch.where(sender, phi_k_l[:, t], phi_k[:, t])
        numerator = (phi_q[:, t, :, :, None] * S).sum(-2)
        out.append(numerator / ((phi_q[:, t] * z).sum(-1)[..., None] + mixer.eps))
    return torch.stack(out, dim=1)


def deltanet_state_loop(mixer: DeltaNet, acts, senders: Tensor) -> Tensor:
    """The `state` route of DeltaNet: S_t = S_{t-1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, read out as
    S_t q_t (hook_y), one position at a time."""
    q, k, v, beta = (acts(name, "corrupt") for name in ("q", "k", "v", "beta"))
    k_l, v_l, beta_l = (acts(name, "clean") for name in ("k", "v", "beta"))
    S = v.new_zeros(v.shape[0], v.shape[2], v.shape[3], k.shape[3])  # [N, head, d_v, d_k]
    out = []
    for t in range(v.shape[1]):
        corrupt_write = beta[:, t, :, None, None] * v[:, t, :, :, None] * k[:, t, :, None, :]
        clean_write = beta_l[:, t, :, None, None] * v_l[:, t, :, :, None] * k_l[:, t, :, None, :]
        write = torch.where(senders[:, t, None, None, None], clean_write, corrupt_write)
        kept = S - beta[:, t, :, None, None] * (S @ k[:, t, :, :, None]) * k[:, t, :, None, :]  # S (I - β k kᵀ)
        S = kept + write
        out.append((S @ q[:, t, :, :, None])[..., 0])
    return torch.stack(out, dim=1)


def gla_state_loop(mixer: GatedLinearAttention, acts, senders: Tensor) -> Tensor:
    """The `state` route of GLA: S_t = diag(exp(log α_t)) S_{t-1} + k_tᵀ v_t, read out as
    q_t S_t / √d_k (hook_y), one position at a time."""
    q, k, v, log_decay = (acts(name, "corrupt") for name in ("q", "k", "v", "gate"))
    k_l, v_l = acts("k", "clean"), acts("v", "clean")
    S = v.new_zeros(v.shape[0], v.shape[2], k.shape[3], v.shape[3])  # [N, head, d_k, d_v]
    out = []
    for t in range(v.shape[1]):
        corrupt_write = k[:, t, :, :, None] * v[:, t, :, None, :]
        clean_write = k_l[:, t, :, :, None] * v_l[:, t, :, None, :]
        write = torch.where(senders[:, t, None, None, None], clean_write, corrupt_write)
        S = torch.exp(log_decay[:, t])[..., None] * S + write
        out.append((q[:, t, :, :, None] * S).sum(-2) * k.shape[3] ** -0.5)
    return torch.stack(out, dim=1)


def mamba_state_loop(mixer: Mamba, acts, senders: Tensor) -> Tensor:
    """The `state` route of Mamba: h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t, read out as C_t h_t + D u_t
    (hook_y), one position at a time."""
    A = -torch.exp(mixer.A_log)
    delta, u, B, C = (acts(name, "corrupt") for name in ("delta", "conv_act", "B", "C"))
    delta_l, u_l, B_l = (acts(name, "clean") for name in ("delta", "conv_act", "B"))
    h = u.new_zeros(u.shape[0], u.shape[2], A.shape[1])
    out = []
    for t in range(u.shape[1]):
        corrupt_write = (delta[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        clean_write = (delta_l[:, t] * u_l[:, t])[:, :, None] * B_l[:, t, None, :]
        write = torch.where(senders[:, t, None, None], clean_write, corrupt_write)
        h = torch.exp(delta[:, t, :, None] * A) * h + write
        out.append((h * C[:, t, None, :]).sum(-1) + mixer.D * u[:, t])
    return torch.stack(out, dim=1)


def mamba2_state_loop(mixer: Mamba2, acts, senders: Tensor) -> Tensor:
    """The `state` route of Mamba-2: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_tᵀ per head, read out as
    h_t C_t + D x_t (hook_y), one position at a time."""
    A = -torch.exp(mixer.A_log)
    delta, x, B, C = (acts(name, "corrupt") for name in ("delta", "conv_act", "B", "C"))
    delta_l, x_l, B_l = (acts(name, "clean") for name in ("delta", "conv_act", "B"))
    per_head = x.shape[2] // B.shape[2]
    B, C, B_l = (t.repeat_interleave(per_head, dim=2) for t in (B, C, B_l))
    h = x.new_zeros(*x.shape[:1], *x.shape[2:], B.shape[-1])  # [N, head, headdim, d_state]
    out = []
    for t in range(x.shape[1]):
        corrupt_write = (delta[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        clean_write = (delta_l[:, t, :, None] * x_l[:, t])[..., None] * B_l[:, t, :, None, :]
        write = torch.where(senders[:, t, None, None, None], clean_write, corrupt_write)
        h = torch.exp(delta[:, t] * A)[:, :, None, None] * h + write
        out.append((h * C[:, t, :, None, :]).sum(-1) + mixer.D[:, None] * x[:, t])
    return torch.stack(out, dim=1)


def rwkv_state_loop(mixer: RWKV6, acts, senders: Tensor) -> Tensor:
    """The `state` route of RWKV-6: position t reads r_t (S_{t-1} + diag(u) k_tᵀ v_t) (hook_output),
    then S_t = diag(exp(−exp(w_t))) S_{t-1} + k_tᵀ v_t, one position at a time."""
    r, k, v, w = (acts(name, "corrupt") for name in ("r", "k", "v", "decay"))
    k_l, v_l = acts("k", "clean"), acts("v", "clean")
    bonus = mixer.time_faaaa
    S = v.new_zeros(v.shape[0], v.shape[2], k.shape[3], v.shape[3])  # [N, head, d_k, d_v]
    out = []
    for t in range(v.shape[1]):
        corrupt_write = k[:, t, :, :, None] * v[:, t, :, None, :]
        clean_write = k_l[:, t, :, :, None] * v_l[:, t, :, None, :]
        out.append(((S + bonus[..., None] * corrupt_write) * r[:, t, :, :, None]).sum(-2))
        write = torch.where(senders[:, t, None, None, None], clean_write, corrupt_write)
        S = torch.exp(-torch.exp(w[:, t]))[..., None] * S + write
    return torch.stack(out, dim=1)


#: mixer name -> its `state` route's loop
STATE_LOOPS: dict[str, Callable[..., Tensor]] = {
    "based": based_state_loop,
    "deltanet": deltanet_state_loop,
    "gla": gla_state_loop,
    "mamba": mamba_state_loop,
    "mamba2": mamba2_state_loop,
    "rwkv": rwkv_state_loop,
}
