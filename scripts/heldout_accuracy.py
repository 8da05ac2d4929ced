#!/usr/bin/env python
"""Score a sweep run's checkpoint on larger dev (and, for a split task, test) sets than its
sweep's 320 documents.

    python scripts/heldout_accuracy.py CHECKPOINT... [--n 4096] [--seed 11]

For each checkpoint (a sweep run's model.safetensors) it samples --n documents of the task the
checkpoint was trained on and writes ``heldout-<n>.json`` beside it: per split the accuracy, the
mean p(answer) and the accuracy's binomial standard error. A checkpoint trained on a split task
(paper 000 §5.3) is scored on both splits, dev (in-distribution pairs) and test (held-out pairs);
any other on dev only. Why: a sweep's dev and test sets are 320 documents, as the paper's
(tinylang's ``num_eval_steps`` 5 × ``eval_batch_size`` 64), and an accuracy near 0.5 on 320
documents has a standard error of 2.8 points, about the size of the differences docs/results.md
weighs. The documents are drawn with seed ``(seed, 0)`` for dev and ``(seed, 1)`` for test. With the
run's own seed, ``--n 320`` draws the sweep's test set (test.json's number, exactly), but not its dev
set (the sweep's is ``(seed, 1)`` of the training split): keep the default seed, apart from every
sweep run's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from hookmech import tasks
from hookmech.checkpoint import load, read_metadata
from hookmech.errors import HookmechError
from hookmech.fileio import write_text_atomic
from hookmech.training import evaluate

SPLITS = ("dev", "test")


def score(checkpoint: Path, n: int, seed: int) -> dict[str, Any]:
    """Return ``{"n", "seed", "dev": {...}}`` and, for a split task, ``"test": {...}``: each
    split's ``acc``, ``acc_se`` (binomial standard error, sqrt(acc (1 - acc) / n)) and
    ``p_answer`` over `n` documents."""
    task_spec = read_metadata(checkpoint)["task"]
    if not task_spec:
        raise HookmechError(f"{checkpoint}: it names no task (a sweep run's checkpoint does)")
    is_split = task_spec.get("split") is not None
    model = load(checkpoint)
    out: dict[str, Any] = {"n": n, "seed": seed}
    for index, split in enumerate(SPLITS if is_split else SPLITS[:1]):
        spec = {**task_spec, "split": split} if is_split else task_spec
        scores = evaluate(model, tasks.from_spec(spec).sample(n, seed=(seed, index)))
        acc = scores["dev_acc"]
        out[split] = {"acc": acc, "acc_se": math.sqrt(acc * (1 - acc) / n), "p_answer": scores["dev_p_answer"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--n", type=int, default=4096, help="documents per split (default 4096)")
    parser.add_argument("--seed", type=int, default=11, help="seed of the documents (default 11)")
    args = parser.parse_args(argv)
    for checkpoint in args.checkpoints:
        try:
            result = score(checkpoint, args.n, args.seed)
        except HookmechError as error:
            print(f"heldout_accuracy: {error}", file=sys.stderr)
            return 1
        write_text_atomic(checkpoint.parent / f"heldout-{args.n}.json", json.dumps(result, indent=1) + "\n")
        scored = [split for split in SPLITS if split in result]
        scores = ", ".join(f"{split} {result[split]['acc']:.3f} ± {result[split]['acc_se']:.3f}" for split in scored)
        print(f"{checkpoint}: {scores}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
