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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache import CacheFile
from ..errors import UsageError
from ..hooks import pos_axis_of
from ..sites import PositionPatch, as_specs, position_patches
from ..tasks.batch import Batch
from .chunked import DEFAULT_MEMORY, RowsSink, RunRows, chunked_records, plan, row_bytes
from .exact import patched_rows
from .forwards import hooks_to_start
from .metrics import Metric, make_metric
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


@dataclass(frozen=True)
class Endpoint:
    """One end of a path, its site parsed: one target (a hook, or one head of it) at a position
    spec (made into position patches per batch, `sites.position_patches`)."""

    target: Target
    position: str


#: what `path_patch` takes as a sender or receiver: ``SITE@POS`` specs, or endpoints parsed already
EndpointSpecs = str | Iterable[str] | list[Endpoint]


def split_endpoint(spec: str, end: str) -> tuple[str, str]:
    """Return ``(site, position)`` of an endpoint ``SITE@POS`` (`end`: "sender" or "receiver",
    for the message); a UsageError when either part is missing."""
    site, at, position = spec.strip().partition("@")
    if not at or not site.strip() or not position.strip():
        raise UsageError(f"{end} {spec.strip()!r} must be SITE@POS, e.g. L0.block_out@key or L1.mixer.q[0]@query")
    return site.strip(), position.strip()


def parse_endpoints(specs: EndpointSpecs, model: PathPatchableModel, end: str) -> list[Endpoint]:
    """Return the endpoints of ``SITE@POS`` specs (`end`: "sender" or "receiver"): one per site of a
    pattern and per head of ``[*]``; endpoints parsed already are returned as they are (a command
    parses its endpoints once and passes them down). A UsageError for a spec that is not
    ``SITE@POS``, for a joint site and for no spec."""
    if isinstance(specs, list) and specs and all(isinstance(spec, Endpoint) for spec in specs):
        return specs
    split = [split_endpoint(spec, end) for spec in as_specs(specs, end)]  # type: ignore[arg-type]
    if not split:
        raise UsageError("a path patch needs a sender and a receiver (SITE@POS each)")
    return [Endpoint(target, position) for site, position in split for target in _single_targets(site, model, end)]


def path_patch(
    model: PathPatchableModel,
    source: Batch | CacheFile | str | Path,
    sender: EndpointSpecs,
    receiver: EndpointSpecs,
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
    pair), or endpoints parsed already (`parse_endpoints`). SITE is one site, a pattern, or a head
    of one (``L0.mixer.z[0]``, ``[*]``: one record per head); POS a position spec (a role, an
    integer, ``all``, ``whole``, ``a+b``).
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
    if via not in VIA:
        raise UsageError(f"unknown path kind {via!r} (available: {', '.join(VIA)})")
    options = PatchOptions(
        metric=metric, threshold=threshold, max_batch=max_batch, context_memory=context_memory, per_example=per_example
    )
    senders, receivers = parse_endpoints(sender, model, "sender"), parse_endpoints(receiver, model, "receiver")
    request = _PathPatch(model, senders, receivers, via, options)
    return chunked_records(source, memory, request.chunks, request.runner, threshold, rows_sink, progress)


def path_chunks(model: PathPatchableModel, cache: CacheFile, memory: int) -> list[slice]:
    """Return the row chunks `path_patch` reads `cache` in at `memory` bytes of row data."""
    # every stored hook: what a path reads depends on its route (an upper bound of a row's bytes)
    return plan(cache, row_bytes(model, cache, cache.keys(), 1), memory, "path patching")


@dataclass(frozen=True)
class _Path:
    """One (sender target, receiver target) pair of a path patch on a batch: their position patches
    and what the route reads and patches (`PathPatchableModel.path_ends`)."""

    sender: Target
    sender_patches: list[PositionPatch]
    receiver: Target
    receiver_patches: list[PositionPatch]
    ends: Any


@dataclass(frozen=True)
class _PathPatch:
    """What every row chunk of one `path_patch` call runs: its endpoints parsed once."""

    model: PathPatchableModel
    senders: list[Endpoint]
    receivers: list[Endpoint]
    via: str
    options: PatchOptions

    def chunks(self, cache: CacheFile, memory: int) -> list[slice]:
        """Return the row chunks of `cache` at `memory` bytes of row data (`path_chunks`)."""
        return path_chunks(self.model, cache, memory)

    def runner(self, cache: CacheFile | None, slices: list[slice] | None) -> RunRows:
        """Return `chunked.chunked_records`'s runner: every chunk of rows runs `rows`."""
        return self.rows

    def rows(
        self, source: Batch | CacheFile | str | Path, progress: Callable[[int], None] | None
    ) -> list[dict[str, Any]]:
        """Return `path_patch`'s records of all rows of `source` at once."""
        options = self.options
        with evaluating(self.model), open_source(source) as (batch, cache):
            paths = self.paths(batch)
            sites = [PatchSite((Target(path.ends.patched, path.receiver.head),)) for path in paths]
            hooks = [hook for path in paths for hook in (*path.ends.reads, path.ends.patched)]
            runs = CleanCorruptRuns(
                self.model,
                batch,
                hooks + hooks_to_start(self.model, sites),
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
            scored = _Scored(
                runs, scorer, len(batch), (p_clean, p_corrupt), (m_clean, m_corrupt), bool(gap > options.threshold)
            )
            pairs = zip(paths, sites, strict=True)
            return [record for path, site in pairs for record in self.path_records(scored, path, site, progress)]

    def paths(self, batch: Batch) -> list[_Path]:
        """Return every (sender, receiver) pair of targets with their positions on `batch` (a
        `resid` path's pairs that never coincide warned about, `_skip_resid_pairs`)."""

        def at_positions(ends: list[Endpoint]) -> list[tuple[Target, list[PositionPatch]]]:
            n_pos = batch.tokens.shape[1]
            return [(end.target, position_patches(end.position, batch.roles, batch.lengths, n_pos)) for end in ends]

        paths = [
            _Path(
                s_target, s_patches, r_target, r_patches, self.model.path_ends(self.via, s_target.hook, r_target.hook)
            )
            for s_target, s_patches in at_positions(self.senders)
            for r_target, r_patches in at_positions(self.receivers)
        ]
        if self.via == "resid":
            _skip_resid_pairs(paths)
        return paths

    def path_records(
        self, scored: _Scored, path: _Path, site: PatchSite, progress: Callable[[int], None] | None
    ) -> list[dict[str, Any]]:
        """Return the records of `path`: per sender position, the receiver positions it meets, the
        receiver patched at its corrupt value plus the path's change (`PathPatchableModel.path_change`)."""
        runs, target, options = scored.runs, site.targets[0], self.options
        pos_axis = pos_axis_of(self.model.hook_dict[target.hook])
        assert pos_axis is not None  # every patched hook of a path has a position axis
        head_axis = None if target.head is None else head_axis_of(self.model, target.hook)
        base = runs.acts(target.hook, "corrupt")
        records = []
        for s_patch in path.sender_patches:
            met = [r for r in path.receiver_patches if self.via != "resid" or _same_position(s_patch, r)]
            if met:
                change = self.model.path_change(path.ends, runs.acts, s_patch.mask.to(runs.device), path.sender.head)
                plan = TargetPlan(target, pos_axis, head_axis, base + change, base)
                probs, values = patched_rows(self.model, runs, site, met, scored.scorer, options, plans=[plan])
                for r_patch, row_probs, row_values in zip(met, probs, values, strict=True):
                    record = {
                        "sender": f"{path.sender.site_label}@{s_patch.label}",
                        "receiver": f"{path.receiver.site_label}@{r_patch.label}",
                        "via": self.via,
                        **patch_record(
                            path.receiver.site_label,
                            target.label,
                            r_patch.label,
                            scored.n,
                            Means(*scored.p_answer, row_probs.mean().item()),
                            Means(*scored.metric, row_values.mean().item()),
                            method="exact",
                            metric_name=options.metric,
                            direction="denoise",
                            passes_filter=scored.passes_filter,
                        ),
                    }
                    if options.per_example:
                        record["p_patched_rows"] = row_probs.tolist()
                        if options.metric != "p_answer":
                            record["metric_patched_rows"] = row_values.tolist()
                    records.append(record)
            if progress is not None:
                progress(len(path.receiver_patches))
        return records


@dataclass(frozen=True)
class _Scored:
    """A batch's clean and corrupt runs, the metric, the batch's rows and the unpatched means
    (clean, corrupt) that every record of a path patch shares."""

    runs: CleanCorruptRuns
    scorer: Metric
    n: int
    p_answer: tuple[float, float]
    metric: tuple[float, float]
    passes_filter: bool


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


def _skip_resid_pairs(paths: list[_Path]) -> None:
    """Warn (`PathSkippedWarning`) about the (sender position, receiver position) pairs of `resid`
    `paths` that coincide in no row, which `path_patch` leaves out; raise a UsageError when that
    is every pair. Returns None."""
    skipped = [
        (path, s_patch, r_patch)
        for path in paths
        for s_patch in path.sender_patches
        for r_patch in path.receiver_patches
        if not _same_position(s_patch, r_patch)
    ]
    if not skipped:
        return
    path, s_patch, r_patch = skipped[0]
    example = f"{path.sender.site_label}@{s_patch.label} -> {path.receiver.site_label}@{r_patch.label}"
    total = sum(len(path.sender_patches) * len(path.receiver_patches) for path in paths)
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
