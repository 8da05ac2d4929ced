"""The activation cache: clean and corrupt activations of chosen hooks, in HDF5 (design.md §6).

Format version 1::

    /                      attrs: format, format_version, model_sha256, model_config, task, hookmech_version
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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch import Tensor

from . import __version__
from .errors import HookmechError, UsageError
from .fileio import atomic_path
from .sites import site_to_hook
from .tasks.batch import Batch

FORMAT = "hookmech-cache"
FORMAT_VERSION = 1


def answer_probs(logits: Tensor, answers: Tensor) -> Tensor:
    """Return p(answer) ``[N]`` from logits ``[N, d_vocab]`` (softmax over the full vocabulary)."""
    return logits.float().softmax(dim=-1).gather(-1, answers[:, None]).squeeze(-1)


def run_chunks(n_rows: int, chunk: int) -> Iterator[slice]:
    """Yield row slices of at most `chunk` rows covering ``range(n_rows)``."""
    for start in range(0, n_rows, chunk):
        yield slice(start, min(n_rows, start + chunk))


@torch.no_grad()
def write_cache(
    model,
    batch: Batch,
    path: str | Path,
    hooks: Iterable[str],
    *,
    model_sha256: str = "",
    task_spec: dict[str, Any] | None = None,
    chunk: int = 256,
    dtype: str = "float32",
    compression: str | None = None,
    progress=None,
) -> Path:
    """Run `batch` clean and corrupt through `model`, storing the `hooks` activations and
    p(answer) in an HDF5 cache at `path` (written to a temporary file, then renamed).

    Returns the path written.
    """
    hooks = list(dict.fromkeys(hooks))
    for hook in hooks:
        if getattr(model.hook_dict.get(hook), "pos_axis", 1) is None:
            raise UsageError(f"{hook} has no position axis (it does not depend on the input): nothing to cache per example")
    n_rows, n_pos = batch.tokens.shape
    device = next(model.parameters()).device
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as h5:
        h5.attrs.update({
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model_sha256": model_sha256,
            "model_config": model.cfg.to_json(),
            "task": json.dumps(task_spec or {}, sort_keys=True),
            "hookmech_version": __version__,
        })
        h5["tokens/clean"] = batch.tokens.numpy().astype(np.int32)
        h5["tokens/corrupt"] = batch.corrupt_tokens.numpy().astype(np.int32)
        for name in ("lengths", "answers", "doc_index"):
            h5[name] = getattr(batch, name).numpy().astype(np.int32)
        for role, positions in batch.roles.items():
            h5[f"roles/{role}"] = positions.numpy().astype(np.int32)
        datasets: dict[tuple[str, str], h5py.Dataset] = {}
        for rows in run_chunks(n_rows, chunk):
            for which, tokens in (("clean", batch.tokens), ("corrupt", batch.corrupt_tokens)):
                logits, acts = model.run_with_cache(
                    tokens[rows].to(device), names_filter=hooks, return_cache_object=False,
                    positions=batch.query_pos[rows].to(device),
                )
                probs = answer_probs(logits, batch.answers[rows].to(device)).cpu().numpy()
                if ("p", which) not in datasets:
                    datasets["p", which] = h5.create_dataset(f"p_answer/{which}", (n_rows,), dtype="float32")
                datasets["p", which][rows] = probs
                for hook in hooks:
                    if hook not in acts:
                        raise HookmechError(f"hook {hook} did not fire in the forward pass")
                    value = acts[hook].to("cpu", getattr(torch, dtype)).numpy()
                    key = (hook, which)
                    if key not in datasets:
                        datasets[key] = h5.create_dataset(
                            f"acts/{which}/{hook}", (n_rows, *value.shape[1:]), dtype=value.dtype,
                            chunks=(min(chunk, n_rows), *value.shape[1:]), compression=compression,
                        )
                    datasets[key][rows] = value
            if progress is not None:
                progress(rows.stop - rows.start)
    return Path(path)


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
        attrs = self._h5.attrs
        if attrs.get("format") != FORMAT:
            self.close()
            raise HookmechError(f"{self.path}: not a hookmech cache (format attribute {attrs.get('format')!r})")
        if int(attrs.get("format_version", -1)) != FORMAT_VERSION:
            self.close()
            raise HookmechError(f"{self.path}: cache format version {attrs.get('format_version')} is not supported (expected {FORMAT_VERSION})")

    # -- metadata ------------------------------------------------------------------------
    @property
    def model_sha256(self) -> str:
        return str(self._h5.attrs["model_sha256"])

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

    def p_answer(self, which: str) -> Tensor:
        """Return the cached p(answer) ``[N]`` of the clean or corrupt run."""
        return torch.from_numpy(self._h5[f"p_answer/{which}"][()])

    def has(self, hook: str, which: str = "clean") -> bool:
        return f"acts/{which}/{hook}" in self._h5

    def __getitem__(self, key: str | tuple[str, str]) -> h5py.Dataset:
        hook, which = (key, "clean") if isinstance(key, str) else key
        hook = site_to_hook(hook)
        if not self.has(hook, which):
            from .errors import suggest

            raise HookmechError(f"{self.path}: no {which} activations for {hook}{suggest(hook, self.hooks(which))}")
        return self._h5[f"acts/{which}/{hook}"]

    def read(self, hook: str, which: str, rows: slice) -> Tensor:
        """Return the activations of `hook` for `rows` as a float32 tensor."""
        return torch.from_numpy(self[hook, which][rows]).float()

    def at(self, site: str, role: str, which: str = "clean") -> Tensor:
        """Return ``[N, ...]``: each row's activation of `site` at its `role` position."""
        positions = self._h5[f"roles/{role}"][()] if f"roles/{role}" in self._h5 else None
        if positions is None:
            raise HookmechError(f"{self.path}: no role {role!r} (roles: {', '.join(self._h5['roles'])})")
        data = self[site, which]
        # h5py reads one list of increasing rows per call: group the rows by position.
        out = np.empty((len(positions), *data.shape[2:]), dtype=data.dtype)
        for position in np.unique(positions):
            rows = np.nonzero(positions == position)[0]
            out[rows] = data[rows.tolist(), int(position)]
        return torch.from_numpy(out)

    def close(self) -> None:
        self._h5.close()

    def __enter__(self) -> "CacheFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open(path: str | Path) -> CacheFile:  # noqa: A001 - mirrors h5py.File / hookmech.cache.open
    """Open a cache file lazily (see `CacheFile`)."""
    return CacheFile(path)
