"""Time the patching engine against the plain `run_with_hooks` loop on the paper's sweep.

The sweep (paper 000 §4): every block-level site of a model x the positions key, value,
query, divider x 320 AR examples (vocab 64, 4 pairs), random-init models of d_model 64.
Same process, same model, same batch: `hookmech.patching.plain_loop.plain_loop_patch` (one full
corrupt forward per (site, position)) against `hookmech.patching.patch` (the engine, from
the batch, i.e. computing its clean and corrupt runs itself). Then the sweep grows: 4 layers,
and every position (`all`). Prints both times, the ratio, and the largest |Δp| between them.

    python bench/patch_engine.py [--mixers attention,mamba] [--n 320] [--threads 1] [--max-batch 256]
"""
from __future__ import annotations

import argparse
import time

import torch

import hookmech
from hookmech.config import build_config
from hookmech.patching import patch
from hookmech.patching.plain_loop import plain_loop_patch

ROLES = ["key", "value", "query", "divider"]


def timed(run) -> tuple[float, object]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", default="attention,mamba")
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="only the 2-layer, 4-position sweep")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    batch = task.sample(args.n, seed=1)
    grid = [(2, ROLES)] if args.quick else [(2, ROLES), (4, ROLES), (2, ["all"]), (4, ["all"])]
    print(f"{'mixer':<10} {'layers':>6} {'positions':>9} {'cells':>5} {'plain s':>8} {'engine s':>8} {'ratio':>6} {'max |dp|':>9}")
    for mixer in args.mixers.split(","):
        for n_layers, positions in grid:
            torch.manual_seed(0)
            model = hookmech.HookedLM(build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=mixer,
                                                   d_model=args.d_model, n_layers=n_layers)).eval()
            patch(model, batch.select(slice(0, 8)), ["L0.block_in"], ["key"])  # warm-up
            plain_s, reference = timed(lambda: plain_loop_patch(model, batch, ["all"], positions))
            engine_s, records = timed(lambda: patch(model, batch, ["all"], positions, max_batch=args.max_batch))
            worst = max(abs(r["p_patched"] - reference[r["hook"], r["pos"]]["p_patched"]) for r in records)
            label = "4 roles" if positions == ROLES else "all"
            print(f"{mixer:<10} {n_layers:>6} {label:>9} {len(records):>5} {plain_s:>8.2f} {engine_s:>8.2f} "
                  f"{plain_s / engine_s:>6.2f} {worst:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
