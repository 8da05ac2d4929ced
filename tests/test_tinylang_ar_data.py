"""scripts/tinylang_ar_data.py: the replay of tinylang's `ar_32` training set.

The reference is a hand computation of the same algorithm from the Mersenne Twister up: a
pure-Python MT19937 (Matsumoto and Nishimura's reference code: `init_genrand`, `init_by_array`,
`genrand_int32`), seeded as numpy's legacy `RandomState(42)` seeds it (`init_genrand`) and as
CPython's `random.seed(42)` seeds it (`init_by_array([42])`). The legacy permutation is a
Fisher–Yates shuffle from the last index down, each index drawn by masked rejection
(numpy's `random_interval`). Python's `getrandbits(k)` is the top k bits of one output. Nothing
of numpy's or Python's generators is used, so the replay (which calls them) is checked against
an independent derivation. The slow test checks the whole replay against the document
tinylang's notebook prints from the authors' file.
"""

from __future__ import annotations

import runpy

import numpy as np
import pytest
from helpers import REPO

from hookmech import tasks
from hookmech.datasets import check_batch, load_dataset, save_dataset

script = runpy.run_path(str(REPO / "scripts" / "tinylang_ar_data.py"))

_N, _M, _MASK = 624, 397, 0xFFFFFFFF


class HandMT19937:
    """MT19937 as its authors' reference C code (mt19937ar.c) defines it."""

    def __init__(self, seed: int):
        self.state = [seed & _MASK]
        for i in range(1, _N):
            previous = self.state[-1]
            self.state.append((1812433253 * (previous ^ (previous >> 30)) + i) & _MASK)
        self.index = _N

    @classmethod
    def by_array(cls, key: list[int]) -> HandMT19937:
        generator = cls(19650218)
        mt, i, j = generator.state, 1, 0
        for _ in range(max(_N, len(key))):
            mt[i] = ((mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525)) + key[j] + j) & _MASK
            i, j = i + 1, (j + 1) % len(key)
            if i >= _N:
                mt[0], i = mt[_N - 1], 1
        for _ in range(_N - 1):
            mt[i] = ((mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941)) - i) & _MASK
            i += 1
            if i >= _N:
                mt[0], i = mt[_N - 1], 1
        mt[0] = 0x80000000
        return generator

    def next32(self) -> int:
        if self.index >= _N:
            mt = self.state
            for k in range(_N):
                y = (mt[k] & 0x80000000) | (mt[(k + 1) % _N] & 0x7FFFFFFF)
                mt[k] = mt[(k + _M) % _N] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.index = 0
        y = self.state[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)


def hand_below(python_mt: HandMT19937, n: int) -> int:
    """Python's _randbelow(n): top n.bit_length() bits of an output, until below n."""
    while True:
        value = python_mt.next32() >> (32 - n.bit_length())
        if value < n:
            return value


def hand_permutation(numpy_mt: HandMT19937, n: int) -> list[int]:
    """numpy's legacy permutation(n): arange(n) shuffled from the top, j by masked rejection."""
    items = list(range(n))
    for i in range(n - 1, 0, -1):
        mask = (1 << i.bit_length()) - 1
        while (j := numpy_mt.next32() & mask) > i:
            pass
        items[i], items[j] = items[j], items[i]
    return items


def hand_replay(lengths, train_size, eval_size):
    """The documents of the last language, by hand: [(keys, values, queried)] per set."""
    python_mt, numpy_mt = HandMT19937.by_array([42]), HandMT19937(42)
    sets = {}
    for length in lengths:
        for name, size in (("train", train_size), ("test", eval_size)):
            documents = []
            for _ in range(size):
                pairs = length // 2 + hand_below(python_mt, 1)
                keys = hand_permutation(numpy_mt, 4096)[:pairs]
                values = hand_permutation(numpy_mt, 4096)[:pairs]
                documents.append((keys, values, hand_below(python_mt, pairs)))
            sets[name] = documents
    return sets


def test_replay_matches_a_hand_computation_of_the_generator():
    # three languages in one seeding, as make_languages.py made them: the third's documents
    # depend on every draw of the first two
    lengths, train_size, eval_size = (8, 16, 32), 2, 1
    replayed = script["replay"](lengths, train_size=train_size, eval_size=eval_size)
    by_hand = hand_replay(lengths, train_size, eval_size)
    for name in ("train", "test"):
        keys, values, queried = replayed[name]
        assert keys.shape == values.shape == (len(by_hand[name]), 16)
        for row, (hand_keys, hand_values, hand_queried) in enumerate(by_hand[name]):
            assert keys[row].tolist() == hand_keys
            assert values[row].tolist() == hand_values
            assert queried[row] == hand_queried
    # the draws are not degenerate: distinct keys and values within a document, queries vary
    assert len(set(by_hand["train"][0][0])) == 16 and len(set(by_hand["train"][0][1])) == 16


def test_python_seeding_by_hand_is_cpythons():
    # the hand MT seeded as random.seed(42) gives random.Random(42)'s outputs (the premise of
    # reading Python's draws through getrandbits)
    import random

    stream, hand = random.Random(42), HandMT19937.by_array([42])
    assert [stream.getrandbits(32) for _ in range(700)] == [hand.next32() for _ in range(700)]


def test_rows_are_hookmech_ar_rows_of_the_replayed_documents(tmp_path):
    keys, values, queried = script["replay"]((8,), train_size=5, eval_size=0)["train"]
    task = tasks.make("ar", vocab_size=8192, num_kv_pairs=4)
    batch = script["as_batch"](task, keys, values, queried)
    check_batch(batch, task)
    for row in range(5):
        tokens = batch.tokens[row].tolist()
        k, v, q = keys[row].tolist(), values[row].tolist(), int(queried[row])
        assert tokens == [task.bos_id, k[0], 4096 + v[0], k[1], 4096 + v[1], k[2], 4096 + v[2], k[3], 4096 + v[3],
                          task.divider_id, k[q]]  # fmt: skip
        assert batch.answers[row] == 4096 + v[q]
        assert batch.roles["key"][row] == 1 + 2 * q and tokens[batch.roles["value"][row]] == 4096 + v[q]
        corrupt = batch.corrupt_tokens[row].tolist()
        changed = [i for i in range(len(tokens)) if corrupt[i] != tokens[i]]
        assert changed == [1 + 2 * q] and corrupt[1 + 2 * q] not in k and corrupt[1 + 2 * q] < 4096
    path = save_dataset(batch, task, tmp_path / "ar.h5")
    loaded_task, loaded = load_dataset(path)
    assert loaded_task.spec == task.spec and loaded.tokens.equal(batch.tokens)


def test_documents_that_do_not_fit_the_task_are_refused():
    keys, values, queried = script["replay"]((8,), train_size=2, eval_size=0)["train"]
    with pytest.raises(Exception, match="do not fit the task"):
        script["as_batch"](tasks.make("ar", vocab_size=8192, num_kv_pairs=16), keys, values, queried)


@pytest.mark.slow
def test_replay_draws_the_test_document_tinylang_prints_from_its_file():
    # tinylang notebooks/Reverse.ipynb @ b644c87, cell 7:
    # ar_dataset.prettify(ar_dataset.evalsets['test']['toks'][0]), ar_dataset = languages/ar_32.pkl.
    # The test set is drawn after the 100,032 training documents (and after ar_8's and ar_16's),
    # so matching it pins every draw before it. About 2 minutes.
    printed = (
        "<bos> k3926 v1178 k3298 v3725 k2517 v2940 k565 v1864 k77 v2070 k2329 v3316 k653 v2580 "
        "k3250 v3084 k1312 v916 k3854 v630 k1585 v502 k1214 v3764 k3015 v3435 k96 v1161 k1726 v2208 "
        "k1701 v3089 <eos> k1312 v916 <eos>"
    )
    sets = script["replay"]()
    keys, values, queried = sets["test"]
    assert script["describe"](keys[0], values[0], int(queried[0])) == printed
    assert sets["train"][0].shape == (100_032, 16)
    assert np.all(np.sort(sets["train"][0], axis=1)[:, 1:] != np.sort(sets["train"][0], axis=1)[:, :-1])


@pytest.mark.slow
def test_replay_of_one_language_draws_the_document_tinylang_prints_from_its_later_file():
    # the later make_languages.py reseeds for each language; the same notebook cell prints the first
    # test document of languages/ar_value_first/ar_32_value.pkl, made by it (query_type "value":
    # the same draws, the value asked and the key answered). About a minute.
    printed = (
        "<bos> k1918 v3526 k517 v629 k1658 v2914 k745 v2444 k4094 v2212 k3699 v1212 k888 v811 k4089 v545 "
        "k3257 v1943 k3109 v4000 k1887 v2716 k476 v2860 k2277 v3455 k366 v238 k1546 v3373 k189 v3146 "
        "<eos> v3146 k189 <eos>"
    )
    keys, values, queried = script["replay"]((32,))["test"]
    q = int(queried[0])
    pairs = " ".join(f"k{key} v{value}" for key, value in zip(keys[0], values[0], strict=True))
    assert f"<bos> {pairs} <eos> v{values[0][q]} k{keys[0][q]} <eos>" == printed
