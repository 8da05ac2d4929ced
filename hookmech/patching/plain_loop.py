"""Deprecated name of `hookmech.oracles.plain_loop` (the plain loop the engine is tested and timed
against, which is no part of the engine): a thin re-export kept because the API reference listed
this module. Import from `hookmech.oracles` instead; this module goes at the next release that
breaks imports."""

from __future__ import annotations

import warnings

from ..oracles.plain_loop import plain_loop_patch

__all__ = ["plain_loop_patch"]

warnings.warn("hookmech.patching.plain_loop is now hookmech.oracles.plain_loop", DeprecationWarning, stacklevel=2)
