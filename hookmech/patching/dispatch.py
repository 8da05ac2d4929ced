"""`patch`: the one entry point. It checks the options, then hands the work to the exact engine
(`exact`) or to attribution patching (`atp`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from ..allocator import keep_freed_memory
from ..cache import CacheFile
from ..errors import UsageError
from ..hook_names import block_hook
from ..sites import as_specs
from ..tasks.batch import Batch
from .atp import attribution_patch, positional_hooks
from .atp_star import atp_star_patch
from .chunked import DEFAULT_MEMORY, RowsSink, RunRows, chunked_records, plan, row_bytes
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
    keep_freed_memory()  # the runs' multi-MB temporaries: hookmech/allocator.py
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
    request = _NodePatch.checked(model, sites, positions, options, graddrop, partial)
    runner = request.runner(clean_means)
    return chunked_records(source, memory, request.chunks, runner, threshold, rows_sink, progress, partial)


@dataclass(frozen=True)
class _NodePatch:
    """What every row chunk of one `patch` call runs: its sites parsed once, its checked options."""

    model: PatchableModel
    sites: list[PatchSite]
    positions: list[str]
    options: PatchOptions
    graddrop: bool
    partial: bool  # AtP*'s records keep their per-layer GradDrop means (`chunked.RecordSums`)

    @classmethod
    def checked(
        cls,
        model: PatchableModel,
        sites: SiteSpecs,
        positions: str | Iterable[str],
        options: PatchOptions,
        graddrop: bool | None,
        partial: bool,
    ) -> _NodePatch:
        """Return the request of `patch`'s arguments, the sites parsed (once: every step below takes
        them parsed); a UsageError for options the method does not take."""
        position_specs = as_specs(positions, "position")
        if graddrop is not None and options.method != "atp-star":
            raise UsageError(f"graddrop={graddrop} is an option of method 'atp-star' (AtP*), not of {options.method!r}")
        if options.method in ("atp", "atp-star"):
            _check_atp_options(options)
        check_patchable(model)
        patch_sites = parse_sites(sites, model)
        if options.method in ("atp", "atp-star") and not all(is_plain(site) for site in patch_sites):
            raise UsageError(
                f"method {options.method!r} takes plain sites (no joint 'a+b' or per-head '[h]' sites); "
                "use method 'exact'"
            )
        return cls(model, patch_sites, position_specs, options, bool(graddrop), partial)

    def runner(
        self, clean_means: dict[str, Tensor] | None
    ) -> Callable[[CacheFile | None, list[slice] | None], RunRows]:
        """Return `chunked.chunked_records`'s runner: over several chunks of a cache, a mean
        ablation's means come from a first pass over all of them (unless `clean_means` gives them)."""

        def run_rows(cache: CacheFile | None, slices: list[slice] | None) -> RunRows:
            if slices is None:
                return lambda rows, progress: self.rows(rows, progress, clean_means, self.partial)
            means = clean_means
            if self.options.ablate == "mean" and means is None:
                assert cache is not None
                hooks = ablated_hooks(self.model, self.sites)
                means = chunk_means(self.model, cache, hooks, slices, self.options.max_batch)
            return lambda window, progress: self.rows(window, progress, means, True)

        return run_rows

    def chunks(self, cache: CacheFile, memory: int) -> list[slice]:
        """Return the row chunks of `cache` at `memory` bytes of row data (`patch_chunks`)."""
        return patch_chunks(self.model, cache, self.sites, self.positions, self.options, memory)

    def rows(
        self,
        source: Batch | CacheFile | str | Path,
        progress: Callable[[int], None] | None,
        clean_means: dict[str, Tensor] | None,
        partial: bool,
    ) -> list[dict[str, Any]]:
        """Return `patch`'s records of all rows of `source` at once (`partial`: AtP*'s records keep
        their per-layer GradDrop means, to be added to other rows')."""
        options = self.options
        if options.method == "exact":
            return run_exact(self.model, source, self.sites, self.positions, options, progress, clean_means)
        threshold, max_batch, per_example = options.threshold, options.max_batch, options.per_example
        if options.method == "atp":
            records = attribution_patch(
                self.model, source, self.sites, self.positions, threshold, max_batch, per_example
            )
        else:
            records = atp_star_patch(
                self.model,
                source,
                self.sites,
                self.positions,
                threshold=threshold,
                max_batch=max_batch,
                per_example=per_example,
                graddrop=self.graddrop,
                context_memory=options.context_memory,
                graddrop_layers=partial,
            )
        if progress is not None:
            progress(len(records))
        return records


def _check_source_and_memory(source: object, memory: object) -> None:
    """Raise a UsageError unless `source` is a patch source (a `Batch`, a `CacheFile` or a cache
    path) and `memory` a number of bytes > 0 or None; return None."""
    if not isinstance(source, (Batch, CacheFile, str, Path)):
        raise UsageError(f"patch source must be a Batch, a CacheFile or a cache path, got {type(source).__name__}")
    if memory is not None and (
        isinstance(memory, bool) or not isinstance(memory, (int, float)) or not (math.isfinite(memory) and memory > 0)
    ):
        raise UsageError(f"memory must be a number of bytes > 0 (or None: all rows at once), got {memory!r}")


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
