"""Shape aliases of hookmech's public tensors (jaxtyping), shared by every module.

Annotations only: nothing here checks anything when hookmech is used. The test suite checks
them at every call (tests/conftest.py installs jaxtyping's import hook with typeguard), so a
tensor of the wrong rank, dtype kind or size disagreement fails there with a message naming
the parameter, its actual shape and the expected one.

Dimension names (one name is one size within a call):

* ``batch``: the rows of a run; ``pos``: its positions; ``d_model``, ``d_vocab``.
* ``window``: the positions of a resumed window (`HookedLM.resume`, `Mixer.forward_from`),
  whose rows are ``batch``; ``run``: the rows of the run a mixer context was made from
  (`Mixer.prefix_context`), which a window's ``rows`` index.
* ``head_or_channel``: axis 1 of an effective attention map (`EffectiveAttentionMap.attention_axis`).
* ``d``: the width of a flattened activation, ``k`` a subspace's dimension (`hookmech.das`).
* ``...``: any further axes (a hook's own, e.g. ``head d_head``).

`Int` is any integer dtype (the cache stores int32 tokens, runs use int64), `Float` any
floating one (float16/bfloat16/float32/float64).
"""

from __future__ import annotations

from jaxtyping import Bool, Float, Float32, Float64, Int, Shaped
from torch import Tensor

#: token ids ``[batch, pos]`` (a `Batch`'s tokens and corrupt tokens, a model's input)
Tokens = Int[Tensor, "batch pos"]
#: one integer per row ``[batch]``: positions (roles, queries, window starts), row numbers, lengths, answers
RowInts = Int[Tensor, "batch"]
#: one float per row ``[batch]`` (p(answer))
RowFloats = Float[Tensor, "batch"]
#: the residual stream (or a mixer's input or output) ``[batch, pos, d_model]``
Resid = Float[Tensor, "batch pos d_model"]
#: logits at every position ``[batch, pos, d_vocab]``
Logits = Float[Tensor, "batch pos d_vocab"]
#: logits at one position per row (a query) ``[batch, d_vocab]``
QueryLogits = Float[Tensor, "batch d_vocab"]

#: a mixer's input over a whole base run ``[run, pos, d_model]``, of which it makes a `Context`
RunResid = Float[Tensor, "run pos d_model"]
#: what a mixer keeps of a base run for resuming it (`Mixer.prefix_context`): tensors whose first axis is the run's row
Context = dict[str, Shaped[Tensor, "run ..."]]  # noqa: F722 (a jaxtyping shape, not a forward reference)
#: the residual stream (or a mixer's input or output) on a resumed window ``[batch, window, d_model]``
Window = Float[Tensor, "batch window d_model"]
#: the output of a resumed window at one kept position per row ``[batch, 1, d_model]``
KeptWindow = Float[Tensor, "batch 1 d_model"]

#: gradients of a metric with respect to a mixer's output over a base run, several at once ``[..., run, pos, d_model]``
Gradients = Float[Tensor, "*variant run pos d_model"]
#: one float64 value per (gradient,) row and position ``[..., run, pos]``: a patch's effect at each position
PositionEffects = Float64[Tensor, "*variant run pos"]

#: a mixer's sequence operation as a matrix over (query, key) positions ``[batch, head_or_channel, pos, pos]``
EffectiveAttention = Float32[Tensor, "batch head_or_channel pos pos"]

#: positions of each row of a base run ``[run, pos]`` (True where a path patch's sender sits, `PathRoutes.state_path`)
RunMask = Bool[Tensor, "run pos"]
#: a hook's activations over a whole base run ``[run, pos, ...]`` (what a path changes, `PathRoutes.state_path`)
RunActs = Float[Tensor, "run pos ..."]

#: cached activations of a hook ``[batch, pos, ...]`` (`CacheFile.read`)
Acts = Float[Tensor, "batch pos ..."]
#: cached activations of a hook at one position per row ``[batch, ...]`` (`CacheFile.at`, `CacheFile.gather`)
ActsAt = Float[Tensor, "batch ..."]

#: what each head of a mixer writes into the residual stream ``[batch, pos, head, d_model]``
#: (`Block.head_results`, TransformerLens's ``attn.hook_result``)
HeadResults = Float[Tensor, "batch pos head d_model"]

#: activations at one position per row, flattened ``[batch, d]`` (`hookmech.das`)
Flat = Float[Tensor, "batch d"]
#: an orthonormal basis of a subspace of flattened activations ``[d, k]`` (`hookmech.das`)
Basis = Float[Tensor, "d k"]

__all__ = [
    "Acts",
    "ActsAt",
    "Basis",
    "Context",
    "EffectiveAttention",
    "Flat",
    "Gradients",
    "HeadResults",
    "KeptWindow",
    "Logits",
    "PositionEffects",
    "QueryLogits",
    "Resid",
    "RowFloats",
    "RowInts",
    "RunActs",
    "RunMask",
    "RunResid",
    "Tokens",
    "Window",
]
