"""Dataset files: a task's rows saved once, read back by `train --data` and `patch --data`.

HDF5, format version 1 (no pickle anywhere; the arrays are plain integers)::

    /                     attrs: format = "hookmech-dataset", format_version = 1,
                                 task (spec JSON), batch_class ("Batch", "TreeBatch" ...),
                                 seed (or -1 when unknown), hookmech_version
    tokens/clean          int32 [N, T]   right-padded with the task's pad id
    tokens/corrupt        int32 [N, T]
    answers, lengths, doc_index   int32 [N]
    roles/<role>          int32 [N]
    fields/<name>         int32 [N, ...]  extra tensors of Batch subclasses (ATR: parent_pos [N, T])

The layout of `tokens`, `roles` ... is the activation cache's (docs/formats.md), so the same
readers understand both. [N, T] arrays are chunked along N and gzip-compressed (padding
costs almost nothing on disk). The file is written to a temporary name and renamed.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch import Tensor

from . import __version__
from .errors import HookmechError
from .fileio import atomic_h5
from .tasks import Task, from_spec
from .tasks.atr import AssociativeTreecall, atr_statistics
from .tasks.batch import Batch

FORMAT = "hookmech-dataset"
FORMAT_VERSION = 1
#: rows per HDF5 chunk of the [N, T] arrays
_CHUNK_ROWS = 1024
_BASE_FIELDS = {f.name for f in fields(Batch)}
#: task options that change which examples or corruptions are drawn, not the language the model learnt;
#: a checkpoint may be patched on a dataset whose task differs from its own only in these
DATA_ONLY_OPTIONS = ("split", "split_seed", "corrupt")


def _batch_classes() -> dict[str, type[Batch]]:
    """Return ``{class name: class}`` of Batch and every subclass imported so far (the tasks
    module imports them all): a file names its class, it never makes us import anything."""
    found, todo = {"Batch": Batch}, [Batch]
    while todo:
        for sub in todo.pop().__subclasses__():
            found[sub.__name__] = sub
            todo.append(sub)
    return found


def _extra_fields(batch: Batch) -> dict[str, Tensor]:
    """Return the tensors a Batch subclass adds (``{}`` for a plain Batch)."""
    return {
        f.name: getattr(batch, f.name)
        for f in fields(batch)
        if f.name not in _BASE_FIELDS and isinstance(getattr(batch, f.name), Tensor)
    }


def _as_int32(name: str, tensor: Tensor) -> np.ndarray:
    array = tensor.detach().cpu().numpy()
    if not np.issubdtype(array.dtype, np.integer):
        raise HookmechError(f"dataset field {name!r} is {array.dtype}, not an integer tensor")
    if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
        raise HookmechError(f"dataset field {name!r} does not fit int32")
    return array.astype(np.int32)


def save_dataset(
    batch: Batch, task: Task, path: str | Path, *, seed: int | None = None, compression: str | None = "gzip"
) -> Path:
    """Write `batch` (rows of `task`) to an HDF5 dataset file at `path`, atomically.

    Stores tokens, corrupt tokens, answers, lengths, doc_index, roles and the extra
    ``[N, ...]`` tensors of Batch subclasses (ATR's ``parent_pos``), with the task spec as a
    JSON attribute and `seed` (what made the rows, if known) for provenance. Returns the path.
    """
    n_rows = len(batch)
    if n_rows < 1:
        raise HookmechError("refusing to write an empty dataset")
    extra = _extra_fields(batch)
    if type(batch).__name__ not in _batch_classes():
        raise HookmechError(f"{type(batch).__name__} is not a Batch subclass hookmech knows")
    columns: dict[str, np.ndarray] = {
        "tokens/clean": _as_int32("tokens", batch.tokens),
        "tokens/corrupt": _as_int32("corrupt_tokens", batch.corrupt_tokens),
        "answers": _as_int32("answers", batch.answers),
        "lengths": _as_int32("lengths", batch.lengths),
        "doc_index": _as_int32("doc_index", batch.doc_index),
        **{f"roles/{role}": _as_int32(f"roles/{role}", pos) for role, pos in batch.roles.items()},
        **{f"fields/{name}": _as_int32(name, tensor) for name, tensor in extra.items()},
    }
    for name, array in columns.items():
        if array.shape[0] != n_rows:
            raise HookmechError(f"dataset field {name!r} has {array.shape[0]} rows, the batch {n_rows}")
    with atomic_h5(path) as h5:
        h5.attrs.update(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "task": json.dumps(task.spec, sort_keys=True),
                "batch_class": type(batch).__name__,
                "seed": -1 if seed is None else int(seed),
                "hookmech_version": __version__,
            }
        )
        # keep every dataset open until the file closes: one dropped while the disk is full
        # fails to flush in its destructor, where h5py can only print the error and go on
        written = []
        for name, array in columns.items():
            if array.ndim >= 2:
                chunks = (min(_CHUNK_ROWS, n_rows), *array.shape[1:])
                written.append(h5.create_dataset(name, data=array, chunks=chunks, compression=compression))
            else:
                written.append(h5.create_dataset(name, data=array))
    return Path(path)


def read_dataset_header(path: str | Path) -> dict[str, Any]:
    """Return ``{"task": spec dict, "batch_class": str, "seed": int | None, "n": int,
    "width": int, "version": str}`` of a dataset file without reading its arrays."""
    with _open(path) as h5:
        return _header(h5, Path(path))


def load_dataset(path: str | Path) -> tuple[Task, Batch]:
    """Return ``(task, batch)`` stored in a dataset file: the task rebuilt from its spec and
    the rows as int64 tensors (``[N, T]`` tokens, ``[N]`` answers/lengths/doc_index/roles,
    subclass fields such as ATR's ``parent_pos [N, T]``), checked against the task."""
    path = Path(path)
    with _open(path) as h5:
        header = _header(h5, path)

        def read(name: str) -> Tensor:
            if name not in h5:
                raise HookmechError(
                    f"{path}: dataset file has no {name!r} array (truncated or not written by hookmech)"
                )
            return torch.from_numpy(h5[name][()].astype(np.int64))

        classes = _batch_classes()
        if header["batch_class"] not in classes:
            raise HookmechError(f"{path}: unknown batch class {header['batch_class']!r}")
        cls = classes[header["batch_class"]]
        stored_fields = list(h5["fields"]) if "fields" in h5 else []
        known = {f.name for f in fields(cls)} - _BASE_FIELDS
        if set(stored_fields) - known:
            raise HookmechError(f"{path}: fields {sorted(set(stored_fields) - known)} do not belong to {cls.__name__}")
        if known - set(stored_fields):
            raise HookmechError(
                f"{path}: dataset file has no fields {sorted(known - set(stored_fields))} of its "
                f"{cls.__name__} rows (truncated or not written by hookmech)"
            )
        batch = cls(
            tokens=read("tokens/clean"),
            corrupt_tokens=read("tokens/corrupt"),
            answers=read("answers"),
            lengths=read("lengths"),
            doc_index=read("doc_index"),
            roles={role: read(f"roles/{role}") for role in h5.get("roles", [])},
            **{name: read(f"fields/{name}") for name in stored_fields},
        )
    try:
        task = from_spec(header["task"])
    except HookmechError as error:
        raise HookmechError(f"{path}: its task spec is not usable here ({error})") from None
    check_batch(batch, task, path)
    return task, batch


def check_batch(batch: Batch, task: Task, where: str | Path = "batch") -> None:
    """Raise a HookmechError unless `batch` is consistent rows of `task`: shapes agree, tokens
    lie in the task's vocabulary, lengths in 1..T ≤ n_ctx, the task's roles all present and
    inside each row, and the answer predicted at the query lies in the vocabulary."""
    n_rows, width = batch.tokens.shape
    problems = []
    if batch.corrupt_tokens.shape != batch.tokens.shape:
        problems.append(f"corrupt tokens {tuple(batch.corrupt_tokens.shape)} vs tokens {tuple(batch.tokens.shape)}")
    for name in ("answers", "lengths", "doc_index"):
        if getattr(batch, name).shape != (n_rows,):
            problems.append(f"{name} has shape {tuple(getattr(batch, name).shape)}, expected ({n_rows},)")
    for name, tensor in _extra_fields(batch).items():
        if tensor.shape[0] != n_rows:
            problems.append(f"{name} has {tensor.shape[0]} rows, expected {n_rows}")
    if problems:
        raise HookmechError(f"{where}: inconsistent dataset: {'; '.join(problems)}")
    if width > task.n_ctx:
        problems.append(f"rows are {width} tokens wide, the task's context is {task.n_ctx}")
    for name in ("tokens", "corrupt_tokens", "answers"):
        values = getattr(batch, name)
        if values.numel() and (values.min() < 0 or values.max() >= task.d_vocab):
            problems.append(f"{name} outside the task's vocabulary 0..{task.d_vocab - 1}")
    if n_rows and (batch.lengths.min() < 1 or batch.lengths.max() > width):
        problems.append(f"lengths outside 1..{width}")
    missing = [role for role in task.roles if role not in batch.roles]
    if missing:
        problems.append(f"roles {missing} of task {task.name!r} missing (stored: {sorted(batch.roles)})")
    for role, positions in batch.roles.items():
        if positions.shape != (n_rows,):
            problems.append(f"role {role!r} has shape {tuple(positions.shape)}")
        elif n_rows and ((positions < 0).any() or (positions >= batch.lengths).any()):
            problems.append(f"role {role!r} points outside some rows")
    if problems:
        raise HookmechError(f"{where}: not valid rows of task {task.name!r}: {'; '.join(problems)}")


def check_fits_model(data_task: Task, model_task_spec: dict[str, Any] | None, where: str | Path) -> None:
    """Raise a HookmechError unless a dataset of `data_task` may be run through a checkpoint
    trained on `model_task_spec`: the same task, differing at most in `DATA_ONLY_OPTIONS`
    (e.g. patching a model trained on ``split="train"`` with ``split="test"`` rows)."""
    if model_task_spec is None:
        return
    data_spec = data_task.spec
    if data_spec.get("name") != model_task_spec.get("name"):
        raise HookmechError(
            f"{where} holds task {data_spec.get('name')!r}, the checkpoint was trained on "
            f"{model_task_spec.get('name')!r}"
        )
    differ = sorted(
        key
        for key in set(data_spec) | set(model_task_spec)
        if key not in DATA_ONLY_OPTIONS and data_spec.get(key) != model_task_spec.get(key)
    )
    if differ:
        detail = ", ".join(f"{key}={data_spec.get(key)!r} (checkpoint: {model_task_spec.get(key)!r})" for key in differ)
        raise HookmechError(f"{where}: its task differs from the checkpoint's in {detail}")


def load_dataset_for(path: str | Path, model_task: Task | None) -> Batch:
    """Return the rows of a dataset file (a Batch as `load_dataset`) after checking that a
    checkpoint trained on `model_task` can run them (`check_fits_model`)."""
    data_task, batch = load_dataset(path)
    check_fits_model(data_task, None if model_task is None else model_task.spec, path)
    return batch


def _open(path: str | Path) -> h5py.File:
    path = Path(path)
    if not path.is_file():
        raise HookmechError(f"{path}: no such dataset file")
    try:
        h5 = h5py.File(path, "r")
    except OSError as error:
        raise HookmechError(f"{path}: not an HDF5 dataset file ({error})") from None
    kind, version = h5.attrs.get("format"), h5.attrs.get("format_version", -1)
    if kind != FORMAT:
        h5.close()
        hint = " (an activation cache: use --cache)" if kind == "hookmech-cache" else ""
        raise HookmechError(f"{path}: not a hookmech dataset file (format attribute {kind!r}){hint}")
    if int(version) != FORMAT_VERSION:
        h5.close()
        raise HookmechError(f"{path}: dataset format version {version} is not supported (expected {FORMAT_VERSION})")
    return h5


def _header(h5: h5py.File, path: Path) -> dict[str, Any]:
    try:
        spec = json.loads(h5.attrs["task"])
    except (KeyError, ValueError) as error:
        raise HookmechError(f"{path}: dataset file has no readable task spec ({error})") from None
    if "tokens/clean" not in h5:
        raise HookmechError(f"{path}: dataset file has no tokens (truncated or not written by hookmech)")
    seed = int(h5.attrs.get("seed", -1))
    n_rows, width = h5["tokens/clean"].shape
    return {
        "task": spec,
        "batch_class": str(h5.attrs.get("batch_class", "Batch")),
        "seed": None if seed < 0 else seed,
        "n": int(n_rows),
        "width": int(width),
        "version": str(h5.attrs.get("hookmech_version", "")),
    }


# -- statistics ------------------------------------------------------------------------------
def _summary(values: np.ndarray) -> dict[str, float]:
    values = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(values.mean()),
        "min": float(values.min()),
        "p50": float(np.percentile(values, 50)),
        "p90": float(np.percentile(values, 90)),
        "max": float(values.max()),
    }


def batch_statistics(batch: Batch) -> dict[str, Any]:
    """Return simple statistics of any task's rows: counts (rows, documents), row length,
    key→value distance (value − key, signed) and key→query distance (query − key), each as
    ``{mean, min, p50, p90, max}``, and the fraction of rows whose answer token occurs in the
    row before the query (1.0 for every recall task)."""
    roles = batch.roles
    before = torch.arange(batch.tokens.shape[1])[None, :] < batch.query_pos[:, None]
    answer_in_context = ((batch.tokens == batch.answers[:, None]) & before).any(dim=1)
    stats: dict[str, Any] = {
        "rows": len(batch),
        "documents": int(torch.unique(batch.doc_index).numel()),
        "length": _summary(batch.lengths.numpy()),
    }
    if "key" in roles and "value" in roles:
        stats["kv_distance"] = _summary((roles["value"] - roles["key"]).numpy())
    if "key" in roles:
        stats["key_query_distance"] = _summary((roles["query"] - roles["key"]).numpy())
    stats["answer_in_context"] = float(answer_in_context.double().mean())
    return stats


def task_statistics(task: Task, n: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Return statistics of `n` rows of `task` drawn with `seed`: the grammar statistics of
    `hookmech.tasks.atr.atr_statistics` for ATR, `batch_statistics` for the others, with the
    task spec under ``"task"``."""
    if n < 1:
        raise HookmechError(f"statistics need n >= 1 rows, got {n}")
    if isinstance(task, AssociativeTreecall):
        stats = atr_statistics(task, n, seed)
    else:
        stats = batch_statistics(task.sample(n, seed))
    return {"task": task.spec, "seed": seed, **stats}
