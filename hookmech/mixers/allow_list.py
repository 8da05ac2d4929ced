"""Which plug-in mixers a stored model config may import: loading a file never runs code it names
unless the user allows it for that command.

A checkpoint's ``hookmech_config`` (or a cache's ``model_config``) may record a mixer from outside
the package by its canonical name (``module.path:Class``, ``/real/path/file.py:Class``;
`external`). Importing it runs its module's code, so reading a file never imports it
(`checkpoint.read_metadata`, caches, ``probe``, ``inspect``), and building the model a file
describes (`hookmech.load`, every command that runs a checkpoint) imports it only when it is
allowed, by a SPEC that names it:

- ``allow_mixers=[SPEC, ...]`` (`hookmech.load`), ``--allow-mixer SPEC`` (the command line);
- the environment variable ``HOOKMECH_ALLOW_MIXERS`` (SPECs separated by commas).

A SPEC is a module (``pkg.layers``) or a Python file (``/path/mine.py``, ``mine.py`` relative to
the current folder), optionally with ``:Class`` (without it, any class of that module or file).
A stored config naming a file by a relative path is refused whatever is allowed: hookmech
records absolute paths, and a relative one would import whatever file sits beside the reader.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import HookmechError, UsageError

# hookmech.mixers is imported where used: it imports this module before it defines SPECS (a cycle)

#: the environment variable listing the plug-in mixers stored configs may import (comma-separated)
ENV_VAR = "HOOKMECH_ALLOW_MIXERS"


def plug_ins(names: Iterable[str]) -> list[str]:
    """Return the names among `names` (a config's ``mixers``) that are not registered mixers, in
    order, each once: those whose building imports code from outside the package."""
    from . import SPECS

    return list(dict.fromkeys(name for name in names if name not in SPECS))


def _split(spec: str) -> tuple[str, str, bool]:
    """Return (module or file, class or "", whether it names a file) of a SPEC or a stored name."""
    where, colon, qualname = spec.strip().rpartition(":")
    if not colon:
        where, qualname = spec.strip(), ""
    where = where.strip()
    return where, qualname.strip(), where.endswith(".py") or "/" in where or "\\" in where


def check_stored_name(name: str) -> None:
    """Raise a HookmechError when the stored mixer name `name` names a file by a relative path
    (``evil.py:S``, ``../x.py:S``), which would import whatever file sits beside the reader, and
    a UsageError for a bare name that is neither registered nor an installed entry point (read
    from the packages' metadata: nothing is imported); return None."""
    from . import SPECS, external, unknown_mixer

    if name not in SPECS and not external.is_import_name(name) and external.entry_point_value(name) is None:
        raise unknown_mixer(name)
    where, _, is_file = _split(name)
    if is_file and not Path(where).is_absolute():
        raise HookmechError(
            f"mixer {name!r} names a file by a relative path; a stored config names a mixer file by its "
            "absolute path (hookmech records it so), so this one is refused and not imported"
        )


def allowed_specs(allow_mixers: Iterable[str] = ()) -> list[str]:
    """Return `allow_mixers` (a SPEC or several) and the SPECs of ``HOOKMECH_ALLOW_MIXERS``,
    non-empty ones only."""
    if isinstance(allow_mixers, str):
        allow_mixers = [allow_mixers]
    from_env = os.environ.get(ENV_VAR, "").split(",")
    return [spec.strip() for spec in [*allow_mixers, *from_env] if spec.strip()]


def is_allowed(name: str, specs: Iterable[str]) -> bool:
    """True when one of `specs` names the stored mixer `name` (its module or file, and its class
    unless the SPEC names none); files are compared by real path, without importing anything."""
    where, qualname, is_file = _split(name)
    for spec in specs:
        spec_where, spec_class, spec_is_file = _split(spec)
        if spec_is_file != is_file or spec_class not in ("", qualname):
            continue
        if is_file and os.path.realpath(os.path.expanduser(spec_where)) == os.path.realpath(where):
            return True
        if not is_file and spec_where == where:
            return True
    return False


def require_allowed(names: Iterable[str], allow_mixers: Iterable[str] = (), source: str = "the model config") -> None:
    """Raise a UsageError naming the first plug-in mixer of `names` (a stored config's ``mixers``,
    read from `source`) that neither `allow_mixers` nor ``HOOKMECH_ALLOW_MIXERS`` allows, and how
    to allow it; a HookmechError for one named by a relative path (`check_stored_name`). Imports
    nothing; returns None."""
    specs = allowed_specs(allow_mixers)
    for name in plug_ins(names):
        check_stored_name(name)
        if not is_allowed(name, specs):
            raise UsageError(
                f"{source} names the plug-in mixer {name!r}, whose code is imported only if you allow it: "
                f"--allow-mixer {_quoted(name)} (or {ENV_VAR}={_quoted(name)}; allow_mixers=[...] in Python)"
            )


def _quoted(name: str) -> str:
    """`name` as a shell word (quoted when it holds a space or a shell character)."""
    return shlex.quote(name)


@contextlib.contextmanager
def allowing(specs: Iterable[str]) -> Iterator[None]:
    """Add `specs` to ``HOOKMECH_ALLOW_MIXERS`` for the block (so that worker processes started
    in it allow them too), then restore it. Yields None."""
    specs = [spec.strip() for spec in specs if spec.strip()]
    if not specs:
        yield
        return
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = ",".join([*specs, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before
