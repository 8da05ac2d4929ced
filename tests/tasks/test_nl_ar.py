"""Natural-language AR (nl-ar): the word lists and every row checked by hand (the words at each
role decoded), the template option, the corruption, determinism and errors."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokenizers")

from tokenizer_files import WORDS, bpe_tokenizer, word_level_tokenizer

from hookmech import tasks
from hookmech.errors import HookmechError, UsageError


@pytest.fixture(scope="module")
def word_level(tmp_path_factory):
    return word_level_tokenizer(tmp_path_factory.mktemp("tok") / "wl")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")[0]


def test_words_are_the_lowercase_single_tokens_alternately_keys_and_values(word_level):
    task = tasks.make("nl-ar", tokenizer=str(word_level), num_kv_pairs=3)
    # by hand: of the vocabulary's non-special entries, "the" and WORDS are lowercase words of
    # 3+ letters ("is", "of", "an" are short; "Paris", "ROME" not lowercase), in id order
    words = ["the", *WORDS]
    assert [word for _, word in task.key_words] == words[0::2]
    assert [word for _, word in task.value_words] == words[1::2]
    limited = tasks.make("nl-ar", tokenizer=str(word_level), num_kv_pairs=3, num_words=10)
    assert [w for _, w in limited.key_words + limited.value_words] == words[0:10:2] + words[1:10:2]


@pytest.mark.parametrize("corrupt", ["key", "value"])
def test_rows_by_hand_on_a_word_level_tokenizer(word_level, corrupt):
    task = tasks.make("nl-ar", tokenizer=str(word_level), num_kv_pairs=4, corrupt=corrupt)
    batch = task.sample(100, seed=5)
    names = task.token_names(task.d_vocab)
    keys, values = {w for _, w in task.key_words}, {w for _, w in task.value_words}
    assert batch.tokens.shape == (100, 13) and task.n_ctx == 13 and (batch.lengths == 13).all()
    for row in range(100):
        words = [names[t] for t in batch.tokens[row].tolist()]
        # "k0 v0 , k1 v1 , k2 v2 , k3 v3 , kq": pairs at 3p, 3p+1, separators at 3p+2
        pair_keys, pair_values = words[0:12:3], words[1:12:3]
        assert words[2:12:3] == [","] * 4 and set(pair_keys) <= keys and set(pair_values) <= values
        assert len(set(pair_keys)) == 4 and len(set(pair_values)) == 4
        q = pair_keys.index(words[12])
        roles = {role: int(batch.roles[role][row]) for role in ("key", "value", "query", "divider")}
        assert roles == {"key": 3 * q, "value": 3 * q + 1, "query": 12, "divider": 11}
        assert names[int(batch.answers[row])] == pair_values[q]
        corrupted = [names[t] for t in batch.corrupt_tokens[row].tolist()]
        changed = [p for p in range(13) if corrupted[p] != words[p]]
        assert changed == [roles[corrupt]]
        assert corrupted[changed[0]] in (keys if corrupt == "key" else values)
        assert corrupted[changed[0]] not in words


def test_rows_by_hand_on_a_byte_level_bpe_with_bos(bpe):
    task = tasks.make("nl-ar", tokenizer=str(bpe), num_kv_pairs=3, bos=True)
    batch = task.sample(50, seed=2)
    names = task.token_names(task.d_vocab)
    for row in range(50):
        words = [names[t] for t in batch.tokens[row].tolist()]
        assert words[0] == "<|endoftext|>" and len(words) == 11 == task.n_ctx
        pairs = [(words[1 + 3 * p].strip(), words[2 + 3 * p].strip()) for p in range(3)]
        final = words[10].strip()
        # the text, rebuilt from the words: a leading space, then "k v, k v, k v, kq"
        text = " " + ", ".join(f"{k} {v}" for k, v in pairs) + ", " + final
        assert task.describe_tokens(batch.tokens[row].tolist()) == "<|endoftext|>" + text
        q = [k for k, _ in pairs].index(final)
        assert words[int(batch.roles["key"][row])] == words[int(batch.roles["query"][row])] == " " + final
        assert names[int(batch.answers[row])] == words[int(batch.roles["value"][row])] == " " + pairs[q][1]
        assert words[int(batch.roles["divider"][row])] == ","
        assert int(batch.roles["key"][row]) == 1 + 3 * q


def test_a_template_and_separator_of_ones_own(bpe):
    task = tasks.make("nl-ar", tokenizer=str(bpe), num_kv_pairs=2, template="{key} is {value}", separator=". ")
    batch = task.sample(20, seed=0)
    names = task.token_names(task.d_vocab)
    for row in range(20):
        text = task.describe_tokens(batch.tokens[row].tolist())
        first, second, query = text.split(". ")
        key = query.removesuffix(" is").strip()
        # " k0 is v0. k1 is v1. kq is": the query is the template cut before {value}
        assert first.startswith(" ") and first.count(" is ") == second.count(" is ") == 1 and query.endswith(" is")
        value = dict(pair.strip().split(" is ") for pair in (first, second))[key]
        assert names[int(batch.answers[row])] == " " + value
        position = {role: int(batch.roles[role][row]) for role in task.roles}
        assert names[int(batch.tokens[row, position["query"]])] == " is"
        assert names[int(batch.tokens[row, position["divider"]])] == "."
        assert names[int(batch.tokens[row, position["divider"] + 1])] == " " + key
        assert names[int(batch.tokens[row, position["key"]])] == " " + key
        assert names[int(batch.tokens[row, position["value"]])] == " " + value


def test_sampling_is_deterministic_by_seed_and_specs_rebuild_it(bpe):
    task = tasks.make("nl-ar", tokenizer=str(bpe), num_kv_pairs=3)
    a, b, c = task.sample(40, seed=1), task.sample(40, seed=1), task.sample(40, seed=2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.corrupt_tokens, b.corrupt_tokens)
    assert not torch.equal(a.tokens, c.tokens)
    rebuilt = tasks.from_spec(task.spec)
    assert rebuilt.spec == task.spec and torch.equal(rebuilt.sample(40, seed=1).corrupt_tokens, a.corrupt_tokens)
    # the same draws as AR's: the queried pair is uniform over the pairs
    counts = torch.bincount(task.sample(3000, seed=0).roles["key"] // 3, minlength=3).float() / 3000
    assert (counts - 1 / 3).abs().max() < 0.04  # sd 0.009


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"template": "{value} {key}"}, UsageError, "template must hold"),
        ({"template": "{key} {key} {value}"}, UsageError, "template must hold"),
        ({"separator": " "}, UsageError, "other than space"),
        ({"num_kv_pairs": 40}, UsageError, "needs 82"),
        ({"num_words": 2}, UsageError, "num_words"),
        ({"corrupt": "query"}, UsageError, "corrupt must be"),
        ({"min_letters": 0}, UsageError, "min_letters"),
        # the value must follow a space: "=milk" is not the token " milk"
        ({"template": "{key}={value}"}, HookmechError, "nl-ar"),
    ],
)
def test_bad_options_are_one_line(bpe, options, error, message):
    with pytest.raises(error, match=message) as raised:
        tasks.make("nl-ar", **{"tokenizer": str(bpe), "num_kv_pairs": 3, **options})
    assert "\n" not in str(raised.value)


def test_for_checkpoint_takes_a_model_folders_own_tokenizer(bpe):
    # a Hugging Face model folder holds its tokenizer beside the weights and stores no task
    task = tasks.for_checkpoint(bpe, "nl-ar", {"num_kv_pairs": 3})
    assert task.spec["tokenizer"] == str(bpe.resolve())
    assert tasks.stored_task_spec(bpe) is None
    with pytest.raises(UsageError, match="stores no task: give one with --task"):
        tasks.for_checkpoint(bpe)
