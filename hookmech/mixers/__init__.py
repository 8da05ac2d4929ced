"""Sequence mixers: a plain dict from registry name to class, made from the mixers' specs.

Every mixer is built as ``REGISTRY[name](d_model=..., **kwargs)`` and maps
``[batch, pos, d_model] -> [batch, pos, d_model]``; see `base.Mixer` for the core every mixer
implements, `capabilities` for what a mixer may opt into (`ExactPatchEffects` for AtP*,
`PathRoutes`, `EffectiveAttentionMap`), and `mixer_spec.MixerSpec` for what the package knows of each
one besides its class. A mixer's module declares its ``SPEC`` beside the class; `SPECS` holds
every module of this package's, by name, and `REGISTRY` their classes: adding a mixer is adding
its module (docs/architecture.md, "Adding a mixer"). A mixer from outside the package is named
``module.path:Class``, ``path/to/file.py:Class`` or by an entry point of group ``hookmech.mixers``
(`external`; docs/your_mixer.md): `spec_of`, `mixer_class` and `canonical_name` take any name.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..errors import HookmechError, UsageError, unknown
from . import external
from .base import Mixer, check_mixer_options, mixer_options
from .capabilities import EffectiveAttentionMap, ExactPatchEffects, MissingCapability, PathRoutes
from .mixer_spec import Heads, MixerSpec
from .plug_in_check import build_plug_in


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
    """Return the spec of mixer `name`: a registered one's, or that of a mixer from outside the
    package (``module:Class``, ``path/to/file.py:Class``, an entry point of group
    ``hookmech.mixers``; `external`), whose `MixerSpec.name` is its canonical name. A UsageError,
    one line, for a name that does not resolve to a `Mixer` subclass."""
    if name in SPECS:
        return SPECS[name]
    if name in REGISTRY:
        raise HookmechError(
            f"mixer {name!r} is registered without a spec: declare SPEC = MixerSpec(...) beside its class "
            "(hookmech/mixers/mixer_spec.py)"
        )
    if external.is_import_name(name):
        spec = external.resolve(name)
    else:
        value = external.entry_point_value(name)
        if value is None:
            raise unknown_mixer(name)
        spec = external.resolve(value)
    # a registered class named by import is the registered mixer (one config, one model_hash)
    return next((own for own in SPECS.values() if own.mixer is spec.mixer), spec)


def canonical_name(name: str) -> str:
    """Return the name a model config records for mixer `name`: a registered mixer's own name, the
    canonical ``module:Class`` or ``/real/path/file.py:Class`` of any other (`external`)."""
    return name if name in SPECS else spec_of(name).name


def mixer_class(name: str) -> type[Mixer]:
    """Return the class of mixer `name` (`spec_of`), built as ``cls(d_model=..., **options)``."""
    return spec_of(name).mixer


def build_mixer(name: str, d_model: int, options: dict, n_ctx: int) -> Mixer:
    """Return mixer `name` built as ``mixer_class(name)(d_model=d_model, **options)``; a plug-in
    mixer (not registered) is named in one line when it fails, and checked when first built in a
    model of `n_ctx` positions (`plug_in_check`, with its spec's `MixerSpec.causal_tolerance`)."""
    spec = spec_of(name)
    if name in SPECS:
        return spec.mixer(d_model=d_model, **options)
    return build_plug_in(name, spec, d_model, options, n_ctx)


def unknown_mixer(name: str) -> UsageError:
    """The error for a mixer name that is neither registered nor an entry point, nor ``module:Class``."""
    error = unknown("mixer", name, [*REGISTRY, *external.entry_point_names()])
    return UsageError(f"{error}; a mixer of your own is named module.path:Class or path/to/file.py:Class")


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
    "build_mixer",
    "canonical_name",
    "check_mixer_options",
    "mixer_class",
    "mixer_options",
    "spec_of",
    "unknown_mixer",
]
