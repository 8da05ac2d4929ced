"""Deprecated name of `hookmech.das.training_options` (`DasOptions`, also `hookmech.das.DasOptions`),
renamed so that the package has one module called options (`hookmech.patching.options`): a thin
re-export kept because the API reference listed this module. This module goes at the next release
that breaks imports."""

from __future__ import annotations

import warnings

from .training_options import DasOptions

__all__ = ["DasOptions"]

warnings.warn("hookmech.das.options is now hookmech.das.training_options", DeprecationWarning, stacklevel=2)
