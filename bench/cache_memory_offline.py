"""Peak memory of `hookmech probe`, `das` and `view` against the cache's number of rows: they read
the cache in row chunks sized by `--memory` (issue 31), so peak RSS should not grow with N.

Caches of the bundled attention fixture (`fixtures/attention_ar_cpu.safetensors`, every
block-level site, seed 1) with each `--n` rows are made in `--workdir` (under /tmp; reused when
present). Each command runs in its own process, whose peak RSS (`ru_maxrss` of the child) is
reported. Baseline, measured in the same run: the same command on the smallest cache; the ratio
is peak RSS at N over it (target: <= 1.2x). With `--before DIR`, each command is also run with the
hookmech of another checkout extracted in DIR (before issue 31:
``git archive 379850a hookmech cli | tar -x -C DIR``), for comparison.

    python bench/cache_memory_offline.py [--n 3200 32000] [--memory 256] [--before DIR] [--only probe,das,view]
                                         [--workdir /tmp/hookmech-offline-bench]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "fixtures" / "attention_ar_cpu.safetensors"
HOOKMECH = [sys.executable, "-c", "import sys; from hookmech.cli.main import main; main(sys.argv[1:])"]


def hookmech_of(tree: Path) -> list[str]:
    """The command running the CLI of the hookmech extracted in `tree` (its `hookmech` and `cli`
    folders) instead of the installed one."""
    code = (
        f"import sys; sys.path.insert(0, {str(tree)!r}); import hookmech; "
        f"assert hookmech.__file__.startswith({str(tree)!r}), hookmech.__file__; "
        "from cli.main import main; main(sys.argv[1:])"
    )
    return [sys.executable, "-c", code]


def commands(cache: Path, out: Path) -> dict[str, list[str]]:
    """The three commands on `cache`, writing under `out`, at one thread."""
    return {
        "probe": ["probe", str(cache), "--site", "L1.block_in", "--pos", "value", "--threads", "1"],
        "das": ["das", "--ckpt", str(FIXTURE), "--cache", str(cache), "--site", "L1.block_in", "--pos", "value",
                "--dim", "1", "--steps", "20", "--threads", "1", "-o", str(out / "das")],
        "view": ["view", "--ckpt", str(FIXTURE), "--cache", str(cache), "--site", "L*.block_in", "--pos", "key,value",
                 "--threads", "1", "-o", str(out / "page.html")],
    }


def make_cache(n: int, workdir: Path) -> Path:
    """The cache of `n` rows in `workdir`, made with `hookmech cache` unless there."""
    path = workdir / f"c{n}.h5"
    if not path.exists():
        subprocess.run([*HOOKMECH, "cache", "--ckpt", str(FIXTURE), "--n", str(n), "--seed", "1", "--threads", "1",
                        "-o", str(path)], check=True, stdout=subprocess.DEVNULL)
    return path


def peak_rss(command: list[str], arguments: list[str]) -> tuple[float, float]:
    """Run hookmech (`command`) with `arguments` in a child process; return (its peak RSS in MiB, seconds)."""
    start = time.perf_counter()
    child = subprocess.Popen([*command, *arguments], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    error = child.stderr.read().decode() if child.stderr else ""
    if child.returncode != 0:
        raise SystemExit(f"hookmech {' '.join(arguments)} failed ({child.returncode}): {error.strip()[-400:]}")
    return usage.ru_maxrss / 1024, seconds  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[3200, 32000], help="cache rows (the first: baseline)")
    parser.add_argument("--memory", type=float, default=256, help="--memory of the runs (MiB)")
    parser.add_argument("--before", type=Path, default=None, help="also run the hookmech extracted in this folder")
    parser.add_argument("--only", default="probe,das,view", help="commands to run (comma list)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hookmech-offline-bench"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    only = args.only.split(",")
    variants = [("streamed", HOOKMECH, ["--memory", f"{args.memory:g}"])]
    if args.before is not None:
        variants.append(("before", hookmech_of(args.before.resolve()), []))
    print(f"fixture {FIXTURE.name}; caches of every block-level site in {args.workdir}; --memory {args.memory:g} MiB")
    table: dict[tuple[str, str], list[float]] = {}
    for n in args.n:
        cache = make_cache(n, args.workdir)
        print(f"{n:>7} rows: cache {cache.stat().st_size / 2**20:,.0f} MiB", flush=True)
        for label, command, options in variants:
            for name, arguments in commands(cache, args.workdir).items():
                if name not in only:
                    continue
                rss, seconds = peak_rss(command, [*arguments, *options])
                table.setdefault((name, label), []).append(rss)
                print(f"    {name:<6} {label:<10} peak RSS {rss:7.0f} MiB  ({seconds:5.1f} s)", flush=True)
    header = "".join(f"{n:>12,}" for n in args.n)
    print(f"\npeak RSS (MiB) by rows; ratio = largest N over the baseline ({args.n[0]:,} rows)")
    print(f"{'command':<18}{header}{'ratio':>9}")
    for (name, label), values in table.items():
        cells = "".join(f"{value:12.0f}" for value in values)
        print(f"{name + ' ' + label:<18}{cells}{values[-1] / values[0]:8.2f}x")


if __name__ == "__main__":
    main()
