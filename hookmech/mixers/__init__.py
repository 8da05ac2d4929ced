"""Sequence mixers: a plain dict from registry name to class.

Every mixer is built as ``REGISTRY[name](d_model=..., **kwargs)`` and maps
``[batch, pos, d_model] -> [batch, pos, d_model]``; see `base.Mixer` for the core every mixer
implements, `capabilities` for what a mixer may opt into (`ExactPatchEffects` for AtP*,
`PathRoutes`, `EffectiveAttentionMap`).
"""

from __future__ import annotations

from .attention import Attention
from .base import Mixer, check_mixer_options, mixer_options
from .baseconv import BaseConv
from .based import Based
from .capabilities import EffectiveAttentionMap, ExactPatchEffects, MissingCapability, PathRoutes
from .deltanet import DeltaNet
from .h3 import H3
from .hyena import Hyena
from .mamba import Mamba
from .mamba2 import Mamba2
from .rwkv import RWKV6

REGISTRY: dict[str, type[Mixer]] = {
    "mamba2": Mamba2,
    "rwkv": RWKV6,
    "attention": Attention,
    "mamba": Mamba,
    "baseconv": BaseConv,
    "h3": H3,
    "hyena": Hyena,
    "based": Based,
    "deltanet": DeltaNet,
}

__all__ = [
    "REGISTRY",
    "EffectiveAttentionMap",
    "ExactPatchEffects",
    "MissingCapability",
    "Mixer",
    "PathRoutes",
    "check_mixer_options",
    "mixer_options",
]
