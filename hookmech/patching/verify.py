"""`verify_top`: the strongest cells of attribution patching (AtP, AtP*) re-run exactly."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor

from ..cache import CacheFile
from ..errors import UsageError
from ..tasks.batch import Batch
from .atp import verify_priority
from .chunked import DEFAULT_MEMORY
from .dispatch import patch
from .options import CONTEXT_MEMORY, PatchOptions
from .protocol import PatchableModel


def verify_top(
    model: PatchableModel,
    source: Batch | CacheFile | str | Path,
    atp_records: list[dict[str, Any]],
    k: int,
    threshold: float = 0.01,
    max_batch: int = 256,
    context_memory: int = CONTEXT_MEMORY,
    memory: int | None = DEFAULT_MEMORY,
    exact: Callable[[list[str], list[str]], list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """Re-run the `k` records with the largest |AtP estimate| (`verify_priority`: with AtP*'s
    GradDrop score) exactly (`hookmech.patching.patch`, with `threshold`, `max_batch` and
    `context_memory` as there; a cache read in row chunks of about `memory` bytes). `exact(sites,
    positions)`, when given, runs those exact patches instead (e.g. on a Ray cluster: `distributed`).

    `source` must be the one the records were computed from. Returns those `k` records, strongest
    first, each the AtP record (``attribution``, ``p_patched`` still the estimate, ``method`` "atp" or "atp-star")
    plus ``attribution_exact`` and ``p_patched_exact`` from the exact engine.
    """
    if k < 1:
        raise UsageError(f"--verify-top must be >= 1, got {k}")
    PatchOptions(threshold=threshold, max_batch=max_batch, context_memory=context_memory)  # checked here
    top = sorted(atp_records, key=lambda r: -verify_priority(r))[:k]
    by_hook: dict[str, list[str]] = {}
    for record in top:
        by_hook.setdefault(record["hook"], []).append(record["pos"])
    exact_records: dict[tuple[str, str], dict] = {}
    with contextlib.ExitStack() as stack:
        if isinstance(source, (str, Path)):
            source = stack.enter_context(CacheFile(source))
        batch = source.batch() if isinstance(source, CacheFile) else source
        for hook, labels in by_hook.items():
            specs = list(dict.fromkeys(labels))
            if any(_needs_all(label, batch.lengths) for label in specs):
                # `all` leaves rows shorter than p unpatched; an integer spec would refuse them.
                specs = ["all", *(label for label in specs if not label.isdigit())]
            if exact is None:
                records = patch(
                    model,
                    source,
                    [hook],
                    specs,
                    threshold=threshold,
                    max_batch=max_batch,
                    context_memory=context_memory,
                    memory=memory,
                )
            else:
                records = exact([hook], specs)
            for record in records:
                exact_records[hook, record["pos"]] = record
    verified = []
    for record in top:
        match = exact_records[record["hook"], record["pos"]]
        verified.append({**record, "attribution_exact": match["attribution"], "p_patched_exact": match["p_patched"]})
    return verified


def _needs_all(label: str, lengths: Tensor) -> bool:
    """True for a label of `all` (a position p >= 0) that some rows are too short to hold."""
    return label.isdigit() and bool((lengths <= int(label)).any())
