"""What DAS trains and evaluates on, read from an activation cache in row chunks.

Per row: the clean run's activation at (site, position), flattened (the source), the position,
the query and the clean answer; per chunk of rows, what the patched forwards start from — the
corrupt run's residual entering the first block they run and, for resumed runs, the corrupt
run's mixer contexts of that block and the later ones (`PatchableModel.layer_context`), as the
patching engine resumes a patch (hookmech/patching/forwards.py). Everything is read from the
cache where it holds it (the corrupt hooks are computed from the chunk's corrupt tokens where it
does not), one chunk of at most `chunk_rows` rows at a time (`das_chunk_rows`: 512, or fewer where
512 rows do not fit in the memory budget): what is in memory does not grow with the cache's N.
Only per-row numbers (position, query, answer, document, p(answer): ``[N]`` vectors) are held for
every row; tokens are read with their chunk.

Rows are split into train and dev by document (`hookmech.splits.split_by_document`, seeded).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache import CacheFile, check_batch_fits, check_cache_fits
from ..errors import UsageError
from ..hook_names import block_hook
from ..hooks import pos_axis_of
from ..patching.protocol import PatchableModel
from ..row_chunks import MEMORY_MIB, row_chunks
from ..row_chunks import chunk_rows as budget_rows
from ..shapes import Context
from ..sites import hook_to_site, row_positions
from ..splits import split_by_document
from ..validate import check_finite_parameters
from .basis import derived_seed

#: the most rows of one chunk: the unit of DAS's data order (`DasData.train_batches`), so that
#: the same seed gives the same minibatches under any budget that holds this many rows
ORDER_ROWS = 512


@dataclass(frozen=True)
class Route:
    """How a patched forward of `hook` runs: resumed from block `resume_at` on a window of
    positions (`HookedLM.resume`), or, for hooks a resumed run does not fire (inside a mixer,
    embeddings), on every position from block `start_at` (None: from the tokens)."""

    hook: str
    pos_axis: int
    resume_at: int | None
    start_at: int | None

    @property
    def first_block(self) -> int | None:
        """The block whose input the forward starts from (None: the tokens)."""
        return self.resume_at if self.resume_at is not None else self.start_at


def route_of(model: PatchableModel, hook: str) -> Route:
    """Return the `Route` of patching `hook` (moved to its latest equivalent hook first:
    block l's output is block l+1's input, `PatchableModel.equivalent_hook`)."""
    computed = model.equivalent_hook(hook)
    pos_axis = pos_axis_of(model.hook_dict[computed])
    if pos_axis is None:
        raise UsageError(f"{hook_to_site(hook)} has no position axis: it cannot be patched at a position")
    resume_at = model.resume_layer(computed)
    start_at = None if resume_at is not None else model.layer_of_hook(computed)
    return Route(computed, pos_axis, resume_at, start_at)


@dataclass
class RowChunk:
    """Rows of the cache ready for patched forwards, on the model's device.

    `rows` ``[n]`` cache row numbers; `source` ``[n, d]`` the clean activation at the site and
    the row's `position` ``[n]``, flattened; `query`, `answers` ``[n]``; `p_clean`, `p_corrupt`
    ``[n]`` (float64, the cache's); `start_input` the corrupt run's residual entering the route's
    first block ``[n, T, d_model]`` (its tokens ``[n, T]`` when it starts from the tokens);
    `contexts` ``{block: context}`` of the corrupt run for resumed routes, else None.
    """

    rows: Tensor
    source: Tensor
    position: Tensor
    query: Tensor
    answers: Tensor
    p_clean: Tensor
    p_corrupt: Tensor
    start_input: Tensor
    contexts: dict[int, Context] | None

    def __len__(self) -> int:
        return len(self.rows)


class DasData:
    """The rows of `cache` for DAS at `hook` (a hook name of `model`) and position spec `pos`
    (a role or an integer: one position per row), split into train and dev by document.

    The clean activations of `hook` must be in the cache (`hookmech cache --sites ...`).
    """

    def __init__(
        self,
        model: PatchableModel,
        cache: CacheFile,
        hook: str,
        pos: str,
        *,
        dev_frac: float = 0.2,
        seed: int = 0,
        chunk_rows: int | None = None,
        memory: float = MEMORY_MIB,
    ):
        if chunk_rows is not None and chunk_rows < 1:
            raise UsageError(f"chunk_rows must be >= 1, got {chunk_rows}")
        if not isinstance(pos, str):
            raise UsageError(
                f"position {pos!r} is a {type(pos).__name__}, not a string: give a role or an integer as text"
            )
        check_finite_parameters(model)  # NaN weights would train on NaN and score null
        pos = pos.strip()
        if pos in ("all", "whole") or "+" in pos:
            raise UsageError(
                f"DAS learns a subspace at one position per row, not {pos!r}: give a role "
                "(key, value, query, divider) or an integer (-1: each row's last token)"
            )
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.route = route_of(model, hook)
        self.source_hook = self._cached_clean(hook)
        first = self.route.first_block
        self.start_hook = None if first is None else model.resid_hook(first)
        resume_at = self.route.resume_at
        self.context_hooks = (
            {} if resume_at is None else {b: block_hook(b, "mixer_in") for b in range(resume_at, model.cfg.n_layers)}
        )
        self.chunk_rows = self._budget_rows(memory) if chunk_rows is None else chunk_rows
        columns: dict[str, list[Tensor]] = {name: [] for name in ("positions", "query", "answers", "doc_index")}
        for rows in row_chunks(cache.n, self.chunk_rows):  # per-row numbers, a chunk's tokens at a time
            batch = cache.window(rows).batch()
            check_batch_fits(model, batch, str(cache.path))
            if rows.start == 0:
                check_cache_fits(model, cache, batch, [self.source_hook, *self.base_hooks()])
            columns["positions"].append(row_positions(pos, batch.roles, batch.lengths))
            columns["query"].append(batch.query_pos)
            columns["answers"].append(batch.answers)
            columns["doc_index"].append(batch.doc_index)
        self.positions, self.query, self.answers, doc_index = (torch.cat(parts) for parts in columns.values())
        self.train, self.dev = split_by_document(doc_index, dev_frac, seed, who="DAS")
        self.p_clean, self.p_corrupt = cache.p_answer("clean").double(), cache.p_answer("corrupt").double()
        read = [self.source_hook, *(hook for hook in self.base_hooks() if cache.has(hook, "corrupt"))]
        cache.check_model(model, hooks=read)
        self.activation_shape = tuple(cache[self.source_hook].shape[2:])
        self.d = math.prod(self.activation_shape)

    def _cached_clean(self, hook: str) -> str:
        """The hook under which the cache holds `hook`'s clean activations (it, or its equivalent)."""
        for candidate in dict.fromkeys([hook, self.route.hook]):
            if self.cache.has(candidate, "clean"):
                return candidate
        stored = [hook_to_site(name) for name in self.cache.hooks("clean")]
        listing = ", ".join(stored[:12]) + (" ..." if len(stored) > 12 else "") if stored else "none"
        raise UsageError(
            f"{self.cache.path}: no clean activations for site {hook_to_site(hook)!r} (cached: {listing}); "
            f"make a cache holding it: hookmech cache ... --sites {hook_to_site(hook)}"
        )

    def _budget_rows(self, memory: float) -> int:
        """Return the rows read at once: `ORDER_ROWS`, or fewer where they do not fit in `memory`
        MiB. Per row: the source hook's and the corrupt base hooks' activations of every position
        as stored and as float copies, and per resumed block a mixer context (counted as four
        ``[T, d_model]`` float32 tensors: attention's keys and values and their window copies; a
        recurrent mixer's states are smaller)."""
        per_row = 0
        for hook, which in [(self.source_hook, "clean"), *((hook, "corrupt") for hook in self.base_hooks())]:
            if self.cache.has(hook, which):
                dataset = self.cache[hook, which]
                per_row += math.prod(dataset.shape[1:]) * (dataset.dtype.itemsize + 4)
        per_row += len(self.context_hooks) * 4 * self.cache.n_pos * int(self.cache.model_config.get("d_model", 1)) * 4
        return budget_rows(per_row, memory, at_most=ORDER_ROWS)

    def base_hooks(self) -> list[str]:
        """The corrupt run's hooks the patched forwards start from (the first block's input, the
        later blocks' mixer inputs for contexts)."""
        hooks = [] if self.start_hook is None else [self.start_hook]
        return list(dict.fromkeys([*hooks, *self.context_hooks.values()]))

    @property
    def n_train(self) -> int:
        return int(self.train.sum())

    @property
    def n_dev(self) -> int:
        return int(self.dev.sum())

    # -- reading -----------------------------------------------------------------------------
    @torch.no_grad()
    def chunk(self, rows: slice, keep: Tensor) -> RowChunk:
        """Return the `RowChunk` of the rows of `rows` (a slice of the cache) where `keep` ``[N]`` is True."""
        kept = torch.nonzero(keep[rows]).flatten()
        numbers = kept + rows.start
        position = self.positions[numbers]

        def read(hook: str, which: str) -> Tensor:
            values = torch.from_numpy(self.cache.read_rows(hook, which, rows))[kept]
            return values.to(self.device, self.dtype)

        source_axis = pos_axis_of(self.model.hook_dict[self.source_hook])
        assert source_axis is not None  # route_of refused hooks without a position axis
        clean = read(self.source_hook, "clean").movedim(source_axis, 1)  # [n, T, ...]
        source = clean[torch.arange(len(kept), device=self.device), position.to(self.device)].flatten(1)
        corrupt_tokens = self._corrupt_tokens(rows, kept)
        base = self._corrupt_hooks(numbers, corrupt_tokens, read)
        contexts = None
        if self.route.resume_at is not None:
            prefix = self.model.layer_context
            contexts = {block: prefix(block, base[name]) for block, name in self.context_hooks.items()}
        if self.start_hook is None:
            assert corrupt_tokens is not None  # `_corrupt_tokens` reads them for runs from the tokens
            start_input = corrupt_tokens.to(self.device)
        else:
            start_input = base[self.start_hook]
        return RowChunk(
            rows=numbers,
            source=source,
            position=position.to(self.device),
            query=self.query[numbers].to(self.device),
            answers=self.answers[numbers].to(self.device),
            p_clean=self.p_clean[numbers],
            p_corrupt=self.p_corrupt[numbers],
            start_input=start_input,
            contexts=contexts,
        )

    def _corrupt_tokens(self, rows: slice, kept: Tensor) -> Tensor | None:
        """The corrupt tokens ``[n, T]`` of the rows `kept` of the slice `rows`, or None where no
        forward starts from them (every hook they would give is read from the cache)."""
        needed = self.start_hook is None or any(not self.cache.has(hook, "corrupt") for hook in self.base_hooks())
        return self.cache.window(rows).batch().corrupt_tokens[kept] if needed else None

    def _corrupt_hooks(self, numbers: Tensor, corrupt_tokens: Tensor | None, read) -> dict[str, Tensor]:
        """The corrupt run's `base_hooks` of rows `numbers`: read from the cache, or computed from
        their corrupt tokens ``[n, T]`` where the cache does not hold them."""
        hooks = self.base_hooks()
        values = {hook: read(hook, "corrupt") for hook in hooks if self.cache.has(hook, "corrupt")}
        missing = [hook for hook in hooks if hook not in values]
        if missing:
            assert corrupt_tokens is not None  # `_corrupt_tokens` reads them when a hook is missing
            _, computed = self.model.run_with_cache(
                corrupt_tokens.to(self.device),
                names_filter=missing,
                return_cache_object=False,
                positions=self.query[numbers].to(self.device),
            )
            values.update({hook: computed[hook] for hook in missing})
        return values

    def chunks(self, keep: Tensor) -> Iterator[RowChunk]:
        """Yield the `RowChunk`s of the rows where `keep` ``[N]`` is True, in cache order."""
        for start in range(0, len(keep), self.chunk_rows):
            rows = slice(start, min(len(keep), start + self.chunk_rows))
            if keep[rows].any():
                yield self.chunk(rows, keep)

    def train_batches(self, batch_size: int, seed: int) -> Iterator[tuple[RowChunk, Tensor]]:
        """Yield ``(chunk, index [b])`` minibatches of at most `batch_size` training rows, without
        end: each epoch visits the chunks in a seeded random order and each chunk's rows in a
        seeded random order (deterministic in `seed`). Only the current chunk is in memory (a
        cache of one chunk is read once)."""
        if batch_size < 1:
            raise UsageError(f"batch size must be >= 1, got {batch_size}")
        n_rows = len(self.train)
        blocks = [
            slice(start, min(n_rows, start + self.chunk_rows))
            for start in range(0, n_rows, self.chunk_rows)
            if self.train[start : start + self.chunk_rows].any()
        ]
        loaded: tuple[slice, RowChunk] | None = None
        epoch = 0
        while True:
            generator = torch.Generator().manual_seed(derived_seed(seed, epoch))
            for block in torch.randperm(len(blocks), generator=generator).tolist():
                if loaded is None or loaded[0] != blocks[block]:
                    loaded = (blocks[block], self.chunk(blocks[block], self.train))
                chunk = loaded[1]
                order = torch.randperm(len(chunk), generator=generator).to(self.device)
                for start in range(0, len(order), batch_size):
                    yield chunk, order[start : start + batch_size]
            epoch += 1
