"""Mamba-2 (Dao & Gu 2024, "Transformers are SSMs", the SSD layer), in plain PyTorch.

Parameter names follow `mamba_ssm.modules.mamba2_simple.Mamba2Simple` (`in_proj, conv1d,
dt_bias, A_log, D, norm, out_proj`; `conv1d` has `nn.Conv1d`'s keys). Per head h, with a
*scalar* decay (the SSD restriction of Mamba-1's diagonal A, paper §7):

    z, xBC, dt  = in_proj(u)                    (split d_inner | d_inner + 2·G·N | H)
    x, B, C     = silu(conv1d(xBC))             (causal depthwise conv, kernel d_conv)
    Δ_t         = softplus(dt_t + dt_bias)      [H]   (clamped to dt_limit where one is set)
    a_t         = exp(Δ_t · A),  A = -exp(A_log)
    h_t         = a_t h_{t-1} + Δ_t x_t B_tᵀ    [headdim, d_state] per head
    y_t         = h_t C_t + D x_t
    out         = out_proj(rmsnorm(y ⊙ silu(z)) ⊙ norm.weight)

`ssd_sequential` is that recurrence as a loop; `ssd_chunked` is the paper's chunked SSD
algorithm (§6: quadratic "attention" form inside chunks, the recurrence between chunks),
the default under autograd; `ssd_recurrent` is the recurrence in place, faster on CPU where
nothing needs a gradient (the patching engine's runs); `ssd` chooses. All are pinned together
by the tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import UsageError
from ..hooks import AxisHookPoint, declare_sizes, hook_in_use
from ..shapes import (
    Context,
    EffectiveAttention,
    KeptWindow,
    Resid,
    RowInts,
    RunActs,
    RunMask,
    RunResid,
    Window,
)
from .base import Mixer, kept, needs_grad, one_pass, replay_before, state_before
from .capabilities import EffectiveAttentionMap, PathRoutes
from .mixer_spec import Heads, MixerSpec
from .operators import causal_decay
from .selective_scan import linear_scan
from .short_conv import ShortConv, causal_taps
from .state_patch import hook_state_with_propagation


def _expand_groups(bc: Tensor, n_heads: int) -> Tensor:
    """[..., groups, d_state] -> [..., n_heads, d_state]: heads share their group's B/C."""
    return bc.repeat_interleave(n_heads // bc.shape[-2], dim=-2)


def ssd_sequential(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The SSD recurrence, one position at a time (the reference).

    x ``[batch, pos, head, headdim]``, dt ``[batch, pos, head]`` (after softplus), A ``[head]``
    (negative), B, C ``[batch, pos, group, d_state]``, initial_state ``[batch, head, headdim,
    d_state]`` or None (zeros). Returns y ``[batch, pos, head, headdim]`` (without the D skip)
    and the states after each position ``[batch, pos, head, headdim, d_state]``.
    """
    batch, n_pos, n_heads, headdim = x.shape
    B, C = _expand_groups(B, n_heads), _expand_groups(C, n_heads)
    h = x.new_zeros(batch, n_heads, headdim, B.shape[-1]) if initial_state is None else initial_state
    ys, states = [], []
    for t in range(n_pos):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
        states.append(h)
    return torch.stack(ys, dim=1), torch.stack(states, dim=1)


def ssd_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    initial_state: Tensor | None = None,
    return_all_states: bool = False,
) -> tuple[Tensor, Tensor]:
    """The chunked SSD algorithm (Dao & Gu 2024, §6); same arguments as `ssd_sequential`.

    Returns y ``[batch, pos, head, headdim]`` and, with `return_all_states`, the state after
    every position ``[batch, pos, head, headdim, d_state]``; otherwise only the final state
    ``[batch, head, headdim, d_state]`` (no per-position state is materialised).
    """
    if return_all_states:
        # every state is materialised anyway: the recurrence makes them in O(T·headdim·d_state),
        # where the chunked form's all-state contraction costs chunk_size times more
        return ssd_scan(x, dt, A, B, C, initial_state)
    n_chunks = -(-x.shape[1] // chunk_size)
    chunk_size = -(-x.shape[1] // n_chunks)  # equal chunks: 35 positions make two of 18, not 32 and 3 padded to 32
    y, after_each = _ssd_chunks(x, dt, A, B, C, chunk_size, initial_state)
    return y, after_each[:, -1]


def ssd_kept_states(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, stride: int) -> tuple[Tensor, Tensor]:
    """Return ``(y, kept)``: the chunked SSD (arguments as `ssd_sequential`, from the zero state) in
    chunks of exactly `stride` positions (the last one padded), y ``[batch, pos, head, headdim]``
    as `ssd_chunked`'s, and kept ``[batch, pos // stride, head, headdim, d_state]``, the states
    after positions stride - 1, 2 stride - 1, ...: the chunks' boundary states, which the chunked
    form computes anyway."""
    y, after_each = _ssd_chunks(x, dt, A, B, C, stride, None)
    # contiguous: a resume looks rows up in the row-flattened states, which a view would copy whole
    return y, after_each[:, : x.shape[1] // stride].contiguous()


def _ssd_chunks(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, initial_state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The chunked SSD in chunks of `chunk_size` positions (the last one padded with no-ops):
    returns y ``[batch, pos, head, headdim]`` and the state after each chunk ``[batch, chunks,
    head, headdim, d_state]`` (after the last: the final state)."""
    batch, n_pos, n_heads, headdim = x.shape
    groups, d_state = B.shape[-2:]
    n_chunks = -(-n_pos // chunk_size)
    pad = n_chunks * chunk_size - n_pos
    if pad:
        # dt = 0 pads are no-ops of the recurrence (decay 1, no input); they are cut off below.
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    # Head-major chunks, heads split by their group ([b, c, g, h/g, Q, ...]), so that every
    # product below is one batched matmul, and C·B, the same for a group's heads, is made once.
    per_group = n_heads // groups
    x = x.reshape(batch, n_chunks, chunk_size, groups, per_group, headdim).permute(0, 1, 3, 4, 2, 5)
    dt = dt.reshape(batch, n_chunks, chunk_size, groups, per_group).permute(0, 1, 3, 4, 2)
    B, C = (t.reshape(batch, n_chunks, chunk_size, groups, 1, d_state).permute(0, 1, 3, 4, 2, 5) for t in (B, C))

    log_decay = torch.cumsum(dt * A.view(groups, per_group, 1), dim=-1)  # [b,c,g,h/g,Q]: log a_1 ... a_t
    # decay_ts[t, s] = a_{s+1} ... a_t for s <= t; differences of cumulative sums stay <= 0
    # (no overflow), and the mask is applied before exp.
    segsum = log_decay[..., :, None] - log_decay[..., None, :]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay_ts = torch.exp(segsum.masked_fill(~causal, float("-inf")))  # [b,c,g,h/g,t,s]
    dtx = dt[..., None] * x  # Δ_s x_s: the input of position s

    # Intra-chunk: y_t = Σ_{s<=t} (C_t·B_s) decay_ts Δ_s x_s, the "attention" form.
    y = ((C @ B.transpose(-1, -2)) * decay_ts) @ dtx  # [b,c,g,h/g,Q,p]

    # Inter-chunk: the state entering each chunk, by the recurrence over chunks.
    decay_to_end = torch.exp(log_decay[..., -1:] - log_decay)  # [b,c,g,h/g,Q]
    chunk_input = (dtx * decay_to_end[..., None]).transpose(-1, -2) @ B  # [b,c,g,h/g,p,n]
    chunk_decay = torch.exp(log_decay[..., -1])[..., None, None]  # [b,c,g,h/g,1,1]
    h = x.new_zeros(batch, n_heads, headdim, d_state) if initial_state is None else initial_state
    h = h.reshape(batch, groups, per_group, headdim, d_state)
    entering_each: list[Tensor] = []
    for c in range(n_chunks):
        entering_each.append(h)
        h = chunk_decay[:, c] * h + chunk_input[:, c]
    entering = torch.stack(entering_each, dim=1)  # [b,c,g,h/g,p,n]
    y = y + (C * torch.exp(log_decay)[..., None]) @ entering.transpose(-1, -2)
    y = y.permute(0, 1, 4, 2, 3, 5).reshape(batch, n_chunks * chunk_size, n_heads, headdim)
    after_each = torch.cat([entering[:, 1:], h[:, None]], dim=1)
    return y[:, :n_pos], after_each.reshape(batch, n_chunks, n_heads, headdim, d_state)


def ssd_recurrent(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    initial_state: Tensor | None = None,
    return_all_states: bool = False,
) -> tuple[Tensor, Tensor]:
    """The SSD recurrence, each state written once in place into the states' tensor: not
    differentiable, for runs without autograd. Same arguments and returns as `ssd_chunked`.

    Asked for every state it is the fastest form (1.6x faster than `ssd_scan` at 35 positions,
    256 rows, 16 heads of 16 x 64); the chunked form is faster for the output alone."""
    batch, n_pos, n_heads, headdim = x.shape
    B, C = _expand_groups(B, n_heads), _expand_groups(C, n_heads)
    decay = torch.exp(dt * A)[..., None, None]  # [b, t, h, 1, 1]
    dtx = (dt[..., None] * x)[..., None]  # [b, t, h, p, 1]
    states = x.new_empty(batch, n_pos, n_heads, headdim, B.shape[-1])
    state = x.new_zeros(states[:, 0].shape) if initial_state is None else initial_state
    for t in range(n_pos):
        state = torch.mul(state, decay[:, t], out=states[:, t]).addcmul_(dtx[:, t], B[:, t, :, None, :])
    y = (states @ C[..., None]).squeeze(-1)
    return y, (states if return_all_states else state.clone())


def ssd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    initial_state: Tensor | None = None,
    return_all_states: bool = False,
) -> tuple[Tensor, Tensor]:
    """The SSD kernel the mixer runs (arguments and returns as `ssd_chunked`): every state
    asked for and nothing needing a gradient, `ssd_recurrent`; else `ssd_chunked` (which, asked
    for every state, scans). For the output alone the chunked form is the faster (at d_state
    64 its products beat the recurrence's passes over the state from 8 positions on)."""
    if return_all_states and not needs_grad(x, dt, A, B, C, initial_state):
        return ssd_recurrent(x, dt, A, B, C, initial_state, return_all_states)
    return ssd_chunked(x, dt, A, B, C, chunk_size, initial_state, return_all_states)


def ssd_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The SSD recurrence with every state materialised, as one linear scan (differentiable);
    same arguments as `ssd_sequential`. Returns y ``[batch, pos, head, headdim]`` (y_t = h_t C_t)
    and the states after each position ``[batch, pos, head, headdim, d_state]``."""
    n_heads = x.shape[2]
    B, C = _expand_groups(B, n_heads), _expand_groups(C, n_heads)
    writes = (dt[..., None] * x)[..., None] * B[:, :, :, None, :]  # Δ_t x_t B_tᵀ
    decay = torch.exp(dt * A)[..., None, None].expand_as(writes)
    if initial_state is not None:  # h_0 = a_0 h_init + w_0
        writes = torch.cat([writes[:, :1] + decay[:, :1] * initial_state[:, None], writes[:, 1:]], dim=1)
    states = linear_scan(decay, writes)
    return (states @ C[..., None]).squeeze(-1), states


#: the gated norm's epsilon by default: mamba-ssm's, and transformers' default ``layer_norm_epsilon``
GATED_NORM_EPS = 1e-5


class GatedRMSNorm(nn.Module):
    """rmsnorm(y ⊙ silu(z)) ⊙ weight over groups of channels (mamba-ssm's `RMSNormGated`
    with `norm_before_gate=False`). Returns ``[..., d_inner]``."""

    def __init__(self, d_inner: int, group_size: int, eps: float = GATED_NORM_EPS):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(d_inner))

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        gated = y * F.silu(z)
        grouped = gated.unflatten(-1, (-1, self.group_size))
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.flatten(-2) * self.weight


class Mamba2(Mixer, PathRoutes, EffectiveAttentionMap):
    """The Mamba-2 mixer: ``[batch, pos, d_model] -> [batch, pos, d_model]``.

    Inside hooks (G = ngroups, H = nheads = expand·d_model / headdim, N = d_state):
    ``hook_in_x`` ``[batch, pos, d_inner]`` (x branch of in_proj, before the conv);
    ``hook_gate`` ``[batch, pos, d_inner]`` (z, before silu);
    ``hook_conv`` ``[batch, pos, d_inner]`` (x after the conv, before silu);
    ``hook_conv_act`` ``[batch, pos, head, headdim]`` (the SSM input x);
    ``hook_delta`` ``[batch, pos, head]`` (Δ after softplus, and after the `dt_limit` clamp);
    ``hook_B``, ``hook_C`` ``[batch, pos, group, d_state]``;
    ``hook_ssm_state`` ``[batch, pos, head, headdim, d_state]``, the state after each
    position, materialised only while a hook is attached; edits propagate;
    ``hook_y`` ``[batch, pos, head, headdim]`` (SSM output with the D skip, before the gated norm).
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        d_conv: int = 4,
        expand: int = 2,
        headdim: int = 16,
        ngroups: int = 1,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 32,
        dt_limit: Sequence[float | None] | None = None,
        norm_eps: float = GATED_NORM_EPS,
    ):
        super().__init__()
        d_inner = expand * d_model
        for name, value in (
            ("d_state", d_state),
            ("expand", expand),
            ("headdim", headdim),
            ("ngroups", ngroups),
            ("chunk_size", chunk_size),
        ):
            if value < 1:
                raise UsageError(f"mamba2: {name} must be >= 1, got {value}")
        if d_conv < 0:
            raise UsageError(f"mamba2: d_conv must be >= 0 (0 removes the convolution), got {d_conv}")
        if d_inner % headdim:
            raise UsageError(f"mamba2: d_inner = expand*d_model = {d_inner} is not divisible by headdim {headdim}")
        n_heads = d_inner // headdim
        if n_heads % ngroups:
            raise UsageError(f"mamba2: nheads {n_heads} is not divisible by ngroups {ngroups}")
        if not 0 < A_init_range[0] <= A_init_range[1]:
            raise UsageError(f"mamba2: A_init_range must be 0 < low <= high, got {A_init_range}")
        if not 0 < dt_min <= dt_max:
            raise UsageError(f"mamba2: need 0 < dt_min <= dt_max, got {dt_min}, {dt_max}")
        self.dt_limit = _check_dt_limit(dt_limit)
        if not 0 < norm_eps < 1:
            raise UsageError(f"mamba2: norm_eps must be in (0, 1), got {norm_eps}")
        self.d_inner, self.d_state, self.headdim = d_inner, d_state, headdim
        self.n_heads, self.ngroups, self.chunk_size = n_heads, ngroups, chunk_size

        # in_proj order as mamba-ssm: [z, x, B, C, dt]
        self.in_proj = nn.Linear(d_model, 2 * d_inner + 2 * ngroups * d_state + n_heads, bias=bias)
        conv_dim = d_inner + 2 * ngroups * d_state
        self.conv1d = ShortConv(conv_dim, d_conv, bias=conv_bias) if d_conv > 0 else None

        # Δ's bias is the inverse softplus of a log-uniform dt in [dt_min, dt_max] (mamba-ssm).
        dt = torch.exp(torch.rand(n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.empty(n_heads).uniform_(*A_init_range).log())
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm = GatedRMSNorm(d_inner, group_size=d_inner // ngroups, eps=norm_eps)
        self.out_proj = nn.Linear(d_inner, d_model, bias=bias)

        self.hook_in_x = AxisHookPoint("batch pos d_inner")
        self.hook_gate = AxisHookPoint("batch pos d_inner")
        self.hook_conv = AxisHookPoint("batch pos d_inner")
        self.hook_conv_act = AxisHookPoint("batch pos head headdim")
        self.hook_delta = AxisHookPoint("batch pos head")
        self.hook_B = AxisHookPoint("batch pos group d_state")
        self.hook_C = AxisHookPoint("batch pos group d_state")
        self.hook_ssm_state = AxisHookPoint("batch pos head headdim d_state")
        self.hook_y = AxisHookPoint("batch pos head headdim")
        declare_sizes(self, group=ngroups)

    def forward(self, u: Resid) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]`` of ``u [batch, pos, d_model]``."""
        return self._hooked_forward(u)[0]

    def _hooked_forward(self, u: Resid, with_context: bool = False) -> tuple[Resid, Context | None]:
        """Return (forward(u), None); with `with_context`, the run's context (`prefix_context`)
        from the same pass instead of None (not for a hooked state, whose edits it would miss)."""
        batch, n_pos, _ = u.shape
        d_bc = self.ngroups * self.d_state
        z, x, bc, dt = self.in_proj(u).split([self.d_inner, self.d_inner, 2 * d_bc, self.n_heads], dim=-1)
        z = self.hook_gate(z)
        xbc = torch.cat([self.hook_in_x(x), bc], dim=-1)
        conv_input = xbc  # what a resumed window's convolution reads of earlier positions
        if self.conv1d is not None:
            xbc = self.conv1d(xbc)
        x, B, C = xbc.split([self.d_inner, d_bc, d_bc], dim=-1)
        x = self.hook_conv_act(F.silu(self.hook_conv(x)).view(batch, n_pos, self.n_heads, self.headdim))
        B = self.hook_B(F.silu(B).view(batch, n_pos, self.ngroups, self.d_state))
        C = self.hook_C(F.silu(C).view(batch, n_pos, self.ngroups, self.d_state))
        dt = self.hook_delta(self._delta(dt))
        A = -torch.exp(self.A_log)

        context: Context | None = None
        if with_context:  # never with a hooked state (`Mixer.forward_with_context`)
            y, every = ssd_kept_states(x, dt, A, B, C, self.STATE_STRIDE)
            context = {"xbc": conv_input.contiguous(), "x": x.contiguous(), "dt": dt, "B": B.contiguous()}
            context["ssm_state"] = every
        elif hook_in_use(self.hook_ssm_state):
            y = self._ssd_through_state_hook(x, dt, A, B, C)
        else:
            y, _ = ssd(x, dt, A, B, C, self.chunk_size)
        y = self.hook_y(y + self.D[:, None] * x)
        y = self.norm(y.reshape(batch, n_pos, self.d_inner), z)
        return self.out_proj(y), context

    def effective_attention(self, u: Resid) -> EffectiveAttention:
        """Return M ``[batch, head, query_pos, key_pos]`` (float32): SSD's matrix per head
        (Dao & Gu 2024 §3-4, M = L ∘ C Bᵀ with a scalar decay per head, Δ folded into B):

            M[h, t, s] = (C_t · B_s) exp(Σ_{r=s+1..t} Δ_r[h] A[h]) Δ_s[h]     (s <= t)

        M leaves out the skip D ⊙ x, and no hook holds the SSD output without it, so what M
        reproduces is ``hook_y[b, t, h] = Σ_s M[b, h, t, s] x[b, s, h] + D[h] x[b, t, h]``
        with x = ``hook_conv_act`` (``[..., head, headdim]``: one M for the head's channels).
        """
        _, xbc, dt = self._in_proj(u)
        _, dt, B, C = self._ssm_inputs(self.conv1d(xbc) if self.conv1d is not None else xbc, dt)
        dt = dt.double().transpose(1, 2)  # [b, h, t]
        B, C = (_expand_groups(t, self.n_heads).double() for t in (B, C))  # heads share their group's
        log_decay = torch.cumsum(dt * -torch.exp(self.A_log.double())[:, None], dim=-1)  # Σ_{r<=t} Δ_r A
        scores = torch.einsum("bthn,bshn->bhts", C, B)
        return (scores * causal_decay(log_decay, log_decay) * dt[:, :, None, :]).float()

    # -- path patching (see `PathRoutes`) -------------------------------------
    head_outputs = ("y",)
    head_inputs = ("conv_act", "delta", "B", "C")
    state_hooks = ("ssm_state",)
    state_readout = "y"

    def state_path(self, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_y`` ``[run, pos, head, headdim]`` along the state path: with
        w_t = Δ_t x_t B_tᵀ the write of position t (per head),

            ΔH_t = exp(Δ_t A) ΔH_{t-1} + [t is a sender] (w_t(clean) − w_t(corrupt))

        with the corrupt run's Δ (its own decays), read out as ΔH_t C_t with its C."""
        writes = []
        for u in (clean, corrupt):
            _, xbc, dt = self._in_proj(u)
            x, dt, B, C = self._ssm_inputs(self.conv1d(xbc) if self.conv1d is not None else xbc, dt)
            writes.append((dt[..., None] * x)[..., None] * _expand_groups(B, self.n_heads)[:, :, :, None, :])
        # the loop leaves Δ and C of the corrupt run, the last one
        change = torch.where(senders[:, :, None, None, None], writes[0] - writes[1], torch.zeros_like(writes[1]))
        decay = torch.exp(dt * -torch.exp(self.A_log))[..., None, None].expand_as(change).contiguous()
        states = linear_scan(decay, change)
        return torch.einsum("bthpn,bthn->bthp", states, _expand_groups(C, self.n_heads))

    def conv_hooks(self) -> dict[str, tuple[str, ...]]:
        """``{"conv": ("in_x", "conv")}``: the convolution's x channels (none with d_conv 0)."""
        return {"conv": ("in_x", "conv")} if self.conv1d is not None else {}

    def conv_path(self, receiver: str, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_conv`` ``[run, pos, d_inner]`` (the x channels of the
        convolution over xBC) when x at the `senders` positions is the clean run's."""
        assert self.conv1d is not None  # conv_hooks declares no convolution otherwise
        x_clean, x_corrupt = (self._in_proj(u)[1][..., : self.d_inner] for u in (clean, corrupt))
        change = torch.where(senders[..., None], x_clean - x_corrupt, torch.zeros_like(x_corrupt))
        return causal_taps(change, self.conv1d.weight[: self.d_inner])

    # -- resuming from a position (see `Mixer.forward_from`) ---------------------------------
    # A state is headdim·d_state = 1024 numbers per head and position, the SSD's inputs 21 times
    # fewer: the context keeps a state every STATE_STRIDE positions and the inputs everywhere,
    # and a resumed run replays the at most STATE_STRIDE - 1 positions in between (writing every
    # state cost more, in fresh memory alone, than all the resumed runs of a sweep). The kept
    # states are the boundaries of the base run's chunked SSD in chunks of STATE_STRIDE
    # (`ssd_kept_states`): one pass gives the output and them.
    STATE_STRIDE = 16

    def prefix_context(self, u: RunResid) -> Context:
        """Return, for a run on `u` ``[N, T, d_model]``: ``xbc`` ``[N, T, conv_dim]``, the conv's
        input (the window's conv reads the d_conv - 1 positions before it); the SSD's inputs
        ``x`` ``[N, T, head, headdim]``, ``dt`` ``[N, T, head]``, ``B`` ``[N, T, group, d_state]``;
        and ``ssm_state`` ``[N, T // STATE_STRIDE, head, headdim, d_state]``, the state after
        positions STATE_STRIDE - 1, 2 STATE_STRIDE - 1, ..."""
        return self._output_and_context(u)[1]

    def fused_forward_with_context(self, u: RunResid, hooked: bool) -> tuple[RunResid, Context] | None:
        """Return ``(forward(u), prefix_context(u))`` from one pass (`one_pass`)."""
        return one_pass(self._hooked_forward, u, hooked, self._output_and_context)

    def _output_and_context(self, u: RunResid) -> tuple[RunResid, Context]:
        z, xbc, dt = self._in_proj(u)
        x, dt, B, C = self._ssm_inputs(self.conv1d(xbc) if self.conv1d is not None else xbc, dt)
        A = -torch.exp(self.A_log)
        y, every = ssd_kept_states(x, dt, A, B, C, self.STATE_STRIDE)
        y = self.norm((y + self.D[:, None] * x).flatten(2), z)
        # contiguous: views of in_proj's output would be copied whole by each resume's row lookups
        inputs = {"xbc": xbc.contiguous(), "x": x.contiguous(), "dt": dt.contiguous(), "B": B.contiguous()}
        return self.out_proj(y), {**inputs, "ssm_state": every}

    def state_from_context(self, name: str, context: Context, rows: RowInts, positions: RowInts) -> Tensor:
        """Return ``hook_ssm_state`` of the context's run at ``positions[i]`` of row ``rows[i]``,
        ``[B, head, headdim, d_state]``: the state before the next position (`_state_before`; see
        `Mixer.state_from_context`)."""
        assert name in self.state_hooks
        return self._state_before(context, rows, positions + 1)

    def _state_before(self, context: Context, rows: RowInts, start: RowInts) -> Tensor:
        """Return the base run's state after position ``start[i] - 1`` of row ``rows[i]``
        ``[B, head, headdim, d_state]``: the context's last kept state before it, carried over
        the positions in between with the base run's inputs."""
        stride = self.STATE_STRIDE
        kept_state = state_before(context["ssm_state"], rows, start // stride)
        (x, dt, B), live = replay_before([context["x"], context["dt"], context["B"]], rows, start, stride)
        dt = dt * live[..., None]  # Δ = 0: decay 1, no input, a no-op
        return ssd_chunked(x, dt, -torch.exp(self.A_log), B, B, stride - 1, initial_state=kept_state)[1]

    window_hooks = True

    def forward_from(
        self, u: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output ``[B, W, d_model]`` at the window `u` ``[B, W, d_model]`` (see
        `Mixer.forward_from`): in_proj on the window only, SSD from the state at start - 1. The
        inside hooks fire on the window; a state edit is carried on from the window's start."""
        batch, n_pos, _ = u.shape
        d_bc = self.ngroups * self.d_state
        z, x, bc, dt = self.in_proj(u).split([self.d_inner, self.d_inner, 2 * d_bc, self.n_heads], dim=-1)
        z = self.hook_gate(z)
        xbc = torch.cat([self.hook_in_x(x), bc], dim=-1)
        if self.conv1d is not None:
            xbc = self.conv1d.forward_from(xbc, context["xbc"], rows, start)
        x, B, C = xbc.split([self.d_inner, d_bc, d_bc], dim=-1)
        x = self.hook_conv_act(F.silu(self.hook_conv(x)).view(batch, n_pos, self.n_heads, self.headdim))
        B = self.hook_B(F.silu(B).view(batch, n_pos, self.ngroups, self.d_state))
        C = self.hook_C(F.silu(C).view(batch, n_pos, self.ngroups, self.d_state))
        dt = self.hook_delta(self._delta(dt))
        A = -torch.exp(self.A_log)
        initial = self._state_before(context, rows, start)
        if hook_in_use(self.hook_ssm_state):
            y = self._ssd_through_state_hook(x, dt, A, B, C, initial)
        else:
            y, _ = ssd(x, dt, A, B, C, self.chunk_size, initial_state=initial)
        y = self.hook_y(y + self.D[:, None] * x)
        y = self.norm(y.reshape(batch, n_pos, self.d_inner), z)
        return self.out_proj(kept(y, keep))

    def _in_proj(self, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Return z ``[b, t, d_inner]``, xBC before the conv ``[b, t, conv_dim]`` and dt before
        softplus ``[b, t, head]`` (as `forward`, without its hooks)."""
        d_bc = self.ngroups * self.d_state
        z, xbc, dt = self.in_proj(u).split([self.d_inner, self.d_inner + 2 * d_bc, self.n_heads], dim=-1)
        return z, xbc, dt

    def _ssm_inputs(self, xbc: Tensor, dt: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Return the SSD's x ``[b, t, head, headdim]``, Δ ``[b, t, head]``, B, C ``[b, t, group,
        d_state]`` from the conv's output xBC and the raw dt (as `forward`, without its hooks)."""
        batch, n_pos, _ = xbc.shape
        d_bc = self.ngroups * self.d_state
        x, B, C = F.silu(xbc).split([self.d_inner, d_bc, d_bc], dim=-1)
        x = x.reshape(batch, n_pos, self.n_heads, self.headdim)
        B, C = (t.reshape(batch, n_pos, self.ngroups, self.d_state) for t in (B, C))
        return x, self._delta(dt), B, C

    def _delta(self, dt: Tensor) -> Tensor:
        """Return Δ ``[b, t, head]`` of in_proj's raw dt: softplus(dt + dt_bias), clamped to
        `dt_limit` where one is set (mamba-ssm's and transformers' ``dt_limit``/``time_step_limit``,
        applied after the softplus as they do)."""
        delta = F.softplus(dt + self.dt_bias)
        if self.dt_limit is None:  # no clamp at all: the bytes of models made before the option
            return delta
        return delta.clamp(*self.dt_limit)

    def _ssd_through_state_hook(
        self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial: Tensor | None = None
    ) -> Tensor:
        """SSD with every state materialised and passed through `hook_ssm_state`; the
        output is read from the (possibly edited, then re-propagated) states: y_t = h_t C_t.
        `initial` is the state before the first position (zeros when None)."""
        _, states = ssd(x, dt, A, B, C, self.chunk_size, initial_state=initial, return_all_states=True)

        def rescan(initial_state: Tensor, start: int, end: int) -> Tensor:
            sl = slice(start, end)
            return ssd(
                x[:, sl],
                dt[:, sl],
                A,
                B[:, sl],
                C[:, sl],
                self.chunk_size,
                initial_state=initial_state,
                return_all_states=True,
            )[1]

        def carry(edit: Tensor, keep: Tensor | None) -> Tensor:  # h_t = a_t h_{t-1} (state_patch)
            decay = torch.exp(dt * A)  # a_t per head: [batch, pos, head]
            if keep is not None:
                decay = decay * keep[:, :, None]
            return linear_scan(decay[..., None, None].expand_as(edit), edit)

        states = hook_state_with_propagation(self.hook_ssm_state, states, rescan, carry, initial)
        return torch.einsum("blhpn,blhn->blhp", states, _expand_groups(C, self.n_heads))


def _check_dt_limit(dt_limit: Sequence[float | None] | None) -> tuple[float | None, float | None] | None:
    """Return `dt_limit` as a (low, high) tuple (None: no clamp); a UsageError unless it is None
    or two bounds, each a number or None (unbounded), not both None, with low <= high."""
    if dt_limit is None:
        return None
    bounds = tuple(dt_limit) if isinstance(dt_limit, (list, tuple)) else ()
    numbers = all(b is None or (isinstance(b, (int, float)) and not isinstance(b, bool)) for b in bounds)
    if len(bounds) != 2 or not numbers or bounds == (None, None):
        raise UsageError(f"mamba2: dt_limit must be [low, high] (numbers, null for unbounded), got {dt_limit!r}")
    low, high = bounds
    if low is not None and high is not None and not low <= high:
        raise UsageError(f"mamba2: dt_limit needs low <= high, got {list(bounds)}")
    return low, high


def _head_results(mixer: Mamba2, hook) -> tuple[Tensor, Tensor]:
    """The gated RMSNorm of y, per head, and out_proj's weight per head (`MixerSpec.head_results`)."""
    normed = mixer.norm(hook("y").flatten(2), hook("gate"))
    by_head = (mixer.n_heads, mixer.headdim)
    return normed.unflatten(-1, by_head), mixer.out_proj.weight.unflatten(1, by_head)


SPEC = MixerSpec(
    name="mamba2",
    mixer=Mamba2,
    heads=Heads(width="headdim", split="expand"),
    meanings={
        "in_x": "x branch of in_proj",
        "gate": "z branch (gated RMSNorm)",
        "conv": "short convolution over x, B, C",
        "conv_act": "SiLU(conv) x per head",
        "delta": "dt per head (after softplus and the dt_limit clamp)",
        "B": "B_t per group",
        "C": "C_t per group",
        "ssm_state": "h_t = exp(dt·A) h_{t-1} + dt x Bᵀ per head (after position t); patching propagates",
        "y": "SSD output per head (includes D·x)",
    },
    notes=(
        "TransformerLens's Mamba-2 bridge: its `mixer.hook_ssm_out` is the block's `hook_mixer_out` (an alias "
        "above); its `mixer.hook_ssm_state` is this mixer's, with the same axes [batch, pos, head, headdim, "
        "d_state] (TransformerLens fires it only on its eager-scan path, where a patch changes that position's "
        "read-out only; hookmech's propagates). Its `hook_in_proj`, `hook_conv` (over x, B, C, channel-first), "
        "`hook_inner_norm` (the gated norm's output) and `hook_ssm_write` have no hookmech hook: no alias."
    ),
    head_results=_head_results,
    block_norm="rmsnorm",
    block_mlp=False,
    output_projections=("out_proj",),
    output_head_axes="head d_head",
    # y for its z, and its Mamba-2 bridge's ``mixer.hook_ssm_out`` (its ``hook_ssm_state`` is
    # already this mixer's, same axes)
    tl_attention={"z": "y"},
    tl_mixer_out=("ssm_out",),
)
