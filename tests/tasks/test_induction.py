"""The induction task (repeated random tokens of a tokenizer): each row checked by hand against
the document it must be, the roles decoded, the corruption, determinism, options and errors."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokenizers")

from tokenizer_files import WORD_LEVEL_OTHERS, WORD_LEVEL_SPECIALS, WORDS, bpe_tokenizer, word_level_tokenizer

from hookmech import tasks
from hookmech.errors import HookmechError, UsageError


@pytest.fixture(scope="module")
def word_level(tmp_path_factory):
    return word_level_tokenizer(tmp_path_factory.mktemp("tok") / "wl")


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("corrupt", ["key", "value"])
def test_rows_are_a_repeated_sequence_cut_at_the_query(word_level, bos, corrupt):
    task = tasks.make("induction", tokenizer=str(word_level), seq_len=6, bos=bos, corrupt=corrupt)
    batch = task.sample(200, seed=3)
    start = 1 if bos else 0  # <bos> is id 2 in the word-level vocabulary; [PAD] (id 0) pads
    assert task.pad_id == 0 and task.n_ctx == start + 11 and task.d_vocab == 3 + len(WORD_LEVEL_OTHERS) + len(WORDS)
    for row in range(len(batch)):
        tokens, length = batch.tokens[row].tolist(), int(batch.lengths[row])
        key, value, query = (int(batch.roles[role][row]) for role in ("key", "value", "query"))
        first = tokens[start : start + 6]
        i = key - start  # the queried token's place in the sequence
        # the document by hand: [BOS] t0..t5 t0..ti, padded
        assert tokens[:length] == [2] * start + first + first[: i + 1] and set(tokens[length:]) <= {0}
        assert length == query + 1 and value == key + 1 and query == key + 6 and 0 <= i <= 4
        assert len(set(first)) == 6 and not set(first) & {0, 1, 2}  # distinct, never a special token
        assert int(batch.answers[row]) == first[i + 1] == tokens[value]
        # corruption: one token, at the role asked, by a token absent from the document
        changed = [p for p in range(len(tokens)) if tokens[p] != int(batch.corrupt_tokens[row, p])]
        assert changed == [key if corrupt == "key" else value]
        new = int(batch.corrupt_tokens[row, changed[0]])
        assert new not in tokens[:length] and new not in (0, 1, 2)
    # every place i = 0..4 is queried
    assert set((batch.roles["key"] - start).tolist()) == set(range(5))


def test_roles_decode_to_the_repeated_words(tmp_path):
    folder, _ = bpe_tokenizer(tmp_path / "bpe")
    task = tasks.make("induction", tokenizer=str(folder), seq_len=8, bos=True)
    batch = task.sample(20, seed=0)
    end = task.text_tokenizer.token_id("<|endoftext|>")
    assert task.bos_id == end and (batch.tokens[:, 0] == end).all() and task.spec["bos"] == "<|endoftext|>"
    names = task.token_names(task.d_vocab)
    for row in range(20):
        at = {role: names[int(batch.tokens[row, batch.roles[role][row]])] for role in task.roles}
        assert at["key"] == at["query"] and names[int(batch.answers[row])] == at["value"]
        assert task.describe_tokens(batch.tokens[row, : batch.lengths[row]].tolist()).startswith("<|endoftext|>")


def test_token_range_bounds_the_draws(word_level):
    task = tasks.make("induction", tokenizer=str(word_level), seq_len=4, token_range=[20, 40])
    batch = task.sample(100, seed=0)
    inside = batch.tokens[:, :4]
    assert ((inside >= 20) & (inside < 40)).all() and ((batch.corrupt_tokens[:, :4] >= 20).all())
    assert task.spec["token_range"] == [20, 40]
    assert tasks.make("induction", tokenizer=str(word_level)).spec["token_range"] == [0, task.d_vocab]


def test_sampling_is_deterministic_by_seed_and_specs_rebuild_it(word_level):
    task = tasks.make("induction", tokenizer=str(word_level), seq_len=5)
    a, b, c = task.sample(30, seed=7), task.sample(30, seed=7), task.sample(30, seed=8)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.corrupt_tokens, b.corrupt_tokens)
    assert not torch.equal(a.tokens, c.tokens)
    rebuilt = tasks.from_spec(task.spec)
    assert torch.equal(rebuilt.sample(30, seed=7).tokens, a.tokens)
    assert task.spec["tokenizer"] == str(word_level.resolve()) and len(task.spec["tokenizer_sha256"]) == 64


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"seq_len": 1}, UsageError, "seq_len must be >= 2"),
        ({"token_range": [5, 5]}, UsageError, "token_range"),
        ({"token_range": [0, 10_000]}, UsageError, "must lie in"),
        ({"seq_len": 10, "token_range": [0, 12]}, UsageError, "needs 11"),
        ({"corrupt": "query"}, UsageError, "corrupt must be"),
        ({"bos": "<nope>"}, UsageError, "is not a token"),
        ({"tokenizer_sha256": "0" * 64}, HookmechError, "changed since"),
        ({"tokenizer": None}, UsageError, "needs a tokenizer"),
        ({"token_range": "wide"}, UsageError, "token_range"),
    ],
)
def test_bad_options_are_one_line(word_level, options, error, message):
    with pytest.raises(error, match=message) as raised:
        tasks.make("induction", **{"tokenizer": str(word_level), **options})
    assert "\n" not in str(raised.value)


def test_bos_true_needs_a_declared_bos(tmp_path):
    folder, _ = bpe_tokenizer(tmp_path / "bpe")
    (folder / "special_tokens_map.json").unlink()
    with pytest.raises(UsageError, match="declares no BOS"):
        tasks.make("induction", tokenizer=str(folder), bos=True)
