"""Mamba-1 (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces", §3 and Figure 3), state-dict compatible with `mamba_ssm.modules.mamba_simple.Mamba`.

For an input x ``[batch, pos, d_model]`` (d_inner = expand · d_model):

    in_x, z = in_proj(x)                              the SSM branch and the gate branch
    u       = SiLU(conv1d(in_x))                      short causal depthwise convolution
    dt, B, C = x_proj(u)                              input-dependent ("selective") parameters
    Δ       = softplus(dt_proj(dt))                   per channel step size
    h_t     = exp(Δ_t A) ⊙ h_{t-1} + Δ_t u_t B_tᵀ      the selective SSM (eq. 2a, 4), A = -exp(A_log)
    y_t     = h_t C_t + D ⊙ u_t                       (eq. 2b plus the skip)
    out     = out_proj(y ⊙ SiLU(z))

Ablations of paper 000 §5.4 and paper 003 §6: `d_conv` ∈ {0,1,2,3,4} (0 removes the
convolution: u = SiLU(in_x)) and `gate=False` (no z branch: in_proj yields in_x only,
out = out_proj(y); paper 003 Figure 9).

Paths: the pure PyTorch path (reference, default) uses the chunked scan of
`selective_scan.py`. The fused path (mamba-ssm's `selective_scan_fn` and causal-conv1d's
`causal_conv1d_fn`) is taken only on CUDA, when both import, and when no hook inside the
mixer is in use, since the fused kernels never expose their intermediates.

AtP*'s exact per-position patch effects are `mamba_effects.MambaPatchEffects`; the closed forms
of path patching and the effective attention, `mamba_routes.MambaRoutes` (both inherited).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import UsageError
from ..hooks import AxisHookPoint, hook_in_use
from ..shapes import (
    Context,
    KeptWindow,
    Resid,
    RowInts,
    RunResid,
    Window,
)
from .base import Mixer, kept, one_pass, row_blocks, state_before
from .decay_exp import decay_exp_
from .mamba_effects import MambaPatchEffects
from .mamba_routes import MambaRoutes
from .mixer_spec import MixerSpec
from .selective_scan import ROW_BLOCK_BYTES, ScanObserver, linear_scan, selective_scan, strided_selective_scan
from .state_patch import hook_state_with_propagation

# the fused CUDA kernels are optional: imported where used, when installed

# The optional CUDA kernels, bound on first use by `fused_kernels_available` (tests replace them).
causal_conv1d_fn: Callable[..., Tensor] | None = None
selective_scan_fn: Callable[..., Tensor] | None = None
_fused_import_tried = False


def fused_kernels_available(x: Tensor) -> bool:
    """Return True when `x` is a CUDA float tensor (not float64) and both mamba-ssm's
    `selective_scan_fn` and causal-conv1d's `causal_conv1d_fn` import."""
    global causal_conv1d_fn, selective_scan_fn, _fused_import_tried
    if not x.is_cuda or x.dtype == torch.float64:
        return False
    if not _fused_import_tried:
        _fused_import_tried = True
        try:
            from causal_conv1d import causal_conv1d_fn as conv_fn
            from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as scan_fn
        except ImportError:
            return False
        causal_conv1d_fn, selective_scan_fn = conv_fn, scan_fn
    return causal_conv1d_fn is not None and selective_scan_fn is not None


class Mamba(Mixer, MambaPatchEffects, MambaRoutes):
    """The Mamba-1 mixer, ``[batch, pos, d_model] -> [batch, pos, d_model]``.

    Arguments and defaults are mamba-ssm's (`d_state=16, d_conv=4, expand=2,
    dt_rank="auto"` = ceil(d_model / 16), ...), plus the ablations `gate` and `d_conv=0`;
    `use_fast_path=False` forbids the fused CUDA kernels. Parameters, key for key:
    ``in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj``.

    Inside hooks (d_inner = expand · d_model):
    ``hook_in_x`` ``[batch, pos, d_inner]``: SSM branch of in_proj;
    ``hook_gate`` ``[batch, pos, d_inner]``: gate branch z before its SiLU (only with gate);
    ``hook_conv`` ``[batch, pos, d_inner]``: causal conv output before SiLU (only with d_conv > 0);
    ``hook_conv_act`` ``[batch, pos, d_inner]``: u, the SSM input;
    ``hook_delta`` ``[batch, pos, d_inner]``: Δ after softplus;
    ``hook_B``, ``hook_C`` ``[batch, pos, d_state]``;
    ``hook_ssm_state`` ``[batch, pos, d_inner, d_state]``: h_t, built only while the hook is
    in use; an edit at position p is carried through the recurrence to later positions;
    ``hook_y`` ``[batch, pos, d_inner]``: h_t C_t + D ⊙ u_t, before the gate.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        conv_bias: bool = True,
        bias: bool = False,
        gate: bool = True,
        use_fast_path: bool = True,
    ):
        super().__init__()
        _check_options(d_state, d_conv, expand, dt_rank, dt_min, dt_max, dt_init)
        self.d_model, self.d_state, self.d_conv, self.gate = d_model, d_state, d_conv, gate
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.use_fast_path = use_fast_path

        self.in_proj = nn.Linear(d_model, self.d_inner * (2 if gate else 1), bias=bias)
        if d_conv > 0:
            self.conv1d = nn.Conv1d(
                self.d_inner,
                self.d_inner,
                kernel_size=d_conv,
                groups=self.d_inner,
                padding=d_conv - 1,
                bias=conv_bias,
            )
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self._init_dt(dt_min, dt_max, dt_init, dt_scale, dt_init_floor)
        # S4D-real initialisation: A = -(1, 2, ..., d_state) in every channel.
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        # mamba-ssm's convention: flags set on the Parameter itself, read with getattr
        self.A_log._no_weight_decay = True  # type: ignore[attr-defined]  # a flag Parameter does not declare
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.D._no_weight_decay = True  # type: ignore[attr-defined]  # idem
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)

        channels = "batch pos d_inner"
        self.hook_in_x = AxisHookPoint(channels)
        if gate:
            self.hook_gate = AxisHookPoint(channels)
        if d_conv > 0:
            self.hook_conv = AxisHookPoint(channels)
        self.hook_conv_act = AxisHookPoint(channels)
        self.hook_delta = AxisHookPoint(channels)
        self.hook_B = AxisHookPoint("batch pos d_state")
        self.hook_C = AxisHookPoint("batch pos d_state")
        self.hook_ssm_state = AxisHookPoint("batch pos d_inner d_state")
        self.hook_y = AxisHookPoint(channels)

    def _init_dt(self, dt_min: float, dt_max: float, dt_init: str, dt_scale: float, floor: float) -> None:
        # mamba-ssm: keep dt_proj's output variance at init, and set its bias so that
        # softplus(bias) is log-uniform in [dt_min, dt_max].
        std = self.dt_rank**-0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        else:
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        log_dt = torch.rand(self.d_inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        dt = torch.exp(log_dt).clamp(min=floor)
        inverse_softplus_dt = dt + torch.log(-torch.expm1(-dt))
        with torch.no_grad():
            self.dt_proj.bias.copy_(inverse_softplus_dt)
        # mamba-ssm's convention: a model-wide init must not zero this bias.
        self.dt_proj.bias._no_reinit = True  # type: ignore[attr-defined]  # a flag Parameter does not declare

    # -- forward ---------------------------------------------------------------------------
    def forward(self, x: Resid) -> Resid:
        """Return the mixed sequence ``[batch, pos, d_model]``."""
        if self.use_fast_path and not self.inside_hooks_in_use() and fused_kernels_available(x):
            return _forward_fused(self, x)
        return self._hooked_forward(x)[0]

    def _hooked_forward(self, x: Resid, with_context: bool = False) -> tuple[Resid, Context | None]:
        """Return (forward(x) with every inside hook firing, None); with `with_context`, the
        context of the run (`prefix_context`) from the same pass instead of None: the scan then
        keeps its states every STATE_STRIDE positions (`strided_selective_scan`; not for a hooked
        state, whose edits it would miss)."""
        projected = self.in_proj(x)
        if self.gate:
            in_x, z = projected.chunk(2, dim=-1)
            z = self.hook_gate(z)
        else:
            in_x = projected
        in_x = self.hook_in_x(in_x)
        conv_input = in_x  # what a resumed window's convolution reads of earlier positions
        if self.d_conv > 0:
            in_x = self.hook_conv(self._causal_conv(in_x))
        u = self.hook_conv_act(F.silu(in_x))
        dt, B, C = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = self.hook_delta(F.softplus(self.dt_proj(dt)))
        B, C = self.hook_B(B), self.hook_C(C)
        A = self._A()
        context: Context | None = None
        if with_context:
            y, kept_states = strided_selective_scan(u, delta, A, B, C, self.STATE_STRIDE)
            context = {"state": kept_states, "in_x": conv_input.contiguous()}
            y = y + u * self.D
        else:
            y = self._ssm(u, delta, A, B, C)
        y = self.hook_y(y)
        if self.gate:
            y = y * F.silu(z)
        return self.out_proj(y), context

    attention_axis = "channel"

    # -- path patching (see `PathRoutes.state_path`, `PathRoutes.conv_path`) ---------------------------
    state_hooks = ("ssm_state",)
    state_readout = "y"

    # -- resuming from a position (see `Mixer.forward_from`) -------------------------------
    # A state is d_inner·d_state numbers per position (16 times the SSM branch's input): at ATR's
    # lengths every position's states of a few hundred rows are gigabytes (over the engine's
    # default `context_memory`, so every patch ran on every position), and writing them cost more
    # than the scan. The context keeps a state every STATE_STRIDE positions and in_x everywhere;
    # a resumed run replays the at most STATE_STRIDE - 1 positions in between from in_x (the
    # convolution, the projections and the scan of those positions).
    STATE_STRIDE = 16

    def prefix_context(self, x: RunResid) -> Context:
        """Return, for a run on `x` ``[N, T, d_model]``: ``"in_x"`` ``[N, T, d_inner]``, the SSM
        branch's input before the convolution, and ``"state"`` ``[N, T // STATE_STRIDE, d_inner,
        d_state]``, the SSM states after positions STATE_STRIDE - 1, 2 STATE_STRIDE - 1, ..."""
        return self._states(x)[0]

    def fused_forward_with_context(self, x: RunResid, hooked: bool) -> tuple[RunResid, Context] | None:
        """Return ``(forward(x), prefix_context(x))`` from one pass (`one_pass`; without hooks, the
        output read from the states)."""
        return one_pass(self._hooked_forward, x, hooked, self._output_and_context)

    def _output_and_context(self, x: RunResid) -> tuple[RunResid, Context]:
        context, y = self._states(x)
        return self.out_proj(y), context

    def _states(self, x: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """(context, gated y) of a run on `x`, the context as `prefix_context` returns it."""
        in_x, z = self._split(self.in_proj(x))
        u, delta, B, C = self._ssm_inputs(in_x)
        y, kept_states = strided_selective_scan(u, delta, self._A(), B, C, self.STATE_STRIDE)
        y = y + u * self.D
        if z is not None:  # the gate
            y = y * F.silu(z)
        return {"state": kept_states, "in_x": in_x.contiguous()}, y

    def state_from_context(self, name: str, context: Context, rows: RowInts, positions: RowInts) -> Tensor:
        """Return ``hook_ssm_state`` of the context's run at ``positions[i]`` of row ``rows[i]``,
        ``[B, d_inner, d_state]``: the state before the next position, replayed from the last kept
        one (`_replayed_state`; see `Mixer.state_from_context`)."""
        assert name in self.state_hooks
        before, live, kept_state = self._before(context, rows, positions + 1)
        return self._replayed_state(kept_state, self._conv_tail(before), live)

    def _before(self, context: Context, rows: RowInts, start: RowInts) -> tuple[Tensor, Tensor, Tensor]:
        """Return what the state before ``start[i]`` of row ``rows[i]`` is replayed from: in_x of
        the base run at the STATE_STRIDE - 1 positions before start and the d_conv - 1 before those
        (the convolution's reach) ``[B, STATE_STRIDE - 1 + reach, d_inner]``, zeros before position 0
        (the convolution's padding); ``live`` ``[B, STATE_STRIDE - 1]``, True at the positions from
        the start of start's block of STATE_STRIDE on; and the state kept before that block."""
        stride, reach = self.STATE_STRIDE, max(self.d_conv - 1, 0)
        positions = start[:, None] + torch.arange(1 - stride - reach, 0, device=start.device)
        in_x = context["in_x"]
        flat = rows[:, None] * in_x.shape[1] + positions.clamp(min=0)
        before = in_x.flatten(0, 1).index_select(0, flat.flatten()).view(*positions.shape, in_x.shape[-1])
        before = before.masked_fill((positions < 0)[..., None], 0)
        live = positions[:, reach:] >= (start - start % stride)[:, None]
        return before, live, state_before(context["state"], rows, start // stride)

    def _conv_tail(self, in_x: Tensor) -> Tensor:
        """The convolution of ``in_x`` ``[B, P, d_inner]`` at its last P - (d_conv - 1) positions
        (the first d_conv - 1 are the inputs those read): ``[B, P - d_conv + 1, d_inner]``."""
        if self.d_conv == 0:
            return in_x
        return self._causal_conv(in_x)[:, self.d_conv - 1 :]

    def _replayed_state(self, kept_state: Tensor, conv: Tensor, live: Tensor) -> Tensor:
        """Return the state after the positions of `conv` ``[B, P, d_inner]`` (the convolution's
        output there) from `kept_state` ``[B, d_inner, d_state]``; positions not `live` ``[B, P]``
        are no-ops (Δ = 0: decay 1, no input)."""
        # the live positions end every row's replay: those before the longest run of them are
        # no-ops in every row, and the recurrence skips them (half the replay, on average); the
        # inputs are projected at every position, since a product of fewer rows rounds otherwise
        # (DAS on the Mamba fixture moved in the 7th digit)
        needed = int(live.sum(1).max()) if live.numel() else 0
        if needed == 0:
            return kept_state.clone()
        u, delta, B, _ = self._ssm_inputs(conv, convolved=True)
        u, delta, B, live = u[:, -needed:], delta[:, -needed:], B[:, -needed:], live[:, -needed:]
        delta = delta * live[..., None]
        A = self._A()
        h = kept_state.clone()
        # a block of rows at a time, as the scan (`selective_scan.ROW_BLOCK_BYTES`): a chunk
        # replays hundreds of rows, whose decays at d_inner 1536 leave the cache at every step
        # (2.5x slower); every operation is elementwise, so the bytes are the same
        per_row = h[0].numel() * h.element_size()
        for rows in row_blocks(len(h), per_row, ROW_BLOCK_BYTES):
            block_delta = delta[rows]
            decay = decay_exp_(block_delta[..., None] * A, factors=(block_delta, A))
            drive = (block_delta * u[rows])[..., None] * B[rows, :, None, :]
            block = h[rows]
            for t in range(needed):
                block.mul_(decay[:, t]).add_(drive[:, t])
        return h

    window_hooks = True

    def forward_from(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output at the window ``[B, W, d_model]``: the window is projected and
        scanned from each row's state at start - 1 (replayed from the last kept state,
        `_replayed_state`); the convolution reads the d_conv - 1 earlier inputs from the context
        and runs on the window only. The inside hooks fire on the window (``[B, W, ...]``); an
        edit of ``hook_ssm_state`` is carried on through the window's recurrence."""
        in_x, z = self._split(self.in_proj(x))
        if z is not None:
            z = self.hook_gate(z)
        in_x = raw_in_x = self.hook_in_x(in_x)
        # rows with the same run row and start (several patches of a row; several sites' pairs,
        # joined) replay the same positions: one of each gathers, convolves, projects and replays
        # them for all (a joined chunk of Mamba-130m holds each once per site below the block:
        # 8 % of its engine over every L*.block_in, docs/performance.md)
        spread, one = _groups(rows * (context["in_x"].shape[1] + 1) + start)
        before, live, kept_state = self._before(context, rows[one], start[one])
        h0 = self._replayed_state(kept_state, self._conv_tail(before), live)[spread]
        reach = before.shape[1] - live.shape[1]  # the d_conv - 1 inputs the window's convolution reads
        in_x = self._conv_tail(torch.cat([before[spread, before.shape[1] - reach :], in_x.to(before.dtype)], dim=1))
        if self.d_conv > 0:
            in_x = self.hook_conv(in_x)
        u = self.hook_conv_act(F.silu(in_x))
        dt, B, C = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = self.hook_delta(F.softplus(self.dt_proj(dt)))
        B, C = self.hook_B(B), self.hook_C(C)
        # AtP*'s effects of a patch of this mixer's input, computed by the backward through this window
        window = None if self.patch_recorder is None else self.patch_recorder.window(rows, start, raw_in_x, z, in_x)
        y = self.hook_y(self._ssm(u, delta, self._A(), B, C, h0, window))
        if z is not None:  # the gate
            y = y * F.silu(z)
        if window is not None:
            window.watch(y)
        return self.out_proj(kept(y, keep))

    def _split(self, projected: Tensor) -> tuple[Tensor, Tensor | None]:
        """(in_x, z) of in_proj's output; z is None without the gate."""
        if self.gate:
            in_x, z = projected.chunk(2, dim=-1)
            return in_x, z
        return projected, None

    def _ssm_inputs(self, in_x: Tensor, convolved: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(u, Δ, B, C) of the SSM branch (hooks not fired: the resume path only)."""
        if self.d_conv > 0 and not convolved:
            in_x = self._causal_conv(in_x)
        u = F.silu(in_x)
        dt, B, C = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        return u, F.softplus(self.dt_proj(dt)), B, C

    def _ssm(
        self,
        u: Tensor,
        delta: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        h0: Tensor | None = None,
        observer: ScanObserver | None = None,
    ) -> Tensor:
        """y ``[batch, pos, d_inner]`` from the state `h0` before the first position (zeros when
        None); states materialised only while hook_ssm_state is used (`observer`, of the fast
        scan's backward, is then not shown them)."""
        if not hook_in_use(self.hook_ssm_state):
            return selective_scan(u, delta, A, B, C, self.D, h0=h0, observer=observer)
        decay = torch.exp(delta[..., None] * A)  # [batch, pos, d_inner, d_state]

        def drive() -> Tensor:  # the scan overwrites it: made again (the same bits) for a rescan
            made = (delta * u)[..., None] * B[:, :, None, :]
            if h0 is not None:  # the state carried in enters the first position's update
                made[:, 0].addcmul_(decay[:, 0], h0)
            return made

        def rescan(h_before: Tensor, start: int, end: int) -> Tensor:
            inputs = drive()[:, start:end]
            inputs[:, 0].addcmul_(decay[:, start], h_before)
            return linear_scan(decay[:, start:end], inputs, overwrite=True)

        def carry(edit: Tensor, keep: Tensor | None) -> Tensor:  # the homogeneous recurrence (state_patch)
            return linear_scan(decay if keep is None else decay * keep[:, :, None, None], edit, overwrite=True)

        states = linear_scan(decay, drive(), overwrite=True)
        states = hook_state_with_propagation(self.hook_ssm_state, states, rescan, carry)
        return (states @ C[..., None])[..., 0] + u * self.D

    def _causal_conv(self, x: Tensor) -> Tensor:
        """Depthwise conv1d of ``[batch, pos, d_inner]`` -> same; output t sees inputs
        t-d_conv+1 .. t (conv1d pads d_conv-1 on both sides; the last outputs are dropped)."""
        return self.conv1d(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)

    def _A(self) -> Tensor:
        """A = -exp(A_log) ``[d_inner, d_state]``, in at least float32 (as mamba-ssm)."""
        return -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))


def _forward_fused(mixer: Mamba, x: Tensor) -> Tensor:
    """The CUDA path: mamba-ssm's kernels in their [batch, channels, pos] layout."""
    assert causal_conv1d_fn is not None and selective_scan_fn is not None, "only after fused_kernels_available(x)"
    projected = mixer.in_proj(x).transpose(1, 2)
    in_x, z = projected.chunk(2, dim=1) if mixer.gate else (projected, None)
    if 2 <= mixer.d_conv <= 4:  # the widths causal-conv1d implements
        u = causal_conv1d_fn(in_x.contiguous(), mixer.conv1d.weight[:, 0, :], mixer.conv1d.bias, activation="silu")
    elif mixer.d_conv > 0:
        u = F.silu(mixer.conv1d(in_x)[..., : in_x.shape[-1]])
    else:
        u = F.silu(in_x)
    dt, B, C = mixer.x_proj(u.transpose(1, 2)).split([mixer.dt_rank, mixer.d_state, mixer.d_state], dim=-1)
    delta = (dt @ mixer.dt_proj.weight.T).transpose(1, 2)  # bias and softplus run inside the kernel
    y = selective_scan_fn(
        u.contiguous(),
        delta.contiguous(),
        mixer._A(),
        B.transpose(1, 2).contiguous(),
        C.transpose(1, 2).contiguous(),
        mixer.D.float(),
        z=None if z is None else z.contiguous(),
        delta_bias=mixer.dt_proj.bias.float(),
        delta_softplus=True,
    )
    return mixer.out_proj(y.transpose(1, 2))


def _check_options(d_state, d_conv, expand, dt_rank, dt_min, dt_max, dt_init) -> None:
    if d_state < 1:
        raise UsageError(f"mamba: d_state must be >= 1, got {d_state}")
    if d_conv not in (0, 1, 2, 3, 4):
        raise UsageError(f"mamba: d_conv must be one of 0, 1, 2, 3, 4 (0 = no convolution), got {d_conv}")
    if expand <= 0:
        raise UsageError(f"mamba: expand must be > 0, got {expand}")
    if dt_rank != "auto" and (not isinstance(dt_rank, int) or dt_rank < 1):
        raise UsageError(f"mamba: dt_rank must be 'auto' or an integer >= 1, got {dt_rank!r}")
    if not 0 < dt_min <= dt_max:
        raise UsageError(f"mamba: need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
    if dt_init not in ("random", "constant"):
        raise UsageError(f"mamba: dt_init must be 'random' or 'constant', got {dt_init!r}")


SPEC = MixerSpec(
    name="mamba",
    mixer=Mamba,
    heads=None,
    meanings={
        "in_x": "x branch of in_proj",
        "gate": "z branch of in_proj (SiLU gate)",
        "conv": "short causal convolution of x",
        "conv_act": "SiLU(conv): the SSM input u",
        "delta": "Δ = softplus(dt_proj(·)) per channel",
        "B": "input matrix B_t",
        "C": "output matrix C_t",
        "ssm_state": "h_t = exp(ΔA) h_{t-1} + Δ B u (after position t); patching propagates",
        "y": "SSM output before the gate (includes D·u)",
    },
    notes=(
        "TransformerLens's Mamba bridge: its `mixer.hook_ssm_out` is the block's `hook_mixer_out` (an alias above). "
        "Its `mixer.hook_ssm_state` shares this mixer's name, not its axes or its patch: TransformerLens's is "
        "[batch, d_inner, pos, d_state] (position axis 2), fires only on its eager-scan path, and a patch there "
        "changes that position's read-out only; hookmech's propagates through the recurrence. Its `hook_ssm_dt` "
        "(dt_proj's output, before the softplus of `delta`), `hook_in_proj`, `hook_conv` (channel-first, "
        "untruncated), `hook_x_proj` and `hook_ssm_write` (Δ·B·x) mean nothing a hookmech hook holds: no alias."
    ),
    block_norm="rmsnorm",
    block_mlp=False,
    output_projections=("out_proj",),
    reference_init="mamba",  # mamba-ssm's _init_weights, which zoology applies to Mamba blocks
    tl_mixer_out=("ssm_out",),  # its Mamba bridge's ``mixer.hook_ssm_out``
)


def _groups(labels: Tensor) -> tuple[Tensor, Tensor]:
    """Return ``(spread [B], one [G])`` of `labels` ``[B]``: ``one`` the first row of each of the G
    distinct labels, and ``spread[i]`` the index into ``one`` of row i's label."""
    distinct, spread = torch.unique(labels, return_inverse=True)
    one = torch.full((len(distinct),), len(labels), device=labels.device)
    return spread, one.scatter_reduce(0, spread, torch.arange(len(labels), device=labels.device), "amin")
