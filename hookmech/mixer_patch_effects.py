"""A patch through a block's mixer, exactly: what AtP* asks of a model's mixers
(`hookmech.patching.protocol.AtpStarModel`'s ``mixer_patch_*``), each mixer's `ExactPatchEffects`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from torch import Tensor, nn

from .hook_names import MIXER, block_hook, mixer_hook, parse_hook
from .mixers.base import Mixer
from .mixers.capabilities import BackwardPatchEffects, ExactPatchEffects, MixerMemo, PatchMemo
from .shapes import Gradients, PositionEffects, RowInts, RunResid


class _MixerBlock(Protocol):
    """What these methods read of a block: its mixer."""

    @property
    def mixer(self) -> Mixer: ...


BlockT = TypeVar("BlockT", bound=_MixerBlock)


class MixerPatchEffects(Generic[BlockT]):
    """`HookedLM`'s `mixer_patch_*` methods (`AtpStarModel`): the exact effects of a patch through
    the mixer of a block, computed by that mixer (`ExactPatchEffects`), None where it has none."""

    if TYPE_CHECKING:  # HookedLM's blocks, typed as `TransformerLensWeights` types them

        @property
        def blocks(self) -> Sequence[BlockT]: ...

        @blocks.setter
        def blocks(self, value: nn.ModuleList) -> None: ...

    def mixer_patch_effects(
        self,
        layer: int,
        grad_mixer_out: Gradients,
        patched: Tensor,
        base: Callable[[str], Tensor],
        hook_name: str | None = None,
        memo: PatchMemo | None = None,
    ) -> PositionEffects | None:
        """Return block `layer`'s `ExactPatchEffects.position_patch_effects` ``[..., N, T]`` on the base
        run (its mixer input read with `base`, as in `patch_to_next_mixer`): the exact change of the
        mixer's output along `grad_mixer_out` ``[..., N, T, d_model]`` when one position's input becomes `patched`
        (`hook_name` None) or one position of `hook_name`, a hook inside that mixer
        (``blocks.{layer}.mixer.hook_k``), does. None where the mixer has none (no
        `ExactPatchEffects`, or not for that patch), or `hook_name` is not inside that mixer.
        `memo`: kept by the caller for its calls on one base run (this method's,
        `mixer_patch_outputs`' and `layer_patch_context`'), where each mixer keeps what they share."""
        mixer = self.blocks[layer].mixer
        if not isinstance(mixer, ExactPatchEffects) or not self.mixer_patches_exactly(layer, hook_name):
            return None
        local = None if hook_name is None else _inside_of(layer, hook_name)
        mixer_in = base(block_hook(layer, "mixer_in"))
        kept = None if memo is None else memo.of_layer(layer)
        return mixer.position_patch_effects(mixer_in, grad_mixer_out, patched, local, kept)

    def mixer_patches_exactly(self, layer: int, hook_name: str | None = None) -> bool:
        """Return True where `mixer_patch_effects(layer, ..., hook_name)` gives the exact effects,
        False where it gives None (`ExactPatchEffects.patches_exactly`; a mixer without that
        capability, or a hook outside that mixer: False)."""
        mixer = self.blocks[layer].mixer
        if not isinstance(mixer, ExactPatchEffects):
            return False
        local = None
        if hook_name is not None:
            local = _inside_of(layer, hook_name)
            if local is None:
                return False
        return mixer.patches_exactly(local)

    def mixer_patch_reads(self, layer: int) -> list[str]:
        """Return the hooks inside block `layer`'s mixer (``blocks.{layer}.mixer.hook_in_x``) whose
        activations on a run `mixer_patch_effects`, `mixer_patch_outputs` and `layer_patch_context`
        read from their memo where the caller gives them (`ExactPatchEffects.patch_reads`,
        `MixerMemo.give` with the short names); none for a mixer without `ExactPatchEffects`."""
        mixer = self.blocks[layer].mixer
        if not isinstance(mixer, ExactPatchEffects):
            return []
        return [mixer_hook(layer, name) for name in mixer.patch_reads()]

    def mixer_backward_patch_effects(
        self, layer: int, patched: RunResid, memo: MixerMemo, first_row: int
    ) -> BackwardPatchEffects | None:
        """Return block `layer`'s `ExactPatchEffects.backward_patch_effects` of a patch of its input
        to `patched` on the base run `memo` is of (rows `first_row` .. of the batch); None where its
        mixer computes the effects after the backward only."""
        mixer = self.blocks[layer].mixer
        if not isinstance(mixer, ExactPatchEffects):
            return None
        return mixer.backward_patch_effects(patched, memo, first_row)

    def mixer_patch_outputs(
        self,
        layer: int,
        patched: RunResid,
        base: Callable[[str], Tensor],
        at: RowInts,
        memo: PatchMemo | None = None,
    ) -> RunResid | None:
        """Return block `layer`'s `ExactPatchEffects.position_patch_outputs` on the base run (its mixer
        input read with `base`): ``[N, T, d_model]``, the change of the mixer's output at ``at[n]``
        when its input at position s alone becomes ``patched[n, s]``; None where the mixer has none
        (`memo` as in `mixer_patch_effects`)."""
        mixer = self.blocks[layer].mixer
        if not isinstance(mixer, ExactPatchEffects):
            return None
        kept = None if memo is None else memo.of_layer(layer)
        return mixer.position_patch_outputs(base(block_hook(layer, "mixer_in")), patched, at, kept)


def _inside_of(layer: int, hook_name: str) -> str | None:
    """Return the short name of the hook inside block `layer`'s mixer that `hook_name` is (``k``,
    as `ExactPatchEffects.patches_exactly` names it), None where the hook is not inside that mixer."""
    parsed = parse_hook(hook_name)
    if parsed is None or parsed.layer != layer or parsed.part != MIXER:
        return None
    return parsed.inside
