"""Deprecated name of `hookmech.oracles` (the plain references the engines are tested against):
a thin re-export kept because the API reference listed this module. Import from
`hookmech.oracles` instead; this module goes at the next release that breaks imports."""

from __future__ import annotations

import warnings

from .oracles import path_patch_reference, plain_loop_patch

__all__ = ["path_patch_reference", "plain_loop_patch"]

warnings.warn("hookmech.reference is now hookmech.oracles", DeprecationWarning, stacklevel=2)
