"""Time the patching engine against the plain `run_with_hooks` loop on the paper's sweep.

The sweep (paper 000 §4): every block-level site of a model x the positions key, value,
query, divider x 320 AR examples, random-init models. Two scales:

* default: vocab 64, 4 pairs (11 positions), d_model 64; then the sweep grows: 4 layers, and
  every position (`all`);
* `--paper-ar`: the paper's AR setting, vocab 8192, 16 pairs (35 positions), d_model 128,
  2 layers, the four roles;
* `--length L`: ATR's long documents (paper 000 §5, `max_rhs_len` 10, 20 terminals): the `--n`
  longest rows of at most L tokens among `--docs` documents (100,032 by default, the paper's
  dataset size), right-padded to L tokens as a batch of them is padded to its longest row
  (`bench/view_pages.py`'s ATR page: 530 to 918 tokens); d_model 64 (the ATR preset's), 2
  layers, the four roles. ATR's lengths: 259 and 918.

Same process, same model, same batch: `hookmech.oracles.plain_loop_patch` (one full
corrupt forward per (site, position), frozen) against `hookmech.patching.patch` (the engine, from
the batch, i.e. computing its clean and corrupt runs itself), interleaved, best of `--reps`.
Prints both times, the ratio, and the largest |Δp| between them.

    python bench/patch_engine.py [--paper-ar | --length L [--docs D]] [--mixers attention,mamba] [--n 320]
        [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch

import hookmech
from hookmech.config import build_config
from hookmech.oracles import plain_loop_patch
from hookmech.patching import patch
from hookmech.tasks.batch import Batch

ROLES = ["key", "value", "query", "divider"]


def all_mixers() -> str:
    """Every mixer whose spec says the benches include it (`MixerSpec.bench`), comma-separated."""
    from hookmech.mixers import SPECS

    return ",".join(name for name, spec in sorted(SPECS.items()) if spec.bench)


def longest_rows(n: int, length: int, docs: int, seed: int = 1) -> tuple[object, Batch]:
    """Return (task, batch): the `n` longest ATR rows (long setting) of at most `length` tokens among
    `docs` documents drawn in rounds (seeds (seed, round)), right-padded to `length` tokens."""
    task = hookmech.tasks.make("atr", max_rhs_len=10, max_length=length - 3)
    best: Batch | None = None
    for round_index, start in enumerate(range(0, docs, 8192)):
        drawn = task.sample(min(8192, docs - start), seed=(seed, round_index))
        drawn = Batch(drawn.tokens, drawn.corrupt_tokens, drawn.answers, drawn.lengths, drawn.doc_index, drawn.roles)
        pool = drawn if best is None else concat(best, drawn, task.pad_id)
        # stable: among equal lengths the earlier-drawn rows are kept (deterministic)
        order = torch.sort(pool.lengths, descending=True, stable=True).indices[:n]
        best = pool.select(order).trimmed()
    assert best is not None
    pad = length - best.tokens.shape[1]
    widen = lambda tokens: torch.nn.functional.pad(tokens, (0, pad), value=task.pad_id)  # noqa: E731
    return task, Batch(
        widen(best.tokens), widen(best.corrupt_tokens), best.answers, best.lengths, best.doc_index, best.roles
    )


def concat(a: Batch, b: Batch, pad_id: int) -> Batch:
    """Return the rows of `a` then `b`, padded to the wider of the two."""
    width = max(a.tokens.shape[1], b.tokens.shape[1])

    def both(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            x, y = (torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad_id) for t in (x, y))
        return torch.cat([x, y])

    roles = {name: both(a.roles[name], b.roles[name]) for name in a.roles}
    return Batch(
        *(both(getattr(a, f), getattr(b, f)) for f in ("tokens", "corrupt_tokens", "answers", "lengths", "doc_index")),
        roles,
    )


def timed(run) -> tuple[float, object]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", default=None, help=f"default: attention,mamba; with --paper-ar: {all_mixers()}")
    parser.add_argument("--paper-ar", action="store_true", help="vocab 8192, 16 pairs, d_model 128, 2 layers")
    parser.add_argument("--length", type=int, default=None, help="ATR rows of up to this many tokens, padded to it")
    parser.add_argument("--docs", type=int, default=100_032, help="with --length: documents drawn")
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--d-model", type=int, default=None, help="default: 64; 128 with --paper-ar")
    parser.add_argument("--engine-only", action="store_true", help="time the engine alone (for profiling)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=1, help="best of this many interleaved repetitions")
    parser.add_argument("--quick", action="store_true", help="only the 2-layer, 4-position sweep")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    long = args.length is not None
    mixers = args.mixers or (all_mixers() if args.paper_ar or long else "attention,mamba")
    d_model = args.d_model or (128 if args.paper_ar else 64)
    if long:
        task, batch = longest_rows(args.n, args.length, args.docs)
        lengths = batch.lengths
        print(
            f"ATR long setting: the {args.n} longest of {args.docs} documents, rows of {int(lengths.min())}"
            f"-{int(lengths.max())} tokens padded to {batch.tokens.shape[1]}, d_model {d_model}, "
            f"{args.threads} thread(s), best of {args.reps}"
        )
    else:
        vocab, pairs = (8192, 16) if args.paper_ar else (64, 4)
        task = hookmech.tasks.make("ar", vocab_size=vocab, num_kv_pairs=pairs)
        batch = task.sample(args.n, seed=1)
        print(
            f"AR vocab {vocab}, {pairs} pairs ({batch.tokens.shape[1]} positions), d_model {d_model}, N={args.n}, "
            f"{args.threads} thread(s), best of {args.reps}"
        )
    quick = args.quick or args.paper_ar or long
    grid = [(2, ROLES)] if quick else [(2, ROLES), (4, ROLES), (2, ["all"]), (4, ["all"])]
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
                if not args.engine_only:
                    seconds, reference = timed(lambda m=model, p=positions: plain_loop_patch(m, batch, ["all"], p))
                    plain_s = min(plain_s, seconds)
                seconds, records = timed(
                    lambda m=model, p=positions: patch(m, batch, ["all"], p, max_batch=args.max_batch)
                )
                engine_s = min(engine_s, seconds)
            if args.engine_only:
                print(f"{mixer:<10} {n_layers:>6} engine {engine_s:.2f} s", flush=True)
                continue
            worst = max(abs(r["p_patched"] - reference[r["hook"], r["pos"]]["p_patched"]) for r in records)
            label = "4 roles" if positions == ROLES else "all"
            print(
                f"{mixer:<10} {n_layers:>6} {label:>9} {len(records):>5} {plain_s:>8.2f} {engine_s:>8.2f} "
                f"{plain_s / engine_s:>6.2f} {worst:>9.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
