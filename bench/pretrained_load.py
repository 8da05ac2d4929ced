"""Loading a pretrained folder: `hookmech.from_pretrained` as it is (the model built undrawn on the
meta device, then filled from the folder) against the same load drawing random weights first (the
ordinary ``HookedLM(cfg)``), in one process, best of --reps each, after one warm-up load (the
folder in the page cache, the imports done).

The folders are bench/pretrained_commands.py's (random weights at the shapes of Pythia-160m and
Mamba-130m, made under --tmp on first use).

    python bench/pretrained_load.py --threads 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from pretrained_commands import make_folder

import hookmech
import hookmech.pretrained as pretrained


def seconds_to_load(folder: Path, reps: int) -> float:
    """Return the best wall time of `reps` loads of `folder`."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        hookmech.from_pretrained(folder)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["pythia", "mamba"])
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/hookmech-pretrained-bench"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    undrawn = pretrained._unfilled_model
    for name in args.models:
        folder = make_folder(name, args.tmp)
        hookmech.from_pretrained(folder)
        fast = seconds_to_load(folder, args.reps)
        pretrained._unfilled_model = lambda model_class, cfg: model_class(cfg)  # type: ignore[assignment]
        drawn = seconds_to_load(folder, args.reps)
        pretrained._unfilled_model = undrawn
        print(f"{name}: drawn first {drawn:.2f} s, undrawn {fast:.2f} s: {drawn / fast:.1f}x")


if __name__ == "__main__":
    main()
