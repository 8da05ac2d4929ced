"""Taking a checkpoint's tensors by name, so that a family's conversion says in one line which
names a folder lacks and which it holds that the config does not explain."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ..errors import HookmechError


class WeightsMismatch(HookmechError):
    """A folder's weights do not match its config: names missing or left over, or a shape the
    config does not give. `hookmech.pretrained.from_pretrained` prefixes the weights file."""


class Weights:
    """A checkpoint's tensors by their Hugging Face names, each taken once by a family's
    ``convert_weights``. `finish` raises a `WeightsMismatch` listing the names asked for and
    absent, and those never taken (`ignore`: endings, in whole name parts, of buffers a family
    recomputes, such as GPT-2's causal-mask ``attn.bias``, which are dropped unread)."""

    def __init__(self, tensors: dict[str, Tensor], ignore: Iterable[str] = ()):
        # whole name parts: "attn.bias" drops h.0.attn.bias, never h.0.attn.c_attn.bias
        ignored = tuple(f".{suffix}" for suffix in ignore)
        self._tensors = {name: t for name, t in tensors.items() if not f".{name}".endswith(ignored)}
        self._taken: set[str] = set()
        self._missing: list[str] = []

    def has(self, name: str) -> bool:
        """Return True when the checkpoint holds `name`."""
        return name in self._tensors

    def take(self, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
        """Return tensor `name`, checked to have `shape` when given (a `WeightsMismatch` naming
        it otherwise); a missing name is recorded for `finish` and answered with a placeholder of
        that shape (unfilled), so that the conversion goes on to list every missing name."""
        if name not in self._tensors:
            self._missing.append(name)
            return _placeholder(shape)
        self._taken.add(name)
        tensor = self._tensors[name]
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise WeightsMismatch(
                f"weights do not match the config: {name} has shape {tuple(tensor.shape)}, "
                f"the config gives {tuple(shape)}"
            )
        return tensor

    def finish(self) -> None:
        """Raise a `WeightsMismatch` when a name asked for was missing or a tensor was never
        taken (up to 3 of each named); return None otherwise."""
        unused = sorted(set(self._tensors) - self._taken)
        if self._missing or unused:
            parts = []
            if self._missing:
                parts.append(f"missing {_some(self._missing)}")
            if unused:
                parts.append(f"unexpected {_some(unused)}")
            raise WeightsMismatch(f"weights do not match the config: {'; '.join(parts)}")


def _placeholder(shape: tuple[int, ...] | None) -> Tensor:
    return torch.empty(shape if shape is not None else (0,))


def _some(names: list[str]) -> str:
    """Up to 3 of `names`, and how many more."""
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def strip_prefix(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """Return `tensors` with `prefix` removed from the names that start with it (checkpoints of
    one family are saved with and without their base model's prefix, e.g. GPT-2's
    ``transformer.``)."""
    return {name.removeprefix(prefix): tensor for name, tensor in tensors.items()}
