"""The record of one (site, position) patch: the fields exact patching and AtP both return,
in the order tables and JSON show them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .metrics import attribution_score


@dataclass(frozen=True)
class Means:
    """Means over the rows of one quantity in the clean, corrupt and patched runs."""

    clean: float
    corrupt: float
    patched: float


def patch_record(
    site: str,
    hook: str,
    pos: str,
    n: int,
    p_answer: Means,
    metric: Means,
    *,
    method: str,
    metric_name: str,
    direction: str,
    passes_filter: bool,
) -> dict[str, Any]:
    """Return one record: ``site, hook, pos, attribution, p_clean, p_corrupt, p_patched, n,
    passes_filter, method, metric, direction, metric_clean, metric_corrupt, metric_patched``
    (p_* are mean p(answer), metric_* the metric's means, attribution is computed from metric_*)."""
    return {
        "site": site,
        "hook": hook,
        "pos": pos,
        "attribution": attribution_score(metric.clean, metric.corrupt, metric.patched, direction),
        "p_clean": p_answer.clean,
        "p_corrupt": p_answer.corrupt,
        "p_patched": p_answer.patched,
        "n": n,
        "passes_filter": passes_filter,
        "method": method,
        "metric": metric_name,
        "direction": direction,
        "metric_clean": metric.clean,
        "metric_corrupt": metric.corrupt,
        "metric_patched": metric.patched,
    }
