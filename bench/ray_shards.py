"""Per-shard times of `patch --engine ray`, with 1 and 2 workers, and what a paper-scale job costs.

For each mixer and document length: a random-init model at the paper's configuration (d_model 64,
2 layers, vocab 8192; an AR document of the length: 35 tokens is the paper's AR setting, 259 and
918 ATR's), a cache of `--rows` rows with every block-level site, and the job every site x every
position (`--site all --pos all`) run by the local engine in this process (the baseline) and by
`RayPatchEngine` with each `--workers` count on a local Ray (startup not counted). Prints each
shard's rows, model-load and patch seconds, the job's wall time and its ratio to the local
engine's, seconds per row, and the cache's bytes per row. Caches and checkpoints go under --tmp.

    python bench/ray_shards.py --mixers attention,mamba --length 35 259 --rows 32 --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hookmech
from hookmech.cache import CacheFile, write_cache
from hookmech.checkpoint import save
from hookmech.config import build_config
from hookmech.patching import patch
from hookmech.patching.distributed import RayPatchEngine
from hookmech.sites import resolve_sites

MEMORY = 256 << 20


def make_case(mixer: str, length: int, rows: int, folder: Path) -> tuple[Path, Path]:
    """Return (checkpoint, cache) of a random-init paper-configuration `mixer` on AR documents of
    `length` tokens (BOS, pairs, divider, query), `rows` rows; written once under `folder`."""
    pairs = (length - 3) // 2
    task = hookmech.tasks.make("ar", vocab_size=8192, num_kv_pairs=pairs)
    ckpt, cache = folder / f"{mixer}-{length}.safetensors", folder / f"{mixer}-{length}-{rows}.h5"
    if not ckpt.exists():
        torch.manual_seed(0)
        model = hookmech.HookedLM(build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=mixer, d_model=64,
                                               n_layers=2))
        save(model.eval(), ckpt, task_spec=task.spec)
    if not cache.exists():
        model = hookmech.load(ckpt)
        write_cache(model, task.sample(rows, seed=1), cache, resolve_sites(["all"], model.hook_dict))
    return ckpt, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", default="attention,mamba")
    parser.add_argument("--length", type=int, nargs="+", default=[35])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--pos", default="all", help="position spec (default: every position)")
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/hookmech-ray-shards"))
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    args.tmp.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    results = []
    for mixer in args.mixers.split(","):
        for length in args.length:
            ckpt, cache_path = make_case(mixer, length, args.rows, args.tmp)
            model = hookmech.load(ckpt)
            with CacheFile(cache_path) as cache:
                row_bytes = cache_path.stat().st_size / cache.n
                started = time.perf_counter()
                local = patch(model, cache, ["all"], [args.pos], memory=MEMORY)
                local_s = time.perf_counter() - started
                print(f"{mixer} T={length}: {len(local)} cells x {cache.n} rows; cache {row_bytes / 1024:.0f} KiB/row; "
                      f"local engine {local_s:.1f} s ({local_s / cache.n:.2f} s/row)", flush=True)
                for workers in args.workers:
                    with RayPatchEngine(ckpt, cache_path, workers=workers, threads=1) as engine:
                        started = time.perf_counter()
                        shared = engine.patch(model, cache, ["all"], [args.pos], memory=MEMORY)
                        wall = time.perf_counter() - started
                    worst = max(abs(a["p_patched"] - b["p_patched"]) for a, b in zip(shared, local, strict=True))
                    shards = [t for t in engine.timings if t["kind"] == "patch"]
                    print(f"  {workers} worker(s): job {wall:.1f} s ({local_s / wall:.2f}x the local engine), "
                          f"max |dp| {worst:.1e}; shards: "
                          + ", ".join(f"{t['rows']} rows load {t['load_s']:.1f} s patch {t['patch_s']:.1f} s"
                                      for t in shards), flush=True)
                    results.append({"mixer": mixer, "length": length, "rows": cache.n, "cells": len(local),
                                    "cache_bytes_per_row": row_bytes, "local_s": local_s, "workers": workers,
                                    "job_s": wall, "shards": shards})
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
