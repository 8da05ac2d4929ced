"""Sequence mixers: a plain dict from registry name to class, made from the mixers' specs.

Every mixer is built as ``REGISTRY[name](d_model=..., **kwargs)`` and maps
``[batch, pos, d_model] -> [batch, pos, d_model]``; see `base.Mixer` for the core every mixer
implements, `capabilities` for what a mixer may opt into (`ExactPatchEffects` for AtP*,
`PathRoutes`, `EffectiveAttentionMap`), and `spec.MixerSpec` for what the package knows of each
one besides its class. A mixer's module declares its ``SPEC`` beside the class; `SPECS` holds
every module of this package's, by name, and `REGISTRY` their classes: adding a mixer is adding
its module (docs/architecture.md, "Adding a mixer").
"""

from __future__ import annotations

import importlib
import pkgutil

from ..errors import HookmechError, unknown
from .base import Mixer, check_mixer_options, mixer_options
from .capabilities import EffectiveAttentionMap, ExactPatchEffects, MissingCapability, PathRoutes
from .mixer_spec import Heads, MixerSpec, StateLoop


def _collect_specs() -> dict[str, MixerSpec]:
    """Return ``{name: spec}`` of every module of this package that declares a ``SPEC``, by name."""
    specs: dict[str, MixerSpec] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        spec = getattr(importlib.import_module(f"{__name__}.{module_info.name}"), "SPEC", None)
        if not isinstance(spec, MixerSpec):
            continue
        if spec.name in specs:
            raise HookmechError(f"two mixer specs are named {spec.name!r} (hookmech/mixers/{module_info.name}.py)")
        specs[spec.name] = spec
    return dict(sorted(specs.items()))


#: every mixer's spec, by registry name
SPECS: dict[str, MixerSpec] = _collect_specs()
#: registry name -> mixer class (``REGISTRY[name](d_model=..., **options)``), from `SPECS`
REGISTRY: dict[str, type[Mixer]] = {name: spec.mixer for name, spec in SPECS.items()}


def spec_of(name: str) -> MixerSpec:
    """Return the spec of registered mixer `name`: a UsageError for an unknown name, a
    HookmechError for a mixer registered without one."""
    if name in SPECS:
        return SPECS[name]
    if name in REGISTRY:
        raise HookmechError(
            f"mixer {name!r} is registered without a spec: declare SPEC = MixerSpec(...) beside its class "
            "(hookmech/mixers/mixer_spec.py)"
        )
    raise unknown("mixer", name, REGISTRY)


__all__ = [
    "REGISTRY",
    "SPECS",
    "EffectiveAttentionMap",
    "ExactPatchEffects",
    "Heads",
    "MissingCapability",
    "Mixer",
    "MixerSpec",
    "PathRoutes",
    "StateLoop",
    "check_mixer_options",
    "mixer_options",
    "spec_of",
]
