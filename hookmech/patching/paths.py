"""Path patching: the effect of a sender on a receiver through one route only, everything else
held at the corrupt run (Wang et al. 2022; Goldowsky-Dill et al. 2023). docs/guide.md §10
defines each route.

``path_patch(model, source, "L0.mixer.in_x@key", "L0.mixer.conv@value", via="conv")``: for each
(sender, receiver) pair of sites and positions,

1. the model computes how the path changes the receiver (`PathPatchableModel.path_ends`, `path_change`:
   the residual stream's and the mixers' own arithmetic, exactly zero where the path does not
   reach), from the two runs' activations (read from a cache where it holds them);
2. the corrupt run is re-run with the receiver (for a `state` path: what the receiving position
   reads out of the state) replaced at the receiver's positions by its corrupt value plus that
   change: the exact engine's patched forwards (`exact.patched_rows`: batched, resumed where the
   receiver allows, only the rows that change), and the metric is read at the query as usual.

The engine knows no architecture here either: which routes a model has, and what travels along
them, is the model's to say.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..cache import CacheFile
from ..errors import UsageError
from ..hooks import pos_axis_of
from ..sites import PositionPatch, as_specs, position_patches
from ..tasks.batch import Batch
from .chunked import DEFAULT_MEMORY, RowsSink, in_chunks, opened, plan, row_bytes, take_rows
from .exact import patched_rows
from .forwards import hooks_to_start
from .metrics import make_metric
from .options import CONTEXT_MEMORY, PatchOptions
from .plans import TargetPlan
from .protocol import PathPatchableModel, check_patchable
from .records import Means, patch_record
from .runs import RUNS, CleanCorruptRuns, evaluating, open_source
from .targets import PatchSite, Target, head_axis_of, parse_sites

#: the routes of a path (``--via``), defined in docs/guide.md §10
VIA = ("resid", "head", "state", "conv")


class PathSkippedWarning(UserWarning):
    """Pairs of a `path_patch` left out because the route cannot join them (a `resid` path
    between positions that never coincide): they have no record."""


def split_endpoint(spec: str, end: str) -> tuple[str, str]:
    """Return ``(site, position)`` of an endpoint ``SITE@POS`` (`end`: "sender" or "receiver",
    for the message); a UsageError when either part is missing."""
    site, at, position = spec.strip().partition("@")
    if not at or not site.strip() or not position.strip():
        raise UsageError(f"{end} {spec.strip()!r} must be SITE@POS, e.g. L0.block_out@key or L1.mixer.q[0]@query")
    return site.strip(), position.strip()


def path_patch(
    model: PathPatchableModel,
    source: Batch | CacheFile | str | Path,
    sender: str | Iterable[str],
    receiver: str | Iterable[str],
    via: str,
    threshold: float = 0.01,
    max_batch: int = 256,
    per_example: bool = False,
    metric: str = "p_answer",
    context_memory: int = CONTEXT_MEMORY,
    progress: Callable[[int], None] | None = None,
    memory: int | None = DEFAULT_MEMORY,
    rows_sink: RowsSink | None = None,
) -> list[dict[str, Any]]:
    """Patch every path from a sender to a receiver along `via` and score it.

    `sender`, `receiver`: endpoints ``SITE@POS`` (a bare string is one; several give every
    pair). SITE is one site, a pattern, or a head of one (``L0.mixer.z[0]``, ``[*]``: one
    record per head); POS a position spec (a role, an integer, ``all``, ``whole``, ``a+b``).
    `via`: ``resid`` | ``head`` | ``state`` | ``conv`` (docs/guide.md §10). `source`, `threshold`,
    `max_batch`, `metric`, `context_memory` and `per_example` as in `hookmech.patching.patch`
    (denoising: the corrupt run is patched).

    Returns one record per (sender site, sender position, receiver site, receiver position):
    ``sender, receiver, via`` (the endpoints as ``SITE@POS`` labels), then patch's fields
    ``site, hook, pos, attribution, p_clean, p_corrupt, p_patched, n, passes_filter, method,
    metric, direction, metric_clean, metric_corrupt, metric_patched`` with ``site``/``pos`` the
    receiver's and ``hook`` the hook replaced (the receiver, or for a state path the hook holding
    the receiving position's read-out); plus ``p_patched_rows`` (and ``metric_patched_rows``)
    ``[N]`` lists when `per_example`.

    A `resid` path carries a position's value to that same position only: a (sender position,
    receiver position) pair that coincides in no row is left out, with one `PathSkippedWarning`
    naming how many were and one of them; when no pair is left, a UsageError (a single such
    pair is refused the same way). `progress(k)` is called after each sender position of each
    (sender site, receiver site) pair with its k receiver positions, left-out pairs included (the
    calls add up to the number of (sender, receiver) pairs of sites and positions).

    A cache is read in row chunks of about `memory` bytes, as in `hookmech.patching.patch`
    (`rows_sink` as there); a resid path whose positions meet in some chunks' rows only is
    refused over several chunks.
    """
    check_patchable(model, paths=True)

    def run_rows(rows_source, rows_progress):
        return _path_patch_rows(
            model,
            rows_source,
            sender,
            receiver,
            via,
            threshold,
            max_batch,
            per_example,
            metric,
            context_memory,
            rows_progress,
        )

    if memory is None or isinstance(source, Batch):
        return take_rows(run_rows(source, progress), slice(0, None), rows_sink)
    with opened(source) as cache:
        slices = path_chunks(model, cache, memory)
        if len(slices) == 1:
            return take_rows(run_rows(cache, progress), slice(0, cache.n), rows_sink)
        return in_chunks(cache, slices, run_rows, threshold, rows_sink, progress)


def path_chunks(model: PathPatchableModel, cache: CacheFile, memory: int) -> list[slice]:
    """Return the row chunks `path_patch` reads `cache` in at `memory` bytes of row data."""
    # every stored hook: what a path reads depends on its route (an upper bound of a row's bytes)
    return plan(cache, row_bytes(model, cache, cache.keys(), 1), memory, "path patching")


def _path_patch_rows(
    model: PathPatchableModel,
    source: Batch | CacheFile | str | Path,
    sender: str | Iterable[str],
    receiver: str | Iterable[str],
    via: str,
    threshold: float,
    max_batch: int,
    per_example: bool,
    metric: str,
    context_memory: int,
    progress: Callable[[int], None] | None,
) -> list[dict[str, Any]]:
    """Return `path_patch`'s records of all rows of `source` at once."""
    if via not in VIA:
        raise UsageError(f"unknown path kind {via!r} (available: {', '.join(VIA)})")
    options = PatchOptions(
        metric=metric,
        threshold=threshold,
        max_batch=max_batch,
        context_memory=context_memory,
        per_example=per_example,
    )
    senders = [split_endpoint(spec, "sender") for spec in as_specs(sender, "sender")]
    receivers = [split_endpoint(spec, "receiver") for spec in as_specs(receiver, "receiver")]
    if not senders or not receivers:
        raise UsageError("a path patch needs a sender and a receiver (SITE@POS each)")
    with evaluating(model), open_source(source) as (batch, cache):
        n_pos = batch.tokens.shape[1]
        send = [
            (target, position_patches(pos, batch.roles, batch.lengths, n_pos))
            for site, pos in senders
            for target in _single_targets(site, model, "sender")
        ]
        receive = [
            (target, position_patches(pos, batch.roles, batch.lengths, n_pos))
            for site, pos in receivers
            for target in _single_targets(site, model, "receiver")
        ]
        paths = [
            (s_target, s_patches, r_target, r_patches, model.path_ends(via, s_target.hook, r_target.hook))
            for s_target, s_patches in send
            for r_target, r_patches in receive
        ]
        if via == "resid":
            _skip_resid_pairs(paths)
        hooks = [hook for *_, ends in paths for hook in (*ends.reads, ends.patched)]
        sites = [PatchSite((Target(ends.patched, r_target.head),)) for _, _, r_target, _, ends in paths]
        runs = CleanCorruptRuns(
            model,
            batch,
            hooks + hooks_to_start(model, sites),
            cache,
            need_logits=options.metric != "p_answer",
            max_batch=options.max_batch,
            base="corrupt",
            context_memory=options.context_memory,
        )
        scorer = make_metric(options.metric, batch, runs.logits)
        p_clean, p_corrupt = (runs.p_answer[which].mean().item() for which in RUNS)
        m_clean, m_corrupt = (runs.unpatched_metric(scorer, which).mean().item() for which in RUNS)
        gap = m_corrupt - m_clean if scorer.lower_is_better else m_clean - m_corrupt
        records = []
        for (s_target, s_patches, r_target, r_patches, ends), site in zip(paths, sites, strict=True):
            target = site.targets[0]
            pos_axis = pos_axis_of(model.hook_dict[target.hook])
            assert pos_axis is not None  # every patched hook of a path has a position axis
            head_axis = None if target.head is None else head_axis_of(model, target.hook)
            base = runs.acts(target.hook, "corrupt")
            for s_patch in s_patches:
                met = r_patches if via != "resid" else [r for r in r_patches if _same_position(s_patch, r)]
                if not met:
                    if progress is not None:
                        progress(len(r_patches))
                    continue
                change = model.path_change(ends, runs.acts, s_patch.mask.to(runs.device), s_target.head)
                plan = TargetPlan(target, pos_axis, head_axis, base + change, base)
                probs, values = patched_rows(model, runs, site, met, scorer, options, plans=[plan])
                if progress is not None:
                    progress(len(r_patches))
                for r_patch, row_probs, row_values in zip(met, probs, values, strict=True):
                    record = {
                        "sender": f"{s_target.site_label}@{s_patch.label}",
                        "receiver": f"{r_target.site_label}@{r_patch.label}",
                        "via": via,
                        **patch_record(
                            r_target.site_label,
                            target.label,
                            r_patch.label,
                            len(batch),
                            Means(p_clean, p_corrupt, row_probs.mean().item()),
                            Means(m_clean, m_corrupt, row_values.mean().item()),
                            method="exact",
                            metric_name=options.metric,
                            direction="denoise",
                            passes_filter=bool(gap > options.threshold),
                        ),
                    }
                    if per_example:
                        record["p_patched_rows"] = row_probs.tolist()
                        if options.metric != "p_answer":
                            record["metric_patched_rows"] = row_values.tolist()
                    records.append(record)
    return records


def _single_targets(site: str, model: PathPatchableModel, end: str) -> list[Target]:
    """The targets of one endpoint's site spec: one per site of a pattern and per head of ``[*]``;
    a joint site (``a+b``) is refused (a path has one sender and one receiver)."""
    if "+" in site:
        raise UsageError(f"a path's {end} is one site, not the joint site {site!r}")
    return [patch_site.targets[0] for patch_site in parse_sites(site, model)]


def _same_position(sender: PositionPatch, receiver: PositionPatch) -> bool:
    """Whether a sender position and a receiver position coincide in some row (a `resid` path
    joins those only)."""
    return bool((sender.mask & receiver.mask).any())


def _skip_resid_pairs(paths: list[tuple[Target, list[PositionPatch], Target, list[PositionPatch], Any]]) -> None:
    """Warn (`PathSkippedWarning`) about the (sender position, receiver position) pairs of `resid`
    `paths` that coincide in no row, which `path_patch` leaves out; raise a UsageError when that
    is every pair. Returns None."""
    skipped = [
        (s_target, s_patch, r_target, r_patch)
        for s_target, s_patches, r_target, r_patches, _ in paths
        for s_patch in s_patches
        for r_patch in r_patches
        if not _same_position(s_patch, r_patch)
    ]
    if not skipped:
        return
    s_target, s_patch, r_target, r_patch = skipped[0]
    example = f"{s_target.site_label}@{s_patch.label} -> {r_target.site_label}@{r_patch.label}"
    total = sum(len(s_patches) * len(r_patches) for _, s_patches, _, r_patches, _ in paths)
    if len(skipped) == total:
        raise UsageError(
            "a resid path carries a position's value to the same position only, and no sender position is a "
            f"receiver position here (e.g. {example}); give the receiver the sender's position"
        )
    warnings.warn(
        f"{len(skipped)} of {total} resid pairs left out: a resid path carries a position's value to the same "
        f"position only, and their positions never coincide (e.g. {example})",
        PathSkippedWarning,
        stacklevel=3,
    )
