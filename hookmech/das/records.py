"""What a DAS run returns and writes: one record per (site, position, K), and the bases.

A record (`das_record`) has ``site, hook, pos, dim, d, iia, iia_random, iia_full, attribution,
attribution_random, attribution_full, p_clean, p_corrupt, p_patched, p_patched_random, n_dev,
n_train, loss, steps, lr, batch_size, seed, boundless`` (plus ``boundary`` with boundless):
``*_random`` are the random basis of the same dimension (the control), ``*_full`` the vanilla
interchange of the whole activation on the same rows; attributions are null (None) when
p_clean == p_corrupt.

`DasResult.save(folder)` writes ``records.json`` (the records, a JSON array) and
``bases.safetensors`` (``dim{K}`` ``[d, K]``, ``random_dim{K}``, and ``rotation`` ``[d, d]`` for
boundless; metadata: site, hook, pos, model_hash, d, activation_shape), each atomically; the
same model, cache and options give the same bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from .. import __version__
from ..checkpoint import write_safetensors
from ..fileio import atomic_path, write_text_atomic

if TYPE_CHECKING:
    from .data import DasData
    from .training_options import DasOptions

RECORDS_FILE = "records.json"
BASES_FILE = "bases.safetensors"


@dataclass(frozen=True)
class Scores:
    """An intervention's scores on the dev rows: IIA and mean p(answer) patched, with the
    unpatched runs' mean p(answer) of the same rows."""

    iia: float
    p_patched: float
    p_clean: float
    p_corrupt: float
    n: int

    @property
    def attribution(self) -> float | None:
        """(p_patched − p_corrupt) / (p_clean − p_corrupt), None when p_clean == p_corrupt."""
        gap = self.p_clean - self.p_corrupt
        return None if gap == 0 else (self.p_patched - self.p_corrupt) / gap


def das_record(
    site: str,
    hook: str,
    pos: str,
    data: DasData,
    options: DasOptions,
    dim: int,
    learned: Scores,
    random: Scores,
    full: Scores,
    loss: float,
    boundless: bool,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Return the record of one learned basis of dimension `dim` (fields: the module docstring)."""
    record = {
        "site": site,
        "hook": hook,
        "pos": pos,
        "dim": dim,
        "d": data.d,
        "iia": learned.iia,
        "iia_random": random.iia,
        "iia_full": full.iia,
        "attribution": learned.attribution,
        "attribution_random": random.attribution,
        "attribution_full": full.attribution,
        "p_clean": learned.p_clean,
        "p_corrupt": learned.p_corrupt,
        "p_patched": learned.p_patched,
        "p_patched_random": random.p_patched,
        "n_dev": learned.n,
        "n_train": data.n_train,
        "loss": loss if math.isfinite(loss) else None,
        "steps": options.steps,
        "lr": options.lr,
        "batch_size": options.batch_size,
        "seed": options.seed,
        "boundless": boundless,
    }
    record.update({key: value for key, value in extra.items() if not isinstance(value, Tensor)})
    return record


@dataclass
class DasResult:
    """The records (one per learned basis), the bases ``{name: [d, K]}``, the bases file's
    metadata, and the cache rows the scores were measured on, `dev_rows` ``[n_dev]``."""

    records: list[dict[str, Any]]
    bases: dict[str, Tensor]
    metadata: dict[str, str]
    dev_rows: Tensor

    def save(self, folder: str | Path) -> list[Path]:
        """Write ``records.json`` and ``bases.safetensors`` into `folder` (made if missing), each
        atomically; return the paths written."""
        folder = Path(folder)
        records_path, bases_path = folder / RECORDS_FILE, folder / BASES_FILE
        write_text_atomic(records_path, json.dumps(self.records, indent=1, allow_nan=False) + "\n")
        tensors = {name: basis.detach().cpu().float().contiguous() for name, basis in self.bases.items()}
        metadata = {**self.metadata, "hookmech_version": __version__}
        with atomic_path(bases_path) as tmp:
            write_safetensors(tensors, tmp, metadata)
        return [records_path, bases_path]
