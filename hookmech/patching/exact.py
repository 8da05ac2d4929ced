"""The exact engine: every (site, position) patch run, batched, from as late as it can start.

It reads activations from a cache when one is given, resumes a patch at block l from the base
run's residual entering block l (the layers below are untouched), from the first patched
position on (`forwards.resumed_pairs`), computes logits only at the query, skips the rows a
patch does not change (the patched values equal the base run's there: their metric is the base
run's, exactly) or cannot reach (`reachability`), reads those a patch turns into the source run
from that run (`_makes_source_run`), and stacks the remaining (patch, row) pairs
into batched forwards of at most `max_batch` rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..cache import CacheFile, answer_probs
from ..hook_names import block_hook
from ..sites import PositionPatch, as_specs, position_patches
from ..tasks.batch import Batch
from .forwards import (
    ResumedSite,
    full_pairs,
    hooks_to_start,
    joined_pairs,
    joins_sites,
    resume_layer,
    resumed_pairs,
    start_layer,
    unembedded_in_groups,
    window_widths,
)
from .metrics import Metric, make_metric
from .options import PatchOptions
from .plans import TargetPlan, changed_rows, differing_positions, plan_target
from .protocol import PatchableModel, check_patchable
from .reachability import reaches_query
from .records import Means, patch_record
from .runs import RUNS, CleanCorruptRuns, evaluating, open_source
from .targets import PatchSite, SiteSpecs, equivalent_site, parse_sites


def run_exact(
    model: PatchableModel,
    source: Batch | CacheFile | str | Path,
    sites: SiteSpecs,
    positions: str | Iterable[str],
    options: PatchOptions,
    progress: Callable[[int], None] | None = None,
    clean_means: dict[str, Tensor] | None = None,
) -> list[dict[str, Any]]:
    """Return `exact_patch`'s records of site specs `sites` (`targets.parse_sites`) at position
    specs `positions` on `source` (a `Batch`, an open `CacheFile` or a cache path), the model in
    eval mode meanwhile. `clean_means`: a mean ablation's means ``{hook: [1, ...]}`` over more
    rows than `source`'s (`chunked.clean_means`; None: over its own rows)."""
    check_patchable(model)
    patch_sites = parse_sites(sites, model)
    with evaluating(model), open_source(source) as (batch, cache):
        return exact_patch(
            model, batch, cache, patch_sites, as_specs(positions, "position"), options, progress, clean_means
        )


def exact_patch(
    model: PatchableModel,
    batch: Batch,
    cache: CacheFile | None,
    patch_sites: list[PatchSite],
    positions: list[str],
    options: PatchOptions,
    progress: Callable[[int], None] | None = None,
    clean_means: dict[str, Tensor] | None = None,
    site_positions: dict[PatchSite, list[str]] | None = None,
) -> list[dict[str, Any]]:
    """Return one record per (site, position) (`records.patch_record`, plus ``ablate`` when
    ablating and, when `per_example`, ``[N]`` lists ``p_patched_rows`` (``metric_patched_rows``
    for another metric) and the unpatched runs' ``p_clean_rows``, ``p_corrupt_rows``, whose
    means are the record's ``p_clean``, ``p_corrupt``),
    patching every site of `patch_sites` at every position spec of `positions` on `batch`
    (activations read from `cache` where it holds them); `progress(len(positions' patches))` after each site.
    `site_positions`: each site's own position specs instead of `positions` (one pair of clean
    and corrupt runs for cells that are not a grid: `verify_top`)."""
    n_pos = batch.tokens.shape[1]
    specs_of = {site: positions for site in patch_sites} if site_positions is None else site_positions
    patches_of = {site: position_patches(specs_of[site], batch.roles, batch.lengths, n_pos) for site in patch_sites}
    computed_sites = {site: equivalent_site(model, site) for site in patch_sites}
    hooks = [t.hook for s in patch_sites for t in s.targets]
    hooks += [t.hook for s in computed_sites.values() for t in s.targets]
    start_hooks = hooks_to_start(model, list(computed_sites.values()))
    runs = CleanCorruptRuns(
        model,
        batch,
        hooks + start_hooks,
        cache,
        need_logits=options.metric != "p_answer",
        max_batch=options.max_batch,
        base=options.base,
        context_memory=options.context_memory,
        read_at=_read_positions(
            [patch for found in patches_of.values() for patch in found], hooks, start_hooks, options
        ),
    )
    runs.clean_means = clean_means or {}
    metric = make_metric(options.metric, batch, runs.logits)
    p_clean, p_corrupt = (runs.p_answer[which].mean().item() for which in RUNS)
    m_clean, m_corrupt = (runs.unpatched_metric(metric, which).mean().item() for which in RUNS)
    gap = m_corrupt - m_clean if metric.lower_is_better else m_clean - m_corrupt
    keys = {site: (computed_sites[site], tuple(patch.label for patch in patches_of[site])) for site in patch_sites}
    work = {key: (key[0], patches_of[site], None) for site, key in keys.items()}  # L0.block_out, L1.block_in: one
    results = dict(zip(work, patched_rows_of(model, runs, list(work.values()), metric, options), strict=True))
    records = []
    for site in patch_sites:
        patches = patches_of[site]
        probs, values = results[keys[site]]
        for patch_spec, row_probs, row_values in zip(patches, probs, values, strict=True):
            record = patch_record(
                site.site,
                site.hook,
                patch_spec.label,
                len(batch),
                Means(p_clean, p_corrupt, row_probs.mean().item()),
                Means(m_clean, m_corrupt, row_values.mean().item()),
                method=options.method,
                metric_name=options.metric,
                direction=str(options.direction),
                passes_filter=bool(gap > options.threshold),
            )
            if options.ablate is not None:
                record["ablate"] = options.ablate
            if options.per_example:
                record["p_patched_rows"] = row_probs.tolist()
                record["p_clean_rows"], record["p_corrupt_rows"] = (runs.p_answer[which].tolist() for which in RUNS)
                if options.metric != "p_answer":
                    record["metric_patched_rows"] = row_values.tolist()
            records.append(record)
        if progress is not None:
            progress(len(patches))
    return records


def _read_positions(
    patches: list[PositionPatch], hooks: list[str], start_hooks: list[str], options: PatchOptions
) -> dict[str, Tensor]:
    """Return ``{hook: [N, T] bool}``: the positions at which the patches read the base and
    source runs' activations of the patched hooks, the union of the patches' positions (a patch
    writes there and nowhere else). Not for the hooks a resumed run starts from (read on whole
    windows), nor for ablations (the mean and resampling read other rows and positions)."""
    if options.ablate is not None:
        return {}
    union = torch.stack([patch.mask for patch in patches]).any(dim=0)
    return {hook: union for hook in hooks if hook not in start_hooks}


@torch.no_grad()
def patched_rows(
    model: PatchableModel,
    runs: CleanCorruptRuns,
    site: PatchSite,
    patches: list[PositionPatch],
    metric: Metric,
    options: PatchOptions,
    plans: list[TargetPlan] | None = None,
) -> tuple[Tensor, Tensor]:
    """Return (p_answer, metric) of every patch and row of `site`, each ``[len(patches), N]`` float64.

    `plans`: what each target of `site` is patched with (default: the source run's activation, or
    the ablation, of `options`; a path patch gives its own values)."""
    return patched_rows_of(model, runs, [(site, patches, plans)], metric, options)[0]


@torch.no_grad()
def patched_rows_of(
    model: PatchableModel,
    runs: CleanCorruptRuns,
    work: list[tuple[PatchSite, list[PositionPatch], list[TargetPlan] | None]],
    metric: Metric,
    options: PatchOptions,
) -> list[tuple[Tensor, Tensor]]:
    """Return `patched_rows` of each (site, patches, plans) of `work`. The resumed sites of a wide
    model run their pairs together (`forwards.joined_pairs`), the others each on its own."""
    results: dict[int, tuple[Tensor, Tensor]] = {}
    joinable = [i for i, (site, _, _) in enumerate(work) if _joinable(model, runs, site, options.base)]
    if len(joinable) > 1:
        together = {i: _site_pairs(model, runs, *work[i][:2], metric, options, work[i][2]) for i in joinable}
        joined = [pairs for pairs in together.values() if pairs.contexts is not None and len(pairs.patch_index)]
        if len(joined) > 1:
            _run_joined(model, runs, joined, metric, options)
        for i, pairs in together.items():
            if len(joined) < 2 or pairs not in joined:
                pairs.run(model, runs, metric, options)
            results[i] = pairs.probs, pairs.values
    for i, (site, patches, plans) in enumerate(work):
        if i not in results:  # one site at a time: only its plans are held
            alone = _site_pairs(model, runs, site, patches, metric, options, plans)
            alone.run(model, runs, metric, options)
            results[i] = alone.probs, alone.values
    return [results[i] for i in range(len(work))]


def _joinable(model: PatchableModel, runs: CleanCorruptRuns, site: PatchSite, base: str) -> bool:
    """Whether `site`'s pairs may run with other sites' (`forwards.joined_pairs`): it resumes at a
    block (not the final norm) of a model wide enough (`forwards.joins_sites`)."""
    layer = resume_layer(model, site)
    if layer is None or layer >= model.cfg.n_layers:
        return False
    return joins_sites(runs.acts(model.resid_hook(layer), base).shape[-1])


def _run_joined(
    model: PatchableModel, runs: CleanCorruptRuns, joined: list[_SitePairs], metric: Metric, options: PatchOptions
) -> None:
    """Run the pairs of the sites `joined` together (`forwards.joined_pairs`) and record them."""
    contexts = min(joined, key=lambda site: site.layer).contexts
    assert contexts is not None
    site_of = torch.cat([torch.full_like(site.row_index, i) for i, site in enumerate(joined)])
    patch_of = torch.cat([site.patch_index for site in joined])
    chunks = joined_pairs(model, runs, joined, contexts, options.base, options.max_batch)
    for pairs, rows, logits in unembedded_in_groups(model, chunks, options.max_batch):
        for i, site in enumerate(joined):
            at = site_of[pairs] == i
            site.record(patch_of[pairs[at]], rows[at], logits[at], runs.batch, metric)


@dataclass(eq=False)
class _SitePairs(ResumedSite):
    """One site's patches on a batch (`patched_rows_of`): the `ResumedSite` fields (the pairs whose
    patched run must run; `layer` -1 where it cannot resume), where a full run starts (`start`,
    from `resid` or `tokens`), the base run's `contexts` a resumed one starts from (None: it
    cannot resume), and (p_answer, metric) of every pair ``[P, N]``."""

    start: int | None
    resid: Tensor | None
    tokens: Tensor
    contexts: dict[int, dict[str, Tensor]] | None
    probs: Tensor
    values: Tensor

    def run(self, model: PatchableModel, runs: CleanCorruptRuns, metric: Metric, options: PatchOptions) -> None:
        """Run this site's pairs on their own, resumed where it can, and record them."""
        args = self.plans, self.masks, self.patch_index, self.row_index
        if self.contexts is not None:
            pairs = resumed_pairs(model, runs, *args, self.layer, self.contexts, options.base, options.max_batch)
        else:
            pairs = full_pairs(model, runs, *args, self.start, self.tokens, self.resid, options.max_batch)
        for which_patch, rows, logits in pairs:
            self.record(which_patch, rows, logits, runs.batch, metric)

    def record(self, which_patch: Tensor, rows: Tensor, logits: Tensor, batch: Batch, metric: Metric) -> None:
        """Write (p_answer, metric) of the pairs (`which_patch`, `rows`) ``[k]`` from their query logits."""
        cpu_patch, cpu_rows = which_patch.cpu(), rows.cpu()
        self.probs[cpu_patch, cpu_rows] = answer_probs(logits, batch.answers[cpu_rows].to(logits.device)).double().cpu()
        self.values[cpu_patch, cpu_rows] = metric.rows(logits, cpu_rows)


def _site_pairs(
    model: PatchableModel,
    runs: CleanCorruptRuns,
    site: PatchSite,
    patches: list[PositionPatch],
    metric: Metric,
    options: PatchOptions,
    plans: list[TargetPlan] | None,
) -> _SitePairs:
    """Return `site`'s `_SitePairs`: the changed (patch, row) pairs that reach the query, their
    records the base run's until they are run."""
    batch, device, base = runs.batch, runs.device, options.base
    interchange = plans is None and options.ablate is None
    if plans is None:
        plans = [
            plan_target(model, runs, target, base, options.source, options.ablate, options.ablate_seed)
            for target in site.targets
        ]
    masks = torch.stack([patch.mask for patch in patches]).to(device)  # [P, N, T]
    changed = torch.zeros(masks.shape[:2], dtype=torch.bool, device=device)
    for plan in plans:
        changed |= changed_rows(plan, masks)
    start = start_layer(model, site)
    resid = None if start is None else runs.acts(block_hook(start, "resid_pre"), base)
    tokens = batch.tokens if base == "clean" else batch.corrupt_tokens
    resume_at = resume_layer(model, site)
    contexts = None if resume_at is None else runs.resume_contexts(resume_at, base, options.max_batch)
    if changed.any():
        # what a patched run of each pair would run: its window (resumed), or every position
        query = batch.query_pos.to(device)
        first = masks.int().argmax(dim=-1)  # [P, N]: the first patched position
        skippable = (
            window_widths(first, query[None, :]) if contexts is not None else torch.full_like(first, masks.shape[-1])
        )
        changed = reaches_query(model, runs, plans, masks, start, tokens, resid, options.max_batch, changed, skippable)
    probs = runs.p_answer[base].repeat(len(patches), 1)
    values = runs.unpatched_metric(metric, base).repeat(len(patches), 1)
    if interchange and resume_at is not None:
        # such a pair's patched run is the source run itself: its records are that run's
        is_source = changed & _makes_source_run(model, runs, plans, masks, resume_at)
        changed &= ~is_source
        on_cpu = is_source.cpu()
        probs[on_cpu] = runs.p_answer[options.source].expand_as(probs)[on_cpu]
        values[on_cpu] = runs.unpatched_metric(metric, options.source).expand_as(values)[on_cpu]
    patch_index, row_index = changed.nonzero(as_tuple=True)
    layer = -1 if resume_at is None else resume_at
    return _SitePairs(plans, masks, patch_index, row_index, layer, start, resid, tokens, contexts, probs, values)


def _makes_source_run(
    model: PatchableModel, runs: CleanCorruptRuns, plans: list[TargetPlan], masks: Tensor, layer: int
) -> Tensor:
    """Return ``[P, N]``: True where patch p makes row n's run the source run itself: the site
    (`plans`, one target) is the whole residual entering block `layer`, patched with the source
    run's, and the two runs' residuals there differ only at the patch's positions (e.g. block 0's input at the one
    corrupted token). What follows a block's input is a function of it alone."""
    none = torch.zeros(masks.shape[:2], dtype=torch.bool, device=masks.device)
    if len(plans) != 1:
        return none
    plan = plans[0]
    hook = plan.target.hook
    # a hook read at a few positions only (`CleanCorruptRuns.read_at`) is unset elsewhere
    if hook != model.resid_hook(layer) or plan.head_axis is not None or hook in runs.read_at:
        return none
    return ~(differing_positions(plan)[None] & ~masks).any(-1)
