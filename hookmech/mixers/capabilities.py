"""What a sequence mixer may do beyond the core contract: capabilities it opts into.

The core (`hookmech.mixers.base.Mixer`: what it declares of its block, its forward with its hooks,
the resume protocol) is all the backbone, the exact patching engine, AtP and DAS ask of a mixer.
Four more things a mixer can say, each a class it lists after `Mixer` among its bases
(``class Mamba(Mixer, ExactPatchEffects, PathRoutes, EffectiveAttentionMap)``), each asked for
only where it is used:

- `ExactPatchEffects` (AtP*): the exact change of the mixer's output when one position is
  patched. Without it AtP* keeps the first-order estimate through the mixer (plain AtP's there),
  as it does for the patches a mixer with it does not claim (`patches_exactly`).
- `PathRoutes` (path patching, ``--via head|state|conv``): the routes inside the mixer. Without
  it only ``resid`` paths end in the mixer's layer; another route is a usage error naming both.
- `EffectiveAttentionMap` (`hookmech.attention_maps`, `hookmech view`): the mixer's sequence
  operation as a matrix. Without it a map is refused.
- `AttentionWeights` (TransformerLens's ``blocks[l].attn``, ``W_Q`` ... ``OV``, `SVDInterpreter`):
  the heads as TransformerLens's attention heads. Without it those names are refused.

A member of a capability a mixer lacks raises `MissingCapability`, one line naming the mixer and
the capability, wherever it is asked for (`Mixer.__getattr__`); `require` asks first and says
what needed it.

AtP*'s exact computations of one base run share what they compute of it (Mamba's scan of the
base run, for instance) through a typed memo: `PatchMemo` per chunk of rows, a `MixerMemo` per
block's mixer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import torch
from torch import Tensor
from transformer_lens import FactoredMatrix

from ..errors import HookmechError
from ..shapes import Context, EffectiveAttention, Gradients, PositionEffects, Resid, RowInts, RunActs, RunMask, RunResid


class MixerMemo:
    """What one mixer's AtP* computations on one base run keep for each other: its
    `ExactPatchEffects` calls given the same memo are on the same input, and each block of rows
    of it (`row_blocks`) has one tuple of tensors computed by the first call that needs it."""

    def __init__(self) -> None:
        self._by_rows: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        self._given: list[tuple[Tensor, dict[str, Tensor]]] = []
        #: (context, before): the base run equals, before ``before[n]`` of each row n, the run of
        #: this mixer context (`agree`)
        self.agreement: tuple[Context, Tensor] | None = None

    def give(self, mixer_in: Tensor, reads: dict[str, Tensor]) -> None:
        """Keep `reads` ``{short hook name: [N, T, ...]}``: the activations of the mixer's inside
        hooks (`ExactPatchEffects.patch_reads`) on the input `mixer_in` ``[N, T, d_model]``, which
        the caller's runs computed already (the mixer's computations then read them, `given`)."""
        self._given.append((mixer_in, reads))

    def given(self, mixer_in: Tensor) -> dict[str, Tensor] | None:
        """Return the reads kept (`give`) for an input equal to `mixer_in`, None where none is:
        only an input with the same bytes has the same activations."""
        for known, reads in self._given:
            if known is mixer_in or (known.shape == mixer_in.shape and torch.equal(known, mixer_in)):
                return reads
        return None

    def agree(self, context: Context, before: Tensor) -> None:
        """Note that the base run equals, before position ``before[n]`` ``[N]`` of each row n, the
        run whose mixer context (`prefix_context`, ``{name: [N, ...]}``) is `context`: a mixer's
        computations on the base run may start from that context there (AtP*'s corrupt run equals
        the clean run before each row's first corrupted token)."""
        self.agreement = (context, before)

    def of_rows(self, rows: slice, compute: Callable[[], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        """Return what ``compute()`` returns for the rows `rows` of the base run: computed by the
        first call for those rows, kept for the next ones."""
        key = (rows.start, rows.stop)
        if key not in self._by_rows:
            self._by_rows[key] = compute()
        return self._by_rows[key]


class PatchMemo:
    """What AtP*'s exact computations on one chunk of a base run keep for each other: a
    `MixerMemo` per block, made when the block is first asked for (the engine makes one per chunk
    and passes it to every `AtpStarModel` call of that chunk)."""

    def __init__(
        self,
        gifts: Callable[[int], list[tuple[Tensor, dict[str, Tensor]]]] | None = None,
        agreement: Callable[[int], tuple[Context, Tensor] | None] | None = None,
    ) -> None:
        self._by_layer: dict[int, MixerMemo] = {}
        #: ``gifts(layer)``: what a block's memo is given when made (`MixerMemo.give`'s arguments)
        self._gifts = gifts
        #: ``agreement(layer)``: `MixerMemo.agree`'s arguments for a block's memo, or None
        self._agreement = agreement

    def of_layer(self, layer: int) -> MixerMemo:
        """Return the memo of block `layer`'s mixer, given ``gifts(layer)`` when first made."""
        if layer not in self._by_layer:
            memo = MixerMemo()
            for mixer_in, reads in self._gifts(layer) if self._gifts is not None else []:
                memo.give(mixer_in, reads)
            agreement = None if self._agreement is None else self._agreement(layer)
            if agreement is not None:
                memo.agree(*agreement)
            self._by_layer[layer] = memo
        return self._by_layer[layer]

    def forget(self, layer: int) -> None:
        """Drop what block `layer`'s mixer keeps (its computations on the chunk are done): a
        Mamba block keeps its base run's decays and states, ``[n, T, d_inner, d_state]`` twice,
        so every block's together outgrow the memory (12 MB a row a block at Mamba-130m's shape)."""
        self._by_layer.pop(layer, None)


class BackwardPatchEffects(Protocol):
    """`ExactPatchEffects.backward_patch_effects`' recorder."""

    def recording(self) -> AbstractContextManager[None]: ...

    def effects(self) -> PositionEffects | None: ...


class ExactPatchEffects:
    """AtP*'s exact per-position patch effects through the mixer (Kramár et al. 2024, "AtP*", §3.1.1).

    Attribution patching linearises the whole model around the corrupt run. Where the mixer
    itself is strongly nonlinear in one position's input (attention's softmax saturates), AtP*
    asks the mixer for the exact change of its outputs when one position is patched, and
    linearises only what comes after the mixer. A mixer says for which patches it has that
    computation (`patches_exactly`) and computes them (`exact_patch_effects`); optionally its
    output's change at one position per row (`position_patch_outputs`) and its resume context
    made from what its patch computations keep (`patch_context`).
    """

    if TYPE_CHECKING:  # the core member the default `patch_context` reads (`Mixer` defines it)

        def prefix_context(self, x: RunResid) -> Context: ...

    def patches_exactly(self, hook: str | None = None) -> bool:
        """Return True where `exact_patch_effects` computes the patch of the mixer's inside hook
        `hook` (its short name, ``"k"``, as `MixerSpec.meanings` lists it; None: of its input),
        False where AtP* keeps the first-order estimate. AtP* asks before its backward passes, to
        skip the gradients these patches do not need. Default: nowhere."""
        return False

    def patch_reads(self) -> tuple[str, ...]:
        """Return the short names of the inside hooks whose activations on a run's input the
        mixer's patch computations read from their memo where the caller gives them
        (`MixerMemo.give`: AtP* records them in the runs it makes anyway), instead of computing
        them again. Default: none."""
        return ()

    def exact_patch_effects(
        self, x: RunResid, grad_out: Gradients, patched: Tensor, hook: str | None, memo: MixerMemo | None
    ) -> PositionEffects:
        """Return ``[..., N, T]`` (float64): at ``[..., n, s]``, Σ_t (y'_t − y_t) · grad_out[..., n, t],
        where y is the mixer's output on `x` ``[N, T, d_model]`` and y' its output when position s
        alone is patched: its input becomes ``patched[n, s]`` (`hook` None: `patched` is ``[N, T,
        d_model]``), or the activation of its inside hook `hook` becomes ``patched[n, s]``
        (`patched`: that hook's activation shape). `grad_out` ``[..., N, T, d_model]`` is the
        gradient of a metric with respect to the mixer's output (leading axes: several gradients
        at once). Called only where `patches_exactly(hook)`; `memo` as in `position_patch_effects`."""
        raise HookmechError(f"mixer {type(self).__name__} computes no patch exactly")

    def position_patch_effects(
        self,
        x: RunResid,
        grad_out: Gradients,
        patched: Tensor,
        hook: str | None = None,
        memo: MixerMemo | None = None,
    ) -> PositionEffects | None:
        """Return `exact_patch_effects` where `patches_exactly(hook)`, else None (AtP* then keeps
        the first-order estimate there). `memo`: kept by the caller for its calls on the same `x`
        (this method's, `position_patch_outputs`' and `patch_context`'), where the mixer keeps what
        they have in common (what it computes of the base run)."""
        if not self.patches_exactly(hook):
            return None
        return self.exact_patch_effects(x, grad_out, patched, hook, memo)

    def position_patch_outputs(
        self, x: RunResid, patched: RunResid, at: RowInts, memo: MixerMemo | None = None
    ) -> RunResid | None:
        """Return ``[N, T, d_model]``: at ``[n, s]``, y'_{at[n]} − y_{at[n]}, the change of the
        mixer's output at position ``at[n]`` of row n when the input at position s alone becomes
        ``patched[n, s]`` (zeros for s > at[n]; `x`, `patched` ``[N, T, d_model]``). AtP* carries
        it on through the last block exactly (`memo` as in `position_patch_effects`). None where the
        mixer has no such computation (the default): AtP* keeps the linear estimate past it."""
        return None

    def backward_patch_effects(self, patched: RunResid, memo: MixerMemo, first_row: int) -> BackwardPatchEffects | None:
        """Return a recorder that computes `exact_patch_effects` of a patch of the input to
        `patched` ``[N, T, d_model]`` on the base run of `memo` (AtP*'s corrupt run, rows
        `first_row` .. of the batch) while that run's resumed forwards and their backward pass
        run inside its ``recording()``; its ``effects()`` ``[N, T]`` afterwards (None where it
        could not). None (the default): the mixer computes them after the backward only."""
        return None

    def patch_context(self, x: RunResid, memo: MixerMemo) -> Context:
        """Return `prefix_context(x)` for AtP*, which keeps `memo` for its calls on the base run `x`:
        a mixer whose patch computations hold what its context is made of takes it from there.
        Default: `prefix_context(x)`."""
        return self.prefix_context(x)


class PathRoutes:
    """The routes of path patching inside the mixer (`hookmech.patching.path_patch`, docs/guide.md §10).

    A path carries the clean run's value of a sender along one route only, every other quantity
    staying the corrupt run's. Routes through the residual stream need nothing of a mixer; the
    routes inside one are the mixer's to declare and compute. Names are inside hooks without their
    ``hook_`` prefix, as sites spell them (``L1.mixer.q`` -> "q"). A route the mixer declares
    nothing for is refused as a usage error naming it; `state` routes run between the mixer's
    `Mixer.state_hooks`.
    """

    #: `head` senders: inside hooks with a head axis whose value reaches the mixer's output at
    #: its own position only and head by head (attention's z); the rest of the mixer's output
    #: is recomputed from them with every other quantity (gates, norms of other heads) as it was
    head_outputs: ClassVar[tuple[str, ...]] = ()
    #: `head` receivers: inside hooks computed from the mixer's input before positions are
    #: mixed (but for a short convolution or a token shift): attention's q, k, v
    head_inputs: ClassVar[tuple[str, ...]] = ()
    #: the inside hook holding what each position reads out of the state; a `state` path
    #: changes it (`state_path`)
    state_readout: ClassVar[str] = ""

    def conv_hooks(self) -> dict[str, tuple[str, ...]]:
        """Return ``{receiver: senders}`` of this mixer's short causal convolutions (`conv`
        paths): each receiver is the inside hook holding a convolution's output (or what the
        mixer makes of it position by position), with the hooks a sender may name that
        convolution by (its input's hook, where it has one, or the receiver itself).
        Default: ``{}``, no short convolution."""
        return {}

    def state_path(self, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of the `state_readout` hook ``[run, pos, ...]`` along the state
        path: the state each position reads is the corrupt run's plus the clean-minus-corrupt
        writes of the `senders` positions ``[run, pos]``, carried forward by the corrupt run's own
        transitions; the read-out uses the corrupt run's every other quantity. `clean`, `corrupt`
        are the mixer's inputs ``[run, pos, d_model]`` of the two runs. Exactly zero where no
        sender reaches. Default: none (a HookmechError)."""
        raise HookmechError(f"mixer {type(self).__name__} has no recurrent state (no state path)")

    def conv_path(self, receiver: str, clean: RunResid, corrupt: RunResid, senders: RunMask) -> RunActs:
        """Return the change of the inside hook `receiver` (a key of `conv_hooks`) ``[run, pos,
        ...]`` when its short convolution's input at the `senders` positions ``[run, pos]`` is the
        clean run's and everything else the corrupt run's: at position j each sender i with
        0 <= j − i < kernel adds its tap's weight times the input's clean-minus-corrupt change.
        Exactly zero where no tap reaches. Default: none (a HookmechError)."""
        raise HookmechError(f"mixer {type(self).__name__} has no short convolution (no conv path)")


class EffectiveAttentionMap:
    """The mixer's sequence operation as a matrix (`hookmech.attention_maps`).

    Every mixer here mixes positions by an operator that is linear in some "value" once its
    data-dependent parts (queries, keys, gates, decays) are fixed by the input. Written as a
    matrix M over (query, key) positions it is comparable across architectures, exactly.
    """

    #: what axis 1 of `effective_attention` indexes: "head" (one M per head, shared by the
    #: head's value channels) or "channel" (one M per channel: SSMs with per-channel decays,
    #: gated convolutions); `attention_maps(summary="mean")` averages channels, never heads
    attention_axis: ClassVar[str] = "head"

    def effective_attention(self, x: Resid) -> EffectiveAttention:
        """Return M ``[batch, head_or_channel, query_pos, key_pos]`` (float32) for the input
        `x` ``[batch, pos, d_model]``: the mixer's sequence operation as a matrix, such that
        an inside hook (or a product of two) is M applied to values over positions,
        ``Σ_s M[b, h, t, s] value[b, s, h]``; each mixer's docstring names the hook, the values
        and anything the hook adds that is not mixing (a skip D ⊙ u, a bias). Computed as the
        mixer runs with no hook inside it in use. A mixer listing this capability defines it."""
        raise HookmechError(
            f"mixer {type(self).__name__} does not define effective_attention(x), so it has no "
            "effective attention map; implement it (see hookmech/mixers/capabilities.py)"
        )


class AttentionWeights:
    """TransformerLens's attention weights (``model.blocks[l].attn.W_Q`` ..., `hookmech.tl_weights`):
    the mixer's heads are softmax attention heads whose queries, keys and values are affine maps
    of the mixer's input, ``hook_q[b, p, h] = x[b, p] @ W_Q[h] + b_Q[h]``, and whose output is
    ``Σ_h hook_z[b, p, h] @ W_O[h] + b_O``. Its weights are views of the mixer's parameters.
    """

    def attention_weight(self, name: str) -> Tensor:
        """Return TransformerLens's weight `name` (`ATTENTION_WEIGHTS`): ``W_Q``, ``W_K``,
        ``W_V`` ``[n_heads, d_model, d_head]``, ``W_O`` ``[n_heads, d_head, d_model]``, ``b_Q``,
        ``b_K``, ``b_V`` ``[n_heads, d_head]``, ``b_O`` ``[d_model]`` (zeros where the mixer has no
        bias); a NoComponentError where the mixer has no such affine map (a short convolution
        after the projection). A mixer listing this capability defines it."""
        raise HookmechError(f"mixer {type(self).__name__} does not define attention_weight(name)")

    @property
    def OV(self) -> FactoredMatrix:
        """``W_V @ W_O`` per head, ``[n_heads, d_model, d_model]`` (TransformerLens's `FactoredMatrix`)."""
        return FactoredMatrix(self.attention_weight("W_V"), self.attention_weight("W_O"))

    @property
    def QK(self) -> FactoredMatrix:
        """``W_Q @ W_Kᵀ`` per head, ``[n_heads, d_model, d_model]`` (TransformerLens's
        `FactoredMatrix`; without biases, the 1/√d_head scale or rotary embeddings, as TransformerLens's)."""
        return FactoredMatrix(self.attention_weight("W_Q"), self.attention_weight("W_K").transpose(-2, -1))


#: TransformerLens's names of an attention layer's weights (`AttentionWeights.attention_weight`)
ATTENTION_WEIGHTS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")


def _attention_weight_property(name: str) -> property:
    def read(mixer: AttentionWeights) -> Tensor:
        return mixer.attention_weight(name)

    read.__doc__ = f"TransformerLens's {name} of this mixer (`AttentionWeights.attention_weight`)."
    return property(read)


for _name in ATTENTION_WEIGHTS:
    setattr(AttentionWeights, _name, _attention_weight_property(_name))


#: every capability a mixer can opt into
CAPABILITIES: tuple[type, ...] = (ExactPatchEffects, PathRoutes, EffectiveAttentionMap, AttentionWeights)
#: each capability member's name -> its capability (what `Mixer.__getattr__` refuses by name)
CAPABILITY_OF: dict[str, type] = {
    name: capability for capability in CAPABILITIES for name in vars(capability) if not name.startswith("_")
}


class MissingCapability(HookmechError, AttributeError):
    """A member of a capability the mixer does not implement: one line naming the mixer, the
    member and the capability. An AttributeError too, so that ``hasattr`` says False."""


def missing_capability(mixer: object, member: str) -> MissingCapability:
    """Return the `MissingCapability` error for `member` (one of `CAPABILITY_OF`) of `mixer`."""
    capability = CAPABILITY_OF[member]
    return MissingCapability(
        f"mixer {type(mixer).__name__} does not define {member}: it does not implement the capability "
        f"{capability.__name__} (hookmech.mixers.capabilities)"
    )


CapabilityT = TypeVar("CapabilityT")


def require(
    mixer: object, capability: type[CapabilityT], needed_for: str, error: type[HookmechError] = HookmechError
) -> CapabilityT:
    """Return `mixer` when it implements `capability`; else raise `error` (a HookmechError, or a
    UsageError where the user asked for it), one line naming the mixer, the capability and what
    `needed_for` it (``"attention_maps (layer 1)"``)."""
    if isinstance(mixer, capability):
        return mixer
    raise error(
        f"mixer {type(mixer).__name__} does not implement {capability.__name__}, which {needed_for} needs "
        "(a capability a mixer opts into: hookmech/mixers/capabilities.py)"
    )
