"""Caching throughput: `write_cache` of every block-level site against the forward passes alone,
and the size / speed trade-off of fp16 storage and gzip / lzf compression.

Same process, same model, same `--n` examples (seed 1). Baseline: the clean and the corrupt
forward passes over the rows, in the chunks write_cache uses, without hooks (what a run costs
anyway). Also shown: the same forwards with `run_with_cache` (what the hooks add). Each storage
option is the whole `write_cache` to a file (best of `--reps`, interleaved with the baseline),
with the file size and the time relative to the baseline (target: fp32 uncompressed <= 1.5x).

    python bench/cache_throughput.py [CKPT] [--n 320] [--reps 5] [--threads 1] [--d-model 256] [--paper-ar]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import hookmech
from hookmech.cache import default_chunk, run_chunks, write_cache
from hookmech.config import ModelConfig, build_config
from hookmech.sites import resolve_sites

OPTIONS = [("float32", None), ("float16", None), ("float32", "lzf"), ("float16", "lzf"), ("float32", "gzip"),
           ("float16", "gzip")]
DEFAULT = ("fixtures/attention_ar_cpu.safetensors", "/tmp/atp_attn64/model.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", nargs="?", default=None)
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=None, help="rows per forward and per HDF5 chunk (default: write_cache's)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--d-model", type=int, default=None, help="a random-init model of this width instead")
    parser.add_argument("--paper-ar", action="store_true", help="paper 000's AR setting instead of a checkpoint")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.paper_ar:  # paper 000 §4's AR (vocab 8192, 32 pairs: 67 tokens), random-init attention
        task = hookmech.tasks.make("ar", vocab_size=8192, num_kv_pairs=32)
        torch.manual_seed(0)
        model = hookmech.HookedLM(build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers="attention",
                                               d_model=args.d_model or 64, n_layers=2)).eval()
        path = f"paper AR (vocab 8192, 32 pairs), 2-layer attention at d_model {model.cfg.d_model} (random init)"
    else:
        path = args.ckpt or next(p for p in DEFAULT if Path(p).exists())
        model, task = hookmech.load(path), hookmech.tasks.from_checkpoint(path)
    if args.d_model is not None and not args.paper_ar:  # same task and architecture, random init, another width
        torch.manual_seed(0)
        config = json.loads(model.cfg.to_json())
        config["d_model"] = args.d_model
        model = hookmech.HookedLM(ModelConfig.from_json(json.dumps(config))).eval()
        path = f"{Path(path).stem} at d_model {args.d_model} (random init)"
    batch = task.sample(args.n, seed=1)
    hooks = resolve_sites(["all"], model.hook_dict)
    chunk = args.chunk or default_chunk(args.n, batch.tokens.shape[1])  # write_cache's default

    @torch.no_grad()
    def forwards(cache: bool) -> None:
        for rows in run_chunks(len(batch), chunk):
            for tokens in (batch.tokens, batch.corrupt_tokens):
                if cache:
                    model.run_with_cache(tokens[rows], names_filter=hooks, return_cache_object=False,
                                         positions=batch.query_pos[rows])
                else:
                    model(tokens[rows], positions=batch.query_pos[rows])

    with tempfile.TemporaryDirectory() as folder:
        runs = {"forward": lambda: forwards(False), "run_with_cache": lambda: forwards(True)}
        for dtype, compression in OPTIONS:
            out = Path(folder) / f"{dtype}-{compression}.h5"
            runs[dtype, compression] = lambda d=dtype, c=compression, o=out: write_cache(
                model, batch, o, hooks, task_spec=task.spec, dtype=d, compression=c, chunk=chunk)
        best = {name: float("inf") for name in runs}
        sizes = {}
        for rep in range(args.reps + 1):  # the first round warms up
            for name, run in runs.items():
                out = Path(folder) / f"{name[0]}-{name[1]}.h5" if isinstance(name, tuple) else None
                if out is not None and out.exists():
                    out.unlink()  # time writing a new file, not unlinking the last one
                start = time.perf_counter()
                run()
                if rep:
                    best[name] = min(best[name], time.perf_counter() - start)
                if out is not None:
                    sizes[name] = out.stat().st_size
    base = best["forward"]
    print(f"{Path(path).name if Path(path).exists() else path}: {len(hooks)} block-level sites x clean+corrupt, N={args.n}, T={batch.tokens.shape[1]}, "
          f"chunk {chunk} rows, threads {torch.get_num_threads()}")
    print(f"  forward passes alone      {base * 1e3:8.1f} ms   1.00x")
    print(f"  run_with_cache (no file)  {best['run_with_cache'] * 1e3:8.1f} ms   {best['run_with_cache'] / base:.2f}x")
    for dtype, compression in OPTIONS:
        seconds = best[dtype, compression]
        print(f"  write_cache {dtype:7s} {compression or 'none':4s}  {seconds * 1e3:8.1f} ms   {seconds / base:.2f}x   "
              f"{sizes[dtype, compression] / 2**20:6.2f} MiB")


if __name__ == "__main__":
    main()
