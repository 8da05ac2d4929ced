"""Hyena operator of order 2 (Poli et al. 2023, "Hyena Hierarchy", §3, eq. 5-7), as zoology's
``mixers/hyena.py`` with one head and one block (paper 000, appendix B (b)):

    x1, x2, v = split(short_conv(in_proj(u)))          # short causal conv, 3 taps
    z = x2 ⊙ (h * (x1 ⊙ v) + D ⊙ x1 ⊙ v)             # h: implicit long filter, * causal conv
    y = out_proj(z)

The filter h is `long_conv.ImplicitFilter` (positional MLP of width `filter_order` = 64,
exponential decay). ``D`` is zoology's filter bias, the one thing zoology's ``Hyena(bias=...)``
switches (its projections and short convolution always have biases); paper 000's code (tinylang
``model/zoology.py``) passes ``bias=False``, which zeroes it, so it is off by default here.
``bias=True`` or ``filter_bias=True`` (the older name, same switch) restores zoology's own default.
``conv_bias_init="torch"`` starts the short convolution's bias as ``nn.Conv1d`` does (zoology's
``short_filter`` is one; ours starts at zero by default). ``train_filter_z=True`` trains the
filter's positional input z (`long_conv.ImplicitFilter`), as paper
000's code does (zoology registers z as a parameter; tinylang's optimizer trains every parameter at
the one learning rate); off by default, z fixed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

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
from .base import Mixer, kept, splice, take_window, window_of
from .capabilities import EffectiveAttentionMap, PathRoutes
from .long_conv import ImplicitFilter, fft_causal_conv, resumed_causal_conv
from .mixer_spec import MixerSpec
from .operators import toeplitz
from .short_conv import CONV_BIAS_INITS, ShortConv


class Hyena(Mixer, PathRoutes, EffectiveAttentionMap):
    """Order-2 Hyena: two data-controlled gates around one implicit long convolution.

    Inside hooks (input ``[batch, pos, d_model]``):
    ``hook_short_conv`` ``[batch, pos, 3*d_model]``: short-conv output, channels (x1 | x2 | v);
    ``hook_x1`` (gate before the long conv), ``hook_x2`` (gate after it), ``hook_v``,
    ``hook_long_conv`` (long-conv output, before the x2 gate) and ``hook_y`` (after it, before
    out_proj): ``[batch, pos, d_model]``;
    ``hook_filter`` ``[lag, d_model]``: the long filter, no position axis.
    """

    def __init__(
        self,
        d_model: int,
        l_max: int = 1024,
        filter_order: int = 64,
        short_filter_order: int = 3,
        filter_bias: bool = False,
        bias: bool = False,
        train_filter_z: bool = False,
        conv_bias_init: str = "zeros",
    ):
        super().__init__()
        if l_max < 1:
            raise UsageError(f"hyena: l_max must be >= 1, got {l_max}")
        if short_filter_order < 1:
            raise UsageError(f"hyena: short_filter_order must be >= 1, got {short_filter_order}")
        if filter_order < 1:
            raise UsageError(f"hyena: filter_order must be >= 1, got {filter_order}")
        if conv_bias_init not in CONV_BIAS_INITS:
            raise UsageError(f"hyena: conv_bias_init must be one of {CONV_BIAS_INITS}, got {conv_bias_init!r}")
        self.d_model, self.l_max = d_model, l_max
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.short_filter = ShortConv(3 * d_model, short_filter_order, torch_bias_init=conv_bias_init == "torch")
        self.filter_fn = ImplicitFilter(d_model, l_max, order=filter_order, train_z=train_filter_z)
        # zoology's name for the filter bias is `bias`; either option turns it on
        self.D = nn.Parameter(torch.randn(d_model)) if filter_bias or bias else None
        self.out_proj = nn.Linear(d_model, d_model)
        self.hook_short_conv = AxisHookPoint("batch pos d_proj")
        self.hook_x1, self.hook_x2, self.hook_v = (AxisHookPoint() for _ in range(3))
        self.hook_filter = AxisHookPoint("lag d_model", pos_axis=None)
        self.hook_long_conv = AxisHookPoint()
        self.hook_y = AxisHookPoint()

    def forward(self, u: Resid) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]``."""
        return self.out_proj(self._gated_long_conv(self.in_proj(u)))

    def _gated_long_conv(self, projected: Tensor) -> Tensor:
        """Return ``x2 ⊙ (h * (x1 ⊙ v) + D ⊙ x1 ⊙ v)`` ``[batch, pos, d_model]`` (before out_proj)
        from the input projection ``[batch, pos, 3*d_model]``, short convolution included."""
        h = self._filter(projected.shape[1])
        v, x2 = self._gates(self.short_filter(projected))
        return self._gated_output(fft_causal_conv(v, self.hook_filter(h)), v, x2)

    def _filter(self, n_pos: int) -> Tensor:
        """Return the long filter's first `n_pos` lags ``[n_pos, d_model]`` (before its hook)."""
        if n_pos > self.l_max:
            raise UsageError(f"hyena: sequence of {n_pos} positions exceeds l_max {self.l_max}")
        return self.filter_fn(n_pos)

    def _gates(self, convolved: Tensor) -> tuple[Tensor, Tensor]:
        """Return the long convolution's input x1 ⊙ v and the gate x2, each ``[batch, pos, d_model]``,
        from the short convolution's output ``[batch, pos, 3*d_model]``, through their hooks."""
        x1, x2, v = self.hook_short_conv(convolved).split(self.d_model, dim=-1)
        x1, x2, v = self.hook_x1(x1), self.hook_x2(x2), self.hook_v(v)
        return v * x1, x2

    def _gated_output(self, conv: Tensor, v: Tensor, x2: Tensor) -> Tensor:
        """Return ``x2 ⊙ (conv + D ⊙ v)`` ``[batch, pos, d_model]`` from the long convolution
        `conv` of the gated value `v` (x1 ⊙ v) and the gate `x2`, through their hooks."""
        if self.D is not None:
            conv = conv + v * self.D
        return self.hook_y(self.hook_long_conv(conv) * x2)

    attention_axis = "channel"

    def effective_attention(self, u: Resid) -> EffectiveAttention:
        """Return M ``[batch, d_model, query_pos, key_pos]`` (float32): the gated long
        convolution as a matrix per channel, both gates folded in,

            M[d, t, s] = x2_t[d] (h[t - s, d] + D[d] [s = t]) x1_s[d]      (s <= t; D: the filter bias, if on)

        so that ``hook_y[b, t, d] = Σ_s M[b, d, t, s] hook_v[b, s, d]`` exactly (x1 = ``hook_x1``
        gates each value before the convolution, x2 = ``hook_x2`` each output after it).
        """
        n_pos = u.shape[1]
        x1, x2, _ = self.short_filter(self.in_proj(u)).double().split(self.d_model, dim=-1)
        operator = toeplitz(self.filter_fn(n_pos).double(), n_pos)  # [d, t, s]
        if self.D is not None:
            operator = operator + torch.diag_embed(self.D.double()[:, None].expand(-1, n_pos))
        return (x2.transpose(1, 2)[..., :, None] * operator * x1.transpose(1, 2)[..., None, :]).float()

    # -- path patching (see `PathRoutes`) -------------------------------------
    def conv_hooks(self) -> dict[str, tuple[str, ...]]:
        """``{"short_conv": ("short_conv",)}``: the short convolution of the input projection."""
        return {"short_conv": ("short_conv",)}

    def conv_path(self, receiver: str, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_short_conv`` ``[run, pos, 3*d_model]`` when the input
        projection at the `senders` positions is the clean run's (the taps, no bias)."""
        after, before = self.in_proj(clean), self.in_proj(corrupt)
        return self.short_filter.taps(torch.where(senders[..., None], after - before, torch.zeros_like(before)))

    # -- resuming from a position (see `Mixer.forward_from`) ---------------------------------
    def prefix_context(self, x: RunResid) -> Context:
        """Return, for a run on `x` ``[N, T, d_model]``, what a window reads of earlier positions,
        each ``[N, T, ...]``: the input projection ``"projected"`` (``3*d_model``: the short
        convolution's input) and the long convolution's input x1 ⊙ v ``"conv_in"`` and output
        ``"conv_out"`` (``d_model``, without the D term), from which a window's convolution is
        the base run's plus that of the window's change alone (`long_conv.resumed_causal_conv`)."""
        return self._context(x)[0]

    def fused_forward_with_context(self, x: RunResid, hooked: bool) -> tuple[RunResid, Context] | None:
        """Return ``(forward(x), prefix_context(x))`` from one pass; None with an inside hook in use
        (the two then run apart, so that the hooks fire)."""
        if hooked:
            return None
        context, x2 = self._context(x)
        return self.out_proj(self._gated_output(context["conv_out"], context["conv_in"], x2)), context

    def _context(self, x: RunResid) -> tuple[Context, Tensor]:
        """Return `prefix_context` of a run on `x`, and its gate x2 ``[N, T, d_model]`` (as `forward`
        computes them, without the hooks)."""
        projected = self.in_proj(x)
        x1, x2, v = self.short_filter(projected).split(self.d_model, dim=-1)
        conv_in = (v * x1).contiguous()  # a resume's row lookups (`window_of`) would copy a view whole
        # contiguous: an FFT's output is a view of a buffer twice as long (`window_of` reads rows flat)
        conv_out = fft_causal_conv(conv_in, self._filter(x.shape[1])).contiguous()
        return {"projected": projected, "conv_in": conv_in, "conv_out": conv_out}, x2

    window_hooks = True

    def forward_from(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output at the window ``[B, W, d_model]`` (see `Mixer.forward_from`): both
        projections and both convolutions run on the window only (the short one reads its earlier
        inputs from the context, the long one adds the convolution of the window's change to the
        base run's). The hooks with a position axis fire on the window ``[B, W, ...]``, but
        ``hook_long_conv`` and ``hook_y`` with `keep`, at the kept positions only ``[B, 1,
        d_model]`` (the long convolution is computed there alone); ``hook_filter`` only while a
        hook is attached to it."""
        convolved = self.short_filter.forward_from(self.in_proj(x), context["projected"], rows, start)
        v, x2 = self._gates(convolved)
        conv = self._window_long_conv(v, context, rows, start, keep)
        return self.out_proj(self._gated_output(conv, kept(v, keep), kept(x2, keep)))

    def _window_long_conv(
        self, v: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None
    ) -> Window | KeptWindow:
        """Return the long convolution (no D term) at the window ``[B, W, d_model]`` of its input
        `v` (x1 ⊙ v) there, or at `keep` only ``[B, 1, d_model]``."""
        width = v.shape[1]
        # the filter depends on positions only: the run's length gives the base run's lags exactly
        h = self._filter(context["conv_in"].shape[1])
        if hook_in_use(self.hook_filter):
            # an edited filter changes every lag the base run used: convolve the whole spliced run
            full = splice(context["conv_in"], rows, v, start)
            return kept(take_window(fft_causal_conv(full, self.hook_filter(h)), start, width), keep)
        base_in, base_out = (window_of(context[name], rows, start, width) for name in ("conv_in", "conv_out"))
        return resumed_causal_conv(v, base_in, base_out, h, keep)


SPEC = MixerSpec(
    name="hyena",
    mixer=Hyena,
    heads=None,
    meanings={
        "short_conv": "in-projection after the short (3) convolution: x1, x2, v stacked",
        "x1": "first gate",
        "x2": "second gate",
        "v": "value branch",
        "filter": "implicit long filter (no batch or position axis)",
        "long_conv": "long convolution of x2·v",
        "y": "gated output x1·long_conv",
    },
    output_projections=("out_proj",),
)
