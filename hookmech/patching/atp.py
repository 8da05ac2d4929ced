"""Attribution patching (AtP): the first-order estimate of every interchange intervention at once.

Patching a site's activation a at position t from its corrupt value a* to the clean value a'
changes a metric m (p(answer) by default; any of `metrics.METRICS`) by, to first order (Nanda
2023; Syed et al. 2023),

    m(patched) − m(corrupt) ≈ Σ_{t ∈ patch} (a'_t − a*_t) · ∂m/∂a_t |_(corrupt run)

One corrupt forward and one backward per row chunk give ∂m/∂a at every position of every
site, so a whole sweep (sites × positions) costs about one training step. Records are those
of `hookmech.patching.patch` with ``method="atp"`` and ``p_patched = p_corrupt + estimate``;
`verify_top` re-runs the strongest ones exactly.

Caveat: the gradient is that of the hook's output. For a recurrent-state hook whose edits the
mixer re-propagates through the recurrence (``L*.mixer.ssm_state`` …), the unedited forward does
not route later states through the hook, so the estimate holds the direct read-out at t only.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..cache import CacheFile, answer_probs, run_chunks
from ..errors import HookmechError, UsageError
from ..hook_names import block_hook
from ..hooks import pos_axis_of
from ..sites import as_specs, forward_order, hook_to_site, position_patches, resolve_sites
from ..tasks.batch import Batch
from ..validate import refuse_non_finite_run
from .metrics import Metric
from .options import PatchOptions
from .protocol import PatchableModel, check_patchable
from .records import estimate_record
from .runs import CleanCorruptRuns, evaluating, open_source
from .targets import PatchSite, SiteSpecs


def first_order_effects(
    model: PatchableModel,
    corrupt_input: Tensor,
    clean_acts: dict[str, Tensor],
    query: Tensor,
    answers: Tensor,
    *,
    start_at_layer: int | None = None,
    metric: str | Metric = "p_answer",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The gradient core: one corrupt forward and one backward.

    `corrupt_input` is corrupt tokens ``[n, T]`` or, with `start_at_layer=l`, the corrupt residual
    entering block l ``[n, T, d_model]``; `clean_acts` maps each hook to its clean activation
    (shape of the hook's activation, batch axis first); `query`, `answers` are ``[n]``. `metric`
    is a name of `metrics.METRICS` that needs only the answers (p_answer, log_p), or a `Metric`
    of these n rows (logit_diff, kl carry what they need per row).
    Returns ``(m, effects)``: the metric on the corrupt run ``[n]`` and, per hook, ``[n, T]`` the
    first-order change of the metric when that hook is patched clean at position t alone
    (sum over the other axes of ``(clean − corrupt) · ∂m/∂activation``). A patch of several
    positions changes m by the sum of its positions' effects (the estimate is linear).
    """
    values, effects, _ = _first_order(model, corrupt_input, clean_acts, query, answers, start_at_layer, metric)
    return values, effects


def _first_order(
    model: PatchableModel,
    corrupt_input: Tensor,
    clean_acts: dict[str, Tensor],
    query: Tensor,
    answers: Tensor,
    start_at_layer: int | None,
    metric: str | Metric,
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """`first_order_effects`, and the corrupt run's query logits ``[n, d_vocab]`` (detached)."""
    measure = Metric(metric, answers) if isinstance(metric, str) else metric
    hooks = list(clean_acts)
    for hook in hooks:
        if pos_axis_of(model.hook_dict[hook]) is None:
            raise UsageError(f"{hook_to_site(hook)} has no position axis: it cannot be patched at a position")
    corrupt: dict[str, Tensor] = {}
    zeros: dict[str, Tensor] = {}

    def make_hook(name: str):
        def capture(activation: Tensor, hook=None) -> Tensor:
            # Adding a zero leaf leaves the forward unchanged; its gradient is ∂m/∂activation.
            corrupt[name] = activation.detach()
            zeros[name] = torch.zeros_like(activation, requires_grad=True)
            return activation + zeros[name]

        return capture

    with torch.enable_grad():
        logits = model.run_with_hooks(
            corrupt_input,
            start_at_layer=start_at_layer,
            positions=query,
            tail_at_positions=True,
            fwd_hooks=[(hook, make_hook(hook)) for hook in hooks],
        )
        values = measure.values(logits)
        missing = [hook for hook in hooks if hook not in zeros]
        if missing:
            raise HookmechError(f"hook {missing[0]} did not fire in the forward pass")
        # Rows are independent, so the gradient of the sum holds every row's own gradient.
        grads = torch.autograd.grad(values.sum(), [zeros[hook] for hook in hooks], allow_unused=True)
    effects = {}
    for hook, grad in zip(hooks, grads, strict=True):
        clean, dirty = clean_acts[hook].to(corrupt[hook].device, corrupt[hook].dtype), corrupt[hook]
        if clean.shape != dirty.shape:
            raise HookmechError(
                f"clean activation of {hook} has shape {tuple(clean.shape)}, the corrupt run {tuple(dirty.shape)}"
            )
        # Equal entries (masked attention scores are -inf in both runs) contribute nothing.
        difference = torch.where(clean == dirty, torch.zeros_like(clean), clean - dirty)
        if grad is None:  # the metric does not depend on this hook (e.g. a position after the query)
            grad = torch.zeros_like(difference)
        pos_axis = pos_axis_of(model.hook_dict[hook])
        assert pos_axis is not None  # checked above
        product = (difference * grad).movedim(pos_axis, 1)
        effects[hook] = product.flatten(2).sum(-1) if product.dim() > 2 else product
    return values.detach(), effects, logits.detach()


def positional_hooks(model: PatchableModel, sites: SiteSpecs) -> tuple[list[str], int | None]:
    """Return the hooks of site specs `sites` (or of plain sites parsed already, `PatchSite`s) and
    the first block the estimates must run from (None when a hook is outside the blocks: the
    embeddings need the tokens); a UsageError for a site without a position axis (attribution
    patching estimates patches at positions)."""
    given = [sites] if isinstance(sites, str) else list(sites)
    if given and all(isinstance(site, PatchSite) for site in given):
        hooks = forward_order((site.targets[0].hook for site in given), model.hook_dict)  # type: ignore[attr-defined]
    else:
        hooks = resolve_sites(as_specs(given, "site"), model.hook_dict)  # type: ignore[arg-type]
    flat = [hook for hook in hooks if pos_axis_of(model.hook_dict[hook]) is None]
    if flat:
        raise UsageError(
            f"{', '.join(map(hook_to_site, flat))}: no position axis, so no patch at a position "
            "(attribution patching needs one; leave these sites out)"
        )
    layers = [model.layer_of_hook(hook) for hook in hooks]
    return hooks, None if None in layers else min(layer for layer in layers if layer is not None)


def attribution_patch(
    model: PatchableModel,
    source: Batch | CacheFile | str | Path,
    sites: SiteSpecs,
    positions: str | Iterable[str],
    threshold: float = 0.01,
    max_batch: int = 256,
    per_example: bool = False,
) -> list[dict[str, Any]]:
    """Estimate every (site, position) interchange intervention to first order.

    Arguments as `hookmech.patching.patch` (a `Batch`, a cache path or an open `CacheFile`;
    site patterns; position specs: roles, integers, ``all``, ``whole``, ``a+b``; a bare string
    is one spec). Every
    site × position comes from one corrupt forward and one backward per chunk of at most
    `max_batch` rows (from a cache, resumed at the lowest patched layer from the corrupt residual).
    Returns one record per (site, position) with patch's fields
    ``site, hook, pos, attribution, p_clean, p_corrupt, p_patched, n, passes_filter, method,
    metric, direction, metric_clean, metric_corrupt, metric_patched`` (``method="atp"``, metric
    p_answer, direction denoise), where ``p_patched = p_corrupt + `` the mean estimated change of
    p(answer) (plus, when `per_example`, ``[N]`` lists ``p_patched_rows`` and the unpatched runs'
    ``p_clean_rows``, ``p_corrupt_rows``). Estimates are not clipped to [0, 1].
    """
    check_patchable(model)
    if max_batch < 1:
        raise UsageError(f"max_batch must be >= 1, got {max_batch}")
    options = PatchOptions(method="atp", threshold=threshold, max_batch=max_batch, per_example=per_example)
    hooks, start = positional_hooks(model, sites)
    with evaluating(model), open_source(source) as (batch, cache):
        # From tokens the corrupt run is the gradient forward itself (from the tokens): its p(answer)
        # is read there, and only the clean run is computed beforehand. From a cache both are read
        # from the file, and the forward resumes at the lowest patched block.
        if cache is None:
            start = None
        resid = [] if start is None else [block_hook(start, "resid_pre")]
        runs = CleanCorruptRuns(
            model,
            batch,
            list(dict.fromkeys(hooks + resid)),
            cache,
            need_logits=False,
            max_batch=max_batch,
            only=("clean",) if cache is None else ("clean", "corrupt"),
        )
        patches = position_patches(as_specs(positions, "position"), batch.roles, batch.lengths, batch.tokens.shape[1])
        masks = torch.stack([p.mask for p in patches]).double()
        estimates, p_corrupt = _estimates(model, runs, hooks, start, masks, max_batch)
    p_clean_rows = runs.p_answer["clean"].double().cpu()
    p_corrupt_rows = (p_corrupt if cache is None else runs.p_answer["corrupt"]).double().cpu()
    records = []
    for hook in hooks:
        for patch_spec, estimate in zip(patches, estimates[hook], strict=True):
            records.append(
                estimate_record(
                    hook,
                    patch_spec.label,
                    p_clean_rows,
                    p_corrupt_rows,
                    estimate,
                    method="atp",
                    threshold=options.threshold,
                    per_example=per_example,
                )
            )
    return records


def _estimates(
    model: PatchableModel, runs: CleanCorruptRuns, hooks: list[str], start: int | None, masks: Tensor, max_batch: int
) -> tuple[dict[str, Tensor], Tensor]:
    """Return, per hook, the estimated change of p(answer) ``[P, N]`` (float64) of each patch
    (`masks` ``[P, N, T]``) and row, in chunks of `max_batch` rows from block `start`'s input (None:
    the tokens), and p(answer) of the corrupt forward ``[N]`` (float32, as `answer_probs`)."""
    batch, device = runs.batch, runs.device
    clean_all = {hook: runs.acts(hook, "clean") for hook in hooks}
    corrupt_input = (
        batch.corrupt_tokens.to(device) if start is None else runs.acts(block_hook(start, "resid_pre"), "corrupt")
    )
    estimates = {hook: torch.empty(masks.shape[0], len(batch), dtype=torch.float64) for hook in hooks}
    p_corrupt = torch.empty(len(batch))
    for rows in run_chunks(len(batch), max_batch):
        answers = batch.answers[rows].to(device)
        _, effects, logits = _first_order(
            model,
            corrupt_input[rows],
            {h: a[rows] for h, a in clean_all.items()},
            batch.query_pos[rows].to(device),
            answers,
            start,
            "p_answer",
        )
        refuse_non_finite_run(model, logits, batch.corrupt_tokens[rows], "corrupt", rows.start)
        p_corrupt[rows] = answer_probs(logits, answers).cpu()
        for hook in hooks:
            estimates[hook][:, rows] = torch.einsum("pnt,nt->pn", masks[:, rows], effects[hook].double().cpu())
    return estimates, p_corrupt


def verify_priority(record: dict[str, Any]) -> float:
    """Return how strongly `verify_top` wants to check an estimated record: |p_patched − p_corrupt|
    (it orders like |attribution|, one denominator, and exists when that is null), or AtP*'s
    GradDrop score where that is larger."""
    return max(abs(record["p_patched"] - record["p_corrupt"]), record.get("graddrop") or 0.0)
