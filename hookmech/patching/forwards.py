"""The patched forwards: (patch, row) pairs stacked into batches of at most `max_batch` rows,
run either from the input of the first patched block on every position (`full_pairs`), or
resumed from the patched position to the query on a window of positions (`resumed_pairs`,
the resume protocol: docs/guide.md §6, docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache import run_chunks
from ..hook_names import block_hook
from ..mixers.base import window_index, window_of
from .plans import TargetPlan, patch_mask, replace_hook
from .protocol import PatchableModel
from .runs import CleanCorruptRuns
from .targets import PatchSite

#: what both forwards yield per chunk: (patch index ``[k]``, row ``[k]``, query logits ``[k, d_vocab]``)
Pairs = Iterator[tuple[Tensor, Tensor, Tensor]]


def start_layer(model: PatchableModel, site: PatchSite) -> int | None:
    """Return the first block a full patched run of `site` must run (its lowest patched block),
    or None when a target is outside the blocks (embeddings: the run starts from the tokens)."""
    layers = [model.layer_of_hook(target.hook) for target in site.targets]
    return None if None in layers else min(layer for layer in layers if layer is not None)


def resume_layer(model: PatchableModel, site: PatchSite) -> int | None:
    """Return the block a resumed run of `site` starts at, or None when a target is a hook that a
    resumed run does not fire (`PatchableModel.resume_layer`)."""
    layers = [model.resume_layer(target.hook) for target in site.targets]
    return None if None in layers else min(layer for layer in layers if layer is not None)


def hooks_to_start(model: PatchableModel, patch_sites: list[PatchSite]) -> list[str]:
    """Return the hooks whose base-run values the patched runs start from: the residual entering
    the first patched block, and, for resumed runs, every later block's mixer input (its context)."""
    hooks = []
    for site in patch_sites:
        resume_at = resume_layer(model, site)
        if resume_at is not None:
            hooks.append(model.resid_hook(resume_at))
            hooks.extend(block_hook(layer, "mixer_in") for layer in range(resume_at, model.cfg.n_layers))
            continue
        start = start_layer(model, site)
        if start is not None:
            hooks.append(block_hook(start, "resid_pre"))
    return list(dict.fromkeys(hooks))


def full_pairs(
    model: PatchableModel,
    runs: CleanCorruptRuns,
    plans: list[TargetPlan],
    masks: Tensor,
    patch_index: Tensor,
    row_index: Tensor,
    start: int | None,
    tokens: Tensor,
    resid: Tensor | None,
    max_batch: int,
) -> Pairs:
    """Yield (patch index, row, query logits) of (patch, row) pairs run from block `start`'s
    input `resid` (or from `tokens` when `start` is None) on every position."""
    batch, device = runs.batch, runs.device
    for chunk in run_chunks(len(row_index), max_batch):
        which_patch, rows = patch_index[chunk], row_index[chunk]
        chunk_mask = masks[which_patch, rows]  # [k, T]
        fwd_hooks = [(plan.target.hook, replace_hook(plan, plan.values[rows], chunk_mask)) for plan in plans]
        model_input = tokens[rows.cpu()].to(device) if resid is None else resid[rows]
        logits = model.run_with_hooks(
            model_input,
            start_at_layer=start,
            positions=batch.query_pos[rows.cpu()].to(device),
            tail_at_positions=True,
            fwd_hooks=fwd_hooks,
        )
        yield which_patch, rows, logits


def resumed_pairs(
    model: PatchableModel,
    runs: CleanCorruptRuns,
    plans: list[TargetPlan],
    masks: Tensor,
    patch_index: Tensor,
    row_index: Tensor,
    layer: int,
    contexts: dict[int, dict[str, Tensor]],
    base: str,
    max_batch: int,
) -> Pairs:
    """Yield (patch index, row, query logits) of (patch, row) pairs, each re-run only on the
    positions from its first patched one to its query (`PatchableModel.resume`).

    Pairs are sorted by that width and chunked where it grows (`width_chunks`), so that a chunk's
    common window (`resume_window`) wastes little. A large LM head (`gathers_head`) runs once
    on several chunks' query rows, at most `max_batch` of them (`unembedded_in_groups`).
    """
    resid = runs.acts(model.resid_hook(layer), base)
    if not gathers_head(model.cfg.d_vocab, resid):
        yield from _resumed_chunks(model, runs, plans, masks, patch_index, row_index, layer, contexts, resid, max_batch)
        return
    chunks = _resumed_chunks(
        model, runs, plans, masks, patch_index, row_index, layer, contexts, resid, max_batch, unembed=False
    )
    yield from unembedded_in_groups(model, chunks, max_batch)


def _resumed_chunks(
    model: PatchableModel,
    runs: CleanCorruptRuns,
    plans: list[TargetPlan],
    masks: Tensor,
    patch_index: Tensor,
    row_index: Tensor,
    layer: int,
    contexts: dict[int, dict[str, Tensor]],
    resid: Tensor,
    max_batch: int,
    unembed: bool = True,
) -> Pairs:
    """Yield `resumed_pairs`' chunks from the base run's residual entering block `layer`,
    `resid` ``[N, T, d_model]``: (patch index, row, query logits), or with `unembed` False the
    final-normed residual at the query ``[k, d_model]`` in place of the logits."""
    query = runs.batch.query_pos.to(runs.device)
    first = masks[patch_index, row_index].int().argmax(dim=-1)
    widths = window_widths(first, query[row_index])
    order = torch.sort(widths, stable=True).indices
    patchers = [WindowPatch(plan) for plan in plans]
    n_pos = masks.shape[-1]
    # hooks are installed once and pointed at each chunk: adding and removing them per chunk
    # walks every hook point of the model each time
    with model.hooks(fwd_hooks=[(patcher.plan.target.hook, patcher) for patcher in patchers]):
        for chunk in width_chunks(widths[order].tolist(), max_batch, waste_floor(resid.shape[-1])):
            pairs = order[chunk]
            which_patch, rows = patch_index[pairs], row_index[pairs]
            width, start = resume_window(widths[pairs], query[rows])
            every = torch.arange(n_pos, device=rows.device).expand(len(rows), n_pos)  # a mixer firing on the whole run
            for patcher in patchers:
                patcher.point_at(rows, masks[which_patch, rows], (window_index(start, width), query[rows, None], every))
            resid_window = window_of(resid, rows, start, width)  # not whole rows: windows are short
            out = model.resume(resid_window, layer, contexts, rows, start, query[rows], unembed=unembed)
            yield which_patch, rows, out


@dataclass(eq=False)
class ResumedSite:
    """One site's changed (patch, row) pairs, each resumed from block `layer` (`joined_pairs`):
    its targets' `plans`, its patches' `masks` ``[P, N, T]``, and the pairs' patch index and
    row ``[K]``."""

    plans: list[TargetPlan]
    masks: Tensor
    patch_index: Tensor
    row_index: Tensor
    layer: int


#: the most positions (rows x window) a chunk of `joined_pairs` computes
JOINED_POSITIONS = 1024
#: a model at least this wide resumes several sites' pairs in one forward (`joins_sites`)
JOIN_WIDTH = 256


def joins_sites(d_model: int) -> bool:
    """Return whether a model of residual width `d_model` resumes several sites' pairs together
    (`joined_pairs`). At Pythia-160m's 768 a block's weights are 28 MB, and its products over a
    site's few rows (a query cell: 8 rows of one position) read them from memory for little work
    (bench/pretrained_engine.py); at the CPU fixtures' 64 they fit in cache, and each site keeps its
    own forwards and their roundings."""
    return d_model >= JOIN_WIDTH


def joined_pairs(
    model: PatchableModel,
    runs: CleanCorruptRuns,
    sites: Sequence[ResumedSite],
    contexts: dict[int, dict[str, Tensor]],
    base: str,
    max_batch: int,
) -> Pairs:
    """Yield (pair, row, query logits) of the pairs of every site of `sites`, resumed together:
    ``pair`` ``[k]`` indexes the sites' pairs laid end to end. The pairs of all sites are chunked
    by window width as `resumed_pairs` chunks one site's; in a chunk, each pair joins the forward
    at its own site's block (`PatchableModel.resume`'s `joining`), so a block's products run on
    the rows of every site at or below it. `contexts`: the base run's, from the lowest site's block."""
    n_layers = model.cfg.n_layers
    query = runs.batch.query_pos.to(runs.device)
    site_of = torch.cat([torch.full_like(site.row_index, i) for i, site in enumerate(sites)])
    layer_of = torch.tensor([site.layer for site in sites], device=site_of.device)[site_of]
    patch_index = torch.cat([site.patch_index for site in sites])
    row_index = torch.cat([site.row_index for site in sites])
    first = torch.cat([site.masks[site.patch_index, site.row_index].int().argmax(dim=-1) for site in sites])
    widths = window_widths(first, query[row_index])
    order = torch.sort(widths, stable=True).indices
    resids = {layer: runs.acts(model.resid_hook(layer), base) for layer in sorted({site.layer for site in sites})}
    patchers = [[WindowPatch(plan) for plan in site.plans] for site in sites]
    n_pos, floor = sites[0].masks.shape[-1], waste_floor(runs.acts(model.resid_hook(sites[0].layer), base).shape[-1])
    with model.hooks(fwd_hooks=[(p.plan.target.hook, p) for site_patchers in patchers for p in site_patchers]):
        for chunk in width_chunks(widths[order].tolist(), max_batch, floor, JOINED_POSITIONS):
            pairs = order[chunk]
            # by block, then by site: the rows a block runs are the chunk's first ones
            pairs = pairs[torch.sort(layer_of[pairs] * len(sites) + site_of[pairs], stable=True).indices]
            rows = row_index[pairs]
            width, start = resume_window(widths[pairs], query[rows])
            every = torch.arange(n_pos, device=rows.device).expand(len(rows), n_pos)
            windows = (window_index(start, width), query[rows, None], every)
            for i, site in enumerate(sites):
                span = _span(site_of[pairs] == i)
                mask = site.masks[patch_index[pairs[span]], rows[span]]
                for patcher in patchers[i]:
                    patcher.point_at(rows[span], mask, tuple(positions[span] for positions in windows), span)
            entering = {layer: layer_of[pairs] == layer for layer in resids}
            resid = torch.cat([window_of(resids[layer], rows[at], start[at], width) for layer, at in entering.items()])
            first_block = int(layer_of[pairs[0]])
            joining = [int((layer_of[pairs] <= layer).sum()) for layer in range(first_block, n_layers)]
            out = model.resume(resid, first_block, contexts, rows, start, query[rows], unembed=False, joining=joining)
            yield pairs, rows, out


def _span(members: Tensor) -> slice:
    """Return the slice of the True entries of `members` ``[k]``, which are consecutive (empty: 0:0)."""
    at = members.nonzero()[:, 0]
    return slice(int(at[0]), int(at[-1]) + 1) if len(at) else slice(0, 0)


#: an LM head whose weight is larger than this (bytes) unembeds several chunks' rows at once
#: (`gathers_head`): one matrix product then reads the weight once for all of them, where a
#: chunk of a few rows reads Pythia-160m's 154 MB head from memory for each (9 % of the
#: engine's time at its shape, bench/pretrained_engine.py). A head that fits in a core's cache
#: costs the same per row either way, and keeps its per-chunk products (and roundings).
HEAD_GATHER_BYTES = 4 << 20


def gathers_head(d_vocab: int, resid: Tensor) -> bool:
    """Return whether the LM head of a model with `d_vocab` words and residuals like `resid`
    (its width and dtype) is larger than HEAD_GATHER_BYTES (`resumed_pairs`)."""
    return d_vocab * resid.shape[-1] * resid.element_size() > HEAD_GATHER_BYTES


def unembedded_in_groups(model: PatchableModel, chunks: Pairs, max_rows: int) -> Pairs:
    """Yield (patch index, row, query logits) of `chunks`' (patch index, row, final-normed
    residual at the query ``[k, d_model]``), unembedded (`PatchableModel.unembed_resid`) in
    groups of consecutive chunks of at most `max_rows` rows (a larger chunk alone)."""
    group: list[tuple[Tensor, Tensor, Tensor]] = []
    for chunk in chunks:
        if group and sum(len(rows) for _, rows, _ in group) + len(chunk[1]) > max_rows:
            yield _unembedded(model, group)
            group = []
        group.append(chunk)
    if group:
        yield _unembedded(model, group)


def _unembedded(model: PatchableModel, group: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """Return one (patch index, row, logits) of a group of (patch index, row, normed residual)."""
    which_patch, rows, normed = (torch.cat(parts) for parts in zip(*group, strict=True))
    return which_patch, rows, model.unembed_resid(normed)


#: how much wider than its narrowest row a chunk's window may grow (`width_chunks`)
WIDTH_GROWTH = 1.25
#: (row, position) pairs a chunk may compute for nothing whatever its widths (`width_chunks`): a
#: resumed forward costs a fixed few milliseconds of Python and small-tensor calls, what a few
#: hundred positions cost at d_model 64, so merging short windows is cheaper than running them apart
WASTE_FLOOR = 512
#: the residual width up to which WASTE_FLOOR holds (`waste_floor`)
WASTE_FLOOR_WIDTH = 128


def waste_floor(d_model: int) -> int:
    """Return the positions a chunk of a model with residual width `d_model` may compute for
    nothing (`width_chunks`): WASTE_FLOOR up to WASTE_FLOOR_WIDTH, then less as d_model² grows.
    A resumed forward's fixed cost stays, a position's grows with d_model²: at d_model 768
    (Pythia-160m, Mamba-130m) WASTE_FLOOR merged a key's windows of 6 to 60 positions into one
    chunk that computed 64 % more positions than they need (bench/pretrained_engine.py)."""
    return round(WASTE_FLOOR * min(1.0, (WASTE_FLOOR_WIDTH / d_model) ** 2))


def width_chunks(
    widths: list[int], max_batch: int, floor: int | None = None, max_positions: int | None = None
) -> Iterator[slice]:
    """Yield slices covering `widths` (ascending window widths, one per pair) of at most
    `max_batch` pairs, a new slice wherever the next width would make the slice compute more than
    `floor` positions for nothing (default WASTE_FLOOR; a chunk runs every row on its widest window) and exceeds
    WIDTH_GROWTH times the slice's first width (and its first + 1): this bounds the positions
    computed for nothing to a quarter, where fixed-size chunks of a key's windows (4 to 35
    positions) ran most rows on 30 or more, while short windows (ATR's patches near the query:
    1 to 20 positions) share a few forwards instead of one per width."""
    floor = WASTE_FLOOR if floor is None else floor
    start = 0
    while start < len(widths):
        limit = max(widths[start] * WIDTH_GROWTH, widths[start] + 1)
        stop, total = start + 1, widths[start]
        while stop < len(widths) and stop - start < max_batch:
            if max_positions is not None and (stop + 1 - start) * widths[stop] > max_positions:
                break
            waste = (stop + 1 - start) * widths[stop] - (total + widths[stop])
            if widths[stop] > limit and waste > floor:
                break
            total += widths[stop]
            stop += 1
        yield slice(start, stop)
        start = stop


def window_widths(first: Tensor, query: Tensor) -> Tensor:
    """Return ``[B]``: the positions a resumed run of each row needs, from its first patched
    position `first` ``[B]`` to its query `query` ``[B]`` (at least 1)."""
    return (query - first + 1).clamp(min=1)


def resume_window(widths: Tensor, query: Tensor) -> tuple[int, Tensor]:
    """Return ``(W, start [B])``, the common window of rows resumed together: W is the widest
    row's width (`window_widths`) and row i runs positions ``start[i] .. start[i] + W - 1``,
    ending at its query; a row whose window would start before position 0 gets the first W
    positions instead (the extra positions before the patch recompute the base run's values,
    those after the query are not read)."""
    width = int(widths.max())
    return width, (query - width + 1).clamp(min=0)


class WindowPatch:
    """The forward hook patching one target in resumed runs (`resumed_pairs`).

    `point_at` sets the chunk: its rows, their patch masks ``[rows, T]`` and the absolute
    positions ``[rows, W]`` an activation may hold, told apart by their length (the window,
    the query alone after the last mixer, or every position, where a mixer without window
    hooks fires its inside hooks on the whole run).
    """

    def __init__(self, plan: TargetPlan):
        self.plan = plan

    def point_at(self, rows: Tensor, mask: Tensor, windows: tuple[Tensor, ...], span: slice | None = None) -> None:
        """`span`: the activation's rows that are these `rows` (`joined_pairs`; default all of them)."""
        self.rows, self.mask, self.span = rows, mask, span
        self.by_length = {positions.shape[1]: positions for positions in windows}

    def __call__(self, activation: Tensor, hook=None) -> Tensor:
        if self.span is None:
            return self._patched(activation)
        lo, hi = self.span.start, self.span.stop
        if lo == hi:  # none of this site's rows in the chunk
            return activation
        return torch.cat([activation[:lo], self._patched(activation[lo:hi]), activation[hi:]])

    def _patched(self, activation: Tensor) -> Tensor:
        plan = self.plan
        positions = self.by_length[activation.shape[plan.pos_axis]]
        values = _take_rows_positions(plan.values, self.rows, positions, plan.pos_axis)
        mask = patch_mask(self.mask.gather(1, positions), values.shape, plan.pos_axis, plan.head_axis, plan.target.head)
        return torch.where(mask, values, activation)


def _take_rows_positions(values: Tensor, rows: Tensor, positions: Tensor, pos_axis: int) -> Tensor:
    """Return `values` ``[N, ..., T, ...]`` at rows `rows` ``[B]`` and, along `pos_axis`, their
    positions `positions` ``[B, W]``: ``[B, ..., W, ...]``."""
    if pos_axis == 1 and values.is_contiguous():  # one gather of the W positions, not of the T
        flat = rows[:, None] * values.shape[1] + positions
        return values.flatten(0, 1).index_select(0, flat.flatten()).view(*positions.shape, *values.shape[2:])
    return _take_positions(values.index_select(0, rows), positions, pos_axis)


def _take_positions(values: Tensor, positions: Tensor, pos_axis: int) -> Tensor:
    """Return `values` ``[rows, ..., T, ...]`` at `positions` ``[rows, W]`` along `pos_axis`."""
    moved = values.movedim(pos_axis, 1)
    index = positions.view(*positions.shape, *([1] * (moved.dim() - 2))).expand(-1, -1, *moved.shape[2:])
    return moved.gather(1, index).movedim(1, pos_axis)
