"""The activation cache: clean and corrupt activations of chosen hooks, in HDF5 (docs/formats.md, "Activation cache").

Format version 1::

    /                      attrs: format, format_version, model_hash, model_sha256, model_config, task,
                           hookmech_version
    tokens/clean|corrupt   int32 [N, T]
    lengths, answers, doc_index   int32 [N]
    roles/<role>           int32 [N]
    acts/clean/<hook>      float32 or float16 [N, T, ...]   (chunked along N)
    acts/corrupt/<hook>    float32 or float16 [N, T, ...]
    p_answer/clean|corrupt float32 [N]

Hook names contain dots, which HDF5 allows in names; they are stored verbatim.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch import Tensor

from . import __version__
from .cache_checks import (
    ACTIVATION_DTYPES,
    FORMAT,
    FORMAT_VERSION,
    ROW_COLUMNS,
    TOKEN_COLUMNS,
    check_format,
    check_layout,
    check_probabilities,
    check_row_integers,
    check_version,
    json_attribute,
    model_hook_points,
    refuse_non_finite_acts,
    refuse_other_position_axis,
)
from .errors import HookmechError, UsageError, suggest, unknown
from .fileio import atomic_h5, sha256_of
from .identity import model_hash
from .pretrained import is_pretrained
from .row_chunks import DEFAULT_MEMORY_MIB, MIB, bytes_per_row, plan_row_chunks
from .shapes import Acts, ActsAt, RowFloats
from .sites import as_specs, hook_to_site, resolve_sites, site_to_hook
from .tasks.batch import Batch
from .validate import allows_minus_inf, check_finite_parameters, first_non_finite, refuse_non_finite_run, value_at

#: the most rows, and tokens, write_cache runs per forward pass and stores per HDF5 chunk by
#: default (smaller forwards stay in the CPU's caches and let the writes of one overlap the
#: next: bench/cache_throughput.py)
MAX_CHUNK_ROWS = 256
MAX_CHUNK_TOKENS = 8192
#: rows `CacheFile.check_model` recomputes with the model (a seeded choice) to verify a cache
VERIFY_ROWS = 4
VERIFY_SEED = 0
#: the largest difference `CacheFile.check_model` accepts between a cached and a recomputed
#: p(answer): 10x what a run may move between CPU and CUDA (1e-4, bench/gpu_check.py; one device
#: moves it by 1e-6 between batchings), far below what another model or an edit changes
VERIFY_P_TOL = 1e-3
#: the same for activations, relative to the hook's largest |value| on the checked rows, by the
#: dtype stored (float16 rounds to 2**-11 ≈ 5e-4 of a value)
VERIFY_ACTS_RTOL = {"float32": 1e-3, "float16": 4e-3}


def default_chunk(n_rows: int, n_pos: int) -> int:
    """Return write_cache's rows per chunk: `n_rows` split evenly into the fewest chunks of at
    most `MAX_CHUNK_ROWS` rows and `MAX_CHUNK_TOKENS` tokens (HDF5 allocates whole chunks:
    320 rows in chunks of 256 would store 512)."""
    limit = max(1, min(MAX_CHUNK_ROWS, MAX_CHUNK_TOKENS // max(n_pos, 1)))
    return math.ceil(n_rows / math.ceil(n_rows / limit))


def answer_probs(logits: Tensor, answers: Tensor) -> Tensor:
    """Return p(answer) ``[N]`` from logits ``[N, d_vocab]`` (softmax over the full vocabulary)."""
    return logits.float().softmax(dim=-1).gather(-1, answers[:, None]).squeeze(-1)


def run_chunks(n_rows: int, chunk: int) -> Iterator[slice]:
    """Yield row slices of at most `chunk` rows covering ``range(n_rows)``."""
    for start in range(0, n_rows, chunk):
        yield slice(start, min(n_rows, start + chunk))


def check_batch_fits(model, batch: Batch, where: str = "the examples") -> None:
    """Raise a HookmechError unless `model` can run `batch`: every token and answer is one of its
    token ids (``0 .. d_vocab - 1``), the rows fit its context (`n_ctx`) and every role position
    is inside its row (`check_roles_inside_rows`). Returns None."""
    d_vocab, n_ctx = model.cfg.d_vocab, model.cfg.n_ctx
    for name, ids in (("tokens", batch.tokens), ("corrupt tokens", batch.corrupt_tokens), ("answers", batch.answers)):
        if ids.numel() == 0:
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= d_vocab:
            raise HookmechError(
                f"{where}: token id {high if high >= d_vocab else low} (in their {name}) is not a token "
                f"of the model (d_vocab {d_vocab}, ids 0..{d_vocab - 1}): are they of another task "
                "or vocabulary size?"
            )
    if batch.tokens.shape[1] > n_ctx:
        raise HookmechError(
            f"{where}: rows of {batch.tokens.shape[1]} tokens do not fit the model's context (n_ctx {n_ctx})"
        )
    check_roles_inside_rows(batch, where)


def check_roles_inside_rows(batch: Batch, where: str = "the examples") -> None:
    """Raise a HookmechError naming the first row whose length is not in 1..T or whose role
    position is outside the row (a role of -1 would index the last position). Returns None."""
    n_pos, lengths = batch.tokens.shape[1], batch.lengths
    short = (lengths < 1) | (lengths > n_pos)
    if bool(short.any()):
        row = int(short.int().argmax())
        raise HookmechError(
            f"{where}: row {row} has length {int(lengths[row])}, expected 1..{n_pos} (the tokens' width)"
        )
    for role, positions in batch.roles.items():
        outside = (positions < 0) | (positions >= lengths)
        if bool(outside.any()):
            row = int(outside.int().argmax())
            raise HookmechError(
                f"{where}: role {role} of row {row} is {int(positions[row])}, outside the row "
                f"(length {int(lengths[row])}: positions 0..{int(lengths[row]) - 1})"
            )


@torch.no_grad()
def check_cache_fits(model, cache: CacheFile, batch: Batch, hooks: Iterable[str]) -> None:
    """Raise a HookmechError naming the first of `hooks` stored in `cache` whose activation per
    row has another shape than `model`'s (a cache of another model: another width, heads ...),
    measured with one forward of the cache's first row. Returns None."""
    stored = [hook for hook in dict.fromkeys(hooks) if cache.has(hook, "clean") or cache.has(hook, "corrupt")]
    if not stored or len(batch) == 0:
        return
    check_batch_fits(model, batch, str(cache.path))
    device = next(model.parameters()).device
    _, acts = model.run_with_cache(
        batch.tokens[:1].to(device),
        names_filter=stored,
        return_cache_object=False,
        positions=batch.query_pos[:1].to(device),
    )
    for hook in stored:
        which = "clean" if cache.has(hook, "clean") else "corrupt"
        cached, own = list(cache[hook, which].shape[1:]), list(acts[hook].shape[1:]) if hook in acts else None
        if own is not None and cached != own:
            raise HookmechError(
                f"{cache.path}: cached {hook_to_site(hook)} has shape {cached} per row, this model's "
                f"{own}: the cache was made from another model{_config_difference(cache, model)}"
            )


def _config_difference(cache: CacheFile, model) -> str:
    """`` (d_model 16 in the cache, 32 here)``: where the cache's model config differs from `model`'s, or ''."""
    config = cache.model_config  # a JSON object: checked when the cache was opened
    own = json.loads(model.cfg.to_json())
    differ = [
        f"{key} {config[key]} in the cache, {own.get(key)} here"
        for key in ("d_model", "n_layers", "d_vocab", "mixers")
        if key in config and config[key] != own.get(key)
    ]
    return f" ({'; '.join(differ)})" if differ else ""


@torch.no_grad()
def write_cache(
    model,
    batch: Batch,
    path: str | Path,
    hooks: str | Iterable[str],
    *,
    model_sha256: str = "",
    model_source: str = "",
    task_spec: dict[str, Any] | None = None,
    chunk: int | None = None,
    dtype: str = "float32",
    compression: str | None = None,
    progress=None,
) -> Path:
    """Run `batch` clean and corrupt through `model`, storing the `hooks` activations and
    p(answer) in an HDF5 cache at `path` (written to a temporary file, then renamed).

    `hooks` are hook names or site specs (`hookmech.sites.resolve_sites`: ``"all"`` for every
    block-level site, ``"L*.block_in"``, ``"L1.mixer.q"`` ...), a bare string being one. The
    cache is identified by the model's `model_hash`; `model_sha256` (the checkpoint file's hash,
    which `hookmech cache` records) may be left empty; `model_source`, where given, is recorded as
    the root attribute ``model_source`` (`hookmech cache` gives a model folder's resolved path).

    `chunk` is the rows per forward pass and per HDF5 chunk (None: `default_chunk`); `dtype`
    the activations' ("float32" or "float16"). A model whose weights, activations (as `dtype`) or
    p(answer) are not finite is refused (HookmechError; -inf of masked attention scores aside):
    nothing is written. Returns the path written.
    """
    hooks = _hook_names(model, hooks)
    chunk = _check_cache_request(model, batch, hooks, dtype, chunk)
    aliases = _stored_once(model, hooks)
    with atomic_h5(path) as h5:
        _write_attributes(h5, model, model_sha256, model_source, task_spec)
        # every dataset stays referenced until the file closes (see atomic_h5: one freed while
        # the disk is full cannot report its failed flush)
        written = _write_columns(h5, batch)
        datasets = _write_runs(h5, model, batch, hooks, list(aliases), chunk, dtype, compression, progress)
        for hook, same in aliases.items():
            for which in ("clean", "corrupt"):
                h5[f"acts/{which}/{hook}"] = datasets[f"acts/{which}/{same}"]  # an HDF5 hard link
    del written  # after the file is closed
    return Path(path)


def _check_cache_request(model, batch: Batch, hooks: list[str], dtype: str, chunk: int | None) -> int:
    """Return the rows per forward pass of `write_cache`'s arguments (`chunk`, or
    `default_chunk`); a UsageError (or a HookmechError for weights that are not finite) for
    arguments it refuses."""
    if dtype not in ACTIVATION_DTYPES:
        raise UsageError(f"dtype {dtype!r}: the format stores activations as {' or '.join(ACTIVATION_DTYPES)}")
    if len(batch) == 0:
        raise UsageError("no rows to cache: the batch is empty")
    check_finite_parameters(model)
    check_batch_fits(model, batch)
    for hook in hooks:
        if getattr(model.hook_dict.get(hook), "pos_axis", 1) is None:
            raise UsageError(
                f"{hook} has no position axis (it does not depend on the input): nothing to cache per example"
            )
    if chunk is None:
        chunk = default_chunk(*batch.tokens.shape)
    if chunk < 1:
        raise UsageError(f"chunk must be >= 1 rows, got {chunk}")
    return chunk


def _write_attributes(h5: h5py.File, model, model_sha256: str, model_source: str, task_spec: dict | None) -> None:
    """Write the cache's root attributes (format, model identity and config, task); return None."""
    h5.attrs.update(
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model_hash": model_hash(model),
            "model_sha256": model_sha256,
            "model_config": model.cfg.to_json(),
            "task": json.dumps(task_spec or {}, sort_keys=True),
            "hookmech_version": __version__,
            # only where given, so that caches of checkpoint files keep their bytes
            **({"model_source": model_source} if model_source else {}),
        }
    )


def _write_columns(h5: h5py.File, batch: Batch) -> list[h5py.Dataset]:
    """Write `batch`'s integer columns (tokens of both runs, lengths, answers, document indices,
    role positions) as int32; return their datasets."""
    columns = {
        "tokens/clean": batch.tokens,
        "tokens/corrupt": batch.corrupt_tokens,
        **{name: getattr(batch, name) for name in ("lengths", "answers", "doc_index")},
        **{f"roles/{role}": positions for role, positions in batch.roles.items()},
    }
    return [h5.create_dataset(name, data=value.numpy().astype(np.int32)) for name, value in columns.items()]


def _write_runs(
    h5: h5py.File,
    model,
    batch: Batch,
    hooks: list[str],
    aliases: list[str],
    chunk: int,
    dtype: str,
    compression: str | None,
    progress,
) -> dict[str, h5py.Dataset]:
    """Run `batch` clean and corrupt through `model` `chunk` rows at a time and write p(answer) and
    the activations of `hooks` (as `dtype`) but `aliases` (linked to their equivalent hook's after);
    return the datasets written, by name."""
    n_rows = len(batch.tokens)
    device = next(model.parameters()).device
    # One thread writes while the next forward runs: torch computes without holding the
    # GIL, so the file writes (about as long as the forwards on CPU) overlap with them.
    with ThreadPoolExecutor(max_workers=1) as io, _ChunkWriter(h5, n_rows, chunk, compression, io) as writer:
        for rows in run_chunks(n_rows, chunk):
            for which, tokens in (("clean", batch.tokens), ("corrupt", batch.corrupt_tokens)):
                p_answer, acts = forward_rows(
                    model, tokens[rows], batch.query_pos[rows], batch.answers[rows], hooks, device
                )
                refuse_non_finite_run(model, p_answer, tokens[rows], which, rows.start)
                writer.put(f"p_answer/{which}", rows, p_answer.cpu().numpy())
                for hook in hooks:
                    if hook not in acts:
                        raise HookmechError(f"hook {hook} did not fire in the forward pass")
                    if hook not in aliases:
                        values = acts[hook].to("cpu", getattr(torch, dtype)).numpy()
                        _refuse_non_finite_output(values, hook, which, rows.start, dtype)
                        writer.put(f"acts/{which}/{hook}", rows, values)
                writer.flush()
            writer.wait_for_previous_chunk()
            if progress is not None:
                progress(rows.stop - rows.start)
    return writer.datasets


def _hook_names(model, specs: str | Iterable[str]) -> list[str]:
    """The hook names `write_cache` stores: each hook name of `model` as given, each other spec
    expanded by `resolve_sites` (in forward order), once each."""
    hooks: list[str] = []
    for spec in as_specs(specs, "site"):
        hooks += [spec] if spec in model.hook_dict else resolve_sites(spec, model.hook_dict)
    return list(dict.fromkeys(hooks))


def forward_rows(
    model, tokens: Tensor, query: Tensor, answers: Tensor, hooks: Sequence[str], device: torch.device
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run `tokens` ``[n, T]`` through `model` as `write_cache` does; return (p(answer) ``[n]``
    at the `query` positions, ``{hook: activations [n, ...]}`` of `hooks`). The cache check
    (`CacheFile.check_model`) recomputes rows with this same function."""
    logits, acts = model.run_with_cache(
        tokens.to(device), names_filter=list(hooks), return_cache_object=False, positions=query.to(device)
    )
    return answer_probs(logits, answers.to(device)), acts


def _refuse_non_finite_output(values: np.ndarray, hook: str, which: str, first_row: int, dtype: str) -> None:
    """Raise a HookmechError if `values` (rows from `first_row` on of `hook`'s activations, or of
    p(answer), in the `which` run, as `dtype`) hold a NaN or an infinity (-inf of masked
    attention scores aside): a cache of them would give null attributions. Returns None."""
    index = first_non_finite(values, allow_minus_inf=allows_minus_inf(hook))
    if index is None:
        return
    site = hook_to_site(hook)
    label = hook if site == hook else f"{site} ({hook})"
    hint = "; cache as float32" if dtype == "float16" else ""
    raise HookmechError(
        f"{label} of the {which} run holds {value_at(values, index)} at row {first_row + index[0]}, "
        f"index {[first_row + index[0], *index[1:]]} as {dtype}: not written (the model's activations "
        f"are not finite{hint})"
    )


def _stored_once(model, hooks: list[str]) -> dict[str, str]:
    """``{hook: equivalent hook}`` for the hooks whose activation is another cached hook's
    tensor (block l's output is block l+1's input, `HookedLM.equivalent_hook`): they are
    stored once, the second name being an HDF5 hard link to the first (readers see two datasets)."""
    equivalent = getattr(model, "equivalent_hook", lambda hook: hook)
    return {hook: equivalent(hook) for hook in hooks if equivalent(hook) != hook and equivalent(hook) in hooks}


class _ChunkWriter:
    """Writes row blocks into datasets of `h5`, creating each (chunked along N) on first use.

    `put` collects writes; `flush` hands the collected ones to the executor as one task (or
    runs them, without one). Leaving the `with` block waits for every write and re-raises the
    first error; `wait_for_previous_chunk` keeps at most two row chunks in flight.
    """

    def __init__(self, h5: h5py.File, n_rows: int, chunk: int, compression: str | None, executor=None):
        self.h5, self.n_rows, self.chunk, self.compression = h5, n_rows, chunk, compression
        self.datasets: dict[str, h5py.Dataset] = {}
        self.executor = executor
        self.collected: list[tuple[str, slice, np.ndarray]] = []
        self.pending: list[Future] = []
        self.previous: list[Future] = []
        self.failed = False

    def __enter__(self) -> _ChunkWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.flush()
        futures, self.previous, self.pending = self.previous + self.pending, [], []
        if exc_type is None:
            self._wait(futures)
        else:  # already failing: let the writes finish, keep the first error
            for future in futures:
                future.exception()

    def put(self, name: str, rows: slice, value: np.ndarray) -> None:
        """Queue writing `value` ``[len(rows), ...]`` to rows `rows` of dataset `name`."""
        self.collected.append((name, rows, value))

    def flush(self) -> None:
        """Start the queued writes: one task for all of them, since every hand-over between
        the threads costs more than a write of these sizes."""
        collected, self.collected = self.collected, []
        if self.executor is None:
            self._put_all(collected)
        elif collected:
            self.pending.append(self.executor.submit(self._put_all, collected))

    def wait_for_previous_chunk(self) -> None:
        """Block until the writes of the chunk before the current one are done."""
        self.flush()
        self._wait(self.previous)
        self.previous, self.pending = self.pending, []

    @staticmethod
    def _wait(futures: list[Future]) -> None:
        for future in futures:
            future.result()
        futures.clear()

    def _put_all(self, collected: list[tuple[str, slice, np.ndarray]]) -> None:
        if self.failed:  # a write already failed (a full disk): the file is abandoned
            return
        try:
            for name, rows, value in collected:
                self._put(name, rows, value)
        except BaseException:
            self.failed = True
            raise

    def _put(self, name: str, rows: slice, value: np.ndarray) -> None:
        value = np.ascontiguousarray(value)
        if name not in self.datasets:
            big = value.ndim > 1
            self.datasets[name] = self.h5.create_dataset(
                name,
                (self.n_rows, *value.shape[1:]),
                dtype=value.dtype,
                chunks=(min(self.chunk, self.n_rows), *value.shape[1:]) if big else None,
                compression=self.compression if big else None,
            )
        self._write(self.datasets[name], rows, value)

    def _write(self, dataset: h5py.Dataset, rows: slice, value: np.ndarray) -> None:
        chunk_rows = (dataset.chunks or (0,))[0]
        if dataset.compression is None and chunk_rows and rows.start % chunk_rows == 0 and len(value) <= chunk_rows:
            # A whole uncompressed chunk goes to the file as it is, past HDF5's chunk cache and
            # selection machinery (the fastest write h5py has). Rows past the dataset's end are padding.
            if len(value) < chunk_rows:
                value = np.concatenate([value, np.zeros((chunk_rows - len(value), *value.shape[1:]), value.dtype)])
            dataset.id.write_direct_chunk((rows.start, *[0] * (value.ndim - 1)), value.data)  # a memoryview: no copy
        else:
            dataset.write_direct(value, dest_sel=np.s_[rows.start : rows.stop])


class UnverifiedCacheWarning(UserWarning):
    """A cache records no model_hash, so the model it was made from cannot be checked."""


_warned_unverified = False

#: the end of the message of a cache whose recomputed rows disagree with it
_NOT_THIS_MODEL = (
    "the cache was made from another model (whatever its model_hash says) or was edited since; make a cache "
    "of this model, or skip this check (--no-verify-cache; CacheFile(path, verify=False))"
)


class _ModelCheck:
    """`CacheFile.check_model`'s two steps for one open file, and what they have established for
    which model (``checked``: (model_hash, "identity" | "p_answer" | hook) pairs)."""

    def __init__(self, cache: CacheFile):
        self.cache = cache
        self.checked: set[tuple[str, str]] = set()

    def identity(self, own: str, checkpoint: str | Path | None) -> None:
        global _warned_unverified
        if (own, "identity") in self.checked:
            return
        recorded = self.cache.model_hash
        if recorded is not None and recorded != own:
            than, whose = (
                (f" than {checkpoint}", "the checkpoint's") if checkpoint is not None else ("", "this model's")
            )
            raise HookmechError(
                f"{self.cache.path} was made from another model{than} (its model_hash {recorded}, {whose} {own}); "
                "make a cache of this model"
            )
        if (
            recorded is None
            and checkpoint is not None
            and (is_pretrained(checkpoint) or self.cache.model_sha256 != sha256_of(checkpoint))
        ):  # a model folder has no file hash: an older cache cannot be one of its models
            raise HookmechError(
                f"{self.cache.path} was made from another checkpoint (an older cache without model_hash; "
                f"its model_sha256 differs from {checkpoint}'s file hash)"
            )
        if recorded is None and checkpoint is None:
            if not _warned_unverified:
                _warned_unverified = True
                warnings.warn(
                    f"{self.cache.path} records no model_hash (written by an older hookmech): cannot check "
                    "that it was made from this model",
                    UnverifiedCacheWarning,
                    stacklevel=4,
                )
            return
        self.checked.add((own, "identity"))

    @torch.no_grad()
    def recompute(self, model, own: str, hooks: Iterable[str] | None) -> None:
        """Recompute the checked rows (`CacheFile.verify_rows`) with `model` and compare them with the file."""
        stored = self.cache.keys()
        wanted = stored if hooks is None else [hook for hook in dict.fromkeys(hooks) if hook in stored]
        todo = [hook for hook in wanted if (own, hook) not in self.checked]
        if (own, "p_answer") in self.checked and not todo:
            return
        foreign = [hook for hook in todo if hook not in model.hook_dict]
        if foreign:
            raise HookmechError(
                f"{self.cache.path} holds {foreign[0]}, which this model does not have: {_NOT_THIS_MODEL}"
            )
        rows = self.cache.verify_rows()
        batch = self.cache._rows(rows)
        check_batch_fits(model, batch, str(self.cache.path))
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()  # the cache's runs are the model's deterministic ones
        try:
            for which, tokens in (("clean", batch.tokens), ("corrupt", batch.corrupt_tokens)):
                p_answer, acts = forward_rows(model, tokens, batch.query_pos, batch.answers, todo, device)
                try:
                    self._compare_p_answer(which, rows, p_answer.double().cpu())
                    for hook in todo:
                        if self.cache.has(hook, which):
                            self._compare_acts(hook, which, rows, acts[hook].detach().to("cpu", torch.float64))
                except HookmechError:  # the cache's fault, unless the model disagrees with itself
                    again, _ = forward_rows(model, tokens, batch.query_pos, batch.answers, [], device)
                    self._refuse_nondeterministic(which, p_answer, again)
                    raise
        finally:
            model.train(was_training)
        self.checked.update((own, what) for what in ("p_answer", *todo))

    def _refuse_nondeterministic(self, which: str, first: Tensor, second: Tensor) -> None:
        """Raise a HookmechError when two runs of the same rows (`which` run) gave different
        p(answer) `first`, `second`: the model, not the cache, is why the rows disagree."""
        differ = float((first.double() - second.double()).abs().max())
        if differ > 0:
            raise HookmechError(
                f"{self.cache.path} cannot be checked with this model: two runs of the same {which} rows give "
                f"p(answer) {differ:.3g} apart (a mixer that draws random numbers in eval mode?), so its rows "
                "cannot be recomputed; skip the check (--no-verify-cache; CacheFile(path, verify=False)) if you "
                "trust the file"
            )

    def _compare_p_answer(self, which: str, rows: slice, recomputed: Tensor) -> None:
        cached = torch.from_numpy(self.cache._p_answer_rows(which, rows)).double()
        worst = int((cached - recomputed).abs().argmax())
        if abs(float(cached[worst] - recomputed[worst])) > VERIFY_P_TOL:
            raise HookmechError(
                f"{self.cache.path}: p_answer/{which} row {rows.start + worst} is {float(cached[worst]):.6g} in the "
                f"cache but {float(recomputed[worst]):.6g} recomputed with this model (tolerance "
                f"{VERIFY_P_TOL:g}): {_NOT_THIS_MODEL}"
            )

    def _compare_acts(self, hook: str, which: str, rows: slice, recomputed: Tensor) -> None:
        name = f"acts/{which}/{hook}"
        stored = self.cache.read_rows(hook, which, rows)
        cached = torch.from_numpy(stored).double()
        if cached.shape != recomputed.shape:
            raise HookmechError(
                f"{self.cache.path}: {name} has shape {list(cached.shape[1:])} per row, this model's "
                f"{list(recomputed.shape[1:])}: {_NOT_THIS_MODEL}"
            )
        finite = torch.isfinite(recomputed)
        scale = float(recomputed[finite].abs().max()) if bool(finite.any()) else 0.0
        rtol = VERIFY_ACTS_RTOL[stored.dtype.name]
        # equal non-finite entries (masked attention scores) agree; inf - inf would be nan
        difference = torch.where(cached == recomputed, 0.0, (cached - recomputed).abs().nan_to_num(math.inf))
        worst = float(difference.max())
        if worst > rtol * max(scale, 1e-30):
            index = [int(i) for i in np.unravel_index(int(difference.argmax()), tuple(difference.shape))]
            index[0] += rows.start
            raise HookmechError(
                f"{self.cache.path}: {name} row {index[0]} differs from this model's recomputed activation by "
                f"{worst:.3g} at index {index} (tolerance {rtol:g} of its largest |value| {scale:.3g}): "
                f"{_NOT_THIS_MODEL}"
            )


class CacheFile:
    """Lazy read access to a cache file: nothing is read until it is indexed.

    ``cache["blocks.1.hook_resid_pre"]`` (clean) or ``cache["blocks.1.hook_resid_pre", "corrupt"]``
    return h5py datasets (slice them to read); ``cache.at(site, role, which)`` reads the
    ``[N, ...]`` activations of each row at its role position.

    Opening checks the metadata: attributes, layout, shapes and dtypes (docs/formats.md). The
    row data is checked as it is read (`batch`, `p_answer`, `read_rows`, `read`, `gather`): role
    positions inside their rows, lengths, token ids, p(answer) in [0, 1], finite activations
    (-inf of masked attention scores aside). Each refusal is a HookmechError naming the file,
    the dataset and the first bad value. `verify` (default True): `check_model` also recomputes
    a few rows with the model and compares them with the file.
    """

    def __init__(self, path: str | Path, *, verify: bool = True):
        self.path = Path(path)
        self.verify = verify
        #: `check_model`'s steps and what they have established (a window shares its file's)
        self._model_check = _ModelCheck(self)
        #: a window (`window`): its first row in the file, and the whole file's CacheFile
        self._start = 0
        self._parent: CacheFile | None = None
        if not self.path.is_file():
            raise HookmechError(f"{self.path}: no such cache file")
        try:
            self._h5 = h5py.File(self.path, "r")
        except OSError as error:
            raise HookmechError(f"{self.path}: not an HDF5 cache ({error})") from None
        try:  # every check reads before the file closes: attributes of a closed file read as None
            check_format(self._h5, self.path)
            check_version(self._h5, self.path)
            self._model_config = json_attribute(self._h5, self.path, "model_config", "the model's config")
            self._hook_points: dict[str, Any] | None = None
            self._task = json_attribute(self._h5, self.path, "task", "the task's spec")
            self._shape = check_layout(self._h5, self.path)
        except HookmechError:
            self.close()
            raise

    @property
    def model_sha256(self) -> str:
        """The SHA-256 of the checkpoint file the cache was made from ('' when unknown)."""
        return str(self._h5.attrs.get("model_sha256", ""))

    @property
    def model_source(self) -> str:
        """The resolved path of the model folder the cache was made from ('' when it was made from
        a checkpoint file, or the writer did not say)."""
        return str(self._h5.attrs.get("model_source", ""))

    @property
    def model_hash(self) -> str | None:
        """The `hookmech.identity.model_hash` of the model the cache was made from; None in
        caches written before it was recorded."""
        value = self._h5.attrs.get("model_hash")
        return str(value) if value else None

    @property
    def model_config(self) -> dict[str, Any]:
        """The config of the model the cache was made from (the ``model_config`` attribute)."""
        return dict(self._model_config)

    @property
    def task(self) -> dict[str, Any]:
        """The spec of the task whose rows the cache holds (the ``task`` attribute)."""
        return dict(self._task)

    @property
    def n(self) -> int:
        """N: the number of rows."""
        return self._shape[0]

    @property
    def n_pos(self) -> int:
        """T: the tokens' width (rows are right-padded to it)."""
        return self._shape[1]

    def hooks(self, which: str = "clean") -> list[str]:
        """Return the hook names stored for `which` run."""
        group = self._h5.get(f"acts/{which}")
        return list(group.keys()) if group is not None else []

    # -- the one identity check ------------------------------------------------------------------
    def check_model(self, model, *, checkpoint: str | Path | None = None, hooks: Iterable[str] | None = None) -> None:
        """Raise a HookmechError unless this cache was made from `model`; return None.

        1. Identity: the cache's `model_hash` must be the model's. A cache without one (an older
           one) is checked by its `model_sha256` against the SHA-256 of `checkpoint`, the file the
           model was loaded from; without `checkpoint` it cannot be: that warns
           (`UnverifiedCacheWarning`, once per process) and passes.
        2. Unless the cache was opened with ``verify=False``: the file's word is not trusted. The
           clean and corrupt runs of `VERIFY_ROWS` rows (a seeded choice, the same each time) are
           recomputed with `model` and compared with the cached p(answer) (within `VERIFY_P_TOL`)
           and with the cached activations of `hooks` (None: every stored hook; within
           `VERIFY_ACTS_RTOL` of their largest value). A cache of another model, or edited on
           those rows, is refused; edits of other rows are not seen.

        What was checked for a model is not checked again while the file is open. A model whose
        weights are not finite is refused first.
        """
        if self._parent is not None:  # a window is checked as its file, on the file's rows
            return self._parent.check_model(model, checkpoint=checkpoint, hooks=hooks)
        check_finite_parameters(model)
        own = model_hash(model)
        self._model_check.identity(own, checkpoint)
        if self.verify:
            self._model_check.recompute(model, own, hooks)

    def verify_rows(self) -> slice:
        """Return the rows `check_model` recomputes: `VERIFY_ROWS` consecutive rows (all, in a
        smaller cache) from a start drawn with `VERIFY_SEED` (one slice reads them from each
        dataset at once; h5py reads a list of rows a millisecond slower per dataset)."""
        count = min(VERIFY_ROWS, self.n)
        start = int(np.random.default_rng(VERIFY_SEED).integers(0, self.n - count + 1))
        return slice(start, start + count)

    # -- row data, checked as it is read -------------------------------------------------------
    def batch(self) -> Batch:
        """Return the cached rows as a `Batch` (tokens, answers, roles ...), int64. A value outside
        its range (a role outside its row, a length outside 1..T, a token id outside the model
        config's vocabulary) is a HookmechError naming the dataset and the row."""
        return self._rows(slice(None))

    def _rows(self, rows: slice) -> Batch:
        """Return the rows of the slice `rows` as a `Batch`, checked."""
        names = [*TOKEN_COLUMNS, *ROW_COLUMNS, *(f"roles/{role}" for role in self.roles)]
        columns = {name: self._h5[name][self._file_rows(rows)] for name in names}
        check_row_integers(self.path, columns, self._row_numbers(rows), self._model_config, self.n_pos)

        def read(name: str) -> Tensor:
            return torch.from_numpy(columns[name].astype(np.int64))

        return Batch(
            tokens=read("tokens/clean"),
            corrupt_tokens=read("tokens/corrupt"),
            answers=read("answers"),
            lengths=read("lengths"),
            doc_index=read("doc_index"),
            roles={role: read(f"roles/{role}") for role in self.roles},
        )

    def _row_numbers(self, rows: slice) -> np.ndarray:
        """Return the file's row number of each row that `rows` reads."""
        return np.arange(*rows.indices(self.n)) + self._start

    def _file_rows(self, rows: slice) -> slice:
        """Return the file's rows of the slice `rows` of this cache (or window)."""
        start, stop, step = rows.indices(self.n)
        return slice(start + self._start, stop + self._start, step)

    def window(self, rows: slice) -> CacheFile:
        """Return the consecutive rows `rows` of this cache as a cache of their own (no copy: the
        same open file). Its `n`, `batch`, `p_answer`, `read_rows`, `read`, `at` and `gather`
        see those rows only; `check_model` checks the whole file, once for both; closing it
        leaves the file open. ``window[...]`` (an h5py dataset) still indexes the file's rows."""
        start, stop, step = rows.indices(self.n)
        if step != 1 or stop <= start:
            raise HookmechError(f"{self.path}: a window is a non-empty run of consecutive rows, got {rows}")
        view = copy.copy(self)
        view._start, view._shape = self._start + start, (stop - start, self._shape[1])
        view._parent = self._parent or self
        return view

    def p_answer(self, which: str) -> RowFloats:
        """Return the cached p(answer) ``[N]`` of the clean or corrupt run; a value that is not a
        probability (NaN, inf, outside [0, 1]) is a HookmechError naming its row."""
        return torch.from_numpy(self._p_answer_rows(which, slice(None)))

    def _p_answer_rows(self, which: str, rows: slice) -> np.ndarray:
        name = f"p_answer/{which}"
        values = self._h5[name][self._file_rows(rows)]
        check_probabilities(self.path, name, values, self._row_numbers(rows))
        return values

    def has(self, hook: str, which: str = "clean") -> bool:
        return bool(hook) and isinstance(self._h5.get(f"acts/{which}/{hook}"), h5py.Dataset)

    def keys(self) -> list[str]:
        """Return the stored hook names (either run), in forward order, as `ActivationCache.keys()`."""
        stored = list(dict.fromkeys([*self.hooks("clean"), *self.hooks("corrupt")]))
        return resolve_sites([hook_to_site(hook) for hook in stored], stored)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, key: object) -> bool:
        """``"L1.block_in" in cache`` / ``"blocks.1.hook_resid_pre" in cache`` (clean run), or
        ``(site, which) in cache``."""
        site, which = (
            (key, "clean")
            if isinstance(key, str)
            else key
            if isinstance(key, tuple) and len(key) == 2
            else (None, None)
        )
        if not isinstance(site, str) or which not in ("clean", "corrupt"):
            return False
        try:
            return self.has(site_to_hook(site), which)
        except UsageError:
            return False

    def hook_of(self, site: str, which: str = "clean") -> str:
        """Return the hook name of `site` (a site or hook name) stored for `which` run; an
        empty or unknown one is a UsageError naming the closest stored sites."""
        if which not in ("clean", "corrupt"):
            raise unknown("run", which, ("clean", "corrupt"))
        if not isinstance(site, str) or not site.strip():
            listing = ", ".join(map(hook_to_site, self.hooks(which))) or "none"
            raise UsageError(f"{self.path}: empty site name (cached: {listing})")
        try:
            hook = site_to_hook(site)
        except UsageError:
            hook = site
        if not self.has(hook, which):
            stored = self.hooks(which)
            candidates = [*map(hook_to_site, stored), *stored] if stored else []
            hint = suggest(site, candidates)
            listing = "" if hint or len(stored) > 16 else f" (stored: {', '.join(map(hook_to_site, stored)) or 'none'})"
            raise UsageError(f"{self.path}: no {which} activations for site {site!r}{hint}{listing}")
        return hook

    def __getitem__(self, key: str | tuple[str, str]) -> h5py.Dataset:
        hook, which = (key, "clean") if isinstance(key, str) else key
        return self._h5[f"acts/{which}/{self.hook_of(hook, which)}"]

    @property
    def roles(self) -> list[str]:
        """The role names stored (``key``, ``value``, ``query`` ...)."""
        return list(self._h5["roles"])

    def mean_p_answer(self, which: str, memory: int = DEFAULT_MEMORY_MIB * MIB) -> float:
        """Return the mean over rows of the cached p(answer) of the `which` run, read in row
        chunks of at most `memory` bytes (a sum of float64 chunk sums: the mean of the whole
        array, to float64 round-off), checked as `p_answer`."""
        total = 0.0
        for rows in plan_row_chunks(self.n, bytes_per_row([()]), memory):
            total += float(self._p_answer_rows(which, rows).astype(np.float64).sum())
        return total / self.n

    def summary(self, memory: int = DEFAULT_MEMORY_MIB * MIB) -> dict[str, Any]:
        """Return what the file holds, reading only metadata and the two ``[N]`` p(answer) arrays
        (in row chunks of at most `memory` bytes, `mean_p_answer`):
        ``path, format_version, n, n_pos, model_hash (None in older caches), model_sha256,
        model_source, task,
        model (mixers, d_model, n_layers, d_vocab), hookmech_version, roles, p_clean, p_corrupt``
        (means) and ``sites``, one dict per stored hook: ``site, hook, runs, shape, dtype,
        compression, chunks``."""
        config = self.model_config
        sites = []
        for hook in self.keys():
            runs = [which for which in ("clean", "corrupt") if self.has(hook, which)]
            data = self._h5[f"acts/{runs[0]}/{hook}"]
            sites.append(
                {
                    "site": hook_to_site(hook),
                    "hook": hook,
                    "runs": runs,
                    "shape": list(data.shape),
                    "dtype": str(data.dtype),
                    "compression": data.compression,
                    "chunks": list(data.chunks or []),
                }
            )
        return {
            "path": str(self.path),
            "format_version": int(self._h5.attrs["format_version"]),
            "n": self.n,
            "n_pos": self.n_pos,
            "model_hash": self.model_hash,
            "model_sha256": self.model_sha256,
            "model_source": self.model_source,
            "task": self.task,
            "model": {key: config.get(key) for key in ("mixers", "d_model", "n_layers", "d_vocab")},
            "hookmech_version": str(self._h5.attrs.get("hookmech_version", "")),
            "roles": self.roles,
            "p_clean": self.mean_p_answer("clean", memory),
            "p_corrupt": self.mean_p_answer("corrupt", memory),
            "sites": sites,
        }

    def read_rows(self, hook: str, which: str, rows: slice) -> np.ndarray:
        """Return the stored activations of `hook` (a site or hook name) in the `which` run for
        the slice `rows`, as stored (float32 or float16). A NaN or an
        infinity (-inf of masked attention scores aside) is a HookmechError naming the dataset
        and the first such value."""
        hook = self.hook_of(hook, which)
        values = self._h5[f"acts/{which}/{hook}"][self._file_rows(rows)]
        numbers = self._row_numbers(rows)
        refuse_non_finite_acts(self.path, hook, which, values, lambda index: [int(numbers[index[0]]), *index[1:]])
        return values

    def read(self, hook: str, which: str, rows: slice) -> Acts:
        """Return the activations of `hook` for `rows` as a float32 tensor (checked as `read_rows`)."""
        return torch.from_numpy(self.read_rows(hook, which, rows)).float()

    def at(self, site: str, role: str, which: str = "clean") -> ActsAt:
        """Return ``[N, ...]``: each row's activation of `site` at its `role` position."""
        if role not in self._h5["roles"]:
            raise unknown("role", role, self.roles)
        whole = self._file_rows(slice(None))
        columns = {name: self._h5[name][whole] for name in ("lengths", f"roles/{role}")}
        check_row_integers(self.path, columns, self._row_numbers(slice(None)), self._model_config, self.n_pos)
        return self.gather(site, columns[f"roles/{role}"], which)

    def gather(self, site: str, positions: np.ndarray | Tensor | Sequence[int], which: str = "clean") -> ActsAt:
        """Return ``[N, ...]``: row i's activation of `site` at ``positions[i]`` (``[N]`` ints in
        0..T-1; another shape or a position outside is a UsageError), checked as `read_rows`."""
        data = self[site, which]
        refuse_other_position_axis(data.name.rsplit("/", 1)[-1], self._model_hook_points)
        positions = np.asarray(positions)
        if positions.shape != (self.n,):
            raise UsageError(f"need one position per row ({self.n}), got shape {positions.shape}")
        if positions.size and (positions.min() < 0 or positions.max() >= data.shape[1]):
            raise UsageError(f"positions must be in 0..{data.shape[1] - 1}, got {positions.min()}..{positions.max()}")
        # h5py reads one list of increasing rows per call: group the rows by position.
        out = np.empty((len(positions), *data.shape[2:]), dtype=data.dtype)
        for position in np.unique(positions):
            rows = np.nonzero(positions == position)[0]
            out[rows] = data[(rows + self._start).tolist(), int(position)]
        hook = data.name.rsplit("/", 1)[-1]
        refuse_non_finite_acts(
            self.path, hook, which, out, lambda index: [index[0], int(positions[index[0]]), *index[1:]]
        )
        return torch.from_numpy(out)

    def _model_hook_points(self) -> dict[str, Any]:
        """The hook points of the cache's model (`model_hook_points`), built once."""
        if self._hook_points is None:
            self._hook_points = model_hook_points(self._model_config)
        return self._hook_points

    def close(self) -> None:
        """Close the file (a window leaves it open: its file's owner closes it)."""
        if self._parent is None:
            self._h5.close()

    def __enter__(self) -> CacheFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open(path: str | Path, *, verify: bool = True) -> CacheFile:  # noqa: A001 - mirrors h5py.File
    """Open a cache file lazily (see `CacheFile`)."""
    return CacheFile(path, verify=verify)
