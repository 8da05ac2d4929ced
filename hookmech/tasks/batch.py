"""A batch of (document, query) rows with its corrupted twin and role positions (docs/guide.md §2).

No ``from __future__ import annotations`` here: a dataclass's ``__init__`` keeps its fields'
annotations as written, and a subclass in another module (``TreeBatch``) inherits them; as
strings they would name aliases of this module that the subclass's module need not import,
and the test suite's runtime checks (tests/runtime_typecheck.py) could not evaluate them.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Self

import torch
from torch import Tensor

from ..errors import unknown
from ..shapes import RowInts, Tokens


@dataclass
class Batch:
    """Rows of (document, query) pairs.

    tokens, corrupt_tokens: ``[N, T]`` int64, right-padded with the task's pad id;
    answers, lengths, doc_index: ``[N]``; roles: role name -> ``[N]`` absolute positions.
    The answer is predicted at ``roles["query"]``. A subclass's fields are tensors ``[N, ...]``
    too (`select` and `to` treat every tensor field, and every dict of them, as rows).
    """

    tokens: Tokens
    corrupt_tokens: Tokens
    answers: RowInts
    lengths: RowInts
    doc_index: RowInts
    roles: dict[str, RowInts] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def query_pos(self) -> RowInts:
        """``[N]`` positions at which the answer is predicted."""
        return self.roles["query"]

    def role(self, name: str) -> RowInts:
        """Return the ``[N]`` positions of role `name`; an unknown role lists the task's roles."""
        if name not in self.roles:
            raise unknown("role", name, self.roles)
        return self.roles[name]

    def select(self, index: Tensor | slice) -> Self:
        """Return the rows picked by `index` (a slice, or an index / boolean tensor)."""
        return self._map_tensors(lambda rows: rows[index])

    def trimmed(self) -> Self:
        """Return the batch cut to its longest row: all-padding columns dropped from every
        ``[N, T]`` field (subclasses' too). Causal models give the same predictions."""
        n_pos, full = int(self.lengths.max()), self.tokens.shape[1]
        if n_pos == full:
            return self
        cut = {
            f.name: getattr(self, f.name)[:, :n_pos]
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
            and getattr(self, f.name).dim() == 2
            and getattr(self, f.name).shape[1] == full
        }
        return replace(self, **cut)

    def to(self, device: torch.device | str) -> Self:
        """Return the batch with every tensor on `device`."""
        return self._map_tensors(lambda tensor: tensor.to(device))

    def _map_tensors(self, fn: Callable[[Tensor], Tensor]) -> Self:
        """Return a copy with `fn` applied to every tensor field and every tensor of a dict
        field (the roles), subclasses' fields included: all at once, so that the copy is made
        of consistent rows."""
        changed: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                changed[f.name] = fn(value)
            elif isinstance(value, dict):
                changed[f.name] = {key: fn(tensor) for key, tensor in value.items()}
        return replace(self, **changed)
