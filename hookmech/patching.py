"""Interchange interventions (activation patching) and the attribution score (design.md §7).

For each (site, position): run the **corrupt** input, replace the site's activation at the
position by the **clean** run's activation there, and read p(answer) at the query. Over the
N rows,

    attribution = (mean p_patched − mean p_corrupt) / (mean p_clean − mean p_corrupt)

The engine speaks hook names and positions only. It reads clean activations from a cache
when one is given, resumes a patch at block l from the corrupt run's residual entering
block l (the layers below are untouched by the patch), and stacks many patches into one
batched forward.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .cache import CacheFile, answer_probs, run_chunks
from .errors import HookmechError, UsageError
from .hooks import pos_axis_of
from .sites import PositionPatch, hook_to_site, position_patches, resolve_sites
from .tasks.batch import Batch

METHODS = ("exact",)


def attribution_score(p_clean: float, p_corrupt: float, p_patched: float) -> float | None:
    """Return (p_patched − p_corrupt) / (p_clean − p_corrupt), or None when p_clean == p_corrupt."""
    denominator = p_clean - p_corrupt
    if denominator == 0:
        return None
    return (p_patched - p_corrupt) / denominator


def broadcast_mask(mask: Tensor, shape: torch.Size, pos_axis: int) -> Tensor:
    """Reshape a ``[batch, pos]`` mask to broadcast against an activation of `shape`
    whose batch axis is 0 and position axis is `pos_axis`."""
    view = [1] * len(shape)
    view[0], view[pos_axis] = shape[0], shape[pos_axis]
    return mask.view(view)


def replace_at(activation: Tensor, clean: Tensor, mask: Tensor, pos_axis: int) -> Tensor:
    """Return `activation` with the masked positions taken from `clean` (same shape)."""
    return torch.where(broadcast_mask(mask, activation.shape, pos_axis), clean, activation)


@dataclass
class _Source:
    """Where clean activations, corrupt residuals and p(answer) come from."""

    batch: Batch
    p_clean: Tensor
    p_corrupt: Tensor
    read_clean: Callable[[str, slice], Tensor]
    read_corrupt_resid: Callable[[int, slice], Tensor | None]


def _source_from_batch(model, batch: Batch, hooks: Sequence[str], layers: set[int], max_batch: int) -> _Source:
    """Run clean and corrupt once, keeping the patched hooks (clean) and the residuals
    entering each patched layer (corrupt)."""
    device = next(model.parameters()).device
    resid_hooks = [f"blocks.{layer}.hook_resid_pre" for layer in sorted(layers)]
    clean: dict[str, list[Tensor]] = {hook: [] for hook in hooks}
    corrupt: dict[str, list[Tensor]] = {hook: [] for hook in resid_hooks}
    p_clean, p_corrupt = [], []
    for rows in run_chunks(len(batch), max_batch):
        query = batch.query_pos[rows].to(device)
        answers = batch.answers[rows].to(device)
        logits, acts = model.run_with_cache(batch.tokens[rows].to(device), names_filter=list(hooks),
                                            return_cache_object=False, positions=query)
        p_clean.append(answer_probs(logits, answers))
        for hook in hooks:
            clean[hook].append(acts[hook])
        logits, acts = model.run_with_cache(batch.corrupt_tokens[rows].to(device), names_filter=resid_hooks,
                                            return_cache_object=False, positions=query)
        p_corrupt.append(answer_probs(logits, answers))
        for hook in resid_hooks:
            corrupt[hook].append(acts[hook])
    clean_all = {hook: torch.cat(parts) for hook, parts in clean.items()}
    corrupt_all = {hook: torch.cat(parts) for hook, parts in corrupt.items()}
    return _Source(
        batch=batch,
        p_clean=torch.cat(p_clean).cpu(),
        p_corrupt=torch.cat(p_corrupt).cpu(),
        read_clean=lambda hook, rows: clean_all[hook][rows],
        read_corrupt_resid=lambda layer, rows: corrupt_all[f"blocks.{layer}.hook_resid_pre"][rows],
    )


def _source_from_cache(model, cache: CacheFile, hooks: Sequence[str], layers: set[int], max_batch: int) -> _Source:
    """Read what the cache holds; compute (once) what it lacks."""
    batch = cache.batch()
    missing = [hook for hook in hooks if not cache.has(hook, "clean")]
    missing_layers = {layer for layer in layers if not cache.has(f"blocks.{layer}.hook_resid_pre", "corrupt")}
    computed = _source_from_batch(model, batch, missing, missing_layers, max_batch) if (missing or missing_layers) else None
    device = next(model.parameters()).device

    def read_clean(hook: str, rows: slice) -> Tensor:
        if hook in missing:
            return computed.read_clean(hook, rows)
        return cache.read(hook, "clean", rows).to(device)

    def read_corrupt_resid(layer: int, rows: slice) -> Tensor:
        if layer in missing_layers:
            return computed.read_corrupt_resid(layer, rows)
        return cache.read(f"blocks.{layer}.hook_resid_pre", "corrupt", rows).to(device)

    return _Source(batch, cache.p_answer("clean"), cache.p_answer("corrupt"), read_clean, read_corrupt_resid)


@torch.no_grad()
def _patched_probs(model, source: _Source, hook: str, patches: list[PositionPatch], max_batch: int) -> Tensor:
    """Return p(answer) ``[len(patches), N]`` with `hook` patched clean at each patch's mask."""
    batch, device = source.batch, next(model.parameters()).device
    n_rows = len(batch)
    layer = model.layer_of_hook(hook)
    pos_axis = pos_axis_of(model.hook_dict[hook])
    if pos_axis is None:
        raise UsageError(f"{hook_to_site(hook)} has no position axis: it cannot be patched at a position")
    masks = torch.stack([patch.mask for patch in patches]).to(device)  # [P, N, T]
    probs = torch.empty(len(patches), n_rows)
    rows_per_forward = max(1, max_batch // len(patches))
    for rows in run_chunks(n_rows, rows_per_forward):
        n_chunk = rows.stop - rows.start
        clean = source.read_clean(hook, rows).to(device)
        clean = clean.repeat(len(patches), *[1] * (clean.dim() - 1))       # [P*n, ...]
        mask = masks[:, rows].reshape(len(patches) * n_chunk, -1)           # [P*n, T]

        def patch_hook(activation: Tensor, hook=None) -> Tensor:
            return replace_at(activation, clean, mask, pos_axis)

        query = batch.query_pos[rows].to(device).repeat(len(patches))
        if layer is None:
            model_input, start = batch.corrupt_tokens[rows].to(device).repeat(len(patches), 1), None
        else:
            resid = source.read_corrupt_resid(layer, rows).to(device)
            model_input, start = resid.repeat(len(patches), 1, 1), layer
        logits = model.run_with_hooks(model_input, start_at_layer=start, positions=query,
                                      fwd_hooks=[(hook, patch_hook)])
        answers = batch.answers[rows].to(device).repeat(len(patches))
        probs[:, rows] = answer_probs(logits, answers).view(len(patches), n_chunk).cpu()
    return probs


def patch(
    model,
    source: Batch | CacheFile | str | Path,
    sites: Iterable[str],
    positions: Iterable[str],
    method: str = "exact",
    threshold: float = 0.01,
    max_batch: int = 1024,
    per_example: bool = False,
) -> list[dict[str, Any]]:
    """Patch every (site, position) from clean into corrupt and score it.

    `source` is a `Batch` (clean and corrupt runs are computed) or an activation cache
    (path or open `CacheFile`: clean activations and corrupt residuals are read from it).
    `sites` are site names or patterns (`sites.resolve_sites`), `positions` position specs
    (`sites.position_patches`). Returns one record per (site, position):
    ``site, hook, pos, attribution, p_clean, p_corrupt, p_patched, n, passes_filter, method``
    (plus ``p_patched_rows`` ``[N]`` lists when `per_example`).
    """
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r} (available: {', '.join(METHODS)})")
    if max_batch < 1:
        raise UsageError(f"max_batch must be >= 1, got {max_batch}")
    hooks = resolve_sites(list(sites), model.hook_dict)
    layers = {layer for layer in map(model.layer_of_hook, hooks) if layer is not None}
    positions = list(positions)
    was_training = model.training
    model.eval()
    try:
        if isinstance(source, (str, Path)):
            with CacheFile(source) as cache:
                return _patch_from(model, _source_from_cache(model, cache, hooks, layers, max_batch),
                                   hooks, positions, method, threshold, max_batch, per_example)
        if isinstance(source, CacheFile):
            src = _source_from_cache(model, source, hooks, layers, max_batch)
        elif isinstance(source, Batch):
            src = _source_from_batch(model, source, hooks, layers, max_batch)
        else:
            raise HookmechError(f"patch source must be a Batch or a cache file, got {type(source).__name__}")
        return _patch_from(model, src, hooks, positions, method, threshold, max_batch, per_example)
    finally:
        model.train(was_training)


def _patch_from(model, src: _Source, hooks, positions, method, threshold, max_batch, per_example) -> list[dict]:
    batch = src.batch
    patches = position_patches(positions, batch.roles, batch.lengths, batch.tokens.shape[1])
    p_clean, p_corrupt = src.p_clean.double().mean().item(), src.p_corrupt.double().mean().item()
    records = []
    for hook in hooks:
        probs = _patched_probs(model, src, hook, patches, max_batch)
        for patch_spec, row_probs in zip(patches, probs):
            p_patched = row_probs.double().mean().item()
            record = {
                "site": hook_to_site(hook),
                "hook": hook,
                "pos": patch_spec.label,
                "attribution": attribution_score(p_clean, p_corrupt, p_patched),
                "p_clean": p_clean,
                "p_corrupt": p_corrupt,
                "p_patched": p_patched,
                "n": len(batch),
                "passes_filter": bool(p_clean - p_corrupt > threshold),
                "method": method,
            }
            if per_example:
                record["p_patched_rows"] = row_probs.tolist()
            records.append(record)
    return records
