"""`train`: distributed alignment search at one (site, position) of a model, from its activation cache.

For each dimension K: a seeded random orthonormal basis Q ``[d, K]`` (`basis.random_basis`) is
trained with Adam to minimise the cross-entropy of the clean answer at the query when the corrupt
run's activation x at (site, position) becomes ``x + Q Qᵀ (x_clean − x)`` (`basis.SubspaceIntervention`);
then Q, a random orthonormal basis of the same K (the control) and the whole activation (vanilla
interchange, Q Qᵀ = I) are evaluated on the dev rows. With `boundless`, one full rotation and a
soft boundary are trained instead (`basis.BoundlessIntervention`, the boundary's mask annealed
from `temperature[0]` to `temperature[1]`, the boundary penalised by `boundary_penalty` · b as
pyvene's Boundless DAS tutorial does), and the learned subspace — the rotation's first
`learned_dim` columns — is evaluated like a basis of that dimension.

Scores on the dev rows: interchange-intervention accuracy (IIA: the argmax at the query is the
clean answer) and the attribution of mean p(answer), (p_patched − p_corrupt) / (p_clean −
p_corrupt), with p_clean and p_corrupt the cache's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..cache import CacheFile, answer_probs
from ..errors import UsageError
from ..identity import model_hash
from ..patching.protocol import PatchableModel, check_patchable
from ..patching.runs import evaluating
from ..patching.targets import parse_sites
from ..row_chunks import MEMORY_MIB
from .basis import BoundlessIntervention, SubspaceIntervention, derived_seed, random_basis
from .data import DasData
from .patched import Intervene, SubspacePatch, patched_logits
from .records import DasResult, Scores, das_record
from .training_options import DasOptions

#: random streams of one seed (`basis.derived_seed(seed, K, stream)`)
_INITIAL, _COMPLETION, _CONTROL = 0, 1, 2
#: the training losses averaged into a record's ``loss``: the last this many steps
LOSS_WINDOW = 20


def train(
    model: PatchableModel,
    cache: CacheFile | str | Path,
    site: str,
    pos: str,
    dims: int | Iterable[int] | None = None,
    *,
    boundless: bool = False,
    steps: int = 200,
    lr: float = 1e-2,
    batch_size: int = 64,
    seed: int = 0,
    dev_frac: float = 0.2,
    chunk_rows: int | None = None,
    memory: float = MEMORY_MIB,
    temperature: tuple[float, float] = (50.0, 0.1),
    boundary_lr: float | None = None,
    boundary_penalty: float = 1.0,
    progress: Callable[[int], None] | None = None,
) -> DasResult:
    """Run distributed alignment search at `site` (one site, or hook name, with a position axis:
    block-level or inside a mixer) and `pos` (a role or an integer) of `model`, on the rows of the
    activation `cache` (a path or an open `CacheFile` made from this model, holding the site's
    clean activations), and return a `DasResult`: one record per dimension (`records.das_record`)
    and the bases ``{"dim{K}": [d, K]}`` learned, with their random controls ``{"random_dim{K}"}``
    (and, with `boundless`, the learned rotation ``"rotation"`` ``[d, d]``).

    Exactly one of `dims` (dimensions K, 1 <= K <= d, the flattened activation's width) and
    `boundless` is given. `steps` Adam steps of `batch_size` training rows at learning rate `lr`
    (constant) per K; rows are split into train and dev by document (`dev_frac` of the documents
    for dev) and everything random (split, initial bases, data order, controls) is fixed by
    `seed`. The cache is read `chunk_rows` rows at a time (None: `data.ORDER_ROWS`, or as many as
    fit in `memory` MiB where fewer do, `DasData`); the minibatches are drawn chunk by chunk, so
    the data order, and so the bases, depend on the chunk's rows (not on `memory` while it holds
    `ORDER_ROWS` rows). Boundless DAS anneals the
    mask's temperature linearly over `temperature` (start, end), trains the boundary at
    `boundary_lr` (None: 10 × `lr`) and adds `boundary_penalty` × b to the loss. The model's
    parameters are not trained (nor left changed); it runs in eval mode. `progress(1)` is
    called after each training step.

    It computes on one CPU thread (`one_cpu_thread`; torch's setting is restored after), so that
    the same seed gives the same bases and records at any thread count: the backward pass of the
    orthogonal parametrisation sums in an order that depends on the thread count, and training
    amplifies that last-bit difference (×1.15 per step: at K = 1 on the attention fixture, 3e-8 in
    the basis after one step, 0.2 after 200, attribution 0.089 vs 0.142 with 1 or 2 threads).
    """
    options = DasOptions(steps, lr, batch_size, seed, dev_frac, temperature, boundary_lr, boundary_penalty)
    dimensions = _dimensions(dims, boundless)
    check_patchable(model)
    hook = _one_site(model, site)
    with one_cpu_thread(), _open(cache) as cache_file, evaluating(model), _frozen(model):
        data = DasData(model, cache_file, hook, pos, dev_frac=dev_frac, seed=seed, chunk_rows=chunk_rows, memory=memory)
        for k in dimensions:
            if not 1 <= k <= data.d:
                raise UsageError(f"--dim {k}: {site} is {data.d}-dimensional at a position, so 1 <= K <= {data.d}")
        patch = SubspacePatch(data.route.pos_axis)
        with model.hooks(fwd_hooks=[(data.route.hook, patch)]):
            full = _evaluate(model, data, patch, lambda base, source: source)
            if boundless:
                found = [_train_boundless(model, data, patch, options, progress)]
            else:
                found = [_train_subspace(model, data, patch, options, k, progress) for k in dimensions]
            records, bases = _score(model, data, patch, options, found, full, (site, hook, pos), boundless)
        metadata = {
            "site": site,
            "hook": hook,
            "pos": pos,
            "model_hash": model_hash(model),
            "d": str(data.d),
            "activation_shape": str(list(data.activation_shape)),
        }
        dev_rows = torch.nonzero(data.dev).flatten()
    return DasResult(records, bases, metadata, dev_rows)


def _score(model, data: DasData, patch, options: DasOptions, found, full, where, boundless: bool):
    """Return (records, bases): each learned basis of `found` scored on the dev rows beside a
    random basis of the same K (its control) and the whole activation's interchange `full`;
    `where` is (site, hook, pos)."""
    site, hook, pos = where
    records, bases = [], {}
    for basis, loss, extra in found:
        k = basis.shape[1]
        control = random_basis(data.d, k, derived_seed(options.seed, k, _CONTROL))
        learned = _evaluate(model, data, patch, SubspaceIntervention(basis, trainable=False))
        random = _evaluate(model, data, patch, SubspaceIntervention(control, trainable=False))
        records.append(das_record(site, hook, pos, data, options, k, learned, random, full, loss, boundless, extra))
        bases[f"dim{k}"], bases[f"random_dim{k}"] = basis, control
        if "rotation" in extra:
            bases["rotation"] = extra.pop("rotation")
    return records, bases


def _dimensions(dims: int | Iterable[int] | None, boundless: bool) -> list[int]:
    """The dimensions asked for, in order, each once; a UsageError unless exactly one of `dims`
    and `boundless` is given."""
    if boundless:
        if dims is not None:
            raise UsageError("give dimensions (--dim) or --boundless, not both")
        return []
    if dims is None:
        raise UsageError("give the subspace dimensions to learn (--dim K[,K...]) or --boundless")
    dimensions = list(dict.fromkeys([dims] if isinstance(dims, int) else dims))
    if not dimensions:
        raise UsageError("no dimension given (--dim K[,K...])")
    for k in dimensions:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UsageError(f"a subspace dimension must be an integer >= 1, got {k!r}")
    return dimensions


def _one_site(model: PatchableModel, site: str) -> str:
    """The hook of `site`: one site (or hook name) with a position axis, no pattern, head or joint."""
    if any(mark in site for mark in "[+"):
        raise UsageError(f"DAS takes one plain site, not {site!r} (no heads [h], no joint sites a+b)")
    patch_sites = parse_sites([site], model)
    if len(patch_sites) != 1:
        raise UsageError(f"site {site!r} names {len(patch_sites)} sites; DAS learns a subspace of one site at a time")
    return patch_sites[0].targets[0].hook


@contextmanager
def _open(cache: CacheFile | str | Path) -> Iterator[CacheFile]:
    if isinstance(cache, CacheFile):
        yield cache
    else:
        with CacheFile(cache) as opened:
            yield opened


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Within the block torch computes on one CPU thread; its thread count is restored after.
    (Reductions split over threads round in another order: a trained result would depend on the
    thread count, `train`.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _frozen(model: PatchableModel) -> Iterator[None]:
    """Within the block no parameter of `model` requires a gradient (only the basis is trained)."""
    parameters = list(model.parameters())
    wanted = [parameter.requires_grad for parameter in parameters]
    for parameter in parameters:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter, flag in zip(parameters, wanted, strict=True):
            parameter.requires_grad_(flag)


def _loss(model: PatchableModel, data: DasData, patch: SubspacePatch, batch, intervention: nn.Module) -> Tensor:
    chunk, index = batch
    logits = patched_logits(model, data.route, chunk, index, patch, intervention)
    return F.cross_entropy(logits.float(), chunk.answers[index])


def _train_subspace(
    model: PatchableModel,
    data: DasData,
    patch: SubspacePatch,
    options: DasOptions,
    k: int,
    progress: Callable[[int], None] | None,
) -> tuple[Tensor, float, dict]:
    """Train a basis of dimension `k`; return (basis ``[d, k]``, mean loss of the last steps, {})."""
    initial = random_basis(data.d, k, derived_seed(options.seed, k, _INITIAL))
    intervention = SubspaceIntervention(initial, seed=derived_seed(options.seed, k, _COMPLETION)).to(data.device)
    optimizer = torch.optim.Adam(intervention.parameters(), lr=options.lr)
    losses = []
    batches = data.train_batches(options.batch_size, options.seed)
    for _ in range(options.steps):
        loss = _loss(model, data, patch, next(batches), intervention)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if progress is not None:
            progress(1)
    return intervention.basis.detach().cpu().clone(), _mean_tail(losses), {}


def _train_boundless(
    model: PatchableModel,
    data: DasData,
    patch: SubspacePatch,
    options: DasOptions,
    progress: Callable[[int], None] | None,
) -> tuple[Tensor, float, dict]:
    """Train a rotation and boundary; return (learned basis ``[d, k]``, mean loss of the last
    steps, {"boundary": b, "rotation": R ``[d, d]``})."""
    d = data.d
    initial = random_basis(d, d, derived_seed(options.seed, d, _INITIAL))
    intervention = BoundlessIntervention(initial, seed=derived_seed(options.seed, d, _COMPLETION)).to(data.device)
    boundary_lr = 10 * options.lr if options.boundary_lr is None else options.boundary_lr
    optimizer = torch.optim.Adam(
        [
            {"params": list(intervention.columns.parameters()), "lr": options.lr},
            {"params": [intervention.boundary], "lr": boundary_lr},
        ]
    )
    start, end = options.temperature
    schedule = torch.linspace(start, end, options.steps).tolist()
    losses = []
    batches = data.train_batches(options.batch_size, options.seed)
    for temperature in schedule:
        intervention.set_temperature(temperature)
        loss = _loss(model, data, patch, next(batches), intervention)
        total = loss + options.boundary_penalty * intervention.clamped_boundary()
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        losses.append(loss.item())
        if progress is not None:
            progress(1)
    extra = {
        "boundary": float(intervention.clamped_boundary().detach()),
        "rotation": intervention.rotation.detach().cpu().clone(),
    }
    return intervention.learned_basis().cpu(), _mean_tail(losses), extra


def _mean_tail(losses: Sequence[float]) -> float:
    tail = losses[-LOSS_WINDOW:]
    return sum(tail) / len(tail)


@torch.no_grad()
def _evaluate(model: PatchableModel, data: DasData, patch: SubspacePatch, intervene: Intervene) -> Scores:
    """Return the `Scores` of `intervene` on the dev rows (in chunks, `data.chunk_rows` rows per forward)."""
    if isinstance(intervene, nn.Module):
        intervene = intervene.to(data.device)
    hits, p_patched, p_clean, p_corrupt, n = 0, 0.0, 0.0, 0.0, 0
    for chunk in data.chunks(data.dev):
        index = torch.arange(len(chunk), device=data.device)
        logits = patched_logits(model, data.route, chunk, index, patch, intervene)
        hits += int((logits.argmax(dim=-1) == chunk.answers).sum())
        p_patched += float(answer_probs(logits, chunk.answers).double().sum())
        p_clean += float(chunk.p_clean.sum())
        p_corrupt += float(chunk.p_corrupt.sum())
        n += len(chunk)
    return Scores(hits / n, p_patched / n, p_clean / n, p_corrupt / n, n)
