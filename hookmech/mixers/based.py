"""Based linear attention (Arora et al. 2024, "Simple linear attention language models
balance the recall-throughput tradeoff"), as zoology's `zoology/mixers/based.py`.

Per head, with a feature map phi on queries and keys (paper eq. 2–3):

    y_t = phi(q_t)ᵀ S_t / (phi(q_t)ᵀ z_t + eps),   S_t = Σ_{s<=t} phi(k_s) v_sᵀ,   z_t = Σ_{s<=t} phi(k_s)

phi is the 2nd-order Taylor expansion of exp (paper §4.1), so that
phi(q)ᵀ phi(k) = 1 + qᵀk/√d + (qᵀk)²/(2d) ≈ exp(qᵀk/√d), d = feature_dim:

    phi(x) = [1, x / d^¼, vec(x xᵀ) / (√2 √d)]          (1 + d + d² features)

Two views compute the same y (paper 000 appendix B uses `train_view="quadratic"`):
- quadratic: A = causal(phi(Q) phi(K)ᵀ), y = A V / (A 1 + eps), like softmax attention;
- linear: the recurrence above, chunked (intra-chunk quadratic, inter-chunk state).
The recurrent state (S_t, z_t) is materialised per position only when its hook is active.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import UsageError
from ..hooks import AxisHookPoint, hook_in_use
from ..shapes import (
    Context,
    EffectiveAttention,
    Gradients,
    KeptWindow,
    PositionEffects,
    Resid,
    RowInts,
    RunActs,
    RunMask,
    RunResid,
    Window,
)
from .base import Mixer, kept, pattern_effects_by_rows, replay_before, state_before
from .capabilities import EffectiveAttentionMap, ExactPatchEffects, MixerMemo, PathRoutes
from .mixer_spec import Heads, MixerSpec
from .selective_scan import linear_scan
from .state_patch import hook_state_with_propagation

TRAIN_VIEWS = ("quadratic", "linear")
#: what a patched position's input changes, the hooks AtP*'s exact computation takes (`position_patch_effects`)
PATCH_FEATURES = ("phi_q", "phi_k", "v")
FEATURE_MAPS = ("taylor_exp",)


class TaylorExp(nn.Module):
    """2nd-order Taylor feature map of exp(qᵀk/√d): ``[..., d] -> [..., 1 + d + d²]``."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.input_dim = input_dim
        self.r2 = math.sqrt(2)
        self.rd = math.sqrt(input_dim)
        self.rrd = math.sqrt(self.rd)

    @property
    def output_dim(self) -> int:
        return 1 + self.input_dim + self.input_dim**2

    def forward(self, x: Tensor) -> Tensor:
        """Return phi(x) ``[..., 1 + d + d²]`` for x ``[..., d]``."""
        x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(start_dim=-2) / self.r2
        return torch.cat([torch.ones_like(x[..., :1]), x / self.rrd, x2 / self.rd], dim=-1)


class Based(Mixer, ExactPatchEffects, PathRoutes, EffectiveAttentionMap):
    """Causal linear attention with a Taylor-exp feature map, then an output projection.

    Inside hooks (shapes for input ``[batch, pos, d_model]``; F = 1 + feature_dim + feature_dim²):
    ``hook_q, hook_k``: ``[batch, pos, head, feature_dim]`` (before the feature map);
    ``hook_v, hook_y``: ``[batch, pos, head, d_head]`` (y: normalised output, before out_proj);
    ``hook_phi_q, hook_phi_k``: ``[batch, pos, head, F]``;
    ``hook_kv_state``: ``[batch, pos, head, F, d_head]``, S_t after position t;
    ``hook_k_state``: ``[batch, pos, head, F]``, the normaliser z_t after position t.
    The states are materialised only when their hook is active; a patched state is
    continued by the recurrence from the patched position on.

    `bias` changes nothing, exactly as in zoology: its ``Based`` takes ``bias`` (paper 000's
    code passes ``bias=False``) into ``**kwargs`` and ignores it; its projections are always
    bias-free, and so are ours. It is accepted so that a model-wide ``bias`` reaches every layer.
    """

    def __init__(
        self,
        d_model: int,
        feature_dim: int = 8,
        num_key_value_heads: int = 1,
        num_heads: int = 1,
        feature_name: str = "taylor_exp",
        train_view: str = "quadratic",
        eps: float = 1e-12,
        chunk_size: int = 64,
        bias: bool = False,
    ):
        super().__init__()
        del bias  # accepted and ignored, as zoology's Based does (see the class docstring)
        if feature_name not in FEATURE_MAPS:
            raise UsageError(f"based: feature_name must be one of {FEATURE_MAPS}, got {feature_name!r}")
        if train_view not in TRAIN_VIEWS:
            raise UsageError(f"based: train_view must be one of {TRAIN_VIEWS}, got {train_view!r}")
        if feature_dim < 1:
            raise UsageError(f"based: feature_dim must be >= 1, got {feature_dim}")
        if num_heads < 1 or d_model % num_heads:
            raise UsageError(f"based: d_model {d_model} is not divisible by num_heads {num_heads}")
        # zoology sizes k by num_heads and views it by num_key_value_heads: they must agree.
        if num_key_value_heads != num_heads:
            raise UsageError(f"based: num_key_value_heads ({num_key_value_heads}) must equal num_heads ({num_heads})")
        if eps < 0:
            raise UsageError(f"based: eps must be >= 0, got {eps}")
        if chunk_size < 1:
            raise UsageError(f"based: chunk_size must be >= 1, got {chunk_size}")
        self.feature_dim, self.num_heads = feature_dim, num_heads
        self.d_head = d_model // num_heads
        self.train_view, self.eps, self.chunk_size = train_view, eps, chunk_size
        self.feature_map = TaylorExp(feature_dim)
        # zoology's names and bias-free projections; its proj_o is our out_proj (backbone init:
        # scaled as an output projection under "normal", not under "normal-by-name").
        self.proj_q = nn.Linear(d_model, feature_dim * num_heads, bias=False)
        self.proj_k = nn.Linear(d_model, feature_dim * num_heads, bias=False)
        self.proj_v = nn.Linear(d_model, num_heads * self.d_head, bias=False)
        self.out_proj = nn.Linear(num_heads * self.d_head, d_model, bias=False)
        self.hook_q = AxisHookPoint("batch pos head feature_dim")
        self.hook_k = AxisHookPoint("batch pos head feature_dim")
        self.hook_v = AxisHookPoint("batch pos head d_head")
        self.hook_phi_q = AxisHookPoint("batch pos head feature")
        self.hook_phi_k = AxisHookPoint("batch pos head feature")
        self.hook_kv_state = AxisHookPoint("batch pos head feature d_head")
        self.hook_k_state = AxisHookPoint("batch pos head feature")
        self.hook_y = AxisHookPoint("batch pos head d_head")

    def forward(self, x: Resid) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]``."""
        batch, n_pos, _ = x.shape
        phi_q, phi_k, v = self._hooked_features(x)
        if hook_in_use(self.hook_kv_state) or hook_in_use(self.hook_k_state):
            y = self._recurrent_view(phi_q, phi_k, v)
        elif self.train_view == "quadratic":
            y = based_quadratic(phi_q, phi_k, v, self.eps)
        else:
            y = based_chunked(phi_q, phi_k, v, self.eps, self.chunk_size)
        y = self.hook_y(y)
        return self.out_proj(y.reshape(batch, n_pos, -1))

    def effective_attention(self, x: Resid) -> EffectiveAttention:
        """Return M ``[batch, head, query_pos, key_pos]`` (float32): the feature-map kernel,
        normalised as the mixer normalises it (either view; they compute the same y):

            M[h, t, s] = phi(q_t) · phi(k_s) / (Σ_{s'<=t} phi(q_t) · phi(k_s') + eps)     (s <= t)

        so that ``hook_y[b, t, h] = Σ_s M[b, h, t, s] hook_v[b, s, h]`` exactly. The Taylor
        kernel phi(q)·phi(k) = ((qᵀk/√d + 1)² + 1) / 2 is positive, so each row of M is a
        distribution over keys (up to eps), like a softmax pattern.
        """
        phi_q, phi_k, _ = self._features(x)
        n_pos = x.shape[1]
        causal = torch.ones(n_pos, n_pos, dtype=torch.bool, device=x.device).tril()
        scores = torch.einsum("bqhf,bkhf->bhqk", phi_q.double(), phi_k.double()).masked_fill(~causal, 0.0)
        return (scores / (scores.sum(-1, keepdim=True) + self.eps)).float()

    # -- path patching (see `PathRoutes`) -------------------------------------
    head_outputs = ("y",)
    head_inputs = ("q", "k", "v", "phi_q", "phi_k")
    state_hooks = ("kv_state", "k_state")
    state_readout = "y"

    def state_path(self, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_y`` ``[run, pos, head, d_head]`` along the state path. The
        state is the pair (S_t, z_t) = (Σ_{s<=t} phi(k_s) v_sᵀ, Σ_{s<=t} phi(k_s)), whose transition
        is the identity: the senders' clean-minus-corrupt writes are added to the corrupt state at
        their position and every later one, and read out with the corrupt run's query,

            y_t = phi(q_t)ᵀ (S_t + ΔS_t) / (phi(q_t)ᵀ (z_t + Δz_t) + eps),

        minus the corrupt read-out (the same formula with ΔS = Δz = 0; either view of the mixer
        computes this y)."""
        phi_q, phi_k, v = self._features(corrupt)
        _, phi_k_clean, v_clean = self._features(clean)
        sender = senders[:, :, None, None]
        kv, kv_clean = (
            keys.unsqueeze(-1) * values.unsqueeze(-2) for keys, values in ((phi_k, v), (phi_k_clean, v_clean))
        )
        kv_change = torch.where(sender[..., None], kv_clean - kv, torch.zeros_like(kv)).cumsum(dim=1)
        k_change = torch.where(sender, phi_k_clean - phi_k, torch.zeros_like(phi_k)).cumsum(dim=1)
        kv_state, k_state = kv.cumsum(dim=1), phi_k.cumsum(dim=1)

        def read(kv_state: Tensor, k_state: Tensor) -> Tensor:
            numerator = torch.einsum("bthf,bthfd->bthd", phi_q, kv_state)
            return numerator / (torch.einsum("bthf,bthf->bth", phi_q, k_state).unsqueeze(-1) + self.eps)

        return read(kv_state + kv_change, k_state + k_change) - read(kv_state, k_state)

    # -- one position patched, through the normalised kernel exactly (AtP*, see `ExactPatchEffects`)
    def patches_exactly(self, hook: str | None = None) -> bool:
        """Return True for the input, q, k and the features phi_q, phi_k, v (`position_patch_effects`)."""
        return hook in (None, "q", "k", *PATCH_FEATURES)

    def exact_patch_effects(
        self, x: RunResid, grad_out: Gradients, patched: Tensor, hook: str | None, memo: MixerMemo | None
    ) -> PositionEffects:
        """Return ``[..., N, T]`` (float64): Σ_t (y'_t − y_t)·grad_out_t when position s alone is
        patched, the normalisation recomputed, not linearised: with a_tj = phi(q_t)·phi(k_j),
        y_t = Σ_j a_tj v_j / (Σ_j a_tj + eps). `patched` is the new input (`hook` None: new q, k
        and v at s) or the new ``q`` / ``k`` / ``phi_q`` / ``phi_k`` / ``v`` (inside hooks'
        short names) there. Each query t > s sees key s's score and value change (one column of
        the kernel moved: its numerator and normaliser updated in closed form); query s gets a
        new row. Not for ``hook_y`` nor the state hooks (the linear estimate is exact after the
        kernel; a state patch is carried by the recurrence): `patches_exactly`."""
        return pattern_effects_by_rows(
            lambda rows_x, rows_grad, rows_patched: self._row_effects(rows_x, rows_grad, rows_patched, hook),
            x,
            grad_out,
            patched,
            self.num_heads,
        )

    def _row_effects(self, x: RunResid, grad_out: Gradients, patched: Tensor, hook: str | None) -> PositionEffects:
        """`position_patch_effects` of a block of rows (`pattern_effects_by_rows`)."""
        features = PATCH_FEATURES
        base = dict(zip(features, (t.double() for t in self._features(x)), strict=True))
        new = dict(base)
        if hook is None:
            new = dict(zip(features, (t.double() for t in self._features(patched)), strict=True))
        elif hook in ("q", "k"):  # before the feature map
            new[f"phi_{hook}"] = self.feature_map(patched.double())
        else:
            new[hook] = patched.double()
        phi_q, phi_k, v = base["phi_q"], base["phi_k"], base["v"]
        # y_out = y Wᵀ (bias-free), so ∂m/∂y = ∂m/∂y_out · W, per head
        grad_y = (grad_out.double() @ self.out_proj.weight.double()).unflatten(-1, (self.num_heads, self.d_head))
        n_pos = x.shape[1]
        causal = torch.ones(n_pos, n_pos, dtype=torch.bool, device=x.device).tril()  # [t, j]: j <= t
        earlier = causal & ~torch.eye(n_pos, dtype=torch.bool, device=x.device)  # j < t
        scores = torch.einsum("bthf,bjhf->bhtj", phi_q, phi_k).masked_fill(~causal, 0.0)
        total = scores.sum(-1) + self.eps  # the normaliser of each query [b, h, t]
        seen = torch.einsum("bjhd,...bthd->...bhtj", v, grad_y)  # value j read along query t's gradient
        read = (scores * seen).sum(-1) / total  # y_t · ∂m/∂y_t  [..., b, h, t]
        # Query t > s: key s's column moves, the numerator and normaliser lose a_ts and gain a'_ts.
        new_score = torch.einsum("bthf,bshf->bhts", phi_q, new["phi_k"])
        new_seen = torch.einsum("bshd,...bthd->...bhts", new["v"], grad_y)
        # > 0 where phi is the feature map's (its kernel is positive); a patched phi_q / phi_k may be anything
        new_total = total[..., None] - scores + new_score
        column = (read[..., None] * total[..., None] - scores * seen + new_score * new_seen) / new_total
        column = (column - read[..., None]).masked_fill(~earlier, 0.0).sum(dim=-2)  # over t: [..., b, h, s]
        # Query s: a new row, its new query against the keys before it and its own new key.
        row_scores = torch.einsum("bshf,bjhf->bhsj", new["phi_q"], phi_k)
        own = (new["phi_q"] * new["phi_k"]).sum(-1).transpose(1, 2)  # [b, h, s]
        row_scores = torch.where(earlier, row_scores, own[..., None]).masked_fill(~causal, 0.0)
        own_seen = (new["v"] * grad_y).sum(-1).transpose(-1, -2)  # [..., b, h, s]
        row_seen = torch.where(earlier, seen, own_seen[..., None])
        row = (row_scores * row_seen).sum(-1) / (row_scores.sum(-1) + self.eps) - read
        return (column + row).sum(dim=-2)

    # -- resuming from a position (see `Mixer.forward_from`) ---------------------------------
    # The quadratic view's window attended to every earlier key, W x T products per row: at ATR's
    # lengths (windows of a few positions, hundreds of keys) most of a resumed run. Its context also
    # keeps the states every STATE_STRIDE positions (F·d_head numbers each, STATE_STRIDE times fewer
    # than per position), and a window runs the linear view from the state before it, replayed over
    # the at most STATE_STRIDE - 1 positions in between from the kept keys and values.
    STATE_STRIDE = 16

    def prefix_context(self, x: RunResid) -> Context:
        """Return, for a run on `x` ``[N, T, d_model]``, what the window's queries read of earlier
        positions. Quadratic view: ``phi_k`` ``[N, T, head, F]`` and ``v`` ``[N, T, head, d_head]``,
        and the states after positions STATE_STRIDE - 1, 2 STATE_STRIDE - 1, ..., ``kv_kept`` ``[N,
        T // STATE_STRIDE, head, F, d_head]`` and ``k_kept`` ``[N, T // STATE_STRIDE, head, F]``.
        Linear view: the states after each position, ``kv_state`` ``[N, T, head, F, d_head]`` and
        the normaliser ``k_state`` ``[N, T, head, F]``."""
        _, phi_k, v = self._features(x)
        if self.train_view == "quadratic":
            return {"phi_k": phi_k, "v": v, **self._kept_states(phi_k, v)}
        return {"kv_state": (phi_k.unsqueeze(-1) * v.unsqueeze(-2)).cumsum(dim=1), "k_state": phi_k.cumsum(dim=1)}

    def _kept_states(self, phi_k: Tensor, v: Tensor) -> Context:
        """Return ``kv_kept``, ``k_kept``: the states after positions STATE_STRIDE - 1, 2
        STATE_STRIDE - 1, ... (`prefix_context`), summed a block of STATE_STRIDE positions at a time."""
        stride = self.STATE_STRIDE
        blocks = phi_k.shape[1] // stride
        keys = phi_k[:, : blocks * stride].unflatten(1, (blocks, stride))
        values = v[:, : blocks * stride].unflatten(1, (blocks, stride))
        kv_kept = torch.einsum("ncshf,ncshd->nchfd", keys, values).cumsum(dim=1)
        return {"kv_kept": kv_kept, "k_kept": keys.sum(2).cumsum(dim=1)}

    def forward_from(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output ``[B, W, d_model]`` at the window `x` ``[B, W, d_model]`` (see
        `Mixer.forward_from`): projections on the window only; the queries read the state at
        start - 1 (`_states_before`: kept, or in the quadratic view replayed from the last kept one)
        and the window's own keys, in the linear view (the same sums, grouped by chunks)."""
        batch, n_pos, _ = x.shape
        phi_q, phi_k, v = self._hooked_features(x)
        initial = self._states_before(context, rows, start)
        if hook_in_use(self.hook_kv_state) or hook_in_use(self.hook_k_state):
            y = self._recurrent_view(phi_q, phi_k, v, initial)
        else:
            y = based_chunked(phi_q, phi_k, v, self.eps, self.chunk_size, initial_state=initial)
        return self.out_proj(kept(self.hook_y(y).reshape(batch, n_pos, -1), keep))

    window_hooks = True

    def state_from_context(self, name: str, context: Context, rows: RowInts, positions: RowInts) -> Tensor:
        """Return ``hook_kv_state`` ``[B, head, F, d_head]`` or ``hook_k_state`` ``[B, head, F]`` of the
        context's run at ``positions[i]`` of row ``rows[i]``: the states before the next position
        (`_states_before`; see `Mixer.state_from_context`)."""
        kv_state, k_state = self._states_before(context, rows, positions + 1)
        return {"kv_state": kv_state, "k_state": k_state}[name]

    def _states_before(self, context: Context, rows: RowInts, start: RowInts) -> tuple[Tensor, Tensor]:
        """Return the base run's states after position ``start[i] - 1`` of row ``rows[i]``: S
        ``[B, head, F, d_head]`` and z ``[B, head, F]`` (zeros at start 0); the quadratic view's
        context keeps them every STATE_STRIDE positions only, so the keys and values in between are
        added to the last kept ones."""
        if "kv_state" in context:
            return state_before(context["kv_state"], rows, start), state_before(context["k_state"], rows, start)
        stride = self.STATE_STRIDE
        kv_state = state_before(context["kv_kept"], rows, start // stride)
        k_state = state_before(context["k_kept"], rows, start // stride)
        (phi_k, v), live = replay_before([context["phi_k"], context["v"]], rows, start, stride)
        phi_k = phi_k * live[..., None, None]  # positions before the kept state's block add nothing
        return kv_state + torch.einsum("bshf,bshd->bhfd", phi_k, v), k_state + phi_k.sum(1)

    def _hooked_features(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Return phi(q), phi(k) ``[b, t, head, F]`` and v ``[b, t, head, d_head]``, through their hooks."""
        batch, n_pos, _ = x.shape
        q = self.hook_q(self.proj_q(x).view(batch, n_pos, self.num_heads, self.feature_dim))
        k = self.hook_k(self.proj_k(x).view(batch, n_pos, self.num_heads, self.feature_dim))
        v = self.hook_v(self.proj_v(x).view(batch, n_pos, self.num_heads, self.d_head))
        return self.hook_phi_q(self.feature_map(q)), self.hook_phi_k(self.feature_map(k)), v

    def _features(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Return phi(q), phi(k) ``[b, t, head, F]`` and v ``[b, t, head, d_head]`` (as `forward`,
        without its hooks)."""
        q = self.proj_q(x).unflatten(-1, (self.num_heads, self.feature_dim))
        k = self.proj_k(x).unflatten(-1, (self.num_heads, self.feature_dim))
        v = self.proj_v(x).unflatten(-1, (self.num_heads, self.d_head))
        return self.feature_map(q), self.feature_map(k), v

    def _recurrent_view(
        self, phi_q: Tensor, phi_k: Tensor, v: Tensor, initial: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """y from per-position states that pass through their hooks; ``[batch, pos, head, d_head]``.
        `initial`: the states (S, z) before the first position (None: zeros)."""
        kv_updates = phi_k.unsqueeze(-1) * v.unsqueeze(-2)  # [b, t, h, F, d]
        kv_initial, k_initial = (None, None) if initial is None else initial
        kv_state = propagate_additive(kv_updates, self.hook_kv_state, kv_initial)
        k_state = propagate_additive(phi_k, self.hook_k_state, k_initial)
        numerator = torch.einsum("bthf,bthfd->bthd", phi_q, kv_state)
        denominator = torch.einsum("bthf,bthf->bth", phi_q, k_state)
        return numerator / (denominator.unsqueeze(-1) + self.eps)


def based_quadratic(phi_q: Tensor, phi_k: Tensor, v: Tensor, eps: float, query_pos: Tensor | None = None) -> Tensor:
    """Quadratic view: ``causal(phi_q phi_kᵀ) v / (row sums + eps)``.

    phi_q ``[batch, q_pos, head, F]``, phi_k ``[batch, pos, head, F]``, v ``[batch, pos, head,
    d_head]``; `query_pos` ``[batch, q_pos]``: the positions of the queries among the keys
    (default: the queries are at the keys' positions, q_pos = pos). Returns ``[batch, q_pos, head, d_head]``.
    """
    keys = torch.arange(phi_k.shape[1], device=phi_k.device)
    queries = keys if query_pos is None else query_pos
    causal = (keys <= queries[..., None]).unsqueeze(-3)  # [(batch,) 1, q_pos, pos]
    scores = torch.einsum("bqhf,bkhf->bhqk", phi_q, phi_k)
    scores = scores.masked_fill(~causal, 0.0)
    numerator = torch.einsum("bhqk,bkhd->bqhd", scores, v)
    return numerator / (scores.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)


def based_chunked(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    eps: float,
    chunk_size: int,
    initial_state: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Linear view, chunked: within a chunk the quadratic form, across chunks the state
    (S, z) carried forward, so memory is O(pos · chunk) rather than O(pos²).

    Shapes as `based_quadratic` (q_pos = pos); `initial_state`: (S ``[batch, head, F, d_head]``,
    z ``[batch, head, F]``) before the first position, or None (zeros). Returns ``[batch, pos, head, d_head]``.
    """
    batch, n_pos, n_heads, n_feat = phi_q.shape
    if initial_state is None:
        kv_state = phi_q.new_zeros(batch, n_heads, n_feat, v.shape[-1])
        k_state = phi_q.new_zeros(batch, n_heads, n_feat)
    else:
        kv_state, k_state = initial_state
    outputs = []
    for start in range(0, n_pos, chunk_size):
        cq, ck, cv = (t[:, start : start + chunk_size] for t in (phi_q, phi_k, v))
        size = cq.shape[1]
        causal = torch.ones(size, size, dtype=torch.bool, device=cq.device).tril()
        scores = torch.einsum("bqhf,bkhf->bhqk", cq, ck).masked_fill(~causal, 0.0)
        numerator = torch.einsum("bhqk,bkhd->bqhd", scores, cv) + torch.einsum("bqhf,bhfd->bqhd", cq, kv_state)
        denominator = scores.sum(-1).transpose(1, 2) + torch.einsum("bqhf,bhf->bqh", cq, k_state)
        outputs.append(numerator / (denominator.unsqueeze(-1) + eps))
        kv_state = kv_state + torch.einsum("bkhf,bkhd->bhfd", ck, cv)
        k_state = k_state + ck.sum(1)
    return torch.cat(outputs, dim=1)


def propagate_additive(updates: Tensor, hook: AxisHookPoint, initial: Tensor | None = None) -> Tensor:
    """States of the additive recurrence h_t = h_{t-1} + updates_t, passed through `hook`.

    `updates` is ``[batch, pos, ...]``, `initial` ``[batch, ...]`` the state before the first
    position (None: zeros); returns h ``[batch, pos, ...]``, continued by the recurrence from
    wherever the hook edited it (see `state_patch`).
    """

    def rescan(initial: Tensor, start: int, end: int) -> Tensor:
        return initial.unsqueeze(1) + updates[:, start:end].cumsum(dim=1)

    def carry(edit: Tensor, keep: Tensor | None) -> Tensor:  # h_t = h_{t-1} (state_patch)
        if keep is None:
            return edit.cumsum(dim=1)
        return linear_scan(keep.to(edit.dtype).view(*keep.shape, *(1,) * (edit.dim() - 2)).expand_as(edit), edit)

    states = updates.cumsum(dim=1)
    if initial is not None:
        states = states + initial.unsqueeze(1) if states.requires_grad else states.add_(initial.unsqueeze(1))
    return hook_state_with_propagation(hook, states, rescan, carry, initial)


def _head_results(mixer: Based, hook) -> tuple[Tensor, Tensor]:
    """y per head, and out_proj's weight per head (`MixerSpec.head_results`)."""
    return hook("y"), mixer.out_proj.weight.unflatten(1, (mixer.num_heads, mixer.d_head))


SPEC = MixerSpec(
    name="based",
    mixer=Based,
    heads=Heads(count="num_heads", same_as_count=("num_key_value_heads",)),
    meanings={
        "q": "query projection (feature_dim)",
        "k": "key projection (feature_dim)",
        "v": "value projection",
        "phi_q": "Taylor-exp feature map of q: [1, q/d^¼, q⊗q/(√2·√d)]",
        "phi_k": "Taylor-exp feature map of k",
        "kv_state": "recurrent state Σ φ(k)ᵀv up to each position",
        "k_state": "normaliser state Σ φ(k)",
        "y": "linear-attention output per head",
    },
    # Based model: BaseConv with a short kernel, then Based linear attention, alternating
    presets={"based": (("baseconv", {"kernel_size": 3}), ("based", {}))},
    head_results=_head_results,
    output_projections=("out_proj",),
    # zoology's Based names it ``proj_o``, which its `_init_weights` (matching ``out_proj.weight``
    # and ``fc2.weight`` by name) leaves at N(0, 0.02): what ``init = "zoology"`` draws (HazyResearch/zoology
    # zoology/model.py @ 0cd64f8, zoology/mixers/based.py @ 0a9c682)
    reference_scales_output=False,
    output_head_axes="head d_head",
    tl_attention={"q": "q", "k": "k", "v": "v", "z": "y"},  # the projections, and y for its z
)
