"""Peak memory of the commands that read a cache, against the number of rows it holds.

Each measurement is one child process (`hookmech ...`); its peak resident set comes from
`os.wait4`'s resource usage of that child alone (ru_maxrss). For each checkpoint, the smallest
cache is the baseline and the table prints each larger cache's peak as a ratio of it (flat in N:
<= 1.2x). Caches are written under --tmp (default /tmp/hookmech-cache-memory), never in the repo,
and reused by later runs (delete the folder to rebuild them).

    python bench/cache_memory.py                       # fixture 3,200 / 32,000; paper Mamba 320 / 3,200
    python bench/cache_memory.py --n 3200 32000 320000 # and beyond, where the disk allows
    python bench/cache_memory.py --limit-gib 3 --limit-rows 44000   # a cache larger than `ulimit -v`

`--limit-gib G` also writes a cache of `--limit-rows` rows with every block-level site (larger
than G GiB) and patches it in a shell whose virtual memory is limited to G GiB (`ulimit -v`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "fixtures" / "attention_ar_cpu.safetensors"
PAPER = REPO / "fixtures" / "mamba_ar_paper.safetensors"
#: what the patches read: the block inputs, and the mixer inputs and outputs resumed runs and AtP* use
SITES = "L*.block_in,L*.mixer_in,L*.mixer_out"
PATCH = ["--site", "L*.block_in", "--pos", "key,value,query"]


def hookmech(*args: str) -> list[str]:
    return [sys.executable, "-m", "hookmech.cli.main", *map(str, args)]


def measure(command: list[str], shell_prefix: str | None = None) -> tuple[float, float, int]:
    """Run `command` as a child process; return (peak RSS in MiB, wall seconds, exit status).
    With `shell_prefix` (e.g. ``ulimit -v N;``) the command runs in a shell that applies it first."""
    if shell_prefix is not None:
        command = ["bash", "-c", shell_prefix + " exec " + " ".join(f"'{part}'" for part in command)]
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/tmp")
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    error = child.stderr.read().decode() if child.stderr else ""
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        print(f"  exit {code}: {error.strip().splitlines()[-1] if error.strip() else ''}", file=sys.stderr)
    return usage.ru_maxrss / 1024, wall, code  # ru_maxrss is in KiB on Linux


def cache_of(ckpt: Path, n: int, folder: Path, sites: str, threads: int) -> Path:
    """Return a cache of `n` rows of `ckpt` in `folder` (written once, by `hookmech cache`)."""
    path = folder / f"{ckpt.stem}-{n}-{sites.replace('*', 'x').replace(',', '_')}.h5"
    if not path.exists():
        started = time.perf_counter()
        args = ["cache", "--ckpt", ckpt, "--n", n, "--seed", 1, "-o", path, "--threads", threads]
        subprocess.run(hookmech(*args, *(["--sites", sites] if sites != "all" else [])), check=True,
                       stdout=subprocess.DEVNULL, cwd="/tmp")
        print(f"  wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="*", default=[3200, 32000], help="rows of the fixture's caches")
    parser.add_argument("--paper-n", type=int, nargs="*", default=[320, 3200], help="rows of the paper Mamba's")
    parser.add_argument("--memory", type=float, default=256, help="--memory (MiB) of the commands")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/hookmech-cache-memory"))
    parser.add_argument("--limit-gib", type=float, default=None, help="also patch a larger cache under ulimit -v")
    parser.add_argument("--limit-rows", type=int, default=44000)
    args = parser.parse_args()
    args.tmp.mkdir(parents=True, exist_ok=True)
    common = ["--memory", args.memory, "--threads", args.threads]
    jobs = [
        (FIXTURE, args.n, "patch", ["patch", "--ckpt", FIXTURE, *PATCH, *common]),
        (FIXTURE, args.n, "patch --method atp", ["patch", "--ckpt", FIXTURE, *PATCH, "--method", "atp", *common]),
        (FIXTURE, args.n, "inspect", ["inspect", "--memory", args.memory]),
        # the engine before row chunks: every row in one chunk (what `patch` held at main 8313c07)
        (FIXTURE, args.n, "patch, one chunk", ["patch", "--ckpt", FIXTURE, *PATCH, "--memory", 10**6, "--threads",
                                               args.threads]),
        (PAPER, args.paper_n, "patch (paper Mamba)", ["patch", "--ckpt", PAPER, *PATCH, *common]),
    ]
    print(f"peak RSS of one child process per command (--memory {args.memory:g} MiB, --threads {args.threads})")
    print(f"{'command':<24} {'rows':>8} {'cache GiB':>9} {'peak MiB':>9} {'wall s':>7} {'x smallest':>10}")
    for ckpt, sizes, name, command in jobs:
        baseline = None
        for n in sizes:
            cache = cache_of(ckpt, n, args.tmp, SITES, args.threads)
            argv = [*command, cache] if command[0] == "inspect" else [*command, "--cache", cache]
            peak, wall, code = measure(hookmech(*argv))
            baseline = baseline or peak
            size = cache.stat().st_size / 2**30
            print(f"{name:<24} {n:>8} {size:>9.2f} {peak:>9.0f} {wall:>7.1f} {peak / baseline:>9.2f}x"
                  + ("" if code == 0 else f"  (exit {code})"), flush=True)
    if args.limit_gib is not None:
        cache = cache_of(FIXTURE, args.limit_rows, args.tmp, "all", args.threads)
        size = cache.stat().st_size / 2**30
        limit = f"ulimit -v {int(args.limit_gib * 2**20)};"
        peak, wall, code = measure(hookmech("patch", "--ckpt", FIXTURE, *PATCH, *common, "--cache", cache), limit)
        print(f"cache of {size:.2f} GiB under `{limit}` ({args.limit_gib:g} GiB of virtual memory): exit {code}, "
              f"peak {peak:.0f} MiB, {wall:.0f} s")
    free = shutil.disk_usage(args.tmp).free / 2**30
    print(f"caches kept in {args.tmp} ({free:.0f} GiB free there)")


if __name__ == "__main__":
    main()
