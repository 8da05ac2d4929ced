"""Inside-mixer patches resumed from the patched position against the all-position path.

For each mixer: a random-init 2-layer model at paper 000's AR setting (vocab 8192, 16 pairs,
`--d-model` 128), 320 examples (seed 1), its state and q/k/v hooks (or their analogues, below)
in both layers x the positions key, value, query, divider. The same engine call twice, same
process, interleaved, best of `--reps`: with mixer contexts (resumed runs: the patched block on
the window from the patch to the query, later blocks too) and with `context_memory=0` (every
patch runs on every position from its block: what inside hooks always did before they could be
resumed). Prints both times, the ratio, and the largest |Δp| between the two paths.

With `--baseline-src DIR` (a checkout of an earlier commit, e.g. `git worktree add --detach DIR
b4fd28b`: the code issue 13 measured against, where inside hooks always ran every position) it
also times that code's `patch` on the same cells, in a child process importing hookmech from DIR
(warmed up as this process is; interleaved with the other two, best of `--reps`), and prints its
time, the resumed path's ratio against it and the largest |Δp| between the two.

    python bench/inside_hooks.py [--mixers attention,mamba] [--n 320] [--d-model 128] [--threads 1] [--reps 3]
                                 [--baseline-src DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import hookmech
from hookmech.config import build_config
from hookmech.patching import patch

ROLES = ["key", "value", "query", "divider"]


def bench_hooks() -> dict[str, list[str]]:
    """Per benched mixer, the inside hooks its spec names for the benches (`hookmech.oracles.mixer_cases.BENCH_HOOKS`:
    its state and q/k/v hooks; Mamba: B ~ key, C ~ query; Hyena: x1, x2, v; BaseConv: its
    projection and conv). Read in the parent process only: a `--baseline-src` child may import a
    hookmech from before the specs, so it is given its hooks (`--hooks`)."""
    from hookmech.mixers import SPECS
    from hookmech.oracles.mixer_cases import BENCH_HOOKS

    return {name: list(BENCH_HOOKS.get(name, ())) for name, spec in sorted(SPECS.items()) if spec.bench}


def timed(run) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def setting(mixer: str, hooks: list[str], n: int, d_model: int):
    """Return (model, batch, sites) of one mixer's measurement, patching its inside `hooks`: the
    same in every process."""
    task = hookmech.tasks.make("ar", vocab_size=8192, num_kv_pairs=16)
    batch = task.sample(n, seed=1)
    torch.manual_seed(0)
    config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=mixer, d_model=d_model, n_layers=2)
    model = hookmech.HookedLM(config).eval()
    sites = [f"L*.mixer.{name}" for name in hooks]
    patch(model, batch.select(slice(0, 4)), sites, ["key"])  # warm-up
    return model, batch, sites


def child(args) -> None:
    """Time one engine call of whatever hookmech this process imports; print seconds and p_patched as JSON."""
    model, batch, sites = setting(args.mixers, args.hooks.split(","), args.n, args.d_model)
    seconds, records = timed(lambda: patch(model, batch, sites, ROLES))
    print(json.dumps({"seconds": seconds, "p_patched": [r["p_patched"] for r in records]}))


def baseline_run(args, mixer: str, hooks: list[str]) -> tuple[float, list[float]]:
    """Run `child` in a process that imports hookmech from `--baseline-src`."""
    command = [sys.executable, __file__, "--child", "--mixers", mixer, "--hooks", ",".join(hooks), "--n", str(args.n),
               "--d-model", str(args.d_model), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(args.baseline_src)}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["seconds"], result["p_patched"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", default=None, help="default: every mixer whose spec says the benches include it")
    parser.add_argument("--hooks", default=None, help=argparse.SUPPRESS)  # a --child's hooks
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline-src", default=None, help="a checkout of an earlier commit to time as well")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        return child(args)
    hooks = bench_hooks()
    mixers = args.mixers.split(",") if args.mixers else list(hooks)
    n_pos = hookmech.tasks.make("ar", vocab_size=8192, num_kv_pairs=16).sample(1, seed=1).tokens.shape[1]
    print(
        f"paper AR (vocab 8192, 16 pairs, {n_pos} positions), d_model {args.d_model}, 2 layers, "
        f"N={args.n}, positions {','.join(ROLES)}, best of {args.reps}"
        + (f", baseline {args.baseline_src}" if args.baseline_src else "")
    )
    header = f"{'mixer':<10} {'hooks':<22} {'cells':>5} {'all-position s':>14} {'resumed s':>9} {'ratio':>6}"
    header += f" {'max |dp|':>9}"
    if args.baseline_src:
        header += f" {'baseline s':>10} {'ratio':>6} {'max |dp|':>9}"
    print(header)
    for mixer in mixers:
        model, batch, sites = setting(mixer, hooks[mixer], args.n, args.d_model)
        full_s = resumed_s = base_s = float("inf")
        for _ in range(args.reps):  # interleaved: the machine is shared
            if args.baseline_src:
                seconds, base_p = baseline_run(args, mixer, hooks[mixer])
                base_s = min(base_s, seconds)
            seconds, full = timed(lambda m=model, b=batch, s=sites: patch(m, b, s, ROLES, context_memory=0))
            full_s = min(full_s, seconds)
            seconds, resumed = timed(lambda m=model, b=batch, s=sites: patch(m, b, s, ROLES))
            resumed_s = min(resumed_s, seconds)
        worst = max(abs(a["p_patched"] - b["p_patched"]) for a, b in zip(full, resumed, strict=True))
        line = (f"{mixer:<10} {','.join(hooks[mixer]):<22} {len(resumed):>5} {full_s:>14.2f} {resumed_s:>9.2f} "
                f"{full_s / resumed_s:>6.2f} {worst:>9.1e}")
        if args.baseline_src:
            worst_base = max(abs(a - b["p_patched"]) for a, b in zip(base_p, resumed, strict=True))
            line += f" {base_s:>10.2f} {base_s / resumed_s:>6.2f} {worst_base:>9.1e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
