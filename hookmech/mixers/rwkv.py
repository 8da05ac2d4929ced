"""RWKV-6 ("Finch") time mixing (Peng et al. 2024, "Eagle and Finch", §4), in plain PyTorch.

This is the time-mixing half of an RWKV-6 block; the block's MLP stands in for RWKV's
channel mixing (`block_mlp = True`). Parameter names follow BlinkDL's `RWKV_Tmix_x060`
(`time_maa_*`, `time_decay*`, `time_faaaa` = the bonus u, `receptance, key, value, gate,
ln_x`), except the output projection, named `out_proj` (RWKV's `output`) so that the
backbone's init rescales it. With x'_t = x_{t-1} - x_t (token shift, x_{-1} = 0):

    lerp_□(x)  = x + x' ⊙ (μ_□ + lora_□(x + x' ⊙ μ_x))      data-dependent interpolation (eq. 14-16)
    r, k, v    = receptance(lerp_r), key(lerp_k), value(lerp_v)   [head, d_head] each
    g          = silu(gate(lerp_g))
    w_t        = time_decay + tanh(lerp_w @ time_decay_w1) @ time_decay_w2   (eq. 17)
    S_t        = diag(exp(-exp(w_t))) S_{t-1} + k_tᵀ v_t     per head, [d_head, d_head]
    o_t        = r_t (S_{t-1} + diag(u) k_tᵀ v_t)            (eq. 18-19)
    out        = out_proj(groupnorm_heads(o) ⊙ g)

`wkv_sequential` is that recurrence as a loop; `wkv_chunked` (the default) evaluates it
chunk by chunk: a masked quadratic form inside each chunk (gated linear attention with a
per-channel decay) and the recurrence between chunks; `wkv_recurrent` is the recurrence in
place, faster on CPU where nothing needs a gradient (the patching engine's runs); `wkv`
chooses. The tests pin them together.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import UsageError
from ..hooks import AxisHookPoint, hook_in_use
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
from .base import Mixer, kept, needs_grad, one_pass, state_before
from .capabilities import EffectiveAttentionMap, PathRoutes
from .mixer_spec import Heads, MixerSpec
from .operators import causal_decay
from .selective_scan import linear_scan
from .state_patch import hook_state_with_propagation


def wkv_sequential(
    r: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, u: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The RWKV-6 recurrence, one position at a time (the reference).

    r, k, log_decay (= -exp(w), <= 0) ``[batch, pos, head, d_k]``, v ``[batch, pos, head, d_v]``,
    u ``[head, d_k]``, initial_state ``[batch, head, d_k, d_v]`` or None (zeros). Returns
    o ``[batch, pos, head, d_v]`` and the states after each position ``[batch, pos, head, d_k, d_v]``.
    """
    batch, n_pos, n_heads, d_k = k.shape
    state = k.new_zeros(batch, n_heads, d_k, v.shape[-1]) if initial_state is None else initial_state
    outs, states = [], []
    for t in range(n_pos):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", r[:, t], state + u[..., None] * kv))
        state = torch.exp(log_decay[:, t])[..., None] * state + kv
        states.append(state)
    return torch.stack(outs, dim=1), torch.stack(states, dim=1)


def wkv_chunked(
    r: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    u: Tensor,
    chunk_size: int,
    initial_state: Tensor | None = None,
    return_all_states: bool = False,
) -> tuple[Tensor, Tensor]:
    """The RWKV-6 recurrence in chunks; same arguments as `wkv_sequential`.

    Returns o ``[batch, pos, head, d_v]`` and, with `return_all_states`, the state after
    every position ``[batch, pos, head, d_k, d_v]``; otherwise only the final state
    ``[batch, head, d_k, d_v]`` (no per-position state is materialised).
    """
    if return_all_states:
        # every state is materialised anyway: the recurrence makes them in O(T·d_k·d_v), where
        # the chunked form's all-state contraction costs chunk_size times more
        return wkv_scan(r, k, v, log_decay, u, initial_state)
    batch, n_pos, n_heads, d_k = k.shape
    d_v = v.shape[-1]
    chunk_size = min(chunk_size, n_pos)  # a short sequence is one chunk, not a padded one
    pad = -n_pos % chunk_size
    if pad:
        # log_decay = 0, k = 0 pads leave the state unchanged; they are cut off below.
        r, k, v, log_decay = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (r, k, v, log_decay))
    n_chunks = k.shape[1] // chunk_size
    r, k, v, log_decay = (t.reshape(batch, n_chunks, chunk_size, n_heads, -1) for t in (r, k, v, log_decay))

    decay_in = torch.cumsum(log_decay, dim=2)  # log Π_{s<=t} w_s within the chunk
    decay_before = decay_in - log_decay  # log Π_{s<t} w_s: o_t reads S_{t-1}
    # Pairwise decays are formed as differences of cumulative sums, masked before exp, so
    # they stay <= 1: factoring them as exp(b_t) · exp(-b_s) would overflow for fast decays.
    positions = torch.arange(chunk_size, device=k.device)
    strictly_before = (positions[None, :] < positions[:, None])[:, :, None, None]  # [t, s, 1, 1]
    pair_decay = torch.exp(
        (decay_before[:, :, :, None] - decay_in[:, :, None, :]).masked_fill(~strictly_before, float("-inf"))
    )  # [b, c, t, s, h, d_k]

    # Intra-chunk: o_t = Σ_{s<t} (r_t ⊙ decay_ts ⊙ k_s)·1 v_s + (r_t ⊙ u ⊙ k_t)·1 v_t.
    scores = torch.einsum("bcthk,bcshk,bctshk->bctsh", r, k, pair_decay)
    out = torch.einsum("bctsh,bcshv->bcthv", scores, v)
    out = out + torch.einsum("bcthk,hk,bcthk->bcth", r, u, k)[..., None] * v

    # Inter-chunk: the state entering each chunk, by the recurrence over chunks.
    to_end = torch.exp(decay_in[:, :, -1:] - decay_in)  # [b, c, Q, h, d_k]
    chunk_input = torch.einsum("bcshk,bcshv->bchkv", k * to_end, v)
    chunk_decay = torch.exp(decay_in[:, :, -1])  # [b, c, h, d_k]
    state = k.new_zeros(batch, n_heads, d_k, d_v) if initial_state is None else initial_state
    entering_each: list[Tensor] = []
    for c in range(n_chunks):
        entering_each.append(state)
        state = chunk_decay[:, c, ..., None] * state + chunk_input[:, c]
    entering = torch.stack(entering_each, dim=1)  # [b, c, h, d_k, d_v]
    out = out + torch.einsum("bcthk,bchkv->bcthv", r * torch.exp(decay_before), entering)
    return out.reshape(batch, n_chunks * chunk_size, n_heads, d_v)[:, :n_pos], state


def wkv_recurrent(
    r: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    u: Tensor,
    initial_state: Tensor | None = None,
    return_all_states: bool = False,
) -> tuple[Tensor, Tensor]:
    """The RWKV-6 recurrence in place, one read-out and one multiply-add per position: not
    differentiable, for runs without autograd. Same arguments and returns as `wkv_chunked`.

    On CPU it beats the chunked form: a chunk's per-channel pairwise decays cost chunk_size ·
    d_k per position and head pair, the recurrence d_k · d_v per position and head."""
    batch, n_pos, n_heads, d_k = k.shape
    decay = torch.exp(log_decay)[..., None]  # [b, t, h, d_k, 1]
    state = k.new_zeros(batch, n_heads, d_k, v.shape[-1]) if initial_state is None else initial_state.clone()
    states = k.new_empty(batch, n_pos, *state.shape[1:]) if return_all_states else None
    out = (r * u * k).sum(-1, keepdim=True) * v  # the bonus of the current token: (r_t ⊙ u ⊙ k_t)·1 v_t
    for t in range(n_pos):
        out[:, t] += (r[:, t, :, None, :] @ state).squeeze(-2)  # r_t · S_{t-1}
        state.mul_(decay[:, t]).addcmul_(k[:, t, :, :, None], v[:, t, :, None, :])
        if states is not None:
            states[:, t] = state
    return out, (states if states is not None else state)


def wkv(
    r: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    u: Tensor,
    chunk_size: int,
    initial_state: Tensor | None = None,
    return_all_states: bool = False,
) -> tuple[Tensor, Tensor]:
    """The WKV kernel the mixer runs (arguments and returns as `wkv_chunked`): `wkv_recurrent`
    when nothing needs a gradient, else `wkv_chunked` (which, asked for every state, scans)."""
    if not needs_grad(r, k, v, log_decay, u, initial_state):
        return wkv_recurrent(r, k, v, log_decay, u, initial_state, return_all_states)
    return wkv_chunked(r, k, v, log_decay, u, chunk_size, initial_state, return_all_states)


def wkv_scan(
    r: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, u: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The RWKV-6 recurrence with every state materialised, as one linear scan (differentiable);
    same arguments and returns as `wkv_sequential`: o_t = r_t·S_{t-1} + (r_t ⊙ u ⊙ k_t)·1 v_t."""
    kv = k[..., None] * v[..., None, :]  # [b, t, h, d_k, d_v]
    decay = torch.exp(log_decay)[..., None].expand_as(kv)
    if initial_state is not None:  # S_0 = w_0 S_init + k_0 v_0ᵀ
        kv = torch.cat([kv[:, :1] + decay[:, :1] * initial_state[:, None], kv[:, 1:]], dim=1)
    states = linear_scan(decay, kv)
    before = torch.cat([_initial(states, initial_state), states[:, :-1]], dim=1)  # S_{t-1}
    out = (r[..., None, :] @ before).squeeze(-2) + (r * u * k).sum(-1, keepdim=True) * v
    return out, states


def _initial(states: Tensor, initial_state: Tensor | None) -> Tensor:
    """Return the state before position 0, ``[batch, 1, head, d_k, d_v]`` (zeros when None)."""
    if initial_state is None:
        return states.new_zeros(states[:, :1].shape)
    return initial_state[:, None].to(states.dtype)


class RWKV6(Mixer, PathRoutes, EffectiveAttentionMap):
    """RWKV-6 time mixing: ``[batch, pos, d_model] -> [batch, pos, d_model]``.

    Inside hooks (head = d_model / head_size, d_head = head_size):
    ``hook_r``, ``hook_k``, ``hook_v`` ``[batch, pos, head, d_head]``;
    ``hook_decay`` ``[batch, pos, head, d_head]``: RWKV's w_t, the decay factor being
    exp(-exp(w_t)) (hooking w keeps patching exact in log space);
    ``hook_gate`` ``[batch, pos, d_model]``: silu(g);
    ``hook_state`` ``[batch, pos, head, d_head (key), d_head (value)]``: S_t, the state after
    each position, materialised only while a hook is attached; edits propagate;
    ``hook_output`` ``[batch, pos, head, d_head]``: o_t, before the group norm and gate.
    """

    def __init__(
        self,
        d_model: int,
        head_size: int = 16,
        mix_lora: int = 32,
        decay_lora: int = 64,
        init_depth: float = 0.5,
        head_size_divisor: int = 8,
        chunk_size: int = 16,
        bias: bool = False,
    ):
        super().__init__()
        if head_size < 1 or d_model % head_size:
            raise UsageError(f"rwkv: d_model {d_model} is not divisible by head_size {head_size}")
        for name, value in (
            ("mix_lora", mix_lora),
            ("decay_lora", decay_lora),
            ("head_size_divisor", head_size_divisor),
            ("chunk_size", chunk_size),
        ):
            if value < 1:
                raise UsageError(f"rwkv: {name} must be >= 1, got {value}")
        if not 0.0 <= init_depth <= 1.0:
            raise UsageError(f"rwkv: init_depth must be in [0, 1], got {init_depth}")
        self.n_heads, self.head_size, self.chunk_size = d_model // head_size, head_size, chunk_size
        self._init_time_parameters(d_model, mix_lora, decay_lora, init_depth)
        # `bias`: biases on the linear projections (receptance, key, value, gate, output), off as in RWKV-6
        self.receptance = nn.Linear(d_model, d_model, bias=bias)
        self.key = nn.Linear(d_model, d_model, bias=bias)
        self.value = nn.Linear(d_model, d_model, bias=bias)
        self.gate = nn.Linear(d_model, d_model, bias=bias)
        self.ln_x = nn.GroupNorm(self.n_heads, d_model, eps=1e-5 * head_size_divisor**2)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

        head_axes = "batch pos head d_head"
        self.hook_r, self.hook_k, self.hook_v = (AxisHookPoint(head_axes) for _ in range(3))
        self.hook_decay = AxisHookPoint(head_axes)
        self.hook_gate = AxisHookPoint("batch pos d_model")
        self.hook_state = AxisHookPoint("batch pos head d_head_k d_head_v")
        self.hook_output = AxisHookPoint(head_axes)

    @torch.no_grad()
    def _init_time_parameters(self, d_model: int, mix_lora: int, decay_lora: int, depth: float) -> None:
        """RWKV-6's initialisation (`RWKV_Tmix_x060`). It depends on the layer's depth, which a
        mixer does not know: `depth` plays ratio_0_to_1 = layer/(n_layer-1), and
        ratio_1_to_almost0 = 1 - layer/n_layer is taken as 1 - depth/2 (exact for 2 layers)."""
        shallow = 1.0 - depth / 2
        ddd = (torch.arange(d_model) / d_model).view(1, 1, d_model)
        self.time_maa_x = nn.Parameter(1.0 - ddd.pow(shallow))
        self.time_maa_w = nn.Parameter(1.0 - ddd.pow(shallow))
        self.time_maa_k = nn.Parameter(1.0 - ddd.pow(shallow))
        self.time_maa_v = nn.Parameter(1.0 - (ddd.pow(shallow) + 0.3 * depth))
        self.time_maa_r = nn.Parameter(1.0 - ddd.pow(0.5 * shallow))
        self.time_maa_g = nn.Parameter(1.0 - ddd.pow(0.5 * shallow))
        # LoRA A matrices start at zero (so the interpolation starts data-independent);
        # B matrices small and random so that A receives gradient from the first step.
        self.time_maa_w1 = nn.Parameter(torch.zeros(d_model, 5 * mix_lora))
        self.time_maa_w2 = nn.Parameter(torch.empty(5, mix_lora, d_model).uniform_(-0.01, 0.01))
        channel = torch.arange(d_model) / max(d_model - 1, 1)
        self.time_decay = nn.Parameter((-6 + 5 * channel.pow(0.7 + 1.3 * depth)).view(1, 1, d_model))
        self.time_decay_w1 = nn.Parameter(torch.zeros(d_model, decay_lora))
        self.time_decay_w2 = nn.Parameter(torch.empty(decay_lora, d_model).uniform_(-0.01, 0.01))
        zigzag = ((torch.arange(d_model) + 1) % 3 - 1) * 0.1
        self.time_faaaa = nn.Parameter((depth * (1 - channel) + zigzag).view(self.n_heads, self.head_size))

    def forward(self, x: Resid) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]`` of ``x [batch, pos, d_model]``."""
        return self._hooked_forward(x)[0]

    def _hooked_forward(self, x: Resid, with_context: bool = False) -> tuple[Resid, Context | None]:
        """Return (forward(x), None); with `with_context`, the run's context (`prefix_context`)
        from the same pass instead of None (not for a hooked state, whose edits it would miss)."""
        previous = F.pad(x, (0, 0, 1, -1))  # x_{t-1} (x_{-1} = 0): the only cross-position step
        r, k, v, g, w = self._projections(x, previous)
        r, k, v = self.hook_r(r), self.hook_k(k), self.hook_v(v)
        g = self.hook_gate(g)
        log_decay = -torch.exp(self.hook_decay(w))

        context: Context | None = None
        if hook_in_use(self.hook_state):
            out = self._wkv_through_state_hook(r, k, v, log_decay)
        else:
            out, states = wkv(r, k, v, log_decay, self.time_faaaa, self.chunk_size, return_all_states=with_context)
            context = {"x": x, "wkv_state": states} if with_context else None
        return self._output(self.hook_output(out), g), context

    def fused_forward_with_context(self, x: RunResid, hooked: bool) -> tuple[RunResid, Context] | None:
        """Return ``(forward(x), prefix_context(x))`` from one pass, the hooked forward's (`one_pass`),
        whether or not an inside hook is in use."""
        return one_pass(self._hooked_forward, x, hooked)

    def effective_attention(self, x: Resid) -> EffectiveAttention:
        """Return M ``[batch, head, query_pos, key_pos]`` (float32): the WKV operator before
        the group norm. The decays are per key channel i, but o_t = r_t (S_{t-1} + diag(u) k_tᵀ v_t)
        contracts the key channels away, so one M per head acts on all its value channels:

            M[h, t, s] = Σ_i r_t[i] k_s[i] Π_{r=s+1..t-1} exp(-exp(w_r[i]))    (s < t)
            M[h, t, t] = Σ_i r_t[i] u[h, i] k_t[i]                             (the bonus)

        and ``hook_output[b, t, h] = Σ_s M[b, h, t, s] hook_v[b, s, h]`` exactly. Built in
        float64, one key channel at a time (the largest tensor is one ``[batch, head, pos, pos]``).
        """
        r, k, _, _, w = self._projections(x, F.pad(x, (0, 0, 1, -1)))
        r, k = (t.double().permute(0, 2, 3, 1) for t in (r, k))  # [b, h, i, t]
        log_decay = -torch.exp(w.double()).permute(0, 2, 3, 1)
        decay_in = torch.cumsum(log_decay, dim=-1)  # Σ_{r<=t} log w_r
        decay_before = decay_in - log_decay  # Σ_{r<t}: o_t reads S_{t-1}
        M = torch.diag_embed(torch.einsum("bhit,hi,bhit->bht", r, self.time_faaaa.double(), k))
        for i in range(self.head_size):
            decay = causal_decay(decay_before[:, :, i], decay_in[:, :, i], strict=True)  # [b, h, t, s]
            M += r[:, :, i, :, None] * decay * k[:, :, i, None, :]
        return M.float()

    # -- path patching (see `PathRoutes`) -------------------------------------
    head_outputs = ("output",)
    head_inputs = ("r", "k", "v", "decay")
    state_hooks = ("state",)
    state_readout = "output"

    def state_path(self, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_output`` ``[run, pos, head, d_head]`` along the state path:
        with w_t = k_tᵀ v_t the write of position t,

            ΔS_t = diag(exp(−exp(w_t))) ΔS_{t-1} + [t is a sender] (w_t(clean) − w_t(corrupt))

        (the corrupt run's decays), read out as o_t = r_t ΔS_{t-1} with its r. Position t reads the
        state before its own write (S_{t-1}; its own k_tᵀ v_t reaches o_t through the bonus u,
        which is no state), so a sender reaches the positions after it only. The change is linear
        in the writes: it is the WKV of the clean writes minus that of the corrupt ones, both
        with the corrupt decays and no bonus."""
        r, k, v, _, w = self._projections(corrupt, F.pad(corrupt, (0, 0, 1, -1)))
        _, k_clean, v_clean, _, _ = self._projections(clean, F.pad(clean, (0, 0, 1, -1)))
        sender = senders[:, :, None, None].to(k.dtype)
        no_bonus = torch.zeros_like(self.time_faaaa)
        reads = [
            wkv(r, keys * sender, values, -torch.exp(w), no_bonus, self.chunk_size)[0]
            for keys, values in ((k_clean, v_clean), (k, v))
        ]
        return reads[0] - reads[1]

    # -- resuming from a position (see `Mixer.forward_from`) ---------------------------------
    def prefix_context(self, x: RunResid) -> Context:
        """Return, for a run on `x` ``[N, T, d_model]``: ``x`` itself (the window's token shift
        reads x at start - 1) and ``wkv_state`` ``[N, T, head, d_k, d_v]``, S_t after each position."""
        r, k, v, _, w = self._projections(x, F.pad(x, (0, 0, 1, -1)))
        _, states = wkv(r, k, v, -torch.exp(w), self.time_faaaa, self.chunk_size, return_all_states=True)
        return {"x": x, "wkv_state": states}

    def state_from_context(self, name: str, context: Context, rows: RowInts, positions: RowInts) -> Tensor:
        """Return ``hook_state`` of the context's run at ``positions[i]`` of row ``rows[i]``, ``[B,
        head, d_k, d_v]`` (the context keeps every state; see `Mixer.state_from_context`)."""
        assert name in self.state_hooks
        return state_before(context["wkv_state"], rows, positions + 1)

    window_hooks = True

    def forward_from(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output ``[B, W, d_model]`` at the window `x` ``[B, W, d_model]`` (see
        `Mixer.forward_from`): projections on the window only, WKV from S_{start-1}. The inside
        hooks fire on the window; a state edit is carried on from the window's start."""
        before = state_before(context["x"], rows, start)  # x_{start-1}, zeros at start 0
        previous = torch.cat([before[:, None].to(x.dtype), x[:, :-1]], dim=1)
        r, k, v, g, w = self._projections(x, previous)
        r, k, v = self.hook_r(r), self.hook_k(k), self.hook_v(v)
        g = self.hook_gate(g)
        log_decay = -torch.exp(self.hook_decay(w))
        initial = state_before(context["wkv_state"], rows, start)
        if hook_in_use(self.hook_state):
            out = self._wkv_through_state_hook(r, k, v, log_decay, initial)
        else:
            out, _ = wkv(r, k, v, log_decay, self.time_faaaa, self.chunk_size, initial_state=initial)
        return self._output(kept(self.hook_output(out), keep), kept(g, keep))

    def _projections(self, x: Tensor, previous: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Return r, k, v ``[b, t, head, d_head]``, silu(g) ``[b, t, d_model]`` and w ``[b, t, head,
        d_head]`` from the inputs x and the previous inputs x_{t-1}, both ``[b, t, d_model]``."""
        heads = (*x.shape[:2], self.n_heads, self.head_size)
        shifted = previous - x
        lora_in = torch.tanh((x + shifted * self.time_maa_x) @ self.time_maa_w1)
        lora = torch.einsum("btfr,frd->fbtd", lora_in.unflatten(-1, (5, -1)), self.time_maa_w2)
        mix_w, mix_k, mix_v, mix_r, mix_g = lora.unbind(0)
        xw = x + shifted * (self.time_maa_w + mix_w)
        xk = x + shifted * (self.time_maa_k + mix_k)
        xv = x + shifted * (self.time_maa_v + mix_v)
        xr = x + shifted * (self.time_maa_r + mix_r)
        xg = x + shifted * (self.time_maa_g + mix_g)

        r = self.receptance(xr).view(heads)
        k = self.key(xk).view(heads)
        v = self.value(xv).view(heads)
        g = F.silu(self.gate(xg))
        w = self.time_decay + torch.tanh(xw @ self.time_decay_w1) @ self.time_decay_w2
        return r, k, v, g, w.view(heads)

    def _output(self, out: Tensor, g: Tensor) -> Tensor:
        """Return out_proj(groupnorm_heads(o) ⊙ g) ``[b, t, d_model]`` for o ``[b, t, head, d_head]``."""
        batch, n_pos, d_model = g.shape
        out = self.ln_x(out.reshape(batch * n_pos, d_model)).view(batch, n_pos, d_model)
        return self.out_proj(out * g)

    def _wkv_through_state_hook(
        self, r: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, initial: Tensor | None = None
    ) -> Tensor:
        """WKV with every state materialised and passed through `hook_state`; the output is
        read from the (possibly edited, then re-propagated) states: o_t = r_t (S_{t-1} + u k_tᵀ v_t).
        `initial` is the state before the first position (zeros when None)."""
        u = self.time_faaaa
        _, states = wkv(r, k, v, log_decay, u, self.chunk_size, initial_state=initial, return_all_states=True)

        def rescan(initial_state: Tensor, start: int, end: int) -> Tensor:
            sl = slice(start, end)
            return wkv(
                r[:, sl],
                k[:, sl],
                v[:, sl],
                log_decay[:, sl],
                u,
                self.chunk_size,
                initial_state=initial_state,
                return_all_states=True,
            )[1]

        def carry(edit: Tensor, keep: Tensor | None) -> Tensor:  # S_t = diag(w_t) S_{t-1} (state_patch)
            decay = torch.exp(log_decay)  # [batch, pos, head, d_k]
            if keep is not None:
                decay = decay * keep[:, :, None, None]
            return linear_scan(decay[..., None].expand_as(edit), edit)

        states = hook_state_with_propagation(self.hook_state, states, rescan, carry, initial)
        first = torch.zeros_like(states[:, :1]) if initial is None else initial[:, None].to(states.dtype)
        before = torch.cat([first, states[:, :-1]], dim=1)  # S_{t-1}
        bonus = torch.einsum("blhk,hk,blhk->blh", r, u, k)[..., None] * v
        return torch.einsum("blhk,blhkv->blhv", r, before) + bonus


def _head_results(mixer: RWKV6, hook) -> tuple[Tensor, Tensor]:
    """The group norm of the output times the gate (after its SiLU), per head, and out_proj's weight
    per head (`MixerSpec.head_results`)."""
    out = hook("output")
    normed = mixer.ln_x(out.flatten(2).flatten(0, 1)).view(*out.shape[:2], -1)
    by_head = (mixer.n_heads, mixer.head_size)
    return (normed * hook("gate")).unflatten(-1, by_head), mixer.out_proj.weight.unflatten(1, by_head)


SPEC = MixerSpec(
    name="rwkv",
    mixer=RWKV6,
    heads=Heads(width="head_size"),
    meanings={
        "r": "receptance",
        "k": "key",
        "v": "value",
        "decay": "raw data-dependent decay w_t (factor exp(−exp(w)))",
        "gate": "output gate g, after its SiLU",
        "state": "wkv state S_t = diag(decay) S_{t-1} + k_tᵀ v_t; patching propagates",
        "output": "r·(S_{t-1} + diag(u) kᵀv) per head, before group norm",
    },
    head_results=_head_results,
    output_projections=("out_proj",),
    output_head_axes="head d_head",
    # the receptance reads the state as a query does; the output before the group norm is its z
    tl_attention={"q": "r", "k": "k", "v": "v", "z": "output"},
)
