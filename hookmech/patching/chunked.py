"""Patching a cache in row chunks: a record over N rows is the sum of its records over chunks.

Every number of a record is a mean over rows (p_clean, p_corrupt, p_patched and the metric's
three means; AtP*'s GradDrop score is a function of per-layer means), so the patch of N rows
is the patch of each chunk of rows, its means weighted by the chunk's rows and added, the
attribution then computed from the summed means (a ratio of sums, exactly as over all rows at
once: the records agree to float64 round-off). The same sums add up the row shards of
workers (`distributed`). A mean ablation needs the mean over all rows first: `clean_means`
makes a first pass over the chunks. A resample ablation takes a row's partner from any row,
so it is refused over several chunks.

Per-row outputs (``p_patched_rows`` ...) go, as each chunk is done, to a `RowsSink` when one is
given (`per_example.RowsFile` writes them to disk), else they are joined in the records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from ..cache import CacheFile, check_cache_fits
from ..errors import HookmechError, UsageError
from ..hook_names import block_hook
from ..hooks import pos_axis_of
from ..row_chunks import DEFAULT_MEMORY_MIB, MIB, bytes_per_row, plan_row_chunks, rows_per_chunk
from ..tasks.batch import Batch
from .metrics import attribution_score
from .plans import patch_mask
from .protocol import PatchableModel
from .runs import RUNS, CleanCorruptRuns

#: bytes of row data a patch holds at once by default (``--memory``, `hookmech.row_chunks`)
DEFAULT_MEMORY = DEFAULT_MEMORY_MIB * MIB
#: the per-row lists a record may carry (`per_example`)
PER_ROW = ("p_patched_rows", "metric_patched_rows", "p_clean_rows", "p_corrupt_rows")
#: the means a record holds, each over its `n` rows
MEANS = ("p_clean", "p_corrupt", "p_patched", "metric_clean", "metric_corrupt", "metric_patched")
#: AtP*'s per-layer mean changes of p with that layer's gradient dropped (its ``graddrop`` score
#: is the mean of their absolute values), carried by the records of a chunk only
GRADDROP_LAYERS = "graddrop_layers"
#: what one row costs beyond the activations read, relative to them: the patched values, the
#: base values they are compared with and the masks the engine builds per chunk
WORKING_FACTOR = 2


def record_key(record: dict[str, Any]) -> tuple:
    """Return what names a record among its command's: its path ends (path patching), hook and position."""
    return (record.get("sender"), record.get("receiver"), record["hook"], record["pos"])


class RowsSink(Protocol):
    """Where per-row outputs go as chunks are done (`per_example.RowsFile`)."""

    def add(self, key: tuple, field: str, rows: slice, values: list[float]) -> None:
        """Take `values` (one per row of `rows`) of the record named `key` (`record_key`)."""
        ...


def take_rows(records: list[dict[str, Any]], rows: slice, sink: RowsSink | None) -> list[dict[str, Any]]:
    """Hand the per-row lists of `records` (rows `rows`) to `sink` and leave None in their place,
    so that the records keep their fields in order; return `records` (unchanged without a sink)."""
    if sink is None:
        return records
    for record in records:
        for field in PER_ROW:
            if isinstance(record.get(field), list):
                sink.add(record_key(record), field, rows, record[field])
                record[field] = None
    return records


class RecordSums:
    """Records of consecutive row chunks (or shards) added up; `result` gives the records of all
    their rows. `threshold` is the filter on the metric's clean − corrupt gap."""

    def __init__(self, threshold: float, sink: RowsSink | None = None, partial: bool = False):
        # partial: the result is itself to be added to other rows' (it keeps graddrop_layers)
        self.threshold, self.sink, self.partial = threshold, sink, partial
        self.records: list[dict[str, Any]] = []
        self.sums: list[dict[str, Any]] = []
        self.n = 0

    def add(self, records: list[dict[str, Any]], rows: slice) -> None:
        """Add the records of the rows `rows` (each record's ``n`` is their number); return None."""
        take_rows(records, rows, self.sink)
        if not self.records:
            self.records = [dict(record) for record in records]
            self.sums = [{field: 0.0 for field in MEANS} for _ in records]
        elif [record_key(r) for r in records] != [record_key(r) for r in self.records]:
            raise HookmechError(
                "the row chunks of this patch gave different records (a path via resid whose positions "
                "meet in some rows only): raise --memory to read the cache in one chunk"
            )
        for record, template, sums in zip(records, self.records, self.sums, strict=True):
            n = record["n"]
            for field in MEANS:
                sums[field] += record[field] * n
            layers = record.get(GRADDROP_LAYERS)
            if layers is not None:
                previous = sums.get(GRADDROP_LAYERS) or [0.0] * len(layers)
                sums[GRADDROP_LAYERS] = [total + mean * n for total, mean in zip(previous, layers, strict=True)]
            if self.sink is None:
                for field in PER_ROW:
                    if field in record and self.n:  # the first chunk's lists are the template's
                        template[field] = template[field] + record[field]
        self.n += records[0]["n"] if records else 0

    def result(self) -> list[dict[str, Any]]:
        """Return the records of all rows added: means over all rows, ``n`` their number, the
        attribution and the filter computed from those means."""
        out = []
        for template, sums in zip(self.records, self.sums, strict=True):
            record = dict(template)
            for field in MEANS:
                record[field] = sums[field] / self.n
            record["n"] = self.n
            direction = record["direction"]
            m_clean, m_corrupt = record["metric_clean"], record["metric_corrupt"]
            record["attribution"] = attribution_score(m_clean, m_corrupt, record["metric_patched"], direction)
            gap = m_corrupt - m_clean if record["metric"] == "kl" else m_clean - m_corrupt
            record["passes_filter"] = bool(gap > self.threshold)
            record.pop(GRADDROP_LAYERS, None)
            if GRADDROP_LAYERS in sums:
                layers = [total / self.n for total in sums[GRADDROP_LAYERS]]
                record["graddrop"] = sum(map(abs, layers)) / len(layers)
                if self.partial:
                    record[GRADDROP_LAYERS] = layers
            out.append(record)
        return out


def in_chunks(
    cache: CacheFile,
    slices: Sequence[slice],
    run_window: Callable[[CacheFile, Callable[[int], None] | None], list[dict[str, Any]]],
    threshold: float,
    sink: RowsSink | None = None,
    progress: Callable[[int], None] | None = None,
    partial: bool = False,
) -> list[dict[str, Any]]:
    """Return the records of the rows `slices` of `cache` (consecutive, in order), each chunk's
    made by `run_window(window, progress)`, added up (`RecordSums`; `partial` as there).
    `progress(k)` is called with each chunk's share of its calls, so that they add up as over
    one chunk."""
    sums = RecordSums(threshold, sink, partial)
    covered = sum(s.stop - s.start for s in slices)
    owed, reported = [0.0], [0]  # progress due (fractional) and reported (whole calls)

    for rows in slices:
        share = (rows.stop - rows.start) / covered

        def scaled(k: int, share: float = share) -> None:
            assert progress is not None
            owed[0] += k * share
            step = int(owed[0] + 1e-9) - reported[0]
            if step > 0:
                reported[0] += step
                progress(step)

        sums.add(run_window(cache.window(rows), None if progress is None else scaled), rows)
    if progress is not None and round(owed[0]) > reported[0]:
        progress(round(owed[0]) - reported[0])
    return sums.result()


#: what patches a source's rows: ``run_rows(rows, progress)`` gives the records of `rows` (a
#: `Batch`, a cache or one of its windows), calling `progress(k)` as k records are done
RunRows = Callable[[Any, Callable[[int], None] | None], list[dict[str, Any]]]


def chunked_records(
    source: Batch | CacheFile | str | Path,
    memory: int | None,
    chunks: Callable[[CacheFile, int], list[slice]],
    runner: Callable[[CacheFile | None, list[slice] | None], RunRows],
    threshold: float,
    sink: RowsSink | None,
    progress: Callable[[int], None] | None,
    partial: bool = False,
) -> list[dict[str, Any]]:
    """Return the records of all rows of `source` (`patch`'s and `path_patch`'s outline): all rows
    at once where `memory` is None, `source` a `Batch` or the cache's `chunks(cache, memory)` one chunk,
    else each chunk's records added up (`in_chunks`; `threshold`, `sink`, `progress`, `partial` as
    there). `runner(cache, slices)` gives the `RunRows` (`slices`: the chunks, None for all rows
    at once; `cache`: the open cache, None for a `Batch` or memory None)."""
    if memory is None or isinstance(source, Batch):
        rows = slice(0, len(source) if isinstance(source, Batch) else None)
        return take_rows(runner(None, None)(source, progress), rows, sink)
    with opened(source) as cache:
        slices = chunks(cache, memory)
        if len(slices) == 1:
            return take_rows(runner(cache, None)(cache, progress), slice(0, cache.n), sink)
        return in_chunks(cache, slices, runner(cache, slices), threshold, sink, progress, partial=partial)


@contextmanager
def opened(source: CacheFile | str | Path) -> Iterator[CacheFile]:
    """Yield `source` as an open `CacheFile` (a path is opened here and closed after)."""
    if isinstance(source, CacheFile):
        yield source
        return
    with CacheFile(source) as cache:
        yield cache


def row_bytes(
    model: PatchableModel, cache: CacheFile, hooks: Sequence[str], n_patches: int, contexts: bool = True
) -> int:
    """Return the bytes one row of `cache` costs a patch reading `hooks` of both runs (float32
    once read; a hook the cache lacks counts as its largest stored one) with `n_patches` position
    patches, `WORKING_FACTOR` times over for what the engine makes from them; plus, with
    `contexts`, the mixer contexts of one run that resumed patches keep (`context_bytes`)."""
    stored = {
        (hook, which): tuple(cache[hook, which].shape[1:])
        for hook in cache.keys()
        for which in RUNS
        if cache.has(hook, which)
    }
    # a hook the cache lacks is computed per chunk: count it as the largest stored one
    largest = max(stored.values(), key=math.prod, default=(cache.n_pos,))
    shapes = [stored.get((hook, which), largest) for hook in dict.fromkeys(hooks) for which in RUNS]
    # the masks ([P, T], float64 in AtP) and the tokens of both runs (int64)
    shapes += [(n_patches, cache.n_pos, 2), (2, cache.n_pos, 2)]
    return WORKING_FACTOR * bytes_per_row(shapes) + (context_bytes(model, cache) if contexts else 0)


@torch.no_grad()
def context_bytes(model: PatchableModel, cache: CacheFile) -> int:
    """Return the bytes of one row's mixer contexts, every block, of the corrupt run
    (`PatchableModel.layer_context` of the cache's first row; blocks whose mixer input the cache
    lacks count as the largest of the others): what a resumed patch keeps per row (a recurrent
    state per position can outweigh the row's activations many times over)."""
    sizes = []
    dtype = next(model.parameters()).dtype
    hooks = [block_hook(layer, "mixer_in") for layer in range(model.cfg.n_layers)]
    # a cache of another model: the error that names the shapes, not a failed matrix product
    check_cache_fits(model, cache, cache.window(slice(0, 1)).batch(), hooks)
    for layer, hook in enumerate(hooks):
        if cache.has(hook, "corrupt"):
            mixer_in = cache.read(hook, "corrupt", slice(0, 1)).to(next(model.parameters()).device, dtype)
            context = model.layer_context(layer, mixer_in)
            sizes.append(sum(t.numel() * t.element_size() for t in context.values()))
    return max(sizes, default=0) * model.cfg.n_layers


def plan(cache: CacheFile, per_row: int, memory: int, what: str, one_chunk_only: str | None = None) -> list[slice]:
    """Return the row chunks of `cache` for `memory` bytes at `per_row` bytes a row; with
    `one_chunk_only` (why the rows must be read at once), a UsageError when they need more
    than one chunk, naming the --memory that would hold them."""
    slices = plan_row_chunks(cache.n, per_row, memory)
    if len(slices) > 1 and one_chunk_only is not None:
        need = -(-cache.n * per_row // MIB)
        raise UsageError(
            f"{what}: {one_chunk_only}, and {cache.n} rows need {len(slices)} chunks of "
            f"{rows_per_chunk(per_row, memory)} at this --memory; give --memory {need} or more"
        )
    return slices


@torch.no_grad()
def clean_sums(
    model: PatchableModel, cache: CacheFile, hooks: Sequence[str], max_batch: int
) -> dict[str, tuple[Tensor, Tensor]]:
    """Return, per hook, the sum over the rows of `cache` (a window, or the whole file) of the
    clean run's activations at each position the row has ``[1, ...]`` (float64), and how many
    rows have it ``[1, ...]`` (broadcastable). The pieces of a mean ablation's mean."""
    batch = cache.batch()
    runs = CleanCorruptRuns(model, batch, list(hooks), cache, need_logits=False, max_batch=max_batch)
    out = {}
    for hook in hooks:
        acts = runs.acts(hook, "clean")
        pos_axis = _pos_axis(model, hook)
        valid = torch.arange(acts.shape[pos_axis], device=acts.device)[None, :] < batch.lengths.to(acts.device)[:, None]
        weights = patch_mask(valid, acts.shape, pos_axis, None, None)
        # where, not multiply: padded positions may hold -inf (masked attention scores)
        zero = torch.zeros((), dtype=torch.float64, device=acts.device)
        total = torch.where(weights, acts.double(), zero).sum(0, keepdim=True)
        out[hook] = (total.cpu(), weights.double().sum(0, keepdim=True).cpu())
    return out


def add_sums(
    into: dict[str, tuple[Tensor, Tensor]], more: dict[str, tuple[Tensor, Tensor]]
) -> dict[str, tuple[Tensor, Tensor]]:
    """Return the sums `into` and `more` (`clean_sums` of two sets of rows) added."""
    if not into:
        return dict(more)
    return {hook: (into[hook][0] + more[hook][0], into[hook][1] + more[hook][1]) for hook in into}


def means_of(sums: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """Return each hook's mean ``[1, ...]`` (float64) from `clean_sums`, positions no row has at 0."""
    return {hook: total / count.clamp(min=1) for hook, (total, count) in sums.items()}


def clean_means(
    model: PatchableModel, cache: CacheFile, hooks: Sequence[str], slices: Sequence[slice], max_batch: int
) -> dict[str, Tensor]:
    """Return each hook's clean-run mean over all rows of `cache` at each position ``[1, ...]``,
    read chunk by chunk (`slices`): a mean ablation's first pass."""
    sums: dict[str, tuple[Tensor, Tensor]] = {}
    for rows in slices:
        sums = add_sums(sums, clean_sums(model, cache.window(rows), hooks, max_batch))
    return means_of(sums)


def _pos_axis(model: PatchableModel, hook: str) -> int:
    axis = pos_axis_of(model.hook_dict[hook])
    assert axis is not None  # patched hooks have a position axis (parse_sites)
    return axis
