"""H3 (Fu et al. 2023, "Hungry Hungry Hippos", §3.1 and Algorithm 1), as zoology's ``mixers/h3``:

    q, k, v = q_proj(u), k_proj(u), v_proj(u)
    k̃  = SSM_shift(k) + D_k ⊙ k        # per channel: a shift-register state, i.e. a learned
                                        # causal conv of d_state taps (remembers recent keys)
    kv = k̃ ⊗ v                         # per head, head_dim x head_dim outer product
    s  = SSM_diag(kv) + D ⊙ kv         # per head, one diagonal (S4D-Lin) SSM for its head_dim²
                                        # channels (accumulates key-value associations)
    y  = out_proj(q · s)               # contract s with the query over the key index

Both SSMs are linear and time-invariant, so each is applied as a causal convolution with its
kernel ``K_l = C Ā^l B̄`` (`long_conv.fft_causal_conv`), kernels of at most `l_max` lags.

Sizes: paper 000 (appendix B) lists ``d_state = head_dim = 1024``, which cannot hold at
d_model 64; its code (tinylang ``model/zoology.py``) builds H3 with ``d_state = l_max`` and
``head_dim = 2``, which we take: ``d_state=None`` means ``l_max``. With d_state >= L the shift
SSM is an explicit causal filter over the whole sequence ("equivalent to Hyena", says that code).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import UsageError
from ..hooks import AxisHookPoint, hook_in_use
from ..shapes import (
    Acts,
    Context,
    EffectiveAttention,
    KeptWindow,
    Resid,
    RowInts,
    RunResid,
    Window,
)
from .base import Mixer, kept, splice, take_window, window_of
from .capabilities import EffectiveAttentionMap, PathRoutes
from .long_conv import fft_causal_conv, resumed_causal_conv
from .mixer_spec import Heads, MixerSpec
from .operators import toeplitz

#: where a window sits: ``(rows, start, keep)`` of `Mixer.forward_from`
WindowAt = tuple[Tensor, Tensor, Tensor | None]


class ShiftKernel(nn.Module):
    """Convolution kernel of the shift SSM (zoology's `SSKernelShift`).

    State ``x_t = S x_{t-1} + B u_t`` (S shifts the d_state entries down by one),
    output ``y_t = C · x_t``, per channel; its kernel is ``K_l = Σ_n B_n C_{n+l}`` for
    ``l < d_state`` and 0 beyond. Parameters ``B, C [channels, d_state]``; B starts at e_0,
    which makes ``K = C`` (an explicit filter), C at nn.Conv1d's default init.
    """

    def __init__(self, channels: int, d_state: int):
        super().__init__()
        self.d_state = d_state
        self.B = nn.Parameter(F.one_hot(torch.zeros(channels, dtype=torch.long), d_state).float())
        bound = 1 / math.sqrt(d_state)
        self.C = nn.Parameter(torch.empty(channels, d_state).uniform_(-bound, bound))

    def forward(self, n_lags: int) -> Tensor:
        """Return the kernel ``[n_lags, channels]``."""
        fft_size = 2 * self.d_state  # correlation of two d_state-long signals, without wrap-around
        B_f = torch.fft.rfft(self.B, n=fft_size)
        C_f = torch.fft.rfft(self.C, n=fft_size)
        kernel = torch.fft.irfft(B_f.conj() * C_f, n=fft_size)[:, : min(self.d_state, n_lags)]
        return F.pad(kernel, (0, n_lags - kernel.shape[1])).T


class DiagonalKernel(nn.Module):
    """Convolution kernel of a diagonal complex SSM, S4D-Lin (Gu et al. 2022; zoology's `SSKernelDiag`).

    Per channel h, ``d_state/2`` complex modes ``A_n = -exp(inv_A_real_n) + i A_imag_n``
    (initialised ``-1/2 + iπn``), step ``Δ = exp(log_dt)`` (log-uniform in [dt_min, dt_max]),
    bilinear discretisation ``Ā = (1 + ΔA/2)/(1 - ΔA/2)``, ``B̄ = Δ B/(1 - ΔA/2)``; the real
    output of the conjugate-pair system is ``y_t = 2 Re(C · x_t)`` with ``x_t = Ā x_{t-1} + B̄ u_t``,
    so the kernel is ``K_l = 2 Re Σ_n C_n B̄_n Ā_n^l``. Complex parameters are stored as real
    ``[..., 2]`` tensors (``B, C [channels, d_state/2, 2]``), as zoology does.
    """

    def __init__(self, channels: int, d_state: int, dt_min: float = 1e-3, dt_max: float = 1e-1):
        super().__init__()
        n_modes = d_state // 2
        self.log_dt = nn.Parameter(torch.rand(channels) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.inv_A_real = nn.Parameter(torch.full((channels, n_modes), math.log(0.5)))
        self.A_imag = nn.Parameter(math.pi * torch.arange(n_modes, dtype=torch.float32).repeat(channels, 1))
        self.B = nn.Parameter(torch.view_as_real(torch.ones(channels, n_modes, dtype=torch.cfloat)).clone())
        self.C = nn.Parameter(torch.view_as_real(torch.randn(channels, n_modes, dtype=torch.cfloat)).clone())

    def forward(self, n_lags: int) -> Tensor:
        """Return the kernel ``[n_lags, channels]``."""
        dt = torch.exp(self.log_dt)[:, None]
        dtA = torch.complex(-torch.exp(self.inv_A_real), self.A_imag) * dt
        dA = (1 + dtA / 2) / (1 - dtA / 2)
        CdB = torch.view_as_complex(self.C) * torch.view_as_complex(self.B) * dt / (1 - dtA / 2)
        # K_l for l = a·m + b is Σ_n (C B̄ Ā^{a·m})_n (Ā^b)_n: one batched complex matmul of two
        # [channels, modes, ~√L] tables, instead of exponentiating a [channels, modes, L] tensor.
        m = math.isqrt(n_lags - 1) + 1
        steps = torch.arange(m, device=dA.device, dtype=self.log_dt.dtype)
        log_abs, angle = torch.log(dA.abs())[..., None], torch.angle(dA)[..., None]

        def power(exponents: Tensor) -> Tensor:
            # |Ā|^e e^{ieθ} in real arithmetic: complex exp/log are far slower on CPU
            magnitude, phase = torch.exp(log_abs * exponents), angle * exponents
            return torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))

        outer, inner = power(m * steps), power(steps)
        kernel = torch.einsum("hna,hnb->hab", CdB[..., None] * outer, inner).reshape(len(dA), m * m)
        return 2 * kernel[:, :n_lags].real.T


class H3(Mixer, PathRoutes, EffectiveAttentionMap):
    """H3: shift SSM on keys, diagonal SSM on key-value products, read out by queries.

    Inside hooks (input ``[batch, pos, d_model]``, ``head = d_model / head_dim``):
    ``hook_q, hook_k, hook_v`` (projections) and ``hook_shift`` (k after the shift SSM, with
    its D skip): ``[batch, pos, head, head_dim]``;
    ``hook_kv`` (shifted-key ⊗ value) and ``hook_ssm`` (diagonal SSM output with its D skip,
    before the query contraction): ``[batch, pos, head, d_k, d_v]`` (d_k = d_v = head_dim);
    filters, no position axis: ``hook_shift_filter`` ``[lag, head, head_dim]``,
    ``hook_ssm_filter`` ``[lag, head]``.
    The SSMs are used as convolutions, so no per-position state is materialised (none is hooked).

    `bias` changes nothing, exactly as in zoology: its ``H3`` takes ``bias`` (paper 000's code
    passes ``bias=False``) into ``**kwargs`` and ignores it, so q/k/v and the output projection
    keep their biases. It is accepted so that a model-wide ``bias`` reaches every layer.
    """

    def __init__(
        self, d_model: int, l_max: int = 1024, d_state: int | None = None, head_dim: int = 2, bias: bool = True
    ):
        super().__init__()
        del bias  # accepted and ignored, as zoology's H3 does (see the class docstring)
        # the diagonal SSM pairs its modes as conjugates: round l_max up to an even size
        d_state = l_max + l_max % 2 if d_state is None else d_state
        if l_max < 1:
            raise UsageError(f"h3: l_max must be >= 1, got {l_max}")
        if head_dim < 1 or d_model % head_dim:
            raise UsageError(f"h3: d_model {d_model} is not divisible by head_dim {head_dim}")
        if d_state < 2 or d_state % 2:
            raise UsageError(f"h3: d_state must be even and >= 2 (conjugate pairs of modes), got {d_state}")
        self.l_max, self.head_dim, self.n_heads = l_max, head_dim, d_model // head_dim
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.ssm_k_kernel = ShiftKernel(d_model, d_state)
        self.ssm_k_D = nn.Parameter(torch.randn(d_model))
        self.kernel = DiagonalKernel(self.n_heads, d_state)
        self.D = nn.Parameter(torch.randn(self.n_heads))
        self.out_proj = nn.Linear(d_model, d_model)  # zoology: output_linear
        head_axes = "batch pos head d_head"
        self.hook_q, self.hook_k, self.hook_v, self.hook_shift = (AxisHookPoint(head_axes) for _ in range(4))
        self.hook_kv = AxisHookPoint("batch pos head d_k d_v")
        self.hook_ssm = AxisHookPoint("batch pos head d_k d_v")
        self.hook_shift_filter = AxisHookPoint("lag head d_head", pos_axis=None)
        self.hook_ssm_filter = AxisHookPoint("lag head", pos_axis=None)

    #: `head` receivers (`PathRoutes.head_inputs`): the projections, per head
    head_inputs = ("q", "k", "v")

    def forward(self, u: Resid) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]``."""
        q = self.hook_q(self._heads(self.q_proj(u)))
        k = self.hook_k(self._heads(self.k_proj(u)))
        v = self.hook_v(self._heads(self.v_proj(u)))
        return self._read_out(q, self._ssms(k, v))

    def _heads(self, x: Tensor) -> Tensor:
        """Return `x` ``[batch, pos, d_model]`` split into heads, ``[batch, pos, head, head_dim]``."""
        return x.view(*x.shape[:2], self.n_heads, self.head_dim)

    def _ssms(self, k: Tensor, v: Tensor) -> Tensor:
        """Return the diagonal SSM's output ``s`` ``[batch, pos, head, d_k, d_v]`` from the key
        and value projections ``[batch, pos, head, head_dim]`` (shift SSM on k included)."""
        shift_filter, ssm_filter = self._filters(k.shape[1])
        k = self.hook_shift(self._shift(fft_causal_conv(k, self.hook_shift_filter(shift_filter)), k))
        kv = self.hook_kv(self._outer(k, v))
        return self.hook_ssm(self._ssm(fft_causal_conv(kv, self.hook_ssm_filter(ssm_filter)[..., None, None]), kv))

    def _filters(self, n_pos: int) -> tuple[Tensor, Tensor]:
        """Return the kernels of the shift SSM ``[lag, head, head_dim]`` and of the diagonal SSM
        ``[lag, head]`` for a run of `n_pos` positions (before their hooks)."""
        # zoology truncates both kernels to l_max lags; longer inputs are still fine
        n_lags = min(n_pos, self.l_max)
        return self.ssm_k_kernel(n_lags).view(n_lags, self.n_heads, self.head_dim), self.kernel(n_lags)

    def _shift(self, conv: Tensor, k: Tensor) -> Tensor:
        """Return k̃ = SSM_shift(k) + D_k ⊙ k ``[batch, pos, head, head_dim]`` from the shift SSM's
        convolution `conv` of the keys `k` (both that shape)."""
        return conv + k * self.ssm_k_D.view(k.shape[2:])

    def _ssm(self, conv: Tensor, kv: Tensor) -> Tensor:
        """Return s = SSM_diag(kv) + D ⊙ kv ``[batch, pos, head, d_k, d_v]`` from the diagonal SSM's
        convolution `conv` of the products `kv` (both that shape)."""
        return conv + kv * self.D[:, None, None]

    @staticmethod
    def _outer(k: Tensor, v: Tensor) -> Tensor:
        """Return kv = k̃ ⊗ v per head ``[batch, pos, head, d_k, d_v]`` of ``[batch, pos, head, head_dim]`` each."""
        return k[..., :, None] * v[..., None, :]

    def _read_out(self, q: Tensor, s: Tensor) -> Tensor:
        """Return ``out_proj(q · s)`` ``[batch, pos, d_model]`` from the query
        ``[batch, pos, head, head_dim]`` and the SSM output ``[batch, pos, head, d_k, d_v]``."""
        # zoology orders the output channels (d_v, head); kept so out_proj sees the same layout
        y = torch.einsum("bthk,bthkv->btvh", q, s)
        return self.out_proj(y.reshape(*y.shape[:2], -1))

    def effective_attention(self, u: Resid) -> EffectiveAttention:
        """Return M ``[batch, head, query_pos, key_pos]`` (float32): H3 as linear attention with
        an SSM kernel for a decay. Since kv_s = k̃_s ⊗ v_s and the diagonal SSM is the causal
        convolution by K (one kernel per head, zero beyond l_max lags) plus D, the query
        read-out q_t · s_t is, per head,

            M[h, t, s] = (q_t · k̃_s) (K_h[t - s] + D_h [s = t])      (s <= t)

        with k̃ = ``hook_shift`` (the shift SSM's keys): ``Σ_i hook_q[b, t, h, i] hook_ssm[b, t, h, i]
        = Σ_s M[b, h, t, s] hook_v[b, s, h]`` exactly (that read-out is out_proj's input, which
        has no hook of its own). Per head, not per channel: the key index is contracted by q.
        """
        q, k = self._heads(self.q_proj(u)), self._heads(self.k_proj(u))
        n_pos = u.shape[1]
        shift_filter, ssm_filter = self._filters(n_pos)
        k = self._shift(fft_causal_conv(k, shift_filter), k)  # k̃, as `_ssms`
        kernel = toeplitz(ssm_filter.double(), n_pos)  # [head, t, s]
        kernel = kernel + torch.diag_embed(self.D.double()[:, None].expand(-1, n_pos))
        return (torch.einsum("bthi,bshi->bhts", q.double(), k.double()) * kernel).float()

    # -- resuming from a position (see `Mixer.forward_from`) ---------------------------------
    # Both SSMs are causal convolutions, linear in their input: a window's convolution is the
    # base run's plus the convolution of the window's change alone (`long_conv.resumed_causal_conv`).
    def prefix_context(self, x: RunResid) -> Context:
        """Return, for a run on `x` ``[N, T, d_model]``, the key and value projections ``"k"``,
        ``"v"`` and the shift SSM's convolution of k ``"k_conv"`` (each ``[N, T, head, head_dim]``),
        and the diagonal SSM's convolution of kv ``"kv_conv"`` ``[N, T, head, d_k, d_v]`` (both
        without their D term): the base run's SSM inputs (kv is k̃ ⊗ v) and outputs."""
        return self._context(self._heads(self.k_proj(x)), self._heads(self.v_proj(x)))[0]

    def fused_forward_with_context(self, x: RunResid, hooked: bool) -> tuple[RunResid, Context] | None:
        """Return ``(forward(x), prefix_context(x))`` from one pass; None with an inside hook in use
        (the two then run apart, so that the hooks fire)."""
        if hooked:
            return None
        context, kv = self._context(self._heads(self.k_proj(x)), self._heads(self.v_proj(x)))
        return self._read_out(self._heads(self.q_proj(x)), self._ssm(context["kv_conv"], kv)), context

    def _context(self, k: Tensor, v: Tensor) -> tuple[Context, Tensor]:
        """Return `prefix_context` from the projections `k`, `v` ``[N, T, head, head_dim]``, and kv
        ``[N, T, head, d_k, d_v]`` on the way (as `_ssms` computes them, without their hooks)."""
        shift_filter, ssm_filter = self._filters(k.shape[1])
        # contiguous: an FFT's output is a view of a buffer twice as long (`window_of` reads rows flat)
        k_conv = fft_causal_conv(k, shift_filter).contiguous()
        kv = self._outer(self._shift(k_conv, k), v)
        kv_conv = fft_causal_conv(kv, ssm_filter[..., None, None]).contiguous()
        return {"k": k, "v": v, "k_conv": k_conv, "kv_conv": kv_conv}, kv

    window_hooks = True

    def forward_from(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output at the window ``[B, W, d_model]`` (see `Mixer.forward_from`): the
        projections and both SSM convolutions run on the window only. The hooks with a position
        axis fire on the window ``[B, W, ...]``, but ``hook_ssm`` with `keep`, at the kept positions
        only ``[B, 1, ...]`` (the diagonal SSM is computed there alone); the filter hooks only
        while a hook is attached to one of them (both SSMs then convolve the whole run with the
        window spliced in)."""
        q = self.hook_q(self._heads(self.q_proj(x)))
        k = self.hook_k(self._heads(self.k_proj(x)))
        v = self.hook_v(self._heads(self.v_proj(x)))
        # the kernels depend on positions only: the run's length gives the base run's lags exactly
        kernels = self._filters(context["k"].shape[1])
        if hook_in_use(self.hook_shift_filter) or hook_in_use(self.hook_ssm_filter):
            s = self._spliced_ssms(k, v, context, (rows, start, keep), kernels)
        else:
            s = self._window_ssms(k, v, context, (rows, start, keep), kernels)
        return self._read_out(kept(q, keep), s)

    def _window_ssms(self, k: Acts, v: Acts, context: Context, at: WindowAt, kernels: tuple[Tensor, Tensor]) -> Tensor:
        """Return `_ssms` at the window ``[B, W, head, d_k, d_v]`` (``[B, 1, ...]`` at keep) of the
        window's projections `k`, `v` ``[B, W, head, head_dim]``, `at` being ``(rows, start, keep)``:
        each SSM's convolution is the base run's plus that of the window's change of its input
        (`long_conv.resumed_causal_conv`: an FFT over W positions, or one sum at keep)."""
        rows, start, keep = at
        base = {name: window_of(context[name], rows, start, k.shape[1]) for name in ("k", "v", "k_conv", "kv_conv")}
        k_conv = resumed_causal_conv(k, base["k"], base["k_conv"], kernels[0])
        kv = self.hook_kv(self._outer(self.hook_shift(self._shift(k_conv, k)), v))
        base_kv = self._outer(self._shift(base["k_conv"], base["k"]), base["v"])
        kv_conv = resumed_causal_conv(kv, base_kv, base["kv_conv"], kernels[1][..., None, None], keep)
        return self.hook_ssm(self._ssm(kv_conv, kept(kv, keep)))

    def _spliced_ssms(self, k: Acts, v: Acts, context: Context, at: WindowAt, kernels: tuple[Tensor, Tensor]) -> Tensor:
        """Return `_ssms` at the window, as `_window_ssms`, with both SSMs convolving the whole
        run (the window spliced in) and their kernels through their hooks: an edited kernel
        changes every lag the base run used, and an edited shift kernel the keys k̃ before the
        window too (hence kv there), which the diagonal SSM reads."""
        rows, start, keep = at
        width = k.shape[1]
        full_k, full_v = splice(context["k"], rows, k, start), splice(context["v"], rows, v, start)
        shifted = self._shift(fft_causal_conv(full_k, self.hook_shift_filter(kernels[0])), full_k)
        kv = self.hook_kv(self._outer(self.hook_shift(take_window(shifted, start, width)), v))
        full_kv = splice(self._outer(shifted, full_v), torch.arange(len(rows), device=rows.device), kv, start)
        kv_conv = fft_causal_conv(full_kv, self.hook_ssm_filter(kernels[1])[..., None, None])
        return self.hook_ssm(kept(self._ssm(take_window(kv_conv, start, width), kv), keep))


def _head_results(mixer: H3, hook) -> tuple[Tensor, Tensor]:
    """q · ssm per head, and out_proj's weight per head, laid out (d_v, head) for out_proj
    (`MixerSpec.head_results`)."""
    read_out = torch.einsum("bthk,bthkv->bthv", hook("q"), hook("ssm"))
    return read_out, mixer.out_proj.weight.unflatten(1, (mixer.head_dim, mixer.n_heads)).transpose(1, 2)


SPEC = MixerSpec(
    name="h3",
    mixer=H3,
    heads=Heads(width="head_dim"),
    meanings={
        "q": "query projection per head",
        "k": "key projection per head",
        "v": "value projection per head",
        "shift": "shift-SSM output of k (remembers recent keys)",
        "shift_filter": "shift-SSM kernel (no batch or position axis)",
        "kv": "outer product shift(k)ᵀ v per head",
        "ssm": "diagonal-SSM output of the kv products",
        "ssm_filter": "diagonal-SSM kernel (no batch or position axis)",
    },
    head_results=_head_results,
    output_projections=("out_proj",),
    # zoology's H3 names it ``output_linear``, which its `_init_weights` (matching
    # ``out_proj.weight``, ``fc2.weight`` and ``output_linear.0.weight`` by name) leaves at
    # N(0, 0.02): what ``init = "zoology"`` draws (HazyResearch/zoology zoology/mixers/h3/h3.py
    # @ 0c59e61, zoology/model.py @ 0cd64f8)
    reference_scales_output=False,
    output_head_axes="d_head head",  # zoology orders out_proj's input (d_v, head)
    # the projections (no per-head output is hooked: out_proj's input, q·ssm, has no hook)
    tl_attention={"q": "q", "k": "k", "v": "v"},
)
