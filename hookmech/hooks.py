"""Hook points that know their axes.

TransformerLens's `HookPoint` is an identity module with a name; ours adds which axis of
the activation is the sequence position (or none, e.g. a convolution filter), so that a
patching engine can patch "position p" of any hook without knowing the architecture.
"""
from __future__ import annotations

from transformer_lens.hook_points import HookPoint


class AxisHookPoint(HookPoint):
    """A `HookPoint` carrying axis metadata.

    `axes` names every axis of the activation it sees (e.g. ``"batch pos head d_head"``);
    `pos_axis` is the index of the position axis in that layout, or None when the
    activation has no position axis (patching it "at a position" is then an error).
    """

    def __init__(self, axes: str = "batch pos d_model", pos_axis: int | None = 1):
        super().__init__()
        self.axes = axes
        self.pos_axis = pos_axis
        # TransformerLens (>= 4) reads `pos_dim` for `pos_slice`; keep the two in step.
        self.pos_dim = pos_axis

    @property
    def is_active(self) -> bool:
        """True when a forward hook is attached: mixers use it to skip work nobody reads."""
        return bool(self.fwd_hooks)


def pos_axis_of(hook_point: HookPoint) -> int | None:
    """Return the position axis of any hook point (TransformerLens's default is axis 1)."""
    return getattr(hook_point, "pos_axis", 1)
