"""The subspace interventions of distributed alignment search, on a flattened activation x ``[d]``.

DAS (Geiger et al. 2024) learns an orthonormal basis Q ``[d, K]`` and replaces the base (corrupt)
run's coordinates in its span by the source (clean) run's:

    x  ->  x + Q Qᵀ (x_source − x)

(pyvene's `LowRankRotatedSpaceIntervention`; with K = d, Q Qᵀ = I and this is the vanilla
interchange of the whole activation). Boundless DAS (Wu et al. 2023) learns a full rotation
R ``[d, d]`` and a soft boundary b ∈ [1/d, 1] instead: rotated coordinate i is exchanged with weight

    m_i = sigmoid((b·d − i − ½) / T)

at a temperature T annealed towards 0, so that the first round(b·d) coordinates are exchanged
and the rest kept; the learned dimension is that count (pyvene's `BoundlessRotatedSpaceIntervention`
masks with a sigmoid at each end of [0, b·d], which also halves coordinate 0's weight; a single
sigmoid centred between two coordinates does not).

Q and R are `torch.nn.utils.parametrizations.orthogonal` of a ``[d, K]`` weight (pyvene's
parametrisation): orthonormal columns at every step of the optimiser. Assigning the initial
basis completes it to a ``[d, d]`` orthogonal matrix with random columns, which the optimiser
moves along; that completion is drawn from a seeded generator here, so a seed fixes the whole
training trajectory.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import orthogonal

from ..errors import UsageError
from ..shapes import Basis, Flat

#: the widest full rotation Boundless DAS trains: the orthogonal parametrisation's cost grows
#: as d² per step (a Mamba `ssm_state`, d_inner · d_state, is thousands wide: use --dim there)
MAX_ROTATION = 1024


def derived_seed(seed: int, *stream: int) -> int:
    """Return a 63-bit seed for one random stream of a run (e.g. ``(K, 0)``: the initial basis of
    dimension K), independent of the other streams of the same seed (numpy's `SeedSequence`)."""
    return int(np.random.SeedSequence([seed, *stream]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def random_basis(d: int, k: int, seed: int) -> Basis:
    """Return a random orthonormal basis ``[d, k]`` float32, uniform (Haar) over k-dimensional
    subspaces: the Q of a Gaussian matrix's QR decomposition, columns signed so that R's diagonal
    is positive. Deterministic in `seed`."""
    if not 1 <= k <= d:
        raise UsageError(f"a basis of dimension {k} in a {d}-dimensional activation: need 1 <= K <= {d}")
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(d, k, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r))).float()


class _Columns(nn.Module):
    """A ``[d, k]`` weight to be made orthonormal (pyvene's `LowRankRotateLayer`)."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d, k))


def orthonormal_columns(initial: Basis, seed: int) -> nn.Module:
    """Return a module whose ``.weight`` is `initial` ``[d, k]`` (orthonormal columns), trainable
    and kept orthonormal by `torch.nn.utils.parametrizations.orthogonal`; the random completion
    the parametrisation draws is seeded with `seed` (the global generator is left as it was)."""
    module = orthogonal(_Columns(*initial.shape))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        module.weight = initial.to(torch.float32)
    return module


def _weight(module: nn.Module) -> Tensor:
    """The (parametrised) weight of an `orthonormal_columns` module."""
    weight = module.weight
    assert isinstance(weight, Tensor)
    return weight


class SubspaceIntervention(nn.Module):
    """``x + Q Qᵀ (source − x)`` for flattened activations ``[batch, d]``, Q ``[d, K]`` orthonormal.

    `trainable=False` keeps Q fixed as given (the random control, a learned basis evaluated)."""

    fixed: Tensor

    def __init__(self, initial: Basis, seed: int = 0, trainable: bool = True):
        super().__init__()
        if trainable:
            self.columns = orthonormal_columns(initial, seed)
        else:
            self.register_buffer("fixed", initial.detach().clone().float())

    @property
    def basis(self) -> Tensor:
        """Q ``[d, K]``."""
        return _weight(self.columns) if hasattr(self, "columns") else self.fixed

    def forward(self, base: Flat, source: Flat) -> Flat:
        """Return the intervened activations ``[batch, d]`` of `base` ``[batch, d]`` with `source` ``[batch, d]``."""
        q = self.basis.to(base.dtype)
        return base + ((source - base) @ q) @ q.T


class BoundlessIntervention(nn.Module):
    """Boundless DAS: a full rotation R ``[d, d]`` and a learned boundary b (a fraction of d,
    starting at ½); rotated coordinates are exchanged with the soft mask of `mask`, at the
    temperature set by `set_temperature`."""

    temperature: Tensor
    coordinate: Tensor

    def __init__(self, initial: Basis, seed: int = 0):
        super().__init__()
        d = initial.shape[0]
        if initial.shape != (d, d):
            raise UsageError(f"boundless DAS needs a full rotation [d, d], got {list(initial.shape)}")
        if d > MAX_ROTATION:
            raise UsageError(
                f"boundless DAS learns a full {d} x {d} rotation, wider than {MAX_ROTATION}; "
                "learn low-rank bases of given dimensions instead (--dim)"
            )
        self.columns = orthonormal_columns(initial, seed)
        self.boundary = nn.Parameter(torch.tensor(0.5))
        self.register_buffer("temperature", torch.tensor(1.0))
        self.register_buffer("coordinate", torch.arange(d, dtype=torch.float32))

    @property
    def rotation(self) -> Tensor:
        """R ``[d, d]``."""
        return _weight(self.columns)

    def set_temperature(self, temperature: float) -> None:
        """Set the mask's temperature T (annealed during training); return None."""
        self.temperature.fill_(temperature)

    def clamped_boundary(self) -> Tensor:
        """b clamped to ``[1/d, 1]`` (at least one coordinate is exchanged), a 0-d tensor."""
        return self.boundary.clamp(1.0 / len(self.coordinate), 1.0)

    def mask(self) -> Tensor:
        """The soft mask ``[d]``: m_i = sigmoid((b·d − i − ½) / T)."""
        edge = self.clamped_boundary() * len(self.coordinate)
        return torch.sigmoid((edge - self.coordinate - 0.5) / self.temperature)

    def learned_dim(self) -> int:
        """Return the number of coordinates the mask exchanges at T → 0, round(b·d) (at least 1)."""
        return int((self.mask().detach() > 0.5).sum().clamp(min=1))

    def learned_basis(self) -> Basis:
        """Return the first `learned_dim` columns of R ``[d, k]``: the subspace exchanged at T → 0."""
        return self.rotation.detach()[:, : self.learned_dim()].clone()

    def forward(self, base: Flat, source: Flat) -> Flat:
        """Return ``R (mask ⊙ Rᵀ(source − base)) + base`` ``[batch, d]`` of `base`, `source` ``[batch, d]``."""
        rotation = self.rotation.to(base.dtype)
        return base + (((source - base) @ rotation) * self.mask().to(base.dtype)) @ rotation.T
