"""`K=V` options as typed on the command line (design.md §8).

V is parsed as JSON when it is valid JSON (numbers, true/false, null, lists), else kept as
a string. `L0.K=V` applies to layer 0 only and overrides `K=V` there.
"""
from __future__ import annotations

import json
import re
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


def parse_layer_options(
    pairs: Iterable[str], n_layers: int, flag: str = "--mixer-opt"
) -> list[dict[str, Any]]:
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
