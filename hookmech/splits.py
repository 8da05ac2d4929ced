"""Splitting a cache's rows by document: rows of one multi-query document share `doc_index`,
so a split by row could put one document on both sides. Used by probes (`hookmech.probe`) and
distributed alignment search (`hookmech.das`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import UsageError
from .shapes import RowInts


def split_by_document(
    doc_index: RowInts, heldout_frac: float, seed: int, who: str = "a probe"
) -> tuple[Tensor, Tensor]:
    """Return boolean masks ``(train [N], heldout [N])``: a seeded random `heldout_frac` of the
    documents (at least one, never all) is held out with all its rows. `who` names the caller
    in the error raised when there are fewer than 2 documents."""
    if not 0 < heldout_frac < 1:
        raise UsageError(f"heldout fraction must be in (0, 1), got {heldout_frac}")
    documents = torch.unique(doc_index)
    if len(documents) < 2:
        raise UsageError(f"{who} needs rows of at least 2 documents to hold some out")
    order = documents[torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed))]
    n_heldout = min(len(documents) - 1, max(1, math.ceil(heldout_frac * len(documents))))
    heldout = torch.isin(doc_index, order[:n_heldout])
    return ~heldout, heldout
