"""Gated linear attention (Yang et al. 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training"), as flash-linear-attention's `GatedLinearAttention` layer
(``fla/layers/gla.py``, without its optional feature map and key/value head groups).

Per head, with q_t, k_t ``[d_k]`` and v_t ``[d_v]`` linear projections of x_t (with
``use_short_conv``, each through a short causal convolution and SiLU, as fla's option) and a
data-dependent diagonal decay α_t ``[d_k]`` in (0, 1):

    α_t = sigmoid(W₂ W₁ x_t + b)^(1/τ)                    (low-rank gate, τ = 16: §4.4, eq. 14)
    S_t = diag(α_t) S_{t-1} + k_tᵀ v_t                     (S_t: [d_k, d_v])
    y_t = (q_t / √d_k) S_t
    o_t = RMSNorm(y_t) ⊙ swish(W_g x_t)                    (per head; then the output projection)

The gate is kept in log space, log α_t = logsigmoid(·)/τ <= 0, as fla keeps it (``gk``).

Two forms compute the same y:
- recurrent: the loop above, one position at a time (`gla_recurrent`, fla's `naive_recurrent_gla`);
- chunked (§4.2): within a chunk of C positions with initial state S_0 and b_r = Σ_{i<=r} log α_i,

      y_r = (q_r ⊙ e^{b_r}) S_0 / √d_k + Σ_{i<=r} (Σ_d q_{r,d} k_{i,d} e^{b_{r,d} − b_{i,d}}) v_i / √d_k,

  the decay between two positions taken as one exponent of a difference (<= 0), never as the
  quotient e^{b_r} / e^{b_i} (which overflows once the gate has decayed far), and chunks follow one
  another through S. `gla_chunked`; the tests pin the two forms together, and to fla's own
  reference where fla is installed.
The per-position state is materialised only when its hook is in use.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import UsageError
from ..hooks import AxisHookPoint, hook_in_use
from ..shapes import Context, EffectiveAttention, KeptWindow, Resid, RowInts, RunActs, RunMask, RunResid, Window
from .base import Mixer, kept, needs_grad, one_pass, replay_before, state_before
from .capabilities import EffectiveAttentionMap, PathRoutes
from .mixer_spec import Heads, MixerSpec
from .selective_scan import linear_scan
from .short_conv import ShortConv
from .state_patch import hook_state_with_propagation

MODES = ("chunk", "recurrent")


class GatedLinearAttention(Mixer, PathRoutes, EffectiveAttentionMap):
    """Gated linear attention: a matrix state with a data-dependent decay, gated output, projection.

    Per head: the state's decay α_t is data-dependent and diagonal (one rate per key channel); the
    read-out goes through an RMSNorm, a swish output gate and the output projection.

    Inside hooks (shapes for input ``[batch, pos, d_model]``, d_k = expand_k·d_model / head,
    d_v = expand_v·d_model / head):
    ``hook_q, hook_k``: ``[batch, pos, head, d_k]`` (q before its 1/√d_k scale; after the short
    convolution and SiLU with ``use_short_conv``, as v);
    ``hook_v``: ``[batch, pos, head, d_v]``;
    ``hook_gate``: ``[batch, pos, head, d_k]``, log α_t, the decay gate in log space;
    ``hook_state``: ``[batch, pos, head, d_k, d_v]``, S_t after position t, materialised only
    when the hook is in use; a patched state is continued by the recurrence from the patched
    position on;
    ``hook_y``: ``[batch, pos, head, d_v]``, y_t = q_t S_t / √d_k before the norm;
    ``hook_out_gate``: ``[batch, pos, head, d_v]``, swish(W_g x_t) (with ``use_output_gate``).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 4,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        gate_low_rank_dim: int = 16,
        gate_logit_normalizer: int = 16,
        clamp_min: float | None = None,
        use_output_gate: bool = True,
        use_short_conv: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        norm_eps: float = 1e-5,
        mode: str = "chunk",
        chunk_size: int = 64,
        bias: bool = False,
    ):
        super().__init__()
        key_dim, value_dim = int(d_model * expand_k), int(d_model * expand_v)
        if num_heads < 1 or min(key_dim, value_dim) < num_heads or key_dim % num_heads or value_dim % num_heads:
            raise UsageError(
                f"gla: num_heads {num_heads} must divide the key width {key_dim} (expand_k {expand_k} × d_model) "
                f"and the value width {value_dim} (expand_v {expand_v} × d_model)"
            )
        if gate_low_rank_dim < 1 or gate_logit_normalizer <= 0:
            raise UsageError(
                f"gla: gate_low_rank_dim must be >= 1 and gate_logit_normalizer > 0, "
                f"got {gate_low_rank_dim} and {gate_logit_normalizer}"
            )
        if clamp_min is not None and not (math.isfinite(clamp_min) and clamp_min <= 0):
            # log α_t >= clamp_min > 0 would make every decay a growth: the state explodes
            raise UsageError(f"gla: clamp_min is a floor of the log decay, a number <= 0, got {clamp_min}")
        if mode not in MODES:
            raise UsageError(f"gla: mode must be one of {MODES}, got {mode!r}")
        if chunk_size < 1:
            raise UsageError(f"gla: chunk_size must be >= 1, got {chunk_size}")
        if conv_size < 1:
            raise UsageError(f"gla: conv_size must be >= 1, got {conv_size}")
        self.num_heads, self.d_k, self.d_v = num_heads, key_dim // num_heads, value_dim // num_heads
        self.scale = self.d_k**-0.5
        self.gate_logit_normalizer, self.clamp_min = gate_logit_normalizer, clamp_min
        self.use_output_gate, self.mode, self.chunk_size = use_output_gate, mode, chunk_size
        self.use_short_conv = use_short_conv
        # flash-linear-attention's names (its o_proj is our out_proj, for the backbone's init);
        # `bias`: biases on q, k, v, g and the output projection, which fla's layer has none of
        self.q_proj = nn.Linear(d_model, key_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, key_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, value_dim, bias=bias)
        if use_output_gate:
            self.g_proj = nn.Linear(d_model, value_dim, bias=bias)
        if use_short_conv:
            self.q_conv1d = ShortConv(key_dim, conv_size, bias=conv_bias)
            self.k_conv1d = ShortConv(key_dim, conv_size, bias=conv_bias)
            self.v_conv1d = ShortConv(value_dim, conv_size, bias=conv_bias)
        self.gk_proj = nn.Sequential(
            nn.Linear(d_model, gate_low_rank_dim, bias=False), nn.Linear(gate_low_rank_dim, key_dim, bias=True)
        )
        self.g_norm = nn.RMSNorm(self.d_v, eps=norm_eps)
        self.out_proj = nn.Linear(value_dim, d_model, bias=bias)
        self.hook_q, self.hook_k = AxisHookPoint("batch pos head d_head_k"), AxisHookPoint("batch pos head d_head_k")
        self.hook_v = AxisHookPoint("batch pos head d_head")
        self.hook_gate = AxisHookPoint("batch pos head d_head_k")
        self.hook_state = AxisHookPoint("batch pos head d_head_k d_head")
        self.hook_y = AxisHookPoint("batch pos head d_head")
        if use_output_gate:
            self.hook_out_gate = AxisHookPoint("batch pos head d_head")

    def forward(self, x: Resid) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]``."""
        return self._hooked_forward(x)[0]

    def _hooked_forward(self, x: Resid, with_context: bool = False) -> tuple[Resid, Context | None]:
        """Return (forward(x), None); with `with_context`, the run's context (`prefix_context`)
        from the same pass instead of None (not for a hooked state, whose edits it would miss)."""
        (q, k, v, log_decay), projected = self._inputs(x)
        q, k, v, log_decay = self.hook_q(q), self.hook_k(k), self.hook_v(v), self.hook_gate(log_decay)
        y = self._read_out(q, k, v, log_decay, None)
        context = self._context(k, v, log_decay, projected) if with_context else None
        return self._output(x, self.hook_y(y)), context

    def _read_out(self, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, initial: Tensor | None) -> Tensor:
        """Return y ``[b, t, head, d_v]`` from the state `initial` before the first position (None:
        zeros): through `hook_state` (edits carried on by the recurrence) while it is in use, else
        in `mode`'s form without materialising the states."""
        if not hook_in_use(self.hook_state):
            return self._outputs(q, k, v, log_decay, initial)
        states = hook_state_with_propagation(
            self.hook_state,
            self._states(k, v, log_decay, initial, 0, k.shape[1]),
            partial(self._states, k, v, log_decay),
            partial(gla_carry, log_decay),
            initial,
        )
        return self.scale * torch.einsum("bthk,bthkv->bthv", q, states)

    def _inputs(
        self, x: Tensor, context: Context | None = None, rows: RowInts | None = None, start: RowInts | None = None
    ) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], dict[str, Tensor]]:
        """Return (q, k ``[b, t, head, d_k]``, v ``[b, t, head, d_v]``, log α ``[b, t, head, d_k]``) of
        `x` ``[b, t, d_model]`` (fla: ``gk = logsigmoid(gk_proj(x)) / gate_logit_normalizer``), and the
        projections the short convolutions read (``{"q", "k", "v"}`` ``[b, t, width]``; {} without
        them). With `context`, `x` is a window at `start` of rows `rows` of the run `context` was made
        from, whose earlier projections the convolutions read."""
        q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
        projected = {"q": q, "k": k, "v": v} if self.use_short_conv else {}
        if self.use_short_conv:
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            if context is None:
                q, k, v = (F.silu(conv(t)) for conv, t in zip(convs, (q, k, v), strict=True))
            else:
                assert rows is not None and start is not None
                q, k, v = (
                    F.silu(conv.forward_from(t, context[name], rows, start))
                    for conv, name, t in zip(convs, "qkv", (q, k, v), strict=True)
                )
        log_decay = F.logsigmoid(self.gk_proj(x)) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            log_decay = log_decay.clamp_min(self.clamp_min)
        q, k, log_decay = (t.unflatten(-1, (self.num_heads, self.d_k)) for t in (q, k, log_decay))
        return (q, k, v.unflatten(-1, (self.num_heads, self.d_v)), log_decay), projected

    def _output(self, x: Tensor, y: Tensor) -> Tensor:
        """Return out_proj(RMSNorm(y) ⊙ swish(W_g x)) ``[b, t, d_model]`` for y ``[b, t, head, d_v]``
        and the input `x` ``[b, t, d_model]`` at the same positions."""
        normed = self.g_norm(y)
        if self.use_output_gate:
            normed = normed * self.hook_out_gate(F.silu(self.g_proj(x)).unflatten(-1, (self.num_heads, self.d_v)))
        return self.out_proj(normed.flatten(2))

    def _outputs(self, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, initial: Tensor | None = None) -> Tensor:
        """Return y ``[b, t, head, d_v]`` (`mode`'s form) from the state `initial`."""
        if self.mode == "chunk":
            return gla_chunked(q, k, v, log_decay, self.scale, self.chunk_size, initial_state=initial)[0]
        return gla_recurrent(q, k, v, log_decay, self.scale, initial_state=initial)[0]

    def _states(self, k: Tensor, v: Tensor, log_decay: Tensor, initial: Tensor | None, start: int, end: int) -> Tensor:
        """States after positions start .. end-1 from the state before `start`,
        ``[batch, end - start, head, d_k, d_v]`` (the rescan of `state_patch`)."""
        window = slice(start, end)
        return gla_states(k[:, window], v[:, window], log_decay[:, window], initial)

    def effective_attention(self, x: Resid) -> EffectiveAttention:
        """Return M ``[batch, head, query_pos, key_pos]`` (float32): gated linear attention's exact
        operator on the values. Unrolling S_t = diag(α_t) S_{t-1} + k_tᵀ v_t gives
        S_t = Σ_{s<=t} diag(α_{s+1} ⊙ ··· ⊙ α_t) k_sᵀ v_s, so

            M[h, t, s] = Σ_d q_{t,d} k_{s,d} exp(B_{t,d} − B_{s,d}) / √d_k      (s <= t, B = cumsum log α)

        and ``hook_y[b, t, h] = Σ_s M[b, h, t, s] hook_v[b, s, h]`` exactly (float64, each
        exponent <= 0)."""
        (q, k, _, log_decay), _ = self._inputs(x)
        q, k, log_decay = (t.double().transpose(1, 2) for t in (q, k, log_decay))  # [b, h, t, d_k]
        return (self.scale * decayed_scores(q, k, log_decay.cumsum(dim=2))).float()

    # -- path patching (see `PathRoutes`) -------------------------------------
    head_outputs = ("y",)
    head_inputs = ("q", "k", "v", "gate")
    state_hooks = ("state",)
    state_readout = "y"

    def state_path(self, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_y`` ``[run, pos, head, d_v]`` along the state path: with
        w_t = k_tᵀ v_t the write of position t,

            ΔS_t = diag(α_t) ΔS_{t-1} + [t is a sender] (w_t(clean) − w_t(corrupt))

        (α of the corrupt run: its own transitions), read out as q_t ΔS_t / √d_k with its q."""
        (_, k_clean, v_clean, _), (q, k, v, log_decay) = self._inputs(clean)[0], self._inputs(corrupt)[0]
        writes = k_clean[..., :, None] * v_clean[..., None, :] - k[..., :, None] * v[..., None, :]
        change = torch.where(senders[:, :, None, None, None], writes, torch.zeros_like(writes))
        return self.scale * torch.einsum("bthk,bthkv->bthv", q, gla_carry(log_decay, change))

    # -- resuming from a position (see `Mixer.forward_from`) ---------------------------------
    # A state is d_k·d_v numbers per head and position, its inputs k, v, log α 2·d_k + d_v: the
    # context keeps a state every STATE_STRIDE positions and the inputs everywhere, and a resumed
    # run replays the at most STATE_STRIDE - 1 positions in between (as DeltaNet's).
    STATE_STRIDE = 4

    def prefix_context(self, x: RunResid) -> Context:
        """Return, for a run on `x` ``[N, T, d_model]``: ``q``, ``k``, ``v`` ``[N, T, width]``, the
        projections before their convolutions (only with ``use_short_conv``: a window's convolutions
        read the conv_size - 1 positions before it); the recurrence's inputs ``keys`` ``[N, T, head,
        d_k]``, ``values`` ``[N, T, head, d_v]``, ``log_decay`` ``[N, T, head, d_k]``; and ``state``
        ``[N, T // STATE_STRIDE, head, d_k, d_v]``, S_t after positions STATE_STRIDE - 1,
        2 STATE_STRIDE - 1, ..."""
        (_, k, v, log_decay), projected = self._inputs(x)
        return self._context(k, v, log_decay, projected)

    def _context(self, k: Tensor, v: Tensor, log_decay: Tensor, projected: dict[str, Tensor]) -> Context:
        """Return `prefix_context` from the recurrence's inputs of the run and its projections."""
        every = gla_states_every(k, v, log_decay, self.STATE_STRIDE)
        return {**projected, "keys": k, "values": v, "log_decay": log_decay, "state": every}

    def fused_forward_with_context(self, x: RunResid, hooked: bool) -> tuple[RunResid, Context] | None:
        """Return ``(forward(x), prefix_context(x))`` from one pass (`one_pass`)."""
        return one_pass(self._hooked_forward, x, hooked, self._output_and_context)

    def _output_and_context(self, x: RunResid) -> tuple[RunResid, Context]:
        (q, k, v, log_decay), projected = self._inputs(x)
        return self._output(x, self._outputs(q, k, v, log_decay)), self._context(k, v, log_decay, projected)

    def state_from_context(self, name: str, context: Context, rows: RowInts, positions: RowInts) -> Tensor:
        """Return ``hook_state`` of the context's run at ``positions[i]`` of row ``rows[i]``, ``[B,
        head, d_k, d_v]``: the state before the next position (see `Mixer.state_from_context`)."""
        assert name in self.state_hooks
        return self._state_before(context, rows, positions + 1)

    def _state_before(self, context: Context, rows: RowInts, start: RowInts) -> Tensor:
        """Return the base run's state S after position ``start[i] - 1`` of row ``rows[i]``
        ``[B, head, d_k, d_v]``: the context's last kept state before it, carried over the
        positions in between with the base run's inputs."""
        stride = self.STATE_STRIDE
        kept_state = state_before(context["state"], rows, start // stride)
        inputs = [context["keys"], context["values"], context["log_decay"]]
        (k, v, log_decay), live = replay_before(inputs, rows, start, stride)
        live = live[..., None, None]
        # a position that is not live neither decays (log α = 0) nor writes (k = 0): a no-op
        return gla_recurrent(k, k * live, v, log_decay * live, self.scale, initial_state=kept_state)[1]

    window_hooks = True

    def forward_from(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output ``[B, W, d_model]`` at the window `x` ``[B, W, d_model]`` (see
        `Mixer.forward_from`): projections on the window only, the recurrence from S_{start-1}.
        The inside hooks fire on the window; a state edit is carried on from the window's start."""
        (q, k, v, log_decay), _ = self._inputs(x, context, rows, start)
        q, k, v, log_decay = self.hook_q(q), self.hook_k(k), self.hook_v(v), self.hook_gate(log_decay)
        y = self.hook_y(self._read_out(q, k, v, log_decay, self._state_before(context, rows, start)))
        return self._output(kept(x, keep), kept(y, keep))


def gla_recurrent(
    q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, scale: float, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The sequential reference: returns (y ``[batch, pos, head, d_v]``, final state ``[batch, head,
    d_k, d_v]``) for q, k, log_decay ``[batch, pos, head, d_k]``, v ``[batch, pos, head, d_v]``:
    S_t = diag(exp(log_decay_t)) S_{t-1} + k_tᵀ v_t, y_t = scale · q_t S_t."""
    batch, n_pos, n_heads, d_k = k.shape
    state = k.new_zeros(batch, n_heads, d_k, v.shape[-1]) if initial_state is None else initial_state
    outputs = []
    for t in range(n_pos):
        state = log_decay[:, t, :, :, None].exp() * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1), state


def gla_states(k: Tensor, v: Tensor, log_decay: Tensor, initial_state: Tensor | None = None) -> Tensor:
    """Return the state after every position ``[batch, pos, head, d_k, d_v]`` (shapes as
    `gla_recurrent`): one linear scan, in place where autograd records nothing."""
    decay = log_decay.exp()[..., None].expand(*k.shape, v.shape[-1])
    writes = k[..., :, None] * v[..., None, :]
    if initial_state is not None:
        first = decay[:, 0] * initial_state + writes[:, 0]
        writes = torch.cat([first[:, None], writes[:, 1:]], dim=1)
    return linear_scan(decay, writes, overwrite=not needs_grad(k, v, log_decay, initial_state))


def gla_states_every(k: Tensor, v: Tensor, log_decay: Tensor, stride: int) -> Tensor:
    """Return the state after positions stride - 1, 2 stride - 1, ... ``[batch, pos // stride, head,
    d_k, d_v]`` (shapes as `gla_recurrent`), updated in place without keeping the others: what a
    context holds (data, never differentiated)."""
    k, v, decay = k.detach(), v.detach(), log_decay.detach().exp()
    batch, n_pos, n_heads, d_k = k.shape
    state = k.new_zeros(batch, n_heads, d_k, v.shape[-1])
    states = k.new_empty(batch, n_pos // stride, *state.shape[1:])
    for t in range(n_pos):
        state.mul_(decay[:, t, :, :, None]).add_(k[:, t, :, :, None] * v[:, t, :, None, :])
        if (t + 1) % stride == 0:
            states[:, t // stride] = state
    return states


def decayed_scores(q: Tensor, k: Tensor, cumulative: Tensor) -> Tensor:
    """Return ``[..., query, key]``: Σ_d q_{r,d} k_{i,d} exp(b_{r,d} − b_{i,d}) where i <= r, 0 above
    the diagonal, for q, k, cumulative log decays b ``[..., pos, d_k]`` (one exponent of a difference
    <= 0 per pair: no overflow however far the gate has decayed)."""
    n_pos = q.shape[-2]
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool, device=q.device).tril()
    gaps = (cumulative[..., :, None, :] - cumulative[..., None, :, :]).masked_fill(~causal[..., None], -torch.inf)
    return torch.einsum("...rd,...id,...rid->...ri", q, k, gaps.exp())


def gla_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    scale: float,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked form of `gla_recurrent` (module docstring): a masked quadratic form inside each chunk
    of `chunk_size` positions, the state between chunks. Shapes and returns as there."""
    batch, n_pos, n_heads, d_k = k.shape
    state = k.new_zeros(batch, n_heads, d_k, v.shape[-1]) if initial_state is None else initial_state
    outputs = []
    for start in range(0, n_pos, chunk_size):
        # [batch, head, chunk, dim] within the chunk; b_r = Σ_{i<=r} log α_i
        cq, ck, cv, cg = (t[:, start : start + chunk_size].transpose(1, 2) for t in (q, k, v, log_decay))
        cumulative = cg.cumsum(dim=2)
        from_state = (cq * cumulative.exp()) @ state
        outputs.append((scale * (from_state + decayed_scores(cq, ck, cumulative) @ cv)).transpose(1, 2))
        last = cumulative[:, :, -1:]
        state = last.transpose(-1, -2).exp() * state + (ck * (last - cumulative).exp()).transpose(-1, -2) @ cv
    return torch.cat(outputs, dim=1), state


def gla_carry(log_decay: Tensor, edit: Tensor, keep: Tensor | None = None) -> Tensor:
    """GLA's homogeneous recurrence c_t = keep_t diag(α_t) c_{t-1} + e_t from c_{-1} = 0: how edits e
    ``[batch, pos, head, d_k, d_v]`` of the state move later states (`state_patch`; `keep`
    ``[batch, pos]``, None: everywhere); log_decay ``[batch, pos, head, d_k]``."""
    decay = log_decay.exp()
    if keep is not None:
        decay = decay * keep[:, :, None, None]
    return linear_scan(decay[..., None].expand_as(edit), edit)


def _head_results(mixer: GatedLinearAttention, hook) -> tuple[Tensor, Tensor]:
    """RMSNorm(y) ⊙ swish gate per head, and out_proj's weight per head (`MixerSpec.head_results`)."""
    inputs = mixer.g_norm(hook("y"))
    if mixer.use_output_gate:
        inputs = inputs * hook("out_gate")
    return inputs, mixer.out_proj.weight.unflatten(1, (mixer.num_heads, mixer.d_v))


SPEC = MixerSpec(
    name="gla",
    mixer=GatedLinearAttention,
    heads=Heads(count="num_heads", split="expand_v"),
    meanings={
        "q": "queries per head (short conv and SiLU with use_short_conv; before the 1/√d_k scale)",
        "k": "keys per head (short conv and SiLU with use_short_conv)",
        "v": "values per head (short conv and SiLU with use_short_conv)",
        "gate": "log α_t = logsigmoid(low-rank W x)/τ (τ 16): the data-dependent decay gate per key channel",
        "state": "S_t = diag(α_t) S_{t-1} + k_tᵀ v_t (after position t); patching propagates",
        "y": "output q_t S_t / √d_k per head, before the norm",
        "out_gate": "output gate swish(W_g x) per head",
    },
    head_results=_head_results,
    attention_values=("v", "y"),
    output_projections=("out_proj",),
    output_head_axes="head d_head",
    tl_attention={"q": "q", "k": "k", "v": "v", "z": "y"},
)
