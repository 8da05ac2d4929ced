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
from dataclasses import asdict, dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from .cache import CacheFile
from .errors import UsageError, unknown
from .sites import hook_to_site, row_positions
from .splits import split_by_document
from .validate import check_seed

TARGETS = ("key", "value", "answer")
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
    features = features.double()
    weight = torch.zeros(features.shape[1], n_classes, dtype=torch.float64, requires_grad=True)
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
        loss = F.cross_entropy(features @ weight + bias, labels) + 0.5 * weight_decay * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return weight.detach(), bias.detach()


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
) -> ProbeResult:
    """Fit a linear probe decoding `target` (``key``, ``value``, ``answer``) from `site`'s cached
    activation at `pos` (a role or integer position) of the `which` run; return its
    `ProbeResult` (held-out accuracy on the documents `split_by_document` holds out, and chance).

    Features are standardised with the training rows' mean and standard deviation. A held-out
    token never seen in training counts as a miss. `weight_decay` must be a finite number >= 0,
    `max_iter` >= 1 and `seed` in 0..2**64-1 (else a UsageError); non-finite activations are
    refused as the cache reads them.
    """
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise UsageError(f"weight decay must be a finite number >= 0, got {weight_decay}")
    if max_iter < 1:
        raise UsageError(f"max_iter must be >= 1, got {max_iter}")
    check_seed(seed)
    hook = cache.hook_of(site, which)
    features, labels, doc_index = probe_data(cache, hook, pos, target, which)
    train, heldout = split_by_document(doc_index, heldout_frac, seed)
    classes, train_labels = torch.unique(labels[train], return_inverse=True)
    mean = features[train].mean(0)
    std = features[train].std(0, unbiased=False).clamp_min(1e-6)
    standard = (features - mean) / std
    weight, bias = fit_logistic(standard[train], train_labels, len(classes), weight_decay, max_iter)
    predicted = classes[(standard.double() @ weight + bias).argmax(-1)]
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
        d_features=int(features.shape[1]),
    )
