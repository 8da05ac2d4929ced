"""DeltaNet: linear attention with the delta rule (Schlag et al. 2021, "Linear Transformers
Are Secretly Fast Weight Programmers"; Yang et al. 2024, "Parallelizing Linear Transformers
with the Delta Rule over Sequence Length"), as flash-linear-attention's `DeltaNet` layer
(which zoology's `delta_net.py` wraps).

Per head, with q_t, k_t L2-normalised and beta_t = sigmoid(W_beta x_t) in (0, 1):

    S_t = S_{t-1} - beta_t (S_{t-1} k_t - v_t) k_tᵀ = S_{t-1} (I - beta_t k_t k_tᵀ) + beta_t v_t k_tᵀ
    o_t = S_t q_t                                                   (S_t: [d_head(v), d_head(k)])

q, k, v come from linear projections, short causal convolutions (kernel 4) and SiLU.

Two forms compute the same o:
- recurrent: the loop above, one position at a time;
- chunked (Yang et al. 2024 §3): within a chunk of C positions with initial state S_0,
  the product of Householder-like factors has the WY form
  prod_{i<=r} (I - beta_i k_i k_iᵀ) = I - Σ_{i<=r} w_i k_iᵀ, and S_r = S_0 + Σ_{i<=r} (u_i - S_0 w_i) k_iᵀ,
  where W = T diag(beta) K, U = T diag(beta) V and T = (I + tril(diag(beta) K Kᵀ, -1))⁻¹
  (the UT transform, one triangular solve per chunk). Chunks follow one another sequentially.
The per-position state is materialised only when its hook is active.
"""

from __future__ import annotations

from functools import partial

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
from .base import Mixer, kept, needs_grad, one_pass, replay_before, state_before
from .capabilities import EffectiveAttentionMap, PathRoutes
from .mixer_spec import Heads, MixerSpec
from .short_conv import ShortConv
from .state_patch import hook_state_with_propagation

MODES = ("chunk", "recurrent")


class DeltaNet(Mixer, PathRoutes, EffectiveAttentionMap):
    """Delta-rule linear attention, per-head output RMSNorm (optional), output projection.

    Inside hooks (shapes for input ``[batch, pos, d_model]``):
    ``hook_q, hook_k, hook_v``: ``[batch, pos, head, d_head]`` (q, k after the L2 norm);
    ``hook_beta``: ``[batch, pos, head]``;
    ``hook_state``: ``[batch, pos, head, d_head(v), d_head(k)]``, S_t after position t,
    materialised only when the hook is active; a patched state is continued by the
    recurrence from the patched position on;
    ``hook_y``: ``[batch, pos, head, d_head]``, o_t = S_t q_t before the output norm.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 1,
        conv_size: int = 4,
        conv_bias: bool = False,
        use_beta: bool = True,
        output_norm: bool = True,
        norm_eps: float = 1e-5,
        mode: str = "chunk",
        chunk_size: int = 64,
        bias: bool = False,
    ):
        super().__init__()
        if num_heads < 1 or d_model % num_heads:
            raise UsageError(f"deltanet: d_model {d_model} is not divisible by num_heads {num_heads}")
        if conv_size < 0:
            raise UsageError(f"deltanet: conv_size must be >= 0 (0 removes the convolutions), got {conv_size}")
        if mode not in MODES:
            raise UsageError(f"deltanet: mode must be one of {MODES}, got {mode!r}")
        if chunk_size < 1:
            raise UsageError(f"deltanet: chunk_size must be >= 1, got {chunk_size}")
        self.num_heads, self.d_head = num_heads, d_model // num_heads
        self.mode, self.chunk_size, self.use_beta = mode, chunk_size, use_beta
        # flash-linear-attention's names (its o_proj is our out_proj, for the backbone's init)
        # `bias`: biases on the linear projections (q, k, v, beta, output); off as in fla
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        if use_beta:
            self.b_proj = nn.Linear(d_model, num_heads, bias=bias)
        if conv_size > 0:
            self.q_conv1d = ShortConv(d_model, conv_size, bias=conv_bias)
            self.k_conv1d = ShortConv(d_model, conv_size, bias=conv_bias)
            self.v_conv1d = ShortConv(d_model, conv_size, bias=conv_bias)
        self.conv_size = conv_size
        self.o_norm = nn.RMSNorm(self.d_head, eps=norm_eps) if output_norm else nn.Identity()
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        head_axes = "batch pos head d_head"
        self.hook_q, self.hook_k, self.hook_v = (AxisHookPoint(head_axes) for _ in range(3))
        self.hook_beta = AxisHookPoint("batch pos head")
        self.hook_state = AxisHookPoint("batch pos head d_head_v d_head_k")
        self.hook_y = AxisHookPoint(head_axes)

    def forward(self, x: Resid) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]``."""
        return self._hooked_forward(x)[0]

    def _hooked_forward(self, x: Resid, with_context: bool = False) -> tuple[Resid, Context | None]:
        """Return (forward(x), None); with `with_context`, the run's context (`prefix_context`)
        from the same pass instead of None (not for a hooked state, whose edits it would miss)."""
        batch, n_pos, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # what a resumed window's convolutions read of earlier positions
        conv_inputs = {"q": q, "k": k, "v": v} if self.conv_size > 0 else {}
        if self.conv_size > 0:
            q, k, v = self.q_conv1d(q), self.k_conv1d(k), self.v_conv1d(v)
        q, k, v = self._heads(q, k, v)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        beta = self.hook_beta(self._beta(x))
        context: Context | None = None
        if with_context:  # never with a hooked state (`Mixer.forward_with_context`)
            y, every = delta_rule_chunked(q, k, v, beta, self.STATE_STRIDE, return_states="chunks")
            context = {**conv_inputs, "keys": k.contiguous(), "values": v.contiguous(), "beta": beta, "state": every}
        elif hook_in_use(self.hook_state):
            states = hook_state_with_propagation(
                self.hook_state,
                self._states(q, k, v, beta, None, 0, n_pos),
                partial(self._states, q, k, v, beta),
                partial(delta_rule_carry, k, beta),
            )
            y = torch.einsum("bthvk,bthk->bthv", states, q)
        else:
            y = self._outputs(q, k, v, beta)
        y = self.hook_y(y)
        return self.out_proj(self.o_norm(y).reshape(batch, n_pos, -1)), context

    def effective_attention(self, x: Resid) -> EffectiveAttention:
        """Return M ``[batch, head, query_pos, key_pos]`` (float32): the delta rule's exact
        operator on the values, key removal included. Unrolling
        S_t = S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ gives
        S_t = Σ_{s<=t} β_s v_s k_sᵀ (I - β_{s+1} k_{s+1} k_{s+1}ᵀ) ··· (I - β_t k_t k_tᵀ), so

            M[h, t, s] = β_s k_sᵀ (Π_{r=s+1..t} (I - β_r k_r k_rᵀ)) q_t      (s <= t, r ascending)

        and ``hook_y[b, t, h] = Σ_s M[b, h, t, s] hook_v[b, s, h]`` exactly (o_t = S_t q_t,
        before the output norm). Equivalently M = tril(Q Kᵀ) (I + stril(diag(β) K Kᵀ))⁻¹ diag(β),
        the UT form of Yang et al. 2024; the backward sweep below never inverts a matrix: it
        carries every query back through one factor per key position (float64, each factor
        has norm <= 1, so nothing grows).
        """
        q, k = self.q_proj(x), self.k_proj(x)
        if self.conv_size > 0:
            q, k = self.q_conv1d(q), self.k_conv1d(k)
        q, k, _ = self._heads(q, k, k)  # the values are not needed (M acts on them)
        q, k = (t.double().transpose(1, 2) for t in (q, k))  # [b, h, t, d_k]
        beta = self._beta(x).double().transpose(1, 2)  # [b, h, t]
        n_pos = x.shape[1]
        M = q.new_zeros(*beta.shape, n_pos)
        # carried[..., t, :] = (Π_{r=s+1..t} (I - β_r k_r k_rᵀ)) q_t for the current s (t >= s)
        carried = q.clone()
        for s in reversed(range(n_pos)):
            read = torch.einsum("bhd,bhtd->bht", k[:, :, s], carried[:, :, s:])  # k_sᵀ (Π ...) q_t
            M[:, :, s:, s] = beta[:, :, s, None] * read
            # one more factor for key s - 1: (I - β_s k_s k_sᵀ) applied to every carried query
            carried[:, :, s:] -= M[:, :, s:, s, None] * k[:, :, s, None, :]
        return M.float()

    # -- path patching (see `PathRoutes`) -------------------------------------
    head_outputs = ("y",)
    head_inputs = ("q", "k", "v", "beta")
    state_hooks = ("state",)
    state_readout = "y"

    def state_path(self, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_y`` ``[run, pos, head, d_head]`` along the state path: with
        w_t = β_t v_t k_tᵀ the write of position t,

            ΔS_t = ΔS_{t-1} (I − β_t k_t k_tᵀ) + [t is a sender] (w_t(clean) − w_t(corrupt))

        (β, k of the corrupt run: its own transitions), read out as ΔS_t q_t with its q."""
        writes = []
        for x in (clean, corrupt):
            q, k, v = self._heads(*self._projections(x))
            beta = self._beta(x)
            writes.append(beta[..., None, None] * v[..., :, None] * k[..., None, :])  # [b, t, h, d_v, d_k]
        # the loop leaves q, k, β of the corrupt run, the last one
        change = torch.where(senders[:, :, None, None, None], writes[0] - writes[1], torch.zeros_like(writes[1]))
        state_change = torch.zeros_like(change[:, 0])
        read = []
        for t in range(change.shape[1]):
            removed = torch.einsum("bhvk,bhk->bhv", state_change, k[:, t])
            state_change = state_change - beta[:, t, :, None, None] * removed[..., None] * k[:, t, :, None, :]
            state_change = state_change + change[:, t]
            read.append(torch.einsum("bhvk,bhk->bhv", state_change, q[:, t]))
        return torch.stack(read, dim=1)

    def conv_hooks(self) -> dict[str, tuple[str, ...]]:
        """``{"q": ("q",), "k": ("k",), "v": ("v",)}``: the three short convolutions (none with
        conv_size 0); each hook holds its convolution's output after SiLU (and the L2 norm for q, k)."""
        return {name: (name,) for name in "qkv"} if self.conv_size > 0 else {}

    def conv_path(self, receiver: str, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_q``, ``hook_k`` or ``hook_v`` (`receiver`) ``[run, pos, head,
        d_head]`` when that projection at the `senders` positions is the clean run's: the taps'
        change is added to the corrupt run's convolution output, then SiLU (and the L2 norm)."""
        index = "qkv".index(receiver)
        conv = (self.q_conv1d, self.k_conv1d, self.v_conv1d)[index]
        before = self._projections(corrupt, convolve=False)[index]
        after = self._projections(clean, convolve=False)[index]
        change = torch.where(senders[..., None], after - before, torch.zeros_like(before))
        convolved = conv(before)
        old, new = (self._heads(t, t, t)[index] for t in (convolved, convolved + conv.taps(change)))
        return new - old

    # -- resuming from a position (see `Mixer.forward_from`) ---------------------------------
    # A state is d_v·d_k numbers per head and position (16384 at d_model 128), its inputs
    # k, v, β 2·d_head + 1: the context keeps a state every STATE_STRIDE positions and the
    # inputs everywhere, and a resumed run replays the at most STATE_STRIDE - 1 positions in
    # between (writing every state cost more, in fresh memory alone, than the resumed runs). The
    # kept states are the boundaries of the base run's chunked delta rule in chunks of
    # STATE_STRIDE: one pass gives the output and them.
    STATE_STRIDE = 16

    def prefix_context(self, x: RunResid) -> Context:
        """Return, for a run on `x` ``[N, T, d_model]``: ``q``, ``k``, ``v`` ``[N, T, d_model]``,
        the projections before their convs (only with conv_size > 0: the window's convs read
        the conv_size - 1 positions before it); the delta rule's inputs ``keys``, ``values``
        ``[N, T, head, d_head]`` and ``beta`` ``[N, T, head]``; and ``state`` ``[N, T //
        STATE_STRIDE, head, d_v, d_k]``, S_t after positions STATE_STRIDE - 1, 2 STATE_STRIDE - 1, ..."""
        return self._output_and_context(x)[1]

    def fused_forward_with_context(self, x: RunResid, hooked: bool) -> tuple[RunResid, Context] | None:
        """Return ``(forward(x), prefix_context(x))`` from one pass (`one_pass`)."""
        return one_pass(self._hooked_forward, x, hooked, self._output_and_context)

    def _output_and_context(self, x: RunResid) -> tuple[RunResid, Context]:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        context = {"q": q, "k": k, "v": v} if self.conv_size > 0 else {}
        if self.conv_size > 0:
            q, k, v = self.q_conv1d(q), self.k_conv1d(k), self.v_conv1d(v)
        q, k, v = self._heads(q, k, v)
        beta = self._beta(x)
        y, every = delta_rule_chunked(q, k, v, beta, self.STATE_STRIDE, return_states="chunks")
        # contiguous: a resume looks rows up in the row-flattened inputs, which a view would copy whole
        context.update(keys=k.contiguous(), values=v.contiguous(), beta=beta, state=every)
        return self.out_proj(self.o_norm(y).flatten(2)), context

    def _outputs(self, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial: Tensor | None = None) -> Tensor:
        """Return the delta rule's outputs ``[b, t, head, d_v]`` (`mode`'s form) from the state `initial`."""
        if self.mode == "chunk":
            return delta_rule_chunked(q, k, v, beta, self.chunk_size, initial_state=initial)[0]
        return delta_rule_recurrent(q, k, v, beta, initial_state=initial)[0]

    def state_from_context(self, name: str, context: Context, rows: RowInts, positions: RowInts) -> Tensor:
        """Return ``hook_state`` of the context's run at ``positions[i]`` of row ``rows[i]``, ``[B,
        head, d_v, d_k]``: the state before the next position (`_state_before`; see
        `Mixer.state_from_context`)."""
        assert name in self.state_hooks
        return self._state_before(context, rows, positions + 1)

    def _state_before(self, context: Context, rows: RowInts, start: RowInts) -> Tensor:
        """Return the base run's state S after position ``start[i] - 1`` of row ``rows[i]``
        ``[B, head, d_v, d_k]``: the context's last kept state before it, carried over the
        positions in between with the base run's inputs."""
        stride = self.STATE_STRIDE
        kept_state = state_before(context["state"], rows, start // stride)
        (k, v, beta), live = replay_before([context["keys"], context["values"], context["beta"]], rows, start, stride)
        beta = beta * live[..., None]  # β = 0: the state is left as it is, a no-op
        return delta_rule_chunked(k, k, v, beta, stride - 1, initial_state=kept_state)[1]

    window_hooks = True

    def forward_from(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output ``[B, W, d_model]`` at the window `x` ``[B, W, d_model]`` (see
        `Mixer.forward_from`): projections on the window only, the delta rule from S_{start-1}.
        The inside hooks fire on the window; a state edit is carried on from the window's start."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.conv_size > 0:
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            q, k, v = (
                conv.forward_from(t, context[name], rows, start)
                for conv, name, t in zip(convs, "qkv", (q, k, v), strict=True)
            )
        q, k, v = self._heads(q, k, v)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        beta = self.hook_beta(self._beta(x))
        initial = self._state_before(context, rows, start)
        if hook_in_use(self.hook_state):
            states = hook_state_with_propagation(
                self.hook_state,
                self._states(q, k, v, beta, initial, 0, x.shape[1]),
                partial(self._states, q, k, v, beta),
                partial(delta_rule_carry, k, beta),
                initial,
            )
            y = torch.einsum("bthvk,bthk->bthv", states, q)
        else:
            y = self._outputs(q, k, v, beta, initial)
        return self.out_proj(kept(self.o_norm(self.hook_y(y)), keep).flatten(2))

    def _projections(self, x: Tensor, convolve: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """Return the q, k, v projections of `x` ``[b, t, d_model]`` (each ``[b, t, d_model]``),
        through their short convolutions unless `convolve` is False (as `forward`, without hooks)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if convolve and self.conv_size > 0:
            q, k, v = self.q_conv1d(q), self.k_conv1d(k), self.v_conv1d(v)
        return q, k, v

    def _heads(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Return q, k, v ``[b, t, head, d_head]`` from the (convolved) projections ``[b, t, d_model]``:
        SiLU, then the L2 norm on q and k."""
        q, k, v = (F.silu(t).unflatten(-1, (self.num_heads, self.d_head)) for t in (q, k, v))
        return l2_normalize(q), l2_normalize(k), v

    def _beta(self, x: Tensor) -> Tensor:
        """Return the write strength beta ``[b, t, head]`` (ones without `use_beta`)."""
        return self.b_proj(x).sigmoid() if self.use_beta else x.new_ones(*x.shape[:2], self.num_heads)

    def _states(
        self, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Tensor | None, start: int, end: int
    ) -> Tensor:
        """States after positions start .. end-1 from the state before `start`,
        ``[batch, end - start, head, d_v, d_k]`` (the rescan of `state_patch`)."""
        window = slice(start, end)
        if not needs_grad(q, k, v, beta, initial_state):
            # every state is written anyway: in place, without the chunked form's increments
            return delta_rule_states(q[:, window], k[:, window], v[:, window], beta[:, window], initial_state)
        return delta_rule_chunked(
            q[:, window],
            k[:, window],
            v[:, window],
            beta[:, window],
            self.chunk_size,
            return_states=True,
            initial_state=initial_state,
        )[1]


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(|x|² + eps) over the last axis (flash-linear-attention's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_step(state: Tensor, k: Tensor, v: Tensor, beta: Tensor) -> Tensor:
    """One delta-rule update: state ``[batch, head, d_v, d_k]``, k ``[batch, head, d_k]``,
    v ``[batch, head, d_v]``, beta ``[batch, head]``; returns the next state."""
    error = torch.einsum("bhvk,bhk->bhv", state, k) - v
    return state - beta[..., None, None] * error.unsqueeze(-1) * k.unsqueeze(-2)


def delta_rule_carry(k: Tensor, beta: Tensor, edit: Tensor, keep: Tensor | None = None) -> Tensor:
    """The delta rule's homogeneous recurrence c_t = keep_t c_{t-1} (I − β_t k_t k_tᵀ) + e_t from
    c_{-1} = 0: how edits e ``[batch, pos, head, d_v, d_k]`` of the state move later states
    (`state_patch`; `keep` ``[batch, pos]``, None: everywhere); k ``[batch, pos, head, d_k]``,
    beta ``[batch, pos, head]``."""
    carried, state = [], torch.zeros_like(edit[:, 0])
    for t in range(edit.shape[1]):
        kept = torch.einsum("bhvk,bhk->bhv", state, k[:, t])
        state = state - beta[:, t, :, None, None] * kept[..., None] * k[:, t, :, None, :]
        if keep is not None:
            state = state * keep[:, t, None, None, None]
        state = state + edit[:, t]
        carried.append(state)
    return torch.stack(carried, dim=1)


def delta_rule_recurrent(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The sequential reference: returns (o ``[batch, pos, head, d_v]``, final state
    ``[batch, head, d_v, d_k]``) for q, k ``[batch, pos, head, d_k]``, v ``[batch, pos, head, d_v]``,
    beta ``[batch, pos, head]``."""
    batch, n_pos, n_heads, d_k = k.shape
    state = initial_state if initial_state is not None else k.new_zeros(batch, n_heads, v.shape[-1], d_k)
    outputs = []
    for t in range(n_pos):
        state = delta_rule_step(state, k[:, t], v[:, t], beta[:, t])
        outputs.append(torch.einsum("bhvk,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def delta_rule_states(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, initial_state: Tensor | None = None, stride: int = 1
) -> Tensor:
    """Return the delta rule's state after positions stride - 1, 2 stride - 1, ... (`stride` 1:
    every position) ``[batch, pos // stride, head, d_v, d_k]`` (shapes as `delta_rule_recurrent`),
    updated in place: not differentiable, for runs without autograd (every state: 2.9x faster
    than `delta_rule_chunked`'s at 35 positions, d_k = d_v = 128)."""
    batch, n_pos, n_heads, d_k = k.shape
    state = k.new_zeros(batch, n_heads, v.shape[-1], d_k) if initial_state is None else initial_state.clone()
    states = k.new_empty(batch, n_pos // stride, *state.shape[1:])
    for t in range(n_pos):
        error = (state @ k[:, t, :, :, None]).squeeze(-1).sub_(v[:, t]).mul_(beta[:, t, :, None])  # β (S k − v)
        state.sub_(error[..., None] * k[:, t, :, None, :])
        if (t + 1) % stride == 0:
            states[:, t // stride] = state
    return states


def delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    return_states: bool | str = False,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked (WY / UT-transform) form of `delta_rule_recurrent`.

    Shapes as there. Returns (o ``[batch, pos, head, d_v]``, states): with `return_states`
    True the state after every position ``[batch, pos, head, d_v, d_k]``; with ``"chunks"`` the
    state after each whole chunk, i.e. after positions chunk_size - 1, 2 chunk_size - 1, ...
    ``[batch, pos // chunk_size, head, d_v, d_k]`` (the states the chunked form computes anyway);
    else the final state ``[batch, head, d_v, d_k]``.
    """
    batch, n_pos, n_heads, d_k = k.shape
    state = initial_state if initial_state is not None else k.new_zeros(batch, n_heads, v.shape[-1], d_k)
    outputs, all_states = [], []
    for start in range(0, n_pos, chunk_size):
        # [batch, head, chunk, dim] within the chunk
        cq, ck, cv = (t[:, start : start + chunk_size].transpose(1, 2) for t in (q, k, v))
        cb = beta[:, start : start + chunk_size].transpose(1, 2).unsqueeze(-1)
        size = ck.shape[2]
        causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
        strictly_lower = causal.tril(-1)
        # (I + A) with A_{ri} = beta_r k_rᵀ k_i for i < r: then W = (I + A)⁻¹ diag(beta) K
        unit_lower = (cb * ck @ ck.transpose(-1, -2)).masked_fill(~strictly_lower, 0.0)
        unit_lower = unit_lower + torch.eye(size, dtype=k.dtype, device=k.device)
        # one triangular solve gives both W and U
        w, u = torch.linalg.solve_triangular(
            unit_lower, torch.cat([cb * ck, cb * cv], dim=-1), upper=False, unitriangular=True
        ).split([d_k, cv.shape[-1]], dim=-1)
        # rows u_i - S_0 w_i: what position i writes on top of the chunk's initial state
        new_values = u - w @ state.transpose(-1, -2)  # [b, h, c, d_v]
        scores = (cq @ ck.transpose(-1, -2)).masked_fill(~causal, 0.0)
        outputs.append((cq @ state.transpose(-1, -2) + scores @ new_values).transpose(1, 2))
        if return_states is True:
            increments = new_values.unsqueeze(-1) * ck.unsqueeze(-2)  # [b, h, c, d_v, d_k]
            all_states.append((state.unsqueeze(2) + increments.cumsum(dim=2)).transpose(1, 2))
        state = state + new_values.transpose(-1, -2) @ ck
        if return_states == "chunks" and size == chunk_size:
            all_states.append(state[:, None])
    o = torch.cat(outputs, dim=1)
    if return_states == "chunks" and not all_states:  # no whole chunk
        return o, state.new_empty(batch, 0, *state.shape[1:])
    return o, (torch.cat(all_states, dim=1) if return_states else state)


def _head_results(mixer: DeltaNet, hook) -> tuple[Tensor, Tensor]:
    """The output norm of y per head, and out_proj's weight per head (`MixerSpec.head_results`)."""
    return mixer.o_norm(hook("y")), mixer.out_proj.weight.unflatten(1, (mixer.num_heads, mixer.d_head))


SPEC = MixerSpec(
    name="deltanet",
    mixer=DeltaNet,
    heads=Heads(count="num_heads"),
    meanings={
        "q": "queries (short conv, SiLU, L2-normalised)",
        "k": "keys (short conv, SiLU, L2-normalised)",
        "v": "values (short conv, SiLU)",
        "beta": "writing strength β = sigmoid(W x) per head",
        "state": "S_t = S_{t-1} − β_t (S_{t-1} k_t − v_t) k_tᵀ (after position t); patching propagates",
        "y": "output S_t q_t per head",
    },
    notes=(
        "TransformerLens's GatedDeltaNet bridge names q, k and β `hook_ssm_C`, `hook_ssm_B` and `hook_ssm_write`, "
        "on a gated variant at `blocks.{l}.linear_attn`, whose `hook_ssm_state` is [batch, pos, head, d_head_k, "
        "d_head_v] (this mixer's `state` transposed): not aliased."
    ),
    head_results=_head_results,
    output_projections=("out_proj",),
    output_head_axes="head d_head",
    tl_attention={"q": "q", "k": "k", "v": "v", "z": "y"},
)
