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
from .exact import exact_patch
from .options import CONTEXT_MEMORY, PatchOptions
from .protocol import PatchableModel, check_patchable
from .runs import evaluating
from .targets import parse_sites


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
    options = PatchOptions(threshold=threshold, max_batch=max_batch, context_memory=context_memory)  # checked here
    top = sorted(atp_records, key=lambda r: -verify_priority(r))[:k]
    by_hook: dict[str, list[str]] = {}
    for record in top:
        by_hook.setdefault(record["hook"], []).append(record["pos"])
    exact_records: dict[tuple[str, str], dict] = {}
    with contextlib.ExitStack() as stack:
        if isinstance(source, (str, Path)):
            source = stack.enter_context(CacheFile(source))
        batch = source.batch() if isinstance(source, CacheFile) else source
        specs_of = {hook: _position_specs(labels, batch.lengths) for hook, labels in by_hook.items()}
        if exact is None and not isinstance(source, CacheFile):
            # from tokens, every hook's cells on one pair of clean and corrupt runs (a cache is
            # read a chunk of rows at a time, per hook, by `patch`)
            for record in _cells_on_shared_runs(model, source, specs_of, options):
                exact_records[record["hook"], record["pos"]] = record
            specs_of = {}
        for hook, specs in specs_of.items():
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


def _position_specs(labels: list[str], lengths: Tensor) -> list[str]:
    """Return the position specs that patch the cells `labels` of one hook (their records' labels)."""
    specs = list(dict.fromkeys(labels))
    if any(_needs_all(label, lengths) for label in specs):
        # `all` leaves rows shorter than p unpatched; an integer spec would refuse them.
        specs = ["all", *(label for label in specs if not label.isdigit())]
    return specs


def _cells_on_shared_runs(
    model: PatchableModel, batch: Batch, specs_of: dict[str, list[str]], options: PatchOptions
) -> list[dict[str, Any]]:
    """Return the exact engine's records of each hook of `specs_of` at its own position specs, all
    from one clean and one corrupt run (`exact_patch`'s `site_positions`): the records `patch`
    gives hook by hook, without its runs once per hook."""
    check_patchable(model)
    sites = parse_sites(list(specs_of), model)
    with evaluating(model):
        return exact_patch(
            model, batch, None, sites, [], options, site_positions={site: specs_of[site.hook] for site in sites}
        )


def _needs_all(label: str, lengths: Tensor) -> bool:
    """True for a label of `all` (a position p >= 0) that some rows are too short to hold."""
    return label.isdigit() and bool((lengths <= int(label)).any())
