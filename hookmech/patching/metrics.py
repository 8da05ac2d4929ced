"""What is read at the query, and the attribution score: ONE vocabulary for exact patching and AtP.

Metrics m (per row, of the logits at the query position):

    p_answer    p(answer)                                 (the default)
    log_p       log p(answer)
    logit_diff  logit(answer) − logit(corrupt answer)     (see `corrupt_answers`)
    kl          KL(clean distribution ‖ run's distribution), so m_clean = 0

With means m over the N rows, the attribution of a patch is

    denoise:  (m_patched − m_corrupt) / (m_clean − m_corrupt)
    noise:    (m_clean − m_patched) / (m_clean − m_corrupt)

so that 1 means "this site at this position carries the whole clean-vs-corrupt difference"
in both directions (for kl, denoising: (KL_corrupt − KL_patched) / KL_corrupt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import UsageError, unknown
from ..shapes import RowFloats, RowInts
from ..tasks.batch import Batch

METRICS = ("p_answer", "log_p", "logit_diff", "kl")


def attribution_score(m_clean: float, m_corrupt: float, m_patched: float, direction: str = "denoise") -> float | None:
    """Return the attribution of a patch from the three metric means, or None when
    m_clean == m_corrupt. Denoise: (m_patched − m_corrupt) / (m_clean − m_corrupt);
    noise: (m_clean − m_patched) / (m_clean − m_corrupt)."""
    denominator = m_clean - m_corrupt
    if denominator == 0:
        return None
    if direction == "noise":
        return (m_clean - m_patched) / denominator
    return (m_patched - m_corrupt) / denominator


def corrupt_answers(batch: Batch, corrupt_logits: Tensor) -> Tensor:
    """Return the "corrupted answer" of each row, ``[N]``: the answer of the corrupt document.

    Where the corrupt document changed the `value` role's token (value corruption), that is
    its new value there. Where the corrupt document has no answer (key corruption: the
    queried key no longer occurs), it is the corrupt run's most likely token other than the
    clean answer (`corrupt_logits` ``[N, d_vocab]`` at the query).
    """
    answers = batch.answers.to(corrupt_logits.device)
    others = corrupt_logits.clone()
    others[torch.arange(len(answers), device=others.device), answers] = float("-inf")
    fallback = others.argmax(dim=-1)
    if "value" not in batch.roles:
        return fallback
    rows = torch.arange(len(batch))
    value_pos = batch.roles["value"]
    clean_value, corrupt_value = batch.tokens[rows, value_pos], batch.corrupt_tokens[rows, value_pos]
    changed = (clean_value != corrupt_value).to(fallback.device)
    return torch.where(changed, corrupt_value.to(fallback.device), fallback)


@dataclass(frozen=True)
class Metric:
    """A per-row metric of query logits: `name` in METRICS, with what it needs, per row:
    `corrupt_answers` ``[N]`` for logit_diff, `clean_log_probs` ``[N, d_vocab]`` for kl."""

    name: str
    answers: Tensor  # [N]
    corrupt_answers: Tensor | None = None  # [N], logit_diff
    clean_log_probs: Tensor | None = None  # [N, d_vocab], kl

    def __post_init__(self) -> None:
        if self.name not in METRICS:
            raise unknown("metric", self.name, METRICS)
        if self.name == "logit_diff" and self.corrupt_answers is None:
            raise UsageError("metric 'logit_diff' needs the corrupted answer of each row (corrupt_answers)")
        if self.name == "kl" and self.clean_log_probs is None:
            raise UsageError("metric 'kl' needs the clean run's log-probabilities of each row (clean_log_probs)")

    @property
    def lower_is_better(self) -> bool:
        return self.name == "kl"

    def values(self, logits: Tensor, rows: Tensor | None = None) -> Tensor:
        """Return the metric ``[n]`` of query logits ``[n, d_vocab]`` of `rows` (``[n]`` indices of
        this metric's rows; None: all of them, in order), differentiable, on the logits' device,
        in float32 or better (a float64 model keeps its precision)."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))

        def per_row(values: Tensor) -> Tensor:
            return (values if rows is None else values[rows]).to(logits.device)

        answers = per_row(self.answers)[:, None]
        if self.name == "p_answer":
            return logits.softmax(-1).gather(-1, answers).squeeze(-1)
        if self.name == "log_p":
            return logits.log_softmax(-1).gather(-1, answers).squeeze(-1)
        if self.name == "logit_diff":
            assert self.corrupt_answers is not None  # __post_init__ refuses a logit_diff without them
            other = per_row(self.corrupt_answers)[:, None]
            return (logits.gather(-1, answers) - logits.gather(-1, other)).squeeze(-1)
        assert self.clean_log_probs is not None  # kl: likewise
        reference = per_row(self.clean_log_probs)
        return (reference.exp() * (reference - logits.log_softmax(-1))).sum(-1)

    def rows(self, logits: Tensor, rows: Tensor) -> Tensor:
        """Return the metric ``[len(rows)]`` (float64, on the CPU) of the query logits
        ``[len(rows), d_vocab]`` of `rows`."""
        return self.values(logits, rows).detach().double().cpu()


def make_metric(name: str, batch: Batch, logits: dict[str, Tensor]) -> Metric:
    """Return the `Metric` `name` of `batch`, given the unpatched runs' query logits
    (``{"clean": [N, d_vocab], "corrupt": [N, d_vocab]}``; p_answer and log_p need none)."""
    if name == "logit_diff":
        return Metric(name, batch.answers, corrupt_answers=corrupt_answers(batch, logits["corrupt"]).cpu())
    if name == "kl":
        return Metric(name, batch.answers, clean_log_probs=logits["clean"].log_softmax(-1))
    return Metric(name, batch.answers)


def answer_log_odds(logits: Tensor, answers: RowInts) -> RowFloats:
    """Return the log-odds of the answer ``[n]``, log p − log(1 − p) = logit(answer) − logsumexp of
    the other logits, of query logits ``[n, d_vocab]`` (float32 or better, differentiable)."""
    log_p = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    index = answers.to(logits.device)[:, None]
    answer = log_p.gather(-1, index)[:, 0]
    others = log_p.scatter(-1, index, float("-inf")).logsumexp(-1)
    return answer - others
