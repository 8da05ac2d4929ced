"""A Hugging Face model folder, read without running anything it names.

A folder holds ``config.json`` (its ``model_type`` picks the family), the weights in one of
three layouts, and the tokenizer beside them:

- ``model.safetensors``;
- ``model.safetensors.index.json`` and the shards its ``weight_map`` names (plain file names in
  the folder: a name reaching outside it is refused);
- ``pytorch_model.bin``, read only through ``torch.load(weights_only=True)`` (no pickled code
  runs), and only where the folder has no safetensors weights;
- ``tokenizer.json`` (the `tokenizers` library's one-file tokenizer), where the folder has one.

Every refusal is a `HookmechError` naming the file at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import HookmechError

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TOKENIZER_FILE = "tokenizer.json"
#: the weights layouts, in the order they are looked for
WEIGHTS_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_FILE)


@dataclass(frozen=True)
class PretrainedFolder:
    """What a folder holds: its `path`, its parsed ``config.json`` (`config`), the file its
    weights are read from (`weights_file`: one of `WEIGHTS_FILES`) and its tokenizer file
    (`tokenizer`, None where it has none)."""

    path: Path
    config: dict[str, Any]
    weights_file: Path
    tokenizer: Path | None

    @property
    def model_type(self) -> str:
        """The config's ``model_type`` (`read_config` checked it is a string)."""
        return str(self.config["model_type"])

    def weights(self) -> dict[str, torch.Tensor]:
        """Return the checkpoint's tensors by their Hugging Face names (`read_weights`)."""
        return read_weights(self.weights_file)


def is_pretrained_folder(path: str | Path) -> bool:
    """Return True when `path` is a folder holding a ``config.json`` (a Hugging Face model
    folder, as opposed to a hookmech checkpoint file)."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_folder(path: str | Path) -> PretrainedFolder:
    """Return the `PretrainedFolder` at `path`: its config read, its weights file and tokenizer
    found (no tensor read yet). A HookmechError names the file when the folder is not one."""
    path = Path(path)
    if not path.is_dir():
        raise HookmechError(f"{path}: no such model folder")
    return PretrainedFolder(path, read_config(path), weights_file(path), tokenizer_file(path))


def read_config(folder: str | Path) -> dict[str, Any]:
    """Return the JSON object in `folder`'s ``config.json``; a HookmechError naming the file when
    it is missing, not JSON, not an object, or without a string ``model_type``."""
    config_path = Path(folder) / CONFIG_FILE
    if not config_path.is_file():
        raise HookmechError(
            f"{config_path}: missing: {folder} is a folder, and neither a Hugging Face model folder "
            "(config.json and weights) nor a checkpoint file (.safetensors)"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise HookmechError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise HookmechError(f"{config_path}: not a JSON object")
    if not isinstance(config.get("model_type"), str):
        raise HookmechError(f"{config_path}: no model_type (the family of the model: gpt2, gpt_neox, mamba, ...)")
    return config


def weights_file(folder: str | Path) -> Path:
    """Return the file `folder`'s weights are read from: the first of `WEIGHTS_FILES` it holds;
    a HookmechError naming the folder when it holds none."""
    folder = Path(folder)
    for name in WEIGHTS_FILES:
        if (folder / name).is_file():
            return folder / name
    raise HookmechError(f"{folder}: no weights ({', '.join(WEIGHTS_FILES)})")


def tokenizer_file(folder: str | Path) -> Path | None:
    """Return `folder`'s ``tokenizer.json``, None where it has none."""
    path = Path(folder) / TOKENIZER_FILE
    return path if path.is_file() else None


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Return the tensors of weights file `path` (one of `WEIGHTS_FILES`) by name, in the dtype
    stored; a HookmechError naming the file when it cannot be read as its layout says."""
    path = Path(path)
    if path.name == SAFETENSORS_INDEX:
        return _read_shards(path)
    if path.name == TORCH_FILE:
        return _read_torch(path)
    return _read_safetensors(path)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # safetensors raises its own error types for junk files
        raise HookmechError(f"{path}: not a readable safetensors file ({error})") from None


def _read_shards(index_path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a sharded checkpoint: each shard the index's ``weight_map`` names, read
    once, and exactly the tensors the index lists from it."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise HookmechError(f"{index_path}: not valid JSON ({error})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HookmechError(f"{index_path}: no weight_map (tensor name -> shard file)")
    tensors: dict[str, torch.Tensor] = {}
    for shard_name in sorted(set(weight_map.values())):
        shard = index_path.parent / shard_name
        if Path(shard_name).name != shard_name or not shard.is_file():
            raise HookmechError(f"{index_path}: shard {shard_name!r} is not a file in {index_path.parent}")
        stored = _read_safetensors(shard)
        wanted = [name for name, owner in weight_map.items() if owner == shard_name]
        missing = [name for name in wanted if name not in stored]
        if missing:
            raise HookmechError(f"{shard}: lacks {missing[:3]}, which {index_path.name} places there")
        tensors.update({name: stored[name] for name in wanted})
    return tensors


def _read_torch(path: Path) -> dict[str, torch.Tensor]:
    """A ``torch.save`` state dict, through ``torch.load(weights_only=True)``: a file that
    would run code (any object but tensors and plain containers) is refused."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise HookmechError(f"{path}: refused by torch.load(weights_only=True) ({_why_refused(error)})") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise HookmechError(f"{path}: not a state dict (tensor name -> tensor)")
    return dict(state)


def _why_refused(error: Exception) -> str:
    """The line of torch.load's (many-line) error that says what it refused: the global it would
    have had to import, else its first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line]
    return (named or lines or [type(error).__name__])[0].removeprefix("WeightsUnpickler error: ")
