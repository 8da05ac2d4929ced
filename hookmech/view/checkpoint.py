"""What the page of a checkpoint (or of its activation cache) shows, as JSON-able data.

`checkpoint_page_data` collects

- the site × position patching records: those of `hookmech.patching.patch`, the numbers
  ``hookmech patch --json`` prints for the same model, examples, sites and positions;
- per cell, the per-example p_patched and the rows with the largest and smallest effect
  (p_patched − p_corrupt of the row), beside the unpatched runs' per-example p_clean, p_corrupt
  (the engine's own, with ``per_example``);
- the examples: clean and corrupt tokens, lengths, answers, roles, and the task's name of
  every token id (`Task.token_names`: a tokenizer task's are the tokens' texts);
- per layer, the effective attention (`hookmech.attention_maps`) of the first examples: the
  channel mean of per-channel mixers and every head, plus every channel for short rows
  (`SHORT_ROWS`), as many examples as fit in `MAP_BUDGET` bytes;
- the induction scores of every layer and head on the first `INDUCTION_ROWS` examples
  (`hookmech.induction_scores` of the batch: query → value, value → key), and, when asked,
  Olsson et al.'s prefix matching on random repeated tokens (out of the task's distribution).

Rendering is `hookmech.view.page`'s; nothing here writes HTML.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import CacheFile
from ..errors import HookmechError
from ..row_chunks import MEMORY_MIB, chunk_rows, row_chunks
from ..tasks.base import Task
from ..tasks.batch import Batch
from .encode import pack_floats, pack_ints
from .spill import Spill, materialize

# the patching engine and .effective_attention are imported where used: they load TransformerLens

#: rows whose effective attention is embedded, at most (the first rows of the examples)
MAP_EXAMPLES = 8
#: bytes of float32 map values embedded at most (at least one example is always embedded)
MAP_BUDGET = 8 * 2**20
#: per-channel maps (Mamba, Hyena, BaseConv) are embedded for rows of at most this many tokens
SHORT_ROWS = 64
#: rows listed per cell with the largest and with the smallest effect
TOP_K = 5
#: the induction scores are those of the first examples, at most this many (per-channel mixers
#: build their M a row at a time: 64 rows of the Mamba fixture take 0.7 s, 320 take 3.3 s)
INDUCTION_ROWS = 64


def default_positions(task: Task, batch: Batch) -> list[str]:
    """Return the task's roles that `batch` carries, in the task's order: the positions the page
    (and `hookmech report`'s heatmaps) patch when none are given."""
    return [role for role in task.roles if role in batch.roles]


def token_names(task: Task, d_vocab: int) -> list[str]:
    """Return the task's name of every token id ``0 .. d_vocab - 1`` (`Task.token_names`:
    ``k3``, ``v0``, ``t17``, ``BOS``, ...; a tokenizer task's decoded texts, `` Paris``)."""
    return task.token_names(d_vocab)


def checkpoint_page_data(
    model,
    task: Task,
    source: Batch | CacheFile | str | Path,
    *,
    sites: Sequence[str] = ("all",),
    positions: Sequence[str] | None = None,
    threshold: float = 0.01,
    max_batch: int = 256,
    map_examples: int = MAP_EXAMPLES,
    map_budget: int = MAP_BUDGET,
    top_k: int = TOP_K,
    about: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    random_repeat_induction: bool = False,
    memory: float = MEMORY_MIB,
    chunk: int | None = None,
    spill: bool = False,
) -> dict[str, Any]:
    """Return the page data of `model` on `source` (a `Batch`, or an activation cache of this
    model: path or open `CacheFile`): ``{"kind": "checkpoint", "about", "model", "records",
    "rows", "cells", "vocab", "maps", "induction"}`` (module docstring; arrays packed by
    `hookmech.view.encode`).

    `records` are `hookmech.patching.patch`'s records of `sites` × `positions` (default: every
    role of the task, `default_positions`) with `threshold` and `max_batch`, without their
    per-row lists; ``cells[i]`` holds record i's per-row ``p_patched`` and the `top_k` rows of
    largest and smallest effect. `about` (JSON-able) is shown as the page's description.
    `progress` is `patch`'s, per chunk (called as records are done: the calls add up to the
    records times the chunks, `page_chunk_rows`). The induction scores are those of
    the examples (`induction_data`), plus prefix matching on random repeated tokens with
    `random_repeat_induction`.

    Memory: the rows are patched `chunk` rows at a time (None: as many as fit in `memory` MiB,
    `page_chunk_rows`), each chunk's per-row numbers going to temporary files as they are made;
    a record's means are its chunks' means weighted by their rows (the one chunk's own record
    where the rows fit in one). With `spill`, the per-row arrays stay in those files
    (`hookmech.view.spill.Spill`s in the data, which `write_page` writes and closes); without,
    they are read back into the data as packed arrays.
    """
    with contextlib.ExitStack() as stack:
        if isinstance(source, (str, Path)):
            source = stack.enter_context(CacheFile(source))
        n_rows = source.n if isinstance(source, CacheFile) else len(source)
        first = _window(source, slice(0, min(n_rows, max(map_examples, INDUCTION_ROWS))))
        positions = list(positions) if positions is not None else default_positions(task, first)
        rows_per_chunk = page_chunk_rows(model, source, memory) if chunk is None else chunk
        rows, cells, records = _patched_rows(
            model, source, n_rows, rows_per_chunk, list(sites), positions, threshold, max_batch, top_k, progress
        )
    config = model.cfg
    data = {
        "kind": "checkpoint",
        "about": about or {},
        "model": {
            "mixers": list(config.mixers),
            "d_model": config.d_model,
            "n_layers": config.n_layers,
            "d_vocab": config.d_vocab,
        },
        "task": task.spec,
        "records": records,
        "rows": rows,
        "cells": cells,
        "vocab": token_names(task, config.d_vocab),
        "maps": maps_data(model, first, map_examples, map_budget),
        "induction": induction_data(
            model, first.select(slice(0, INDUCTION_ROWS)), random_repeat=random_repeat_induction
        ),
    }
    return data if spill else materialize(data)


def page_chunk_rows(model, source: Batch | CacheFile, memory: float = MEMORY_MIB) -> int:
    """Return the rows `checkpoint_page_data` patches at once within `memory` MiB. Per row, as
    the patching engine holds them: the clean and corrupt activations of every block-level site
    (eight per layer, and the embeddings; or every hook the cache stores, if more) and four
    ``[T, d_model]`` mixer contexts per layer, each counted twice for the forwards' copies."""
    config = model.cfg
    n_pos = source.n_pos if isinstance(source, CacheFile) else int(source.tokens.shape[1])
    per_row = 2 * (8 * config.n_layers + 2) * n_pos * config.d_model * 4
    if isinstance(source, CacheFile):
        stored = sum(
            math.prod(source[hook, which].shape[1:]) * source[hook, which].dtype.itemsize
            for which in ("clean", "corrupt")
            for hook in source.hooks(which)
        )
        per_row = max(per_row, stored)
    per_row += 4 * config.n_layers * n_pos * config.d_model * 4
    return chunk_rows(2 * per_row, memory)


def _window(source: Batch | CacheFile, rows: slice) -> Batch:
    """The `Batch` of the rows `rows` of `source`."""
    return source.window(rows).batch() if isinstance(source, CacheFile) else source.select(rows)


def _patched_rows(
    model,
    source: Batch | CacheFile,
    n_rows: int,
    rows_per_chunk: int,
    sites: list[str],
    positions: list[str],
    threshold: float,
    max_batch: int,
    top_k: int,
    progress: Callable[[int], None] | None,
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Patch the rows of `source` a chunk at a time; return (`rows_data`'s dict, the cells, the
    records), the per-row arrays as `Spill`s written chunk by chunk."""
    from ..patching import patch

    columns = {name: Spill("ints") for name in ("tokens", "corrupt_tokens")}
    columns.update({name: Spill("list") for name in ("lengths", "answers")})
    roles: dict[str, Spill] = {}
    p_rows = {name: Spill("floats") for name in ("p_clean", "p_corrupt")}
    chunks_records: list[list[dict[str, Any]]] = []
    cell_rows: list[Spill] = []
    tops: list[tuple[_Extremes, _Extremes]] = []
    n_pos = 0
    for rows in row_chunks(n_rows, rows_per_chunk):
        window = source.window(rows) if isinstance(source, CacheFile) else source.select(rows)
        batch = window.batch() if isinstance(window, CacheFile) else window
        records = patch(
            model,
            window,
            sites,
            positions,
            threshold=threshold,
            max_batch=max_batch,
            per_example=True,
            progress=progress,
        )
        n_pos = int(batch.tokens.shape[1])
        columns["tokens"].append(batch.tokens.numpy())
        columns["corrupt_tokens"].append(batch.corrupt_tokens.numpy())
        columns["lengths"].append(batch.lengths.numpy())
        columns["answers"].append(batch.answers.numpy())
        for role, at in batch.roles.items():
            roles.setdefault(role, Spill("list")).append(at.numpy())
        p_corrupt = np.asarray(records[0]["p_corrupt_rows"], dtype=np.float64)
        p_rows["p_clean"].append(records[0]["p_clean_rows"])
        p_rows["p_corrupt"].append(p_corrupt)
        if not cell_rows:
            cell_rows = [Spill("floats") for _ in records]
            tops = [(_Extremes(top_k, largest=True), _Extremes(top_k, largest=False)) for _ in records]
        for record, spill, extremes in zip(records, cell_rows, tops, strict=True):
            p_patched = np.asarray(record.pop("p_patched_rows"), dtype=np.float64)
            for name in ("p_clean_rows", "p_corrupt_rows", "metric_patched_rows"):
                record.pop(name, None)
            spill.append(p_patched)
            for top in extremes:
                top.add(p_patched - p_corrupt, rows.start)
        chunks_records.append(records)
    rows_dict = {
        "n": n_rows,
        "pos": n_pos,
        **columns,
        "roles": roles,
        **p_rows,
    }
    cells = [
        {"p_patched": spill, "largest": largest.rows(), "smallest": smallest.rows()}
        for spill, (largest, smallest) in zip(cell_rows, tops, strict=True)
    ]
    return rows_dict, cells, _joined_records(chunks_records, threshold)


def _joined_records(chunks: list[list[dict[str, Any]]], threshold: float) -> list[dict[str, Any]]:
    """Return the records of all rows from each chunk's records (the same cells in the same
    order): means weighted by the chunks' rows, attribution and filter recomputed from them as the
    engine computes them (`patch_record`); one chunk's records are returned as they are."""
    from ..patching.records import Means, patch_record

    if len(chunks) == 1:
        return chunks[0]
    joined = []
    for parts in zip(*chunks, strict=True):
        n = sum(part["n"] for part in parts)

        def mean(name: str, parts=parts, n=n) -> float:
            return sum(part[name] * part["n"] for part in parts) / n

        first = parts[0]
        metric = Means(mean("metric_clean"), mean("metric_corrupt"), mean("metric_patched"))
        joined.append(
            patch_record(
                first["site"],
                first["hook"],
                first["pos"],
                n,
                Means(mean("p_clean"), mean("p_corrupt"), mean("p_patched")),
                metric,
                method=first["method"],
                metric_name=first["metric"],
                direction=first["direction"],
                passes_filter=bool(metric.clean - metric.corrupt > threshold),
            )
        )
    return joined


class _Extremes:
    """The `k` rows of largest (or smallest) effect seen so far, ties to the lower row (as
    `extreme_rows` picks them from all rows at once: the best `k` of all rows are the best `k`
    of the best `k` of each chunk)."""

    def __init__(self, k: int, *, largest: bool):
        self.k, self.sign = k, -1.0 if largest else 1.0
        self.kept_rows = np.zeros(0, dtype=np.int64)
        self.kept_keys = np.zeros(0, dtype=np.float64)

    def add(self, effect: np.ndarray, first_row: int) -> None:
        """Consider the rows ``first_row ..`` of effect `effect` ``[n]`` (after every row kept so far)."""
        rows = np.concatenate([self.kept_rows, first_row + np.arange(len(effect))])
        keys = np.concatenate([self.kept_keys, self.sign * effect])
        best = np.sort(np.argsort(keys, kind="stable")[: self.k])  # kept in row order: ties stay to the lower row
        self.kept_rows, self.kept_keys = rows[best], keys[best]

    def rows(self) -> list[int]:
        """The rows kept, best first."""
        return self.kept_rows[np.argsort(self.kept_keys, kind="stable")].tolist()


def extreme_rows(
    p_patched_rows: Sequence[float], p_corrupt_rows: Sequence[float], k: int
) -> tuple[list[int], list[int]]:
    """Return (the `k` rows of largest effect, the `k` of smallest), effect = p_patched − p_corrupt
    of the row; ties go to the lower row index."""
    effect = np.asarray(p_patched_rows, dtype=np.float64) - np.asarray(p_corrupt_rows, dtype=np.float64)
    largest = np.argsort(-effect, kind="stable")[:k]
    smallest = np.argsort(effect, kind="stable")[:k]
    return largest.tolist(), smallest.tolist()


def rows_data(batch: Batch, p_clean_rows: Sequence[float], p_corrupt_rows: Sequence[float]) -> dict[str, Any]:
    """Return the examples as the page reads them: ``n``, ``pos`` (the padded row length),
    clean and corrupt ``tokens`` ``[n, pos]`` (packed), ``lengths``, ``answers``, ``roles``
    (role -> ``[n]`` positions), and the unpatched runs' per-row ``p_clean``, ``p_corrupt`` (packed)."""
    return {
        "n": len(batch),
        "pos": int(batch.tokens.shape[1]),
        "tokens": pack_ints(batch.tokens.numpy()),
        "corrupt_tokens": pack_ints(batch.corrupt_tokens.numpy()),
        "lengths": batch.lengths.tolist(),
        "answers": batch.answers.tolist(),
        "roles": {role: positions.tolist() for role, positions in batch.roles.items()},
        "p_clean": pack_floats(p_clean_rows),
        "p_corrupt": pack_floats(p_corrupt_rows),
    }


def _triangle(matrix: np.ndarray) -> np.ndarray:
    """Return the lower triangle (diagonal included) of ``[..., L, L]`` row by row, ``[..., L(L+1)/2]``:
    query t's keys 0..t start at t(t+1)/2 (causal maps are zero above the diagonal)."""
    rows, cols = np.tril_indices(matrix.shape[-1])
    return matrix[..., rows, cols]


def maps_data(model, batch: Batch, examples: int, budget: int) -> dict[str, Any]:
    """Return the effective attention of the first rows of `batch`: ``{"examples": [row], "layers":
    [{"layer", "mixer", "axis", "n", "channels"}], "values": [[packed per layer] per example],
    "channels": same or None}``. ``values[i][l]`` is layer l's M on example i's own tokens (its
    length L), ``[n, L(L+1)/2]``: every head (or the channel mean, n = 1) as a lower triangle,
    float32; ``channels[i][l]`` every channel of a per-channel mixer (``channels`` of them), for
    rows of at most `SHORT_ROWS` tokens, else None. As many of the first `examples` rows as fit
    in `budget` bytes, at least one. On a model without effective attention (e.g. BaseConv
    with use_act) ``{"error": message}``."""
    from ..effective_attention import attention_maps

    device = next(model.parameters()).device
    lengths = batch.lengths.tolist()
    try:  # two tokens tell each layer's heads or channels
        probe = attention_maps(model, batch.tokens[:1, :2].to(device), summary=None)
    except HookmechError as error:
        return {"error": str(error)}
    layers = []
    for layer, layer_map in probe.items():
        per_channel = model.blocks[layer].mixer.attention_axis == "channel"
        width = int(layer_map.shape[1])
        layers.append(
            {
                "layer": layer,
                "mixer": model.cfg.mixers[layer],
                "axis": "channel" if per_channel else "head",
                "n": 1 if per_channel else width,
                "channels": width if per_channel else 0,
            }
        )
    chosen: list[int] = []
    spent = 0
    for row in range(min(examples, len(batch))):
        maps_per_row = sum(entry["n"] for entry in layers)
        if lengths[row] <= SHORT_ROWS:
            maps_per_row += sum(entry["channels"] for entry in layers)
        cost = 4 * maps_per_row * lengths[row] * (lengths[row] + 1) // 2
        if chosen and spent + cost > budget:
            break
        chosen.append(row)
        spent += cost
    longest = max(lengths[row] for row in chosen)
    tokens = batch.tokens[chosen, :longest].to(device)
    means = {layer: m.cpu().numpy() for layer, m in attention_maps(model, tokens).items()}
    with_channels = longest <= SHORT_ROWS and any(entry["channels"] for entry in layers)
    every = (
        {layer: m.cpu().numpy() for layer, m in attention_maps(model, tokens, summary=None).items()}
        if with_channels
        else {}
    )
    values, channels = [], []
    for index, row in enumerate(chosen):
        length = lengths[row]
        values.append(
            [
                pack_floats(_triangle(means[entry["layer"]][index, :, :length, :length]), lossy_float32=True)
                for entry in layers
            ]
        )
        if with_channels:
            channels.append(
                [
                    pack_floats(_triangle(every[entry["layer"]][index, :, :length, :length]), lossy_float32=True)
                    if entry["channels"]
                    else None
                    for entry in layers
                ]
            )
    if not with_channels:
        for entry in layers:
            entry["channels"] = 0
    return {"examples": chosen, "layers": layers, "values": values, "channels": channels or None}


def induction_data(model, batch: Batch, random_repeat: bool = False, rows: int = 16, seed: int = 0) -> dict[str, Any]:
    """Return the induction scores of every layer and head or channel mean on the examples of
    `batch` (`hookmech.induction_scores`): ``{"n", "names", "uniform": {name: value},
    "layers": [{"layer", "mixer", "per_channel", "scores": {name: [value per head]}}]}``, with
    ``"random_repeat": {"seq_len", "rows", "layers": [... "scores": [value per head]]}`` (prefix
    matching on `rows` random repeated sequences, `seed`) when `random_repeat`; or
    ``{"error": message}`` when the model has no effective attention."""
    from ..effective_attention import (
        RANDOM_REPEAT_SCORE,
        TASK_SCORES,
        induction_scores,
        uniform_task_scores,
    )

    try:
        scores = induction_scores(model, batch)
        repeated = induction_scores(model, random_repeat=True, rows=rows, seed=seed) if random_repeat else None
    except HookmechError as error:
        return {"error": str(error)}

    def layer_entry(layer: int, values) -> dict[str, Any]:
        return {
            "layer": layer,
            "mixer": model.cfg.mixers[layer],
            "per_channel": model.blocks[layer].mixer.attention_axis == "channel",
            "scores": values,
        }

    data: dict[str, Any] = {
        "n": len(batch),
        "names": list(TASK_SCORES),
        "uniform": uniform_task_scores(batch),
        "layers": [
            layer_entry(layer, {name: [float(v) for v in values.tolist()] for name, values in by_name.items()})
            for layer, by_name in scores.items()
        ],
    }
    if repeated is not None:
        data["random_repeat"] = {
            "seq_len": min(model.cfg.n_ctx // 2, model.cfg.d_vocab),
            "rows": rows,
            "layers": [
                layer_entry(layer, [float(v) for v in by_name[RANDOM_REPEAT_SCORE].tolist()])
                for layer, by_name in repeated.items()
            ],
        }
    return data
