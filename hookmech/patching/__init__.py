"""Activation patching: exact interchange interventions and attribution patching (AtP, AtP*).

``hookmech.patching.patch(model, source, sites=..., positions=..., method=..., ...)`` is the
entry point. The package's files, in the order a patch flows through them
(docs/architecture.md):

    dispatch.py      `patch`: checks the options, hands over to the exact engine or AtP
    options.py       `PatchOptions`: method, metric, direction, threshold, batching, ablation
    protocol.py      what the engine asks of a model: `PatchableModel` (exact, AtP, DAS), and
                     `AtpStarModel` / `PathPatchableModel` besides for AtP* / path patching
    targets.py       sites as the engine sees them: hooks, heads, joint patches (`parse_sites`)
    runs.py          `CleanCorruptRuns`: the unpatched runs, read from a cache or computed
    metrics.py       the metrics read at the query (one vocabulary) and the attribution score
    plans.py         what a patch writes where: source values or ablations, masks
    reachability.py  which (patch, row) pairs can change the answer (a NaN probe)
    forwards.py      the batched patched forwards: full, or resumed from the patched position
    exact.py         the exact engine: plans, probes and forwards into records
    atp.py           attribution patching (first-order estimates)
    verify.py        `verify_top`: the strongest estimated cells re-run exactly
    paths.py         `path_patch`: a sender's effect on a receiver along one route (resid, head, state, conv)
    atp_star.py      AtP*: attribution patching with the saturation, state and GradDrop fixes
    records.py       the record of one (site, position), shared by both methods
    chunked.py       a cache patched in row chunks (``memory``): records as sums over chunks
    rows_file.py     per-row outputs written to disk as chunks are done (``--per-example``)
    distributed.py   one patch job's row chunks over Ray workers (``--engine ray``)
    plain_loop.py    the deprecated name of `hookmech.oracles.plain_loop` (the plain loop the engine is
                     tested against, no part of it), a thin re-export
"""

from __future__ import annotations

from .atp import attribution_patch, first_order_effects
from .atp_star import atp_star_patch
from .dispatch import patch
from .metrics import METRICS, Metric, attribution_score, corrupt_answers
from .options import ABLATIONS, CONTEXT_MEMORY, DIRECTIONS, METHODS, PatchOptions, check_threshold
from .paths import VIA, PathSkippedWarning, path_patch
from .plans import resample_order
from .protocol import AtpStarModel, HookedModel, PatchableConfig, PatchableModel, PathPatchableModel
from .runs import CleanCorruptRuns
from .targets import PatchSite, Target, head_axis_of, n_heads_of, parse_sites
from .verify import verify_top

__all__ = [
    "ABLATIONS",
    "CONTEXT_MEMORY",
    "DIRECTIONS",
    "METHODS",
    "METRICS",
    "VIA",
    "AtpStarModel",
    "CleanCorruptRuns",
    "HookedModel",
    "Metric",
    "PatchOptions",
    "PatchSite",
    "PathSkippedWarning",
    "PatchableConfig",
    "PatchableModel",
    "PathPatchableModel",
    "Target",
    "atp_star_patch",
    "attribution_patch",
    "attribution_score",
    "check_threshold",
    "corrupt_answers",
    "first_order_effects",
    "head_axis_of",
    "n_heads_of",
    "parse_sites",
    "patch",
    "path_patch",
    "resample_order",
    "verify_top",
]
