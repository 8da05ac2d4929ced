"""Mamba-1's exact per-position patch effects for AtP* (`ExactPatchEffects`; Kramár et al. 2024,
"AtP*", §3.1.1, for the selective SSM).

A patch of one position s of the mixer's input (or of its SSM branch ``in_x``) reaches the
d_conv positions s .. s + d_conv − 1 through the causal convolution; there Δ, B, C and the state
are recomputed exactly (the selection is what makes Mamba nonlinear). After them the state's
change moves on through the base run's fixed decays: its effect on a gradient's read-outs is that
change times an adjoint state swept backwards once (`MambaPatchEffects.exact_patch_effects`), its
change of the output at one position the decays' product read out there
(`MambaPatchEffects.position_patch_outputs`). What these computations share of the base run (its
convolved input, Δ, C, decays, states, gate and gated output) is kept in the caller's
`MixerMemo`, which also gives the resume context of the same run (`patch_context`).

Where the base run is AtP*'s resumed corrupt forward, the effects of a patch of the input are
computed by that forward's backward pass instead (`MambaPatchEffects.backward_patch_effects`,
`BackwardEffects`): the scan's backward recomputes the base states and sweeps the adjoint chunk by
chunk anyway, so nothing is scanned or swept a second time.

States, decays and adjoints here are state-major, ``[..., d_state, d_inner]`` (the mixer's own are
``[..., d_inner, d_state]``): every elementwise step and outer product then runs along d_inner,
the long axis, and each read-out C·h is a row vector times a matrix; in the mixer's layout those
ran 16 elements at a time (AtP*'s effects at Mamba-130m's shape: docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..hooks import hook_in_use
from ..shapes import Context, Gradients, PositionEffects, RowInts, RunResid
from .base import row_blocks, window_index
from .capabilities import ExactPatchEffects, MixerMemo
from .decay_exp import decay_exp_
from .selective_scan import linear_scan

if TYPE_CHECKING:
    from ..hooks import AxisHookPoint

#: bytes of one block of (row, position) pairs' states in the patched steps (`_patched_reach`):
#: a block runs through the d_conv steps while its states stay in cache
PAIR_BLOCK_BYTES = 6 << 20
#: positions of the adjoint states one step of the sweep keeps at once (`_adjoint_sweep`)
SWEEP_POSITIONS = 16


class MambaPatchEffects(ExactPatchEffects):
    """`ExactPatchEffects` of the Mamba-1 mixer (`mamba.Mamba` inherits it; module docstring)."""

    #: where the resumed forwards record their windows while AtP* computes effects in its backward
    #: passes (`backward_patch_effects`, `BackwardEffects.recording`)
    patch_recorder: BackwardEffects | None = None

    if TYPE_CHECKING:  # the Mamba mixer's members these methods read (`mamba.Mamba` defines them)
        STATE_STRIDE: int  # positions between the states a resume context keeps
        gate: bool
        in_proj: nn.Linear
        out_proj: nn.Linear
        conv1d: nn.Conv1d
        d_conv: int
        d_inner: int
        d_state: int
        D: nn.Parameter
        hook_ssm_state: AxisHookPoint

        def _split(self, projected: Tensor) -> tuple[Tensor, Tensor | None]: ...

        def _ssm_inputs(self, in_x: Tensor, convolved: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...

        def _A(self) -> Tensor: ...

        def _causal_conv(self, x: Tensor) -> Tensor: ...

    def patch_reads(self) -> tuple[str, ...]:
        """Return in_proj's outputs, ``("in_x", "gate")`` (``("in_x",)`` without the gate): a
        run's in_proj is most of the projections these computations would repeat."""
        return ("in_x", "gate") if self.gate else ("in_x",)

    def _projected(self, x: RunResid, reads: dict[str, Tensor] | None, rows: slice) -> tuple[Tensor, Tensor | None]:
        """Return (in_x, z) of in_proj on the rows `rows` of an input, `x` those rows: read from
        `reads` (`MixerMemo.given` of that input) where the caller gave them, else computed."""
        if reads is None:
            return self._split(self.in_proj(x))
        return reads["in_x"][rows], reads["gate"][rows] if self.gate else None

    def patches_exactly(self, hook: str | None = None) -> bool:
        """Return True for the input and the SSM branch's in_x (`position_patch_effects`)."""
        return hook in (None, "in_x")

    def exact_patch_effects(
        self, x: RunResid, grad_out: Gradients, patched: Tensor, hook: str | None, memo: MixerMemo | None
    ) -> PositionEffects:
        """Return ``[..., N, T]`` (float64): the change Σ_t (y'_t − y_t)·grad_out_t when position s
        alone is patched (`hook` None: the input; ``"in_x"``: the SSM branch of in_proj).
        A patch at s reaches the d_conv positions s .. s + d_conv − 1 through the convolution,
        where Δ, B, C and the state are recomputed exactly (the selection is what makes Mamba
        nonlinear); after them the state's change moves on through fixed decays, so its effect is
        the change of the state times the adjoint state of the later read-outs (exact as well).
        Computed a block of rows at a time (`_row_blocks`)."""
        reads = (None, None) if memo is None else (memo.given(x), None if hook is not None else memo.given(patched))
        parts = [
            self._row_effects(x[rows], grad_out[..., rows, :, :], patched[rows], hook, memo, rows, reads)
            for rows in self._row_blocks(x)
        ]
        return torch.cat(parts, dim=-2)

    def _row_effects(
        self,
        x: RunResid,
        grad_out: Gradients,
        patched: Tensor,
        hook: str | None,
        memo: MixerMemo | None,
        block: slice,
        reads: tuple[dict[str, Tensor] | None, dict[str, Tensor] | None] = (None, None),
    ) -> PositionEffects:
        """`position_patch_effects` of the block of rows `block` (`x` and the rest: those rows;
        `reads`: what the memo was given of the base input and of `patched`, `_projected`)."""
        in_x, z = self._projected(x, reads[0], block)
        if hook is None:
            new_in_x, new_z = self._projected(patched, reads[1], block)
        else:
            new_in_x, new_z = patched, z
        effect = grad_out.new_zeros(grad_out.shape[:-1], dtype=torch.float64)
        # only the (row, position) pairs whose input the patch changes can move anything
        rows, positions = self._changed(in_x, z, new_in_x, new_z).nonzero(as_tuple=True)  # [P] each
        if len(rows) == 0:
            return effect
        earliest = int(positions.min())
        conv, _, C, decay, states, gate, gated = self._base_branch(in_x, z, memo, block, earliest)
        A_t = self._state_major_A()
        # ∂m/∂(y ⊙ SiLU(z)) [..., N, T, d_inner], read from the earliest pair on: zeros before it
        grad_gated = grad_out.new_zeros(*grad_out.shape[:-1], self.d_inner)
        grad_gated[..., earliest:, :] = grad_out[..., earliest:, :] @ self.out_proj.weight
        n_pos, reach = x.shape[1], max(self.d_conv, 1)
        change = (new_in_x - in_x)[rows, positions]  # [P, d_inner]
        moved = grad_out.new_zeros(*grad_out.shape[:-3], len(rows), dtype=torch.float64)  # per pair
        steps, moved_state = self._patched_reach(rows, positions, change, (conv, new_in_x, new_z, gate), A_t, states)
        for j, at, gated_j in steps:
            inside = (positions + j < n_pos).double()
            moved += (grad_gated[..., rows, at, :] * (gated_j - gated[rows, at])).sum(-1).double() * inside
        # After r = s + reach - 1 the state's change decays through the base run's fixed decays:
        # Σ_{t > r} ĝ_t · C_t (Π decay) Δh_r = Δh_r · μ_r with the adjoint state
        # μ_{r-1} = decay_r ⊙ (μ_r + C_r ⊗ ĝ_r), μ_{T-1} = 0, swept backwards once (ĝ: ∂m/∂y).
        last = positions + reach - 1  # where `moved_state`, Δh, is
        read = grad_gated * gate  # ĝ: [..., N, T, d_inner]
        # the sweep stops at the earliest pair's: a row block corrupted late needs its last positions only
        for lo, adjoints in self._adjoint_sweep(read, C, decay, int(last.min())):
            here = ((last >= lo) & (last < lo + adjoints.shape[-3])).nonzero(as_tuple=True)[0]
            if len(here):
                moved[..., here] += torch.einsum(
                    "pij,...pij->...p", moved_state[here], adjoints[..., rows[here], last[here] - lo, :, :]
                ).double()
        effect[..., rows, positions] = moved
        return effect

    def _adjoint_sweep(self, read: Tensor, C: Tensor, decay: Tensor, first: int) -> Iterator[tuple[int, Tensor]]:
        """Yield ``(lo, μ)``, μ ``[..., N, K, d_state, d_inner]`` the adjoint states μ_lo .. μ_{lo+K-1}
        (μ_{r-1} = decay_r ⊙ (μ_r + C_r ⊗ ĝ_r) from μ_{T-1} = 0, ĝ = `read` ``[..., N, T, d_inner]``),
        a segment of at most SWEEP_POSITIONS positions at a time from the last down to `first`.
        One segment's buffer is what the sweep holds; each position costs one multiply-add and one
        multiply in place, and the read-outs of a segment's pairs take one contraction."""
        n_pos = read.shape[-2]
        carry = read.new_zeros(*read.shape[:-2], *decay.shape[-2:])  # μ_hi-1 entering the segment
        for hi in range(n_pos, first, -SWEEP_POSITIONS):
            lo = max(first, hi - SWEEP_POSITIONS)
            adjoints = read.new_empty(*read.shape[:-2], hi - lo, *decay.shape[-2:])
            adjoints[..., -1, :, :] = carry
            for r in range(hi - 1, lo, -1):
                torch.addcmul(
                    adjoints[..., r - lo, :, :],
                    C[:, r, :, None],
                    read[..., r, None, :],
                    out=adjoints[..., r - lo - 1, :, :],
                ).mul_(decay[:, r])
            if lo > first:
                carry = torch.addcmul(adjoints[..., 0, :, :], C[:, lo, :, None], read[..., lo, None, :]).mul_(
                    decay[:, lo]
                )
            yield lo, adjoints

    def position_patch_outputs(
        self, x: RunResid, patched: RunResid, at: RowInts, memo: MixerMemo | None = None
    ) -> RunResid | None:
        """Return ``[N, T, d_model]``: the change of the output at ``at[n]`` when position s alone
        (of row n) takes the input ``patched[n, s]`` (`ExactPatchEffects.position_patch_outputs`). Within the
        convolution's reach of s, Δ, B, C and the state are recomputed (as `position_patch_effects`);
        beyond it the state's change decays through the base run's decays to ``at``: Π_r exp(Δ_r A)
        = exp(A · Σ_r Δ_r), then is read out by C and gated there. Computed a block of rows at a
        time (`_row_blocks`)."""
        reads = (None, None) if memo is None else (memo.given(x), memo.given(patched))
        parts = [self._row_outputs(x[rows], patched[rows], at[rows], memo, rows, reads) for rows in self._row_blocks(x)]
        return torch.cat(parts)

    def _row_outputs(
        self,
        x: RunResid,
        patched: RunResid,
        at: RowInts,
        memo: MixerMemo | None,
        block: slice,
        reads: tuple[dict[str, Tensor] | None, dict[str, Tensor] | None] = (None, None),
    ) -> RunResid:
        """`position_patch_outputs` of the block of rows `block` (`x` and the rest: those rows;
        `reads` as `_row_effects`')."""
        in_x, z = self._projected(x, reads[0], block)
        new_in_x, new_z = self._projected(patched, reads[1], block)
        n_pos = x.shape[1]
        out = x.new_zeros(x.shape)
        changed = self._changed(in_x, z, new_in_x, new_z)
        changed &= torch.arange(n_pos, device=x.device)[None, :] <= at[:, None]
        rows, positions = changed.nonzero(as_tuple=True)  # [P] each
        if len(rows) == 0:
            return out
        conv, delta, C, _, states, gate, gated = self._base_branch(in_x, z, memo, block, int(positions.min()))
        A_t = self._state_major_A()
        query, reach = at[rows], max(self.d_conv, 1)
        change = (new_in_x - in_x)[rows, positions]  # [P, d_inner]
        moved = change.new_zeros(len(rows), change.shape[-1])  # Δ(gated y) at the query, per pair
        steps, moved_state = self._patched_reach(rows, positions, change, (conv, new_in_x, new_z, gate), A_t, states)
        for j, at_j, gated_j in steps:
            hit = positions + j == query
            moved[hit] = (gated_j - gated[rows, at_j])[hit]
        last = positions + reach - 1
        far = (last < query).nonzero(as_tuple=True)[0]
        if len(far):  # the state's change after the reach, carried by fixed decays to the query
            summed = delta.double().cumsum(1)
            span = (summed[rows[far], query[far]] - summed[rows[far], last[far]]).to(delta.dtype)  # [F, d_inner]
            carried = (span[:, None, :] * A_t).exp_().mul_(moved_state[far])
            read = (C[rows[far], query[far]][:, None, :].to(carried.dtype) @ carried)[:, 0]
            moved[far] = (read * gate[rows[far], query[far]]).to(moved.dtype)
        out[rows, positions] = moved @ self.out_proj.weight.T  # the output projection's bias cancels
        return out

    def _row_blocks(self, x: RunResid) -> list[slice]:
        """Return the blocks of rows of `x` ``[N, T, d_model]`` the patch computations take at once
        (`row_blocks`): each step touches several ``[rows, T, d_inner, d_state]`` tensors."""
        return row_blocks(len(x), x.shape[1] * self.d_inner * self.d_state * x.element_size())

    def _changed(self, in_x: Tensor, z: Tensor | None, new_in_x: Tensor, new_z: Tensor | None) -> Tensor:
        """Return ``[N, T]`` bool: where a patch changes the SSM branch's input or the gate's."""
        changed = (new_in_x != in_x).any(-1)
        if z is not None and new_z is not None:
            changed |= (new_z != z).any(-1)
        return changed

    def _base_branch(
        self, in_x: Tensor, z: Tensor | None, memo: MixerMemo | None, rows: slice, earliest: int | None = None
    ) -> tuple[Tensor, ...]:
        """Return the base run's (convolved in_x, Δ, C, decay ``[N, T, d_state, d_inner]``, states
        (the same shape), gate, gated y) from in_proj's split output of its rows `rows`, for the
        patch computations of AtP*; kept in `memo` (the caller's, for calls on the same input) for
        the next such call. Where the memo knows a run the base run agrees with up to some
        position (`MixerMemo.agree`), the scan starts from that run's state there: before `start`
        (`_agreed`) the decays are not set and gated y is 0, nor are the states but the kept ones
        (every STATE_STRIDE) and the one at start - 1. `earliest`, the first position the caller's
        pairs patch, must not precede start (else all is computed for that call); None: the
        caller reads kept states only."""
        if memo is None:
            return self._compute_base_branch(in_x, z)
        agreed = self._agreed(memo, rows)
        if earliest is not None and agreed is not None and earliest < agreed[0]:
            return self._compute_base_branch(in_x, z)
        return memo.of_rows(rows, lambda: self._compute_base_branch(in_x, z, agreed))

    def _agreed(self, memo: MixerMemo, rows: slice) -> tuple[int, Tensor] | None:
        """Return ``(start, kept)`` where the memo's agreement (`MixerMemo.agree`) lets the scan of
        the rows `rows` start after position 0: `start` the last multiple of STATE_STRIDE at or
        before their first disagreement, `kept` ``[n, start // STATE_STRIDE, d_state, d_inner]``
        the agreeing run's states before it (state-major); None where it does not."""
        if memo.agreement is None:
            return None
        context, before = memo.agreement
        stride = self.STATE_STRIDE
        start = min(int(before[rows].min()) // stride, context["state"].shape[1]) * stride
        if start == 0:
            return None
        return start, context["state"][rows, : start // stride].transpose(-1, -2)

    def _state_major_A(self) -> Tensor:
        """Return A transposed, ``[d_state, d_inner]`` (contiguous): the layout of every state here."""
        return self._A().t().contiguous()

    def _compute_base_branch(
        self, in_x: Tensor, z: Tensor | None, agreed: tuple[int, Tensor] | None = None
    ) -> tuple[Tensor, ...]:
        """Return `_base_branch`'s tuple for in_proj's split output (in_x, z) of some rows: from
        position 0, or with `agreed` (`_agreed`'s ``(start, kept)``) from the kept state at start - 1
        on, the positions before `start` left unset as `_base_branch` says (the same operations on
        the positions computed, so the same bytes on the CPU)."""
        conv = self._causal_conv(in_x) if self.d_conv > 0 else in_x
        u, delta, B, C = self._ssm_inputs(conv, convolved=True)
        A_t = self._state_major_A()
        gate = torch.ones_like(u) if z is None else F.silu(z)
        if agreed is None:
            decay = decay_exp_(delta[..., None, :] * A_t, factors=(delta, A_t))
            states = linear_scan(decay, B[..., None] * (delta * u)[..., None, :], overwrite=True)
            gated = ((C[..., None, :] @ states)[..., 0, :] + u * self.D) * gate
            return conv, delta, C, decay, states, gate, gated
        # the same operations from `start` on, from the agreeing run's state at start - 1
        start, kept = agreed
        stride, later = self.STATE_STRIDE, slice(start, None)
        decay = u.new_empty(*u.shape[:2], *A_t.shape)
        states = torch.empty_like(decay)
        states[:, stride - 1 : start : stride] = kept
        decay_exp_(torch.mul(delta[:, later, None, :], A_t, out=decay[:, later]), factors=(delta[:, later], A_t))
        torch.mul(B[:, later, :, None], (delta * u)[:, later, None, :], out=states[:, later])
        # in place on the states (AtP*'s effects run without autograd; position start - 1 is the kept state)
        linear_scan(decay[:, start - 1 :], states[:, start - 1 :], overwrite=True)
        gated = torch.zeros_like(u)
        for row in range(len(u)):  # a row's states from start on are contiguous: read out in place
            read = (C[row, later, None, :] @ states[row, later])[..., 0, :]
            gated[row, later] = (read + u[row, later] * self.D) * gate[row, later]
        return conv, delta, C, decay, states, gate, gated

    def _patched_reach(
        self,
        rows: Tensor,
        positions: Tensor,
        change: Tensor,
        run: tuple[Tensor, Tensor, Tensor | None, Tensor],
        A_t: Tensor,
        states: Tensor,
    ) -> tuple[list[tuple[int, Tensor, Tensor]], Tensor]:
        """Return ``([(j, at, y'·gate') for j = 0 .. reach − 1], Δh)``: with the SSM branch's input
        at ``positions[i]`` of row ``rows[i]`` moved by `change` ``[P, d_inner]``, the gated output
        ``[P, d_inner]`` at ``at = positions + j`` (clamped to the last position: callers drop
        those past it), and Δh ``[P, d_state, d_inner]`` the change of the state after the reach's
        last position (clamped as ``at``), from the base run's `states` ``[N, T, d_state, d_inner]``
        and A transposed, `A_t` ``[d_state, d_inner]``.
        `run` holds the base run's (convolved in_x, patched in_x, patched z or None, gate). The
        projections of each step take every pair at once; the recurrence then runs a block of
        pairs at a time from the state before s through all the steps (`PAIR_BLOCK_BYTES`: the
        block's states, read, updated and compared with the base run's, stay in cache)."""
        n_pos = run[0].shape[1]
        inputs = _reach_inputs(self, rows, positions, change, run)
        gated = [change.new_empty(change.shape) for _ in inputs]
        moved = states.new_empty(len(rows), *states.shape[2:])
        last = (positions + len(inputs) - 1).clamp(max=n_pos - 1)
        block = max(1, PAIR_BLOCK_BYTES // (states[0, 0].numel() * states.element_size()))
        flat_states = states.flatten(0, 1)  # read in place, a run of consecutive positions at a time
        for first_pair in range(0, len(rows), block):
            pairs = slice(first_pair, first_pair + block)
            for j, (_, u_j, delta_j, B_j, C_j, gate_j) in enumerate(inputs):
                # h ← exp(Δ_j A) ⊙ h + Δ_j u_j B_j, in place on one [block, d_state, d_inner] temporary
                delta_p = delta_j[pairs]
                decay = decay_exp_(delta_p[:, None, :] * A_t, factors=(delta_p, A_t))
                if j == 0:  # times h_{s-1}, the base run's (zeros at s = 0)
                    state = _times_state_before(decay, flat_states, rows[pairs], positions[pairs], n_pos)
                else:
                    state = decay.mul_(state)
                state.addcmul_(B_j[pairs, :, None], (delta_p * u_j[pairs])[:, None, :])
                y_j = (C_j[pairs, None, :].to(state.dtype) @ state)[:, 0] + u_j[pairs] * self.D
                gated[j][pairs] = y_j * gate_j[pairs]
            for i, k, first in _consecutive_runs(rows[pairs] * n_pos + last[pairs]):
                torch.sub(state[i:k], flat_states[first : first + k - i], out=moved[first_pair + i : first_pair + k])
        return [(j, step[0], gated[j]) for j, step in enumerate(inputs)], moved

    def backward_patch_effects(self, patched: RunResid, memo: MixerMemo, first_row: int) -> BackwardEffects:
        """Return the recorder of `exact_patch_effects` of a patch of the input to `patched`
        ``[N, T, d_model]`` (rows `first_row` .. of the base run's resumed forwards; `memo` that
        run's, `MixerMemo.given` and `MixerMemo.agree`) computed by their backward passes
        (`BackwardEffects`)."""
        with torch.no_grad():
            new_in_x, new_z = self._projected(patched, memo.given(patched), slice(None))
        first = None if memo.agreement is None else memo.agreement[1]
        return BackwardEffects(self, new_in_x, new_z, first, first_row)

    def patch_context(self, x: RunResid, memo: MixerMemo) -> Context:
        """Return `prefix_context(x)` from the base branch the patch computations keep in `memo`
        (`_base_branch`, computed here where it is not yet): their states, a block of rows at a time
        (each projected as `_row_effects` projects it, so both read the same numbers)."""
        states, inputs = [], []
        stride = self.STATE_STRIDE
        reads = memo.given(x)
        for rows in self._row_blocks(x):
            in_x, z = self._projected(x[rows], reads, rows)
            # the base branch's states are state-major; a context's are the mixer's [d_inner, d_state]
            states.append(self._base_branch(in_x, z, memo, rows)[4][:, stride - 1 :: stride].transpose(-1, -2))
            inputs.append(in_x)
        return {"state": torch.cat(states).contiguous(), "in_x": torch.cat(inputs)}


def _reach_inputs(
    mixer: MambaPatchEffects,
    rows: Tensor,
    positions: Tensor,
    change: Tensor,
    run: tuple[Tensor, Tensor, Tensor | None, Tensor],
) -> list[tuple[Tensor, ...]]:
    """Return, per step j of the convolution's reach, ``(at, u_j, Δ_j, B_j, C_j, gate_j)``: the
    positions ``at = positions + j`` (clamped to the last) and the SSM branch's inputs and gate
    ``[P, ...]`` there when in_x at ``positions[i]`` of row ``rows[i]`` moves by `change`
    ``[P, d_inner]`` (`run` as `_patched_reach`'s)."""
    conv, new_in_x, new_z, gate = run
    n_pos = conv.shape[1]
    inputs: list[tuple[Tensor, ...]] = []
    for j in range(max(mixer.d_conv, 1)):
        at = (positions + j).clamp(max=n_pos - 1)
        if mixer.d_conv > 0:  # in_x at s enters the output at s + j with the kernel's tap d_conv - 1 - j
            conv_j = conv[rows, at] + mixer.conv1d.weight[:, 0, mixer.d_conv - 1 - j] * change
        else:
            conv_j = new_in_x[rows, positions]
        gate_j = F.silu(new_z[rows, positions]) if j == 0 and new_z is not None else gate[rows, at]
        inputs.append((at, *mixer._ssm_inputs(conv_j, convolved=True), gate_j))
    return inputs


def _times_state_before(x: Tensor, flat_states: Tensor, rows: Tensor, positions: Tensor, n_pos: int) -> Tensor:
    """Return `x` ``[P, ...]`` multiplied in place by the base run's state before ``positions[i]``
    of row ``rows[i]`` (zeros at position 0), from the row-flattened states ``[N·T, ...]`` of
    `n_pos` positions a row: read as views, a run of consecutive positions at a time (AtP*'s pairs
    are whole stretches of a row), not copied out first as `base.state_before` does."""
    for i, k, first in _consecutive_runs(rows * n_pos + (positions - 1).clamp(min=0)):
        x[i:k].mul_(flat_states[first : first + k - i])
    at_start = positions == 0
    if bool(at_start.any()):
        x[at_start] = 0
    return x


def _consecutive_runs(index: Tensor) -> list[tuple[int, int, int]]:
    """Return ``(i, k, index[i])`` for each maximal stretch ``index[i:k]`` of consecutive integers."""
    if len(index) == 0:
        return []
    bounds = [0, *((index.diff() != 1).nonzero()[:, 0] + 1).tolist(), len(index)]
    firsts = index[bounds[:-1]].tolist()
    return list(zip(bounds[:-1], bounds[1:], firsts, strict=True))


class BackwardEffects:
    """`MambaPatchEffects.exact_patch_effects` of a patch of the mixer's input (hook None) on the
    base run's resumed windows (AtP*'s corrupt forward), computed by those windows' backward passes.

    The effects need the base run's states before and after each pair's reach and the adjoint
    states after it, which the scan's backward recomputes a chunk at a time anyway (its adjoint
    g_t gives μ_t = exp(Δ_{t+1} A) ⊙ g_{t+1}); computed after the backward, they cost a second
    scan of the base run and a sweep of the adjoints over ``[N, T, d_state, d_inner]`` tensors.
    While `recording`, each resumed forward of the mixer makes a `_WindowEffects`, which the scan
    shows each chunk (`ScanObserver`) and which writes its pairs' effects into `effect`."""

    def __init__(
        self, mixer: MambaPatchEffects, new_in_x: Tensor, new_z: Tensor | None, first: Tensor | None, first_row: int
    ):
        self.mixer, self.first_row = mixer, first_row
        #: in_proj's outputs on the patched input ``[N, T, d_inner]``
        self.new_in_x, self.new_z = new_in_x, new_z
        #: each row's first position where the base run may differ from the run it agrees with (None: 0)
        self.first: Tensor | None = first
        self.effect = new_in_x.new_zeros(new_in_x.shape[:2], dtype=torch.float64)
        self.windows: list[_WindowEffects] = []
        self.failed = False

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Within the `with` block the mixer's resumed forwards record their windows here."""
        self.mixer.patch_recorder = self
        try:
            yield
        finally:
            self.mixer.patch_recorder = None

    def effects(self) -> PositionEffects | None:
        """Return ``[N, T]`` float64, `exact_patch_effects` along the gradient of the backward passes,
        or None unless every window's backward ran through its scan (then compute them after it)."""
        if self.failed or not self.windows or not all(window.done for window in self.windows):
            return None
        return self.effect

    def window(
        self, rows: RowInts, start: RowInts, in_x: Tensor, z: Tensor | None, conv: Tensor
    ) -> _WindowEffects | None:
        """Return the `ScanObserver` of one resumed window (`Mamba.forward_from`: rows ``rows[i]`` of
        the base run from ``start[i]``; its in_x, z and convolved in_x ``[B, W, d_inner]``), or
        None where its scan shows none (a hooked state: the effects are then computed after)."""
        if hook_in_use(self.mixer.hook_ssm_state):
            self.failed = True
            return None
        with torch.no_grad():
            window = _WindowEffects(self, rows - self.first_row, start, in_x.detach(), z, conv.detach())
        self.windows.append(window)
        return window


class _WindowEffects:
    """The effects of `BackwardEffects`' patch on one resumed window, computed chunk by chunk by
    the window's backward pass (`ScanObserver`, last chunk first). Each (row, position) pair s
    whose input the patch changes runs its d_conv steps from the state before s, as
    `MambaPatchEffects._patched_reach` does; its state after the reach is read against the base
    state and μ there. Per chunk, the states from the one before it to the reach − 1 positions
    after it (kept from the chunk after, `ahead`) are laid out state-major in one buffer, and the
    pairs, ordered by position then row, read them as views where they cover whole positions."""

    def __init__(
        self, recorder: BackwardEffects, rows: Tensor, start: Tensor, in_x: Tensor, z: Tensor | None, conv: Tensor
    ):
        mixer = recorder.mixer
        # not the recorder itself: a cycle with it would keep every window's tensors to the next collection
        self.effect, self.mixer, self.rows, self.start = recorder.effect, mixer, rows, start
        self.width, self.reach = in_x.shape[1], max(mixer.d_conv, 1)
        index = window_index(start, self.width)  # [B, W] positions in the run
        new_in_x = recorder.new_in_x[rows[:, None], index]
        new_z = None if recorder.new_z is None else recorder.new_z[rows[:, None], index]
        z = None if z is None else z.detach()
        changed = mixer._changed(in_x, z, new_in_x, new_z)
        if recorder.first is not None:  # before it the base run is the agreeing run's: nothing changes
            changed &= index >= recorder.first[rows, None]
        self.s, self.b = changed.t().nonzero(as_tuple=True)  # [P] each, by position then row
        gate = torch.ones_like(in_x) if z is None else F.silu(z)
        change = (new_in_x - in_x)[self.b, self.s]
        self.inputs = _reach_inputs(mixer, self.b, self.s, change, (conv, new_in_x, new_z, gate))
        self.A_t = mixer._state_major_A()
        self.gated: Tensor | None = None
        self.grad_gated: Tensor | None = None
        self.ahead: tuple[Tensor, Tensor] | None = None  # the first reach − 1 states and μ of the chunk after
        self.done = False

    def watch(self, gated: Tensor) -> None:
        """Keep the window's gated output ``[B, W, d_inner]`` and, from the backward, its gradient."""
        self.gated = gated.detach()
        if gated.requires_grad:
            gated.register_hook(self._keep_gradient)

    def _keep_gradient(self, gradient: Tensor) -> None:
        self.grad_gated = gradient

    @torch.no_grad()
    def __call__(
        self, lo: int, h0: Tensor, decay: Tensor, states: Tensor, adjoints: Tensor, after: Tensor | None
    ) -> None:
        """Write the effects of the pairs at the chunk's positions lo .. lo + K − 1 (`ScanObserver`)."""
        size, keep = len(states), self.reach - 1
        extra = 0 if self.ahead is None else len(self.ahead[0])
        # positions lo - 1 .. lo + K - 1 + extra, state-major (module docstring)
        n_rows, d_inner, d_state = states.shape[1:]
        held = states.new_empty(1 + size + extra, n_rows, d_state, d_inner)
        held[0] = h0.transpose(-1, -2)
        held[1 : 1 + size] = states.transpose(-1, -2)
        # μ_t = exp(Δ_{t+1} A) ⊙ g_{t+1}, what the read-outs after t take of h_t: positions lo .. lo + K - 1 + extra
        mu = torch.empty_like(held[1:])
        torch.mul(decay[1:], adjoints[1:], out=mu[: size - 1].transpose(-1, -2))
        if after is None:
            mu[size - 1].zero_()
        else:
            mu[size - 1] = after.transpose(-1, -2)
        if self.ahead is not None:
            held[1 + size :], mu[size:] = self.ahead
        first, last = (int(i) for i in torch.searchsorted(self.s, torch.tensor([lo, lo + size])))
        if last > first:
            self._pairs(slice(first, last), lo, held, mu)
        self.ahead = (held[1 : 1 + keep].clone(), mu[:keep].clone())
        self.done = lo == 0

    def _pairs(self, here: slice, lo: int, held: Tensor, mu: Tensor) -> None:
        """Write the effects of the pairs `here` (a stretch of the window's pairs), whose positions
        lie in the chunk from `lo` (`held`, the states from lo − 1 on, and μ from lo on:
        ``[positions, B, d_state, d_inner]``)."""
        mixer, width = self.mixer, held.shape[1]
        b, s = self.b[here], self.s[here]
        assert self.gated is not None and self.grad_gated is not None  # `watch`, then the backward
        state = _rows_at(held.flatten(0, 1), (s - lo) * width + b)  # the base state before s
        total = torch.zeros(len(b), dtype=torch.float64, device=held.device)
        for j, step in enumerate(self.inputs):
            at, u_j, delta_j, B_j, C_j, gate_j = (value[here] for value in step)
            # h ← exp(Δ_j A) ⊙ h + Δ_j u_j B_j, on the fresh [P, d_state, d_inner] decay
            state = decay_exp_(delta_j[:, None, :] * self.A_t, factors=(delta_j, self.A_t)).mul_(state)
            state.addcmul_(B_j[:, :, None], (delta_j * u_j)[:, None, :])
            y_j = (C_j[:, None, :].to(state.dtype) @ state)[:, 0] + u_j * mixer.D
            moved = (self.grad_gated[b, at] * (y_j * gate_j - self.gated[b, at])).sum(-1)
            total += moved.double() * (s + j < self.width)
        # the state's change after the reach, read by everything after it through μ there
        reached = s + self.reach - 1
        inside = (reached < self.width).nonzero(as_tuple=True)[0]
        if len(inside):
            offset = (reached[inside] - lo) * width + b[inside]
            changed = state[inside].sub_(_rows_at(held[1:].flatten(0, 1), offset))
            total[inside] += changed.mul_(_rows_at(mu.flatten(0, 1), offset)).sum((-1, -2)).double()
        self.effect[self.rows[b], self.start[b] + s] = total


def _rows_at(flat: Tensor, index: Tensor) -> Tensor:
    """Return ``flat[index]`` ``[P, ...]``: a view where `index` is a stretch of consecutive rows."""
    if len(index) and int(index[-1]) - int(index[0]) == len(index) - 1 and bool((index.diff() == 1).all()):
        return flat.narrow(0, int(index[0]), len(index))
    return flat.index_select(0, index)
