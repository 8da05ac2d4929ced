"""Interchange interventions (activation patching) and the attribution score (docs/guide.md §1, §6).

For each (site, position): run the **base** input, replace the site's activation at the
position by the **source** activation, and read a metric at the query. Denoising (default):
base = corrupt run, source = clean run. Noising: base = clean run, source = corrupt run.
Ablations (zero / mean / resample) replace the source by a value that does not come from
the other run, on the clean run (they are noising by nature). With means m over the N rows,

    denoise:  attribution = (m_patched − m_corrupt) / (m_clean − m_corrupt)
    noise:    attribution = (m_clean − m_patched) / (m_clean − m_corrupt)

so that 1 means "this site at this position carries the whole clean-vs-corrupt difference" in
both directions. Metrics m (per row, at the query position):

    p_answer    p(answer)                                 (the default)
    log_p       log p(answer)
    logit_diff  logit(answer) − logit(corrupt answer)     (see `corrupt_answers`)
    kl          KL(clean distribution ‖ run's distribution), so m_clean = 0 and, denoising,
                attribution = (KL_corrupt − KL_patched) / KL_corrupt

Sites: a site name or pattern (`sites.resolve_sites`), a head of a hook with a ``head`` axis
(``L1.mixer.z[0]``; ``L1.mixer.z[*]`` = every head, one record each), or a joint patch of
several sites in one run (``L0.block_out+L1.mixer_in``, one record).

The engine speaks hook names, axes and positions only. It reads activations from a cache when
one is given, resumes a patch at block l from the base run's residual entering block l (the
layers below are untouched), computes logits only at the query, skips the rows a patch does not
change (the patched values equal the base run's there: their metric is the base run's, exactly),
and stacks the remaining (patch, row) pairs into batched forwards of at most `max_batch` rows.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .cache import CacheFile, answer_probs, check_batch_fits, check_cache_fits, run_chunks
from .errors import HookmechError, UsageError, suggest
from .hooks import axis_size, pos_axis_of
from .mixers.base import take_window, window_index
from .sites import PositionPatch, as_specs, hook_to_site, joint_parts, position_patches, resolve_sites
from .tasks.batch import Batch

METHODS = ("exact", "atp")
METRICS = ("p_answer", "log_p", "logit_diff", "kl")
DIRECTIONS = ("denoise", "noise")
ABLATIONS = ("zero", "mean", "resample")
#: bytes of mixer contexts the engine keeps for resumed patches by default (`patch`)
CONTEXT_MEMORY = 2 << 30
_HEAD_SUFFIX = re.compile(r"^(?P<base>.+)\[(?P<head>\d+|\*)\]$")


def attribution_score(p_clean: float, p_corrupt: float, p_patched: float, direction: str = "denoise") -> float | None:
    """Return the attribution of a patch from the three metric means, or None when
    m_clean == m_corrupt. Denoise: (p_patched − p_corrupt) / (p_clean − p_corrupt);
    noise: (p_clean − p_patched) / (p_clean − p_corrupt)."""
    denominator = p_clean - p_corrupt
    if denominator == 0:
        return None
    if direction == "noise":
        return (p_clean - p_patched) / denominator
    return (p_patched - p_corrupt) / denominator


# -- sites ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """One patched activation: a hook, optionally restricted to one index of its ``head`` axis."""

    hook: str
    head: int | None = None


@dataclass(frozen=True)
class PatchSite:
    """What one record patches: one or several targets, patched together in one run."""

    targets: tuple[Target, ...]

    @property
    def site(self) -> str:
        return "+".join(hook_to_site(t.hook) + ("" if t.head is None else f"[{t.head}]") for t in self.targets)

    @property
    def hook(self) -> str:
        return "+".join(t.hook + ("" if t.head is None else f"[{t.head}]") for t in self.targets)


def head_axis_of(model, hook: str) -> int:
    """Return the index of the ``head`` axis of `hook`'s activation; a UsageError if it has none."""
    axes = getattr(model.hook_dict[hook], "axes", "").split()
    if "head" not in axes:
        raise UsageError(f"{hook_to_site(hook)} has no head axis (axes: {' '.join(axes) or 'unknown'}); "
                         "per-head sites need one, e.g. L1.mixer.z[0] of multi-head attention")
    return axes.index("head")


def n_heads_of(model, hook: str) -> int:
    """Return the size of `hook`'s head axis, as its hook point declares it (`hooks.axis_size`,
    whatever the mixer calls its head option); a UsageError if it has no head axis or no size."""
    head_axis_of(model, hook)
    n_heads = axis_size(model.hook_dict[hook], "head")
    if n_heads is None:
        raise UsageError(f"{hook_to_site(hook)}[*]: its hook does not declare how many heads it has; "
                         "name a head, e.g. [0]")
    return n_heads


def parse_sites(specs: str | Iterable[str], model) -> list[PatchSite]:
    """Resolve site specs to `PatchSite`s, in forward order of their first target.

    A spec is a site or pattern, optionally with a head suffix (``[h]`` or ``[*]``), or
    several of those joined by ``+`` (one joint patch); a bare string is one spec. Returns one
    `PatchSite` per record.
    """
    result: list[PatchSite] = []
    for spec in as_specs(specs):
        parts = joint_parts(spec, "site")
        per_part = [_parse_part(part, model) for part in parts]
        if len(parts) == 1:
            result.extend(PatchSite((target,)) for target in per_part[0])
        else:
            joint = tuple(dict.fromkeys(target for targets in per_part for target in targets))
            result.append(PatchSite(joint))
    if not result:
        raise UsageError("no site given")
    return list(dict.fromkeys(result))


def _parse_part(part: str, model) -> list[Target]:
    head_spec = None
    if match := _HEAD_SUFFIX.match(part):
        part, head_spec = match.group("base"), match.group("head")
    hooks = resolve_sites([part], model.hook_dict)
    for hook in hooks:
        if pos_axis_of(model.hook_dict[hook]) is None:
            raise UsageError(f"{hook_to_site(hook)} has no position axis (it does not depend on the input): "
                             "it cannot be patched at a position")
    if head_spec is None:
        return [Target(hook) for hook in hooks]
    targets = []
    for hook in hooks:
        head_axis_of(model, hook)
        heads = range(n_heads_of(model, hook)) if head_spec == "*" else [int(head_spec)]
        targets.extend(Target(hook, head) for head in heads)
    return targets


# -- metrics -------------------------------------------------------------------------------
def corrupt_answers(batch: Batch, corrupt_logits: Tensor) -> Tensor:
    """Return the "corrupted answer" of each row, ``[N]``: the answer of the corrupt document.

    Where the corrupt document changed the `value` role's token (value corruption), that is
    its new value there. Where the corrupt document has no answer (key corruption: the
    queried key no longer occurs), it is the corrupt run's most likely token other than the
    clean answer (`corrupt_logits` ``[N, d_vocab]`` at the query).
    """
    answers = batch.answers.to(corrupt_logits.device)
    others = corrupt_logits.clone()
    others[torch.arange(len(answers), device=others.device), answers] = float("-inf")
    fallback = others.argmax(dim=-1)
    if "value" not in batch.roles:
        return fallback
    rows = torch.arange(len(batch))
    value_pos = batch.roles["value"]
    clean_value, corrupt_value = batch.tokens[rows, value_pos], batch.corrupt_tokens[rows, value_pos]
    changed = (clean_value != corrupt_value).to(fallback.device)
    return torch.where(changed, corrupt_value.to(fallback.device), fallback)


@dataclass
class Metric:
    """A per-row metric of query logits: `name` in METRICS, with what it needs."""

    name: str
    answers: Tensor                      # [N]
    corrupt_answers: Tensor | None = None  # [N], logit_diff
    clean_log_probs: Tensor | None = None  # [N, d_vocab], kl

    @property
    def lower_is_better(self) -> bool:
        return self.name == "kl"

    def rows(self, logits: Tensor, rows: Tensor) -> Tensor:
        """Return the metric ``[len(rows)]`` (float64) of query logits ``[len(rows), d_vocab]`` of `rows`."""
        logits = logits.float()
        answers = self.answers[rows].to(logits.device)
        if self.name == "p_answer":
            out = answer_probs(logits, answers)
        elif self.name == "log_p":
            out = logits.log_softmax(-1).gather(-1, answers[:, None]).squeeze(-1)
        elif self.name == "logit_diff":
            other = self.corrupt_answers[rows].to(logits.device)
            out = logits.gather(-1, answers[:, None]).squeeze(-1) - logits.gather(-1, other[:, None]).squeeze(-1)
        else:
            reference = self.clean_log_probs[rows].to(logits.device)
            out = (reference.exp() * (reference - logits.log_softmax(-1))).sum(-1)
        return out.double().cpu()


def resample_order(n_rows: int, seed: int) -> Tensor:
    """Return ``[n_rows]``: row i takes row order[i]'s activation, a derangement (one cycle
    through a random order, deterministic in `seed`; the identity when n_rows == 1)."""
    generator = torch.Generator().manual_seed(seed)
    cycle = torch.randperm(n_rows, generator=generator)
    order = torch.empty(n_rows, dtype=torch.long)
    order[cycle] = cycle.roll(-1)
    return order


# -- where activations come from -----------------------------------------------------------
class _Runs:
    """The clean and corrupt runs of a batch: activations of hooks, residuals entering
    blocks and query logits, read from a cache where it holds them, else computed once."""

    def __init__(self, model, batch: Batch, hooks: Sequence[str], cache: CacheFile | None, need_logits: bool,
                 max_batch: int, base: str | None = None, context_memory: int = 0):
        self.model, self.batch, self.cache = model, batch, cache
        # mixer contexts (for resumed patches) are kept only while they fit in this many bytes
        self.context_memory, self.contexts_refused = context_memory, context_memory <= 0
        self.device = next(model.parameters()).device
        wanted = list(dict.fromkeys(hooks))
        missing = [hook for hook in wanted if cache is None or not (cache.has(hook, "clean") and cache.has(hook, "corrupt"))]
        self.logits: dict[str, Tensor] = {}
        self.p_answer: dict[str, Tensor] = {}
        self.computed: dict[tuple[str, str], Tensor] = {}
        self.contexts: dict[tuple[int, str], dict[str, Tensor]] = {}
        check_batch_fits(model, batch, "the examples" if cache is None else str(cache.path))
        if cache is not None:
            check_cache_fits(model, cache, batch, [hook for hook in wanted if hook not in missing])
            cache.check_model(model)  # a cache of another model would give numbers that mean nothing
            self.p_answer = {which: cache.p_answer(which).double() for which in ("clean", "corrupt")}
        if missing or need_logits or cache is None:
            self._compute(missing, max_batch, base)

    @torch.no_grad()
    def _compute(self, hooks: list[str], max_batch: int, base: str | None) -> None:
        """Run clean and corrupt; the `base` run also records every block's mixer context
        (`HookedLM.collecting_contexts`), which resumed patches start from."""
        parts: dict[tuple[str, str], list[Tensor]] = {}
        logits: dict[str, list[Tensor]] = {"clean": [], "corrupt": []}
        collect = base is not None and hasattr(self.model, "collecting_contexts") and not self.contexts_refused
        contexts = {layer: [] for layer in range(self.model.cfg.n_layers)} if collect else {}
        for rows in run_chunks(len(self.batch), max_batch):
            query = self.batch.query_pos[rows].to(self.device)
            for which, tokens in (("clean", self.batch.tokens), ("corrupt", self.batch.corrupt_tokens)):
                with self.model.collecting_contexts() if collect and which == base else nullcontext() as recorded:
                    out, acts = self.model.run_with_cache(tokens[rows].to(self.device), names_filter=hooks,
                                                          return_cache_object=False, positions=query)
                for layer, chunk_contexts in (recorded or {}).items():
                    contexts[layer].extend(chunk_contexts)
                logits[which].append(out.float())
                for hook in hooks:
                    parts.setdefault((hook, which), []).append(acts[hook])
            if collect and self._over_budget(contexts, rows.stop):
                collect, contexts = False, {}
        self.computed = {key: _concat(chunks) for key, chunks in parts.items()}
        for layer, chunks in contexts.items():
            self.contexts[layer, base] = {name: _concat([chunk[name] for chunk in chunks]) for name in chunks[0]}
        self.logits = {which: _concat(chunks) for which, chunks in logits.items()}
        if not self.p_answer:
            answers = self.batch.answers.to(self.device)
            self.p_answer = {which: answer_probs(out, answers).double().cpu() for which, out in self.logits.items()}

    def resume_contexts(self, layer: int, which: str, max_batch: int) -> dict[int, dict[str, Tensor]] | None:
        """Return the mixer contexts of the `which` run for blocks `layer` .. last
        (`HookedLM.prefix_context`, computed once, in chunks of `max_batch` rows), or None when
        they would not fit in `context_memory` bytes (the patches then run on every position)."""
        for index in range(layer, self.model.cfg.n_layers):
            if self.contexts_refused:
                return None
            if (index, which) not in self.contexts:
                self._make_context(index, which, max_batch)
        return None if self.contexts_refused else {i: self.contexts[i, which] for i in range(layer, self.model.cfg.n_layers)}

    def _make_context(self, layer: int, which: str, max_batch: int) -> None:
        mixer_in = self.acts(f"blocks.{layer}.hook_mixer_in", which)
        parts: list[dict[str, Tensor]] = []
        for rows in run_chunks(len(mixer_in), max_batch):
            parts.append(self.model.prefix_context(layer, mixer_in[rows]))
            if self._over_budget({layer: parts}, rows.stop):
                return
        self.contexts[layer, which] = {name: _concat([part[name] for part in parts]) for name in parts[0]}

    def _over_budget(self, new: dict[int, list[dict[str, Tensor]]], rows_done: int) -> bool:
        """Whether the contexts kept, plus `new` (made for the first `rows_done` rows, scaled to
        all rows), exceed `context_memory`; if so, drop every context and refuse more."""
        kept = sum(_nbytes(context) for context in self.contexts.values())
        made = sum(_nbytes(context) for chunks in new.values() for context in chunks)
        if kept + made * len(self.batch) / rows_done <= self.context_memory:
            return False
        self.contexts, self.contexts_refused = {}, True
        return True

    def acts(self, hook: str, which: str) -> Tensor:
        """Return `hook`'s activations of the `which` run, ``[N, ...]`` on the model's device."""
        if (hook, which) in self.computed:
            return self.computed[hook, which]
        return self.cache.read(hook, which, slice(0, len(self.batch))).to(self.device)


def _nbytes(context: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in context.values())


def _concat(chunks: list[Tensor]) -> Tensor:
    """torch.cat along rows, without copying a single chunk."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


# -- the engine ----------------------------------------------------------------------------
def _patch_mask(mask: Tensor, shape: torch.Size, pos_axis: int, head_axis: int | None, head: int | None) -> Tensor:
    """Broadcast a ``[batch, pos]`` mask (and a head choice) against an activation of `shape`."""
    view = [1] * len(shape)
    view[0], view[pos_axis] = shape[0], shape[pos_axis]
    full = mask.view(view)
    if head is not None:
        heads = torch.zeros(shape[head_axis], dtype=torch.bool, device=mask.device)
        heads[head] = True
        head_view = [1] * len(shape)
        head_view[head_axis] = shape[head_axis]
        full = full & heads.view(head_view)
    return full


@dataclass
class _TargetPlan:
    target: Target
    pos_axis: int
    head_axis: int | None
    values: Tensor   # [N, ...] (or broadcastable along rows): what is patched in
    base: Tensor     # [N, ...]: the base run's activation


def _plan_target(model, runs: _Runs, target: Target, base: str, source: str, ablate: str | None, ablate_seed: int) -> _TargetPlan:
    hook = target.hook
    pos_axis = pos_axis_of(model.hook_dict[hook])
    head_axis = None if target.head is None else head_axis_of(model, hook)
    base_acts = runs.acts(hook, base)
    if head_axis is not None and target.head >= base_acts.shape[head_axis]:
        raise UsageError(f"{hook_to_site(hook)}[{target.head}]: it has {base_acts.shape[head_axis]} heads")
    if ablate is None:
        values = runs.acts(hook, source)
    elif ablate == "zero":
        values = torch.zeros_like(base_acts)
    elif ablate == "resample":
        values = runs.acts(hook, "clean")[resample_order(len(runs.batch), ablate_seed).to(runs.device)]
    else:
        values = _row_mean(runs.acts(hook, "clean"), runs.batch.lengths.to(runs.device), pos_axis).expand_as(base_acts)
    return _TargetPlan(target, pos_axis, head_axis, values, base_acts)


def _row_mean(acts: Tensor, lengths: Tensor, pos_axis: int) -> Tensor:
    """Mean over rows at each position, over the rows long enough to have it: ``[1, ...]``."""
    n_pos = acts.shape[pos_axis]
    valid = torch.arange(n_pos, device=acts.device)[None, :] < lengths[:, None]  # [N, T]
    weights = _patch_mask(valid, acts.shape, pos_axis, None, None)
    # where, not multiply: padded positions may hold -inf (masked attention scores), and -inf * 0 is NaN
    total = torch.where(weights, acts, torch.zeros((), dtype=acts.dtype, device=acts.device)).sum(0, keepdim=True)
    return total / weights.to(acts.dtype).sum(0, keepdim=True).clamp(min=1)


def _changed_rows(plan: _TargetPlan, masks: Tensor) -> Tensor:
    """``[P, N]`` True where patching `plan` at the patch's positions changes the row."""
    differs = plan.values != plan.base
    if plan.head_axis is not None:
        differs = differs.select(plan.head_axis, plan.target.head).unsqueeze(plan.head_axis)
    differs = differs.movedim(plan.pos_axis, 1).flatten(2).any(-1)  # [N, T]
    return (masks & differs[None]).any(-1)


@torch.no_grad()
def _patched_rows(model, runs: _Runs, site: PatchSite, patches: list[PositionPatch], metric: Metric,
                  base: str, source: str, ablate: str | None, ablate_seed: int, max_batch: int) -> tuple[Tensor, Tensor]:
    """Return (p_answer, metric) of every patch and row, each ``[len(patches), N]`` float64."""
    batch, device = runs.batch, runs.device
    plans = [_plan_target(model, runs, target, base, source, ablate, ablate_seed) for target in site.targets]
    masks = torch.stack([patch.mask for patch in patches]).to(device)  # [P, N, T]
    changed = torch.zeros(masks.shape[:2], dtype=torch.bool, device=device)
    for plan in plans:
        changed |= _changed_rows(plan, masks)
    probs = runs.p_answer[base].repeat(len(patches), 1)
    values = runs_metric(runs, metric, base).repeat(len(patches), 1)
    layers = [model.layer_of_hook(t.hook) for t in site.targets]
    start = None if None in layers else min(layers)
    resid = None if start is None else runs.acts(f"blocks.{start}.hook_resid_pre", base)
    tokens = batch.tokens if base == "clean" else batch.corrupt_tokens
    if changed.any():
        changed &= _reaches_query(model, runs, plans, masks, start, tokens, resid, max_batch)
    patch_index, row_index = changed.nonzero(as_tuple=True)
    resume_at = _resume_layer(model, site)
    contexts = None if resume_at is None else runs.resume_contexts(resume_at, base, max_batch)
    if contexts is not None:
        pairs = _resumed_pairs(model, runs, plans, masks, patch_index, row_index, resume_at, contexts, base, max_batch)
    else:
        pairs = _full_pairs(model, runs, plans, masks, patch_index, row_index, start, tokens, resid, max_batch)
    for which_patch, rows, logits in pairs:
        cpu_patch, cpu_rows = which_patch.cpu(), rows.cpu()
        probs[cpu_patch, cpu_rows] = answer_probs(logits, batch.answers[cpu_rows].to(device)).double().cpu()
        values[cpu_patch, cpu_rows] = metric.rows(logits, cpu_rows)
    return probs, values


def _full_pairs(model, runs: _Runs, plans, masks, patch_index, row_index, start, tokens, resid, max_batch):
    """Yield (patch index, row, query logits) of (patch, row) pairs run from block `start`'s
    input (or from the tokens when `start` is None) on every position."""
    batch, device = runs.batch, runs.device
    for chunk in run_chunks(len(row_index), max_batch):
        which_patch, rows = patch_index[chunk], row_index[chunk]
        chunk_mask = masks[which_patch, rows]  # [k, T]
        fwd_hooks = [(plan.target.hook, _replace_hook(plan, plan.values[rows], chunk_mask)) for plan in plans]
        model_input = tokens[rows.cpu()].to(device) if start is None else resid[rows]
        logits = model.run_with_hooks(model_input, start_at_layer=start, positions=batch.query_pos[rows.cpu()].to(device),
                                      fwd_hooks=fwd_hooks)
        yield which_patch, rows, logits


def _resume_layer(model, site: PatchSite) -> int | None:
    """The block a resumed run of `site` starts at, or None when a target is a hook that a
    resumed run does not fire (or the model cannot resume)."""
    if not hasattr(model, "resume"):
        return None
    layers = [model.resume_layer(target.hook) for target in site.targets]
    return None if None in layers else min(layers)


def _resumed_pairs(model, runs: _Runs, plans, masks, patch_index, row_index, layer: int,
                   contexts: dict[int, dict[str, Tensor]], base: str, max_batch: int):
    """Yield (patch index, row, query logits) of (patch, row) pairs, each re-run only on the
    positions from its first patched one to its query (`HookedLM.resume`).

    Pairs are sorted by that width so that a chunk's common window W wastes little; a row
    whose window would start before position 0 gets the first W positions instead (the extra
    positions before the patch recompute the base run's values, those after the query are
    not read).
    """
    query = runs.batch.query_pos.to(runs.device)
    first = masks[patch_index, row_index].int().argmax(dim=-1)
    widths = (query[row_index] - first + 1).clamp(min=1)
    order = torch.sort(widths, stable=True).indices
    resid = runs.acts(model.resid_hook(layer), base)
    patchers = [_WindowPatch(plan) for plan in plans]
    # hooks are installed once and pointed at each chunk: adding and removing them per chunk
    # walks every hook point of the model each time
    with model.hooks(fwd_hooks=[(patcher.plan.target.hook, patcher) for patcher in patchers]):
        for chunk in run_chunks(len(order), max_batch):
            pairs = order[chunk]
            which_patch, rows = patch_index[pairs], row_index[pairs]
            width = int(widths[pairs].max())
            start = (query[rows] - width + 1).clamp(min=0)
            for patcher in patchers:
                patcher.point_at(rows, masks[which_patch, rows], (window_index(start, width), query[rows, None]))
            resid_window = take_window(resid.index_select(0, rows), start, width)
            logits = model.resume(resid_window, layer, contexts, rows, start, query[rows])
            yield which_patch, rows, logits


class _WindowPatch:
    """The forward hook patching one target in resumed runs (`_resumed_pairs`).

    `point_at` sets the chunk: its rows, their patch masks ``[rows, T]`` and the absolute
    positions ``[rows, W]`` an activation may hold, told apart by their length (the window,
    or the query alone after the last mixer).
    """

    def __init__(self, plan: _TargetPlan):
        self.plan = plan

    def point_at(self, rows: Tensor, mask: Tensor, windows: tuple[Tensor, ...]) -> None:
        self.values, self.mask = self.plan.values.index_select(0, rows), mask
        self.by_length = {positions.shape[1]: positions for positions in windows}

    def __call__(self, activation: Tensor, hook=None) -> Tensor:
        plan = self.plan
        positions = self.by_length[activation.shape[plan.pos_axis]]
        values = _take_positions(self.values, positions, plan.pos_axis)
        mask = _patch_mask(self.mask.gather(1, positions), values.shape, plan.pos_axis, plan.head_axis, plan.target.head)
        return torch.where(mask, values, activation)


def _replace_hook(plan: _TargetPlan, patch_values: Tensor, mask: Tensor):
    """A forward hook putting `patch_values` (rows of a chunk) where `mask` ``[rows, T]`` (and the head) say."""
    full_mask = _patch_mask(mask, patch_values.shape, plan.pos_axis, plan.head_axis, plan.target.head)

    def patch_hook(activation: Tensor, hook=None) -> Tensor:
        return torch.where(full_mask, patch_values, activation)
    return patch_hook


def _take_positions(values: Tensor, positions: Tensor, pos_axis: int) -> Tensor:
    """``values`` ``[rows, ..., T, ...]`` at `positions` ``[rows, W]`` along `pos_axis`."""
    moved = values.movedim(pos_axis, 1)
    index = positions.view(*positions.shape, *([1] * (moved.dim() - 2))).expand(-1, -1, *moved.shape[2:])
    return moved.gather(1, index).movedim(1, pos_axis)


def _reaches_query(model, runs: _Runs, plans: list[_TargetPlan], masks: Tensor, start: int | None,
                   tokens: Tensor, resid: Tensor | None, max_batch: int) -> Tensor:
    """``[P, N]`` True where the query logits depend on the patched activations at all.

    A structural test, without knowing the architecture: write NaN at the patched places of
    one representative row per (positions, query position, length) group and see whether it
    reaches the query logits. NaN propagates through every arithmetic dependence (and masked
    attention scores or untaken `where` branches drop it exactly where there is none), so a
    patch whose NaN does not arrive cannot change the answer: those rows keep the base run's
    metric. (E.g. a last-layer MLP patched anywhere but at the query.)
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
            fwd_hooks.append((plan.target.hook, _replace_hook(plan, nan, chunk_mask)))
        model_input = tokens[rows.cpu()].to(device) if start is None else resid[rows]
        logits = model.run_with_hooks(model_input, start_at_layer=start, positions=query[rows], fwd_hooks=fwd_hooks)
        reaches[chunk] = ~logits.isfinite().all(dim=-1)
    return reaches[group].view(n_patches, n_rows)


def _group_rows(masks: Tensor, query: Tensor, lengths: Tensor) -> Tensor:
    """``[M]`` group index of each (mask ``[M, T]``, query, length) triple: equal triples, equal index."""
    n_pos = masks.shape[1]
    if n_pos > 62:
        keys = torch.cat([masks.long(), query[:, None], lengths[:, None]], dim=1)
        return torch.unique(keys, dim=0, return_inverse=True)[1]
    # 1-D keys: torch.unique over rows (dim=0) is an order of magnitude slower
    bits = 1 << torch.arange(n_pos, device=masks.device)
    _, mask_id = torch.unique((masks.long() * bits).sum(-1), return_inverse=True)
    return torch.unique((mask_id * (n_pos + 1) + query) * (n_pos + 1) + lengths, return_inverse=True)[1]


def runs_metric(runs: _Runs, metric: Metric, which: str) -> Tensor:
    """Return the metric ``[N]`` (float64) of the unpatched `which` run."""
    if metric.name == "p_answer":
        return runs.p_answer[which]
    return metric.rows(runs.logits[which], torch.arange(len(runs.batch)))


def _make_metric(name: str, runs: _Runs) -> Metric:
    batch = runs.batch
    if name == "p_answer":
        return Metric(name, batch.answers)
    if name == "logit_diff":
        return Metric(name, batch.answers, corrupt_answers=corrupt_answers(batch, runs.logits["corrupt"]).cpu())
    if name == "kl":
        return Metric(name, batch.answers, clean_log_probs=runs.logits["clean"].log_softmax(-1))
    return Metric(name, batch.answers)


def check_threshold(threshold: float) -> None:
    """Raise a UsageError unless `threshold` (the filter on m_clean − m_corrupt) is a finite number."""
    try:
        finite = math.isfinite(float(threshold))
    except (TypeError, ValueError):
        finite = False
    if not finite:
        raise UsageError(f"threshold must be a finite number, got {threshold!r}")


def _check_options(method, metric, direction, ablate, max_batch, threshold) -> str:
    check_threshold(threshold)
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r} (available: {', '.join(METHODS)})")
    for kind, value, choices in (("metric", metric, METRICS), ("ablation", ablate, ABLATIONS),
                                 ("direction", direction, DIRECTIONS)):
        if value is not None and value not in choices:
            raise UsageError(f"unknown {kind} {value!r}{suggest(value, choices)} (available: {', '.join(choices)})")
    if max_batch < 1:
        raise UsageError(f"max_batch must be >= 1, got {max_batch}")
    if ablate is not None and direction == "denoise":
        raise UsageError("ablations replace activations of the clean run (direction 'noise'); "
                         "drop direction 'denoise' or the ablation")
    return direction or ("noise" if ablate is not None else "denoise")


def patch(
    model,
    source: Batch | CacheFile | str | Path,
    sites: str | Iterable[str],
    positions: str | Iterable[str],
    method: str = "exact",
    threshold: float = 0.01,
    max_batch: int = 256,
    per_example: bool = False,
    metric: str = "p_answer",
    direction: str | None = None,
    ablate: str | None = None,
    ablate_seed: int = 0,
    context_memory: int = CONTEXT_MEMORY,
) -> list[dict[str, Any]]:
    """Patch every (site, position) and score it (see the module docstring for the formulas).

    `source` is a `Batch` (clean and corrupt runs are computed) or an activation cache
    (path or open `CacheFile`: activations and residuals are read from it). `sites` are site
    specs (`parse_sites`), `positions` position specs (`sites.position_patches`); a bare string
    is one spec. `threshold` must be finite. `metric` in
    METRICS; `direction` "denoise" (default) or "noise" ("noise" with `ablate`); `ablate` None
    (interchange) or "zero" / "mean" / "resample" (resample: row i takes row
    `resample_order(N, ablate_seed)[i]`'s clean activation). Returns one record per (site,
    position): ``site, hook, pos, attribution, p_clean, p_corrupt, p_patched, n, passes_filter,
    method, metric, direction, metric_clean, metric_corrupt, metric_patched`` (p_* are mean
    p(answer), metric_* the metric's means, attribution is computed from metric_*); plus
    ``ablate`` when ablating, and ``p_patched_rows`` (and ``metric_patched_rows``) ``[N]``
    lists when `per_example`.

    Memory: `max_batch` rows per forward, plus the activations of the patched hooks for all N
    rows, plus the mixer contexts that resumed patches start from while they fit in
    `context_memory` bytes (beyond it, patches run on every position: slower, same numbers).
    """
    direction = _check_options(method, metric, direction, ablate, max_batch, threshold)
    sites, positions = as_specs(sites), as_specs(positions)
    if method == "atp":
        return _attribution_patch(model, source, sites, positions, threshold, max_batch, per_example,
                                  metric, direction, ablate)
    patch_sites = parse_sites(sites, model)
    was_training = model.training
    model.eval()
    try:
        if isinstance(source, (str, Path)):
            with CacheFile(source) as cache:
                return _patch_from(model, cache.batch(), cache, patch_sites, positions, method, threshold, max_batch,
                                   per_example, metric, direction, ablate, ablate_seed, context_memory)
        if isinstance(source, CacheFile):
            return _patch_from(model, source.batch(), source, patch_sites, positions, method, threshold, max_batch,
                               per_example, metric, direction, ablate, ablate_seed, context_memory)
        if isinstance(source, Batch):
            return _patch_from(model, source, None, patch_sites, positions, method, threshold, max_batch,
                               per_example, metric, direction, ablate, ablate_seed, context_memory)
        raise HookmechError(f"patch source must be a Batch or a cache file, got {type(source).__name__}")
    finally:
        model.train(was_training)


def _attribution_patch(model, source, sites, positions, threshold, max_batch, per_example, metric, direction, ablate):
    """`method="atp"`: the first-order estimate (hookmech.atp), which covers interchange
    denoising of p(answer) at plain sites; other options need the exact engine."""
    from .atp import attribution_patch

    if metric != "p_answer" or direction != "denoise" or ablate is not None:
        raise UsageError("method 'atp' estimates interchange denoising of p_answer only; "
                         "use method 'exact' for other metrics, directions and ablations")
    if any("+" in spec or "[" in spec for spec in sites):
        raise UsageError("method 'atp' takes plain sites (no joint 'a+b' or per-head '[h]' sites); use method 'exact'")
    return attribution_patch(model, source, sites, positions, threshold=threshold, max_batch=max_batch,
                             per_example=per_example)


def _equivalent_site(model, site: PatchSite) -> PatchSite:
    """`site` with each target moved to the latest hook holding the same tensor before the same
    computation (`HookedLM.equivalent_hook`: block l's output is block l+1's input), so that
    its patched runs start as late as possible and equal sites are run once."""
    if not hasattr(model, "equivalent_hook"):
        return site
    targets = (Target(model.equivalent_hook(t.hook), t.head) for t in site.targets)
    return PatchSite(tuple(dict.fromkeys(targets)))


def _hooks_to_start(model, patch_sites: list[PatchSite]) -> list[str]:
    """The hooks whose base-run values the patched runs start from: the residual entering the
    first patched block, and, for resumed runs, every later block's mixer input (its context)."""
    hooks = []
    for site in patch_sites:
        resume_at = _resume_layer(model, site)
        if resume_at is not None:
            hooks.append(model.resid_hook(resume_at))
            hooks.extend(f"blocks.{layer}.hook_mixer_in" for layer in range(resume_at, model.cfg.n_layers))
            continue
        layers = [model.layer_of_hook(target.hook) for target in site.targets]
        if None not in layers:
            hooks.append(f"blocks.{min(layers)}.hook_resid_pre")
    return list(dict.fromkeys(hooks))


def _patch_from(model, batch, cache, patch_sites, positions, method, threshold, max_batch, per_example,
                metric_name, direction, ablate, ablate_seed, context_memory) -> list[dict]:
    patches = position_patches(positions, batch.roles, batch.lengths, batch.tokens.shape[1])
    base, source = ("corrupt", "clean") if direction == "denoise" else ("clean", "corrupt")
    computed_sites = {site: _equivalent_site(model, site) for site in patch_sites}
    hooks = [t.hook for s in patch_sites for t in s.targets]
    hooks += [t.hook for s in computed_sites.values() for t in s.targets]
    runs = _Runs(model, batch, hooks + _hooks_to_start(model, list(computed_sites.values())), cache,
                 need_logits=metric_name != "p_answer", max_batch=max_batch, base=base, context_memory=context_memory)
    metric = _make_metric(metric_name, runs)
    p_clean, p_corrupt = (runs.p_answer[w].mean().item() for w in ("clean", "corrupt"))
    m_clean, m_corrupt = (runs_metric(runs, metric, w).mean().item() for w in ("clean", "corrupt"))
    gap = m_corrupt - m_clean if metric.lower_is_better else m_clean - m_corrupt
    records, results = [], {}
    for site in patch_sites:
        computed = computed_sites[site]
        if computed not in results:  # e.g. L0.block_out after L1.block_in: the same patch
            results[computed] = _patched_rows(model, runs, computed, patches, metric, base, source, ablate,
                                              ablate_seed, max_batch)
        probs, values = results[computed]
        for patch_spec, row_probs, row_values in zip(patches, probs, values):
            m_patched = row_values.mean().item()
            record = {
                "site": site.site,
                "hook": site.hook,
                "pos": patch_spec.label,
                "attribution": attribution_score(m_clean, m_corrupt, m_patched, direction),
                "p_clean": p_clean,
                "p_corrupt": p_corrupt,
                "p_patched": row_probs.mean().item(),
                "n": len(batch),
                "passes_filter": bool(gap > threshold),
                "method": method,
                "metric": metric_name,
                "direction": direction,
                "metric_clean": m_clean,
                "metric_corrupt": m_corrupt,
                "metric_patched": m_patched,
            }
            if ablate is not None:
                record["ablate"] = ablate
            if per_example:
                record["p_patched_rows"] = row_probs.tolist()
                if metric_name != "p_answer":
                    record["metric_patched_rows"] = row_values.tolist()
            records.append(record)
    return records
