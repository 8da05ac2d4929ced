"""What every task offers: a JSON spec, a vocabulary size, and seeded batches."""

from __future__ import annotations

import abc
import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

from ..errors import HookmechError, UsageError, suggest
from ..option_pairs import check_option_types
from .batch import Batch


class Task(abc.ABC):
    """A synthetic recall task. Subclasses set `name`, `roles` and implement `sample`."""

    name: ClassVar[str]
    #: the roles a batch of this task carries
    roles: ClassVar[tuple[str, ...]]
    #: how many rows the task holds when its rows are given rather than drawn (the user's
    #: prompts: `sample` returns the first n of them); None where any number can be drawn
    n_rows: int | None = None

    @property
    @abc.abstractmethod
    def spec(self) -> dict[str, Any]:
        """The task as JSON-able options: ``make(**spec)`` rebuilds it (checkpoint metadata)."""

    @property
    @abc.abstractmethod
    def d_vocab(self) -> int:
        """Size of the model's vocabulary: content tokens plus specials."""

    @property
    @abc.abstractmethod
    def n_ctx(self) -> int:
        """Longest sequence the task produces."""

    @abc.abstractmethod
    def sample(self, n: int, seed: int | Sequence[int]) -> Batch:
        """Return `n` rows, a deterministic function of (task spec, n, seed)."""

    def describe_tokens(self, tokens: list[int]) -> str:
        """Return a human-readable rendering of one row of token ids."""
        return " ".join(str(t) for t in tokens)

    def chance(self) -> float | None:
        """Return the task's chance accuracy: that of a guess which knows the task's format but
        not which pair the query asks, uniform among the answers the document offers to its
        possible queries (AR, MQAR: its values; ATR: the parents of its eligible keys). None
        where the task defines none."""
        return None

    def token_names(self, d_vocab: int) -> list[str]:
        """Return the name of every token id ``0 .. d_vocab - 1`` (`describe_tokens` of each:
        ``k3``, ``v0``, ``BOS``, ...); tasks whose names hold spaces (a tokenizer's) override it."""
        names = self.describe_tokens(list(range(d_vocab))).split(" ")
        if len(names) != d_vocab:  # a name with a space in it would shift every later one
            raise HookmechError(f"task {self.name}: describe_tokens gave {len(names)} names for {d_vocab} tokens")
        return names


def check_task_options(cls: type[Task], options: dict[str, Any]) -> None:
    """Raise a UsageError naming the task if `options` holds a key `cls` does not take."""
    known = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for key in options:
        if key not in known:
            raise UsageError(
                f"task {cls.name!r} takes no option {key!r}{suggest(key, known)}; its options: {', '.join(known)}"
            )
    check_option_types(f"task {cls.name!r}", cls, options)
