"""Deprecated name of `hookmech.path_routes` (the model's side of path patching: what travels
along each route), renamed so that it is not mistaken for `hookmech.patching.paths` (the engine's
`path_patch`): a thin re-export kept because the API reference listed this module. This module
goes at the next release that breaks imports."""

from __future__ import annotations

import warnings

from .path_routes import RESIDUAL_WRITES, VIA, ActsReader, PathEnds, PathModel, path_change, path_ends

__all__ = ["RESIDUAL_WRITES", "VIA", "ActsReader", "PathEnds", "PathModel", "path_change", "path_ends"]

warnings.warn("hookmech.paths is now hookmech.path_routes", DeprecationWarning, stacklevel=2)
