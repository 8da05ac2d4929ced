"""Checks of numbers that come from outside the computation (files, weights, options): a NaN weight
or activation would otherwise flow through every forward and come out as null attributions."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import schema
from .config import ModelConfig
from .errors import HookmechError, UsageError
from .hook_names import parse_hook
from .sites import hook_to_site

#: the largest seed every random stream of hookmech takes (numpy's SeedSequence, torch's Generator:
#: unsigned 64-bit), one range for every command (`schema.SEED`)
MAX_SEED = schema.MAX_SEED


def first_non_finite(values: Tensor | np.ndarray, allow_minus_inf: bool = False) -> tuple[int, ...] | None:
    """Return the index of the first NaN or infinite entry of `values` in C order (with
    `allow_minus_inf`, -inf does not count), or None when there is none.

    Cheap when all is well: one pass for the smallest and largest entries (a NaN makes both
    NaN, +inf the largest, -inf the smallest; as fast as a sum, 5x faster than an elementwise
    test), and the elementwise test only to locate a bad entry."""
    tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else values.detach()
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    smallest, largest = torch.aminmax(tensor)
    if math.isfinite(float(largest)) and (allow_minus_inf or math.isfinite(float(smallest))):
        return None
    bad = torch.isnan(tensor) | (tensor == math.inf)
    if not allow_minus_inf:
        bad |= tensor == -math.inf
    flat = int(bad.flatten().nonzero()[0])
    return tuple(int(i) for i in np.unravel_index(flat, tuple(tensor.shape)))


def allows_minus_inf(hook: str) -> bool:
    """Whether `hook`'s activations hold -inf by definition: masked attention scores (before the softmax)."""
    name = parse_hook(hook)
    return name is not None and (name.part if name.inside is None else name.inside) == "attn_scores"


def value_at(values: Tensor | np.ndarray, index: tuple[int, ...]) -> str:
    """Return the entry of `values` at `index` as text (``nan``, ``inf``, ``-inf``, ``0.5``)."""
    return str(float(values[index]))


def first_non_finite_tensor(tensors) -> tuple[str, Tensor] | None:
    """Return ``(name, tensor)`` of the first floating-point tensor of `tensors` (pairs of name and
    tensor) holding a NaN or an infinity, or None when every one is finite (`first_non_finite`)."""
    for name, tensor in tensors:
        if first_non_finite(tensor) is not None:
            return name, tensor
    return None


def check_finite_parameters(model, source: str = "the model") -> None:
    """Raise a HookmechError naming the first parameter or buffer of `model` (a torch module)
    holding a NaN or an infinity, and where (`source` names the model: a checkpoint path).
    Returns None."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        index = first_non_finite(tensor.detach())
        if index is not None:
            raise HookmechError(
                f"{source}: weight {name} holds {value_at(tensor.detach(), index)} at {list(index)}: "
                "its training diverged or the file is damaged; use a checkpoint whose weights are finite"
            )


def check_seed(seed: object, name: str = "seed") -> int:
    """Return `seed` if it is an integer in ``0..MAX_SEED``; else raise a UsageError naming `name`."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise UsageError(f"{name} must be {schema.SEED.describe()}, got {seed}")
    return int(seed)


def refuse_non_finite_run(model, values: Tensor, tokens: Tensor, which: str, first_row: int = 0) -> None:
    """Raise a HookmechError when `values` ``[n, ...]`` (the output of the `which` run of
    `tokens` ``[n, T]``, rows `first_row` on: its logits or p(answer)) hold a NaN or an infinity,
    naming the first hook of the first such row where the activations stopped being finite (a
    model with finite weights whose activations overflow); return None. One pass over `values`
    when all is well; the row is re-run with every hook watched only when it is not."""
    index = first_non_finite(values)
    if index is None:
        return
    found = first_non_finite_hook(model, tokens[index[0] : index[0] + 1])
    row = first_row + index[0]
    if found is None:  # the output alone (never seen: the hooks cover the model up to its logits)
        where = f"its output holds {value_at(values, index)}"
    else:
        hook, value = found
        site = hook_to_site(hook)
        where = f"{hook if site == hook else f'{site} ({hook})'} is the first hook to hold {value}"
    raise HookmechError(
        f"the {which} run's activations are not finite at row {row}: {where} (the weights are finite, the "
        "activations overflow float32); nothing computed from them would mean anything"
    )


def first_non_finite_hook(model, tokens: Tensor) -> tuple[str, str] | None:
    """Return (hook name, its first non-finite value as text) of the first hook, in the order they
    fire, whose activation on `tokens` ``[1, T]`` holds a NaN or an infinity (-inf of masked
    attention scores aside), or None when none does."""
    found: list[tuple[str, str]] = []

    def watch(activation: Tensor, hook) -> None:
        if not found:
            index = first_non_finite(activation, allow_minus_inf=allows_minus_inf(hook.name))
            if index is not None:
                found.append((hook.name, value_at(activation.detach(), index)))

    device = next(model.parameters()).device
    with torch.no_grad():
        model.run_with_hooks(tokens.to(device), fwd_hooks=[(lambda name: True, watch)])
    return found[0] if found else None


#: the token dtypes the embedding takes
TOKEN_DTYPES = (torch.int64, torch.int32)


def check_tokens(tokens: Any, cfg: ModelConfig, caller: str) -> None:
    """Raise a UsageError naming `caller` unless `tokens` is an integer tensor ``[batch, pos]``
    (`TOKEN_DTYPES`) of at least one row and one position, every id in ``0 .. d_vocab - 1``.
    The ids cost one min/max over the tensor (the sequence length is `embed_tokens`' to check)."""
    if not isinstance(tokens, Tensor):
        raise UsageError(
            f"{caller}: tokens must be a torch tensor [batch, pos] of token ids, got {type(tokens).__name__}"
        )
    if tokens.dtype not in TOKEN_DTYPES:
        raise UsageError(f"{caller}: tokens must be integer ids (torch.int64 or torch.int32), got {tokens.dtype}")
    if tokens.dim() != 2 or tokens.numel() == 0:
        raise UsageError(
            f"{caller}: tokens must be [batch, pos] with at least one row and one position, "
            f"got shape {list(tokens.shape)}"
        )
    low, high = torch.stack(torch.aminmax(tokens)).tolist()  # one transfer from the device
    if low < 0 or high >= cfg.d_vocab:
        bad = low if low < 0 else high
        raise UsageError(
            f"{caller}: token id {bad} is outside the vocabulary 0..{cfg.d_vocab - 1} (d_vocab {cfg.d_vocab})"
        )
