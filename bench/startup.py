"""Time to first output of every `hookmech` command, against `python -c pass`.

Each command runs as a user runs it at a terminal: stdout and stderr are a pseudo-terminal
(`pty`), so bars and transient status lines count. "first output" is the time from starting
the process to the first byte it writes; "exit" is the time to its exit. The baseline is
`python -c pass` (an interpreter's start) and `python -c "import torch"`, measured in the same
run, best of `--reps`. Commands run on the bundled attention fixture, in a temporary folder; a
command that fails is marked so (its first output is then the error line).

    python bench/startup.py [--reps 3] [--only train,patch] [--baseline-src DIR]

With `--baseline-src DIR` (a checkout of an earlier commit: `git worktree add --detach DIR
COMMIT`) each command also runs with hookmech imported from DIR, interleaved with this
checkout's runs, and is printed again marked "(before)".
"""

from __future__ import annotations

import argparse
import os
import pty
import re
import select
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


def timed(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[float, float, float, int, str]:
    """Run `argv` with a pseudo-terminal as stdout and stderr; return (seconds to its first
    output byte, seconds to its first output of its own — after the start-up status line —,
    seconds to its exit, exit code, its first line of its own)."""
    leader, follower = pty.openpty()
    began = time.perf_counter()
    process = subprocess.Popen(argv, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL, cwd=cwd, env=env)
    os.close(follower)
    first = own = None
    seen = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 0.02)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the follower closed: the process exited
                chunk = b""
            if not chunk:
                break
            now = time.perf_counter() - began
            first = now if first is None else first
            seen += chunk
            if own is None and own_text(seen):
                own = now
        elif process.poll() is not None:
            break
    code = process.wait()
    ended = time.perf_counter() - began
    os.close(leader)
    line = next((part.strip() for part in own_text(seen).splitlines() if part.strip()), "")
    return (ended if first is None else first), (ended if own is None else own), ended, code, line


def own_text(seen: bytes) -> str:
    """The output without the start-up status line and terminal control sequences."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace")).replace("\r", "\n")
    return re.sub(r"hookmech [a-z]+: starting \(loading torch\)…", "", text).strip()


def baseline_env(src: str | None) -> dict[str, str] | None:
    """The environment of a command importing hookmech (and its CLI) from checkout `src`."""
    if src is None:
        return None
    return {**os.environ, "PYTHONPATH": os.path.abspath(src), "HOOKMECH_BENCH_CLI": os.path.abspath(src)}


#: runs `hookmech.cli.main` from the checkout in HOOKMECH_BENCH_CLI (the editable install maps
#: `hookmech.cli` to this checkout's cli/ folder otherwise)
CHILD = (
    "import importlib.util, os, sys; src = os.environ['HOOKMECH_BENCH_CLI']; "
    "spec = importlib.util.spec_from_file_location('hookmech.cli', os.path.join(src, 'cli', '__init__.py'), "
    "submodule_search_locations=[os.path.join(src, 'cli')]); module = importlib.util.module_from_spec(spec); "
    "sys.modules['hookmech.cli'] = module; spec.loader.exec_module(module); "
    "from hookmech.cli.main import main; sys.argv[0] = 'hookmech'; main()"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma list of command names")
    parser.add_argument("--baseline-src", default=None, help="a checkout of an earlier commit, timed in the same run")
    args = parser.parse_args()
    print(f"time to first output, best of {args.reps} (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"{'command':<30} {'first output':>12} {'own output':>10} {'exit':>8}  {'vs python':>9}  first line")
    base = None
    for name, argv in [("python -c pass", [sys.executable, "-c", "pass"]),
                       ("python -c 'import torch'", [sys.executable, "-c", "import torch"])]:  # fmt: skip
        best = min(timed(argv, Path.cwd())[2] for _ in range(args.reps))
        base = best if base is None else base
        print(f"{name:<30} {'':>12} {'':>10} {best:>7.2f}s  {best / base:>8.1f}x")
    builds = [("", HOOKMECH, None)]
    if args.baseline_src:
        builds.append((" (before)", [sys.executable, "-c", CHILD], baseline_env(args.baseline_src)))
    results: dict[str, list[tuple[float, float, float, int, str]]] = {}
    for _ in range(args.reps):
        for suffix, command, env in builds:  # interleaved: the load moves both alike
            with tempfile.TemporaryDirectory(prefix="hookmech-startup-") as folder:
                for name, argv in commands(Path(folder)):
                    if args.only and name not in args.only.split(","):
                        continue
                    results.setdefault(name + suffix, []).append(timed(command + argv, Path(folder), env))
    for name, runs in results.items():
        first, own, ended, code, line = min(runs)
        failed = "" if code == 0 else f" [exit {code}]"
        times = f"{first:>11.2f}s {own:>9.2f}s {ended:>7.2f}s  {first / base:>8.1f}x"
        print(f"hookmech {name:<21} {times}  {line[:60]}{failed}")


if __name__ == "__main__":
    main()
