"""hookmech: mechanistic evaluation of sequence models on in-context recall tasks.

The package is imported lazily: ``import hookmech`` costs nothing until an attribute
that needs torch (``hookmech.load``, ``hookmech.HookedLM`` ...) is first touched, so
``hookmech --help`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# attribute -> (module, name in module); name None means the module itself
_LAZY = {
    "HookedLM": ("hookmech.model", "HookedLM"),
    "ModelConfig": ("hookmech.config", "ModelConfig"),
    "load": ("hookmech.checkpoint", "load"),
    "from_pretrained": ("hookmech.pretrained", "from_pretrained"),
    "save": ("hookmech.checkpoint", "save"),
    "HookmechError": ("hookmech.errors", "HookmechError"),
    "tasks": ("hookmech.tasks", None),
    "mixers": ("hookmech.mixers", None),
    "patching": ("hookmech.patching", None),
    "pretrained": ("hookmech.pretrained", None),
    "sites": ("hookmech.sites", None),
    "cache": ("hookmech.cache", None),
    "training": ("hookmech.training", None),
    "das": ("hookmech.das", None),
    "attention_maps": ("hookmech.effective_attention", "attention_maps"),
    "induction_scores": ("hookmech.effective_attention", "induction_scores"),
    "fixture": ("hookmech.demo", "fixture"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hookmech' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
