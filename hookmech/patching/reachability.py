"""Which (patch, row) pairs can change the answer at all: a NaN probe, without knowing the
architecture.

Write NaN at the patched places of one representative row per (positions, query position,
length) group and see whether it reaches the query logits. NaN propagates through every
arithmetic dependence (and masked attention scores or untaken `where` branches drop it exactly
where there is none), so a patch whose NaN does not arrive cannot change the answer: those rows
keep the base run's metric. (E.g. a last-layer MLP patched anywhere but at the query.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import run_chunks
from .plans import TargetPlan, replace_hook
from .protocol import PatchableModel
from .runs import CleanCorruptRuns


def reaches_query(
    model: PatchableModel,
    runs: CleanCorruptRuns,
    plans: list[TargetPlan],
    masks: Tensor,
    start: int | None,
    tokens: Tensor,
    resid: Tensor | None,
    max_batch: int,
) -> Tensor:
    """Return ``[P, N]``: True where the query logits depend on the patched activations at all.

    `masks` ``[P, N, T]`` are the patches' positions; the probe runs from block `start`'s input
    `resid` (or from `tokens` when `start` is None), `max_batch` rows at a time.
    """
    n_patches, n_rows, n_pos = masks.shape
    device = masks.device
    query, lengths = runs.batch.query_pos.to(device), runs.batch.lengths.to(device)
    group = _group_rows(masks.reshape(-1, n_pos), query.repeat(n_patches), lengths.repeat(n_patches))
    n_groups = int(group.max()) + 1
    items = torch.arange(len(group), device=device)
    first = torch.full((n_groups,), len(group), device=device).scatter_reduce(0, group, items, "amin")
    reaches = torch.empty(n_groups, dtype=torch.bool, device=device)
    for chunk in run_chunks(n_groups, max_batch):
        which = first[chunk]
        rows, chunk_mask = which % n_rows, masks.reshape(-1, n_pos)[which]
        fwd_hooks = []
        for plan in plans:
            nan = torch.full_like(plan.base[rows], float("nan"))
            fwd_hooks.append((plan.target.hook, replace_hook(plan, nan, chunk_mask)))
        model_input = tokens[rows.cpu()].to(device) if resid is None else resid[rows]
        logits = model.run_with_hooks(
            model_input, start_at_layer=start, positions=query[rows], tail_at_positions=True, fwd_hooks=fwd_hooks
        )
        reaches[chunk] = ~logits.isfinite().all(dim=-1)
    return reaches[group].view(n_patches, n_rows)


def _group_rows(masks: Tensor, query: Tensor, lengths: Tensor) -> Tensor:
    """Return ``[M]``, the group index of each (mask ``[M, T]``, query, length) triple: equal triples, equal index."""
    n_pos = masks.shape[1]
    if n_pos > 62:
        keys = torch.cat([masks.long(), query[:, None], lengths[:, None]], dim=1)
        return torch.unique(keys, dim=0, return_inverse=True)[1]
    # 1-D keys: torch.unique over rows (dim=0) is an order of magnitude slower
    bits = 1 << torch.arange(n_pos, device=masks.device)
    _, mask_id = torch.unique((masks.long() * bits).sum(-1), return_inverse=True)
    return torch.unique((mask_id * (n_pos + 1) + query) * (n_pos + 1) + lengths, return_inverse=True)[1]
