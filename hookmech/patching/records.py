"""The record of one (site, position) patch: the fields exact patching and AtP both return,
in the order tables and JSON show them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..sites import hook_to_site
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


def estimate_record(
    hook: str,
    pos: str,
    p_clean_rows: Tensor,
    p_corrupt_rows: Tensor,
    shift: Tensor,
    *,
    method: str,
    threshold: float,
    per_example: bool,
) -> dict[str, Any]:
    """Return the record of an estimated (site, position) cell (AtP, AtP*): p_patched is p_corrupt
    plus the mean estimated change `shift` ``[N]`` (float64) of p(answer); the metric is p(answer),
    denoising. With `per_example` it also holds ``p_patched_rows``, ``p_clean_rows`` and
    ``p_corrupt_rows`` (lists of N floats), from `p_clean_rows` and `p_corrupt_rows` ``[N]``."""
    p_clean, p_corrupt = p_clean_rows.mean().item(), p_corrupt_rows.mean().item()
    p_answer = Means(p_clean, p_corrupt, p_corrupt + shift.mean().item())
    record = patch_record(
        hook_to_site(hook),
        hook,
        pos,
        len(shift),
        p_answer,
        p_answer,
        method=method,
        metric_name="p_answer",
        direction="denoise",
        passes_filter=bool(p_clean - p_corrupt > threshold),
    )
    if per_example:
        record["p_patched_rows"] = (p_corrupt_rows + shift).tolist()
        record["p_clean_rows"] = p_clean_rows.tolist()
        record["p_corrupt_rows"] = p_corrupt_rows.tolist()
    return record
