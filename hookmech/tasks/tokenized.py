"""What the tasks made of a tokenizer's tokens share (induction, nl-ar, prompts): the tokenizer
option and its record in the spec, the vocabulary, token names, and texts made into rows.

Their token ids are the tokenizer's own (``0 .. vocab_size - 1``, no specials added on top),
so a model runs them when its ``d_vocab`` covers the tokenizer's (a pretrained model's does;
`hookmech.tasks.check_vocabulary`). Rows are right-padded with the tokenizer's declared pad
token, else id 0 (padding follows a row's length and is never read).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import HookmechError, UsageError
from .base import Task
from .batch import Batch
from .tokenizer import Encoded, Span, TextTokenizer, load_tokenizer, resolve_bos, span_tokens


class TokenizerTask(Task):
    """A task whose tokens are those of the tokenizer at `tokenizer` (a tokenizer.json, or a
    folder holding it or vocab.json + merges.txt). `tokenizer_sha256`, where given (a spec's
    record), must be the files' identity. `bos`: prepend no BOS (False), the tokenizer's
    declared one (True) or the token named."""

    def __init__(self, tokenizer: str | None, tokenizer_sha256: str | None, bos: bool | str):
        if tokenizer is None:
            raise UsageError(
                f"{self.name}: needs a tokenizer: tokenizer=PATH (a tokenizer.json, or a folder holding one; "
                "a Hugging Face --ckpt folder gives its own)"
            )
        self.text_tokenizer: TextTokenizer = load_tokenizer(tokenizer, tokenizer_sha256)
        self.bos, self.bos_id = resolve_bos(self.text_tokenizer, bos, self.name)
        pad = self.text_tokenizer.declared.get("pad_token")
        pad_id = None if pad is None else self.text_tokenizer.token_id(pad)
        self.pad_id = 0 if pad_id is None else pad_id

    def tokenizer_spec(self) -> dict[str, Any]:
        """Return the spec entries of the tokenizer: its resolved path, its files' sha256, the BOS."""
        spec: dict[str, Any] = {
            "tokenizer": str(self.text_tokenizer.path),
            "tokenizer_sha256": self.text_tokenizer.sha256,
        }
        if self.bos is not None:
            spec["bos"] = self.bos
        return spec

    @property
    def d_vocab(self) -> int:
        return self.text_tokenizer.vocab_size

    def token_names(self, d_vocab: int) -> list[str]:
        return self.text_tokenizer.names(d_vocab)

    def describe_tokens(self, tokens: list[int]) -> str:
        """Return the text of `tokens` (special tokens written out)."""
        return self.text_tokenizer.decode(tokens)

    @property
    def prefix(self) -> list[int]:
        """The ids every row starts with before its text's tokens: the BOS, if any."""
        return [] if self.bos_id is None else [self.bos_id]


def text_rows(
    task: TokenizerTask,
    clean: Sequence[str],
    corrupt: Sequence[str],
    answers: Sequence[int],
    spans: Mapping[str, Sequence[Span | None]],
    where: Callable[[int], str],
    single_token: frozenset[str] = frozenset(),
) -> Batch:
    """Return the Batch of texts: row i is `task.prefix` then the tokens of ``clean[i]`` (its
    corrupted twin: of ``corrupt[i]``, which must tokenize to as many tokens), answer
    ``answers[i]`` and, per role, the position of the *last* token of the character span
    ``spans[role][i]`` of ``clean[i]`` (None: the row's last token; roles in `single_token`
    must be one token). Errors name the row by ``where(i)`` (a line, a document)."""
    tokenizer, offset = task.text_tokenizer, len(task.prefix)
    clean_rows, corrupt_rows = tokenizer.encode(clean), tokenizer.encode(corrupt)
    positions = {role: np.empty(len(clean), dtype=np.int64) for role in spans}
    for i, (encoded, twin) in enumerate(zip(clean_rows, corrupt_rows, strict=True)):
        if not encoded.ids:
            raise HookmechError(f"{where(i)}: the clean text has no tokens")
        if len(twin.ids) != len(encoded.ids):
            raise HookmechError(
                f"{where(i)}: clean and corrupt texts tokenize to {len(encoded.ids)} and {len(twin.ids)} "
                "tokens; they must have the same length (position p of one is position p of the other)"
            )
        for role, role_spans in spans.items():
            span = role_spans[i]
            last = len(encoded.ids) - 1 if span is None else _role_token(encoded, role, span, role in single_token)
            if isinstance(last, str):
                raise HookmechError(f"{where(i)}: {last}")
            positions[role][i] = offset + last
    lengths = np.array([offset + len(encoded.ids) for encoded in clean_rows], dtype=np.int64)
    tokens = _padded(task, [encoded.ids for encoded in clean_rows], int(lengths.max()))
    corrupt_tokens = _padded(task, [encoded.ids for encoded in corrupt_rows], int(lengths.max()))
    return Batch(
        tokens=tokens,
        corrupt_tokens=corrupt_tokens,
        answers=torch.tensor(list(answers), dtype=torch.int64),
        lengths=torch.from_numpy(lengths),
        doc_index=torch.arange(len(clean), dtype=torch.int64),
        roles={role: torch.from_numpy(found) for role, found in positions.items()},
    )


def _role_token(encoded: Encoded, role: str, span: Span, single: bool) -> int | str:
    """Return the index of the last token of `span` in `encoded`, or the reason it has none."""
    start, end = span
    covered = span_tokens(encoded, span)
    if covered is None:
        if not 0 <= start < end <= len(encoded.text):
            return f"role {role!r} span [{start}, {end}) is not a span of the text ({len(encoded.text)} characters)"
        return (
            f"role {role!r} span [{start}, {end}) ({encoded.text[start:end]!r}) is not token-aligned: it starts or "
            f"ends inside a token (tokens there: {_tokens_near(encoded, start, end)})"
        )
    first, last = covered
    if single and first != last:
        return f"role {role!r}: {encoded.text[start:end]!r} is {last - first + 1} tokens in context, one expected"
    return last


def _tokens_near(encoded: Encoded, start: int, end: int) -> str:
    """The tokens overlapping ``[start - 1, end + 1)``, as their texts, for an error message."""
    near = [encoded.text[a:b] for a, b in encoded.offsets if b > start - 1 and a < end + 1]
    return " | ".join(repr(text) for text in near) or "none"


def _padded(task: TokenizerTask, rows: list[list[int]], width: int) -> torch.Tensor:
    """Return ``[len(rows), width]`` int64: the task's prefix and each row, right-padded with its pad id."""
    out = np.full((len(rows), width), task.pad_id, dtype=np.int64)
    prefix = task.prefix
    for i, ids in enumerate(rows):
        out[i, : len(prefix)] = prefix
        out[i, len(prefix) : len(prefix) + len(ids)] = ids
    return torch.from_numpy(out)
