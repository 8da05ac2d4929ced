"""Mixers from outside the package: a class named ``module.path:Class`` or ``path/to/file.py:Class``,
or registered by an installed package under the entry-point group ``hookmech.mixers``, resolved
to a `MixerSpec` under its *canonical* name, the one model configs and checkpoints record.

Canonical names: ``module:Qualname`` of the module that defines the class (so that a class
re-exported by a package has one name), or, for a class defined in a file,
``/real/path/to/file.py:Qualname`` (the absolute path with symbolic links resolved, so that two
spellings of one file give one name, one `model_hash` and one sweep run id). An entry point's name
stands for the canonical name of its value. A name that does not resolve, or resolves to something
that is not a `Mixer` subclass, is one UsageError line.

What the package knows of an outside mixer besides its class is a `MixerSpec` its module may
declare beside it (any module-level ``MixerSpec`` whose ``mixer`` is the class; its name is replaced
by the canonical one); without one the mixer has no heads, and the block fields of a class it
derives from that has one (`BLOCK_FIELDS`), else their defaults. A class attribute named as a block
field (``output_projections = ("out_proj",)``, ``causal_tolerance = None``) states that field of
an outside mixer's spec, as docs/your_mixer.md shows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from ..errors import UsageError, suggest
from .base import Mixer
from .mixer_spec import BLOCK_FIELDS, MixerSpec

#: the entry-point group under which installed packages register mixers (name = "module:Class")
ENTRY_POINT_GROUP = "hookmech.mixers"
#: the prefix of the module names under which mixer files are imported (``sys.modules``)
FILE_MODULE_PREFIX = "hookmech_mixer_file_"

#: canonical name -> spec, for every outside mixer resolved in this process
_SPECS: dict[str, MixerSpec] = {}


def is_import_name(name: str) -> bool:
    """Return True when `name` names a class by import (``module:Class`` or ``file.py:Class``)."""
    return ":" in name


def entry_point_names() -> list[str]:
    """Return the names registered under `ENTRY_POINT_GROUP` by the installed packages, sorted."""
    return sorted({point.name for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


def entry_point_value(name: str) -> str | None:
    """Return the ``module:Class`` that entry point `name` of `ENTRY_POINT_GROUP` stands for, or None
    when no installed package registers it; a UsageError when two register it differently."""
    points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
    values = sorted({point.value.partition("[")[0].strip() for point in points})  # without "[extras]"
    if len(values) > 1:
        raise UsageError(
            f"mixer {name!r}: installed packages register it twice under the entry-point group "
            f"{ENTRY_POINT_GROUP!r} ({', '.join(values)}); name one of them as module:Class"
        )
    if values and not is_import_name(values[0]):
        raise UsageError(f"mixer {name!r}: its entry point names {values[0]!r}, not a module:Class")
    return values[0] if values else None


def resolve(name: str) -> MixerSpec:
    """Return the spec of the outside mixer `name` (``module:Class``, ``file.py:Class``), importing
    its module on first use; its `MixerSpec.name` is the canonical name. A UsageError, one line,
    when the module or file cannot be imported or the class is missing or not a `Mixer` subclass."""
    spec = _SPECS.get(name)  # by canonical name only: another spelling may mean another file elsewhere
    if spec is not None and _still_there(spec):
        return spec
    cls, canonical = _import_class(name)  # the module itself is imported once (sys.modules)
    spec = _SPECS.get(canonical)
    if spec is None or spec.mixer is not cls:
        spec = _spec_of(cls, canonical)
        _SPECS[canonical] = spec
    return spec


def _still_there(spec: MixerSpec) -> bool:
    """True unless `spec`'s mixer came from a file that is gone: a name resolved earlier in this
    process is refused, as it would be in a new process, once its file is moved away."""
    where = spec.name.rpartition(":")[0]
    return not where.endswith(".py") or Path(where).is_file()


def _import_class(name: str) -> tuple[type[Mixer], str]:
    """Return (the class `name` names, its canonical name)."""
    where, _, qualname = name.strip().rpartition(":")
    where = where.strip()
    qualname = qualname.strip()
    if not where or not qualname:
        raise UsageError(f"mixer {name!r}: expected module.path:Class or path/to/file.py:Class")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _import_file(name, where) if is_file else _import_module(name, where)
    target: object = module
    for part in qualname.split("."):
        if not hasattr(target, part):
            candidates = [key for key, value in vars(module).items() if _is_mixer_class(value)]
            raise UsageError(f"mixer {name!r}: {_describe(module)} has no {qualname!r}{suggest(qualname, candidates)}")
        target = getattr(target, part)
    if not _is_mixer_class(target):
        if target is Mixer:
            kind = "the base class Mixer itself"
        elif isinstance(target, type):
            kind = f"class {target.__module__}.{target.__qualname__}"
        else:
            kind = f"an object of type {type(target).__name__}"
        raise UsageError(f"mixer {name!r} is {kind}, not a subclass of hookmech.mixers.Mixer")
    cls: type[Mixer] = target  # type: ignore[assignment]
    return cls, _canonical(cls, module, name)


def _is_mixer_class(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, Mixer) and value is not Mixer


def _describe(module) -> str:
    """'file /x/y.py' for a mixer file's module, else 'module a.b'."""
    path = getattr(module, "__file__", None)
    return f"file {path}" if module.__name__.startswith(FILE_MODULE_PREFIX) else f"module {module.__name__} ({path})"


def _import_module(name: str, module_name: str):
    """Import `module_name` (a module or package path); any failure is one UsageError line."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise UsageError(
                f"mixer {name!r}: no module named {missing!r} (install its package, or put its folder on "
                "PYTHONPATH; a file is named path/to/file.py:Class)"
            ) from None
        raise _import_failed(name, module_name, error) from None
    except (Exception, SystemExit) as error:  # the user's module may raise anything, or exit, while imported
        raise _import_failed(name, module_name, error) from None


def _import_file(name: str, where: str):
    """Import the Python file `where` under a module name made from its real path (once per
    process: later calls get the same module); any failure is one UsageError line."""
    path = Path(where).expanduser()
    if not path.is_file():
        raise UsageError(f"mixer {name!r}: no such file {path.absolute()}")
    path = path.resolve()
    module_name = FILE_MODULE_PREFIX + hashlib.sha1(str(path).encode()).hexdigest()[:16]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"mixer {name!r}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    # in sys.modules while it runs, as an import puts it: dataclasses and pickling look the module up there
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # sys.exit() at import too
        sys.modules.pop(module_name, None)
        raise _import_failed(name, str(path), error) from None
    return module


def _import_failed(name: str, where: str, error: BaseException) -> UsageError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return UsageError(f"mixer {name!r}: importing {where} raised {type(error).__name__}: {first}")


def _canonical(cls: type[Mixer], module, name: str) -> str:
    """Return the canonical name of `cls`, found through `module` under `name` (module docstring)."""
    if cls.__module__.startswith(FILE_MODULE_PREFIX):
        defining = sys.modules.get(cls.__module__)
        return f"{Path(getattr(defining, '__file__', module.__file__)).resolve()}:{cls.__qualname__}"
    defining = sys.modules.get(cls.__module__)
    found: object = defining
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is cls:
        return f"{cls.__module__}:{cls.__qualname__}"
    return name.strip()  # defined somewhere it cannot be named from (a function's local class): as given


#: what a mixer class once declared for its block's TransformerLens names, now `MixerSpec.tl_attention`
#: and `tl_mixer_out`
RETIRED_ALIASES = ("block_hook_aliases", "hook_aliases")


def _spec_of(cls: type[Mixer], canonical: str) -> MixerSpec:
    """Return the spec of `cls` under `canonical` (module docstring): its module's `MixerSpec` of
    it, or a plain one with the block fields of its nearest base class that has one; with the
    block fields `cls` states as class attributes on top."""
    retired = [name for name in RETIRED_ALIASES if hasattr(cls, name)]
    if retired:  # read silently before: a plug-in's TransformerLens names would vanish without a word
        raise UsageError(
            f"mixer {canonical!r} declares {retired[0]}, which hookmech no longer reads: state TransformerLens's "
            "names in its MixerSpec (tl_attention, tl_mixer_out; docs/your_mixer.md)"
        )
    spec = _declared_spec(cls)
    if spec is None:
        base = next(filter(None, map(_declared_spec, cls.__mro__[1:])), None)
        block = {name: getattr(base, name) for name in BLOCK_FIELDS} if base is not None else {}
        spec = MixerSpec(name=canonical, mixer=cls, heads=None, meanings={}, bench=False, **block)
    stated = {name: getattr(cls, name) for name in BLOCK_FIELDS if hasattr(cls, name)}
    return dataclasses.replace(spec, name=canonical, **stated)


def _declared_spec(cls: type) -> MixerSpec | None:
    """Return the module-level `MixerSpec` of `cls` in its module (the first by name), or None."""
    module = sys.modules.get(cls.__module__)
    declared = (
        value
        for _, value in sorted(vars(module).items() if module is not None else ())
        if isinstance(value, MixerSpec) and value.mixer is cls
    )
    return next(declared, None)
