"""Overhead of `hookmech train --mech-every K` (attributions during training) vs training alone.

Trains the same run twice (same seed, one thread): plain, and with the mechanistic callback at
a given K (default: the CLI's, every second evaluation) on the default dev batch (n_dev rows, L1.block_in at key,
value, query). Prints both wall times and the ratio; the trained weights must be identical.

    python bench/mech_overhead.py [--steps 1000] [--d-model 64] [--mixer attention]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import hookmech
from hookmech.config import build_config
from hookmech.mech import DEFAULT_EVERY_EVALS, DEFAULT_POSITIONS, DEFAULT_SITES, mech_callback
from hookmech.training import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--mixer", default="attention")
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--every", type=int, default=None, help="--mech-every (default: the CLI's default)")
    args = parser.parse_args()
    every = args.every or DEFAULT_EVERY_EVALS * args.eval_every
    torch.set_num_threads(1)
    task = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=args.mixer, d_model=args.d_model,
                                n_layers=2, tie_embeddings=False)
    config = TrainConfig(lr=3e-3, epochs=None, steps=args.steps, n_train=0, eval_every=args.eval_every,
                         ckpt_every=args.steps)
    times, cpu = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        # alternate the two kinds so a change in the machine's load hits both alike
        for label in ("plain", "mech", "plain2", "mech2", "plain3", "mech3"):
            on_eval = None
            if label.startswith("mech"):
                on_eval = mech_callback(task, model_config, sites=DEFAULT_SITES, positions=DEFAULT_POSITIONS,
                                        every=every, eval_every=config.eval_every,
                                        total_steps=config.total_steps(), n=config.n_dev, seed=config.seed)
            began, began_cpu = time.perf_counter(), time.process_time()
            train(task, model_config, config, Path(tmp) / label, progress=False, on_eval=on_eval, log=lambda m: None)
            times[label] = time.perf_counter() - began
            cpu[label] = time.process_time() - began_cpu
        same = all(torch.equal(a, b) for a, b in zip(hookmech.load(Path(tmp) / "plain" / "model.safetensors").state_dict().values(),
                                                      hookmech.load(Path(tmp) / "mech" / "model.safetensors").state_dict().values()))
    print(f"{args.mixer} d_model {args.d_model}, {args.steps} steps, eval every {args.eval_every}, mech every {every}, 1 thread "
          f"(best of 3, alternated)")
    for name, table in (("wall", times), ("cpu", cpu)):
        plain = min(v for k, v in table.items() if k.startswith("plain"))
        mech = min(v for k, v in table.items() if k.startswith("mech"))
        print(f"{name:4s} baseline (train alone): {plain:.2f} s   with --mech-every {every}: {mech:.2f} s   "
              f"ratio {mech / plain:.3f} (overhead {100 * (mech / plain - 1):.1f}%)")
    print(f"same weights with and without the callback: {same}")


if __name__ == "__main__":
    main()
