"""The plain TransformerLens patching loop: one full corrupt forward per (site, position),
written the way a TransformerLens user would. It is the independent reference the engine
is tested and benchmarked against, not a code path of the engine."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .cache import answer_probs
from .sites import position_patches, resolve_sites
from .tasks.batch import Batch


@torch.no_grad()
def plain_loop_patch(model, batch: Batch, sites: Iterable[str], positions: Iterable[str]) -> dict[tuple[str, str], dict]:
    """Return ``{(hook, pos label): {"p_clean", "p_corrupt", "p_patched"}}`` (means over rows),
    patching with `run_with_hooks` on the full corrupt tokens."""
    hooks = resolve_sites(list(sites), model.hook_dict)
    patches = position_patches(list(positions), batch.roles, batch.lengths, batch.tokens.shape[1])
    rows = torch.arange(len(batch))
    clean_logits, clean_cache = model.run_with_cache(batch.tokens)
    corrupt_logits = model(batch.corrupt_tokens)
    query = batch.query_pos
    p_clean = answer_probs(clean_logits[rows, query], batch.answers).mean().item()
    p_corrupt = answer_probs(corrupt_logits[rows, query], batch.answers).mean().item()
    results = {}
    for hook in hooks:
        axis = model.hook_dict[hook].pos_axis
        for patch_spec in patches:
            def patch_hook(activation, hook, mask=patch_spec.mask, name=hook):
                activation = activation.clone()
                for row, position in mask.nonzero().tolist():
                    index = [slice(None)] * activation.dim()
                    index[0], index[axis] = row, position
                    activation[tuple(index)] = clean_cache[name][tuple(index)]
                return activation

            logits = model.run_with_hooks(batch.corrupt_tokens, fwd_hooks=[(hook, patch_hook)])
            p_patched = answer_probs(logits[rows, query], batch.answers).mean().item()
            results[hook, patch_spec.label] = {"p_clean": p_clean, "p_corrupt": p_corrupt, "p_patched": p_patched}
    return results
