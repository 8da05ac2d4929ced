"""What a model's token ids mean as text, for TransformerLens's ``to_tokens``, ``to_string`` and
``to_str_tokens`` (`hookmech.tl_compat`).

Two kinds: a task's token names (``k3 v0 DIV``, one word per token: a text is its tokens' names
separated by spaces), and a tokenizer's (`hookmech.tasks.tokenizer.TextTokenizer`: a pretrained
folder's, or a tokenizer task's). `HookedLM.set_vocabulary` gives a model one; a checkpoint's task
is the tasks package's to rebuild (``hookmech.tasks.from_checkpoint(path)``), which the model, imported
by that package, does not import. `hookmech.from_pretrained` gives a folder the tokenizer beside its
weights (its path: loaded on first use).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .errors import UsageError, suggest
from .tasks.tokenizer import TextTokenizer, load_tokenizer

#: the name the tasks give their beginning-of-sequence token (`Task.token_names`)
BOS_NAME = "BOS"


class Vocabulary(Protocol):
    """Text to token ids and back."""

    def encode(self, text: str) -> list[int]:
        """Return the token ids of `text`."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of `ids`."""
        ...

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Return the text of each id of `ids`, one string per token."""
        ...

    @property
    def bos_id(self) -> int | None:
        """The id of the beginning-of-sequence token, None where there is none."""
        ...


@dataclass(frozen=True)
class NamedVocabulary:
    """A task's vocabulary: one name per token id (`Task.token_names`), a text is the names
    separated by white space."""

    names: tuple[str, ...]

    def encode(self, text: str) -> list[int]:
        """Return the ids of the names in `text`; a UsageError naming the first unknown name."""
        ids = {name: index for index, name in enumerate(self.names)}
        for word in text.split():
            if word not in ids:
                raise UsageError(
                    f"to_tokens: {word!r} is no token of this model's task (its tokens are written "
                    f"{', '.join(self.names[:3])} ... {self.names[-1]}){suggest(word, self.names)}"
                )
        return [ids[word] for word in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        """Return the names of `ids` separated by spaces."""
        return " ".join(self.token_texts(ids))

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Return the name of each id."""
        return [self.names[index] for index in ids]

    @property
    def bos_id(self) -> int | None:
        """The id of the token named ``BOS`` (the tasks' beginning of sequence), None without one."""
        return self.names.index(BOS_NAME) if BOS_NAME in self.names else None


@dataclass(frozen=True)
class TokenizerVocabulary:
    """A tokenizer's vocabulary (`TextTokenizer`): no special token is added to a text."""

    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        """Return the tokenizer's ids of `text`."""
        return list(self.tokenizer.encode([text])[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Return the tokenizer's text of `ids` (special tokens written out)."""
        return str(self.tokenizer.decode(list(ids)))

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Return the text of each id alone (a leading space kept)."""
        return [self.tokenizer.decode([index]) for index in ids]

    @property
    def bos_id(self) -> int | None:
        """The id of the BOS token the tokenizer's files declare, None where they declare none."""
        declared = self.tokenizer.declared.get("bos_token")
        return None if declared is None else self.tokenizer.token_id(declared)


def vocabulary_of(source: Any, d_vocab: int) -> Vocabulary:
    """Return the vocabulary of `source`: a task (anything with `token_names(d_vocab)`, `Task`'s),
    a `TextTokenizer`, a path to a tokenizer file or folder, a sequence of `d_vocab` token names,
    or a `Vocabulary`."""
    if all(hasattr(source, member) for member in ("encode", "decode", "token_texts", "bos_id")):
        return source
    if hasattr(source, "token_names"):
        return NamedVocabulary(tuple(source.token_names(d_vocab)))
    if isinstance(source, TextTokenizer):
        return TokenizerVocabulary(source)
    if isinstance(source, (str, Path)):
        return TokenizerVocabulary(load_tokenizer(source))
    if isinstance(source, Sequence) and all(isinstance(name, str) for name in source):
        if len(source) != d_vocab:
            raise UsageError(f"set_vocabulary: {len(source)} token names for a vocabulary of {d_vocab}")
        return NamedVocabulary(tuple(source))
    raise UsageError(
        f"set_vocabulary: give a task, a tokenizer (or its path) or the {d_vocab} token names, "
        f"not a {type(source).__name__}"
    )
