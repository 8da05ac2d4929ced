"""Model sizes: whether a model of a config fits a device's memory (`check_fits`), counted by
arithmetic on torch's meta device before anything is allocated, so that a config asking for
terabytes (a checkpoint's, or ``train --d-model 1000000``) is refused by name instead of failing
in the allocator."""

from __future__ import annotations

import functools

import torch

from .config import ModelConfig
from .devices import memory_bytes
from .errors import UsageError
from .model import HookedLM


def check_fits(config: ModelConfig, device="cpu", copies: int = 1, *, meta_model=None) -> None:
    """Raise a UsageError naming the config's sizes when `copies` copies of the weights and
    buffers of a model of `config` would not fit in `device`'s memory (`memory_bytes`); return None.

    The model is counted on torch's meta device (shapes only: nothing is allocated; once per
    config, `_model_size`), or is `meta_model` when the caller built it there already. `copies`
    counts what the caller holds at once: 2 to load a checkpoint (the file's tensors and the
    model), 4 to train (weights, gradients and AdamW's two moments)."""
    size = _size_of(meta_model) if meta_model is not None else _model_size(config.to_json())
    count, n_bytes, largest, shape = size
    limit = memory_bytes(device)
    if limit is None or n_bytes * copies <= limit:
        return
    sizes = ", ".join(f"{name} {getattr(config, name)}" for name in ("d_vocab", "n_ctx", "d_model", "n_layers"))
    held = f"{copies} copies: " if copies > 1 else ""
    raise UsageError(
        f"model config ({sizes}) has {count:,} parameters ({held}{_gigabytes(n_bytes * copies)}), more than "
        f"the {_gigabytes(limit)} of memory of device {str(device)!r}; its largest tensor, {largest}, is {shape}"
    )


@functools.lru_cache(maxsize=32)
def _model_size(config_json: str) -> tuple[int, int, str, list[int]]:
    """`_size_of` a model of the config `config_json`, built on the meta device (a few ms, so
    remembered: a command may load one checkpoint many times)."""
    with torch.device("meta"):
        return _size_of(HookedLM(ModelConfig.from_json(config_json)))


def _size_of(model) -> tuple[int, int, str, list[int]]:
    """Return (elements, bytes, name of the largest tensor, its shape) of `model`'s parameters
    and buffers, each tensor once (tied embeddings are one)."""
    tensors = {id(t): (name, t) for name, t in (*model.named_parameters(), *model.named_buffers())}
    count = sum(t.numel() for _, t in tensors.values())
    n_bytes = sum(t.numel() * t.element_size() for _, t in tensors.values())
    largest, tensor = max(tensors.values(), key=lambda item: item[1].numel())
    return count, n_bytes, largest, list(tensor.shape)


def _gigabytes(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:,.1f} GiB"
