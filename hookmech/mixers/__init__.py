"""Sequence mixers: a plain dict from registry name to class.

Every mixer is built as ``REGISTRY[name](d_model=..., **kwargs)`` and maps
``[batch, pos, d_model] -> [batch, pos, d_model]``; see `base.Mixer` for what each declares.
"""
from __future__ import annotations

from .attention import Attention
from .base import Mixer, check_mixer_options, mixer_options

REGISTRY: dict[str, type[Mixer]] = {
    "attention": Attention,
}

__all__ = ["REGISTRY", "Mixer", "check_mixer_options", "mixer_options"]
