"""AtP* over the full site x position grid at pretrained size: its cost, and its top K re-run exactly.

Shapes, weights and data as bench/pretrained_engine.py (Pythia-160m and Mamba-130m shapes, random
weights, AR documents of 63 tokens). The grid: every ``L*.block_in`` x every position (`--pos
all`: 12 x 63 = 756 cells for Pythia, 24 x 63 = 1512 for Mamba). Per shape, in one process:

* AtP* (`atp_star_patch`, GradDrop off, its default) on `--n` rows, timed `--reps` times, in
  forward-equivalents: its time over one forward of the same rows (`model(tokens)`, no hooks,
  logits everywhere: bench/atp.py's unit) timed just before it, the median over reps;
* with `--whole-forward`, AtP* again with its corrupt forward run whole rather than from each row's
  first corrupted token (the path before `hookmech/patching/atp_star_resumed.py`), alternated with
  it rep by rep, and their largest difference of p_patched;
* `verify_top` of its `--top` strongest cells (what `hookmech patch --method atp-star --verify-top K`
  runs), timed, and how many of them the exact engine also ranks among its `--top` strongest;
* the exact engine on the whole grid of the same rows (`--exact-n` of them, default `--n`; the
  slow part: hundreds of forward-equivalents), against which AtP*'s estimates are scored as
  bench/atp.py scores them (but unrounded: `changes`): Spearman's rho over all cells and the top-K
  overlap; and the verified cells' |exact - estimate|.

    python bench/pretrained_atp.py [--shapes pythia,mamba] [--n 8] [--top 20] [--reps 1] [--threads 1]
        [--exact-n N | --no-exact] [--whole-forward]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import hookmech
from hookmech.patching import atp_star, atp_star_patch, patch, verify_top

sys.path.insert(0, str(Path(__file__).parent))
from atp import spearman  # noqa: E402  (bench/atp.py's rank correlation)
from pretrained_engine import SHAPES, build  # noqa: E402


def timed(run) -> tuple[float, object]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def changes(records) -> torch.Tensor:
    """p_patched - p_corrupt of each record, unrounded: with random weights p(answer) is about
    1/d_vocab and the changes about 1e-7, under bench/atp.py's 1e-6 resolution (the engine is
    exact to about 1e-11 here: bench/pretrained_engine.py's max |dp|)."""
    return torch.tensor([r["p_patched"] - r["p_corrupt"] for r in records], dtype=torch.float64)


def paired(model, batch, run) -> tuple[tuple[float, float], object]:
    """Return ((one forward's seconds, ``run()``'s seconds), its result): the forward timed just before."""
    with torch.no_grad():
        forward_s = timed(lambda: model(batch.corrupt_tokens))[0]
    seconds, result = timed(run)
    return (forward_s, seconds), result


def cost(pairs: list[tuple[float, float]]) -> str:
    """Describe runs timed with `paired`: the median of their seconds and of their ratios to their forwards."""
    seconds = statistics.median(run_s for _, run_s in pairs)
    ratio = statistics.median(run_s / forward_s for forward_s, run_s in pairs)
    best = min(run_s / forward_s for forward_s, run_s in pairs)
    return f"{seconds:.1f} s (median of {len(pairs)}), {ratio:.2f} forward-equivalents (median; best {best:.2f})"


def whole_forward(model, batch) -> list:
    """AtP*'s records with its corrupt forward run whole (`atp_star_resumed.fires_on_windows` says no)."""
    resumable = atp_star.fires_on_windows
    atp_star.fires_on_windows = lambda model, hooks: False
    try:
        return atp_star_patch(model, batch, ["L*.block_in"], ["all"])
    finally:
        atp_star.fires_on_windows = resumable


def strongest(values: torch.Tensor, k: int) -> set[int]:
    """Return the indices of the `k` largest |values|."""
    return set(torch.argsort(-values.abs(), stable=True)[:k].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="pythia,mamba")
    parser.add_argument("--n", type=int, default=8, help="rows AtP* and verify_top run on")
    parser.add_argument("--exact-n", type=int, default=None, help="rows of the exact grid (default: --n)")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact grid (cost only)")
    parser.add_argument("--top", type=int, default=20, help="K of --verify-top")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--whole-forward", action="store_true", help="also time AtP* with the whole corrupt forward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = hookmech.tasks.make("ar", vocab_size=8192, num_kv_pairs=30)
    batch = task.sample(args.n, seed=1)
    print(f"AR, {args.n} documents of {batch.tokens.shape[1]} tokens, random weights, {args.threads} thread(s)")
    for key in args.shapes.split(","):
        bench_shape(key, batch, args)


def bench_shape(key: str, batch, args: argparse.Namespace) -> None:
    """Print AtP*'s cost, its verified top cells and its agreement with the exact grid at shape `key`."""
    shape = SHAPES[key]
    model = build(shape)
    atp_star_patch(model, batch.select(slice(0, 2)), ["L0.block_in"], ["all"])  # warm-up
    forward_s, star_s, whole_s = float("inf"), [], []
    records: list = []
    whole: list = []
    for _ in range(args.reps):
        # each AtP* run right after a forward of its own: the machine's speed may drift between reps
        seconds, records = paired(model, batch, lambda: atp_star_patch(model, batch, ["L*.block_in"], ["all"]))
        forward_s, star_s = min(forward_s, seconds[0]), [*star_s, seconds]
        if args.whole_forward:
            seconds, whole = paired(model, batch, lambda: whole_forward(model, batch))
            forward_s, whole_s = min(forward_s, seconds[0]), [*whole_s, seconds]
    verify_s, verified = timed(lambda: verify_top(model, batch, records, args.top))
    print(
        f"{shape.name}: {len(records)} cells; one forward {forward_s:.2f} s; AtP* {cost(star_s)}; "
        f"--verify-top {args.top}: {verify_s:.1f} s ({verify_s / forward_s:.1f} forward-equivalents)",
        flush=True,
    )
    if whole:
        moved = max(abs(a["p_patched"] - b["p_patched"]) for a, b in zip(records, whole, strict=True))
        print(f"  the whole corrupt forward: AtP* {cost(whole_s)}; largest |difference| of p_patched {moved:.2e}")
    gaps = sorted(abs(r["p_patched_exact"] - r["p_patched"]) for r in verified)
    print(f"  verified cells: largest |exact - AtP*| of p_patched {gaps[-1]:.2e}, median {gaps[len(gaps) // 2]:.2e}")
    if args.no_exact:
        return
    exact_rows = batch if args.exact_n in (None, args.n) else batch.select(slice(0, args.exact_n))
    star = records
    if exact_rows is not batch:
        star = atp_star_patch(model, exact_rows, ["L*.block_in"], ["all"])
    exact_s, exact = timed(lambda: patch(model, exact_rows, ["L*.block_in"], ["all"]))
    assert [(r["hook"], r["pos"]) for r in exact] == [(r["hook"], r["pos"]) for r in star]
    truth, estimate = changes(exact), changes(star)
    overlap = len(strongest(truth, args.top) & strongest(estimate, args.top))
    print(
        f"  exact grid on {len(exact_rows)} rows: {exact_s:.1f} s; Spearman {spearman(truth, estimate):.3f}, "
        f"top-{args.top} overlap {overlap}/{args.top}, largest |error| {(truth - estimate).abs().max():.2e} "
        f"(largest |exact| {truth.abs().max():.2e})",
        flush=True,
    )


if __name__ == "__main__":
    main()
