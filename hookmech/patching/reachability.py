"""Which (patch, row) pairs can change the answer at all: a NaN probe, without knowing the
architecture.

Write NaN at the patched places of one representative row per (positions, query position,
length) group and see whether it reaches the query logits. NaN propagates through every
arithmetic dependence (and masked attention scores or untaken `where` branches drop it exactly
where there is none), so a patch whose NaN does not arrive cannot change the answer: those rows
keep the base run's metric. (E.g. a last-layer MLP patched anywhere but at the query.)

The probe is one forward on every position per group, and it only saves patched runs: where
every row is its own group and the patched runs are short windows (long documents whose roles sit
at varied positions, e.g. ATR's), it costs more than all it could skip. It runs only where its
positions are at most `PROBE_SHARE` of the positions the patched runs it can skip would run;
elsewhere every changed row is run (skipping a row that cannot reach the query only saves time:
run or not, its metric is the base run's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import run_chunks
from .plans import TargetPlan, replace_hook
from .protocol import PatchableModel
from .runs import CleanCorruptRuns

#: the probe runs only where its forwards' positions are at most this share of those of the
#: patched runs it could skip (`reaches_query`'s `skippable`)
PROBE_SHARE = 0.25


def reaches_query(
    model: PatchableModel,
    runs: CleanCorruptRuns,
    plans: list[TargetPlan],
    masks: Tensor,
    start: int | None,
    tokens: Tensor,
    resid: Tensor | None,
    max_batch: int,
    changed: Tensor,
    skippable: Tensor,
) -> Tensor:
    """Return ``[P, N]``: True where `changed` ``[P, N]`` and the query logits may depend on the
    patched activations (False: they do not at all).

    `masks` ``[P, N, T]`` are the patches' positions; the probe runs from block `start`'s input
    `resid` (or from `tokens` when `start` is None), `max_batch` rows at a time, on one changed
    pair per group, and only where its positions (groups × T) are at most `PROBE_SHARE` of
    `skippable` ``[P, N]`` summed over the changed pairs (the positions each patched run would
    run); otherwise it returns `changed` itself.
    """
    n_patches, n_rows, n_pos = masks.shape
    device = masks.device
    query, lengths = runs.batch.query_pos.to(device), runs.batch.lengths.to(device)
    items = changed.flatten().nonzero(as_tuple=True)[0]  # the changed (patch, row) pairs, flat
    if len(items) == 0:
        return changed
    group = _group_rows(masks.reshape(-1, n_pos)[items], query[items % n_rows], lengths[items % n_rows])
    n_groups = int(group.max()) + 1
    if n_groups * n_pos > PROBE_SHARE * float(skippable[changed].sum()):
        return changed
    first = torch.full((n_groups,), len(items), device=device).scatter_reduce(
        0, group, torch.arange(len(items), device=device), "amin"
    )
    first = items[first]
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
    result = torch.zeros(n_patches * n_rows, dtype=torch.bool, device=device)
    result[items] = reaches[group]
    return result.view(n_patches, n_rows)


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
