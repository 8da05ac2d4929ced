"""Attribution patching (AtP) against the exact engine: time and rank agreement.

For each checkpoint: every block-level site × every position (`--pos all`) on `--n` examples
(seed 1), once with the exact engine (`hookmech.patching.patch`) and once with AtP
(`hookmech.patching.attribution_patch`), both from the same `Batch` in the same process (each
computes its own clean and corrupt runs). Prints both times (best of `--reps`, interleaved),
the ratio exact / AtP, and the rank agreement of the two scores (p_patched − p_corrupt per
site × position, at a resolution of 1e-6: smaller differences are float noise, the exact
engine is exact to 1e-5): Spearman's rho over all cells (ties get average ranks) and
the exact effect of AtP's 10 strongest cells relative to the 10 strongest exact cells.

    python bench/atp.py [CKPT ...] [--n 320] [--reps 2] [--threads 1]

Default checkpoints: the bundled fixtures/attention_ar_cpu.safetensors and fixtures/mamba_ar_cpu.safetensors.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hookmech
from hookmech.patching import attribution_patch
from hookmech.patching import patch

DEFAULTS = [("fixtures/attention_ar_cpu.safetensors",), ("fixtures/mamba_ar_cpu.safetensors",)]
RESOLUTION = 1e-6


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n of `values` ``[n]``, ties sharing their mean rank (as scipy.stats.rankdata)."""
    order = torch.argsort(values, stable=True)
    ranks = torch.empty(len(values), dtype=torch.float64)
    sorted_values = values[order]
    start = 0
    while start < len(values):
        stop = start
        while stop + 1 < len(values) and sorted_values[stop + 1] == sorted_values[start]:
            stop += 1
        ranks[order[start : stop + 1]] = (start + stop) / 2 + 1
        start = stop + 1
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two ``[n]`` tensors (Pearson of average ranks)."""
    ra, rb = average_ranks(a.double()), average_ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra @ rb) / (ra.norm() * rb.norm()))


def bench(path: str, n: int, reps: int) -> None:
    model, task = hookmech.load(path), hookmech.tasks.from_checkpoint(path)
    batch = task.sample(n, seed=1)
    runs = {
        "exact": lambda: patch(model, batch, ["all"], ["all"]),
        "atp": lambda: attribution_patch(model, batch, ["all"], ["all"]),
    }
    best = {name: float("inf") for name in runs}
    results = {}
    for _ in range(reps):
        for name, run in runs.items():
            start = time.perf_counter()
            results[name] = run()
            best[name] = min(best[name], time.perf_counter() - start)
    exact, atp = results["exact"], results["atp"]
    assert [(r["hook"], r["pos"]) for r in exact] == [(r["hook"], r["pos"]) for r in atp]
    exact_change, atp_change = (
        torch.round(torch.tensor([r["p_patched"] - r["p_corrupt"] for r in records], dtype=torch.float64) / RESOLUTION)
        * RESOLUTION for records in (exact, atp))
    # Many exact cells tie (attribution 1.0 along the whole path): compare effect mass, not identities.
    top_exact = torch.argsort(-exact_change.abs())[:10]
    top_atp = torch.argsort(-atp_change.abs())[:10]
    top_mass = exact_change[top_atp].abs().sum() / exact_change[top_exact].abs().sum()
    mixers = ",".join(dict.fromkeys(model.cfg.mixers))
    print(f"{Path(path).name} ({mixers}, {model.cfg.n_layers} layers, d_model {model.cfg.d_model}): "
          f"{len({r['hook'] for r in exact})} sites x {len({r['pos'] for r in exact})} positions = {len(exact)} cells, "
          f"N={n}, p_clean {exact[0]['p_clean']:.3f}, p_corrupt {exact[0]['p_corrupt']:.3f}")
    print(f"  exact engine {best['exact']:.3f} s   AtP {best['atp']:.3f} s   ratio exact/AtP {best['exact'] / best['atp']:.1f}x")
    print(f"  Spearman rho (all cells) {spearman(exact_change, atp_change):.3f}   "
          f"exact effect of AtP's top 10 / of exact's top 10 {top_mass:.2f}   "
          f"max |AtP - exact| (p) {(atp_change - exact_change).abs().max():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpts", nargs="*")
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ckpts = args.ckpts or [next((p for p in options if Path(p).exists()), None) for options in DEFAULTS]
    for path in ckpts:
        if path is None:
            print("(a default checkpoint is missing: see the module docstring)")
            continue
        bench(path, args.n, args.reps)


if __name__ == "__main__":
    main()
