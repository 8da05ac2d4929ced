"""The tokenizer of the tokenizer tasks (hookmech.tasks.tokenizer): files read, their identity,
GPT-2's vocab.json + merges.txt read as tokenizer.json reads them, token names, and the map from
character spans to tokens."""
from __future__ import annotations

import hashlib
import json
import sys

import pytest

pytest.importorskip("tokenizers")

from tokenizer_files import WORD_LEVEL_OTHERS, WORD_LEVEL_SPECIALS, WORDS, bpe_tokenizer, word_level_tokenizer

from hookmech.errors import HookmechError
from hookmech.tasks.tokenizer import Encoded, load_tokenizer, span_tokens


def _sha256sum_lines(*files) -> str:
    """What `sha256sum FILES | sha256sum` prints, the identity the spec records (a second implementation)."""
    lines = "".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def test_identity_is_the_sha256_of_the_files_read(tmp_path):
    folder = word_level_tokenizer(tmp_path / "wl")
    tokenizer = load_tokenizer(folder)
    assert tokenizer.path == folder.resolve()
    assert tokenizer.files == (folder / "tokenizer.json", folder / "tokenizer_config.json")
    assert tokenizer.sha256 == _sha256sum_lines(folder / "tokenizer.json", folder / "tokenizer_config.json")
    # the file named directly reads the same files
    assert load_tokenizer(folder / "tokenizer.json").sha256 == tokenizer.sha256
    # a changed file: the spec's record no longer matches, named in one message
    with pytest.raises(HookmechError, match="changed since the spec was made"):
        load_tokenizer(folder, expected_sha256="0" * 64)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[UNK]"}))
    assert load_tokenizer(folder).sha256 != tokenizer.sha256


def test_word_level_vocabulary_specials_and_declared_tokens(tmp_path):
    tokenizer = load_tokenizer(word_level_tokenizer(tmp_path / "wl"))
    entries = [*WORD_LEVEL_SPECIALS, *WORD_LEVEL_OTHERS, *WORDS]
    assert tokenizer.vocab_size == len(entries)
    assert tokenizer.special_ids == frozenset({0, 1, 2})
    assert tokenizer.declared == {"bos_token": "<bos>", "pad_token": "[PAD]"}
    assert tokenizer.names(len(entries) + 2) == [*entries, f"<unused {len(entries)}>", f"<unused {len(entries) + 1}>"]


def test_gpt2_vocab_and_merges_tokenize_as_the_tokenizer_json(tmp_path):
    json_folder, trained = bpe_tokenizer(tmp_path / "json")
    pair_folder = tmp_path / "pair"
    pair_folder.mkdir()
    trained.model.save(str(pair_folder))  # vocab.json + merges.txt, GPT-2's older pair
    (pair_folder / "special_tokens_map.json").write_text((json_folder / "special_tokens_map.json").read_text())
    from_json, from_pair = load_tokenizer(json_folder), load_tokenizer(pair_folder)
    assert from_pair.files[:2] == (pair_folder / "vocab.json", pair_folder / "merges.txt")
    texts = [" cat door, tree milk.", "Paris is in France; Rome<|endoftext|> héllo wörld", "  two  spaces\nand a line"]
    for a, b in zip(from_json.encode(texts), from_pair.encode(texts), strict=True):
        assert a.ids == b.ids and a.offsets == b.offsets
    # <|endoftext|> is declared, so it is one special token in both (a plain BPE would split it)
    end = from_json.token_id("<|endoftext|>")
    assert end in from_pair.special_ids and end in from_json.special_ids
    assert from_pair.encode(["<|endoftext|>"])[0].ids == [end]
    assert from_pair.names(from_pair.vocab_size) == from_json.names(from_json.vocab_size)
    # vocab.json named directly finds merges.txt beside it
    assert load_tokenizer(pair_folder / "vocab.json").files == from_pair.files


def test_token_names_keep_leading_spaces_and_show_newlines(tmp_path):
    tokenizer = load_tokenizer(bpe_tokenizer(tmp_path / "bpe")[0])
    names = tokenizer.names(tokenizer.vocab_size)
    encoded = tokenizer.encode([" cat door\nmilk"])[0]
    assert [names[i] for i in encoded.ids][:2] == [" cat", " door"]
    assert "↵" in "".join(names[i] for i in encoded.ids) and all("\n" not in name for name in names)
    assert names[tokenizer.token_id("<|endoftext|>")] == "<|endoftext|>"


def test_single_token_words_are_one_token_with_their_space(tmp_path):
    tokenizer = load_tokenizer(bpe_tokenizer(tmp_path / "bpe")[0])
    words = tokenizer.single_token_words(3)
    assert words == sorted(words) and len(words) > 20
    for token, word in words:  # checked one by one against the tokenizer itself
        assert len(word) >= 3 and word.isascii() and word.isalpha() and word.islower()
        assert tokenizer.encode([" " + word])[0].ids == [token]
    # every WORDS entry the tokenizer holds as one " word" token is found, and nothing else
    expected = {w for w in WORDS if len(w) >= 3 and len(tokenizer.encode([" " + w])[0].ids) == 1}
    assert expected <= {word for _, word in words}


@pytest.mark.parametrize(
    "name, make, message",
    [
        ("missing", lambda p: None, "no such tokenizer file or folder"),
        ("empty", lambda p: p.mkdir(), "holds no tokenizer.json"),
        ("junk.json", lambda p: p.write_text("{not json"), "not a readable tokenizer"),
        ("vocab.json", lambda p: p.write_text("{}"), "needs merges.txt beside it"),
    ],
)
def test_unreadable_tokenizers_are_one_line_naming_the_file(tmp_path, name, make, message):
    path = tmp_path / name
    make(path)
    with pytest.raises(HookmechError, match=message) as error:
        load_tokenizer(path)
    assert "\n" not in str(error.value) and name in str(error.value)


def test_a_missing_tokenizers_library_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(HookmechError, match=r"hookmech\[hf\]"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "text, offsets, span, expected",
    [
        # tokens " Paris" (offsets with the space) and " is": the word's span without the space is aligned
        (" Paris is", [(0, 6), (6, 9)], (1, 6), (0, 0)),
        (" Paris is", [(0, 6), (6, 9)], (0, 6), (0, 0)),
        (" Paris is", [(0, 6), (6, 9)], (1, 9), (0, 1)),
        # offsets trimmed of the space (ByteLevel trim_offsets): the same
        (" Paris is", [(1, 6), (7, 9)], (1, 6), (0, 0)),
        # inside a token, or ending inside one: not aligned
        (" Paris is", [(0, 6), (6, 9)], (2, 6), None),
        (" Paris is", [(0, 6), (6, 9)], (1, 4), None),
        # a word of several tokens: first and last; a lone space token before it is not counted in
        (" Parisian", [(0, 1), (1, 6), (6, 9)], (1, 9), (1, 2)),
        # a space token inside the span is in it (" Eiffel Tower" split as ' ', 'E', …, ' ', 'T', …)
        (" Ei ff", [(0, 1), (1, 3), (3, 4), (4, 6)], (1, 6), (1, 3)),
        # an empty token where the span ends (a trimmed space) belongs to the next word
        ("ab cd", [(0, 2), (2, 2), (3, 5)], (0, 2), (0, 0)),
        ("ab cd", [(0, 2), (3, 3), (3, 5)], (3, 5), (2, 2)),
        # a span starting inside a token before the one it ends in
        ("abcd", [(0, 2), (2, 4)], (1, 4), None),
        # outside the text or empty
        ("ab", [(0, 2)], (0, 3), None),
        ("ab", [(0, 2)], (1, 1), None),
    ],
)
def test_span_tokens_by_hand(text, offsets, span, expected):
    assert span_tokens(Encoded(text, list(range(len(offsets))), offsets), span) == expected


def test_offsets_count_characters_not_bytes(tmp_path):
    tokenizer = load_tokenizer(bpe_tokenizer(tmp_path / "bpe")[0])
    text = " héllo wörld cat"
    encoded = tokenizer.encode([text])[0]
    start = text.index("cat")
    first, last = span_tokens(encoded, (start, start + 3))
    assert tokenizer.decode(encoded.ids[first : last + 1]).strip() == "cat"
