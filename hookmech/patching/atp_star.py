"""AtP*: attribution patching with the fixes of Kramár et al. 2024 ("AtP*: An efficient and
scalable method for localizing LLM behaviour to components"), and the one these models need most.

Plain AtP (`atp.py`) linearises the whole model around the corrupt run. On the recall models
here it ranks cells fairly well, but its values fail where they matter most, for four reasons,
each with its fix (one corrupt forward, then backward passes, per row chunk, as AtP):

1. **The metric saturates.** p(answer) ≈ 0 on the corrupt run, so ∂p/∂activation ≈ 0 even
   where a patch takes p to 1. AtP* estimates the change of the answer's log-odds,
   λ = log p − log(1 − p) = logit(answer) − logsumexp(other logits), which is close to linear
   in the logits while p is small, and maps it back: p_patched = σ(λ_corrupt + Δλ). (Kramár et
   al. measure logit differences; this mapping is this package's.)
2. **Attention saturates** (Kramár et al. §3.1.1). A query that does not attend to a key has
   no gradient towards it. For each patched position, the first mixer the patch reaches is
   computed exactly (`AtpStarModel.mixer_patch_effects`, i.e. the mixer's `ExactPatchEffects`:
   attention recomputes its softmax for the patched key, query and value), and only what comes
   after that mixer is linearised. A block-level patch reaches that mixer's input
   position-wise (`AtpStarModel.patch_to_next_mixer`): the estimate at position s is

       Δλ_s = (r'_s − r_s) · g_s + Σ_t (y'_t − y_t) · g_t

   with r, r' the residual entering the mixer's block before and after the patch, y, y' the
   mixer's outputs, and g = ∂λ/∂(mixer output) (the gradient of the residual after the mixer).
   Patches of a mixer's own q / k / v / scores go to the same method. Mixers without it keep
   the linear estimate. Where that mixer is the one before the last and can say how its output
   at the query changes (`AtpStarModel.mixer_patch_outputs`: Mamba), that change goes on
   through the last block exactly, resumed at the query alone from the corrupt run's context:
   the g_q·(y'_q − y_q) term is replaced by the exact change of λ. A patch whose effect passes
   the last mixer's own nonlinearity at the query (a read-out C_q·h, a gate) is then not lost to
   the linearisation; changes at the last block's other positions stay first order.
3. **Recurrent states** (``L*.mixer.ssm_state`` …): an edit there is carried on by the
   recurrence; the gradient at the state hook follows it (`hooks.gradients_follow_edits`).
4. **Cancellation: GradDrop** (Kramár et al. §3.1.2; opt-in, ``graddrop=True``, since it changed
   no ranking on any model docs/performance.md measures). For each layer ℓ, one more backward pass
   with the gradient flowing from ℓ's sublayers back into the residual stream dropped (started
   at block ℓ, not at the logits: `graddrop.GradientPasses`); a cell's ``graddrop`` score is the
   mean over ℓ of |estimated change of p| under each. A cell whose paths cancel in the full
   gradient shows up there. `verify_top` checks cells in order of max(|estimate|, graddrop).

The backward passes run only to the hooks that need a gradient: every block's mixer output and
the hooks estimated linearly; a hook whose patch a mixer computes exactly needs none
(`AtpStarModel.mixer_patches_exactly`, asked before the forward). From tokens, with the rows in
one chunk and no GradDrop, the corrupt forward and its backward run from each row's first
corrupted token only (`atp_star_resumed`).

Records are those of `hookmech.patching.patch` with ``method="atp-star"``, ``p_patched`` the
mean over rows of p_corrupt + σ(λ_corrupt + Δλ) − σ(λ_corrupt), and ``graddrop``. A patch of
several positions sums their Δλ (the estimate stays first order across positions).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..allocator import keep_freed_memory
from ..cache import CacheFile, answer_probs, run_chunks
from ..errors import HookmechError
from ..hook_names import block_hook, parse_hook
from ..hooks import gradients_follow_edits, pos_axis_of
from ..mixers.capabilities import MixerMemo, PatchMemo
from ..sites import as_specs, position_patches
from ..tasks.batch import Batch
from .atp import positional_hooks
from .atp_star_query import QueryStep
from .atp_star_resumed import ResumedCorruptRun, fires_on_windows
from .chunked import GRADDROP_LAYERS
from .graddrop import GradientPasses
from .metrics import answer_log_odds
from .options import CONTEXT_MEMORY, PatchOptions
from .protocol import AtpStarModel, PatchableModel, check_patchable
from .records import estimate_record
from .runs import CleanCorruptRuns, evaluating, open_source
from .targets import SiteSpecs


def atp_star_patch(
    model: PatchableModel,
    source: Batch | CacheFile | str | Path,
    sites: SiteSpecs,
    positions: str | Iterable[str],
    threshold: float = 0.01,
    max_batch: int = 256,
    per_example: bool = False,
    graddrop: bool = False,
    context_memory: int = CONTEXT_MEMORY,
    graddrop_layers: bool = False,
) -> list[dict[str, Any]]:
    """Estimate every (site, position) interchange intervention with AtP* (module docstring).

    Arguments as `attribution_patch` (plain sites; position specs). With `graddrop` one more
    backward pass per layer gives each record its ``graddrop`` score (off by default: it changed
    no ranking on any model docs/performance.md measures, and it adds a backward pass per layer). `context_memory`
    (bytes) bounds the corrupt run's resume contexts the last block's exact query step keeps, as
    in `hookmech.patching.patch`: beyond it the step runs on every position (slower, same numbers).
    Returns one record per (site, position) with patch's fields (``method="atp-star"``,
    metric p_answer, direction denoise), ``p_patched`` the estimate (always within [0, 1]),
    plus ``graddrop`` (mean over layers of |estimated change of mean p| with that layer's
    gradient dropped; None without `graddrop`) and ``p_patched_rows`` ``[N]`` when `per_example`.
    With `graddrop` and `graddrop_layers`, also ``graddrop_layers``: each layer's mean change
    (signed), from which `chunked.RecordSums` adds up the score of rows patched apart.
    """
    check_patchable(model, atp_star=True)  # more than exact patching asks: AtP*'s own members
    assert isinstance(model, AtpStarModel)  # for mypy: checked above
    keep_freed_memory()  # its runs' and effects' multi-MB temporaries: hookmech/allocator.py
    options = PatchOptions(method="atp-star", threshold=threshold, max_batch=max_batch, per_example=per_example)
    hooks, start = positional_hooks(model, sites)
    blocks = range(0 if start is None else start, model.cfg.n_layers)
    context = _corrupt_hooks_read(model, hooks, blocks)
    with evaluating(model), open_source(source) as (batch, cache):
        # From tokens, the mixers' patch computations read what the runs computed of their inputs
        # (Mamba's in_proj outputs: `AtpStarModel.mixer_patch_reads`) off those runs: of the
        # corrupt run each chunk's, of the clean run where the batch is one chunk (memory as the
        # corrupt run's captures); from a cache, which need not hold them, they are computed.
        reads = {layer: model.mixer_patch_reads(layer) for layer in blocks} if cache is None else {}
        corrupt_reads = [hook for names in reads.values() for hook in names]
        clean_reads = (
            [hook for layer, names in reads.items() if names for hook in [block_hook(layer, "mixer_in"), *names]]
            if len(batch) <= max_batch
            else []
        )
        wanted = list(dict.fromkeys(hooks + context + corrupt_reads))
        # From tokens, the corrupt run's activations are read off the estimator's own corrupt
        # forward (the one its backward passes go through, then run from the tokens), not
        # computed by a second forward; of the clean run only the patched hooks (and reads).
        capture = wanted if cache is None else None
        # Where the batch is one chunk, that forward resumes at each row's first corrupted token
        # from the clean run's contexts (`atp_star_resumed`), and the clean run records every hook
        # the forward records, for the positions before it (GradDrop's passes start from every
        # position of a layer: the whole forward)
        resumed = capture is not None and not graddrop and len(batch) <= max_batch and fires_on_windows(model, wanted)
        runs = CleanCorruptRuns(
            model,
            batch,
            wanted if resumed or not capture else list(dict.fromkeys(hooks + clean_reads)),
            cache,
            need_logits=False,
            max_batch=max_batch,
            base="clean" if resumed else None,
            # the last block may resume at the query from the corrupt run's context (`QueryStep`),
            # made from its mixer input when first asked for
            context_memory=context_memory,
            only=("clean",) if capture else ("clean", "corrupt"),
        )
        patches = position_patches(as_specs(positions, "position"), batch.roles, batch.lengths, batch.tokens.shape[1])
        masks = torch.stack([p.mask for p in patches]).double()  # [P, N, T]
        estimator = _Estimator(model, runs, hooks, start, blocks, graddrop, max_batch, capture)
        estimator.reads, estimator.clean_reads = reads, bool(clean_reads)
        contexts = runs.resume_contexts(0, "clean", max_batch) if resumed else None
        estimator.resumed = None if contexts is None else ResumedCorruptRun(model, runs, contexts)
        shifts, dropped_shifts = _estimated_shifts(estimator, masks, max_batch)
    p_rows = runs.p_answer["clean"], estimator.p_corrupt if capture else runs.p_answer["corrupt"]
    labels = [patch_spec.label for patch_spec in patches]
    return _records(hooks, labels, p_rows, shifts, dropped_shifts, options, graddrop_layers)


def _estimated_shifts(
    estimator: _Estimator, masks: Tensor, max_batch: int
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Return the estimated shifts of p per hook, ``[P, N]``, and with each GradDrop layer's
    gradient dropped, ``[layers, P, N]``, of the patches `masks` ``[P, N, T]``, row chunk by row chunk."""
    n_patches, n_rows = masks.shape[:2]
    hooks, dropped = estimator.hooks, estimator.dropped
    shifts = {hook: torch.empty(n_patches, n_rows, dtype=torch.float64) for hook in hooks}
    dropped_shifts = {hook: torch.empty(len(dropped), n_patches, n_rows, dtype=torch.float64) for hook in hooks}
    for rows in run_chunks(n_rows, max_batch):
        log_odds, variants = estimator.chunk(rows)
        for hook in hooks:
            shifts[hook][:, rows] = _p_shift(log_odds, masks[:, rows], variants[None][hook])
            for index, layer in enumerate(dropped):
                dropped_shifts[hook][index, :, rows] = _p_shift(log_odds, masks[:, rows], variants[layer][hook])
    return shifts, dropped_shifts


def _corrupt_hooks_read(model: AtpStarModel, hooks: list[str], blocks: range) -> list[str]:
    """Return the hooks of the corrupt run the estimates of `hooks` read: each block's input, mixer
    input and output, and the residual before its MLP where that MLP's output is patched (a parallel
    block has none: its MLP reads the block's input); the final norm's input where it is patched."""
    context = [block_hook(layer, part) for layer in blocks for part in ("resid_pre", "mixer_in", "mixer_out")]
    context += [
        block_hook(layer, "resid_mid")
        for layer in blocks
        if block_hook(layer, "mlp_out") in hooks and block_hook(layer, "resid_mid") in model.hook_dict
    ]
    if any(model.resume_layer(hook) == model.cfg.n_layers for hook in hooks):  # the final norm is patched
        context.append(model.resid_hook(model.cfg.n_layers))  # its input
    return context


def _records(
    hooks: list[str],
    labels: list[str],
    p_rows: tuple[Tensor, Tensor],
    shifts: dict[str, Tensor],
    dropped_shifts: dict[str, Tensor],
    options: PatchOptions,
    graddrop_layers: bool,
) -> list[dict[str, Any]]:
    """Return `atp_star_patch`'s records, hook-major: per hook and position label, from p(answer) of
    the clean and corrupt runs ``[N]`` each (`p_rows`), the estimated shifts of p ``[P, N]`` per hook
    and those with each GradDrop layer's gradient dropped ``[layers, P, N]``."""
    p_clean_rows, p_corrupt_rows = (p.double().cpu() for p in p_rows)
    records = []
    for hook in hooks:
        for index, label in enumerate(labels):
            record = estimate_record(
                hook,
                label,
                p_clean_rows,
                p_corrupt_rows,
                shifts[hook][index],
                method="atp-star",
                threshold=options.threshold,
                per_example=options.per_example,
            )
            layer_means = dropped_shifts[hook][:, index].mean(dim=1)
            dropped = len(layer_means) > 0
            record["graddrop"] = layer_means.abs().mean().item() if dropped else None
            if graddrop_layers and dropped:
                record[GRADDROP_LAYERS] = layer_means.tolist()
            records.append(record)
    return records


def _p_shift(log_odds: Tensor, masks: Tensor, per_position: Tensor) -> Tensor:
    """Return ``[P, n]``: σ(λ + Δλ) − σ(λ) per patch (`masks` ``[P, n, T]``) and row, where Δλ sums
    the estimates `per_position` ``[n, T]`` over the patch's positions."""
    change = torch.einsum("pnt,nt->pn", masks, per_position.double().cpu())
    base = log_odds.double().cpu()
    return torch.sigmoid(base + change) - torch.sigmoid(base)


class _Estimator:
    """Per row chunk: the corrupt forward, the backward passes and the per-position estimates
    Δλ ``[n, T]`` of every hook (module docstring)."""

    def __init__(
        self,
        model: AtpStarModel,
        runs: CleanCorruptRuns,
        hooks: list[str],
        start: int | None,
        blocks: range,
        graddrop: bool,
        max_batch: int,
        capture: list[str] | None = None,
    ):
        self.model, self.runs, self.hooks, self.blocks = model, runs, hooks, blocks
        #: the block the corrupt forward starts at, from the corrupt run's residual there (None: the tokens)
        self.start = None if capture is not None else start
        #: the corrupt run's hooks read off the gradient forward (None: from `runs`) and its p(answer) ``[N]``
        self.capture = capture
        self.p_corrupt = torch.empty(len(runs.batch), dtype=torch.float64)
        #: what the mixers' patch computations share within a chunk (`AtpStarModel.mixer_patch_effects`)
        self.memo = PatchMemo()
        #: per block, the hooks inside its mixer whose activations its patch computations read
        #: where given (`AtpStarModel.mixer_patch_reads`; captured by the runs), and whether the
        #: clean run holds them too
        self.reads: dict[int, list[str]] = {}
        self.clean_reads = False
        #: the corrupt forward resumed at each row's first corrupted token (None: the whole forward)
        self.resumed: ResumedCorruptRun | None = None
        self.max_batch = max_batch
        #: per block, (patched mixer input, its mixer's effects) computed by the backward passes
        self.in_backward: dict[int, tuple[Tensor, Tensor]] = {}
        #: the last block's exact query step, resumed from the contexts of that forward's mixer inputs
        self.query_step = QueryStep(model, runs, max_batch, from_tokens=capture is not None)
        self.gradient_hooks = [block_hook(layer, "mixer_out") for layer in blocks]
        #: the hooks whose patches `_exact_terms` computes (no gradient at the hook needed), and the
        #: hooks the backward passes reach: each mixer's output, the linearly estimated hooks
        self.exact_hooks = [hook for hook in hooks if self._computed_exactly(hook)]
        self.exact_layers = [self._exact_layer(hook) for hook in self.exact_hooks]
        self.leaves = list(
            dict.fromkeys([hook for hook in hooks if hook not in self.exact_hooks] + self.gradient_hooks)
        )
        #: the layers whose gradient a GradDrop pass drops (layers the forward runs)
        self.dropped = list(blocks) if graddrop else []
        #: the backward passes: all paths (None), then each GradDrop layer's
        self.variants: list[int | None] = [None, *self.dropped]
        #: the hooks whose outputs GradDrop's passes start from (`GradientPasses`)
        self.seeds = [
            block_hook(index, part)
            for layer in self.dropped
            for index, part in ((layer, "resid_pre"), (layer, "mixer_out"), (layer + 1, "resid_pre"))
            if index < model.cfg.n_layers
        ]

    def _computed_exactly(self, hook: str) -> bool:
        """Return True where `_exact_terms` computes the patch of `hook` (its next mixer exactly,
        or only position-wise computation left), False where the estimate is linear."""
        return self._exact_layer(hook) is not None

    def _exact_layer(self, hook: str) -> int | None:
        """Return the block whose mixer `_exact_terms` computes the patch of `hook` through
        (n_layers where only position-wise computation is left), None where the estimate is linear."""
        model, n_layers = self.model, self.model.cfg.n_layers
        if model.resume_layer(hook) == n_layers:  # the final norm
            return n_layers
        parsed = parse_hook(hook)
        if parsed is not None and parsed.layer is not None and parsed.inside is None:  # `patch_to_next_mixer`
            layer = parsed.layer
            following = layer if parsed.part in ("resid_pre", "mixer_in") else layer + 1
            return following if following == n_layers or model.mixer_patches_exactly(following) else None
        inside = model.layer_of_hook(hook)
        exact = inside is not None and inside in self.blocks and model.mixer_patches_exactly(inside, hook)
        return inside if exact else None

    def _release_memos(self, done: int) -> None:
        """Forget what the mixers keep for `exact_hooks` [0, `done`] in `memo` where no later hook
        reads it: a mixer's memo lives from its first patch computation to its last, except the
        last two blocks' (the query step's: `mixer_patch_outputs`, the last block's contexts)."""
        n_layers = self.model.cfg.n_layers
        later = set(self.exact_layers[done + 1 :])
        for layer in set(self.exact_layers[: done + 1]) - later:
            if layer is not None and layer < n_layers - 2:
                self.memo.forget(layer)

    def chunk(self, rows: slice) -> tuple[Tensor, dict[int | None, dict[str, Tensor]]]:
        """Return (λ on the corrupt run ``[n]``, {None: full estimates, ℓ: estimates with layer ℓ's
        gradient dropped}, each ``{hook: [n, T]}`` float64) for the rows `rows`."""
        runs, model, batch = self.runs, self.model, self.runs.batch
        chunk_acts: dict[tuple[str, str], Tensor] = {}

        def acts(hook: str, which: str) -> Tensor:
            if (hook, which) not in chunk_acts:
                chunk_acts[hook, which] = runs.acts(hook, which)[rows]
            return chunk_acts[hook, which]

        captured: dict[str, Tensor] = {}  # the gradient forward's, as it runs

        def base(hook: str) -> Tensor:
            return captured[hook] if hook in captured else acts(hook, "corrupt")

        corrupt_input = (
            batch.corrupt_tokens[rows].to(runs.device)
            if self.start is None
            else base(block_hook(self.start, "resid_pre"))
        )
        agreement = None if self.resumed is None else self.resumed.agreement(rows)
        self.memo = PatchMemo(lambda layer: self._reads_of(layer, acts, base), agreement)
        self.query_step.new_chunk(self.memo)
        query, answers = batch.query_pos[rows].to(runs.device), batch.answers[rows]
        log_odds, p_answer, grads = self._backward(rows, corrupt_input, query, answers, captured, acts, base)
        self.p_corrupt[rows] = p_answer
        chunk_acts.update({(hook, "corrupt"): activation for hook, activation in captured.items()})
        variants = self.variants
        with torch.no_grad():
            # every backward pass's gradient of each mixer's output, stacked: [V, n, T, d_model]
            stacked = {
                hook: torch.stack([grads[variant][hook] for variant in variants]) for hook in self.gradient_hooks
            }
            rows_index = torch.arange(rows.start, rows.stop, device=runs.device)
            exact = self._exact_terms(stacked, acts, base, query, answers, log_odds, rows_index)
            estimates: dict[int | None, dict[str, Tensor]] = {variant: {} for variant in variants}
            for hook in self.hooks:
                for index, variant in enumerate(variants):
                    if hook not in exact:  # the first-order estimate (plain AtP's, state gradients propagating)
                        estimate = _linear(model, hook, acts(hook, "clean"), base(hook), grads[variant][hook])
                    else:
                        layer, effect, skip = exact[hook]
                        # GradDrop: a pass that drops this layer drops the path through its mixer
                        estimate = skip[index] + (0 if variant == layer else effect[index])
                    estimates[variant][hook] = estimate
        # the chunk's memo (a Mamba block's base decays and states) goes now, not at the next cyclic
        # collection: its gifts' closure refers back to this estimator (1.1 GB at Mamba-130m's shape)
        self.memo = PatchMemo()
        self.query_step.new_chunk(self.memo)
        return log_odds, estimates

    def _reads_of(self, layer: int, acts, base) -> list[tuple[Tensor, dict[str, Tensor]]]:
        """Return what block `layer`'s mixer memo is given when made (`PatchMemo`'s gifts,
        `MixerMemo.give`): its `reads` on the chunk's corrupt mixer input and, with `clean_reads`,
        on the clean one (a block-level patch's mixer input at its own block)."""
        names = self.reads.get(layer, [])
        if not names:
            return []
        short = {name: _inside_name(name) for name in names}
        mixer_in = block_hook(layer, "mixer_in")
        gifts = [(base(mixer_in), {short[name]: base(name) for name in names})]
        if self.clean_reads:
            gifts.append((acts(mixer_in, "clean"), {short[name]: acts(name, "clean") for name in names}))
        return gifts

    def _backward(
        self,
        rows: slice,
        corrupt_input: Tensor,
        query: Tensor,
        answers: Tensor,
        captured: dict[str, Tensor],
        acts,
        base,
    ) -> tuple[Tensor, Tensor, dict[int | None, dict[str, Tensor]]]:
        """One corrupt forward of the rows `rows`; backward passes of λ: all paths, then each GradDrop
        layer's (`GradientPasses`), to the hooks `leaves` only. Returns (λ ``[n]``, p(answer) ``[n]``
        float64 on the CPU, {variant: {hook: gradient}}); with `capture`, the forward's activations
        of those hooks go into `captured` ``{hook: [n, ...]}`` (then read by `base`). With `resumed`,
        the forward runs from each row's first corrupted token (`ResumedCorruptRun`)."""
        model = self.model
        points = [model.hook_dict[hook] for hook in self.hooks]
        if self.resumed is not None:
            found = self._resumed_backward(rows, points, acts, base)
            if found is not None:
                log_odds, p_answer, acts, leaf_grads = found
                captured.update(acts)
                return log_odds, p_answer, {None: leaf_grads}
            self.resumed = None  # a hook fired on whole runs: the whole forward, for every chunk
        zeros: dict[str, Tensor] = {}
        outputs: dict[str, Tensor] = {}
        recorded = set(self.capture or ())

        def leaf(name: str):
            def add_zero(activation: Tensor, hook=None) -> Tensor:
                if name in recorded:
                    captured[name] = activation.detach()
                if name in self.leaves:
                    # a zero leaf leaves the forward unchanged; its gradient is ∂λ/∂activation
                    zeros[name] = torch.zeros_like(activation, requires_grad=True)
                    activation = activation + zeros[name]
                outputs[name] = activation
                return activation

            return add_zero

        with torch.enable_grad(), gradients_follow_edits(points), _parameters_frozen(model):
            logits = model.run_with_hooks(
                corrupt_input,
                start_at_layer=self.start,
                positions=query,
                tail_at_positions=True,
                fwd_hooks=[(hook, leaf(hook)) for hook in dict.fromkeys(self.leaves + self.seeds + [*recorded])],
            )
            log_odds = answer_log_odds(logits, answers)
            p_answer = answer_probs(logits.detach(), answers.to(logits.device)).double().cpu()
            missing = [hook for hook in self.leaves if hook not in zeros]
            if missing:
                raise HookmechError(f"hook {missing[0]} did not fire in the forward pass")
            passes = GradientPasses(
                model,
                log_odds.sum(),
                zeros,
                {name: outputs[name] for name in self.seeds},
                self.dropped,
                lambda: self._final_gradient(base, query, answers),
                query,
            )
            grads = passes.gradients(self.leaves)
        return log_odds.detach(), p_answer, grads

    def _resumed_backward(
        self, rows: slice, points: list, acts, base
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]] | None:
        """`ResumedCorruptRun.run` of the rows `rows` with the forward's hooks, `points` (the patched
        hooks) carrying their edits' gradients; None where it falls back to the whole forward.
        The mixers that can compute the effects of a patch of their input by the backward passes
        (`AtpStarModel.mixer_backward_patch_effects`) do so for each block's input under the
        clean run's block input (`in_backward`, read by `_exact_terms`)."""
        assert self.resumed is not None and self.capture is not None and not self.dropped  # `atp_star_patch`
        resumed, recorded = self.resumed, self.capture
        self.in_backward = {}
        recorders = _backward_recorders(self, rows, acts, base)
        with torch.enable_grad(), gradients_follow_edits(points), _parameters_frozen(self.model), ExitStack() as stack:
            for _, _, recorder in recorders:
                stack.enter_context(recorder.recording())
            with self.model.hooks(fwd_hooks=resumed.hooks(self.leaves, recorded)):
                found = resumed.run(rows, self.leaves, recorded, self.max_batch)
        for layer, mixer_in, recorder in recorders:
            effects = recorder.effects()
            if effects is not None:
                self.in_backward[layer] = (mixer_in, effects)
        return found

    def _final_gradient(self, base, query: Tensor, answers: Tensor) -> Tensor:
        """Return ∂λ/∂(the residual entering the final norm at the query) ``[n, 1, d_model]``, from
        the corrupt run's last block read with `base` and a backward of the final norm alone."""
        last = self.model.cfg.n_layers - 1
        hook = block_hook(last, "mixer_out")
        route = self.model.patch_to_next_mixer(hook, base(hook), base, at=query)
        assert route is not None  # a block-level hook
        final = route[1].detach().requires_grad_(True)
        logits = self.model(final, start_at_layer=last + 1, positions=torch.zeros_like(query))
        (gradient,) = torch.autograd.grad(answer_log_odds(logits, answers).sum(), final)
        return gradient

    def _exact_terms(
        self,
        stacked: dict[str, Tensor],
        acts,
        base,
        query: Tensor,
        answers: Tensor,
        log_odds: Tensor,
        rows: Tensor,
    ) -> dict[str, tuple[int, Tensor, Tensor]]:
        """Return ``{hook: (L, effect, skip)}`` for the hooks whose next mixer (block L) computes
        the patch exactly: ``effect`` ``[V, n, T]`` the mixer's part, ``skip`` ``[V, n, T]`` the
        residual's own change past it (zeros for a patch inside the mixer), per gradient in
        `stacked`. Hooks sharing a mixer input (a block's input and its mixer's input) share one
        computation. After the last mixer (L = n_layers) only position-wise computation is left:
        ``effect`` is the exact change of λ at each row's query (0 elsewhere). Where the next
        mixer is the one before the last, what its change at the query does goes on exactly
        through the last block (`QueryStep.correction`, in the full gradient's estimate)."""
        model = self.model
        n_layers = model.cfg.n_layers
        terms: dict[str, tuple[int, Tensor, Tensor]] = {}
        # (layer, mixer input, effect, output change at the query or None) computed so far
        done: list[tuple[int, Tensor, Tensor, Tensor | None]] = []
        variants = next(iter(stacked.values())).shape[0] if stacked else 1
        for index, hook in enumerate(self.exact_hooks):
            self._release_memos(index - 1)  # the blocks before this hook's are done with
            clean = acts(hook, "clean")
            # past the last mixer only the query's residual is followed: all its read-out needs
            route = model.patch_to_next_mixer(hook, clean, base, at=query)
            if route is None and model.resume_layer(hook) == n_layers:  # the final norm itself
                final_resid = _at(base(model.resid_hook(n_layers)), 1, query)
                patched = _query_log_odds(self.model, hook, final_resid, clean, query, answers)
            elif route is not None and route[2] is None:  # after the last mixer
                patched = _query_log_odds(self.model, None, route[1], clean, query, answers)
            else:
                patched = None
            if patched is not None:
                effect = torch.zeros(query.shape[0], clean.shape[1], dtype=torch.float64, device=query.device)
                effect[torch.arange(len(query), device=query.device), query] = (patched - log_odds).double()
                effect = effect.expand(variants, -1, -1)
                terms[hook] = (n_layers, effect, torch.zeros_like(effect))
            elif route is not None and route[2] is not None:  # a block-level patch: exact through the next mixer
                layer, resid, mixer_in = route[0], route[1], route[2]
                gradient = stacked[block_hook(layer, "mixer_out")]
                entry = next((d for d in done if d[0] == layer and torch.equal(d[1], mixer_in)), None)
                if entry is None:
                    in_backward = self.in_backward.get(layer)
                    if in_backward is not None and torch.equal(in_backward[0], mixer_in):
                        mixer_effect = in_backward[1].expand(variants, -1, -1)  # no GradDrop when resumed
                    else:
                        mixer_effect = self._along_kept(layer, gradient, mixer_in, base)
                    # the mixer before the last: its output's change at the query, for `QueryStep.correction`
                    at_query = (
                        model.mixer_patch_outputs(layer, mixer_in, base, query, self.memo)
                        if layer == n_layers - 2
                        else None
                    )
                    entry = (layer, mixer_in, mixer_effect, at_query)
                    done.append(entry)
                found, moved = entry[2], entry[3]
                skip = torch.einsum("vntd,ntd->vnt", gradient, resid - base(block_hook(layer, "resid_pre")))
                if moved is not None:
                    correction = self.query_step.correction(
                        layer, resid, moved, base, gradient[0], rows, query, answers, log_odds
                    )
                    if correction is not None:
                        found = torch.cat([found[:1] + correction, found[1:]])
                terms[hook] = (layer, found, skip.double())
            else:  # a mixer's q / k ...
                inside = model.layer_of_hook(hook)
                assert inside is not None  # `_computed_exactly`
                gradient = stacked[block_hook(inside, "mixer_out")]
                inside_effect = self._along_kept(inside, gradient, clean, base, hook)
                terms[hook] = (inside, inside_effect, torch.zeros_like(inside_effect))
        return terms

    def _along_kept(self, layer: int, gradient: Tensor, patched: Tensor, base, hook: str | None = None) -> Tensor:
        """Return block `layer`'s `AtpStarModel.mixer_patch_effects` ``[V, n, T]`` along the
        gradients `gradient` ``[V, n, T, d_model]`` of the backward passes, computed once per
        distinct gradient: a GradDrop pass that drops a layer below `layer` has the full pass's
        gradient there (`GradientPasses`), and the pass that drops `layer` itself leaves the
        mixer's effect out (`chunk`): zeros, not computed."""
        distinct = [index for index, variant in enumerate(self.variants) if variant is None or variant > layer]
        found = self.model.mixer_patch_effects(layer, gradient[distinct], patched, base, hook, self.memo)
        if found is None:
            raise HookmechError(
                f"block {layer}'s mixer says it patches {hook or 'its input'} exactly (mixer_patches_exactly) "
                "but mixer_patch_effects returned None"
            )
        effects = found.new_zeros(len(self.variants), *found.shape[1:])
        effects[distinct] = found
        for index, variant in enumerate(self.variants):
            if variant is not None and variant < layer:
                effects[index] = found[0]
        return effects


def _query_log_odds(
    model: AtpStarModel, hook: str | None, start: Tensor, clean: Tensor, query: Tensor, answers: Tensor
) -> Tensor:
    """Return λ ``[n]`` of the logits at the query when only position-wise computation is left:
    from `start` ``[n, 1, d_model]``, the residual entering the final norm at the query; with
    `hook` (the final norm's output), the base run's residual there with `hook` set to `clean`."""
    fwd_hooks = []
    if hook is not None:
        pos_axis = pos_axis_of(model.hook_dict[hook])
        assert pos_axis is not None
        value = _at(clean, pos_axis, query)
        fwd_hooks = [(hook, lambda activation, hook=None: value)]
    logits = model.run_with_hooks(
        start,
        start_at_layer=model.cfg.n_layers,
        positions=torch.zeros_like(query),
        fwd_hooks=fwd_hooks,
    )
    return answer_log_odds(logits, answers)


def _backward_recorders(estimator: _Estimator, rows: slice, acts, base) -> list[tuple[int, Tensor, Any]]:
    """Return ``(layer, patched mixer input, recorder)`` for each block whose exact hooks include
    its own input or its mixer's (their patched mixer input is the clean run's) and whose mixer
    computes those effects by the backward passes (`AtpStarModel.mixer_backward_patch_effects`)."""
    recorders: list[tuple[int, Tensor, Any]] = []
    for hook, layer in zip(estimator.exact_hooks, estimator.exact_layers, strict=True):
        parsed = parse_hook(hook)
        if parsed is None or parsed.inside is not None or parsed.part not in ("resid_pre", "mixer_in"):
            continue
        if layer is None or parsed.layer != layer or layer in [known for known, _, _ in recorders]:
            continue
        mixer_in = acts(hook, "clean")
        if parsed.part == "resid_pre":
            route = estimator.model.patch_to_next_mixer(hook, mixer_in, base)  # reads no base run
            assert route is not None and route[2] is not None  # a block's input
            mixer_in = route[2]
        recorder = estimator.model.mixer_backward_patch_effects(
            layer, mixer_in, _clean_memo(estimator, layer, rows, acts), rows.start
        )
        if recorder is not None:
            recorders.append((layer, mixer_in, recorder))
    return recorders


def _clean_memo(estimator: _Estimator, layer: int, rows: slice, acts) -> MixerMemo:
    """Return a memo of block `layer`'s mixer given its reads on the clean mixer input (with
    `clean_reads`) and agreeing with the clean run before each row's first corrupted token."""
    memo = MixerMemo()
    names = estimator.reads.get(layer, [])
    if estimator.clean_reads and names:
        memo.give(
            acts(block_hook(layer, "mixer_in"), "clean"),
            {_inside_name(name): acts(name, "clean") for name in names},
        )
    assert estimator.resumed is not None  # `_resumed_backward`
    agreement = estimator.resumed.agreement(rows)(layer)
    if agreement is not None:
        memo.agree(*agreement)
    return memo


@contextmanager
def _parameters_frozen(model: PatchableModel) -> Iterator[None]:
    """Within the `with` block no parameter of `model` requires a gradient, then each as it was:
    the backward passes ask for gradients of activations only, and an operation whose inputs
    include a parameter that requires one (the selective scan's A) computes that one too."""
    required = [(parameter, parameter.requires_grad) for parameter in model.parameters()]
    try:
        for parameter, _ in required:
            parameter.requires_grad_(False)
        yield
    finally:
        for parameter, was in required:
            parameter.requires_grad_(was)


def _inside_name(hook: str) -> str:
    """Return the short name of a hook inside a mixer (``blocks.1.mixer.hook_in_x`` -> ``in_x``)."""
    parsed = parse_hook(hook)
    assert parsed is not None and parsed.inside is not None  # `AtpStarModel.mixer_patch_reads`
    return parsed.inside


def _at(values: Tensor, pos_axis: int, positions: Tensor) -> Tensor:
    """Return `values` ``[n, ..., T, ...]`` at one position per row, keeping the position axis
    (length 1)."""
    moved = values.movedim(pos_axis, 1)
    index = positions.view(-1, 1, *([1] * (moved.dim() - 2))).expand(-1, 1, *moved.shape[2:])
    return moved.gather(1, index).movedim(1, pos_axis)


def _linear(model: PatchableModel, hook: str, clean: Tensor, corrupt: Tensor, grad: Tensor) -> Tensor:
    """Return ``[n, T]`` float64: Σ over the hook's other axes of (clean − corrupt) · gradient."""
    # equal entries (masked attention scores are -inf in both runs) contribute nothing
    difference = torch.where(clean == corrupt, torch.zeros_like(clean), clean - corrupt)
    pos_axis = pos_axis_of(model.hook_dict[hook])
    assert pos_axis is not None  # refused by atp_star_patch
    product = (difference * grad).movedim(pos_axis, 1)
    return (product.flatten(2).sum(-1) if product.dim() > 2 else product).double()
