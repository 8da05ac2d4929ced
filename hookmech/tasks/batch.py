"""A batch of (document, query) rows with its corrupted twin and role positions."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

from ..errors import unknown


@dataclass
class Batch:
    """Rows of (document, query) pairs.

    tokens, corrupt_tokens: ``[N, T]`` int64, right-padded with the task's pad id;
    answers, lengths, doc_index: ``[N]``; roles: role name -> ``[N]`` absolute positions.
    The answer is predicted at ``roles["query"]``.
    """

    tokens: Tensor
    corrupt_tokens: Tensor
    answers: Tensor
    lengths: Tensor
    doc_index: Tensor
    roles: dict[str, Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def query_pos(self) -> Tensor:
        """``[N]`` positions at which the answer is predicted."""
        return self.roles["query"]

    def role(self, name: str) -> Tensor:
        """Return the ``[N]`` positions of role `name`; an unknown role lists the task's roles."""
        if name not in self.roles:
            raise unknown("role", name, self.roles)
        return self.roles[name]

    def select(self, index: Tensor | slice) -> "Batch":
        """Return the rows picked by `index` (a slice, or an index / boolean tensor)."""
        return replace(
            self,
            tokens=self.tokens[index],
            corrupt_tokens=self.corrupt_tokens[index],
            answers=self.answers[index],
            lengths=self.lengths[index],
            doc_index=self.doc_index[index],
            roles={name: pos[index] for name, pos in self.roles.items()},
        )

    def trimmed(self) -> "Batch":
        """Return the batch cut to its longest row: all-padding columns dropped from every
        ``[N, T]`` field (subclasses' too). Causal models give the same predictions."""
        n_pos, full = int(self.lengths.max()), self.tokens.shape[1]
        if n_pos == full:
            return self
        cut = {
            f.name: getattr(self, f.name)[:, :n_pos]
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor) and getattr(self, f.name).dim() == 2
            and getattr(self, f.name).shape[1] == full
        }
        return replace(self, **cut)

    def to(self, device: torch.device | str) -> "Batch":
        """Return the batch with every tensor on `device`."""
        return replace(
            self,
            tokens=self.tokens.to(device),
            corrupt_tokens=self.corrupt_tokens.to(device),
            answers=self.answers.to(device),
            lengths=self.lengths.to(device),
            doc_index=self.doc_index.to(device),
            roles={name: pos.to(device) for name, pos in self.roles.items()},
        )
