"""Make an edit to a recurrent-state hook propagate through the recurrence (docs/sites.md).

A recurrent mixer exposes its state after each position, ``[batch, pos, ...state dims]``,
through a hook. A hook function may overwrite the state of some rows at some positions;
the recurrence must then continue from the edited state. Row by row:

    h_t = edited_t                   if the hook changed row's state at position t,
    h_t = step(h_{t-1}, inputs_t)    otherwise, from the row's earliest edit on.

The mixer supplies `rescan(initial_state, start, end)`, its own (chunked) recurrence run
over positions ``start .. end-1`` from the state after ``start-1``; this file only finds
the edited positions and stitches the segments together.

Every recurrence here is affine in the state, h_t = A_t h_{t-1} + b_t, with A_t fixed by the
inputs, so an edit moves later states linearly: the edited run's states are h + δ with

    δ_t = hooked_t − h_t      where row's state was edited at t,
    δ_t = A_t δ_{t-1}         elsewhere (δ_{-1} = 0),

one pass of the homogeneous recurrence with the transition dropped at edited positions. A mixer
that supplies `carry(e, keep)`, computing c_t = keep_t A_t c_{t-1} + e_t (c_{-1} = 0; `keep`
``[batch, pos]`` bool, None: everywhere), gets that pass; otherwise the segments after each edited
position are re-run with `rescan` (a pass per edited position).

Gradients (attribution patching, `hookmech.hooks.gradients_follow_edits`): with `carry` and the
hook's `edit_gradients` on, an unedited output is returned as

    hooked + carry(hooked − states) − (hooked − states)

equal to `hooked` in value (no edit: hooked == states), whose derivative with respect to the
hook's output at s is I at s and A_t ··· A_{s+1} at every t > s: an edit's own effect.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..hooks import AxisHookPoint

Rescan = Callable[[Tensor, int, int], Tensor]
Carry = Callable[[Tensor, Tensor | None], Tensor]


def hook_state_with_propagation(
    hook: AxisHookPoint, states: Tensor, rescan: Rescan, carry: Carry | None = None, initial: Tensor | None = None
) -> Tensor:
    """Apply `hook` to `states` ``[batch, pos, ...]`` and return the states the mixer uses.

    Returns the hook's output itself when it changed nothing; otherwise a tensor of the
    same shape in which every state after an edit follows the recurrence from the edited
    states (`rescan(h [batch, ...], start, end)` returns ``[batch, end - start, ...]``; with
    `carry`, the homogeneous recurrence ``(edit [batch, pos, ...], keep [batch, pos] | None) ->
    [batch, pos, ...]``, one pass instead). With `carry` and the hook's `edit_gradients` on, an
    unedited output is returned with gradients that follow the recurrence (module docstring).
    `initial` ``[batch, ...]``: the state before the first position (None: zeros), from which the
    unedited states are recomputed when the hook edited them in place.
    """
    version = states._version
    hooked = hook(states)
    if states._version == version:  # not edited in place: `states` are the unedited states
        if hooked is states:  # a hook that only reads (a cache): nothing to propagate
            return _without_edits(hook, hooked, states, carry)
        reference = states.detach()
    else:
        # TransformerLens examples often edit in place (`act[:, p] = ...`): recompute the unedited
        # states, rather than copy every state tensor before every hook in case one does. Same
        # grad mode, hence the same kernel: the recomputed states must equal the first bit for bit
        before = states.new_zeros(states[:, 0].shape) if initial is None else initial
        reference = rescan(before, 0, states.shape[1]).detach()
    changed = (hooked != reference).flatten(2).any(dim=2)  # [batch, pos]
    edited = torch.nonzero(changed.any(dim=0)).flatten().tolist()
    if not edited:
        return _without_edits(hook, hooked, states, carry)
    if carry is not None:
        # in place where autograd allows: a state tensor is the largest one a mixer makes
        at_edits = changed.view(*changed.shape, *(1,) * (hooked.dim() - 2))
        edits = (hooked - reference).masked_fill_(~at_edits, 0)  # (inf − inf at an unedited place: 0)
        carried = carry(edits, ~changed)
        return reference + carried if carried.requires_grad else carried.add_(reference)
    n_pos = hooked.shape[1]
    segments = [hooked[:, : edited[0] + 1]]
    for index, pos in enumerate(edited):
        following = edited[index + 1] if index + 1 < len(edited) else None
        stop = n_pos if following is None else following + 1
        if stop <= pos + 1:
            continue
        segment = rescan(segments[-1][:, -1], pos + 1, stop)
        if following is not None:
            # At the next edited position only the rows edited there take the edit; the
            # others keep their re-propagated state (the hook saw the unpropagated one).
            take_edit = changed[:, following].view(-1, *(1,) * (segment.dim() - 2))
            last = torch.where(take_edit, hooked[:, following], segment[:, -1])
            segment = torch.cat([segment[:, :-1], last[:, None]], dim=1)
        segments.append(segment)
    return torch.cat(segments, dim=1)


def _without_edits(hook: AxisHookPoint, hooked: Tensor, states: Tensor, carry: Carry | None) -> Tensor:
    """Return the hook's output when it edited no state: itself, or, with `carry` and the hook's
    `edit_gradients` on, a tensor equal to it whose gradient follows the recurrence."""
    if carry is not None and getattr(hook, "edit_gradients", False) and hooked.requires_grad:
        # zero in value; its gradient carries an edit at s on to every later state
        edit = hooked - states
        return hooked + carry(edit, None) - edit
    return hooked
