"""The patched forwards of DAS: the patching engine's forwards, with a subspace intervention
instead of a plain replacement at the patched position.

A block-level site runs resumed, as the engine runs it (hookmech/patching/forwards.py): from the
corrupt residual entering the patched block, on the window of positions from the patched one to
the query (`resume_window`), the earlier positions known through the corrupt run's mixer contexts
(`PatchableModel.resume`); hooks inside a mixer resume the same way where the model says so
(`resume_layer`). A hook a resumed run does not fire (an embedding) runs on every position from
the patched block's input (or from the tokens); a recurrent state patched propagates through the
recurrence as in any run (`hookmech/mixers/state_patch.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..mixers.base import take_window, window_index
from ..patching.forwards import resume_window, window_widths
from ..patching.protocol import PatchableModel
from ..shapes import QueryLogits, RowInts
from .data import Route, RowChunk

#: an intervention: (base [b, d], source [b, d]) -> intervened [b, d]
Intervene = Callable[[Tensor, Tensor], Tensor]


class SubspacePatch:
    """The forward hook at the patched site: in each row, the activation at the row's patched
    position, flattened, becomes ``intervene(activation, source)``; other positions are kept.

    `point_at` sets the rows of the next forward: the intervention, their sources ``[b, d]``,
    patched positions ``[b]`` and the absolute positions ``[b, W]`` an activation of that forward
    may hold, told apart by their length (a resumed window, or the query alone after the last
    mixer, or every position); `disarm` makes it pass activations through unchanged (the forwards
    that read a chunk's corrupt run, while the hook stays attached)."""

    def __init__(self, pos_axis: int):
        self.pos_axis = pos_axis
        self.intervene: Intervene | None = None

    def point_at(self, intervene: Intervene, source: Tensor, position: Tensor, windows: tuple[Tensor, ...]) -> None:
        """Aim the hook at the rows of the next forward; return None."""
        self.intervene, self.source, self.position = intervene, source, position
        self.by_length = {positions.shape[1]: positions for positions in windows}

    def disarm(self) -> None:
        """Let activations pass unchanged until the next `point_at`; return None."""
        self.intervene = None

    def __call__(self, activation: Tensor, hook=None) -> Tensor:
        if self.intervene is None:
            return activation
        moved = activation.movedim(self.pos_axis, 1)  # [b, W, ...]
        at = self.by_length[moved.shape[1]] == self.position[:, None]  # [b, W], at most one True per row
        rows = torch.arange(len(moved), device=moved.device)
        base = moved[rows, at.int().argmax(dim=1)].flatten(1)  # [b, d]
        patched = self.intervene(base, self.source.to(base.dtype)).view(len(moved), 1, *moved.shape[2:])
        mask = at.view(*at.shape, *([1] * (moved.dim() - 2)))
        return torch.where(mask, patched, moved).movedim(1, self.pos_axis)


def patched_logits(
    model: PatchableModel, route: Route, chunk: RowChunk, index: RowInts, patch: SubspacePatch, intervene: Intervene
) -> QueryLogits:
    """Return the query logits ``[b, d_vocab]`` of rows `index` ``[b]`` of `chunk` patched by
    `intervene` at their positions. `patch` must be attached to the model at `route.hook`
    (``model.hooks(fwd_hooks=[(route.hook, patch)])``)."""
    position, query, source = chunk.position[index], chunk.query[index], chunk.source[index]
    try:
        if route.resume_at is not None:
            assert chunk.contexts is not None  # a resumed route's chunks carry contexts
            width, start = resume_window(window_widths(position, query), query)
            patch.point_at(intervene, source, position, (window_index(start, width), query[:, None]))
            window = take_window(chunk.start_input.index_select(0, index), start, width)
            return model.resume(window, route.resume_at, chunk.contexts, index, start, query)
        n_pos = chunk.start_input.shape[1]
        every = torch.arange(n_pos, device=index.device).expand(len(index), n_pos)
        patch.point_at(intervene, source, position, (every,))
        return model(chunk.start_input.index_select(0, index), start_at_layer=route.start_at, positions=query)
    finally:
        patch.disarm()
