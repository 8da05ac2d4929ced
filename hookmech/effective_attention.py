"""Effective attention: each layer's sequence mixing as a matrix over positions, exactly.

Every mixer of hookmech mixes positions by an operator that is linear in some value once the
input has fixed its data-dependent parts (queries, keys, gates, decays). `attention_maps` writes
that operator as M ``[batch, head_or_channel, query_pos, key_pos]``, so that a hook inside the
mixer is M applied to the values over positions: the attention pattern for attention, the
unrolled recurrence for Mamba, Mamba-2, DeltaNet (key removal included) and RWKV, the
normalised kernel for Based, the gated Toeplitz operator for the convolutions. Each mixer's
`effective_attention` docstring says which hook, which values, and what else the hook adds;
this module knows no architecture (docs/guide.md, "Effective attention", lists them all).

`induction_scores` reads Olsson et al. (2022)'s prefix-matching score off M on a random
sequence repeated twice.

The module is named for the operator, not for `attention_maps`: a submodule named like the
function the package exports lazily would replace it as ``hookmech.attention_maps`` once imported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import HookmechError, UsageError
from .hook_names import block_hook
from .mixers.capabilities import EffectiveAttentionMap, require
from .model import check_tokens

SUMMARIES = ("mean", None)
#: the largest per-channel result `attention_maps(summary=None)` returns, in elements
#: (batch · channels · pos²): 256 MiB of float32
MAX_CHANNEL_ELEMENTS = 64 * 2**20


def attention_maps(model, tokens: Tensor, *, summary: str | None = "mean") -> dict[int, Tensor]:
    """Return ``{layer: M}`` for `tokens` ``[batch, pos]``: each M a float32 tensor
    ``[batch, head_or_channel, query_pos, key_pos]``, the layer's `EffectiveAttentionMap.effective_attention`
    of its input (``blocks.{layer}.hook_mixer_in`` of a run on `tokens`).

    Axis 1 is the mixer's `attention_axis`. Heads are always kept. Per-channel operators
    (Mamba, Hyena, BaseConv: one M per channel) are averaged over channels with
    ``summary="mean"`` (axis 1 of size 1) or returned whole with ``summary=None``, which is
    refused above `MAX_CHANNEL_ELEMENTS` elements per layer. Mixers compute M one row at a
    time in that case, so the mean costs one row's per-channel M in memory, not the batch's.
    Hooks attached to the model fire during the run that records the mixer inputs; M itself
    is computed as the mixers run with no hook inside them in use. A mixer without the
    capability (`hookmech.mixers.EffectiveAttentionMap`) is refused, naming it, before anything runs.
    """
    if summary not in SUMMARIES:
        raise UsageError(f"attention_maps: summary must be 'mean' or None, got {summary!r}")
    check_tokens(tokens, model.cfg, "attention_maps")
    mixers = [
        require(block.mixer, EffectiveAttentionMap, f"attention_maps (layer {layer})")
        for layer, block in enumerate(model.blocks)
    ]
    names = [block_hook(layer, "mixer_in") for layer in range(len(model.blocks))]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names, return_cache_object=False)
        return {
            layer: _layer_map(layer, mixer, cache[name], summary)
            for layer, (mixer, name) in enumerate(zip(mixers, names, strict=True))
        }


def _layer_map(layer: int, mixer: EffectiveAttentionMap, x: Tensor, summary: str | None) -> Tensor:
    """Return one layer's M ``[batch, head_or_channel, pos, pos]`` of its mixer input `x`."""
    if mixer.attention_axis != "channel":
        return mixer.effective_attention(x)
    maps: list[Tensor] = []
    for row in x.split(1):
        M = mixer.effective_attention(row)
        if summary is None and not maps:
            _check_size(layer, len(x), M.shape[1], x.shape[1])
        maps.append(M.mean(dim=1, keepdim=True) if summary == "mean" else M)
    return torch.cat(maps)


def _check_size(layer: int, batch: int, channels: int, n_pos: int) -> None:
    """Raise a HookmechError when a layer's per-channel maps would exceed `MAX_CHANNEL_ELEMENTS`."""
    size = batch * channels * n_pos**2
    if size > MAX_CHANNEL_ELEMENTS:
        raise HookmechError(
            f"attention_maps(summary=None): layer {layer} has one map per channel, "
            f"{batch} rows × {channels} channels × {n_pos}² positions = {size:,} elements, "
            f"over the limit of {MAX_CHANNEL_ELEMENTS:,}; pass fewer rows or shorter sequences, "
            "or summary='mean' for the channel mean"
        )


def repeated_tokens(d_vocab: int, seq_len: int, batch: int, seed: int = 0) -> Tensor:
    """Return ``[batch, 2 * seq_len]`` long: per row, `seq_len` distinct tokens drawn uniformly
    from ``range(d_vocab)``, then the same again; deterministic in `seed`. Distinct tokens
    make the previous occurrence of every token in the second half the one seq_len back."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.stack([torch.randperm(d_vocab, generator=generator)[:seq_len] for _ in range(batch)])
    return first.repeat(1, 2)


def prefix_matching(maps: Tensor, seq_len: int) -> Tensor:
    """Return ``[head_or_channel]``: the mean weight that M ``[batch, head_or_channel, 2 seq_len,
    2 seq_len]`` of a sequence repeated twice puts from each query t of the second half on
    key t - seq_len + 1, the token after t's previous occurrence (mean over t and rows)."""
    # the diagonal at offset 1 - seq_len runs from (seq_len - 1, 0); its first entry is a first-half query
    stripe = maps.diagonal(offset=1 - seq_len, dim1=-2, dim2=-1)[..., 1:]  # [batch, h, seq_len]
    return stripe.mean(dim=(0, -1))


def induction_scores(model, *, seq_len: int | None = None, batch: int = 16, seed: int = 0) -> dict[int, Tensor]:
    """Return ``{layer: scores}``, the prefix-matching score (Olsson et al. 2022) of every head,
    ``[head]``, or of the channel mean, ``[1]``, for per-channel mixers (`attention_maps` with
    summary "mean"): the mean weight M puts from each token of the second half of a random
    sequence repeated twice (`repeated_tokens`, tokens of the model's vocabulary, `seed`) on the
    token after its previous occurrence. An ideal induction head scores 1; a uniform causal
    pattern (1 / (t + 1) on every key) scores (1/L) Σ_{t=L..2L-1} 1/(t + 1) with L = seq_len.

    `seq_len` defaults to the longest that fits: min(n_ctx // 2, d_vocab) (tokens in a half are distinct).
    """
    d_vocab, n_ctx = model.cfg.d_vocab, model.cfg.n_ctx
    if seq_len is None:
        seq_len = min(n_ctx // 2, d_vocab)
    if not 2 <= seq_len <= d_vocab or 2 * seq_len > n_ctx:
        raise UsageError(
            f"induction_scores: seq_len must be >= 2, at most d_vocab ({d_vocab}: the tokens of a half are "
            f"distinct) and at most n_ctx / 2 ({n_ctx // 2}: the sequence is repeated), got {seq_len}"
        )
    if batch < 1:
        raise UsageError(f"induction_scores: batch must be >= 1, got {batch}")
    device = next(model.parameters()).device
    tokens = repeated_tokens(d_vocab, seq_len, batch, seed).to(device)
    return {layer: prefix_matching(maps, seq_len) for layer, maps in attention_maps(model, tokens).items()}
