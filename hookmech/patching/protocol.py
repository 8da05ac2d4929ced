"""What the patching engine expects of a model: `PatchableModel`.

The engine speaks hook names, axes and positions only; everything it asks of a model is
written here, once, split by what asks it: `PatchableModel` (a `HookedModel`, what
TransformerLens gives, plus the resume protocol) is all that exact patching, AtP and DAS need;
AtP* asks `AtpStarModel` and path patching `PathPatchableModel` besides, each checked where it
runs (`check_patchable`). `hookmech.model.HookedLM` satisfies all of them
(tests/test_patching_package.py). A model only has to be able to say where a resumed run starts
(`resume_layer`, None for a hook it cannot resume at); patches it cannot resume run on every
position, with the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from ..errors import HookmechError
from ..mixers.capabilities import MixerMemo, PatchMemo


@runtime_checkable
class PatchableConfig(Protocol):
    """The configuration fields the engine reads."""

    @property
    def n_layers(self) -> int: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def d_vocab(self) -> int: ...

    def to_json(self) -> str:
        """Return the configuration as JSON (a cache records it; `model_hash` hashes it)."""
        ...


@runtime_checkable
class HookedModel(Protocol):
    """What a TransformerLens-style hooked model is: TransformerLens's `HookedRootModule` gives
    `hook_dict`, `run_with_hooks`, `run_with_cache` and `hooks`; `nn.Module` gives `parameters`,
    `training`, `eval`, `train`; the model itself `cfg` and its forward. Nothing here is the
    engine's: a model satisfying it needs only `PatchableModel`'s own members to be patched."""

    # read-only properties, so that any attribute of a matching type satisfies them (mypy)
    @property
    def cfg(self) -> PatchableConfig: ...

    @property
    def hook_dict(self) -> dict[str, Any]:
        """Hook name -> hook point, in forward order; a hook point may say its axes
        (`hookmech.hooks.AxisHookPoint`: ``axes``, ``pos_axis``, ``sizes``)."""
        ...

    @property
    def training(self) -> bool: ...

    def __call__(
        self,
        input: Tensor,
        *,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        positions: Tensor | None = None,
        tail_at_positions: bool = False,
    ) -> Tensor:
        """Return logits ``[batch, pos, d_vocab]`` (``[batch, d_vocab]`` at `positions` ``[batch]``) of
        tokens ``[batch, pos]``, or of the residual entering block `start_at_layer` ``[batch, pos, d_model]``.
        `tail_at_positions`: a hint that only the logits at `positions` are wanted, so what follows
        the last mixer may run there only (a model may ignore it; the engine passes it)."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Yield the parameters (the engine reads their device)."""
        ...

    def eval(self) -> Any:
        """Switch to evaluation mode; return the model."""
        ...

    def train(self, mode: bool = True) -> Any:
        """Switch to training mode (or back, `mode`); return the model."""
        ...

    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Tensor:
        """Return the forward's output with ``fwd_hooks=[(hook name, fn)]`` attached for this call."""
        ...

    def run_with_cache(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        """Return ``(output, activations)``; with ``return_cache_object=False`` the activations are
        a dict hook name -> tensor (``names_filter`` chooses the hooks)."""
        ...

    def hooks(self, *args: Any, **kwargs: Any) -> AbstractContextManager[Any]:
        """Return a context manager that attaches ``fwd_hooks`` while it is open."""
        ...


@runtime_checkable
class PatchableModel(HookedModel, Protocol):
    """A hooked causal language model the patching engine can run: exact patching, AtP and DAS
    ask this and nothing more. Beyond a `HookedModel`, the resume protocol (docs/guide.md §6,
    docs/architecture.md): where a hook lives, where a resumed run starts, and the run itself.
    AtP* asks more (`AtpStarModel`), path patching too (`PathPatchableModel`), each where it runs.
    """

    def layer_of_hook(self, hook_name: str) -> int | None:
        """Return l for a hook inside ``blocks.{l}``, None for hooks outside the blocks."""
        ...

    def resid_hook(self, layer: int) -> str:
        """Return the hook holding the residual entering block `layer` (`n_layers`: the final norm's input)."""
        ...

    def resume_layer(self, hook_name: str) -> int | None:
        """Return the block whose resumed run fires `hook_name`, None for hooks a resumed run does not fire."""
        ...

    def equivalent_hook(self, hook_name: str) -> str:
        """Return the latest hook holding the same tensor as `hook_name` before the same computation."""
        ...

    def collecting_contexts(self) -> AbstractContextManager[dict[int, list[dict[str, Tensor]]]]:
        """Return a context manager under which every forward records each block's mixer context;
        it yields ``{layer: [context of each forward]}``."""
        ...

    def layer_context(self, layer: int, mixer_in: Tensor) -> dict[str, Tensor]:
        """Return block `layer`'s mixer context of a run whose mixer input was `mixer_in` ``[N, T, d_model]``."""
        ...

    def resume(
        self,
        resid: Tensor,
        start_at_layer: int,
        contexts: dict[int, dict[str, Tensor]],
        rows: Tensor,
        start: Tensor,
        query: Tensor,
        unembed: bool = True,
        joining: list[int] | None = None,
    ) -> Tensor:
        """Return the logits at `query` ``[B, d_vocab]`` of a run resumed on a window of positions
        (with `unembed` False, the final-normed residual there ``[B, d_model]``, for `unembed_resid`);
        with `joining`, block l runs only the first ``joining[l - start_at_layer]`` rows."""
        ...

    def unembed_resid(self, resid: Tensor) -> Tensor:
        """Return logits ``[..., d_vocab]`` of a final-normed residual ``[..., d_model]``."""
        ...

    def state_reader(self, hook_name: str) -> Callable[[dict[str, Tensor], Tensor, Tensor], Tensor] | None:
        """Return ``read(context, rows, positions)`` -> ``[B, ...]``: hook `hook_name`'s activation
        at ``positions[i]`` of row ``rows[i]`` of the run its block's recorded context (`collecting_contexts`)
        was made from; None for a hook the model cannot read there (the unpatched runs then fire it)."""
        ...


@runtime_checkable
class AtpStarModel(PatchableModel, Protocol):
    """A `PatchableModel` that AtP* can run (`hookmech.patching.atp_star_patch`): it follows a patch
    to the next mixer and asks that mixer for its exact per-position effects. `HookedLM` does for
    every mixer (`mixer_patches_exactly` False, the first-order estimate, where a mixer has no
    `hookmech.mixers.ExactPatchEffects`). Exact patching, AtP and DAS do not need it.

    `memo`: a `hookmech.mixers.capabilities.PatchMemo` the caller keeps for its calls on one chunk
    of a base run, where the model (its mixers) keeps what they have in common."""

    def patch_to_next_mixer(
        self, hook_name: str, values: Tensor, base: Callable[[str], Tensor], at: Tensor | None = None
    ) -> tuple[int, Tensor, Tensor | None] | None:
        """Return ``(L, resid, mixer_in)`` ``[N, T, d_model]``: block L of the next mixer after
        `hook_name`, and the residual entering it and that mixer's input at every position when
        that position alone of `hook_name` takes `values` ``[N, T, ...]`` (the base run's
        activations read with `base(hook)`); ``(n_layers, resid entering the final norm, None)``
        after the last mixer, with `at` ``[N]`` at position ``at[n]`` alone (``[N, 1, d_model]``);
        None when the hook is not a block-level hook."""
        ...

    def mixer_patches_exactly(self, layer: int, hook_name: str | None = None) -> bool:
        """Return True where `mixer_patch_effects` with these arguments returns the effects, False
        where it returns None (AtP* asks before its backward passes)."""
        ...

    def mixer_patch_effects(
        self,
        layer: int,
        grad_mixer_out: Tensor,
        patched: Tensor,
        base: Callable[[str], Tensor],
        hook_name: str | None = None,
        memo: PatchMemo | None = None,
    ) -> Tensor | None:
        """Return ``[..., N, T]``: the exact change of block `layer`'s mixer output along
        `grad_mixer_out` ``[..., N, T, d_model]`` when one position of its input (`hook_name`
        None) or of its inside hook `hook_name` takes `patched`; None where the mixer has no such
        computation."""
        ...

    def mixer_backward_patch_effects(self, layer: int, patched: Tensor, memo: MixerMemo, first_row: int) -> Any:
        """Return a recorder of `mixer_patch_effects(layer, ·, patched, ...)` (a patch of the mixer's
        input) computed by the backward passes of the resumed forwards run within its
        ``recording()``, read with ``effects()`` (None where it could not); None where the
        mixer computes them after the backward only."""
        ...

    def mixer_patch_outputs(
        self,
        layer: int,
        patched: Tensor,
        base: Callable[[str], Tensor],
        at: Tensor,
        memo: PatchMemo | None = None,
    ) -> Tensor | None:
        """Return ``[N, T, d_model]``: the change of block `layer`'s mixer output at position ``at[n]``
        when one position s of its input takes ``patched[n, s]`` (AtP* carries it through the
        last block exactly); None where the mixer has no such computation."""
        ...

    def layer_patch_context(self, layer: int, mixer_in: Tensor, memo: PatchMemo) -> dict[str, Tensor]:
        """Return `layer_context(layer, mixer_in)`, made from what `memo` keeps where the mixer can."""
        ...

    def mixer_patch_reads(self, layer: int) -> list[str]:
        """Return the hooks inside block `layer`'s mixer whose activations on a run its patch
        computations read from `memo` where the caller gives them (`PatchMemo.of_layer(layer).give`)."""
        ...


@runtime_checkable
class PathPatchableModel(PatchableModel, Protocol):
    """A `PatchableModel` that can also say what travels along a path (`hookmech.patching.path_patch`,
    docs/guide.md §10): `HookedLM` does, through `hookmech/path_routes.py`. Node patching does not need it."""

    def path_ends(self, via: str, sender: str, receiver: str) -> Any:
        """Return the checked path from hook `sender` to hook `receiver` along route `via`: an object
        with ``patched`` (the hook the path replaces at the receiver's positions) and ``reads`` (the
        hooks whose clean and corrupt activations `path_change` reads); a UsageError if there is none."""
        ...

    def path_change(self, ends: Any, acts: Any, senders: Tensor, head: int | None = None) -> Tensor:
        """Return the change ``[N, pos, ...]`` of ``ends.patched`` along the path `ends` when the sender is
        the clean run's at the positions `senders` ``[N, pos]`` (its head `head` only, if given), given
        ``acts(hook, "clean" | "corrupt")`` -> ``[N, ...]``; exactly zero where the path does not reach."""
        ...


def _members(protocol: type) -> tuple[str, ...]:
    """Return every public name `protocol` declares, its bases' first (what `check_patchable` looks for)."""
    names = ["__call__"]
    for cls in reversed(protocol.__mro__):
        if cls is not Protocol and getattr(cls, "_is_protocol", False):
            names += [name for name in vars(cls) if not name.startswith("_") and name not in names]
    return tuple(names)


def check_patchable(model: object, paths: bool = False, atp_star: bool = False) -> None:
    """Raise a HookmechError naming what `model` lacks unless it satisfies `PatchableModel` (what
    exact patching, AtP and DAS ask), with `atp_star` `AtpStarModel` (what AtP* asks), with `paths`
    `PathPatchableModel` (what path patching asks); return None."""
    protocol, what = PatchableModel, "patched"
    if paths:
        protocol, what = PathPatchableModel, "path-patched"
    elif atp_star:
        protocol, what = AtpStarModel, "patched with AtP*"
    if isinstance(model, protocol):
        return
    missing = [name for name in _members(protocol) if not hasattr(model, name)]
    raise HookmechError(
        f"{type(model).__name__} cannot be {what}: it has no {', '.join(missing)} "
        f"(hookmech.patching.{protocol.__name__} lists what the engine needs)"
    )
