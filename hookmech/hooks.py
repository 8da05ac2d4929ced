"""Hook points that know their axes.

TransformerLens's `HookPoint` is an identity module with a name; ours adds which axis of
the activation is the sequence position (or none, e.g. a convolution filter), so that a
patching engine can patch "position p" of any hook without knowing the architecture.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from transformer_lens.hook_points import HookPoint


class AxisHookPoint(HookPoint):
    """A `HookPoint` carrying axis metadata.

    `axes` names every axis of the activation it sees (e.g. ``"batch pos head d_head"``);
    `pos_axis` is the index of the position axis in that layout, or None when the
    activation has no position axis (patching it "at a position" is then an error).
    `sizes` holds the sizes the module knows in advance of named axes (``{"head": 4}``; see
    `declare_sizes`): the patching engine reads the number of heads of ``[*]`` sites from it.
    """

    def __init__(self, axes: str = "batch pos d_model", pos_axis: int | None = 1, sizes: dict[str, int] | None = None):
        super().__init__()
        self.axes = axes
        self.pos_axis = pos_axis
        self.sizes: dict[str, int] = dict(sizes or {})
        # TransformerLens (>= 4) reads `pos_dim` for `pos_slice`; keep the two in step.
        self.pos_dim = pos_axis
        #: see `gradients_follow_edits`: while True, the gradient with respect to this hook's
        #: output follows what an edit there does (a recurrent state: the re-propagated recurrence)
        self.edit_gradients = False

    @property
    def is_active(self) -> bool:
        """`hook_in_use` of this hook point (the one predicate; kept for code written against it)."""
        return hook_in_use(self)


def hook_in_use(point: HookPoint) -> bool:
    """Return True when a forward or backward hook is attached to `point`: the one test of "is
    this hook in use" (a backward hook, too, needs the activation to pass through the hook point),
    by which the mixers skip work nobody reads and the blocks decide what they may take from a
    base run's context."""
    return bool(point.fwd_hooks or point.bwd_hooks)


@contextmanager
def hooks_silenced(module) -> Iterator[None]:
    """Within the `with` block, no hook attached to a hook point inside `module` fires (and
    `hook_in_use` says False there); every hook is back afterwards, also after an error. For a
    second run of a module on a cached input that must not call its users' hooks again."""
    points = [point for point in module.modules() if isinstance(point, HookPoint)]
    saved = [(point, point._forward_hooks, point.fwd_hooks, point.bwd_hooks) for point in points]
    for point in points:
        point._forward_hooks, point.fwd_hooks, point.bwd_hooks = type(point._forward_hooks)(), [], []
    try:
        yield
    finally:
        for point, forward_hooks, fwd_hooks, bwd_hooks in saved:
            point._forward_hooks, point.fwd_hooks, point.bwd_hooks = forward_hooks, fwd_hooks, bwd_hooks


def pos_axis_of(hook_point: HookPoint) -> int | None:
    """Return the position axis of any hook point (TransformerLens's default is axis 1)."""
    return getattr(hook_point, "pos_axis", 1)


def axes_of(hook_point: HookPoint) -> str:
    """Return the axis names of any hook point's activation (``"batch pos d_model"``), or ""
    for a plain TransformerLens `HookPoint`, which does not say."""
    return getattr(hook_point, "axes", "")


def axis_size(hook_point: HookPoint, axis: str) -> int | None:
    """Return the declared size of the named `axis` of a hook point's activation, or None when
    the hook point does not declare it (or is a plain TransformerLens `HookPoint`)."""
    size = getattr(hook_point, "sizes", {}).get(axis)
    return None if size is None else int(size)


def declare_sizes(module, **sizes: int) -> None:
    """Record axis sizes (``head=4``) on every `AxisHookPoint` directly inside `module` whose
    axes name that axis; a mixer calls it once after creating its hooks."""
    for point in module.children():
        if isinstance(point, AxisHookPoint):
            names = point.axes.split()
            point.sizes.update({axis: int(size) for axis, size in sizes.items() if axis in names})


@contextmanager
def gradients_follow_edits(hook_points: Iterable[HookPoint]) -> Iterator[None]:
    """Within the `with` block, the gradient with respect to the output of each `AxisHookPoint`
    among `hook_points` is that of an *edit* there: where a mixer re-propagates an edited
    recurrent state through its recurrence (`hookmech.mixers.state_patch`), the gradient at the
    state hook includes every later position the re-propagated state reaches, not only the
    direct read-out at the edited position. Hooks whose edits change only their own activation
    are unaffected. Attribution patching (AtP*) reads these gradients. Yields None."""
    points = [point for point in hook_points if isinstance(point, AxisHookPoint)]
    before = [point.edit_gradients for point in points]
    for point in points:
        point.edit_gradients = True
    try:
        yield
    finally:
        for point, value in zip(points, before, strict=True):
            point.edit_gradients = value
