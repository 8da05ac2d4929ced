"""The papers' *models*: per-layer patterns of mixers (paper 000 appendix B; its code, tinylang
``model/zoology.py``). `REGISTRY` holds mixers; these are named separately (``--preset NAME``), so
``REGISTRY["based"]`` stays the Based mixer while preset ``based`` is the Based *model*."""

from __future__ import annotations

from typing import Any

from .errors import unknown
from .mixers import SPECS

#: preset -> the repeating pattern of (mixer, options) layers; layer l uses pattern[l % len(pattern)]:
#: the presets the mixers' specs define (`MixerSpec.presets`: the Based model and the BaseConv model
#: of paper 000; every other mixer its single-mixer model, every layer it with its defaults)
MODEL_PRESETS: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    name: pattern for spec in SPECS.values() for name, pattern in spec.model_presets.items()
}


def expand_preset(name: str, n_layers: int) -> tuple[list[str], list[dict[str, Any]]]:
    """Return (mixer name per layer, options per layer) of preset `name` for `n_layers` layers."""
    if name not in MODEL_PRESETS:
        raise unknown("model preset", name, MODEL_PRESETS)
    pattern = MODEL_PRESETS[name]
    layers = [pattern[layer % len(pattern)] for layer in range(n_layers)]
    return [mixer for mixer, _ in layers], [dict(options) for _, options in layers]
