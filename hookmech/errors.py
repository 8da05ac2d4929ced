"""The project's exceptions: every error a user can cause is one of these, with a message
they can act on. The CLI turns them into one line on stderr and an exit code."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class HookmechError(Exception):
    """An error caused by input (a name, a file, an option); exit code 1 in the CLI."""

    exit_code = 1


class UsageError(HookmechError):
    """Bad usage: an unknown name, an invalid option value; exit code 2 in the CLI."""

    exit_code = 2


class NoComponentError(HookmechError):
    """A part this model does not have, asked for by TransformerLens's name (a block's MLP, a
    position embedding, a head hook of a mixer without one): one line saying what is missing.
    Not a KeyError, which TransformerLens's code catches and replaces by a message of its own."""


def suggest(name: str, candidates: Iterable[str], n: int = 3) -> str:
    """Return ' (did you mean: a, b?)' for the closest candidates to `name`, or ''."""
    matches = difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)
    return f" (did you mean: {', '.join(matches)}?)" if matches else ""


def unknown(kind: str, name: str, candidates: Iterable[str]) -> UsageError:
    """Build the error for an unknown `kind` called `name`, listing close matches."""
    candidates = sorted(set(candidates))
    hint = suggest(name, candidates)
    if not hint and len(candidates) <= 12:
        hint = f" (known: {', '.join(candidates)})"
    return UsageError(f"unknown {kind} {name!r}{hint}")
