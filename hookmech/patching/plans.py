"""What a patch writes, and where: per target, the values patched in (the source run's
activation, or an ablation: zero, the mean over rows, another row's clean activation) and the
base run's activation they replace, with the position and head axes to mask along."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import UsageError
from ..hooks import pos_axis_of
from ..sites import hook_to_site
from .protocol import PatchableModel
from .runs import CleanCorruptRuns
from .targets import Target, head_axis_of


def resample_order(n_rows: int, seed: int) -> Tensor:
    """Return ``[n_rows]``: row i takes row order[i]'s activation, a derangement (one cycle
    through a random order, deterministic in `seed`; the identity when n_rows == 1)."""
    generator = torch.Generator().manual_seed(seed)
    cycle = torch.randperm(n_rows, generator=generator)
    order = torch.empty(n_rows, dtype=torch.long)
    order[cycle] = cycle.roll(-1)
    return order


def patch_mask(mask: Tensor, shape: torch.Size, pos_axis: int, head_axis: int | None, head: int | None) -> Tensor:
    """Return a ``[batch, pos]`` mask (and a head choice) broadcast against an activation of `shape`."""
    view = [1] * len(shape)
    view[0], view[pos_axis] = shape[0], shape[pos_axis]
    full = mask.view(view)
    if head is not None:
        assert head_axis is not None
        heads = torch.zeros(shape[head_axis], dtype=torch.bool, device=mask.device)
        heads[head] = True
        head_view = [1] * len(shape)
        head_view[head_axis] = shape[head_axis]
        full = full & heads.view(head_view)
    return full


@dataclass
class TargetPlan:
    """One target of a patch: its axes, the values patched in and the base run's values."""

    target: Target
    pos_axis: int
    head_axis: int | None
    values: Tensor  # [N, ...] (or broadcastable along rows): what is patched in
    base: Tensor  # [N, ...]: the base run's activation


def plan_target(
    model: PatchableModel,
    runs: CleanCorruptRuns,
    target: Target,
    base: str,
    source: str,
    ablate: str | None,
    ablate_seed: int,
) -> TargetPlan:
    """Return the `TargetPlan` of `target`: the `source` run's activation patched into the `base`
    run, or the ablation `ablate` of the clean run's (zero, mean over rows, resample)."""
    hook = target.hook
    pos_axis = pos_axis_of(model.hook_dict[hook])
    assert pos_axis is not None  # parse_sites refuses hooks without one
    head_axis = None if target.head is None else head_axis_of(model, hook)
    base_acts = runs.acts(hook, base)
    if head_axis is not None and target.head is not None and target.head >= base_acts.shape[head_axis]:
        raise UsageError(f"{hook_to_site(hook)}[{target.head}]: it has {base_acts.shape[head_axis]} heads")
    if ablate is None:
        values = runs.acts(hook, source)
    elif ablate == "zero":
        values = torch.zeros_like(base_acts)
    elif ablate == "resample":
        values = runs.acts(hook, "clean")[resample_order(len(runs.batch), ablate_seed).to(runs.device)]
    elif hook in runs.clean_means:  # the mean over all rows of a cache read in chunks (`chunked.clean_means`)
        values = runs.clean_means[hook].to(base_acts.device, base_acts.dtype).expand_as(base_acts)
    else:
        values = _row_mean(runs.acts(hook, "clean"), runs.batch.lengths.to(runs.device), pos_axis).expand_as(base_acts)
    return TargetPlan(target, pos_axis, head_axis, values, base_acts)


def _row_mean(acts: Tensor, lengths: Tensor, pos_axis: int) -> Tensor:
    """Mean over rows at each position, over the rows long enough to have it: ``[1, ...]``."""
    n_pos = acts.shape[pos_axis]
    valid = torch.arange(n_pos, device=acts.device)[None, :] < lengths[:, None]  # [N, T]
    weights = patch_mask(valid, acts.shape, pos_axis, None, None)
    # where, not multiply: padded positions may hold -inf (masked attention scores), and -inf * 0 is NaN
    total = torch.where(weights, acts, torch.zeros((), dtype=acts.dtype, device=acts.device)).sum(0, keepdim=True)
    return total / weights.to(acts.dtype).sum(0, keepdim=True).clamp(min=1)


def differing_positions(plan: TargetPlan) -> Tensor:
    """Return ``[N, T]``: True where `plan`'s patched-in values differ from the base run's (in
    its head, for a head's target)."""
    differs = plan.values != plan.base
    if plan.head_axis is not None:
        assert plan.target.head is not None
        differs = differs.select(plan.head_axis, plan.target.head).unsqueeze(plan.head_axis)
    return differs.movedim(plan.pos_axis, 1).flatten(2).any(-1)


def changed_rows(plan: TargetPlan, masks: Tensor) -> Tensor:
    """Return ``[P, N]``: True where patching `plan` at the positions of patch p (`masks`
    ``[P, N, T]``) changes row n."""
    return (masks & differing_positions(plan)[None]).any(-1)


def replace_hook(plan: TargetPlan, patch_values: Tensor, mask: Tensor):
    """Return a forward hook putting `patch_values` (rows of a chunk) where `mask` ``[rows, T]`` (and the head) say."""
    full_mask = patch_mask(mask, patch_values.shape, plan.pos_axis, plan.head_axis, plan.target.head)

    def patch_hook(activation: Tensor, hook=None) -> Tensor:
        return torch.where(full_mask, patch_values, activation)

    return patch_hook
