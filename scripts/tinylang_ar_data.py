"""Replay the training set of paper 000's AR runs (tinylang's `ar_32` language) into a dataset file.

Paper 000's runs at its AR configuration (tinylang `experiments/configs/ar_32*`) read the
language file `languages/ar_32.pkl`. That path is the one `ar_vary_num_kv` in
`tinylang/make_languages.py` wrote at aryamanarora/tinylang f6108e2 and 2a0e0e6 (the next
versions write `languages/<folder>/<name>.pkl`). This script follows that algorithm; it holds no
tinylang code.

- The seeds are set once, at import: ``random.seed(42)``, ``np.random.seed(42)`` (and
  ``torch.manual_seed(42)``, which nothing below draws from).
- One process then makes the languages for max_length = min_length = 8, 16, 32, … in that order:
  each is ``AR(num_kv=8192, query_type="key", prepare_train_set=True)`` with
  ``prepare_sets(train_set_size=100032, eval_set_size=1024)``. That draws 100,032 training
  documents, then 1,024 test documents, from the same two generators. So `ar_32`'s documents
  are the third language's, drawn after `ar_8`'s and `ar_16`'s.
- Each document is ``AR.sample`` (`tinylang/language/ar.py` @ f6108e2), four draws in this order:

  1. ``random.randint(L/2, L/2)``: the number of pairs n (one ``_randbelow(1)``, which still
     draws);
  2. ``np.random.choice(4096, n, replace=False)``: the keys (the legacy RandomState takes
     ``permutation(4096)[:n]``);
  3. the same for the values;
  4. ``random.choice(range(n))``: the queried pair (``_randbelow(n)``; with no held-out pairs
     every pair is eligible).

  The document is ``BOS k₀ v₀ … EOS k_q v_q EOS``, keys at ids 3…4098 and values after them.

Python's `randint` and `choice` are replayed through `getrandbits`, CPython's ``_randbelow``
(tinylang pins Python 3.11), so a later change of either function cannot move the draws. numpy's
legacy RandomState stream is frozen (NEP 19).

Evidence that this is the file's generator: the first test document the replay draws for
`ar_32`, after its 100,032 training documents, is the one tinylang's `notebooks/Reverse.ipynb`
prints from `ar_32.pkl` (@ b644c87, cell 7; `tests/test_tinylang_ar_data.py` checks it).

The dataset file holds the training documents in their order, as hookmech's AR task
(`vocab_size` 8192, 16 pairs) writes them. Key k is token k and value v is 4096 + v. BOS and
the divider are hookmech's (the divider replaces tinylang's mid-document EOS). The answer and
the final EOS are dropped: a causal model's prediction at the query does not see them. The key
corruption, which training does not read, is a key absent from the document, drawn from
``numpy.random.default_rng(SPARE_SEED)``. Train on it with tinylang's order
(`[train] order = "fixed"`, batch ``step % 3126``):

    python scripts/tinylang_ar_data.py -o runs/tinylang-ar_32.h5          # about 2 minutes
    hookmech train --data runs/tinylang-ar_32.h5 --order fixed ...
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

import numpy as np

#: the seed tinylang's make_languages.py sets for `random` and numpy
TINYLANG_SEED = 42
#: the languages that version of make_languages.py makes in one process, in order, up to ar_32
LENGTHS = (8, 16, 32)
#: tinylang's `num_kv`: 4096 keys and 4096 values
NUM_KV = 8192
TRAIN_SET_SIZE, EVAL_SET_SIZE = 100_032, 1_024
#: seed of the corrupting (absent) keys, which tinylang's documents do not have
SPARE_SEED = 0


def randbelow(stream: random.Random, n: int) -> int:
    """Return CPython's ``_randbelow(n)`` on `stream`: `getrandbits(n.bit_length())` redrawn
    until it is below n (n >= 1; for n = 1 it still draws once or more)."""
    bits = n.bit_length()
    value = stream.getrandbits(bits)
    while value >= n:
        value = stream.getrandbits(bits)
    return value


def draw_document(stream: random.Random, legacy: np.random.RandomState, pairs: int, num_keys: int):
    """Return one tinylang AR document's draws ``(keys [pairs], values [pairs], queried)``, the
    keys and values as indices 0..num_keys-1, in the order `AR.sample` draws them."""
    pairs = pairs + randbelow(stream, 1)  # random.randint(pairs, pairs)
    keys = legacy.choice(num_keys, size=pairs, replace=False)
    values = legacy.choice(num_keys, size=pairs, replace=False)
    return keys, values, randbelow(stream, pairs)


def replay(
    lengths: Sequence[int] = LENGTHS,
    train_size: int = TRAIN_SET_SIZE,
    eval_size: int = EVAL_SET_SIZE,
    num_kv: int = NUM_KV,
    seed: int = TINYLANG_SEED,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Replay make_languages.py over `lengths` (one seeding, languages in order) and return the last
    language's sets: ``{"train": (keys [N, P], values [N, P], queried [N]), "test": (...)}``, with
    P = lengths[-1] // 2 pairs, keys and values as indices 0..num_kv/2 - 1."""
    stream, legacy = random.Random(seed), np.random.RandomState(seed)
    sets: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for length in lengths:
        for name, size in (("train", train_size), ("test", eval_size)):
            documents = [draw_document(stream, legacy, length // 2, num_kv // 2) for _ in range(size)]
            sets[name] = (
                np.array([keys for keys, _, _ in documents], dtype=np.int64).reshape(size, length // 2),
                np.array([values for _, values, _ in documents], dtype=np.int64).reshape(size, length // 2),
                np.array([queried for _, _, queried in documents], dtype=np.int64),
            )
    return sets


def as_batch(task, keys: np.ndarray, values: np.ndarray, queried: np.ndarray, spare_seed: int = SPARE_SEED):
    """Return the documents as rows of hookmech's AR `task` (a `Batch`: tokens ``[N, 2P + 3]``,
    answers ``[N]``, roles key/value/divider/query), the corruption a key absent from its row."""
    import torch

    from hookmech.errors import UsageError
    from hookmech.tasks.batch import Batch

    rows, pairs = keys.shape
    if pairs != task.num_kv_pairs or 2 * (int(max(keys.max(), values.max())) + 1) > task.vocab_size:
        raise UsageError(f"documents of {pairs} pairs over {int(keys.max()) + 1}+ keys do not fit the task {task.spec}")
    half, index = task.vocab_size // 2, np.arange(rows)
    tokens = np.empty((rows, task.n_ctx), dtype=np.int64)
    tokens[:, 0] = task.bos_id
    tokens[:, 1 : 2 * pairs + 1 : 2] = keys
    tokens[:, 2 : 2 * pairs + 2 : 2] = values + half
    tokens[:, 2 * pairs + 1] = task.divider_id
    tokens[:, 2 * pairs + 2] = keys[index, queried]
    key_pos = 1 + 2 * queried
    corrupt = tokens.copy()
    corrupt[index, key_pos] = _absent_keys(keys, half, np.random.default_rng(spare_seed))

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))

    return Batch(
        tokens=tensor(tokens),
        corrupt_tokens=tensor(corrupt),
        answers=tensor(values[index, queried] + half),
        lengths=torch.full((rows,), task.n_ctx, dtype=torch.int64),
        doc_index=torch.arange(rows, dtype=torch.int64),
        roles={
            "key": tensor(key_pos),
            "value": tensor(key_pos + 1),
            "query": torch.full((rows,), task.n_ctx - 1, dtype=torch.int64),
            "divider": torch.full((rows,), task.n_ctx - 2, dtype=torch.int64),
        },
    )


def _absent_keys(keys: np.ndarray, num_keys: int, rng: np.random.Generator) -> np.ndarray:
    """Return ``[N]`` keys, each uniform over the keys its row does not hold (redrawn on a clash)."""
    spare = rng.integers(0, num_keys, size=len(keys))
    clash = (keys == spare[:, None]).any(axis=1)
    while clash.any():
        spare[clash] = rng.integers(0, num_keys, size=int(clash.sum()))
        clash = (keys == spare[:, None]).any(axis=1)
    return spare


def describe(keys: np.ndarray, values: np.ndarray, queried: int) -> str:
    """Return a document as tinylang's `prettify` prints it (``<bos> k… v… … <eos> k_q v_q <eos>``)."""
    pairs = " ".join(f"k{key} v{value}" for key, value in zip(keys, values, strict=True))
    return f"<bos> {pairs} <eos> k{keys[queried]} v{values[queried]} <eos>"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--out", required=True, help="dataset file to write (HDF5)")
    parser.add_argument(
        "--lengths",
        default=",".join(map(str, LENGTHS)),
        help="the languages' lengths, made in this order under one seeding; the file holds the last's "
        "training set (default %(default)s; 32 alone replays the later make_languages.py, which reseeds "
        "for each language)",
    )
    args = parser.parse_args()
    from hookmech import tasks
    from hookmech.datasets import save_dataset
    from hookmech.fileio import sha256_of

    lengths = [int(length) for length in args.lengths.split(",")]
    sets = replay(lengths)
    task = tasks.make("ar", vocab_size=NUM_KV, num_kv_pairs=lengths[-1] // 2)
    save_dataset(as_batch(task, *sets["train"]), task, args.out)
    keys, values, queried = sets["test"]
    rows = len(sets["train"][0])
    print(f"wrote {args.out}: {rows} training documents of ar_{lengths[-1]} (sha256 {sha256_of(args.out)})")
    print(f"its first test document: {describe(keys[0], values[0], int(queried[0]))}")


if __name__ == "__main__":
    main()
