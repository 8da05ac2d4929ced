"""Mechanistic evaluation during and after training: attributions on a fixed dev batch.

`mech_callback` builds the trainer's ``on_eval(step, model)``: every `every` steps it runs the
exact patching engine (`patching.patch`) on one batch drawn once, so the emergence of induction
(attribution at the value) or direct retrieval (at the query) can be plotted against loss and
accuracy (paper 003 §5). Its dict goes into that step's ``metrics.jsonl`` line::

    {"attr:L1.block_in@value": 0.93, "attr:L1.block_in@query": 0.02, ...,
     "mech_n": 320, "mech_p_clean": 0.97, "mech_p_corrupt": 0.03, "mech_passes": true}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .errors import UsageError

# torch, the model and the patching engine are imported where used: this module loads without torch

#: seed stream of the mechanistic batch; the trainer uses streams 0-3 (train, dev, fresh, order)
MECH_STREAM = 4
DEFAULT_SITES = ("L1.block_in",)
DEFAULT_POSITIONS = ("key", "value", "query")
#: default `--mech-every`, in evaluations: every second one keeps the overhead near 5% of training
#: (one measurement on 320 rows costs about 10% of 200 training steps; docs/performance.md)
DEFAULT_EVERY_EVALS = 2


def mech_batch(task, seed: int, n: int):
    """Return the fixed batch of `n` rows on which attributions are measured (pure in `seed`)."""
    if n < 1:
        raise UsageError(f"mechanistic evaluation needs n >= 1 examples, got {n}")
    return task.sample(n, seed=(seed, MECH_STREAM))


def attribution_columns(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Return the flat columns of patching records: ``attr:<site>@<pos>`` (None when undefined)
    plus ``mech_n, mech_p_clean, mech_p_corrupt, mech_passes`` (shared by all records)."""
    if not records:
        return {}
    first = records[0]
    columns: dict[str, Any] = {
        "mech_n": first["n"],
        "mech_p_clean": first["p_clean"],
        "mech_p_corrupt": first["p_corrupt"],
        "mech_passes": first["passes_filter"],
    }
    for record in records:
        columns[f"attr:{record['site']}@{record['pos']}"] = record["attribution"]
    return columns


def evaluate_mechanism(
    model, batch, sites: Sequence[str], positions: Sequence[str], threshold: float = 0.01, max_batch: int = 256
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Patch every (site, position) on `batch`; return ``(records, attribution_columns(records))``."""
    from .patching import patch

    records = patch(model, batch, sites=sites, positions=positions, threshold=threshold, max_batch=max_batch)
    return records, attribution_columns(records)


def check_mech_options(task, model_config, sites: Sequence[str], positions: Sequence[str]) -> None:
    """Raise a UsageError now (not thousands of steps later) when a site does not exist in
    models of `model_config` or a position is not one of `task`'s."""
    import torch

    from .model import HookedLM

    state = torch.random.get_rng_state()
    try:
        hook_names = HookedLM(model_config).hook_dict
    finally:
        torch.random.set_rng_state(state)  # building a probe model must not move the trainer's RNG
    check_sites_and_positions(hook_names, task.sample(2, seed=(0, MECH_STREAM)), sites, positions)


def check_sites_and_positions(hook_names, batch, sites: Sequence[str], positions: Sequence[str]) -> None:
    """Raise a UsageError when a site matches no hook of `hook_names` or a position is not one of
    `batch`'s rows (a role of its task, or an index inside every row); return None otherwise."""
    from .sites import position_patches, resolve_sites

    resolve_sites(sites, hook_names)
    position_patches(positions, batch.roles, batch.lengths, batch.tokens.shape[1])


def mech_callback(
    task,
    model_config,
    *,
    sites: Sequence[str] = DEFAULT_SITES,
    positions: Sequence[str] = DEFAULT_POSITIONS,
    every: int,
    eval_every: int,
    total_steps: int,
    n: int = 320,
    seed: int = 0,
    threshold: float = 0.01,
    device: str = "cpu",
) -> Callable[[int, Any], dict[str, Any]]:
    """Return ``on_eval(step, model) -> dict`` for `hookmech.training.train`.

    The trainer calls it at each evaluation (multiples of `eval_every` and the last step);
    it measures attributions when `step` is a multiple of `every` or the last step, and returns
    `attribution_columns` then, ``{}`` otherwise. `every` must be a multiple of `eval_every`.
    """
    if every < 1:
        raise UsageError(f"--mech-every must be >= 1, got {every}")
    if every % eval_every:
        raise UsageError(
            f"--mech-every {every} must be a multiple of --eval-every {eval_every} "
            "(attributions are measured at evaluations)"
        )
    from .patching import check_threshold
    from .sites import as_specs

    check_threshold(threshold)
    sites, positions = as_specs(sites), as_specs(positions)
    check_mech_options(task, model_config, sites, positions)
    batch = mech_batch(task, seed, n).trimmed()

    def on_eval(step: int, model) -> dict[str, Any]:
        if step % every and step != total_steps:
            return {}
        return evaluate_mechanism(model, batch, sites, positions, threshold)[1]

    return on_eval
