"""`patch`: the one entry point. It checks the options, then hands the work to the exact engine
(`exact`) or to attribution patching (`atp`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch import Tensor

from ..cache import CacheFile
from ..errors import UsageError
from ..hook_names import block_hook
from ..sites import as_specs
from ..tasks.batch import Batch
from .atp import attribution_patch, positional_hooks
from .atp_star import atp_star_patch
from .chunked import DEFAULT_MEMORY, RowsSink, in_chunks, opened, plan, row_bytes, take_rows
from .chunked import clean_means as chunk_means
from .exact import run_exact
from .forwards import hooks_to_start
from .options import CONTEXT_MEMORY, PatchOptions
from .protocol import PatchableModel, check_patchable
from .targets import PatchSite, SiteSpecs, equivalent_site, is_plain, parse_sites


def patch(
    model: PatchableModel,
    source: Batch | CacheFile | str | Path,
    sites: SiteSpecs,
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
    graddrop: bool | None = None,
    progress: Callable[[int], None] | None = None,
    memory: int | None = DEFAULT_MEMORY,
    rows_sink: RowsSink | None = None,
    clean_means: dict[str, Tensor] | None = None,
    partial: bool = False,
) -> list[dict[str, Any]]:
    """Patch every (site, position) and score it (formulas: `hookmech.patching.metrics`).

    For each (site, position): run the **base** input, replace the site's activation at the
    position by the **source** activation, and read a metric at the query. Denoising (default):
    base = corrupt run, source = clean run. Noising: base = clean run, source = corrupt run.
    Ablations (zero / mean / resample) replace the source by a value that does not come from
    the other run, on the clean run (they are noising by nature).

    `source` is a `Batch` (clean and corrupt runs are computed) or an activation cache
    (path or open `CacheFile`: activations and residuals are read from it). `sites` are site
    specs (`parse_sites`), `positions` position specs (`sites.position_patches`); a bare string
    is one spec. `threshold` must be finite. `metric` in
    METRICS; `direction` "denoise" (default) or "noise" ("noise" with `ablate`); `ablate` None
    (interchange) or "zero" / "mean" / "resample" (resample: row i takes row
    `resample_order(N, ablate_seed)[i]`'s clean activation). `method` "exact", "atp" (the
    first-order estimate, `attribution_patch`: interchange denoising of p_answer at plain sites) or
    "atp-star" (AtP*, `atp_star_patch`: the same cells, estimated with the fixes of Kramár et al. 2024;
    `graddrop=True` adds its GradDrop passes, one backward per layer, and the ``graddrop`` score;
    None, the default, and False leave them out and ``graddrop`` None).
    Returns one record per (site, position): ``site, hook, pos, attribution, p_clean, p_corrupt,
    p_patched, n, passes_filter, method, metric, direction, metric_clean, metric_corrupt,
    metric_patched`` (p_* are mean p(answer), metric_* the metric's means, attribution is
    computed from metric_*); plus ``ablate`` when ablating, and ``p_patched_rows`` (and
    ``metric_patched_rows``), ``p_clean_rows``, ``p_corrupt_rows`` ``[N]`` lists when `per_example`.

    Memory: a cache is read in row chunks of about `memory` bytes of row data (`chunked`; None:
    all rows at once), the records being sums over chunks (equal to one pass over all rows to
    float64 round-off); a mean ablation first makes a pass for the means over all rows, and a
    resample ablation over more than one chunk is a UsageError. Per chunk: `max_batch` rows per
    forward, the activations of the patched hooks of its rows, and the mixer contexts that
    resumed patches start from while they fit in `context_memory` bytes (beyond it, patches run
    on every position: slower, same numbers). `rows_sink`: where the per-row lists go as each
    chunk is done (`chunked.RowsSink`; the records then hold None in their place). `clean_means`:
    a mean ablation's means ``{hook: [1, ...]}`` over more rows than `source`'s (a worker's row
    shard, `distributed`); `partial`: records to be added to other rows' (`chunked.RecordSums`:
    AtP*'s keep ``graddrop_layers``).

    `progress(k)` is called as k records are done (the exact engine: once per site, with its
    positions; AtP and AtP*: once, with all), so that the calls add up to the number of records.
    """
    _check_source_and_memory(source, memory)
    options = PatchOptions(
        method=method,
        metric=metric,
        direction=direction,
        threshold=threshold,
        max_batch=max_batch,
        context_memory=context_memory,
        per_example=per_example,
        ablate=ablate,
        ablate_seed=ablate_seed,
    )
    positions = as_specs(positions, "position")
    if graddrop is not None and options.method != "atp-star":
        raise UsageError(f"graddrop={graddrop} is an option of method 'atp-star' (AtP*), not of {options.method!r}")
    if options.method in ("atp", "atp-star"):
        _check_atp_options(options)
    check_patchable(model)
    patch_sites = parse_sites(sites, model)  # once: every step below takes the parsed sites
    if options.method in ("atp", "atp-star") and not all(is_plain(site) for site in patch_sites):
        raise UsageError(
            f"method {options.method!r} takes plain sites (no joint 'a+b' or per-head '[h]' sites); use method 'exact'"
        )

    def run_rows(
        rows_source: Batch | CacheFile | str | Path,
        rows_progress: Callable[[int], None] | None,
        means: dict[str, Tensor] | None,
        chunk: bool,
    ) -> list[dict[str, Any]]:
        return _patch_rows(
            model, rows_source, patch_sites, positions, options, bool(graddrop), rows_progress, means, partial or chunk
        )

    if memory is None or isinstance(source, Batch):
        n_rows = len(source) if isinstance(source, Batch) else None
        return take_rows(run_rows(source, progress, clean_means, False), slice(0, n_rows), rows_sink)
    with opened(source) as cache:
        slices = patch_chunks(model, cache, patch_sites, positions, options, memory)
        if len(slices) == 1:
            return take_rows(run_rows(cache, progress, clean_means, False), slice(0, cache.n), rows_sink)
        means = clean_means
        if options.ablate == "mean" and means is None:
            means = chunk_means(model, cache, ablated_hooks(model, patch_sites), slices, max_batch)
        return in_chunks(
            cache,
            slices,
            lambda window, window_progress: run_rows(window, window_progress, means, True),
            threshold,
            rows_sink,
            progress,
            partial=partial,
        )


def _check_source_and_memory(source: object, memory: object) -> None:
    """Raise a UsageError unless `source` is a patch source (a `Batch`, a `CacheFile` or a cache
    path) and `memory` a number of bytes > 0 or None; return None."""
    if not isinstance(source, (Batch, CacheFile, str, Path)):
        raise UsageError(f"patch source must be a Batch, a CacheFile or a cache path, got {type(source).__name__}")
    if memory is not None and (
        isinstance(memory, bool) or not isinstance(memory, (int, float)) or not (math.isfinite(memory) and memory > 0)
    ):
        raise UsageError(f"memory must be a number of bytes > 0 (or None: all rows at once), got {memory!r}")


def _patch_rows(
    model: PatchableModel,
    source: Batch | CacheFile | str | Path,
    sites: list[PatchSite],
    positions: list[str],
    options: PatchOptions,
    graddrop: bool,
    progress: Callable[[int], None] | None,
    clean_means: dict[str, Tensor] | None,
    partial: bool,
) -> list[dict[str, Any]]:
    """Return `patch`'s records of all rows of `source` at once (`partial`: AtP*'s records keep
    their per-layer GradDrop means, to be added to other rows')."""
    if options.method == "atp":
        records = attribution_patch(
            model,
            source,
            sites,
            positions,
            threshold=options.threshold,
            max_batch=options.max_batch,
            per_example=options.per_example,
        )
    elif options.method == "atp-star":
        records = atp_star_patch(
            model,
            source,
            sites,
            positions,
            threshold=options.threshold,
            max_batch=options.max_batch,
            per_example=options.per_example,
            graddrop=graddrop,
            context_memory=options.context_memory,
            graddrop_layers=partial,
        )
    else:
        return run_exact(model, source, sites, positions, options, progress, clean_means)
    if progress is not None:
        progress(len(records))
    return records


def patch_chunks(
    model: PatchableModel,
    cache: CacheFile,
    sites: list[PatchSite],
    positions: list[str],
    options: PatchOptions,
    memory: int,
) -> list[slice]:
    """Return the row chunks `patch` reads `cache` in at `memory` bytes of row data (a
    UsageError for a resample ablation that needs more than one)."""
    resample = "a resample ablation takes each row's partner from any row" if options.ablate == "resample" else None
    return plan(cache, _row_bytes(model, cache, options, sites, positions), memory, "--ablate resample", resample)


def _row_bytes(
    model: PatchableModel, cache: CacheFile, options: PatchOptions, sites: list[PatchSite], positions: list[str]
) -> int:
    """Return what one row of `cache` costs the patch (`chunked.row_bytes`): the hooks it reads
    of both runs, with the masks of its position patches."""
    n_patches = sum(cache.n_pos if spec == "all" else 1 for spec in positions)
    if options.method == "exact":
        patch_sites = parse_sites(sites, model)
        computed = [equivalent_site(model, site) for site in patch_sites]
        hooks = [target.hook for site in patch_sites + computed for target in site.targets]
        hooks += hooks_to_start(model, computed)
    else:
        hooks, start = positional_hooks(model, sites)
        blocks = range(start or 0, model.cfg.n_layers)
        hooks = hooks + [block_hook(layer, part) for layer in blocks for part in ("resid_pre", "mixer_in", "mixer_out")]
    # plain AtP keeps no mixer contexts; the exact engine and AtP*'s last block do
    return row_bytes(model, cache, hooks, n_patches, contexts=options.method != "atp" and options.context_memory > 0)


def ablated_hooks(model: PatchableModel, sites: list[PatchSite]) -> list[str]:
    """Return the hooks a mean ablation of `sites` replaces (theirs and their equivalent sites')."""
    patch_sites = parse_sites(sites, model)
    computed = [equivalent_site(model, site) for site in patch_sites]
    return list(dict.fromkeys(target.hook for site in patch_sites + computed for target in site.targets))


def _check_atp_options(options: PatchOptions) -> None:
    """Raise a UsageError unless AtP covers `options` (interchange denoising of p(answer); other
    options need the exact engine; `patch` checks that its sites are plain); return None."""
    method = options.method
    if options.metric != "p_answer" or options.direction != "denoise" or options.ablate is not None:
        raise UsageError(
            f"method {method!r} estimates interchange denoising of p_answer only; "
            "use method 'exact' for other metrics, directions and ablations"
        )
