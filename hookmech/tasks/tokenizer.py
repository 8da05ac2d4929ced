"""A tokenizer read from local files, the identity a task spec records of it, and the map
from a text's character spans to its token positions.

The files: a ``tokenizer.json`` (the `tokenizers` library's own format, which every Hugging
Face folder of GPT-2, Pythia and Mamba holds), or GPT-2's older pair ``vocab.json`` +
``merges.txt`` (a byte-level BPE, built as transformers' GPT-2 converter builds it). Beside
them, ``tokenizer_config.json`` and ``special_tokens_map.json`` name the BOS/EOS/pad/unk
tokens where the folder has them; they are read as JSON only (nothing they name is run).
Nothing is downloaded.

`tokenizers` is imported only here, when a tokenizer is loaded: it comes with the optional
extra ``hookmech[hf]``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import HookmechError, UsageError
from ..fileio import sha256_of

# tokenizers is imported where used: the built-in tasks do not need it

TOKENIZER_FILE = "tokenizer.json"
BPE_FILES = ("vocab.json", "merges.txt")
#: read beside the tokenizer files, where present, for the names of its special tokens
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
DECLARED_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")
#: an id above the tokenizer's vocabulary (a model may pad its embedding beyond it), as shown
UNUSED_NAME = "<unused {id}>"

#: a character span ``[start, end)`` of a text
Span = tuple[int, int]


def require_tokenizers() -> Any:
    """Return the `tokenizers` module; a HookmechError saying how to install it when it is missing."""
    try:
        import tokenizers
    except ImportError:
        raise HookmechError(
            "the tasks induction, nl-ar and prompts read a tokenizer with the 'tokenizers' library, "
            "which is not installed: pip install 'hookmech[hf]'"
        ) from None
    return tokenizers


@dataclass(frozen=True)
class Encoded:
    """One text's tokens: ``ids`` and each token's character span ``offsets`` in the text."""

    text: str
    ids: list[int]
    offsets: list[Span]


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer and its identity.

    `path` is what was named, resolved (a tokenizer.json file, or the folder holding it or
    vocab.json + merges.txt); `files` the files read; `sha256` the SHA-256 of the lines
    ``sha256sum`` prints for `files` (so a spec says which bytes made its tokens).
    `declared` maps bos_token/eos_token/pad_token/unk_token to the token texts the config
    files name; `special_ids` are the ids of special tokens (never drawn as content).
    """

    path: Path
    files: tuple[Path, ...]
    sha256: str
    backend: Any = field(repr=False, compare=False)
    declared: dict[str, str] = field(default_factory=dict)
    special_ids: frozenset[int] = frozenset()
    _words: dict[int, list[tuple[int, str]]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included: ids are ``0 .. vocab_size - 1``."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_id(self, text: str) -> int | None:
        """Return the id of the token whose text is `text` (a vocabulary entry, e.g.
        ``<|endoftext|>``), or None."""
        found = self.backend.token_to_id(text)
        return None if found is None else int(found)

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        """Return each text's token ids and character offsets, without added special tokens
        (no post-processor BOS/EOS: a row's tokens are exactly its text's)."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [
            Encoded(text, list(encoding.ids), [(int(a), int(b)) for a, b in encoding.offsets])
            for text, encoding in zip(texts, encodings, strict=True)
        ]

    def names(self, d_vocab: int) -> list[str]:
        """Return a readable text of each id ``0 .. d_vocab - 1``: the decoded token (a leading
        space kept, newlines and tabs as ↵ and ⇥), a special token as written, ids beyond the
        tokenizer as ``<unused ID>``."""
        known = min(d_vocab, self.vocab_size)
        texts = self.backend.decode_batch([[i] for i in range(known)], skip_special_tokens=False)
        shown = [text.replace("\n", "↵").replace("\t", "⇥") for text in texts]
        return shown + [UNUSED_NAME.format(id=i) for i in range(known, d_vocab)]

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of `ids` (special tokens written out)."""
        return str(self.backend.decode(list(ids), skip_special_tokens=False))

    def single_token_words(self, min_letters: int) -> list[tuple[int, str]]:
        """Return ``(id, word)`` of every lowercase ASCII word of at least `min_letters`
        letters that the tokenizer encodes, with its leading space (``" word"``), as one
        token that is not special, sorted by id (for byte-level BPEs, roughly by frequency)."""
        if min_letters not in self._words:
            self._words[min_letters] = self._find_words(min_letters)
        return self._words[min_letters]

    def _find_words(self, min_letters: int) -> list[tuple[int, str]]:
        pattern = re.compile(rf"[a-z]{{{min_letters},}}")
        texts = self.backend.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        candidates = sorted({text.strip() for text in texts if pattern.fullmatch(text.strip())})
        words = {}
        for word, encoded in zip(candidates, self.encode([" " + word for word in candidates]), strict=True):
            if len(encoded.ids) == 1 and encoded.ids[0] not in self.special_ids:
                words[encoded.ids[0]] = word
        return sorted(words.items())


def load_tokenizer(path: str | Path, expected_sha256: str | None = None) -> TextTokenizer:
    """Return the tokenizer at `path`: a tokenizer.json, a vocab.json (merges.txt beside it),
    or a folder holding either. With `expected_sha256` (a spec's record), a HookmechError
    when the files' identity differs: they changed since the spec was made."""
    require_tokenizers()
    resolved, files = _tokenizer_files(Path(path))
    configs = (files[0].parent / name for name in CONFIG_FILES)
    present = files + tuple(config for config in configs if config.is_file())
    lines = "".join(f"{sha256_of(file)}  {file.name}\n" for file in present)
    sha256 = hashlib.sha256(lines.encode()).hexdigest()
    if expected_sha256 is not None and sha256 != expected_sha256:
        raise HookmechError(
            f"tokenizer {resolved}: its files have sha256 {sha256[:12]}…, the task spec records "
            f"{expected_sha256[:12]}…: they changed since the spec was made (a cache's or checkpoint's tokens "
            "came from other files)"
        )
    key = (str(resolved), sha256)
    if key not in _LOADED:
        declared = _declared_tokens(present[len(files) :])
        backend = _read_backend(files, declared)
        special = {int(i) for i, token in backend.get_added_tokens_decoder().items() if token.special}
        special |= {i for text in declared.values() if (i := backend.token_to_id(text)) is not None}
        _LOADED[key] = TextTokenizer(resolved, present, sha256, backend, declared, frozenset(special))
    return _LOADED[key]


#: tokenizers loaded in this process, by (resolved path, sha256): tasks are rebuilt from specs often
_LOADED: dict[tuple[str, str], TextTokenizer] = {}


def _tokenizer_files(path: Path) -> tuple[Path, tuple[Path, ...]]:
    """Return (resolved path, the tokenizer files it names); a HookmechError naming what is missing."""
    resolved = path.expanduser().resolve()
    if resolved.is_dir():
        if (resolved / TOKENIZER_FILE).is_file():
            return resolved, (resolved / TOKENIZER_FILE,)
        if all((resolved / name).is_file() for name in BPE_FILES):
            return resolved, tuple(resolved / name for name in BPE_FILES)
        raise HookmechError(f"{path}: the folder holds no {TOKENIZER_FILE} (nor {' and '.join(BPE_FILES)})")
    if not resolved.is_file():
        raise HookmechError(f"{path}: no such tokenizer file or folder")
    if resolved.name == BPE_FILES[0]:
        merges = resolved.parent / BPE_FILES[1]
        if not merges.is_file():
            raise HookmechError(f"{path}: a GPT-2 style vocabulary needs {BPE_FILES[1]} beside it, missing")
        return resolved, (resolved, merges)
    return resolved, (resolved,)


def _declared_tokens(config_files: Sequence[Path]) -> dict[str, str]:
    """Return the special token texts the config files name (the first file naming a role wins)."""
    declared: dict[str, str] = {}
    for config in config_files:
        try:
            values = json.loads(config.read_text())
        except (ValueError, UnicodeDecodeError) as error:
            raise HookmechError(f"{config}: not valid JSON ({error})") from None
        if not isinstance(values, dict):
            continue
        for role in DECLARED_ROLES:
            value = values.get(role)
            text = value.get("content") if isinstance(value, dict) else value
            if isinstance(text, str) and text and role not in declared:
                declared[role] = text
    return declared


def _read_backend(files: tuple[Path, ...], declared: dict[str, str]) -> Any:
    """Return the `tokenizers.Tokenizer` of `files`; a HookmechError naming a file it cannot read."""
    tokenizers = require_tokenizers()
    try:
        if len(files) == 1:
            return tokenizers.Tokenizer.from_file(str(files[0]))
        # GPT-2's pair, as transformers' GPT2 converter builds it: byte-level BPE, no prefix space
        backend = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(files[0]), str(files[1])))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tokenizers.decoders.ByteLevel()
        backend.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    except Exception as error:  # the Rust side raises plain Exceptions for unreadable files
        raise HookmechError(f"{files[0]}: not a readable tokenizer ({error})") from None
    present = sorted({text for text in declared.values() if backend.token_to_id(text) is not None})
    if present:  # GPT-2's <|endoftext|> is a plain vocabulary entry until it is declared special
        backend.add_special_tokens(present)
    return backend


def resolve_bos(tokenizer: TextTokenizer, bos: bool | str, task: str) -> tuple[str | None, int | None]:
    """Return (text, id) of the BOS token option `bos` asks for: none (False), the one the
    tokenizer's config files declare (True), or the token named; a UsageError otherwise."""
    if bos is False:
        return None, None
    text = tokenizer.declared.get("bos_token") if bos is True else bos
    if text is None:
        raise UsageError(
            f"{task}: tokenizer {tokenizer.path} declares no BOS token (no bos_token in "
            f"{' or '.join(CONFIG_FILES)} beside it): name one, e.g. bos='<|endoftext|>'"
        )
    assert isinstance(text, str)
    token = tokenizer.token_id(text)
    if token is None:
        raise UsageError(f"{task}: bos {text!r} is not a token of tokenizer {tokenizer.path}")
    return text, token


def span_tokens(encoded: Encoded, span: Span) -> Span | None:
    """Return ``(first, last)``: the tokens that cover ``text[start:end]`` exactly, or None when
    the span is not token-aligned (it starts or ends inside a token).

    A token starts where its offsets do, or where its text does once its leading whitespace
    is skipped: the spans of ``Paris`` and `` Paris`` are both aligned with the token
    `` Paris``, whatever the tokenizer's offsets include. Tokens of whitespace alone (a
    byte-level space split off its word, or one whose offsets were trimmed away) at either
    end are not counted in; inside the span they are.
    """
    start, end = span
    if not 0 <= start < end <= len(encoded.text):
        return None
    ends = [b for _, b in encoded.offsets]
    last = bisect.bisect_right(ends, end) - 1
    if last < 0 or ends[last] != end:
        return None
    while last > 0 and ends[last - 1] == end and not _has_text(encoded, last):
        last -= 1  # an empty token trimmed to where the span ends belongs to the next word
    first = last
    while first > 0 and encoded.offsets[first - 1][0] >= start:
        first -= 1
    if encoded.offsets[first][0] > start and first > 0:
        first -= 1  # the token before may start at `start` once its leading whitespace is skipped
    if start not in (encoded.offsets[first][0], _start_of(encoded, first)):
        return None
    while first < last and not _has_text(encoded, first):
        first += 1
    return first, last


def _start_of(encoded: Encoded, index: int) -> int:
    a, b = encoded.offsets[index]
    piece = encoded.text[a:b]
    return a + len(piece) - len(piece.lstrip())


def _has_text(encoded: Encoded, index: int) -> bool:
    a, b = encoded.offsets[index]
    return bool(encoded.text[a:b].strip())
