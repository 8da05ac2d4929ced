"""The core contract of a sequence mixer (`Mixer`: its forward with its hooks, the resume protocol;
what the package knows of its block is its spec, mixer_spec.py), so that the backbone never has to
name one; the helpers its resume and patch computations share. What a mixer may do beyond the
core: capabilities.py."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from ..errors import HookmechError, UsageError, suggest
from ..hook_names import hook_attribute
from ..hooks import AxisHookPoint
from ..hooks import hook_in_use as hook_in_use  # the one "is this hook in use"; also importable here
from ..option_pairs import check_option_types
from ..shapes import Context, KeptWindow, Resid, RowInts, RunResid, Window
from .capabilities import CAPABILITY_OF, missing_capability


class Mixer(nn.Module):
    """Base class of sequence mixers: ``[batch, pos, d_model] -> [batch, pos, d_model]``.

    The core contract, all that the backbone, the exact patching engine, AtP and DAS ask of a
    mixer besides its `MixerSpec` (its block, its heads): its `forward` with its inside hooks
    (`AxisHookPoint`s), and the resume protocol, whose defaults are exact for any causal mixer, so
    that a new mixer is correct before it is fast. Built as ``REGISTRY[name](d_model=..., **kwargs)``.

    What else a mixer can do it opts into by listing a capability among its bases
    (`hookmech.mixers.capabilities`: `ExactPatchEffects` for AtP*, `PathRoutes`,
    `EffectiveAttentionMap`); a member of one it lacks raises `MissingCapability`, naming both.
    """

    #: the inside hooks holding the recurrent state after each position (``("ssm_state",)``,
    #: without the "hook_" prefix); a mixer declaring them defines `state_from_context`
    state_hooks: ClassVar[tuple[str, ...]] = ()

    if TYPE_CHECKING:  # declared for mypy and readers; each mixer defines it (nn.Module's raises)

        def forward(self, x: Resid) -> Resid:
            """Return the mixed sequence ``[batch, pos, d_model]`` of `x` ``[batch, pos, d_model]``."""

    # -- resuming a run from a position (the patching engine's protocol) -------------------
    # A patch at position p of a causal model changes nothing before p. To re-run only
    # positions >= p, the engine keeps, per layer, what the mixer needs to know about the
    # unpatched run's earlier positions (`prefix_context`, computed once per run) and asks
    # for the outputs of a window of positions (`forward_from`). Each mixer answers with what
    # it already has: attention with the earlier keys and values, recurrent mixers with their
    # state at p - 1, convolutions with their earlier inputs. The defaults below are exact for
    # any causal mixer and save nothing inside the mixer (the block around it still runs
    # its norms and MLP on the window only).
    def prefix_context(self, x: RunResid) -> Context:
        """Return what `forward_from` needs to know about a run on `x` ``[N, T, d_model]``:
        a dict of tensors whose first axis is the row (N). Default: ``{"x": x}``."""
        return {"x": x}

    def forward_with_context(self, x: RunResid) -> tuple[RunResid, Context]:
        """Return ``(forward(x), prefix_context(x))`` (the engine's unpatched base run records
        contexts this way): from one pass where `fused_forward_with_context` gives one, else the
        two apart. Never from one pass while a state hook is in use: the hook may edit the states,
        and a context is the unedited run's. Mixers override `fused_forward_with_context`, not this."""
        if not any(hook_in_use(getattr(self, hook_attribute(name))) for name in self.state_hooks):
            both = self.fused_forward_with_context(x, hooked=self.inside_hooks_in_use())
            if both is not None:
                return both
        return self(x), self.prefix_context(x)

    def fused_forward_with_context(self, x: RunResid, hooked: bool) -> tuple[RunResid, Context] | None:
        """Return ``(forward(x), prefix_context(x))`` computed in one pass, or None where the mixer
        has no such pass (the default). `hooked`: an inside hook is in use, so the pass must fire
        the hooks as `forward` does (or return None). Not called while a state hook is in use."""
        return None

    def forward_from(
        self, x: Window, context: Context, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return the output at positions ``start[i] .. start[i] + W - 1`` of row ``rows[i]``,
        ``[B, W, d_model]``, when the input there is `x` ``[B, W, d_model]`` and the input at
        earlier positions is that of the run `context` was made from (`prefix_context`).
        With `keep` ``[B]`` (window indices) only the output there is wanted: ``[B, 1, d_model]``.

        `rows`, `start`: ``[B]`` long; ``start[i] + W <= T``. Must equal ``forward`` on the
        spliced full input at those positions (tests/mixers/test_resume.py checks every mixer).
        """
        return self.forward_spliced(x, context["x"], rows, start, keep)

    #: whether `forward_from` fires the mixer's own (inside) hooks on the window, as `forward`
    #: fires them on the whole run: ``[B, W, ...]`` along their position axis (``[B, 1, ...]``
    #: where only `keep` is computed), a recurrent state hook's edits carried on from the
    #: window's start. Without it, a resumed run with an inside hook in use runs
    #: `forward_spliced` instead (the backbone keeps the mixer's input in its context for that).
    window_hooks: ClassVar[bool] = False

    def forward_spliced(
        self, x: Window, run_input: RunResid, rows: RowInts, start: RowInts, keep: RowInts | None = None
    ) -> Window | KeptWindow:
        """Return `forward_from`'s output from the base run's whole input `run_input` ``[N, T,
        d_model]``: the mixer's own forward on it with the window `x` spliced in, so that every
        inside hook fires on the run's T positions (exact for any causal mixer; saves nothing
        inside the mixer)."""
        full = splice(run_input, rows, x, start)
        return kept(take_window(self.forward(full), start, x.shape[1]), keep)

    def state_from_context(self, name: str, context: Context, rows: RowInts, positions: RowInts) -> Tensor:
        """Return the state hook `name` (one of `state_hooks`, e.g. ``"ssm_state"``) of the run
        `context` was made from (`prefix_context`) at position ``positions[i]`` of row ``rows[i]``,
        ``[B, ...]`` (the hook's axes after batch and position): what that run's hook fired with
        there. The engine's unpatched runs read a patched state here instead of having the mixer
        materialise every position's state for its hook. Mixers with `state_hooks` define it."""
        raise HookmechError(f"mixer {type(self).__name__} has no state hook {name!r}")

    def inside_hooks_in_use(self) -> bool:
        """Return True when a forward or backward hook is attached to one of the mixer's own hooks."""
        # the hook points are listed once: a resumed run asks per block and chunk, and walking the
        # modules each time was a fifth of a short window's cost (a mixer's hook points are made in
        # its __init__; the list lives outside nn.Module's registries, so it is no submodule)
        points = self.__dict__.get("_hook_points")
        if points is None:
            points = [point for point in self.modules() if isinstance(point, AxisHookPoint)]
            self.__dict__["_hook_points"] = points
        return any(hook_in_use(point) for point in points)

    def __getattr__(self, name: str) -> Tensor | nn.Module:
        """nn.Module's (submodules, parameters, buffers), except that a member of a capability the
        mixer does not implement raises `MissingCapability`, one line naming both."""
        if name in CAPABILITY_OF:
            raise missing_capability(self, name)
        return super().__getattr__(name)


#: bytes of the largest tensor AtP*'s exact per-position mixer computations
#: (`ExactPatchEffects.position_patch_effects`, `position_patch_outputs`) hold for one block of rows
#: (`row_blocks`): bounded memory, and several times faster on a CPU than all rows at once
PATCH_BLOCK_BYTES = 16 << 20


def one_pass(
    hooked_forward: Callable[..., tuple[RunResid, Context | None]],
    x: RunResid,
    hooked: bool,
    unhooked: Callable[[RunResid], tuple[RunResid, Context]] | None = None,
) -> tuple[RunResid, Context]:
    """Return ``(forward(x), prefix_context(x))`` (`Mixer.fused_forward_with_context`) of a mixer
    whose ``hooked_forward(x, with_context=True)`` gives its run's context too: from it when an
    inside hook is in use (`hooked`: the hooks fire) or no `unhooked` is given, else from
    ``unhooked(x)``, the same pass without the hook points."""
    if hooked or unhooked is None:
        out, context = hooked_forward(x, with_context=True)
        assert context is not None  # with_context=True always makes one
        return out, context
    return unhooked(x)


def row_blocks(n_rows: int, bytes_per_row: int, block_bytes: int = PATCH_BLOCK_BYTES) -> list[slice]:
    """Return slices covering ``range(n_rows)`` in blocks of rows whose tensors of `bytes_per_row`
    bytes per row stay within `block_bytes` (at least one row per block)."""
    size = max(1, block_bytes // max(1, bytes_per_row))
    return [slice(start, min(n_rows, start + size)) for start in range(0, n_rows, size)]


def pattern_effects_by_rows(row_effects, x: RunResid, grad_out: Tensor, patched: Tensor, n_heads: int) -> Tensor:
    """Return ``row_effects(x, grad_out, patched)`` ``[..., N, T]`` computed a block of rows at a time
    (`row_blocks`), for a mixer whose computation holds float64 ``[..., head, T, T]`` patterns
    (attention, Based): `x` ``[N, T, d_model]``, `grad_out` ``[..., N, T, d_model]``, `patched`
    rows first."""
    per_row = math.prod(grad_out.shape[:-3]) * n_heads * x.shape[1] ** 2 * 8
    parts = [row_effects(x[rows], grad_out[..., rows, :, :], patched[rows]) for rows in row_blocks(len(x), per_row)]
    return torch.cat(parts, dim=-2)


def window_index(start: Tensor, width: int) -> Tensor:
    """Return ``[B, width]``: the positions ``start[i] .. start[i] + width - 1`` of each row."""
    return start[:, None] + torch.arange(width, device=start.device)


def take_window(full: Tensor, start: Tensor, width: int) -> Tensor:
    """Return ``full[i, start[i] : start[i] + width]`` for every row, ``[B, width, ...]`` of ``[B, T, ...]``."""
    index = window_index(start, width).view(*start.shape, width, *([1] * (full.dim() - 2)))
    return full.gather(1, index.expand(-1, -1, *full.shape[2:]))


def window_of(run: Tensor, rows: Tensor, start: Tensor, width: int) -> Tensor:
    """Return ``run[rows[i], start[i] : start[i] + width]`` for every i, ``[B, width, ...]`` of
    ``[N, T, ...]`` (what `take_window` of ``run[rows]`` gives, without copying whole rows; `run`
    contiguous, else it is copied whole first)."""
    flat = rows[:, None] * run.shape[1] + window_index(start, width)
    return run.flatten(0, 1).index_select(0, flat.flatten()).view(len(rows), width, *run.shape[2:])


def kept(window: Tensor, keep: Tensor | None) -> Tensor:
    """Return ``window[i, keep[i]]`` as ``[B, 1, ...]`` (`window` itself when `keep` is None)."""
    return window if keep is None else take_window(window, keep, 1)


def splice(context: Tensor, rows: Tensor, window: Tensor, start: Tensor) -> Tensor:
    """Return rows `rows` of `context` ``[N, T, ...]`` (a new ``[B, T, ...]`` tensor) with
    `window` ``[B, W, ...]`` written at positions ``start[i] .. start[i] + W - 1`` of row i."""
    full = context.index_select(0, rows)  # index_select, not context[rows]: several times faster on CPU
    batch_index = torch.arange(len(rows), device=rows.device)[:, None]
    full[batch_index, window_index(start, window.shape[1])] = window.to(full.dtype)
    return full


def state_before(states: Tensor, rows: Tensor, start: Tensor) -> Tensor:
    """Return the state after position ``start[i] - 1`` of row ``rows[i]`` (zeros where start
    is 0), ``[B, ...]``, from per-position states ``[N, T, ...]``."""
    if states.shape[1] == 0:  # none kept (a run shorter than a mixer's state stride): start is 0
        return states.new_zeros(len(rows), *states.shape[2:])
    flat = states.flatten(0, 1)  # index_select on [N*T, ...]: far cheaper than states[rows, positions]
    before = flat.index_select(0, rows * states.shape[1] + (start - 1).clamp(min=0))
    first = (start == 0).view(-1, *([1] * (before.dim() - 1)))
    return before.masked_fill(first, 0)


def needs_grad(*tensors: Tensor | None) -> bool:
    """Return True when autograd would record an operation on `tensors` (grad mode on and one of
    them requires grad): the mixers run their in-place kernels only when it would not."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def replay_before(inputs: list[Tensor], rows: Tensor, start: Tensor, stride: int) -> tuple[list[Tensor], Tensor]:
    """Return what a mixer that keeps its state every `stride` positions replays to reach the
    state before ``start[i]`` of row ``rows[i]``: each of `inputs` ``[N, T, ...]`` at the
    ``stride - 1`` positions before start ``[B, stride - 1, ...]``, and ``live`` ``[B, stride -
    1]``, True at those from the start of start's block of `stride` positions on (the kept state
    is the one after the position before that block: the others must replay as no-ops)."""
    positions = start[:, None] + torch.arange(1 - stride, 0, device=start.device)
    live = positions >= (start - start % stride)[:, None]
    flat = rows[:, None] * inputs[0].shape[1] + positions.clamp(min=0)
    return [values.flatten(0, 1)[flat] for values in inputs], live


def mixer_options(cls: type[Mixer]) -> dict[str, Any]:
    """Return the keyword options of a mixer class (besides d_model) with their defaults."""
    params = inspect.signature(cls.__init__).parameters
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {
        name: (None if p.default is inspect.Parameter.empty else p.default)
        for name, p in params.items()
        if name not in ("self", "d_model") and p.kind in keyword_kinds
    }


def check_mixer_options(name: str, cls: type[Mixer], kwargs: dict[str, Any]) -> None:
    """Raise a UsageError naming the mixer if `cls` takes no ``d_model`` or `kwargs` holds an
    option `cls` does not take."""
    parameters = inspect.signature(cls.__init__).parameters
    if "d_model" not in parameters and not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        raise UsageError(
            f"mixer {name!r} takes no d_model parameter; every mixer is built as Class(d_model=..., **options)"
        )
    known = mixer_options(cls)
    for key in kwargs:
        if key not in known:
            raise UsageError(
                f"mixer {name!r} takes no option {key!r}{suggest(key, known)}"
                f"; its options: {', '.join(sorted(known)) or 'none'}"
            )
    check_option_types(f"mixer {name!r}", cls, kwargs)
