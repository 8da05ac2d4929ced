"""The activation cache: clean and corrupt activations of chosen hooks, in HDF5 (docs/formats.md, "Activation cache").

Format version 1::

    /                      attrs: format, format_version, model_hash, model_sha256, model_config, task,
                           hookmech_version
    tokens/clean|corrupt   int32 [N, T]
    lengths, answers, doc_index   int32 [N]
    roles/<role>           int32 [N]
    acts/clean/<hook>      [N, T, ...]   (chunked along N)
    acts/corrupt/<hook>    [N, T, ...]
    p_answer/clean|corrupt float32 [N]

Hook names contain dots, which HDF5 allows in names; they are stored verbatim.
"""

from __future__ import annotations

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
from .errors import HookmechError, UsageError, suggest, unknown
from .fileio import atomic_h5
from .identity import model_hash
from .shapes import Acts, ActsAt, RowFloats
from .sites import hook_to_site, resolve_sites, site_to_hook
from .tasks.batch import Batch

FORMAT = "hookmech-cache"
FORMAT_VERSION = 1
#: the format attribute of dataset files (`hookmech.datasets`), told apart in messages
DATASET_FORMAT = "hookmech-dataset"
#: the most rows, and tokens, write_cache runs per forward pass and stores per HDF5 chunk by
#: default (smaller forwards stay in the CPU's caches and let the writes of one overlap the
#: next: bench/cache_throughput.py)
MAX_CHUNK_ROWS = 256
MAX_CHUNK_TOKENS = 8192


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
    token ids (``0 .. d_vocab - 1``) and the rows fit its context (`n_ctx`). Returns None."""
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
    try:
        config = cache.model_config
    except (KeyError, ValueError):  # no readable model config: the shapes say enough
        return ""
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
    hooks: Iterable[str],
    *,
    model_sha256: str = "",
    task_spec: dict[str, Any] | None = None,
    chunk: int | None = None,
    dtype: str = "float32",
    compression: str | None = None,
    progress=None,
) -> Path:
    """Run `batch` clean and corrupt through `model`, storing the `hooks` activations and
    p(answer) in an HDF5 cache at `path` (written to a temporary file, then renamed).

    `chunk` is the rows per forward pass and per HDF5 chunk (None: `default_chunk`). Returns
    the path written.
    """
    hooks = list(dict.fromkeys(hooks))
    check_batch_fits(model, batch)
    for hook in hooks:
        if getattr(model.hook_dict.get(hook), "pos_axis", 1) is None:
            raise UsageError(
                f"{hook} has no position axis (it does not depend on the input): nothing to cache per example"
            )
    aliases = _stored_once(model, hooks)
    n_rows, n_pos = batch.tokens.shape
    if chunk is None:
        chunk = default_chunk(n_rows, n_pos)
    if chunk < 1:
        raise UsageError(f"chunk must be >= 1 rows, got {chunk}")
    device = next(model.parameters()).device
    with atomic_h5(path) as h5:
        h5.attrs.update(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "model_hash": model_hash(model),
                "model_sha256": model_sha256,
                "model_config": model.cfg.to_json(),
                "task": json.dumps(task_spec or {}, sort_keys=True),
                "hookmech_version": __version__,
            }
        )
        # every dataset stays referenced until the file closes (see atomic_h5: one freed while
        # the disk is full cannot report its failed flush)
        columns = {
            "tokens/clean": batch.tokens,
            "tokens/corrupt": batch.corrupt_tokens,
            **{name: getattr(batch, name) for name in ("lengths", "answers", "doc_index")},
            **{f"roles/{role}": positions for role, positions in batch.roles.items()},
        }
        written = [h5.create_dataset(name, data=value.numpy().astype(np.int32)) for name, value in columns.items()]
        # One thread writes while the next forward runs: torch computes without holding the
        # GIL, so the file writes (about as long as the forwards on CPU) overlap with them.
        with ThreadPoolExecutor(max_workers=1) as io, _ChunkWriter(h5, n_rows, chunk, compression, io) as writer:
            for rows in run_chunks(n_rows, chunk):
                for which, tokens in (("clean", batch.tokens), ("corrupt", batch.corrupt_tokens)):
                    logits, acts = model.run_with_cache(
                        tokens[rows].to(device),
                        names_filter=hooks,
                        return_cache_object=False,
                        positions=batch.query_pos[rows].to(device),
                    )
                    writer.put(
                        f"p_answer/{which}", rows, answer_probs(logits, batch.answers[rows].to(device)).cpu().numpy()
                    )
                    for hook in hooks:
                        if hook not in acts:
                            raise HookmechError(f"hook {hook} did not fire in the forward pass")
                        if hook not in aliases:
                            writer.put(
                                f"acts/{which}/{hook}", rows, acts[hook].to("cpu", getattr(torch, dtype)).numpy()
                            )
                    writer.flush()
                writer.wait_for_previous_chunk()
                if progress is not None:
                    progress(rows.stop - rows.start)
        for hook, same in aliases.items():
            for which in ("clean", "corrupt"):
                h5[f"acts/{which}/{hook}"] = writer.datasets[f"acts/{which}/{same}"]  # an HDF5 hard link
    del written  # after the file is closed
    return Path(path)


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


class CacheFile:
    """Lazy read access to a cache file: nothing is read until it is indexed.

    ``cache["blocks.1.hook_resid_pre"]`` (clean) or ``cache["blocks.1.hook_resid_pre", "corrupt"]``
    return h5py datasets (slice them to read); ``cache.at(site, role, which)`` reads the
    ``[N, ...]`` activations of each row at its role position.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise HookmechError(f"{self.path}: no such cache file")
        try:
            self._h5 = h5py.File(self.path, "r")
        except OSError as error:
            raise HookmechError(f"{self.path}: not an HDF5 cache ({error})") from None
        # read what the messages need before closing: attributes of a closed file read as None
        kind, version = self._h5.attrs.get("format"), self._h5.attrs.get("format_version")
        if kind != FORMAT:
            self.close()
            if kind == DATASET_FORMAT:
                raise HookmechError(
                    f"{self.path}: a hookmech dataset file, not an activation cache (`train --data` and "
                    "`patch --data` read it; `hookmech cache` makes caches)"
                )
            raise HookmechError(f"{self.path}: not a hookmech cache (format attribute {kind!r})")
        if version is None or int(version) != FORMAT_VERSION:
            self.close()
            raise HookmechError(
                f"{self.path}: cache format version {version} is not supported (expected {FORMAT_VERSION})"
            )
        try:
            self._check_layout()
        except HookmechError:
            self.close()
            raise

    def _check_layout(self) -> None:
        """Raise a HookmechError naming the first dataset the format needs that is missing or
        whose rows disagree with the tokens' (a truncated or hand-made file). Reads metadata only."""
        h5 = self._h5
        for name in (
            "tokens/clean",
            "tokens/corrupt",
            "answers",
            "lengths",
            "doc_index",
            "roles",
            "p_answer/clean",
            "p_answer/corrupt",
        ):
            if name not in h5:
                raise HookmechError(f"{self.path}: cache has no {name} (truncated or not written by hookmech)")
        tokens = h5["tokens/clean"].shape
        if len(tokens) != 2 or h5["tokens/corrupt"].shape != tokens:
            raise HookmechError(
                f"{self.path}: cache tokens have shapes {list(tokens)} (clean) and "
                f"{list(h5['tokens/corrupt'].shape)} (corrupt); expected two [N, T] arrays"
            )
        n_rows = tokens[0]
        per_row = [
            "answers",
            "lengths",
            "doc_index",
            "p_answer/clean",
            "p_answer/corrupt",
            *(f"roles/{r}" for r in h5["roles"]),
        ]
        for name in per_row:
            if h5[name].shape != (n_rows,):
                raise HookmechError(
                    f"{self.path}: {name} has {(h5[name].shape or (0,))[0]} rows, the cache {n_rows} "
                    f"(shape {list(h5[name].shape)}, expected [{n_rows}]; truncated or not written by hookmech)"
                )
        for which in ("clean", "corrupt"):
            for hook in self.hooks(which):
                shape = h5[f"acts/{which}/{hook}"].shape
                if not shape or shape[0] != n_rows:
                    raise HookmechError(
                        f"{self.path}: acts/{which}/{hook} has shape {list(shape)}, expected "
                        f"{n_rows} rows like the tokens (truncated or not written by hookmech)"
                    )

    # -- metadata ------------------------------------------------------------------------
    @property
    def model_sha256(self) -> str:
        """The SHA-256 of the checkpoint file the cache was made from ('' when unknown)."""
        return str(self._h5.attrs.get("model_sha256", ""))

    @property
    def model_hash(self) -> str | None:
        """The `hookmech.identity.model_hash` of the model the cache was made from; None in
        caches written before it was recorded."""
        value = self._h5.attrs.get("model_hash")
        return str(value) if value else None

    def check_model(self, model) -> None:
        """Raise `HookmechError` unless `model` is the model this cache was made from (same
        `model_hash`). A cache without a model_hash (an older one) cannot be checked: that
        warns (`UnverifiedCacheWarning`, once per process) and passes. Returns None."""
        global _warned_unverified
        if self.model_hash is None:
            if not _warned_unverified:
                _warned_unverified = True
                warnings.warn(
                    f"{self.path} records no model_hash (written by an older hookmech): cannot check "
                    "that it was made from this model",
                    UnverifiedCacheWarning,
                    stacklevel=3,
                )
            return
        own = model_hash(model)
        if own != self.model_hash:
            raise HookmechError(
                f"{self.path} was made from another model (its model_hash {self.model_hash}, "
                f"this model's {own}); make a cache of this model"
            )

    @property
    def model_config(self) -> dict[str, Any]:
        return json.loads(self._h5.attrs["model_config"])

    @property
    def task(self) -> dict[str, Any]:
        return json.loads(self._h5.attrs["task"])

    @property
    def n(self) -> int:
        return int(self._h5["tokens/clean"].shape[0])

    def hooks(self, which: str = "clean") -> list[str]:
        """Return the hook names stored for `which` run."""
        group = self._h5.get(f"acts/{which}")
        return list(group.keys()) if group is not None else []

    # -- data --------------------------------------------------------------------------
    def batch(self) -> Batch:
        """Return the cached rows as a `Batch` (tokens, answers, roles ...), int64."""

        def read(name: str) -> Tensor:
            return torch.from_numpy(self._h5[name][()].astype(np.int64))

        return Batch(
            tokens=read("tokens/clean"),
            corrupt_tokens=read("tokens/corrupt"),
            answers=read("answers"),
            lengths=read("lengths"),
            doc_index=read("doc_index"),
            roles={role: read(f"roles/{role}") for role in self._h5["roles"]},
        )

    def p_answer(self, which: str) -> RowFloats:
        """Return the cached p(answer) ``[N]`` of the clean or corrupt run."""
        return torch.from_numpy(self._h5[f"p_answer/{which}"][()])

    def has(self, hook: str, which: str = "clean") -> bool:
        return f"acts/{which}/{hook}" in self._h5

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
        unknown one is a UsageError naming the closest stored sites."""
        if which not in ("clean", "corrupt"):
            raise unknown("run", which, ("clean", "corrupt"))
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

    def summary(self) -> dict[str, Any]:
        """Return what the file holds, reading only metadata and the two ``[N]`` p(answer) arrays:
        ``path, format_version, n, n_pos, model_hash (None in older caches), model_sha256, task,
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
            "n_pos": int(self._h5["tokens/clean"].shape[1]),
            "model_hash": self.model_hash,
            "model_sha256": self.model_sha256,
            "task": self.task,
            "model": {key: config.get(key) for key in ("mixers", "d_model", "n_layers", "d_vocab")},
            "hookmech_version": str(self._h5.attrs.get("hookmech_version", "")),
            "roles": self.roles,
            "p_clean": float(self.p_answer("clean").double().mean()),
            "p_corrupt": float(self.p_answer("corrupt").double().mean()),
            "sites": sites,
        }

    def read(self, hook: str, which: str, rows: slice) -> Acts:
        """Return the activations of `hook` for `rows` as a float32 tensor."""
        return torch.from_numpy(self[hook, which][rows]).float()

    def at(self, site: str, role: str, which: str = "clean") -> ActsAt:
        """Return ``[N, ...]``: each row's activation of `site` at its `role` position."""
        if role not in self._h5["roles"]:
            raise unknown("role", role, self.roles)
        return self.gather(site, self._h5[f"roles/{role}"][()], which)

    def gather(self, site: str, positions: np.ndarray | Tensor | Sequence[int], which: str = "clean") -> ActsAt:
        """Return ``[N, ...]``: row i's activation of `site` at ``positions[i]`` (``[N]`` ints;
        another shape is a UsageError)."""
        data = self[site, which]
        positions = np.asarray(positions)
        if positions.shape != (data.shape[0],):
            raise UsageError(f"need one position per row ({data.shape[0]}), got shape {positions.shape}")
        # h5py reads one list of increasing rows per call: group the rows by position.
        out = np.empty((len(positions), *data.shape[2:]), dtype=data.dtype)
        for position in np.unique(positions):
            rows = np.nonzero(positions == position)[0]
            out[rows] = data[rows.tolist(), int(position)]
        return torch.from_numpy(out)

    def close(self) -> None:
        self._h5.close()

    def __enter__(self) -> CacheFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open(path: str | Path) -> CacheFile:  # noqa: A001 - mirrors h5py.File / hookmech.cache.open
    """Open a cache file lazily (see `CacheFile`)."""
    return CacheFile(path)
