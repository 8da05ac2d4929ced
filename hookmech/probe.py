"""Linear probes on cached activations: a second, non-causal view of where information sits.

A probe is multinomial logistic regression from one site's activation at one position
(``L1.block_in`` at ``value``) to a token of the row (the queried ``key``, its ``value``, or the
``answer``). It is fitted on some documents and scored on the others (rows of one multi-query
document share `doc_index` and so never straddle the split). High held-out accuracy says the
token is *linearly decodable* there; it does not say the model uses it (patching does).

Everything is read from the cache (`hookmech.cache.CacheFile`); no model is loaded.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from .cache import CacheFile
from .errors import UsageError, unknown
from .row_chunks import MEMORY_MIB, check_memory, chunk_rows, row_chunks
from .sites import hook_to_site, row_positions
from .splits import split_by_document
from .validate import check_seed

TARGETS = ("key", "value", "answer")
#: the most rows `fit_probe` reads at once: a larger chunk reads and sums no faster (the fit makes
#: a pass over the chunks per L-BFGS evaluation either way), it only holds more
PROBE_CHUNK_ROWS = 4096
WHICH = ("clean", "corrupt")


@dataclass(frozen=True)
class ProbeResult:
    """A fitted probe's scores: accuracies in [0, 1]; `chance` is the held-out accuracy of always
    predicting the most frequent training token; `n_classes` the distinct training tokens."""

    site: str
    hook: str
    pos: str
    target: str
    which: str
    heldout_accuracy: float
    train_accuracy: float
    chance: float
    n_classes: int
    n_train: int
    n_heldout: int
    d_features: int

    def to_dict(self) -> dict:
        return asdict(self)


def probe_data(
    cache: CacheFile, site: str, pos: str, target: str, which: str = "clean"
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(features [N, D] float32, labels [N] int64, doc_index [N])``: each row's activation of `site`
    at `pos` (a role, or an integer: ``p`` or ``-k`` from the row's end), flattened, and the
    target token of the `which` run's document (``key`` / ``value``: the token at that role;
    ``answer``: the clean answer)."""
    if target not in TARGETS:
        raise unknown("probe target", target, TARGETS)
    if which not in WHICH:
        raise unknown("run", which, WHICH)
    if not isinstance(pos, str):
        raise UsageError(f"position {pos!r} is a {type(pos).__name__}, not a string: give a role or an integer as text")
    batch = cache.batch()
    if pos.strip() in ("all", "whole") or "+" in pos:
        raise UsageError(
            f"a probe reads one position per row, not {pos.strip()!r}: give a role "
            f"({', '.join(batch.roles)}) or an integer (-1: each row's last token)"
        )
    positions = row_positions(pos.strip(), batch.roles, batch.lengths)
    features = cache.gather(site, positions.numpy(), which).float().flatten(1)
    if target == "answer":
        labels = batch.answers
    else:
        tokens = batch.tokens if which == "clean" else batch.corrupt_tokens
        labels = tokens[torch.arange(len(batch)), batch.role(target)]
    return features, labels, batch.doc_index


def fit_logistic(
    features: Tensor, labels: Tensor, n_classes: int, weight_decay: float, max_iter: int
) -> tuple[Tensor, Tensor]:
    """Fit multinomial logistic regression (cross-entropy + ``weight_decay/2 · ||W||²``) with
    full-batch L-BFGS from zero weights, deterministic. `features` ``[n, D]``, `labels` ``[n]``
    in ``0..n_classes-1``. Returns ``(W [D, n_classes], b [n_classes])``."""
    return _fit_logistic_chunks([(features, labels)], int(features.shape[1]), n_classes, weight_decay, max_iter)


def _fit_logistic_chunks(
    chunks: Iterable[tuple[Tensor, Tensor]] | Callable[[], Iterator[tuple[Tensor, Tensor]]],
    d_features: int,
    n_classes: int,
    weight_decay: float,
    max_iter: int,
) -> tuple[Tensor, Tensor]:
    """`fit_logistic` on training rows given in chunks of ``(features [n_c, D], labels [n_c])``
    (a re-iterable, or a function returning a fresh iterator): the loss and its gradient are the
    full batch's, summed chunk by chunk (the same L-BFGS steps up to float64 round-off), so only
    one chunk is in memory at a time. Returns ``(W [D, n_classes], b [n_classes])``."""
    read = chunks if callable(chunks) else lambda: iter(chunks)
    n_rows = sum(len(labels) for _, labels in read())
    weight = torch.zeros(d_features, n_classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [weight, bias],
        lr=1,
        max_iter=max_iter,
        history_size=20,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
    )

    def closure() -> Tensor:
        optimizer.zero_grad()
        penalty = 0.5 * weight_decay * weight.pow(2).sum()
        penalty.backward()
        total = penalty.detach()
        for features, labels in read():  # each chunk's backward adds its share of the gradient
            loss = F.cross_entropy(features.double() @ weight + bias, labels, reduction="sum") / n_rows
            loss.backward()
            total = total + loss.detach()
        return total

    with torch.enable_grad():
        optimizer.step(closure)
    return weight.detach(), bias.detach()


class _RowStore:
    """Float32 rows ``[n, D]`` appended in chunks and read back in the same chunks: held in memory
    while they fit in `budget` bytes, else written to a temporary file (deleted on `close`) and
    read from it a chunk at a time."""

    def __init__(self, budget: int):
        self.budget, self.held = budget, 0
        self.sizes: list[int] = []
        self.chunks: list[Tensor] = []
        self.file: BinaryIO | None = None
        self.width = 0

    def append(self, rows: Tensor) -> None:
        rows = rows.float().contiguous()
        self.width, self.held = int(rows.shape[1]), self.held + rows.numel() * 4
        self.sizes.append(len(rows))
        if self.file is None and self.held > self.budget:
            self.file = tempfile.TemporaryFile(prefix="hookmech-probe-")  # noqa: SIM115 - closed by close()
            for held in self.chunks:
                self.file.write(held.numpy().tobytes())
            self.chunks = []
        if self.file is None:
            self.chunks.append(rows)
        else:
            self.file.write(rows.numpy().tobytes())

    def __iter__(self) -> Iterator[Tensor]:
        if self.file is None:
            yield from self.chunks
            return
        self.file.seek(0)
        for size in self.sizes:
            data = np.frombuffer(self.file.read(size * self.width * 4), dtype=np.float32)
            yield torch.from_numpy(data.copy()).view(size, self.width)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def probe_chunk_rows(cache: CacheFile, hook: str, which: str = "clean", memory: float = MEMORY_MIB) -> int:
    """Return the rows `fit_probe` reads at once from `cache` at `hook` (of the `which` run):
    `PROBE_CHUNK_ROWS`, or fewer where they do not fit in `memory` MiB. Per row: the gathered
    activation (as stored, then float32 and float64 copies and the standardised float64
    features) and the float64 logits with their gradient."""
    dataset = cache[hook, which]
    d_features = math.prod(dataset.shape[2:])
    d_vocab = cache.model_config.get("d_vocab")
    n_classes = d_vocab if isinstance(d_vocab, int) and d_vocab > 0 else d_features
    per_row = d_features * (dataset.dtype.itemsize + 4 + 8 + 8) + 3 * 8 * n_classes
    return chunk_rows(per_row, memory, at_most=PROBE_CHUNK_ROWS)


def fit_probe(
    cache: CacheFile,
    site: str,
    pos: str,
    target: str = "key",
    which: str = "clean",
    heldout_frac: float = 0.25,
    seed: int = 0,
    weight_decay: float = 1e-3,
    max_iter: int = 100,
    memory: float = MEMORY_MIB,
    chunk: int | None = None,
) -> ProbeResult:
    """Fit a linear probe decoding `target` (``key``, ``value``, ``answer``) from `site`'s cached
    activation at `pos` (a role or integer position) of the `which` run; return its
    `ProbeResult` (held-out accuracy on the documents `split_by_document` holds out, and chance).

    Features are standardised with the training rows' mean and standard deviation. A held-out
    token never seen in training counts as a miss. `weight_decay` must be a finite number >= 0,
    `max_iter` >= 1 and `seed` in 0..2**64-1 (else a UsageError); non-finite activations are
    refused as the cache reads them.

    Memory: the cache is read `chunk` rows at a time (None: as many as fit in `memory` MiB,
    `probe_chunk_rows`); the features at the position are kept in memory while they fit in
    `memory` MiB, else in a temporary file, and the full-batch L-BFGS sums its loss and gradient
    over the chunks (`_fit_logistic_chunks`). Per-row integers (labels, documents) are held for
    all N rows. Any chunking gives the same probe up to round-off (the statistics and the
    gradient are summed in another order).
    """
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise UsageError(f"weight decay must be a finite number >= 0, got {weight_decay}")
    if max_iter < 1:
        raise UsageError(f"max_iter must be >= 1, got {max_iter}")
    check_seed(seed)
    hook = cache.hook_of(site, which)
    rows_per_chunk = probe_chunk_rows(cache, hook, which, memory) if chunk is None else chunk
    store = _RowStore(int(check_memory(memory) * 2**20))
    try:
        labels, doc_index = _read_rows(cache, hook, pos, target, which, rows_per_chunk, store)
        train, heldout = split_by_document(doc_index, heldout_frac, seed)
        classes, train_labels = torch.unique(labels[train], return_inverse=True)
        bounds = [(rows.start, rows.stop) for rows in row_chunks(cache.n, rows_per_chunk)]
        mean, std = _train_statistics(store, train, bounds)

        def standardised() -> Iterator[tuple[Tensor, slice]]:
            for features, (start, stop) in zip(store, bounds, strict=True):
                yield (features - mean) / std, slice(start, stop)

        train_offsets = torch.cumsum(train.long(), 0) - 1  # row -> its index among training rows

        def train_chunks() -> Iterator[tuple[Tensor, Tensor]]:
            for features, rows in standardised():
                kept = train[rows]
                if kept.any():
                    yield features[kept], train_labels[train_offsets[rows][kept]]

        weight, bias = _fit_logistic_chunks(train_chunks, store.width, len(classes), weight_decay, max_iter)
        predicted = torch.cat(
            [classes[(features.double() @ weight + bias).argmax(-1)] for features, _ in standardised()]
        )
    finally:
        store.close()
    correct = predicted == labels
    majority = classes[torch.bincount(train_labels).argmax()]
    return ProbeResult(
        site=hook_to_site(hook),
        hook=hook,
        pos=pos,
        target=target,
        which=which,
        heldout_accuracy=correct[heldout].double().mean().item(),
        train_accuracy=correct[train].double().mean().item(),
        chance=(labels[heldout] == majority).double().mean().item(),
        n_classes=len(classes),
        n_train=int(train.sum()),
        n_heldout=int(heldout.sum()),
        d_features=store.width,
    )


def _read_rows(
    cache: CacheFile, hook: str, pos: str, target: str, which: str, rows_per_chunk: int, store
) -> tuple[Tensor, Tensor]:
    """Append each chunk's features at `pos` to `store`; return the labels and document indices
    of all rows (``[N]`` each)."""
    label_parts, doc_parts = [], []
    for rows in row_chunks(cache.n, rows_per_chunk):
        features, labels, doc_index = probe_data(cache.window(rows), hook, pos, target, which)
        store.append(features)
        label_parts.append(labels)
        doc_parts.append(doc_index)
    return torch.cat(label_parts), torch.cat(doc_parts)


def _train_statistics(store: _RowStore, train: Tensor, bounds: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """Return the training rows' feature mean and standard deviation (population; at least
    1e-6), ``[D]`` float32 each: summed in float64 over the chunks (two passes: the mean, then
    the squared deviations from it), rounded to float32 as the features are."""
    n_train = int(train.sum())
    total = torch.zeros(store.width, dtype=torch.float64)
    for features, (start, stop) in zip(store, bounds, strict=True):
        total += features[train[start:stop]].double().sum(0)
    mean = total / n_train
    squares = torch.zeros(store.width, dtype=torch.float64)
    for features, (start, stop) in zip(store, bounds, strict=True):
        squares += (features[train[start:stop]].double() - mean).pow(2).sum(0)
    std = (squares / n_train).sqrt()
    return mean.float(), std.float().clamp_min(1e-6)
