"""The papers' *models*: per-layer patterns of mixers (paper 000 appendix B; its code, tinylang
``model/zoology.py``). `REGISTRY` holds mixers; these are named separately (``--preset NAME``), so
``REGISTRY["based"]`` stays the Based mixer while preset ``based`` is the Based *model*."""

from __future__ import annotations

from typing import Any

from .errors import unknown

#: preset -> the repeating pattern of (mixer, options) layers; layer l uses pattern[l % len(pattern)]
MODEL_PRESETS: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    # Based model: BaseConv with a short kernel, then Based linear attention, alternating
    "based": (("baseconv", {"kernel_size": 3}), ("based", {})),
    # BaseConv model: a short (k=3) and an implicit long convolution, alternating
    "baseconv": (("baseconv", {"kernel_size": 3}), ("baseconv", {"kernel_size": -1})),
    # the single-mixer models, for completeness: every layer the same mixer with its defaults
    **{name: ((name, {}),) for name in ("attention", "h3", "hyena", "mamba", "mamba2", "deltanet", "rwkv")},
}


def expand_preset(name: str, n_layers: int) -> tuple[list[str], list[dict[str, Any]]]:
    """Return (mixer name per layer, options per layer) of preset `name` for `n_layers` layers."""
    if name not in MODEL_PRESETS:
        raise unknown("model preset", name, MODEL_PRESETS)
    pattern = MODEL_PRESETS[name]
    layers = [pattern[layer % len(pattern)] for layer in range(n_layers)]
    return [mixer for mixer, _ in layers], [dict(options) for _, options in layers]
