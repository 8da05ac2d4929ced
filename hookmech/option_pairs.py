"""`K=V` options as typed on the command line (docs/guide.md §4).

V is parsed as JSON when it is valid JSON (numbers, true/false, null, lists), else kept as
a string. `L0.K=V` applies to layer 0 only and overrides `K=V` there.
"""

from __future__ import annotations

import collections.abc
import json
import re
import types
import typing
from collections.abc import Iterable
from typing import Any

from .errors import UsageError

_LAYER_KEY = re.compile(r"^L(\d+)\.(.+)$")


def parse_value(text: str) -> Any:
    """Return `text` parsed as JSON when it is valid JSON, else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_pairs(pairs: Iterable[str], flag: str) -> list[tuple[str, Any]]:
    """Split each ``K=V`` into ``(K, parsed V)``; a pair without '=' is a UsageError."""
    parsed = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} expects K=V, got {pair!r}")
        parsed.append((key.strip(), parse_value(value)))
    return parsed


def parse_options(pairs: Iterable[str], flag: str = "--task-opt") -> dict[str, Any]:
    """Return ``{K: V}`` from ``K=V`` strings (later pairs win)."""
    return dict(parse_pairs(pairs, flag))


def parse_layer_options(pairs: Iterable[str], n_layers: int, flag: str = "--mixer-opt") -> list[dict[str, Any]]:
    """Return one option dict per layer from ``K=V`` (all layers) and ``L{l}.K=V`` pairs."""
    shared: dict[str, Any] = {}
    per_layer: list[dict[str, Any]] = [{} for _ in range(n_layers)]
    for key, value in parse_pairs(pairs, flag):
        match = _LAYER_KEY.match(key)
        if match is None:
            shared[key] = value
            continue
        layer = int(match.group(1))
        if layer >= n_layers:
            raise UsageError(f"{flag} {key}: layer {layer} does not exist (the model has {n_layers} layers)")
        per_layer[layer][match.group(2)] = value
    return [{**shared, **own} for own in per_layer]


def split_list(values: Iterable[str]) -> list[str]:
    """Flatten repeated and comma-separated flag values: ('a,b', 'c') -> ['a', 'b', 'c']."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def check_option_types(owner: str, cls: type[object], options: dict[str, Any]) -> None:
    """Raise a UsageError naming `owner` when an option's value does not fit the type the
    constructor of `cls` annotates (``window=abc`` for an ``int | None``, ``2.5`` for an int).
    Options whose annotation cannot be read are left to the constructor."""
    hints = _init_hints(cls)
    for key, value in options.items():
        hint = hints.get(key)
        if hint is not None and not _fits(value, hint):
            raise UsageError(f"{owner}: option {key}={json.dumps(value)} should be {_describe(hint)}")


#: the resolved constructor annotations of each class checked so far (`_init_hints`)
_HINTS: dict[type[object], dict[str, Any]] = {}


def _init_hints(cls: type[object]) -> dict[str, Any]:
    """The annotations of `cls`'s constructor, resolved once per class (every model config
    checks its mixers' options); {} when one cannot be resolved (nothing to check against)."""
    if cls not in _HINTS:
        try:
            _HINTS[cls] = typing.get_type_hints(cls.__init__)
        except Exception:
            _HINTS[cls] = {}
    return _HINTS[cls]


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, collections.abc.Sequence) or hint in (list, tuple):
        return isinstance(value, (list, tuple))
    return True


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return " or ".join(json.dumps(arg) for arg in typing.get_args(hint))
    return {type(None): "null", int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )
