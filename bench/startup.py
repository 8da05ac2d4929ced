"""Time to first output of every `hookmech` command, against `python -c pass`.

Each command runs as a user runs it at a terminal: stdout and stderr are a pseudo-terminal
(`pty`), so bars and transient status lines count. "first output" is the time from starting
the process to the first byte it writes; "exit" is the time to its exit. The baseline is
`python -c pass` (an interpreter's start) and `python -c "import torch"`, measured in the same
run, best of `--reps`. Commands run on the bundled attention fixture, in a temporary folder; a
command that fails is marked so (its first output is then the error line).

    python bench/startup.py [--reps 3] [--only train,patch] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import pty
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hookmech.fixtures

FIXTURE = Path(hookmech.fixtures.__file__).parent / "attention_ar_cpu.safetensors"
HOOKMECH = [sys.executable, "-m", "hookmech.cli.main"]


def commands(tmp: Path) -> list[tuple[str, list[str]]]:
    """Return ``(name, argv)`` of each command measured, in an order where later ones read what
    earlier ones wrote (the cache, the runs folder)."""
    ckpt = str(FIXTURE)
    sweep_file = tmp / "sweep.toml"
    sweep_file.write_text(
        'name = "startup"\n[task]\nname = "ar"\nvocab_size = 16\nnum_kv_pairs = 2\n'
        "[train]\nsteps = 10\nn_train = 0\neval_every = 5\nckpt_every = 10\nn_dev = 32\n"
        '[model]\nmixer = "attention"\nd_model = 16\nn_layers = 2\n[grid]\nlr = [1e-3]\n'
        '[mech]\nsites = ["L1.block_in"]\npositions = ["key", "value", "query"]\nn = 32\nseed = 0\n'
    )
    return [
        ("--help", ["--help"]),
        (
            "train",
            [
                "train",
                "--task",
                "ar",
                "--task-opt",
                "vocab_size=16",
                "--task-opt",
                "num_kv_pairs=2",
                "--d-model",
                "16",
                "--steps",
                "10",
                "--n-train",
                "0",
                "--n-dev",
                "32",
                "--eval-every",
                "5",
                "-o",
                str(tmp / "train"),
            ],
        ),  # fmt: skip
        ("sweep", ["sweep", str(sweep_file), "-o", str(tmp / "runs"), "--threads", "1"]),
        ("sites", ["sites", "--ckpt", ckpt]),
        ("cache", ["cache", "--ckpt", ckpt, "--n", "32", "-o", str(tmp / "c.h5")]),
        ("inspect", ["inspect", str(tmp / "c.h5")]),
        ("probe", ["probe", str(tmp / "c.h5"), "--site", "L1.block_in", "--pos", "query"]),
        ("patch", ["patch", "--ckpt", ckpt, "--site", "L1.block_in", "--pos", "value", "--n", "32"]),
        ("data", ["data", "ar", "--stats", "--n", "100"]),
        ("report", ["report", str(tmp / "runs"), "-o", str(tmp / "report")]),
        ("view", ["view", str(tmp / "runs"), "-o", str(tmp / "runs.html")]),
        (
            "evaluate",
            [
                "evaluate",
                "--arch",
                "attention",
                "--tasks",
                "ar",
                "--steps",
                "10",
                "--lr",
                "1e-3",
                "--threads",
                "1",
                "--no-view",
                "-o",
                str(tmp / "eval"),
            ],
        ),  # fmt: skip
    ]


def timed(argv: list[str], cwd: Path) -> tuple[float, float, int, str]:
    """Run `argv` with a pseudo-terminal as stdout and stderr; return (seconds to its first
    output byte, seconds to its exit, exit code, its first line)."""
    leader, follower = pty.openpty()
    began = time.perf_counter()
    process = subprocess.Popen(argv, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL, cwd=cwd)
    os.close(follower)
    first, seen = None, b""
    while True:
        ready, _, _ = select.select([leader], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the follower closed: the process exited
                chunk = b""
            if not chunk:
                break
            if first is None:
                first = time.perf_counter() - began
            seen += chunk
        elif process.poll() is not None:
            break
    code = process.wait()
    ended = time.perf_counter() - began
    os.close(leader)
    text = seen.decode(errors="replace").replace("\r", "\n")
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return (ended if first is None else first), ended, code, line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma list of command names")
    parser.add_argument("--keep", default=None, help="folder to run in (kept); default a temporary one")
    args = parser.parse_args()
    env_note = f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    baselines = [("python -c pass", [sys.executable, "-c", "pass"]),
                 ("python -c 'import torch'", [sys.executable, "-c", "import torch"])]  # fmt: skip
    print(f"time to first output, best of {args.reps} ({env_note})")
    print(f"{'command':<28} {'first output':>12} {'exit':>8}  {'vs python':>9}  first line")
    base = None
    for name, argv in baselines:
        best = min(timed(argv, Path.cwd())[1] for _ in range(args.reps))
        base = best if base is None else base
        print(f"{name:<28} {'':>12} {best:>7.2f}s  {best / base:>8.1f}x")
    for rep in range(args.reps):
        tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hookmech-startup-"))
        if rep and args.keep:
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        for name, argv in commands(tmp):
            if args.only and name not in args.only.split(","):
                continue
            results.setdefault(name, []).append(timed(HOOKMECH + argv, tmp))
        if not args.keep:
            shutil.rmtree(tmp)
    for name, runs in results.items():
        first, ended, code, line = min(runs)
        failed = "" if code == 0 else f" [exit {code}]"
        print(f"hookmech {name:<19} {first:>11.2f}s {ended:>7.2f}s  {first / base:>8.1f}x  {line[:70]}{failed}")


results: dict[str, list[tuple[float, float, int, str]]] = {}

if __name__ == "__main__":
    main()
