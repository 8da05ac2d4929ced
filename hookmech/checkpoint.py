"""Checkpoints: one safetensors file with config, task spec, version and model hash in its
metadata (docs/formats.md, "Checkpoint"). Loading never unpickles. The same model saved twice gives the same bytes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as save_bytes

from . import __version__
from .config import ModelConfig
from .devices import check_device
from .errors import HookmechError, UsageError
from .fileio import atomic_path
from .identity import state_hash
from .mixers.allow_list import plug_ins, require_allowed
from .model import HookedLM
from .pretrained import from_pretrained, is_pretrained
from .sizes import check_fits

_PICKLE_MAGIC = b"\x80"  # pickle protocol >= 2 starts with PROTO, then the protocol number
_PICKLE_PROTOCOLS = tuple(bytes([n]) for n in range(2, 6))
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default container


def save(
    model: HookedLM,
    path: str | Path,
    task_spec: dict[str, Any] | None = None,
    summary: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (weights + config, task spec, summary, `model_hash`) to a safetensors file
    atomically; the same model, task spec and summary always give the same bytes.

    The summary should hold no wall-clock values (a run's timings live in its summary.json).
    Returns the path written.
    """
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}
    config_json = model.cfg.to_json()
    metadata = {
        "hookmech_config": config_json,
        "hookmech_version": __version__,
        "hookmech_model_hash": state_hash(config_json, tensors),
    }
    if task_spec is not None:
        metadata["hookmech_task"] = json.dumps(task_spec, sort_keys=True)
    if summary is not None:
        metadata["hookmech_summary"] = json.dumps(summary, sort_keys=True)
    with atomic_path(path) as tmp:
        write_safetensors(tensors, tmp, metadata)
    return Path(path)


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    """True when `head` (a file's first 9 bytes) is a safetensors header: an 8-byte
    little-endian header length that fits the file, then the JSON header's '{'."""
    return len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= size - 8


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file whose bytes depend only on `tensors` and `metadata`.

    safetensors writes its metadata in hash-map order, which differs from one call to the
    next; the header is rewritten here with the metadata keys sorted (same tensors, same
    offsets: the format's data start right after the 8-byte-aligned header). Returns None.
    """
    data = save_bytes(tensors, metadata=metadata)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    ordered = {"__metadata__": dict(sorted(header.pop("__metadata__", {}).items()))}
    ordered.update(header)  # tensor entries keep safetensors' (deterministic) order
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little"))
        handle.write(text)
        handle.write(memoryview(data)[8 + size :])


def _refuse_non_safetensors(path: Path) -> None:
    with open(path, "rb") as handle:
        head = handle.read(9)
    size = path.stat().st_size
    # a safetensors header length may itself begin with 0x80 or "PK": sniff pickles only in
    # files that are not safetensors-shaped
    if _looks_like_safetensors(head, size):
        return
    if head[8:9] == b"{":  # a JSON header after 8 bytes: a safetensors file whose length is broken
        length = int.from_bytes(head[:8], "little")
        raise HookmechError(
            f"{path}: not a valid safetensors file (header length {length} bytes, but the file "
            f"holds {size} bytes); it is damaged or cut short"
        )
    if head.startswith(_ZIP_MAGIC) or (head.startswith(_PICKLE_MAGIC) and head[1:2] in _PICKLE_PROTOCOLS):
        raise HookmechError(
            f"{path}: is a pickle/torch.save file, not safetensors; it was not opened "
            "(convert it with hookmech.load(path, config=...), which reads it with weights_only=True)"
        )


def _checkpoint_path(path: object) -> Path:
    """Return `path` as a Path of an existing file; a UsageError for what is not a path, a
    HookmechError for a folder or a missing file."""
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"a checkpoint is named by a path (str or Path), got {type(path).__name__}")
    path = Path(path)
    if path.is_dir():
        raise HookmechError(f"{path}: is a folder, not a checkpoint file (.safetensors)")
    if not path.is_file():
        raise HookmechError(f"{path}: no such checkpoint file")
    return path


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Return ``{"config": ModelConfig, "task": dict|None, "version": str, "summary": dict|None,
    "model_hash": str|None}`` from a checkpoint's header, without reading its tensors
    (``model_hash`` is None in checkpoints written before it was recorded).

    Imports no mixer: a plug-in mixer's name is kept as stored, its options unchecked
    (`ModelConfig.from_json` with ``resolve_mixers=False``); `load` imports it once allowed."""
    path = _checkpoint_path(path)
    _refuse_non_safetensors(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as error:  # safetensors raises its own error types for junk files
        raise HookmechError(f"{path}: not a readable safetensors checkpoint ({error})") from None
    if "hookmech_config" not in metadata:
        raise HookmechError(f"{path}: safetensors file has no hookmech_config metadata (not a hookmech checkpoint)")
    try:
        return {
            "config": ModelConfig.from_json(metadata["hookmech_config"], resolve_mixers=False),
            "task": json.loads(metadata["hookmech_task"]) if "hookmech_task" in metadata else None,
            "summary": json.loads(metadata["hookmech_summary"]) if "hookmech_summary" in metadata else None,
            "version": metadata.get("hookmech_version"),
            "model_hash": metadata.get("hookmech_model_hash"),
        }
    except (ValueError, TypeError) as error:
        raise HookmechError(f"{path}: corrupt hookmech metadata ({error})") from None
    except HookmechError as error:  # a field of the config, by name (ModelConfig checks each)
        raise HookmechError(f"{path}: model config: {error}") from None


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:
        raise HookmechError(f"{path}: truncated or corrupt safetensors file ({error})") from None


def load(
    path: str | Path,
    config: ModelConfig | str | Path | None = None,
    device: str = "cpu",
    *,
    allow_mixers: Iterable[str] = (),
) -> HookedLM:
    """Return the `HookedLM` stored at `path`, in eval mode, on `device`.

    A ``.pt``/``.pth`` state dict is read with ``torch.load(weights_only=True)`` and needs
    `config` (a ModelConfig, or a path to its JSON). A folder is a Hugging Face model folder, and
    a missing path that reads as ``owner/name`` a hub name (`hookmech.pretrained.from_pretrained`,
    which reads the folder's own config.json). Any other file must be a hookmech safetensors
    checkpoint.

    A plug-in mixer the stored config names is imported only when `allow_mixers` (SPECs:
    ``module[:Class]``, ``path/file.py[:Class]``) or ``HOOKMECH_ALLOW_MIXERS`` names it; else a
    UsageError says how to allow it (`hookmech.mixers.allow_list`).
    """
    check_device(device)

    # folders and hub names first: `_checkpoint_path` takes files only
    if isinstance(path, (str, os.PathLike)):
        folder = Path(path)
        if folder.is_dir() and (folder / "run.json").is_file() and not (folder / "config.json").exists():
            raise HookmechError(f"{folder} is a hookmech run folder: its checkpoint is {folder / 'model.safetensors'}")
        if is_pretrained(folder):
            return from_pretrained(folder, device=device)
    path = _checkpoint_path(path)
    if path.suffix in (".pt", ".pth"):
        return _load_torch_state(path, config, device, allow_mixers)
    meta = read_metadata(path)
    model = _build(_resolved(meta["config"], allow_mixers, path), device, path)
    _load_into(model, _load_state(path), path)
    # built in float32; a config that records another compute dtype (ModelConfig.dtype) runs in it
    return model.to(device=device, dtype=getattr(torch, meta["config"].dtype)).eval()


def _resolved(config: ModelConfig, allow_mixers: Iterable[str], source: str | Path) -> ModelConfig:
    """Return the stored `config` (parsed unresolved, from `source`) with its plug-in mixers
    imported and their options checked, once they are allowed (`require_allowed`)."""
    require_allowed(config.mixers, allow_mixers, str(source))
    if not plug_ins(config.mixers):
        return config
    try:
        return ModelConfig.from_json(config.to_json())
    except HookmechError as error:  # the file's fault (a mixer gone, an option it does not take): exit 1
        raise HookmechError(f"{source}: model config: {error}") from None


def _build(config: ModelConfig, device: str, path: Path) -> HookedLM:
    """Return a `HookedLM` of `config` once its size is known to fit: the file's tensors and the
    model are built on the CPU (2 copies) and the model then moved to `device` (1 copy there);
    naming `path` otherwise."""
    try:
        check_fits(config, "cpu", copies=2)
        if torch.device(device).type != "cpu":
            check_fits(config, device, copies=1)
    except HookmechError as error:
        raise HookmechError(f"{path}: {error}") from None
    return HookedLM(config)


def _load_torch_state(
    path: Path, config: ModelConfig | str | Path | None, device: str, allow_mixers: Iterable[str]
) -> HookedLM:
    if config is None:
        raise HookmechError(f"{path}: a torch state dict needs its model config (config=...)")
    if not isinstance(config, ModelConfig):
        try:
            stored = ModelConfig.from_json(Path(config).read_text(), resolve_mixers=False)
        except (ValueError, TypeError) as error:
            raise HookmechError(f"{config}: not a model config ({error})") from None
        except HookmechError as error:
            raise HookmechError(f"{config}: model config: {error}") from None
        config = _resolved(stored, allow_mixers, config)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise HookmechError(f"{path}: refused by torch.load(weights_only=True) ({error})") from None
    model = _build(config, device, path)
    _load_into(model, state, path)
    return model.to(device).eval()


def _load_into(model: HookedLM, state: dict[str, torch.Tensor], path: Path) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise HookmechError(f"{path}: weights do not match the config (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise HookmechError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, config expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state)
