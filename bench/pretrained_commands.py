"""The commands of docs/pretrained.md ("Mamba-130m and Pythia-160m") on random weights of those shapes:
wall time and peak memory of each, the float16 cache's error on attributions, and the cache's
peak memory against its number of rows.

Nothing is downloaded: each model is built with transformers' own config class at its published
shape (Pythia-160m: GPT-NeoX, 12 layers, d_model 768, 12 heads, rotary_pct 0.25, parallel
residual, vocab 50304; Mamba-130m: Mamba-1, 24 layers, d_model 768, d_state 16, vocab 50280),
its weights transformers' random init, saved with ``save_pretrained`` under --tmp (about 0.6 GiB
each, reused by later runs) beside a word-level tokenizer of as many lowercase words (nl-ar's
single-token words). Each command is one child process; its peak resident set comes from
`os.wait4` (ru_maxrss of that child alone).

    python bench/pretrained_commands.py                       # both models, N 64, cache rows 64 and 512
    python bench/pretrained_commands.py --models pythia --n 16 --cache-n 16 64 --threads 1

Prints, per model: each command with its seconds and peak MiB; the largest difference between the
attributions (and p_patched) patched from the float32 and the float16 cache; and the cache's peak
memory at each --cache-n (flat in N beyond one chunk of rows: `hookmech.cache.default_chunk`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import string
import subprocess
import sys
import time
from pathlib import Path

#: published shapes (the models' config.json on the hub), as transformers' config classes take them
SHAPES = {
    "pythia": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {
            "vocab_size": 50304,
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
            "rotary_pct": 0.25,
            "rotary_emb_base": 10000,
            "max_position_embeddings": 2048,
            "use_parallel_residual": True,
            "tie_word_embeddings": False,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
    ),
    "mamba": (
        "MambaConfig",
        "MambaForCausalLM",
        {
            "vocab_size": 50280,
            "hidden_size": 768,
            "num_hidden_layers": 24,
            "state_size": 16,
            "expand": 2,
            "conv_kernel": 4,
        },
    ),
}
#: the layers `das` learns a subspace at: the middle of each model
MIDDLE = {"pythia": 6, "mamba": 12}
SPECIALS = ("<pad>", "<unk>", "<bos>", ",")


def make_folder(name: str, root: Path) -> Path:
    """Save a random model of `name`'s shape (`SHAPES`) and a word-level tokenizer into
    ``root/name`` unless it is there; return the folder."""
    folder = root / name
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.utils import logging

    logging.disable_progress_bar()
    config_class, model_class, fields = SHAPES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    model.save_pretrained(folder)
    # four-letter lowercase words (aaaa, aaab, ...): every one a single token, so nl-ar draws from them
    words = ("".join(letters) for letters in itertools.product(string.ascii_lowercase, repeat=4))
    entries = [*SPECIALS, *itertools.islice(words, fields["vocab_size"] - len(SPECIALS))]
    tokenizer = Tokenizer(models.WordLevel({token: i for i, token in enumerate(entries)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(SPECIALS[:3]))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "pad_token": "<pad>"}))
    return folder


def measure(argv: list[str]) -> tuple[float, float, str]:
    """Run ``hookmech ARGV`` as a child process; return (seconds, its peak RSS in MiB, its stdout).
    The peak is the child's alone: a small wrapper process waits for it with os.wait4 (ru_maxrss).
    A failing command stops the bench with its stderr."""
    wrapper = (
        "import os,subprocess,sys,json;"
        "c=subprocess.Popen(sys.argv[1:]);_,s,u=os.wait4(c.pid,0);"
        "sys.stderr.write('\\nPEAK_KIB %d\\n'%u.ru_maxrss);sys.exit(os.waitstatus_to_exitcode(s))"
    )
    command = [sys.executable, "-c", wrapper, sys.executable, "-m", "hookmech.cli.main", *map(str, argv)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): hookmech {shlex.join(map(str, argv))}\n{done.stderr}")
    peak_kib = int(done.stderr.rsplit("PEAK_KIB ", 1)[1].split()[0])
    return seconds, peak_kib / 1024, done.stdout


def attribution_difference(records32: list[dict], records16: list[dict]) -> dict[str, float]:
    """The largest absolute difference of `attribution` and of `p_patched` between the records
    patched from the float32 and the float16 cache (paired by site and position), and the largest
    relative difference of the attribution (to the larger |attribution| of the pair, over pairs
    with |attribution| >= 0.01)."""
    by_cell = {(r["site"], r["pos"]): r for r in records16}
    worst = {"attribution": 0.0, "p_patched": 0.0, "relative": 0.0}
    for record in records32:
        other = by_cell[record["site"], record["pos"]]
        for key in ("attribution", "p_patched"):
            if record[key] is not None and other[key] is not None:
                worst[key] = max(worst[key], abs(record[key] - other[key]))
        a, b = record["attribution"], other["attribution"]
        if a is not None and b is not None and max(abs(a), abs(b)) >= 0.01:
            worst["relative"] = max(worst["relative"], abs(a - b) / max(abs(a), abs(b)))
    return worst


def bench_model(name: str, folder: Path, work: Path, args) -> None:
    """Run and print the documented commands on `folder` (unless --memory-only), then the cache's
    memory against N."""
    if not args.memory_only:
        bench_commands(name, folder, work, args)
    task = ["--task", "nl-ar", "--task-opt", f"num_kv_pairs={args.pairs}"]
    for n_rows in args.cache_n:
        path = work / f"{name}-mem-{n_rows}.h5"
        path.unlink(missing_ok=True)
        argv = ["cache", "--ckpt", folder, *task, "--n", n_rows, "--sites", "L*.block_in", "--threads", args.threads]
        seconds, peak, _ = measure([*argv, "-o", path])
        size = path.stat().st_size / 2**20
        print(f"{name} cache N {n_rows:<6} {seconds:>8.1f} s {peak:>7.0f} MiB peak {size:8.0f} MiB file", flush=True)
        path.unlink()


def bench_commands(name: str, folder: Path, work: Path, args) -> None:
    """Run and print the documented commands on `folder`, and the float16 cache's error."""
    task = ["--task", "nl-ar", "--task-opt", f"num_kv_pairs={args.pairs}"]
    threads = ["--threads", str(args.threads)]
    ckpt = ["--ckpt", folder]
    cache32, cache16 = work / f"{name}-{args.n}.h5", work / f"{name}-{args.n}-fp16.h5"
    sites = ["--sites", "L*.block_in"]
    patch = ["--site", "L*.block_in", "--pos", "key,value,query", "--json"]
    middle = f"L{MIDDLE[name]}.block_in"
    commands = [
        ("sites", ["sites", *ckpt]),
        ("cache float32", ["cache", *ckpt, *task, "--n", args.n, *sites, *threads, "-o", cache32]),
        (
            "cache float16",
            ["cache", *ckpt, *task, "--n", args.n, *sites, "--dtype", "float16", *threads, "-o", cache16],
        ),
        ("patch --cache float32", ["patch", *ckpt, "--cache", cache32, *patch, *threads]),
        ("patch --cache float16", ["patch", *ckpt, "--cache", cache16, *patch, *threads]),
        (
            "das",
            [
                "das",
                *ckpt,
                "--cache",
                cache32,
                "--site",
                middle,
                "--pos",
                "value",
                "--dim",
                "1",
                "--steps",
                args.das_steps,
                *threads,
                "-o",
                work / f"{name}-das",
            ],
        ),
        (
            "view",
            [
                "view",
                *ckpt,
                "--cache",
                cache32,
                "--site",
                "L*.block_in",
                "--pos",
                "key,value,query",
                *threads,
                "-o",
                work / f"{name}-view.html",
            ],
        ),
    ]
    print(f"\n## {name}: {folder}  (nl-ar, {args.pairs} pairs, N {args.n}, --threads {args.threads})")
    print(f"{'command':<24} {'seconds':>8} {'peak MiB':>9}")
    outputs = {}
    for label, argv in commands:
        for path in (cache32, cache16):
            if label.startswith("cache") and str(path) in map(str, argv):
                path.unlink(missing_ok=True)
        seconds, peak, out = measure(argv)
        outputs[label] = out
        print(f"{label:<24} {seconds:>8.1f} {peak:>9.0f}", flush=True)
        print(f"    hookmech {shlex.join(map(str, argv))}", flush=True)
    worst = attribution_difference(
        json.loads(outputs["patch --cache float32"]), json.loads(outputs["patch --cache float16"])
    )
    print(
        f"float16 cache against float32: max |d attribution| {worst['attribution']:.2e}, "
        f"max relative {worst['relative']:.2e}, max |d p_patched| {worst['p_patched']:.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["pythia", "mamba"])
    parser.add_argument("--n", type=int, default=64, help="examples of the cache the commands read")
    parser.add_argument("--pairs", type=int, default=8, help="nl-ar key-value pairs per document")
    parser.add_argument("--cache-n", type=int, nargs="*", default=[64, 512], help="rows of the memory runs")
    parser.add_argument("--das-steps", type=int, default=20)
    parser.add_argument("--memory-only", action="store_true", help="only the cache's memory against --cache-n")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/hookmech-pretrained-bench"))
    args = parser.parse_args()
    args.tmp.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        start = time.perf_counter()
        folder = make_folder(name, args.tmp)
        print(f"{name}: folder ready in {time.perf_counter() - start:.0f} s", flush=True)
        bench_model(name, folder, args.tmp, args)


if __name__ == "__main__":
    main()
