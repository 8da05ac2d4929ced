"""Where AtP*'s time goes at Mamba-130m's shape: each phase timed by perf counters around it.

The setup of bench/pretrained_atp.py (random weights, 8 AR documents of 63 tokens, every
``L*.block_in`` x every position, GradDrop off); best of `--reps` runs, each phase in
forward-equivalents (its time over one forward of the same rows, `model(tokens)`). Nested phases
are indented under the phase that contains them.

    python bench/pretrained_atp_phases.py [--reps 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

import hookmech
from hookmech.mixers import mamba_effects
from hookmech.patching import atp_star, atp_star_patch, atp_star_query, atp_star_resumed
from hookmech.patching import runs as runs_module

sys.path.insert(0, str(Path(__file__).parent))
from pretrained_engine import SHAPES, build  # noqa: E402

#: (owner, method, label) of each phase timed
PHASES = [
    (runs_module.CleanCorruptRuns, "_compute", "the clean run"),
    (atp_star._Estimator, "_backward", "the corrupt forward and its backward"),
    (atp_star_resumed.ResumedCorruptRun, "run", "  resumed at the first corrupted token"),
    (torch.autograd, "grad", "  of which the backward passes"),
    (mamba_effects._WindowEffects, "__call__", "    of which Mamba's effects by the backward"),
    (atp_star._Estimator, "_exact_terms", "the exact terms"),
    (mamba_effects.MambaPatchEffects, "exact_patch_effects", "  Mamba's per-position effects after the backward"),
    (mamba_effects.MambaPatchEffects, "_compute_base_branch", "    the base run's decays and states"),
    (mamba_effects.MambaPatchEffects, "_patched_reach", "    the d_conv patched steps"),
    (mamba_effects.MambaPatchEffects, "position_patch_outputs", "  the output change at the query"),
    (atp_star_query.QueryStep, "correction", "  the last block's query step"),
]


def timing(spent: dict[str, float], owner, name: str, label: str) -> None:
    """Replace ``owner.name`` by itself adding its time to ``spent[label]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spent: dict[str, float] = {}
    for owner, name, label in PHASES:
        timing(spent, owner, name, label)
    batch = hookmech.tasks.make("ar", vocab_size=8192, num_kv_pairs=30).sample(8, seed=1)
    model = build(SHAPES["mamba"])
    atp_star_patch(model, batch.select(slice(0, 2)), ["L0.block_in"], ["all"])  # warm-up
    best: tuple[float, float, float, dict[str, float]] | None = None
    for _ in range(args.reps):
        with torch.no_grad():
            start = time.perf_counter()
            model(batch.corrupt_tokens)
            forward = time.perf_counter() - start
        spent.clear()
        start = time.perf_counter()
        atp_star_patch(model, batch, ["L*.block_in"], ["all"])
        total = time.perf_counter() - start
        if best is None or total / forward < best[0]:
            best = (total / forward, forward, total, dict(spent))
    assert best is not None
    ratio, forward, total, phases = best
    print(f"Mamba-130m: one forward {forward:.2f} s; AtP* {total:.2f} s = {ratio:.2f} forward-equivalents")
    for _, _, label in PHASES:
        print(f"  {label:45s} {phases.get(label, 0.0):6.2f} s  {phases.get(label, 0.0) / forward:5.2f}")


if __name__ == "__main__":
    main()
