"""`PatchOptions`: how a patch is run and scored, checked once, in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError, suggest
from ..validate import check_seed
from .metrics import METRICS

METHODS = ("exact", "atp", "atp-star")
DIRECTIONS = ("denoise", "noise")
ABLATIONS = ("zero", "mean", "resample")
#: bytes of mixer contexts the engine keeps for resumed patches by default
CONTEXT_MEMORY = 2 << 30


def check_threshold(threshold: float) -> None:
    """Raise a UsageError unless `threshold` (the filter on m_clean − m_corrupt) is a finite number; return None."""
    try:
        finite = math.isfinite(float(threshold))
    except (TypeError, ValueError):
        finite = False
    if not finite:
        raise UsageError(f"threshold must be a finite number, got {threshold!r}")


@dataclass(frozen=True)
class PatchOptions:
    """The options of `hookmech.patching.patch` (see its docstring), checked on construction.

    `direction` None means "denoise", or "noise" with an ablation; after construction it is
    always one of DIRECTIONS. Base run (patched) and source run (read from) follow from it.
    """

    method: str = "exact"
    metric: str = "p_answer"
    direction: str | None = None
    threshold: float = 0.01
    max_batch: int = 256
    context_memory: int = CONTEXT_MEMORY
    per_example: bool = False
    ablate: str | None = None
    ablate_seed: int = 0

    def __post_init__(self) -> None:
        check_threshold(self.threshold)
        if self.method not in METHODS:
            raise UsageError(f"unknown method {self.method!r} (available: {', '.join(METHODS)})")
        for kind, value, choices in (
            ("metric", self.metric, METRICS),
            ("ablation", self.ablate, ABLATIONS),
            ("direction", self.direction, DIRECTIONS),
        ):
            if value is not None and value not in choices:
                raise UsageError(f"unknown {kind} {value!r}{suggest(value, choices)} (available: {', '.join(choices)})")
        if self.max_batch < 1:
            raise UsageError(f"max_batch must be >= 1, got {self.max_batch}")
        check_seed(self.ablate_seed, "ablate_seed")
        if self.ablate is not None and self.direction == "denoise":
            raise UsageError(
                "ablations replace activations of the clean run (direction 'noise'); "
                "drop direction 'denoise' or the ablation"
            )
        if self.direction is None:  # frozen: the resolved default is written once, here
            object.__setattr__(self, "direction", "noise" if self.ablate is not None else "denoise")

    @property
    def base(self) -> str:
        """The run that is patched: "corrupt" when denoising, "clean" when noising or ablating."""
        return "corrupt" if self.direction == "denoise" else "clean"

    @property
    def source(self) -> str:
        """The run whose activations are patched in (ablations use the clean run's)."""
        return "clean" if self.direction == "denoise" else "corrupt"
