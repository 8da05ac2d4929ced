"""What a value of an option or a config field may be: a type and a range (`Field`), so that the
trainer, the model config and sweep files check a value the same way and say what they expected.

JSON and TOML give ints, floats, bools and strings; Python's ``True`` is also an int, and
``2.0`` a float: a bool is never a number here, and an integer field takes ints only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .errors import UsageError

#: the largest seed: torch.manual_seed takes unsigned 64-bit values
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class Field:
    """One field's type (`kind`: "integer", "number", "bool", "name" or "names") and range.

    Integers and numbers are checked against `low` (inclusive; exclusive with `low_open`) and
    `high` (inclusive); numbers must be finite. A name is a non-empty string, one of `choices`
    when they are given; `what` says what kind of name ("a mixer name"). "names" takes a name or
    a non-empty list of names (a mixer per layer)."""

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] | None = None
    what: str = "a name"

    def fits(self, value: Any) -> bool:
        """True when `value` has this field's type and lies in its range."""
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "name":
            return isinstance(value, str) and bool(value.strip()) and (self.choices is None or value in self.choices)
        if self.kind == "names":
            return _is_name(value) or (isinstance(value, list) and bool(value) and all(map(_is_name, value)))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "integer" and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        """Return what the field expects, e.g. "an integer >= 1", "a number in [0, 1]"."""
        if self.kind == "bool":
            return "true or false"
        if self.kind == "names":
            return f"{self.what} (a string) or a list of them, one per layer"
        if self.kind == "name":
            if self.choices is not None:
                return "one of " + ", ".join(json.dumps(choice) for choice in self.choices)
            return f"{self.what} (a string)"
        if self.kind == "integer":
            if self.low is not None and self.high is not None:
                return f"an integer in {self.low}..{self.high}"
            return "an integer" + (f" >= {self.low}" if self.low is not None else "")
        if self.low is not None and self.high is not None:
            return f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"a number {'>' if self.low_open else '>='} {self.low:g}"
        return "a number"

    def check(self, name: str, value: Any) -> None:
        """Raise a UsageError "NAME must be WHAT, got VALUE" when `value` does not fit; return None."""
        if not self.fits(value):
            raise UsageError(f"{name} must be {self.describe()}, got {value!r}")


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def integer(low: int | None = None, high: int | None = None) -> Field:
    """Return an integer field in [low, high] (None: unbounded)."""
    return Field("integer", low=low, high=high)


def number(low: float | None = None, high: float | None = None, *, above: bool = False) -> Field:
    """Return a finite-number field: > low when `above`, else >= low, and <= high."""
    return Field("number", low=low, high=high, low_open=above)


def name(what: str = "a name", choices: tuple[str, ...] | None = None) -> Field:
    """Return a non-empty string field (`what` says which kind of name), one of `choices` if given."""
    return Field("name", choices=choices, what=what)


def names(what: str) -> Field:
    """Return a field taking one name or a non-empty list of names (`what`: "a mixer name")."""
    return Field("names", what=what)


BOOL = Field("bool")
COUNT = integer(1)
SEED = integer(0, MAX_SEED)


def toml_text(value: Any) -> str:
    """Return `value` as it is written in TOML and JSON (``"abc"``, ``true``, ``[0, 1.5]``, ``inf``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list):
        return "[" + ", ".join(toml_text(item) for item in value) + "]"
    try:
        return json.dumps(value)
    except (TypeError, ValueError):  # not a JSON value (a library caller's object)
        return repr(value)
