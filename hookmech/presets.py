"""Deprecated name of `hookmech.model_presets` (the papers' models, ``--preset``), renamed so that
it is not mistaken for `hookmech.sweep.presets` (the sweep presets): a thin re-export kept because
the API reference listed this module. This module goes at the next release that breaks imports."""

from __future__ import annotations

import warnings

from .model_presets import MODEL_PRESETS, expand_preset

__all__ = ["MODEL_PRESETS", "expand_preset"]

warnings.warn("hookmech.presets is now hookmech.model_presets", DeprecationWarning, stacklevel=2)
