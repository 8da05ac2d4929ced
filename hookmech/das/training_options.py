"""`DasOptions`: the training options of one distributed alignment search, checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError
from ..validate import check_seed


@dataclass(frozen=True)
class DasOptions:
    """The training options of one search (each checked on construction)."""

    steps: int = 200
    lr: float = 1e-2
    batch_size: int = 64
    seed: int = 0
    dev_frac: float = 0.2
    temperature: tuple[float, float] = (50.0, 0.1)
    boundary_lr: float | None = None
    boundary_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UsageError(f"steps must be >= 1, got {self.steps}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UsageError(f"learning rate must be a positive number, got {self.lr}")
        if self.batch_size < 1:
            raise UsageError(f"batch size must be >= 1, got {self.batch_size}")
        check_seed(self.seed)
        if not all(math.isfinite(t) and t > 0 for t in self.temperature):
            raise UsageError(f"temperatures must be positive numbers, got {self.temperature}")
