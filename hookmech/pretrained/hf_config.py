"""Reading a family's options out of a Hugging Face ``config.json`` (a dict): typed, with
transformers' own defaults where the file leaves a key out, and a one-line error naming the key.
from_pretrained prefixes the file."""

from __future__ import annotations

from typing import Any

from ..errors import HookmechError

#: Hugging Face activation names (``activation_function``, ``hidden_act``) -> `ModelConfig.mlp_act`:
#: the exact GELU, or one of the spellings of its tanh approximation
MLP_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def count(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """Return ``config[key]`` (`default` when absent and given) as an integer >= 1; a
    HookmechError naming the key otherwise."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HookmechError(f"{key} = {value!r}: expected an integer >= 1")
    return value


def number(config: dict[str, Any], key: str, default: float) -> float:
    """Return ``config[key]`` (`default` when absent) as a float > 0; a HookmechError otherwise."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise HookmechError(f"{key} = {value!r}: expected a number > 0")
    return float(value)


def flag(config: dict[str, Any], key: str, default: bool) -> bool:
    """Return ``config[key]`` (`default` when absent) as a bool; a HookmechError otherwise."""
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise HookmechError(f"{key} = {value!r}: expected true or false")
    return value


def mlp_activation(config: dict[str, Any], key: str, default: str) -> str:
    """Return the `ModelConfig.mlp_act` of activation ``config[key]`` (`MLP_ACTIVATIONS`); a
    HookmechError naming the key and the supported names otherwise."""
    value = config.get(key, default)
    if value not in MLP_ACTIVATIONS:
        raise HookmechError(f"{key} = {value!r}: hookmech's MLP supports {', '.join(MLP_ACTIVATIONS)}")
    return MLP_ACTIVATIONS[value]


def hidden_multiple(hidden: int, d_model: int, key: str) -> int:
    """Return `hidden` / `d_model`, the MLP's `ModelConfig.mlp_hidden_mult`; a HookmechError
    naming `key` when the MLP's width is not a multiple of d_model."""
    if hidden % d_model:
        raise HookmechError(f"{key} = {hidden}: hookmech's MLP is a whole multiple of d_model ({d_model}) wide")
    return hidden // d_model


def refuse(config: dict[str, Any], key: str, unsupported: Any, default: Any, why: str) -> None:
    """Raise a HookmechError naming `key` when ``config[key]`` (`default` when absent) is
    `unsupported`, saying `why`; return None otherwise."""
    if config.get(key, default) == unsupported:
        raise HookmechError(f"{key} = {unsupported!r} is not supported: {why}")
