"""AtP*'s exact query step: a patch's change of the output of the mixer before the last, carried
on exactly through the last block at the query (`QueryStep`; `atp_star` module docstring, fix 2).

The last block resumes at the query alone from the corrupt run's mixer contexts: those of the
whole run (`CleanCorruptRuns.resume_contexts`, from a cache) or, from tokens, each row chunk's own,
made from the mixer inputs of the estimator's corrupt forward while they fit in the runs'
`context_memory`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..hook_names import block_hook
from ..mixers.capabilities import PatchMemo
from .metrics import answer_log_odds
from .protocol import AtpStarModel
from .runs import CleanCorruptRuns


class QueryStep:
    """The last block's exact query step of one AtP* run, chunk after chunk (`correction`)."""

    def __init__(self, model: AtpStarModel, runs: CleanCorruptRuns, max_batch: int, from_tokens: bool):
        self.model, self.runs, self.max_batch = model, runs, max_batch
        #: the contexts are the chunk's own, made from the estimator's corrupt forward (else the runs')
        self.from_tokens = from_tokens
        self.chunk_contexts: dict[int, dict[str, Tensor]] = {}
        #: once over the runs' `context_memory`, for every chunk
        self.contexts_refused = runs.context_memory <= 0
        self.memo = PatchMemo()

    def new_chunk(self, memo: PatchMemo) -> None:
        """Forget the last chunk's contexts; `memo` is the new chunk's (what the mixers' patch
        computations of that chunk share with its contexts)."""
        self.chunk_contexts, self.memo = {}, memo

    def correction(
        self,
        layer: int,
        resid: Tensor,
        moved: Tensor,
        base,
        gradient: Tensor,
        rows: Tensor,
        query: Tensor,
        answers: Tensor,
        log_odds: Tensor,
    ) -> Tensor | None:
        """Return ``[n, T]`` float64: per patched position s, the exact change of λ through the last
        block at the query minus its linear estimate there, for a block-level patch whose next
        mixer (block `layer`) is the one before the last; None where the contexts do not fit.

        Block `layer`'s output at the query under the patch at s (its mixer's change there, the
        residual's own change when s is the query) enters the last block, which resumes on the
        query alone from the corrupt run's context: the last mixer's own nonlinearity at the query
        (a readout C_q·h, a gate, a softmax row) is computed, not linearised. Changes the patch
        makes at other positions of the last block's input stay first order. `moved` ``[n, T,
        d_model]`` is the mixer's output change at the query under the patch at each s
        (`AtpStarModel.mixer_patch_outputs`), `gradient` ``[n, T, d_model]`` ∂λ/∂(its output),
        `resid` ``[n, T, d_model]`` the residual entering block `layer` under each position's own
        patch (`patch_to_next_mixer`), `rows` the rows' indices in the batch."""
        model = self.model
        found = self._contexts(layer + 1, base, rows)
        if found is None:
            return None
        contexts, rows = found
        n, n_pos, _ = moved.shape
        at_query = torch.arange(n, device=query.device), query
        own = torch.arange(n_pos, device=query.device)[None, :] == query[:, None]  # [n, s]: s is the query
        resid_change = (resid - base(block_hook(layer, "resid_pre")))[at_query]  # [n, d_model]
        # only pairs the patch changes at the query resume (a patch after the query changes nothing)
        pair_row, pair_pos = ((moved != 0).any(-1) | own & (resid_change != 0).any(-1)[:, None]).nonzero(as_tuple=True)
        correction = torch.zeros(n, n_pos, dtype=torch.float64, device=query.device)
        if len(pair_row) == 0:
            return correction
        own_change = own[pair_row, pair_pos, None] * resid_change[pair_row]  # [P, d_model]
        before = base(block_hook(layer, "resid_pre"))[at_query][pair_row] + own_change
        mixed = base(block_hook(layer, "mixer_out"))[at_query][pair_row] + moved[pair_row, pair_pos]
        window = {block_hook(layer, "resid_pre"): before[:, None]}
        route = model.patch_to_next_mixer(block_hook(layer, "mixer_out"), mixed[:, None], lambda hook: window[hook])
        assert route is not None  # a block-level hook
        pair_query = query[pair_row]
        entering = block_hook(layer + 1, "resid_pre")
        # resume takes the base run's residual; the pairs' own enters through the block's input hook
        with model.hooks(fwd_hooks=[(entering, lambda activation, hook=None: route[1])]):
            logits = model.resume(route[1], layer + 1, contexts, rows[pair_row], pair_query, pair_query)
        exact = answer_log_odds(logits, answers[pair_row]) - log_odds[pair_row]
        linear = ((moved[pair_row, pair_pos] + own_change) * gradient[pair_row, pair_query]).sum(-1)
        correction[pair_row, pair_pos] = (exact - linear).double()
        return correction

    def _contexts(self, layer: int, base, rows: Tensor) -> tuple[dict[int, dict[str, Tensor]], Tensor] | None:
        """Return (the corrupt run's mixer contexts of blocks `layer` .. last, the indices of the chunk's
        rows `rows` ``[n]`` in them), or None when they do not fit in the runs' `context_memory` bytes. Read off
        the gradient forward (`capture`): the chunk's own, made from its mixer inputs once per
        chunk; else the whole run's, from `runs`."""
        if not self.from_tokens:
            found = self.runs.resume_contexts(layer, "corrupt", self.max_batch)
            return None if found is None else (found, rows)
        if self.contexts_refused:
            return None
        for index in range(layer, self.model.cfg.n_layers):
            if index not in self.chunk_contexts:
                mixer_in = base(block_hook(index, "mixer_in"))
                self.chunk_contexts[index] = self.model.layer_patch_context(index, mixer_in, self.memo)
        contexts = {index: self.chunk_contexts[index] for index in range(layer, self.model.cfg.n_layers)}
        size = sum(t.numel() * t.element_size() for context in contexts.values() for t in context.values())
        # the budget is the whole run's, as `CleanCorruptRuns.resume_contexts` keeps it (a cache
        # source gives the same estimates): this chunk's contexts scaled to every row
        if size * len(self.runs.batch) / len(rows) > self.runs.context_memory:
            self.contexts_refused, self.chunk_contexts = True, {}
            return None
        return contexts, torch.arange(len(rows), device=rows.device)
