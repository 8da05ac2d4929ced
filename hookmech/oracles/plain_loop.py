"""The plain TransformerLens patching loop: one full forward per (site, position), written the
way a TransformerLens user would. It is the independent reference the engine is tested and
benchmarked against, not a code path of the engine (no module of the library imports it). It
shares only the definitions of the options with the engine (site grammar, which row a resample
takes, the corrupted answer). Frozen: bench/patch_engine.py times the engine against it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..cache import answer_probs
from ..patching.metrics import corrupt_answers
from ..patching.plans import resample_order
from ..patching.targets import parse_sites
from ..sites import position_patches
from ..tasks.batch import Batch


def plain_metric(name: str, logits, answers, other_answers, clean_logits):
    """Return the per-row metric `name` (``p_answer``, ``log_p``, ``logit_diff``, ``kl``) of the
    query `logits` ``[N, d_vocab]``, written out plainly."""
    rows = torch.arange(len(answers))
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    if name == "p_answer":
        return log_probs[rows, answers].exp()
    if name == "log_p":
        return log_probs[rows, answers]
    if name == "logit_diff":
        return logits[rows, answers] - logits[rows, other_answers]
    clean = torch.log_softmax(clean_logits.float(), dim=-1)
    return (clean.exp() * (clean - log_probs)).sum(-1)


@torch.no_grad()
def plain_loop_patch(
    model,
    batch: Batch,
    sites: Iterable[str],
    positions: Iterable[str],
    metric: str = "p_answer",
    direction: str = "denoise",
    ablate: str | None = None,
    ablate_seed: int = 0,
) -> dict[tuple[str, str], dict]:
    """Return ``{(hook label, pos label): {"p_clean", "p_corrupt", "p_patched", "metric_clean",
    "metric_corrupt", "metric_patched"}}`` (means over rows), patching with `run_with_hooks` on
    the full input of the base run (corrupt for "denoise", clean for "noise" and ablations)."""
    patch_sites = parse_sites(list(sites), model)
    patches = position_patches(list(positions), batch.roles, batch.lengths, batch.tokens.shape[1])
    rows = torch.arange(len(batch))
    query = batch.query_pos
    cached_hooks = sorted({target.hook for site in patch_sites for target in site.targets})
    clean_logits, clean_cache = model.run_with_cache(batch.tokens, names_filter=cached_hooks)
    corrupt_logits, corrupt_cache = model.run_with_cache(batch.corrupt_tokens, names_filter=cached_hooks)
    clean_q, corrupt_q = clean_logits[rows, query], corrupt_logits[rows, query]
    other = corrupt_answers(batch, corrupt_q)

    def score(query_logits):
        return (
            answer_probs(query_logits, batch.answers).double().mean().item(),
            plain_metric(metric, query_logits, batch.answers, other, clean_q).double().mean().item(),
        )

    p_clean, m_clean = score(clean_q)
    p_corrupt, m_corrupt = score(corrupt_q)
    noising = ablate is not None or direction == "noise"
    base_tokens = batch.tokens if noising else batch.corrupt_tokens
    source_cache = corrupt_cache if direction == "noise" else clean_cache
    replacement = _Replacement(
        source_cache, clean_cache, ablate, resample_order(len(batch), ablate_seed), batch.lengths
    )
    results = {}
    for site in patch_sites:
        for patch_spec in patches:
            hooks = [(target.hook, _patch_hook(model, target, patch_spec.mask, replacement)) for target in site.targets]
            logits = model.run_with_hooks(base_tokens, fwd_hooks=hooks)
            p_patched, m_patched = score(logits[rows, query])
            results[site.hook, patch_spec.label] = {
                "p_clean": p_clean,
                "p_corrupt": p_corrupt,
                "p_patched": p_patched,
                "metric_clean": m_clean,
                "metric_corrupt": m_corrupt,
                "metric_patched": m_patched,
            }
    return results


def _patch_hook(model, target, mask, replacement: _Replacement):
    """Return the forward hook that replaces `target`'s activation at the (row, position) pairs
    of `mask` ``[N, T]``, one element at a time, by `replacement`'s value."""
    point = model.hook_dict[target.hook]
    pos_axis = point.pos_axis
    head_axis = point.axes.split().index("head") if target.head is not None else None

    def patch_hook(activation, hook):
        activation = activation.clone()
        for row, position in mask.nonzero().tolist():
            index: Any = [slice(None)] * activation.dim()  # a list, then the tuple that indexes
            index[0], index[pos_axis] = row, position
            if target.head is not None:
                index[head_axis] = target.head
            index = tuple(index)
            activation[index] = replacement.value(target.hook, index, position)
        return activation

    return patch_hook


@dataclass(frozen=True)
class _Replacement:
    """Where a patched element's new value comes from: the source run's cache (`ablate` None) or
    an ablation of the clean run's (zero, `resample`'s partner row, the mean over the rows that
    have the position, of `lengths` ``[N]``)."""

    source_cache: Any
    clean_cache: Any
    ablate: str | None
    resample: Any
    lengths: Any

    def value(self, name: str, index: tuple, position: int) -> Any:
        """Return the new value of element `index` (at `position`) of hook `name`'s activation."""
        clean = self.clean_cache[name]
        if self.ablate is None:
            return self.source_cache[name][index]
        if self.ablate == "zero":
            return 0.0
        if self.ablate == "resample":
            return clean[(int(self.resample[index[0]]), *index[1:])]
        have = [r for r in range(len(self.lengths)) if position < int(self.lengths[r])]  # the mean over them
        return sum(clean[(r, *index[1:])] for r in have) / len(have)
