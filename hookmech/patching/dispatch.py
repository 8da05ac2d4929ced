"""`patch`: the one entry point. It checks the options, then hands the work to the exact engine
(`exact`) or to attribution patching (`atp`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..cache import CacheFile
from ..errors import UsageError
from ..sites import as_specs
from ..tasks.batch import Batch
from .atp import attribution_patch
from .atp_star import atp_star_patch
from .exact import run_exact
from .options import CONTEXT_MEMORY, PatchOptions
from .protocol import PatchableModel


def patch(
    model: PatchableModel,
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
    graddrop: bool | None = None,
    progress: Callable[[int], None] | None = None,
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

    Memory: `max_batch` rows per forward, plus the activations of the patched hooks for all N
    rows, plus the mixer contexts that resumed patches start from while they fit in
    `context_memory` bytes (beyond it, patches run on every position: slower, same numbers).

    `progress(k)` is called as k records are done (the exact engine: once per site, with its
    positions; AtP and AtP*: once, with all), so that the calls add up to the number of records.
    """
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
    sites, positions = as_specs(sites, "site"), as_specs(positions, "position")
    if graddrop is not None and options.method != "atp-star":
        raise UsageError(f"graddrop={graddrop} is an option of method 'atp-star' (AtP*), not of {options.method!r}")
    if options.method == "atp":
        _check_atp_options(options, sites)
        records = attribution_patch(
            model, source, sites, positions, threshold=threshold, max_batch=max_batch, per_example=per_example
        )
    elif options.method == "atp-star":
        _check_atp_options(options, sites)
        records = atp_star_patch(
            model,
            source,
            sites,
            positions,
            threshold=threshold,
            max_batch=max_batch,
            per_example=per_example,
            graddrop=bool(graddrop),
            context_memory=context_memory,
        )
    else:
        return run_exact(model, source, sites, positions, options, progress)
    if progress is not None:
        progress(len(records))
    return records


def _check_atp_options(options: PatchOptions, sites: list[str]) -> None:
    """Raise a UsageError unless AtP covers `options` and `sites` (interchange denoising of
    p(answer) at plain sites; other options need the exact engine); return None."""
    method = options.method
    if options.metric != "p_answer" or options.direction != "denoise" or options.ablate is not None:
        raise UsageError(
            f"method {method!r} estimates interchange denoising of p_answer only; "
            "use method 'exact' for other metrics, directions and ablations"
        )
    if any("+" in spec or "[" in spec for spec in sites):
        raise UsageError(
            f"method {method!r} takes plain sites (no joint 'a+b' or per-head '[h]' sites); use method 'exact'"
        )
