"""Causal multi-head softmax attention (Vaswani et al. 2017), as in zoology's MHA.

Options from the papers: `window` (local causal attention over the last `window` tokens;
paper 000's fixture uses window 2 in layer 0, i.e. current and previous token) and a short
causal convolution on any of q/k/v (`qkv_conv="k"`, paper 003 table 1). For pretrained GPT-NeoX
(Pythia) models: rotary position embeddings on a fraction of each head (`rotary_pct`,
`rotary_base`; hookmech/mixers/rotary.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import NoComponentError, UsageError
from ..hook_names import hook_attribute
from ..hooks import AxisHookPoint
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
from .base import Mixer, pattern_effects_by_rows, splice, take_window, window_index
from .capabilities import AttentionWeights, EffectiveAttentionMap, ExactPatchEffects, MixerMemo, PathRoutes
from .mixer_spec import Heads, MixerSpec
from .rotary import rotary_dim, rotate, rotation
from .short_conv import ShortConv

#: the inside hooks of q and k after rotary embeddings -> the one each rotates
_ROTATED = {"rot_q": "q", "rot_k": "k"}


class Attention(Mixer, ExactPatchEffects, PathRoutes, EffectiveAttentionMap, AttentionWeights):
    """softmax(q kᵀ / √d_head + causal mask) v, per head, then an output projection.

    `bias`: the q/k/v projection's bias (zoology's ``MHA(bias=...)``, which leaves the output
    projection's on; paper 000's code passes ``bias=False``); `out_bias`: the output
    projection's bias (always on in zoology). `rotary_pct` > 0: rotary position embeddings on
    that fraction of each head's channels, with base `rotary_base` (GPT-NeoX's ``rotary_pct``,
    ``rotary_emb_base``), applied to q and k after their hooks.

    Inside hooks (shapes for input ``[batch, pos, d_model]``):
    ``hook_q, hook_k, hook_v, hook_z``: ``[batch, pos, head, d_head]``;
    ``hook_rot_q, hook_rot_k`` (with rotary embeddings only): q and k rotated, the same shape
    (TransformerLens's names: its ``hook_q``/``hook_k`` are before the rotation too);
    ``hook_attn_scores, hook_pattern``: ``[batch, head, query_pos, key_pos]`` (masked
    scores are -inf), position axis = the query axis.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int = 1,
        window: int | None = None,
        qkv_conv: str = "",
        conv_size: int = 3,
        bias: bool = True,
        out_bias: bool = True,
        rotary_pct: float = 0.0,
        rotary_base: float = 10000.0,
    ):
        super().__init__()
        if n_heads < 1 or d_model % n_heads:
            raise UsageError(f"attention: d_model {d_model} is not divisible by n_heads {n_heads}")
        if window is not None and window < 1:
            raise UsageError(f"attention: window must be >= 1, got {window}")
        if any(c not in "qkv" for c in qkv_conv) or len(set(qkv_conv)) != len(qkv_conv):
            raise UsageError(f"attention: qkv_conv must be letters of 'qkv', got {qkv_conv!r}")
        if conv_size < 1:
            raise UsageError(f"attention: conv_size must be >= 1, got {conv_size}")
        if not rotary_base > 0:
            raise UsageError(f"attention: rotary_base must be > 0, got {rotary_base}")
        self.n_heads, self.d_head, self.window = n_heads, d_model // n_heads, window
        #: channels of each head that rotate (0: no rotary embeddings), and the rotation's base
        self.rotary_dim, self.rotary_base = rotary_dim(self.d_head, rotary_pct), rotary_base
        # zoology's MHA: `bias` is Wqkv's only; its out_proj always has one (`out_bias` here)
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=out_bias)
        self.convs = nn.ModuleDict({c: ShortConv(d_model, conv_size) for c in qkv_conv})
        head_axes = "batch pos head d_head"
        self.hook_q, self.hook_k, self.hook_v = (AxisHookPoint(head_axes) for _ in range(3))
        self.hook_attn_scores = AxisHookPoint("batch head query_pos key_pos", pos_axis=2)
        self.hook_pattern = AxisHookPoint("batch head query_pos key_pos", pos_axis=2)
        self.hook_z = AxisHookPoint(head_axes)
        if self.rotary_dim:
            self.hook_rot_q, self.hook_rot_k = AxisHookPoint(head_axes), AxisHookPoint(head_axes)

    def _rotated(self, q: Tensor, k: Tensor, positions: Tensor, hooked: bool = True) -> tuple[Tensor, Tensor]:
        """Return q and k ``[..., pos, head, d_head]`` rotated for their `positions` (``[pos]`` or
        ``[batch, pos]``), through ``hook_rot_q``/``hook_rot_k`` when `hooked`; themselves
        without rotary embeddings."""
        if not self.rotary_dim:
            return q, k
        turns = rotation(positions, self.rotary_dim, self.rotary_base, q)
        q, k = (rotate(t, positions, self.rotary_dim, self.rotary_base, turns) for t in (q, k))
        return (self.hook_rot_q(q), self.hook_rot_k(k)) if hooked else (q, k)

    def forward(self, x: Resid) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]``."""
        return self._mixed(self.Wqkv(x))

    def fused_forward_with_context(self, x: RunResid, hooked: bool) -> tuple[RunResid, Context] | None:
        """Return ``(forward(x), prefix_context(x))`` with the projection computed once for both
        (the base run of the engine computed it twice: a quarter of a block's products); None
        with an inside hook in use (a hook may edit q, k or v in place, views of the projection)."""
        if hooked:
            return None
        projected = self.Wqkv(x)
        return self._mixed(projected), self._context(projected)

    def _mixed(self, qkv: Tensor) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]`` of the projections `qkv` ``[batch, pos, 3 d_model]``."""
        batch, n_pos, _ = qkv.shape
        projected = dict(zip("qkv", qkv.chunk(3, dim=-1), strict=True))
        for name, conv in self.convs.items():
            projected[name] = conv(projected[name])
        q, k, v = (projected[c].view(batch, n_pos, self.n_heads, self.d_head) for c in "qkv")
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        q, k = self._rotated(q, k, torch.arange(n_pos, device=qkv.device))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.d_head)
        scores = self.hook_attn_scores(scores.masked_fill(~self._mask(n_pos, qkv.device), float("-inf")))
        pattern = self.hook_pattern(scores.softmax(dim=-1))
        z = self.hook_z(torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        return self.out_proj(z.reshape(batch, n_pos, -1))

    def effective_attention(self, x: Resid) -> EffectiveAttention:
        """Return M ``[batch, head, query_pos, key_pos]`` (float32): the attention pattern
        (`hook_pattern`, window and q/k convolutions included), which is exactly how the
        head mixes its values: ``hook_z[b, t, h] = Σ_s M[b, h, t, s] hook_v[b, s, h]``."""
        batch, n_pos, _ = x.shape
        projected = dict(zip("qk", self.Wqkv(x).chunk(3, dim=-1), strict=False))  # v is not needed
        for name in "qk":
            if name in self.convs:
                projected[name] = self.convs[name](projected[name])
        q, k = (projected[c].view(batch, n_pos, self.n_heads, self.d_head) for c in "qk")
        q, k = self._rotated(q, k, torch.arange(n_pos, device=x.device), hooked=False)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.d_head)
        return scores.masked_fill(~self._mask(n_pos, x.device), float("-inf")).softmax(dim=-1).float()

    # -- TransformerLens's weights (see `AttentionWeights`) --------------------------------
    def attention_weight(self, name: str) -> Tensor:
        """Return TransformerLens's `name` of this layer (`AttentionWeights.attention_weight`):
        W_Q, W_K, W_V are `Wqkv`'s rows per head, transposed; W_O is `out_proj`'s columns per head,
        transposed; a bias the layer lacks is zeros. A projection followed by a short convolution
        (`qkv_conv`) is refused: no matrix maps the input to its hook."""
        kind, letter = name[0], name[-1].lower()  # "W_Q" -> ("W", "q")
        d_model = self.out_proj.in_features
        if letter == "o":
            if kind == "W":
                return self.out_proj.weight.T.unflatten(0, (self.n_heads, self.d_head))
            bias = self.out_proj.bias
            return self.out_proj.weight.new_zeros(d_model) if bias is None else bias
        if letter in self.convs:
            raise NoComponentError(
                f"{name}: this attention layer convolves its {letter} after the projection (qkv_conv "
                f"{''.join(self.convs)!r}), so no W_{letter.upper()} maps its input to {hook_attribute(letter)}"
            )
        rows = slice("qkv".index(letter) * d_model, ("qkv".index(letter) + 1) * d_model)
        if kind == "W":
            return self.Wqkv.weight[rows].unflatten(0, (self.n_heads, self.d_head)).transpose(1, 2)
        bias = self.Wqkv.bias
        zeros = self.Wqkv.weight.new_zeros(self.n_heads, self.d_head)
        return zeros if bias is None else bias[rows].view(self.n_heads, self.d_head)

    # -- path patching (see `PathRoutes`) -----------------------------------
    head_outputs = ("z",)
    head_inputs = ("q", "k", "v")

    def conv_hooks(self) -> dict[str, tuple[str, ...]]:
        """``{c: (c,)}`` for each projection c of q, k, v with a short convolution (`qkv_conv`):
        ``hook_c`` holds that convolution's output."""
        return {name: (name,) for name in "qkv" if name in self.convs}

    def conv_path(self, receiver: str, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_q``, ``hook_k`` or ``hook_v`` (`receiver`) ``[run, pos, head,
        d_head]`` when that projection at the `senders` positions is the clean run's: the
        convolution's taps (no bias) applied to the clean-minus-corrupt projection."""
        index = "qkv".index(receiver)
        after, before = (self.Wqkv(x).chunk(3, dim=-1)[index] for x in (clean, corrupt))
        change = torch.where(senders[..., None], after - before, torch.zeros_like(before))
        conv = self.convs[receiver]
        assert isinstance(conv, ShortConv)  # for mypy: a ModuleDict holds Modules
        return conv.taps(change).unflatten(-1, (self.n_heads, self.d_head))

    # -- one position patched, through the softmax exactly (AtP*, see `ExactPatchEffects`)
    def patches_exactly(self, hook: str | None = None) -> bool:
        """Return True for the input and q / k / v (rotated or not) / scores without short
        convolutions (`position_patch_effects`)."""
        rotated = tuple(_ROTATED) if self.rotary_dim else ()
        return not self.convs and hook in (None, "q", "k", "v", "attn_scores", *rotated)

    def exact_patch_effects(
        self, x: RunResid, grad_out: Gradients, patched: Tensor, hook: str | None, memo: MixerMemo | None
    ) -> PositionEffects:
        """Return ``[..., N, T]`` (float64): the change Σ_t (y'_t − y_t)·grad_out_t when position s
        alone is patched, with the softmax recomputed, not linearised (Kramár et al. 2024,
        "AtP*", §3.1.1: a saturated pattern has no gradient to move along). `patched` is the new
        input (`hook` None: new q, k and v at s), or the new ``q`` / ``k`` / ``v`` (rotated or not:
        ``rot_q``, ``rot_k``) / ``attn_scores`` there. Each query t > s sees key s's score and value change
        (softmax with one column moved, in closed form); query s gets a new row. Computed in
        float64. Not with a short convolution on q/k/v (it spreads one position's change over the
        next ones) nor for the other hooks (downstream of the softmax, where the linear estimate
        is already exact inside the mixer): `patches_exactly`."""
        return pattern_effects_by_rows(
            lambda rows_x, rows_grad, rows_patched: self._row_effects(rows_x, rows_grad, rows_patched, hook),
            x,
            grad_out,
            patched,
            self.n_heads,
        )

    def _row_effects(self, x: RunResid, grad_out: Gradients, patched: Tensor, hook: str | None) -> PositionEffects:
        """`position_patch_effects` of a block of rows (`pattern_effects_by_rows`)."""
        batch, n_pos, _ = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.reshape(*t.shape[:-1], self.n_heads, self.d_head).double()

        positions = torch.arange(n_pos, device=x.device)
        q, k, v = (heads(t) for t in self.Wqkv(x).chunk(3, dim=-1))
        new = {"q": q, "k": k, "v": v}
        if hook is None:
            new = dict(zip("qkv", (heads(t) for t in self.Wqkv(patched).chunk(3, dim=-1)), strict=True))
        elif hook in ("q", "k", "v"):
            new[hook] = patched.double()
        # every position's new q / k is at that position: rotated as the run rotates it
        q, k = self._rotated(q, k, positions, hooked=False)
        new["q"], new["k"] = self._rotated(new["q"], new["k"], positions, hooked=False)
        if hook in _ROTATED:
            new[_ROTATED[hook]] = patched.double()
        grad_z = heads(grad_out @ self.out_proj.weight)  # y = z Wᵀ + b, so ∂m/∂z = ∂m/∂y · W
        allowed = self._mask(n_pos, x.device)  # [t, j]
        eye = torch.eye(n_pos, dtype=torch.bool, device=x.device)
        scale = 1 / math.sqrt(self.d_head)
        scores = (torch.einsum("bthd,bjhd->bhtj", q, k) * scale).masked_fill(~allowed, float("-inf"))
        log_total = scores.logsumexp(-1)  # [b, h, t]
        pattern = torch.exp(scores - log_total[..., None])
        seen = torch.einsum("bjhd,...bthd->...bhtj", v, grad_z)  # value j read along query t's gradient
        read = (pattern * seen).sum(-1)  # z_t · ∂m/∂z_t  [..., b, h, t]
        # Query t != s: key s's score and value change, the other keys keep theirs. In log space
        # the new normaliser is log(Σ_{j≠s} e^{S_tj} + e^{S'_ts}) = logaddexp(L_t + log(1 − P_ts), S'_ts)
        # (a saturated P_ts = 1 leaves only the new term).
        if hook == "attn_scores":  # row s's scores only: no key or value moves
            column = torch.zeros_like(read)
        else:
            new_score = torch.einsum("bthd,bshd->bhts", q, new["k"]) * scale
            new_seen = torch.einsum("bshd,...bthd->...bhts", new["v"], grad_z)
            others = log_total[..., None] + torch.log1p(-pattern.clamp(max=1.0))
            new_log_total = torch.logaddexp(others, new_score)
            kept_mass = torch.exp(log_total[..., None] - new_log_total)  # Z_t / Z'_ts
            column = (
                (read[..., None] - pattern * seen) * kept_mass
                + torch.exp(new_score - new_log_total) * new_seen
                - read[..., None]
            )
            column = column.masked_fill(~(allowed & ~eye), 0.0).sum(dim=-2)  # over queries t: [..., b, h, s]
        # Query s: a new row, from its new query against the keys (its own key new too).
        if hook == "attn_scores":
            row_scores = patched.double().masked_fill(~allowed, float("-inf"))
        else:
            row_scores = torch.einsum("bshd,bjhd->bhsj", new["q"], k) * scale
            own = (new["q"] * new["k"]).sum(-1).transpose(1, 2) * scale  # [b, h, s]
            row_scores = torch.where(eye, own[..., None], row_scores).masked_fill(~allowed, float("-inf"))
        own_seen = (new["v"] * grad_z).sum(-1).transpose(-1, -2)  # [..., b, h, s]
        row_seen = torch.where(eye, own_seen[..., None], seen)
        row = (row_scores.softmax(-1) * row_seen).sum(-1) - read
        return (column + row).sum(dim=-2)

    # -- resuming from a position (see `Mixer.forward_from`) -------------------------------
    def prefix_context(self, x: RunResid) -> Context:
        """Return what `forward_from` reads of a run on `x` ``[N, T, d_model]`` (`_context`)."""
        return self._context(self.Wqkv(x))

    def _context(self, qkv: Tensor) -> Context:
        """Return the context of a run whose projections are `qkv` ``[N, T, 3 d_model]``: with short
        convolutions ``{"qkv": qkv}`` (they re-run on the spliced buffer), else `_laid_out`'s keys
        and values."""
        return {"qkv": qkv} if self.convs else self._laid_out(*qkv.chunk(3, dim=-1)[1:])

    def _laid_out(self, k: Tensor, v: Tensor) -> Context:
        """Return a run's keys `k`, rotated for their positions, and values `v` (both ``[N, T,
        d_model]``) as ``{"k", "v"}`` ``[N, T, head, d_head]``, each contiguous. Kept as the context,
        a resumed chunk gathers its rows and writes its window in, where it rotated every row's T
        keys again at each chunk and block, gathered from the strided projections (together half
        of a one-position window's attention at Pythia-160m's shape); rotation is position-wise,
        so the keys are the same bytes."""
        n_rows, n_pos, _ = k.shape
        k, v = (t.reshape(n_rows, n_pos, self.n_heads, self.d_head) for t in (k, v))
        if self.rotary_dim:
            k = rotate(k, torch.arange(n_pos, device=k.device), self.rotary_dim, self.rotary_base)
        return {"k": k.contiguous(), "v": v.contiguous()}

    window_hooks = True

    def forward_from(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output at the window ``[B, W, d_model]`` (``[B, 1, d_model]`` at `keep`):
        only the window's tokens are projected; they attend to the earlier keys and values of
        the context's run, and only the kept queries are read out. The inside hooks fire on the
        window: q, k, v ``[B, W, head, d_head]``; scores, pattern ``[B, head, Q, T]`` and z
        ``[B, Q, head, d_head]`` for the Q = W (or 1, at `keep`) queries computed."""
        batch, width, _ = x.shape
        window = self.Wqkv(x)  # [B, W, 3 d_model]
        if self.convs:  # the convolutions read earlier positions: run them on the spliced buffer
            spliced = splice(context["qkv"], rows, window, start)
            full = dict(zip("qkv", spliced.chunk(3, dim=-1), strict=True))
            for name, conv in self.convs.items():
                full[name] = conv(full[name])
            parts = {c: take_window(full[c], start, width) for c in "qkv"}
        else:
            parts = dict(zip("qkv", window.chunk(3, dim=-1), strict=True))
        hooked = {
            c: getattr(self, hook_attribute(c))(parts[c].reshape(batch, width, self.n_heads, self.d_head))
            for c in "qkv"
        }
        hooked["q"], hooked["k"] = self._rotated(hooked["q"], hooked["k"], window_index(start, width))
        # keys and values at every position: the context run's, with the window's written in
        run = self._laid_out(full["k"], full["v"]) if self.convs else context
        k, v = (self._spliced(run[c], hooked[c], rows, start, bool(self.convs)) for c in "kv")
        n_keys = k.shape[1]
        q = hooked["q"] if keep is None else take_window(hooked["q"], keep, 1)
        queries = window_index(start, width) if keep is None else (start + keep)[:, None]  # [B, Q] positions
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.d_head)
        allowed = self._allowed(queries[:, :, None], torch.arange(n_keys, device=x.device))
        scores = self.hook_attn_scores(scores.masked_fill(~allowed[:, None], float("-inf")))
        pattern = self.hook_pattern(scores.softmax(dim=-1))
        z = self.hook_z(torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        return self.out_proj(z.reshape(batch, queries.shape[1], -1))

    def _spliced(self, run: Tensor, window: Tensor, rows: Tensor, start: Tensor, selected: bool) -> Tensor:
        """Return ``[B, T, head, d_head]``: `run` (the context's keys or values ``[N, T, head,
        d_head]`` (`_laid_out`), or, when `selected`, the chunk's own ``[B, ...]``, written into)
        at rows `rows`, with `window` ``[B, W, head, d_head]`` written at each row's window."""
        # index_select, not run[rows]: several times faster on CPU, and a new tensor to write into
        chosen = run if selected else run.index_select(0, rows)
        chosen[torch.arange(len(rows), device=rows.device)[:, None], window_index(start, window.shape[1])] = window
        return chosen

    def _allowed(self, query: Tensor, key: Tensor) -> Tensor:
        """True where a query at position `query` may attend a key at `key` (broadcast):
        causal, within the window."""
        allowed = key <= query
        if self.window is not None:
            allowed = allowed & (query - key < self.window)
        return allowed

    def _mask(self, n_pos: int, device: torch.device) -> Tensor:
        """[query_pos, key_pos] True where the query may attend: causal, within the window."""
        positions = torch.arange(n_pos, device=device)
        return self._allowed(positions[:, None], positions[None, :])


def _head_results(mixer: Attention, hook) -> tuple[Tensor, Tensor]:
    """z per head, and out_proj's weight per head (`MixerSpec.head_results`)."""
    return hook("z"), mixer.out_proj.weight.unflatten(1, (mixer.n_heads, mixer.d_head))


SPEC = MixerSpec(
    name="attention",
    mixer=Attention,
    heads=Heads(count="n_heads"),
    meanings={
        "q": "queries (after the optional q convolution; before rotary embeddings)",
        "k": "keys (after the optional k convolution; before rotary embeddings)",
        "rot_q": "queries after rotary embeddings (rotary_pct > 0)",
        "rot_k": "keys after rotary embeddings (rotary_pct > 0)",
        "v": "values (after the optional v convolution)",
        "attn_scores": "q·k/√d_head with the causal/window mask (-inf)",
        "pattern": "softmax of the scores: where each query attends",
        "z": "attention-weighted values, per head",
    },
    head_results=_head_results,
    default_pos_emb="learned",
    output_projections=("out_proj",),
    output_head_axes="head d_head",
    # its attention hooks are TransformerLens's (the rotated q and k where it has them)
    tl_attention={name: name for name in ("q", "k", "v", "attn_scores", "pattern", "z", "rot_q", "rot_k")},
    notes=(
        "With rotary position embeddings (`rotary_pct` > 0, as pretrained GPT-NeoX / Pythia models load), "
        "`L0.mixer.rot_q` and `L0.mixer.rot_k` (`blocks.0.mixer.hook_rot_q`, `hook_rot_k`; TransformerLens's "
        "`blocks.0.attn.hook_rot_q`, `hook_rot_k`) hold q and k after the rotation, of the same shape; "
        "`q` and `k` are before it, as in TransformerLens."
    ),
)
