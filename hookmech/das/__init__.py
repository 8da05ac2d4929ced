"""Distributed alignment search (DAS; Geiger et al. 2024) and Boundless DAS (Wu et al. 2023) from
the activation cache: in which low-dimensional subspace of an activation does the answer live?

``hookmech.das.train(model, cache, site, pos, dims=[1, 2, 4])`` learns, per dimension K, an
orthonormal basis Q ``[d, K]`` of the flattened activation at (site, position) such that replacing
the corrupt run's coordinates in its span by the clean run's, ``x + Q Qᵀ (x_clean − x)``, restores
the clean answer; it reports interchange-intervention accuracy and attribution on held-out
documents, against a random basis of the same K. The package's files, in the order a search
flows through them:

    search.py    `train`: the training loop per K (or Boundless DAS), the evaluation
    options.py   `DasOptions`: steps, learning rate, batch size, seed, Boundless DAS's schedule
    basis.py     the interventions (`SubspaceIntervention`, `BoundlessIntervention`), random bases
    data.py      `DasData`: the cache's rows in chunks, split by document, with what forwards start from
    patched.py   the patched forwards: the engine's resumed (or full) runs with a subspace intervention
    records.py   `DasResult`: the scores, one record per (site, position, K), the bases, the files written
"""

from __future__ import annotations

from .basis import MAX_ROTATION, BoundlessIntervention, SubspaceIntervention, random_basis
from .records import BASES_FILE, RECORDS_FILE, DasResult
from .search import train
from .training_options import DasOptions

__all__ = [
    "BASES_FILE",
    "MAX_ROTATION",
    "RECORDS_FILE",
    "BoundlessIntervention",
    "DasOptions",
    "DasResult",
    "SubspaceIntervention",
    "random_basis",
    "train",
]
