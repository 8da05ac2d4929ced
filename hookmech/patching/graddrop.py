"""AtP*'s backward passes over one forward: all paths, and GradDrop's (Kramár et al. 2024, §3.1.2).

GradDrop's pass for layer ℓ drops the gradient that flows from ℓ's sublayers (mixer, MLP) back
into the residual stream. Run as the paper describes, one backward pass from the metric per
layer with those paths gated, each pass costs a whole backward. It need not: dropping layer ℓ
changes no gradient above block ℓ, and below it only through what enters the residual stream
at ℓ, the skip connection's share of the gradient g*_ℓ at block ℓ's output. So pass ℓ's
gradient at a hook is

* above block ℓ (later blocks, the final norm) and in ℓ's MLP (its input and output, downstream
  of the dropped path): the full pass's;
* at ℓ's residual stream (resid_pre, resid_mid, resid_post) and its mixer's output: g*_ℓ;
* at ℓ's mixer input and inside the mixer: one backward from the mixer's output with g*_ℓ,
  through that mixer alone;
* below ℓ (earlier blocks, the embeddings): one backward from the residual entering ℓ with g*_ℓ.

g*_ℓ is the full pass's gradient at the residual entering block ℓ + 1, or for the last block the
gradient at the final norm's input, from the final norm and the unembedding alone. A backward
pass also runs only as far down as the hooks asked for reach: AtP* asks for each mixer's output
and the hooks it estimates linearly, not for the hooks whose patches it computes exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..errors import HookmechError
from ..hook_names import MIXER as MIXER_SUBLAYER
from ..hook_names import MLP as MLP_SUBLAYER
from ..hook_names import RESIDUAL_PARTS, block_hook, parse_hook, sublayer_of
from .protocol import PatchableModel

#: where a hook lies relative to a GradDrop layer, as its gradient is found (module docstring)
FULL, SKIP, MIXER, BELOW = "full", "skip", "mixer", "below"


def relative_place(model: PatchableModel, hook: str, layer: int) -> str:
    """Return where `hook` lies relative to block `layer`: FULL (above it, or in its MLP), SKIP (its
    residual stream or mixer output), MIXER (its mixer's input or inside the mixer) or BELOW."""
    inside = model.layer_of_hook(hook)
    if inside is None:  # the final norm is above every block, the embeddings below
        return FULL if model.resume_layer(hook) == model.cfg.n_layers else BELOW
    if inside != layer:
        return FULL if inside > layer else BELOW
    parsed = parse_hook(hook)
    place = None if parsed is None else _place_in_block(parsed.part)
    if place is not None:
        return place
    raise HookmechError(f"GradDrop cannot place hook {hook!r} in block {layer}")


def _place_in_block(part: str) -> str | None:
    """Where the hooks of block part `part` (`hookmech.hook_names.BLOCK_PARTS`, or a sublayer for
    the hooks inside it) lie relative to their own block's GradDrop pass: the residual stream and
    the mixer's output take the skip connection's gradient (SKIP); the mixer's input and inside
    the mixer lie below the mixer's output (MIXER); the MLP is downstream of the dropped path (FULL)."""
    if part in RESIDUAL_PARTS or part == "mixer_out":
        return SKIP
    sublayer = sublayer_of(part)
    if sublayer == MIXER_SUBLAYER:
        return MIXER
    if sublayer == MLP_SUBLAYER:
        return FULL
    return None


class GradientPasses:
    """The gradients of one forward's `objective` (a scalar) at its hooks, for the full backward
    pass (variant None) and GradDrop's pass of each layer in `dropped` (variant ℓ).

    `leaves`: ``{hook: zero tensor added to the hook's activation}``, whose gradient is the
    objective's with respect to that activation. `outputs`: the tensors the forward's hooks
    returned, for ``blocks.{ℓ}.hook_resid_pre`` and ``blocks.{ℓ}.hook_mixer_out`` of each dropped
    ℓ and ``blocks.{ℓ+1}.hook_resid_pre`` below the last block. `final_gradient()`: ``[n, 1,
    d_model]`` the objective's gradient at the final norm's input at `query` ``[n]``, each row's
    position (called only when the last block is dropped)."""

    def __init__(
        self,
        model: PatchableModel,
        objective: Tensor,
        leaves: dict[str, Tensor],
        outputs: dict[str, Tensor],
        dropped: Sequence[int],
        final_gradient: Callable[[], Tensor],
        query: Tensor,
    ):
        self.model, self.objective, self.leaves, self.outputs = model, objective, leaves, outputs
        self.dropped, self.final_gradient, self.query = list(dropped), final_gradient, query

    def gradients(self, hooks: Sequence[str]) -> dict[int | None, dict[str, Tensor]]:
        """Return ``{variant: {hook: gradient}}`` for the hooks `hooks` (each gradient the shape of the
        hook's activation, zeros where the objective does not depend on it), variant None the
        full pass and ℓ GradDrop's pass of layer ℓ. Keeps the forward's graph for later calls."""
        n_layers = self.model.cfg.n_layers
        entering = [block_hook(layer + 1, "resid_pre") for layer in self.dropped if layer + 1 < n_layers]
        found = self._backward(
            self.objective, None, [self.leaves[hook] for hook in hooks] + [self.outputs[name] for name in entering]
        )
        full = dict(zip(hooks, found[: len(hooks)], strict=True))
        after = dict(zip(entering, found[len(hooks) :], strict=True))
        grads: dict[int | None, dict[str, Tensor]] = {None: full}
        for layer in self.dropped:
            g_star = self.final_gradient() if layer + 1 == n_layers else after[block_hook(layer + 1, "resid_pre")]
            grads[layer] = self._dropped(layer, g_star, hooks, full)
        return grads

    def _dropped(self, layer: int, g_star: Tensor, hooks: Sequence[str], full: dict[str, Tensor]) -> dict[str, Tensor]:
        """GradDrop's pass of `layer` at `hooks` (module docstring), `g_star` the full gradient at
        the block's output ``[n, T or 1, d_model]``."""
        places = {hook: relative_place(self.model, hook, layer) for hook in hooks}
        grads = {hook: full[hook] for hook in hooks if places[hook] == FULL}
        grads.update({hook: self._spread(g_star, self.leaves[hook]) for hook in hooks if places[hook] == SKIP})
        for place, start in ((MIXER, "mixer_out"), (BELOW, "resid_pre")):
            asked = [hook for hook in hooks if places[hook] == place]
            if asked:
                output = self.outputs[block_hook(layer, start)]
                found = self._backward(output, self._spread(g_star, output), [self.leaves[hook] for hook in asked])
                grads.update(zip(asked, found, strict=True))
        return {hook: grads[hook] for hook in hooks}

    def _backward(self, output: Tensor, seed: Tensor | None, inputs: list[Tensor]) -> list[Tensor]:
        """Gradients of `output` (along `seed`; None: a scalar) at `inputs`, zeros where unused."""
        found = torch.autograd.grad(output, inputs, grad_outputs=seed, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(tensor) if grad is None else grad for tensor, grad in zip(inputs, found, strict=True)]

    def _spread(self, g_star: Tensor, like: Tensor) -> Tensor:
        """`g_star` ``[n, W, d_model]`` in the shape of `like` ``[n, T, d_model]``: as it is where W = T;
        where W = 1 (the last block after its mixer ran at the query alone) at each row's query,
        zeros elsewhere (only the query's residual reaches the logits there)."""
        if g_star.shape == like.shape:
            return g_star
        spread = torch.zeros_like(like)
        spread[torch.arange(len(like), device=like.device), self.query] = g_star[:, 0]
        return spread
