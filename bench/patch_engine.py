"""Time the patching engine against the plain `run_with_hooks` loop on the paper's sweep.

The sweep (paper 000 §4): every block-level site of a model x the positions key, value,
query, divider x 320 AR examples, random-init models. Two scales:

* default: vocab 64, 4 pairs (11 positions), d_model 64; then the sweep grows: 4 layers, and
  every position (`all`);
* `--paper-ar`: the paper's AR setting, vocab 8192, 16 pairs (35 positions), d_model 128,
  2 layers, the four roles.

Same process, same model, same batch: `hookmech.oracles.plain_loop_patch` (one full
corrupt forward per (site, position), frozen) against `hookmech.patching.patch` (the engine, from
the batch, i.e. computing its clean and corrupt runs itself), interleaved, best of `--reps`.
Prints both times, the ratio, and the largest |Δp| between them.

    python bench/patch_engine.py [--paper-ar] [--mixers attention,mamba] [--n 320] [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch

import hookmech
from hookmech.config import build_config
from hookmech.patching import patch
from hookmech.oracles import plain_loop_patch

ROLES = ["key", "value", "query", "divider"]


def all_mixers() -> str:
    """Every mixer whose spec says the benches include it (`MixerSpec.bench`), comma-separated."""
    from hookmech.mixers import SPECS

    return ",".join(name for name, spec in sorted(SPECS.items()) if spec.bench)


def timed(run) -> tuple[float, object]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", default=None, help=f"default: attention,mamba; with --paper-ar: {all_mixers()}")
    parser.add_argument("--paper-ar", action="store_true", help="vocab 8192, 16 pairs, d_model 128, 2 layers")
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--d-model", type=int, default=None, help="default: 64; 128 with --paper-ar")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=1, help="best of this many interleaved repetitions")
    parser.add_argument("--quick", action="store_true", help="only the 2-layer, 4-position sweep")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mixers = args.mixers or (all_mixers() if args.paper_ar else "attention,mamba")
    d_model = args.d_model or (128 if args.paper_ar else 64)
    vocab, pairs = (8192, 16) if args.paper_ar else (64, 4)
    task = hookmech.tasks.make("ar", vocab_size=vocab, num_kv_pairs=pairs)
    batch = task.sample(args.n, seed=1)
    quick = args.quick or args.paper_ar
    grid = [(2, ROLES)] if quick else [(2, ROLES), (4, ROLES), (2, ["all"]), (4, ["all"])]
    print(
        f"AR vocab {vocab}, {pairs} pairs ({batch.tokens.shape[1]} positions), d_model {d_model}, N={args.n}, "
        f"{args.threads} thread(s), best of {args.reps}"
    )
    header = f"{'mixer':<10} {'layers':>6} {'positions':>9} {'cells':>5} {'plain s':>8} {'engine s':>8} {'ratio':>6}"
    print(f"{header} {'max |dp|':>9}")
    for mixer in mixers.split(","):
        for n_layers, positions in grid:
            torch.manual_seed(0)
            config = build_config(
                d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=mixer, d_model=d_model, n_layers=n_layers
            )
            model = hookmech.HookedLM(config).eval()
            patch(model, batch.select(slice(0, 8)), ["L0.block_in"], ["key"])  # warm-up
            plain_s = engine_s = float("inf")
            for _ in range(args.reps):  # interleaved: the machine is shared and noisy
                seconds, reference = timed(lambda m=model, p=positions: plain_loop_patch(m, batch, ["all"], p))
                plain_s = min(plain_s, seconds)
                seconds, records = timed(
                    lambda m=model, p=positions: patch(m, batch, ["all"], p, max_batch=args.max_batch)
                )
                engine_s = min(engine_s, seconds)
            worst = max(abs(r["p_patched"] - reference[r["hook"], r["pos"]]["p_patched"]) for r in records)
            label = "4 roles" if positions == ROLES else "all"
            print(
                f"{mixer:<10} {n_layers:>6} {label:>9} {len(records):>5} {plain_s:>8.2f} {engine_s:>8.2f} "
                f"{plain_s / engine_s:>6.2f} {worst:>9.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
