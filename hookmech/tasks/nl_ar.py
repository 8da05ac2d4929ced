"""Natural-language associative recall: AR written in words a tokenizer holds as single tokens.

     cat door, tree milk, lamp shoe, tree   ->   " milk"

Each pair is `template` with ``{key}`` and ``{value}`` filled in, the pairs are joined by
`separator`, and the document ends with the separator and the template cut before
``{value}`` (trailing spaces dropped): the query, whose next token is the queried key's value.
A document starting with ``{key}`` gets a leading space, so that every word is its
``" word"`` token. Keys and values are single-token words (`TextTokenizer.single_token_words`:
lowercase, at least `min_letters` letters, one token with their leading space), the first
`num_words` of them by id split alternately into keys (even places) and values (odd places),
drawn without replacement per document as AR draws its tokens.

Roles: `key` (the queried key in context), `value` (its value in context), `query` (the last
token: the final key with the default template), `divider` (the token right before the final
key: the separator's ``,`` by default; the separator must hold a character other than space).
The corrupted twin replaces the queried key in context (`corrupt="value"`: its value) by a
key (value) word that occurs nowhere in the document.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..errors import HookmechError, UsageError
from .ar import distinct_draws, rng_for
from .batch import Batch
from .tokenized import TokenizerTask, text_rows
from .tokenizer import Span

_SLOT = re.compile(r"(\{key\}|\{value\})")


class NaturalLanguageAR(TokenizerTask):
    """AR over a tokenizer's single-token words: `num_kv_pairs` pairs as text (module docstring)."""

    name = "nl-ar"
    roles = ("key", "value", "query", "divider")

    def __init__(
        self,
        tokenizer: str | None = None,
        tokenizer_sha256: str | None = None,
        num_kv_pairs: int = 8,
        template: str = "{key} {value}",
        separator: str = ", ",
        num_words: int | None = None,
        min_letters: int = 3,
        corrupt: str = "key",
        bos: bool | str = False,
    ):
        super().__init__(tokenizer, tokenizer_sha256, bos)
        self._check_options(num_kv_pairs, template, separator, num_words, min_letters, corrupt)
        self.num_kv_pairs, self.template, self.separator = num_kv_pairs, template, separator
        self.num_words, self.min_letters, self.corrupt = num_words, min_letters, corrupt
        words = self.text_tokenizer.single_token_words(min_letters)[:num_words]
        self.key_words, self.value_words = words[0::2], words[1::2]
        if len(self.value_words) < num_kv_pairs + 1:
            raise UsageError(
                f"nl-ar: tokenizer {self.text_tokenizer.path} gives {len(words)} single-token words of at least "
                f"{min_letters} letters{'' if num_words is None else f' (num_words {num_words})'}; "
                f"num_kv_pairs {num_kv_pairs} needs {2 * (num_kv_pairs + 1)} (distinct keys and values, plus one "
                "absent key and value for the corruption)"
            )
        pieces = _SLOT.split(template)
        value_at = pieces.index("{value}")
        self._pair_pieces = pieces
        self._query_pieces = [*pieces[: value_at - 1], pieces[value_at - 1].rstrip()]
        self._lead = " " if pieces[0] == "" else ""
        # one document tells the row length (every word is one token) and checks the template
        self._n_ctx = int(self.sample(1, seed=0).lengths[0])

    @staticmethod
    def _check_options(
        pairs: int, template: str, separator: str, num_words: int | None, min_letters: int, corrupt: str
    ) -> None:
        """A UsageError naming the first option out of its range; returns None."""
        if pairs < 1:
            raise UsageError(f"nl-ar: num_kv_pairs must be >= 1, got {pairs}")
        if (
            template.count("{key}") != 1
            or template.count("{value}") != 1
            or template.index("{key}") > template.index("{value}")
        ):
            raise UsageError(f"nl-ar: template must hold {{key}} then {{value}}, once each; got {template!r}")
        if not separator.strip():
            raise UsageError(
                f"nl-ar: separator {separator!r} must hold a character other than space (it gives the divider)"
            )
        if num_words is not None and num_words < 4:
            raise UsageError(f"nl-ar: num_words must be >= 4 (or null: every word), got {num_words}")
        if min_letters < 1:
            raise UsageError(f"nl-ar: min_letters must be >= 1, got {min_letters}")
        if corrupt not in ("key", "value"):
            raise UsageError(f"nl-ar: corrupt must be 'key' or 'value', got {corrupt!r}")

    @property
    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            **self.tokenizer_spec(),
            "num_kv_pairs": self.num_kv_pairs,
            "template": self.template,
            "separator": self.separator,
            "num_words": self.num_words,
            "min_letters": self.min_letters,
            "corrupt": self.corrupt,
        }

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    def sample(self, n: int, seed: int | Sequence[int]) -> Batch:
        """Return `n` rows; deterministic in (spec, n, seed)."""
        if n < 1:
            raise UsageError(f"nl-ar: number of examples must be >= 1, got {n}")
        rng = rng_for(seed)
        pairs = self.num_kv_pairs
        # one word more than the document needs: the spare is absent, the corruption
        keys = distinct_draws(rng, n, pairs + 1, len(self.key_words))
        values = distinct_draws(rng, n, pairs + 1, len(self.value_words))
        queried = rng.integers(0, pairs, size=n)
        clean, corrupt, spans = [], [], []
        for row in range(n):
            key_words = [self.key_words[k][1] for k in keys[row]]
            value_words = [self.value_words[v][1] for v in values[row]]
            text, row_spans = self._document(key_words[:pairs], value_words[:pairs], int(queried[row]))
            clean.append(text)
            spare = key_words[pairs] if self.corrupt == "key" else value_words[pairs]
            start, end = row_spans[self.corrupt]
            corrupt.append(text[:start] + spare + text[end:])
            spans.append(row_spans)
        answers = [self.value_words[values[row, queried[row]]][0] for row in range(n)]
        batch = text_rows(
            self,
            clean,
            corrupt,
            answers,
            {role: [row_spans[role] for row_spans in spans] for role in ("key", "value", "final_key")}
            | {"query": [None] * n},
            lambda row: f"nl-ar document {row} ({clean[row]!r})",
            single_token=frozenset({"key", "value", "final_key"}),
        )
        self._check_answers_in_context(batch, clean)
        roles = dict(batch.roles)
        roles["divider"] = roles.pop("final_key") - 1
        return replace(batch, roles=roles)

    def _document(self, keys: list[str], values: list[str], queried: int) -> tuple[str, dict[str, Span]]:
        """Return a document's text and the character spans of its queried key and value in
        context and of its final key."""
        text, spans = self._lead, {}
        for pair, (key, value) in enumerate(zip(keys, values, strict=True)):
            text += self.separator if pair else ""
            text, found = _fill(text, self._pair_pieces, key, value)
            if pair == queried:
                spans["key"], spans["value"] = found["{key}"], found["{value}"]
        text, found = _fill(text + self.separator, self._query_pieces, keys[queried], None)
        spans["final_key"] = found["{key}"]
        return text, spans

    def _check_answers_in_context(self, batch: Batch, clean: list[str]) -> None:
        """A HookmechError unless the value token in context is the answer (the word's own
        ``" word"`` token): a template whose {value} follows no space gives another token."""
        in_context = batch.tokens[torch.arange(len(batch)), batch.roles["value"]]
        wrong = torch.nonzero(in_context != batch.answers).flatten()
        if len(wrong):
            row = int(wrong[0])
            raise HookmechError(
                f"nl-ar: in document {row} ({clean[row]!r}) the value is token {int(in_context[row])}, not its word's "
                f"token {int(batch.answers[row])} (put a space before {{value}} in the template)"
            )


def _fill(text: str, pieces: list[str], key: str, value: str | None) -> tuple[str, dict[str, Span]]:
    """Return `text` with `pieces` appended (``{key}``/``{value}`` replaced by the words) and the
    character span of each word placed."""
    spans: dict[str, Span] = {}
    for piece in pieces:
        word = {"{key}": key, "{value}": value}.get(piece)
        if word is None:
            text += piece
            continue
        spans[piece] = (len(text), len(text) + len(word))
        text += word
    return text, spans


__all__ = ["NaturalLanguageAR"]
