"""BaseConv (Arora et al. 2024, "Zoology", §4 / eq. 2), as zoology's ``mixers/base_conv.py``:

    y = conv(u) ⊙ linear(u) + u

`conv` is a short causal depthwise convolution (``kernel_size`` k >= 1; the paper's default
3), or, with ``kernel_size=-1``, a long convolution over the whole sequence: an implicit
filter (Hyena's positional MLP with exponential decay, `long_conv.ImplicitFilter`, width 16)
or, with ``implicit_long_conv=False``, an explicit filter of l_max taps per channel. As in
zoology, the long convolution carries its own skip term, ``conv(u) = h * u + u``, and the
short one does not. Paper 000's BaseConv model alternates k=3 and k=-1 layers (appendix B).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import HookmechError, UsageError
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


class BaseConv(Mixer, PathRoutes, EffectiveAttentionMap):
    """``conv(u) * projection(u) + u`` (no output projection, as in zoology).

    `bias` changes nothing, exactly as in zoology: its ``BaseConv`` takes ``bias`` (paper
    000's code passes ``bias=False``) into ``**kwargs`` and ignores it, so the projection and
    the short convolution keep their biases. It is accepted so that a model-wide ``bias``
    (``--mixer-opt bias=false``, the paper's configs) reaches every layer.

    `conv_bias_init`: the short convolution's bias starts at zero (``"zeros"``) or as
    ``nn.Conv1d``'s (``"torch"``: zoology's ``ShortConvolution`` is one, left alone by its init).

    Inside hooks (input ``[batch, pos, d_model]``):
    ``hook_proj`` (linear branch) and ``hook_conv`` (convolution branch, incl. the long
    convolution's skip term): ``[batch, pos, d_model]``; long convolution only:
    ``hook_filter`` ``[lag, d_model]``, no position axis (it depends on positions, not inputs).
    """

    def __init__(
        self,
        d_model: int,
        l_max: int = 1024,
        kernel_size: int = 3,
        implicit_long_conv: bool = True,
        use_act: bool = False,
        bias: bool = True,
        conv_bias_init: str = "zeros",
    ):
        super().__init__()
        del bias  # accepted and ignored, as zoology's BaseConv does (see the class docstring)
        if kernel_size == 0 or kernel_size < -1:
            raise UsageError(f"baseconv: kernel_size must be >= 1 (short conv) or -1 (long conv), got {kernel_size}")
        if l_max < 1:
            raise UsageError(f"baseconv: l_max must be >= 1, got {l_max}")
        if conv_bias_init not in CONV_BIAS_INITS:
            raise UsageError(f"baseconv: conv_bias_init must be one of {CONV_BIAS_INITS}, got {conv_bias_init!r}")
        self.l_max, self.kernel_size, self.use_act = l_max, kernel_size, use_act
        self.long, self.implicit = kernel_size == -1, implicit_long_conv
        self.projection = nn.Linear(d_model, d_model)
        self.conv: ShortConv | ImplicitFilter
        if not self.long:
            self.conv = ShortConv(d_model, kernel_size, torch_bias_init=conv_bias_init == "torch")
        elif implicit_long_conv:
            self.conv = ImplicitFilter(d_model, l_max)
        else:
            # zoology's LongConvolution: one free tap per channel and lag
            self.filter = nn.Parameter(torch.randn(l_max, d_model))
        self.hook_proj = AxisHookPoint()
        self.hook_conv = AxisHookPoint()
        if self.long:
            self.hook_filter = AxisHookPoint("lag d_model", pos_axis=None)

    def forward(self, u: Resid) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]``."""
        u_conv = self.hook_conv(self._conv(u))
        u_proj = self.hook_proj(self.projection(u))
        return self._gate(u, u_conv, u_proj)

    def _conv(self, u: Tensor) -> Tensor:
        """Return the convolution branch ``[batch, pos, d_model]`` (long: with its skip term)."""
        if not self.long:
            return self.conv(u)
        return fft_causal_conv(u, self.hook_filter(self._filter(u.shape[1]))) + u

    def _filter(self, n_pos: int) -> Tensor:
        """Return the long filter's first `n_pos` lags ``[n_pos, d_model]`` (before its hook)."""
        if n_pos > self.l_max:
            raise UsageError(f"baseconv: sequence of {n_pos} positions exceeds l_max {self.l_max}")
        if not self.implicit:
            return self.filter[:n_pos]
        assert isinstance(self.conv, ImplicitFilter)  # for mypy: `conv` is either
        return self.conv(n_pos)

    def _gate(self, u: Tensor, u_conv: Tensor, u_proj: Tensor) -> Tensor:
        """Return ``conv(u) * projection(u) + u`` from its three parts, ``[batch, pos, d_model]``."""
        if self.use_act:
            return F.silu(u_conv) * F.silu(u_proj) + u
        return u_conv * u_proj + u

    attention_axis = "channel"

    def effective_attention(self, u: Resid) -> EffectiveAttention:
        """Return M ``[batch, d_model, query_pos, key_pos]`` (float32): the convolution gated by
        the projection, as a matrix per channel acting on the input u itself,

            M[d, t, s] = proj(u)_t[d] T[d, t, s]

        where T is the convolution's Toeplitz matrix: short, T[t, s] = w[t - s] for the kernel's
        lags; long, T[t, s] = h[t - s] + [s = t] (the long convolution's own skip). So
        ``hook_conv[b, t, d] hook_proj[b, t, d] = Σ_s M[b, d, t, s] u[b, s, d] + bias[d] hook_proj[b, t, d]``
        exactly, bias being the short convolution's (zero for the long one); the mixer's
        output adds u. With ``use_act`` the gate is silu(conv(u)), not linear in u: no M (HookmechError).
        """
        if self.use_act:
            raise HookmechError(
                "baseconv with use_act=True has no effective attention: silu(conv(u)) ⊙ silu(proj(u)) "
                "is not linear in u, so no matrix over positions reproduces it"
            )
        n_pos = u.shape[1]
        if not self.long:
            assert isinstance(self.conv, ShortConv)
            # ShortConv cross-correlates over the last kernel_size inputs: lag t - s is tap k - 1 - (t - s)
            kernel = self.conv.weight[:, 0].flip(-1).T
        else:
            kernel = self._filter(n_pos)
        operator = toeplitz(kernel.double(), n_pos)
        if self.long:
            operator = operator + torch.eye(n_pos, dtype=operator.dtype, device=operator.device)
        return (self.projection(u).double().transpose(1, 2)[..., :, None] * operator).float()

    # -- path patching (see `PathRoutes`) -------------------------------------
    def conv_hooks(self) -> dict[str, tuple[str, ...]]:
        """``{"conv": ("conv",)}`` with a short kernel (its input is the mixer's input itself);
        none for the long convolution."""
        return {} if self.long else {"conv": ("conv",)}

    def conv_path(self, receiver: str, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of ``hook_conv`` ``[run, pos, d_model]`` when the input u at the
        `senders` positions is the clean run's: the short kernel's taps (no bias) applied to the
        clean-minus-corrupt u."""
        assert isinstance(self.conv, ShortConv)  # conv_hooks declares the short convolution only
        return self.conv.taps(torch.where(senders[..., None], clean - corrupt, torch.zeros_like(corrupt)))

    # -- resuming from a position (see `Mixer.forward_from`) ---------------------------------
    def prefix_context(self, x: RunResid) -> Context:
        """Return ``{"u": x}`` ``[N, T, d_model]``: the convolution reads the mixer input itself
        (there is no projection before it); the long one also keeps its output without the skip
        term, ``"conv"`` ``[N, T, d_model]``, so that a window's is the base run's plus the
        convolution of the window's change alone (`long_conv.resumed_causal_conv`)."""
        if not self.long:
            return {"u": x}
        # contiguous: an FFT's output is a view of a buffer twice as long (`window_of` reads rows flat)
        return {"u": x, "conv": fft_causal_conv(x, self._filter(x.shape[1])).contiguous()}

    def fused_forward_with_context(self, x: RunResid, hooked: bool) -> tuple[RunResid, Context] | None:
        """Return ``(forward(x), prefix_context(x))``, the long convolution run once for both; None
        with an inside hook in use (the two then run apart, so that the hooks fire) or without the
        long convolution."""
        if not self.long or hooked:
            return None
        context = self.prefix_context(x)
        return self._gate(x, context["conv"] + x, self.projection(x)), context

    window_hooks = True

    def forward_from(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output at the window ``[B, W, d_model]`` (see `Mixer.forward_from`): the
        projection and the convolution run on the window only (the short one reads its
        kernel_size - 1 earlier inputs from the context). ``hook_conv`` and ``hook_proj`` fire on
        the window ``[B, W, d_model]``, or with `keep` at the kept positions only ``[B, 1,
        d_model]`` (the gate is position-wise); ``hook_filter`` only while a hook is attached to it."""
        u_conv = self.hook_conv(self._window_conv(x, context, rows, start, keep))
        x = kept(x, keep)
        return self._gate(x, u_conv, self.hook_proj(self.projection(x)))

    def _window_conv(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None
    ) -> Window | KeptWindow:
        """Return the convolution branch at the window ``[B, W, d_model]`` (long: with its skip),
        or at `keep` only ``[B, 1, d_model]``."""
        if not self.long:
            assert isinstance(self.conv, ShortConv)
            return kept(self.conv.forward_from(x, context["u"], rows, start), keep)
        width = x.shape[1]
        # the filter depends on positions only: the run's length gives the base run's lags exactly
        h = self._filter(context["u"].shape[1])
        if hook_in_use(self.hook_filter):
            # an edited filter changes every lag the base run used: convolve the whole spliced run
            full = splice(context["u"], rows, x, start)
            return kept(take_window(fft_causal_conv(full, self.hook_filter(h)), start, width) + x, keep)
        base_in, base_out = (window_of(context[name], rows, start, width) for name in ("u", "conv"))
        return resumed_causal_conv(x, base_in, base_out, h, keep) + kept(x, keep)


SPEC = MixerSpec(
    name="baseconv",
    mixer=BaseConv,
    heads=None,
    meanings={
        "proj": "linear branch W u",
        "conv": "convolution branch (short kernel, or implicit long filter)",
        "filter": "implicit long-convolution filter (no batch or position axis)",
    },
    # BaseConv model: a short (k=3) and an implicit long convolution, alternating
    presets={"baseconv": (("baseconv", {"kernel_size": 3}), ("baseconv", {"kernel_size": -1}))},
    output_projections=(),  # none: the gated product itself is the output, as in zoology
)
