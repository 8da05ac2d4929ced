"""Inside-mixer patches resumed from the patched position against the all-position path.

For each mixer: a random-init 2-layer model at paper 000's AR setting (vocab 8192, 16 pairs,
`--d-model` 128), 320 examples (seed 1), its state and q/k/v hooks (or their analogues, below)
in both layers x the positions key, value, query, divider. The same engine call twice, same
process, interleaved, best of `--reps`: with mixer contexts (resumed runs: the patched block on
the window from the patch to the query, later blocks too) and with `context_memory=0` (every
patch runs on every position from its block: what inside hooks always did before they could be
resumed). Prints both times, the ratio, and the largest |Δp| between the two paths.

    python bench/inside_hooks.py [--mixers attention,mamba] [--n 320] [--d-model 128] [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch

import hookmech
from hookmech.config import build_config
from hookmech.patching import patch

ROLES = ["key", "value", "query", "divider"]
#: per mixer, its state and q/k/v hooks (Mamba: B ~ key, C ~ query; Hyena: x1, x2, v; BaseConv: its projection and conv)
HOOKS = {
    "attention": ["q", "k", "v"],
    "mamba": ["B", "C", "ssm_state"],
    "mamba2": ["B", "C", "ssm_state"],
    "deltanet": ["q", "k", "v", "state"],
    "rwkv": ["r", "k", "v", "state"],
    "based": ["q", "k", "v", "kv_state"],
    "h3": ["q", "k", "v", "kv"],
    "hyena": ["x1", "x2", "v"],
    "baseconv": ["proj", "conv"],
}


def timed(run) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", default=",".join(HOOKS))
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = hookmech.tasks.make("ar", vocab_size=8192, num_kv_pairs=16)
    batch = task.sample(args.n, seed=1)
    print(
        f"paper AR (vocab 8192, 16 pairs, {batch.tokens.shape[1]} positions), d_model {args.d_model}, 2 layers, "
        f"N={args.n}, positions {','.join(ROLES)}, best of {args.reps}"
    )
    header = f"{'mixer':<10} {'hooks':<22} {'cells':>5} {'all-position s':>14} {'resumed s':>9} {'ratio':>6}"
    print(f"{header} {'max |dp|':>9}")
    for mixer in args.mixers.split(","):
        torch.manual_seed(0)
        config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=mixer, d_model=args.d_model, n_layers=2)
        model = hookmech.HookedLM(config).eval()
        sites = [f"L*.mixer.{name}" for name in HOOKS[mixer]]
        patch(model, batch.select(slice(0, 4)), sites, ["key"])  # warm-up
        full_s = resumed_s = float("inf")
        for _ in range(args.reps):  # interleaved: the machine is shared
            seconds, full = timed(lambda m=model, s=sites: patch(m, batch, s, ROLES, context_memory=0))
            full_s = min(full_s, seconds)
            seconds, resumed = timed(lambda m=model, s=sites: patch(m, batch, s, ROLES))
            resumed_s = min(resumed_s, seconds)
        worst = max(abs(a["p_patched"] - b["p_patched"]) for a, b in zip(full, resumed, strict=True))
        print(
            f"{mixer:<10} {','.join(HOOKS[mixer]):<22} {len(resumed):>5} {full_s:>14.2f} {resumed_s:>9.2f} "
            f"{full_s / resumed_s:>6.2f} {worst:>9.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
