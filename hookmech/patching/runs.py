"""The clean and corrupt runs a patch starts from: `CleanCorruptRuns`.

Activations of hooks, residuals entering blocks, query logits and p(answer) of both unpatched
runs of a batch, read from an activation cache where it holds them, else computed once (in
chunks of `max_batch` rows). A model whose weights are not finite is refused. Reading a cache
checks that its shapes are this model's and that it was made from this model
(`CacheFile.check_model`: its `model_hash`, and a few rows recomputed); the base run also records the mixer
contexts that resumed patches start from, while they fit in `context_memory` bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import Tensor

from ..cache import CacheFile, answer_probs, check_batch_fits, check_cache_fits, run_chunks
from ..errors import HookmechError
from ..hook_names import block_hook
from ..hooks import pos_axis_of
from ..tasks.batch import Batch
from ..validate import check_finite_parameters, refuse_non_finite_run
from .metrics import Metric
from .protocol import PatchableModel

RUNS = ("clean", "corrupt")


@contextmanager
def open_source(source: Batch | CacheFile | str | Path) -> Iterator[tuple[Batch, CacheFile | None]]:
    """Yield ``(batch, cache)`` of a patch source: a `Batch` (cache None), an open `CacheFile`,
    or a cache path (opened here and closed after)."""
    if isinstance(source, (str, Path)):
        with CacheFile(source) as cache:
            yield cache.batch(), cache
    elif isinstance(source, CacheFile):
        yield source.batch(), source
    elif isinstance(source, Batch):
        yield source, None
    else:
        raise HookmechError(f"patch source must be a Batch or a cache file, got {type(source).__name__}")


@contextmanager
def evaluating(model: PatchableModel) -> Iterator[None]:
    """Put `model` in eval mode for the `with` block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class CleanCorruptRuns:
    """The unpatched clean and corrupt runs of `batch`.

    `acts(hook, which)` ``[N, ...]``; `p_answer[which]` ``[N]`` (float64); `logits[which]`
    ``[N, d_vocab]`` at the query (when computed: `need_logits` or no cache);
    `resume_contexts(layer, base, ...)` the mixer contexts of the `base` run. A hook named in
    `read_at` ``{hook: [N, T] bool}`` is read only at those positions: `acts` holds the run's
    values there and leaves the other positions unset. From tokens, `only` names the runs
    computed (default both; a HookmechError for another name): a caller that runs the other one
    itself (AtP*'s and AtP's corrupt forward with gradients) reads neither its activations nor
    its p(answer) here.
    """

    def __init__(
        self,
        model: PatchableModel,
        batch: Batch,
        hooks: Sequence[str],
        cache: CacheFile | None,
        *,
        need_logits: bool,
        max_batch: int,
        base: str | None = None,
        context_memory: int = 0,
        read_at: dict[str, Tensor] | None = None,
        only: Sequence[str] = RUNS,
    ):
        self.model, self.batch, self.cache = model, batch, cache
        unknown = [which for which in only if which not in RUNS]
        if unknown or not only:
            raise HookmechError(f"runs to compute must be some of {RUNS}, got {list(only)}")
        self.only = [which for which in RUNS if which in only]
        # hooks whose computed activations are read only at some positions ([N, T] bool): only
        # those are copied out of each chunk (a state hook's are the largest tensors of a run)
        read_at = read_at or {}
        self.read_at = {hook: where for hook, where in read_at.items() if pos_axis_of(model.hook_dict[hook]) == 1}
        # mixer contexts (for resumed patches) are kept only while they fit in this many bytes
        self.context_memory, self.contexts_refused = context_memory, context_memory <= 0
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        wanted = list(dict.fromkeys(hooks))
        missing = [
            hook for hook in wanted if cache is None or not (cache.has(hook, "clean") and cache.has(hook, "corrupt"))
        ]
        self.logits: dict[str, Tensor] = {}
        self.p_answer: dict[str, Tensor] = {}
        self.computed: dict[tuple[str, str], Tensor] = {}
        self.contexts: dict[tuple[int, str], dict[str, Tensor]] = {}
        #: a mean ablation's mean per hook ``[1, ...]`` when it is over more rows than these
        #: (a cache read in row chunks: `chunked.clean_means`); else it is these rows' own
        self.clean_means: dict[str, Tensor] = {}
        check_finite_parameters(model)  # NaN weights would give null attributions and no word
        check_batch_fits(model, batch, "the examples" if cache is None else str(cache.path))
        if cache is not None:
            read = [hook for hook in wanted if hook not in missing]
            check_cache_fits(model, cache, batch, read)
            cache.check_model(model, hooks=read)  # a cache of another model would give numbers that mean nothing
            self.p_answer = {which: cache.p_answer(which).double() for which in RUNS}
        if missing or need_logits or cache is None:
            self._compute(missing, max_batch, base)

    @torch.no_grad()
    def _compute(self, hooks: list[str], max_batch: int, base: str | None) -> None:
        """Run the runs of `only` (clean and corrupt by default); the `base` run also records every
        block's mixer context (`PatchableModel.collecting_contexts`), which resumed patches start
        from. A run left out has no activations, logits or p(answer) here (from tokens)."""
        parts: dict[tuple[str, str], list[Tensor]] = {}
        sparse: dict[tuple[str, str], Tensor] = {}
        logits: dict[str, list[Tensor]] = {which: [] for which in self.only}
        collect = base is not None and not self.contexts_refused
        contexts: dict[int, list[dict[str, Tensor]]] = (
            {layer: [] for layer in range(self.model.cfg.n_layers)} if collect else {}
        )
        # a recurrent state read at a few positions is read from the run's recorded context: with
        # its hook in use, the mixer would materialise every position's state (the largest tensors
        # of a run) only for the hook to keep a few of them
        from_context = {hook: self.model.state_reader(hook) for hook in hooks if hook in self.read_at}
        readers = {hook: read for hook, read in from_context.items() if read is not None}
        fired = [hook for hook in hooks if hook not in readers]
        for rows in run_chunks(len(self.batch), max_batch):
            query = self.batch.query_pos[rows].to(self.device)
            for which in self.only:
                tokens = self.batch.tokens if which == "clean" else self.batch.corrupt_tokens
                keep_contexts = collect and which == base
                with self.model.collecting_contexts() if keep_contexts or readers else nullcontext() as recorded:
                    out, acts = self.model.run_with_cache(
                        tokens[rows].to(self.device),
                        names_filter=fired,
                        return_cache_object=False,
                        positions=query,
                        tail_at_positions=True,
                    )
                for hook, read in readers.items():
                    layer = self.model.layer_of_hook(hook)
                    assert recorded is not None and layer is not None  # a state hook is inside a block
                    self._read_from_context(sparse, (hook, which), read, recorded[layer][-1], rows)
                if keep_contexts:
                    assert recorded is not None
                    for layer, chunk_contexts in recorded.items():
                        contexts[layer].extend(chunk_contexts)
                logits[which].append(out.float())
                for hook in fired:
                    if hook in self.read_at:
                        self._copy_read_positions(sparse, (hook, which), acts[hook], rows)
                    else:
                        parts.setdefault((hook, which), []).append(acts[hook])
            if collect and self._over_budget(contexts, rows.stop):
                collect, contexts = False, {}
        self.computed = {key: concat_rows(chunks) for key, chunks in parts.items()} | sparse
        for layer, chunks in contexts.items():
            assert base is not None  # contexts are collected of the base run only
            self.contexts[layer, base] = {name: concat_rows([chunk[name] for chunk in chunks]) for name in chunks[0]}
        self.logits = {which: concat_rows(chunks) for which, chunks in logits.items()}
        for which, out in self.logits.items():  # finite weights, overflowing activations: null records, no word
            refuse_non_finite_run(
                self.model, out, self.batch.tokens if which == "clean" else self.batch.corrupt_tokens, which
            )
        if not self.p_answer:
            answers = self.batch.answers.to(self.device)
            self.p_answer = {which: answer_probs(out, answers).double().cpu() for which, out in self.logits.items()}

    def _copy_read_positions(
        self, out: dict[tuple[str, str], Tensor], key: tuple[str, str], chunk: Tensor, rows: slice
    ) -> None:
        """Copy `chunk` (rows `rows` of hook key[0]'s activations) into ``out[key]`` ``[N, T, ...]``
        at the positions `read_at` names; the others are left unset (no patch uses them)."""
        if key not in out:
            out[key] = chunk.new_empty(len(self.batch), *chunk.shape[1:])
        row, pos = self.read_at[key[0]][rows].to(chunk.device).nonzero(as_tuple=True)
        out[key][row + rows.start, pos] = chunk[row, pos]

    def _read_from_context(
        self, out: dict[tuple[str, str], Tensor], key: tuple[str, str], read, context: dict[str, Tensor], rows: slice
    ) -> None:
        """Write into ``out[key]`` ``[N, T, ...]`` hook key[0]'s activations at the positions `read_at`
        names of the rows `rows`, read with `read` (`PatchableModel.state_reader`) from `context`,
        the chunk's recorded context of its block; the other positions are left unset."""
        row, pos = self.read_at[key[0]][rows].to(self.device).nonzero(as_tuple=True)
        values = read(context, row, pos)
        if key not in out:
            out[key] = values.new_empty(len(self.batch), self.batch.tokens.shape[1], *values.shape[1:])
        out[key][row + rows.start, pos] = values

    def resume_contexts(self, layer: int, which: str, max_batch: int) -> dict[int, dict[str, Tensor]] | None:
        """Return the mixer contexts of the `which` run for blocks `layer` .. last
        (`PatchableModel.layer_context`, computed once, in chunks of `max_batch` rows), or None
        when they would not fit in `context_memory` bytes (the patches then run on every position)."""
        n_layers = self.model.cfg.n_layers
        for index in range(layer, n_layers):
            if self.contexts_refused:
                return None
            if (index, which) not in self.contexts:
                self._make_context(index, which, max_batch)
        return None if self.contexts_refused else {i: self.contexts[i, which] for i in range(layer, n_layers)}

    def _make_context(self, layer: int, which: str, max_batch: int) -> None:
        mixer_in = self.acts(block_hook(layer, "mixer_in"), which)
        parts: list[dict[str, Tensor]] = []
        for rows in run_chunks(len(mixer_in), max_batch):
            parts.append(self.model.layer_context(layer, mixer_in[rows]))
            if self._over_budget({layer: parts}, rows.stop):
                return
        self.contexts[layer, which] = {name: concat_rows([part[name] for part in parts]) for name in parts[0]}

    def _over_budget(self, new: dict[int, list[dict[str, Tensor]]], rows_done: int) -> bool:
        """Whether the contexts kept, plus `new` (made for the first `rows_done` rows, scaled to
        all rows), exceed `context_memory`; if so, drop every context and refuse more."""
        kept = sum(_nbytes(context) for context in self.contexts.values())
        made = sum(_nbytes(context) for chunks in new.values() for context in chunks)
        if kept + made * len(self.batch) / rows_done <= self.context_memory:
            return False
        self.contexts, self.contexts_refused = {}, True
        return True

    def acts(self, hook: str, which: str) -> Tensor:
        """Return `hook`'s activations of the `which` run, ``[N, ...]`` on the model's device."""
        if (hook, which) in self.computed:
            return self.computed[hook, which]
        assert self.cache is not None  # a hook not computed is one the cache holds
        stored = self.cache.read(hook, which, slice(0, len(self.batch)))
        # the cache keeps float32; a model in another precision runs on its own (float64: exact
        # to the cache's rounding, CACHE_TOL)
        dtype = self.dtype if stored.is_floating_point() else stored.dtype
        return stored.to(self.device, dtype)

    def unpatched_metric(self, metric: Metric, which: str) -> Tensor:
        """Return `metric` ``[N]`` (float64) of the unpatched `which` run."""
        if metric.name == "p_answer":
            return self.p_answer[which]
        return metric.rows(self.logits[which], torch.arange(len(self.batch)))


def _nbytes(context: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in context.values())


def concat_rows(chunks: list[Tensor]) -> Tensor:
    """Return the chunks concatenated along rows (axis 0), without copying a single chunk."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
