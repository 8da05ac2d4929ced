"""Time hookmech's `mamba` mixer against mambapy's parallel-scan Mamba on CPU.

Same process, same weights (mambapy's `MambaBlock` loads our state dict key for key),
B=16, L=256, d_model=64 (d_inner 128, d_state 16): forward+backward and forward-only
(no grad). Prints both times (best of `--reps`, the two models interleaved so that load
from other processes hits both alike) and the ratios mambapy / ours.

    python bench/mamba_scan.py [--batch 16] [--length 256] [--d-model 64] [--reps 10]
"""
from __future__ import annotations

import argparse
import time

import torch

from hookmech.mixers.mamba import Mamba


def best_times(candidates: dict, reps: int) -> dict[str, float]:
    """Return the best wall time in seconds of each zero-argument callable, interleaved."""
    best = {name: float("inf") for name in candidates}
    for run in candidates.values():
        run()  # warm-up
    for _ in range(reps):
        for name, run in candidates.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from mambapy.mamba import MambaBlock, MambaConfig

    torch.manual_seed(0)
    ours = Mamba(d_model=args.d_model)
    theirs = MambaBlock(MambaConfig(d_model=args.d_model, n_layers=1))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(args.batch, args.length, args.d_model, requires_grad=True)

    def forward_backward(model):
        def run():
            model.zero_grad(set_to_none=True)
            x.grad = None
            model(x).square().mean().backward()
        return run

    def forward_only(model):
        def run():
            with torch.no_grad():
                model(x)
        return run

    times = best_times(
        {
            "ours fwd+bwd": forward_backward(ours),
            "mambapy fwd+bwd": forward_backward(theirs),
            "ours fwd": forward_only(ours),
            "mambapy fwd": forward_only(theirs),
        },
        args.reps,
    )
    print(f"B={args.batch} L={args.length} d_model={args.d_model} threads={torch.get_num_threads()}")
    for mode in ("fwd+bwd", "fwd"):
        mine, base = times[f"ours {mode}"], times[f"mambapy {mode}"]
        print(f"{mode:8s} ours {mine * 1e3:7.1f} ms   mambapy {base * 1e3:7.1f} ms   "
              f"speed-up {base / mine:4.1f}x")


if __name__ == "__main__":
    main()
