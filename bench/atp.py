"""Attribution patching (AtP) and AtP* against the exact engine: accuracy, ranking and cost.

For each checkpoint: every block-level site x every position (`--pos all`) on `--n` examples
(seed 1), with the exact engine (`hookmech.patching.patch`), plain AtP (`method="atp"`) and AtP*
(`method="atp-star"`), all from the same `Batch` in the same process (each computes its own
clean and corrupt runs). Scores compared: p_patched - p_corrupt per cell, at a resolution of 1e-6
(smaller differences are float noise; the exact engine is exact to 1e-5). Per method:

* Spearman's rho over all cells (ties get average ranks);
* top-10 error: the largest |estimate - exact| among the 10 strongest exact cells;
* top-10 recall at a budget of B exact checks (`--verify-top B`, B in `--budgets`): the share of
  the 10 strongest exact cells (cells tied with the 10th count) among the B cells `verify_top`
  would check (`verify_priority`: |estimate|, and AtP*'s GradDrop score);
* cost in forward-equivalents: the method's time over the time of one forward (`model(tokens)`,
  no hooks) of the same rows; times are the best of `--reps`, methods interleaved.

Also timed: AtP*'s floor, what it cannot do without (`gradient_floor`): the clean run's
activations at every site (logits at the query alone); the corrupt run with one backward pass of
the answer's log-odds to the first block's mixer output (where its exact computations through the
first mixer start); and, per block, one exact computation of its mixer for every patched position
(`mixer_patch_effects` along one gradient, the least Kramár et al.'s fix of the first mixer a patch
reaches needs; zero time where a mixer has none). Where the floor alone exceeds a cost target, no
AtP* with that fix meets it.

    python bench/atp.py [CKPT ...] [--n 320] [--reps 3] [--threads 1] [--budgets 10,20]

Default checkpoints: the bundled fixtures/attention_ar_cpu.safetensors, mamba_ar_cpu.safetensors
and attention_ar_paper.safetensors.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hookmech
from hookmech.mixers.capabilities import PatchMemo
from hookmech.patching import atp_star_patch, patch
from hookmech.patching.atp import positional_hooks, verify_priority
from hookmech.patching.atp_star import answer_log_odds

DEFAULTS = [
    "fixtures/attention_ar_cpu.safetensors",
    "fixtures/mamba_ar_cpu.safetensors",
    "fixtures/attention_ar_paper.safetensors",
]
RESOLUTION = 1e-6
#: the estimators compared; "atp-star" is AtP* with GradDrop (`graddrop=True`), "atp-star, no
#: GradDrop" AtP* without its extra backward passes (the default)
METHODS = ("atp", "atp-star", "atp-star, no GradDrop")


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


def changes(records) -> torch.Tensor:
    """p_patched - p_corrupt of each record, rounded to RESOLUTION."""
    values = torch.tensor([r["p_patched"] - r["p_corrupt"] for r in records], dtype=torch.float64)
    return torch.round(values / RESOLUTION) * RESOLUTION


def scores(exact: torch.Tensor, records, budgets: list[int]) -> dict[str, float]:
    """Spearman, top-10 error and top-10 recall at each of `budgets` checks of one method's records."""
    estimate = changes(records)
    top = torch.argsort(-exact.abs(), stable=True)[:10]
    threshold = exact.abs()[top[-1]] - RESOLUTION  # cells tied with the 10th strongest count as found
    priority = torch.tensor([verify_priority(r) for r in records], dtype=torch.float64)
    order = torch.argsort(-priority, stable=True)
    return {
        "spearman": spearman(exact, estimate),
        "top10_error": (estimate[top] - exact[top]).abs().max().item(),
        **{f"recall@{b}": min(1.0, (exact.abs()[order[:b]] >= threshold).sum().item() / 10) for b in budgets},
    }


def gradient_floor(model, batch, sites: list[str]) -> None:
    """Run, for its time (returns None), the clean run caching the hooks `sites` and every mixer's
    input (no gradient, logits at the query); the corrupt run with one backward pass of the answer's
    log-odds to block 0's mixer output (`autograd.grad` to it alone, as AtP* takes its gradients: no
    weight gradients); then each block's `mixer_patch_effects` with the clean mixer input patched in
    at each position, along that gradient (the cost does not depend on which gradient)."""
    query, n_layers = batch.query_pos, model.cfg.n_layers
    mixer_inputs = [f"blocks.{layer}.hook_mixer_in" for layer in range(n_layers)]
    with torch.no_grad():
        _, clean = model.run_with_cache(
            batch.tokens, names_filter=[*sites, *mixer_inputs], positions=query, tail_at_positions=True
        )
    leaves, corrupt = [], {}

    def leaf(activation, hook=None):
        leaves.append(torch.zeros_like(activation, requires_grad=True))
        return activation + leaves[-1]

    def keep(activation, hook):
        corrupt[hook.name] = activation.detach()

    with torch.enable_grad():
        logits = model.run_with_hooks(
            batch.corrupt_tokens,
            positions=query,
            tail_at_positions=True,
            fwd_hooks=[("blocks.0.hook_mixer_out", leaf), *((name, keep) for name in mixer_inputs)],
        )
        (gradient,) = torch.autograd.grad(answer_log_odds(logits, batch.answers).sum(), leaves)
    with torch.no_grad():
        for layer, name in enumerate(mixer_inputs):
            model.mixer_patch_effects(layer, gradient[None], clean[name], corrupt.__getitem__, None, PatchMemo())


def bench(path: str, n: int, reps: int, budgets: list[int]) -> None:
    model, task = hookmech.load(path), hookmech.tasks.from_checkpoint(path)
    batch = task.sample(n, seed=1)
    sites, _ = positional_hooks(model, ["all"])
    best = {name: float("inf") for name in ("exact", "forward", "floor", *METHODS)}
    results = {}
    for _ in range(reps):
        for name in best:
            start = time.perf_counter()
            if name == "forward":
                with torch.no_grad():
                    model(batch.corrupt_tokens)
            elif name == "floor":
                gradient_floor(model, batch, sites)
            elif name == "exact" and "exact" in results:
                continue  # once is enough: its time is only reported
            elif name == METHODS[1]:  # GradDrop is opt-in
                results[name] = atp_star_patch(model, batch, ["all"], ["all"], graddrop=True)
            elif name == METHODS[2]:
                results[name] = atp_star_patch(model, batch, ["all"], ["all"], graddrop=False)
            else:
                results[name] = patch(model, batch, ["all"], ["all"], method=name)
            best[name] = min(best[name], time.perf_counter() - start)
    exact = changes(results["exact"])
    for name in METHODS:
        assert [(r["hook"], r["pos"]) for r in results[name]] == [(r["hook"], r["pos"]) for r in results["exact"]]
    mixers = ",".join(dict.fromkeys(model.cfg.mixers))
    records = results["exact"]
    print(f"{Path(path).name} ({mixers}, {model.cfg.n_layers} layers, d_model {model.cfg.d_model}, "
          f"{batch.tokens.shape[1]} positions): {len({r['hook'] for r in records})} sites x "
          f"{len({r['pos'] for r in records})} positions = {len(records)} cells, N={n}, "
          f"p_clean {records[0]['p_clean']:.3f}, p_corrupt {records[0]['p_corrupt']:.3f}")
    print(f"  one forward {best['forward'] * 1e3:.1f} ms, exact engine {best['exact']:.3f} s "
          f"({best['exact'] / best['forward']:.0f} forward-equivalents), gradient floor "
          f"{best['floor'] / best['forward']:.2f} forward-equivalents")
    recalls = "".join(f" {f'recall@{b}':>10}" for b in budgets)
    print(f"  {'method':<22} {'Spearman':>8} {'top-10 err':>10}{recalls} {'time s':>7} {'fwd-eq':>7}")
    for name in METHODS:
        got = scores(exact, results[name], budgets)
        recalls = "".join(f" {got[f'recall@{b}']:10.2f}" for b in budgets)
        print(f"  {name:<22} {got['spearman']:8.3f} {got['top10_error']:10.3f}{recalls} "
              f"{best[name]:7.3f} {best[name] / best['forward']:7.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpts", nargs="*")
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budgets", default="10,20", help="exact checks (--verify-top) of the recalls, comma list")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for path in args.ckpts or DEFAULTS:
        bench(path, args.n, args.reps, [int(b) for b in args.budgets.split(",")])


if __name__ == "__main__":
    main()
