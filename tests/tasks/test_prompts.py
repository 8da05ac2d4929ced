"""The user's prompts (a JSONL of clean, corrupt, answer and role spans): positions checked by
hand and against the tokenizer on each text's prefix, and every malformed line named by number."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("tokenizers")

from tokenizer_files import bpe_tokenizer, word_level_tokenizer

from hookmech import tasks
from hookmech.errors import HookmechError, UsageError


@pytest.fixture(scope="module")
def word_level(tmp_path_factory):
    return word_level_tokenizer(tmp_path_factory.mktemp("tok") / "wl")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")[0]


def span(text: str, word: str, nth: int = 0) -> list[int]:
    """The character span [start, end) of the nth occurrence of `word` in `text`."""
    start = -1
    for _ in range(nth + 1):
        start = text.index(word, start + 1)
    return [start, start + len(word)]


def write_prompts(path, prompts, blank_lines=False):
    lines = [json.dumps(prompt) for prompt in prompts]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n")
    return path


def prompt(clean, corrupt, answer, **roles):
    return {"clean": clean, "corrupt": corrupt, "answer": answer, "roles": roles}


def test_positions_by_hand_on_a_word_level_tokenizer(word_level, tmp_path):
    first = "cat door , tree milk , cat"
    second = "owl pear , salt tent , salt"
    path = write_prompts(
        tmp_path / "p.jsonl",
        [
            prompt(first, "dog door , tree milk , cat", "door", key=span(first, "cat"), value=span(first, "door"),
                   divider=span(first, ",", 1)),
            prompt(second, "owl pear , wolf tent , salt", " tent", key=span(second, "salt"), value=span(second, "tent"),
                   divider=span(second, ",", 1)),
        ],
        blank_lines=True,
    )
    task = tasks.make("prompts", data=str(path), tokenizer=str(word_level))
    batch = task.sample(2, seed=0)
    names = task.token_names(task.d_vocab)
    # one token per word: the role's position is the word's index; the query the last word
    assert {role: batch.roles[role].tolist() for role in ("key", "value", "divider", "query")} == {
        "key": [0, 3], "value": [1, 4], "divider": [5, 5], "query": [6, 6]}
    assert [names[a] for a in batch.answers.tolist()] == ["door", "tent"]
    assert [names[t] for t in batch.corrupt_tokens[1].tolist()] == "owl pear , wolf tent , salt".split()
    assert task.n_rows == 2 and batch.lengths.tolist() == [7, 7]
    spec = task.spec
    assert spec["data"] == str(path.resolve()) and len(spec["data_sha256"]) == 64
    assert torch.equal(tasks.from_spec(spec).sample(2, seed=0).tokens, batch.tokens)


def test_spans_of_several_tokens_take_their_last_token(bpe, tmp_path):
    texts = [" The Eiffel Tower stands in the city of", " héllo wörld, the cat sat near the door of"]
    marks = [("Eiffel Tower", "city"), ("cat", "door")]
    path = write_prompts(
        tmp_path / "p.jsonl",
        [prompt(text, text, " Paris", key=span(text, key), query=span(text, query))
         for text, (key, query) in zip(texts, marks, strict=True)],
    )
    task = tasks.make("prompts", data=str(path), tokenizer=str(bpe), bos=True)
    batch = task.sample(2, seed=0)
    tokenizer = task.text_tokenizer
    for row, (text, (key, query)) in enumerate(zip(texts, marks, strict=True)):
        for role, word in (("key", key), ("query", query)):
            # independently: the tokens of the text up to the end of the word (a word boundary), after the BOS
            end = span(text, word)[1]
            assert int(batch.roles[role][row]) == len(tokenizer.encode([text[:end]])[0].ids)
        ids = batch.tokens[row, : batch.lengths[row]].tolist()
        assert ids[0] == tokenizer.token_id("<|endoftext|>") and tokenizer.decode(ids[1:]) == text
    assert tokenizer.decode([int(batch.answers[0])]) == " Paris"


def test_sample_returns_the_first_prompts_in_file_order(word_level, tmp_path):
    texts = ["cat dog", "tree milk sun", "owl"]
    path = write_prompts(tmp_path / "p.jsonl", [prompt(t, t, "cat") for t in texts])
    task = tasks.make("prompts", data=str(path), tokenizer=str(word_level))
    two = task.sample(2, seed=5)
    assert two.tokens.shape == (2, 3) and two.lengths.tolist() == [2, 3] and two.roles["query"].tolist() == [1, 2]
    assert torch.equal(task.sample(2, seed=9).tokens, two.tokens)  # the seed chooses nothing
    assert task.n_ctx == 3 and task.n_rows == 3
    with pytest.raises(UsageError, match="holds 3 prompts, 4 asked"):
        task.sample(4, seed=0)


CLEAN = "cat door , tree milk , cat"


@pytest.mark.parametrize(
    "lines, message",
    [
        ([prompt(CLEAN, CLEAN, "door"), prompt(CLEAN, "cat dog door , tree milk , cat", "door")],
         "line 2: clean and corrupt texts tokenize to 7 and 8 tokens"),
        ([prompt(CLEAN, CLEAN, "door", key=[1, 3])], r"line 1: role 'key' span \[1, 3\) \('at'\) is not token-aligned"),
        ([prompt(CLEAN, CLEAN, "door", key=[0, 5])], r"line 1: role 'key' span \[0, 5\) .* is not token-aligned"),
        ([prompt(CLEAN, CLEAN, "door", key=[20, 99])], "line 1: role 'key' span .* is not a span of the text"),
        ([prompt(CLEAN, CLEAN, "door cat")], "line 1: answer 'door cat' is 2 tokens"),
        ([prompt(CLEAN, CLEAN, "door", subject=[0, 3])], "line 1: unknown role 'subject'"),
        ([prompt(CLEAN, CLEAN, "door", key=[0, 3]), prompt(CLEAN, CLEAN, "door")],
         "line 2: roles none differ from line 1's key"),
        ([prompt(CLEAN, CLEAN, "door", key=[0])], "line 1: role 'key' must be"),
        ([{"clean": CLEAN, "corrupt": CLEAN}], "line 1: answer missing"),
        ([{"clean": CLEAN, "corrupt": CLEAN, "answer": "door", "role": {}}], r"line 1: unknown fields \['role'\]"),
        ([prompt("", "", "door")], "line 1: the clean text has no tokens"),
    ],
)
def test_malformed_prompts_name_their_line(word_level, tmp_path, lines, message):
    path = write_prompts(tmp_path / "p.jsonl", lines)
    with pytest.raises(HookmechError, match=message) as raised:
        tasks.make("prompts", data=str(path), tokenizer=str(word_level))
    assert "\n" not in str(raised.value) and str(path.resolve()) in str(raised.value)


def test_file_errors(word_level, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(prompt(CLEAN, CLEAN, "door")) + "\n{oops\n")
    with pytest.raises(HookmechError, match="line 2: not valid JSON"):
        tasks.make("prompts", data=str(bad), tokenizer=str(word_level))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(HookmechError, match="holds no prompts"):
        tasks.make("prompts", data=str(tmp_path / "empty.jsonl"), tokenizer=str(word_level))
    with pytest.raises(HookmechError, match="no such prompts file"):
        tasks.make("prompts", data=str(tmp_path / "none.jsonl"), tokenizer=str(word_level))
    with pytest.raises(UsageError, match="--data FILE.jsonl"):
        tasks.make("prompts", tokenizer=str(word_level))
    good = write_prompts(tmp_path / "good.jsonl", [prompt(CLEAN, CLEAN, "door")])
    spec = tasks.make("prompts", data=str(good), tokenizer=str(word_level)).spec
    write_prompts(good, [prompt(CLEAN, CLEAN, "milk")])
    with pytest.raises(HookmechError, match="prompts changed since the spec was made"):
        tasks.from_spec(spec)


def test_the_docs_example_spans_mark_the_words_they_mean():
    from helpers import REPO

    text = (REPO / "docs" / "tasks.md").read_text()
    start = text.index('    {"clean": "When Mary')
    example = json.loads(" ".join(line.strip() for line in text[start:].split("\n\n")[0].splitlines()))
    clean, roles = example["clean"], example["roles"]
    assert {role: clean[a:b] for role, (a, b) in roles.items()} == {"value": "Mary", "key": "John", "query": "to"}
    assert len(example["corrupt"]) == len(clean) and example["answer"] == " Mary"
