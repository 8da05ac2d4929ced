"""Check hookmech's GPU path in one short run: every mixer's forward on the device against the CPU,
the patching engine against the plain `run_with_hooks` loop on the device, the fused Mamba kernels
(mamba-ssm, causal-conv1d) against the pure-PyTorch path where they import, and the time of the
engine and of a training step.

    python bench/gpu_check.py                                   # on cuda
    python bench/gpu_check.py --device cpu --quick --small-task # a dry run of this script on the CPU

Models: random-init 2-layer models of each registered mixer on paper 000's AR task (vocab 8192,
16 pairs), d_model 64. Tolerances: forwards 1e-4 in the logits (relative to their largest
magnitude, TF32 off), the engine 1e-5 in p(answer) (the engine's contract), the fused Mamba path
1e-4. Prints one line per check and the timings; exit status 0 when every check passes, 1 when
one fails. Without CUDA (``--device cuda``) it says so on one line and exits 0 having checked
nothing; ``--device cpu`` runs every check on the CPU, where device and CPU agree trivially
(a test of the script, not of a GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import hookmech
from hookmech.config import build_config
from hookmech.mixers import SPECS
from hookmech.patching import patch
from hookmech.oracles import plain_loop_patch

ROLES = ["key", "value", "query", "divider"]
FORWARD_TOL = 1e-4
ENGINE_TOL = 1e-5
FUSED_TOL = 1e-4


@dataclass
class Result:
    """One check: its name, the largest difference found, the tolerance, and whether it ran."""

    name: str
    difference: float | None
    tolerance: float
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.difference is None or self.difference <= self.tolerance

    def line(self) -> str:
        if self.difference is None:
            return f"SKIP  {self.name}: {self.note}"
        verdict = "ok  " if self.passed else "FAIL"
        return (
            f"{verdict}  {self.name}: max difference {self.difference:.2e} (tolerance {self.tolerance:.0e}){self.note}"
        )


def make_task(small: bool):
    """Paper 000's AR task (its code's ar_32: vocab 8192, 16 pairs), or with `small` the CPU proxy
    task of the bundled fixtures (vocab 64, 4 pairs)."""
    if small:
        return hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    return hookmech.tasks.make("ar", vocab_size=8192, num_kv_pairs=16)


def benched_mixers() -> list[str]:
    """Every mixer whose spec says the benches include it (`MixerSpec.bench`)."""
    return [name for name, spec in SPECS.items() if spec.bench]


def make_model(task, mixer: str, d_model: int = 64, n_layers: int = 2, seed: int = 0) -> hookmech.HookedLM:
    """A random-init model of `mixer` for `task`, on the CPU, in eval mode."""
    torch.manual_seed(seed)
    config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=mixer, d_model=d_model, n_layers=n_layers)
    return hookmech.HookedLM(config).eval()


def check_forwards(device: torch.device, task, n: int) -> list[Result]:
    """Every registered mixer: the logits of the same model and tokens on `device` and on the CPU."""
    tokens = task.sample(n, seed=0).tokens
    results = []
    for mixer in benched_mixers():
        model = make_model(task, mixer)
        with torch.no_grad():
            reference = model(tokens)
            on_device = model.to(device)(tokens.to(device)).cpu()
        scale = reference.abs().max().clamp(min=1e-12)
        difference = ((on_device - reference).abs().max() / scale).item()
        results.append(Result(f"forward {mixer} on {device} vs cpu (relative)", difference, FORWARD_TOL))
    return results


def check_engine(device: torch.device, task, n: int, mixers: list[str]) -> list[Result]:
    """The engine against the plain loop, both on `device`, every block site x the four roles."""
    batch = task.sample(n, seed=1).to(device)
    results = []
    for mixer in mixers:
        model = make_model(task, mixer).to(device)
        reference = plain_loop_patch(model, batch, ["all"], ROLES)
        records = patch(model, batch, ["all"], ROLES)
        difference = max(abs(r["p_patched"] - reference[r["hook"], r["pos"]]["p_patched"]) for r in records)
        results.append(Result(f"engine vs plain loop, {mixer} on {device}", difference, ENGINE_TOL))
    return results


def check_fused_mamba(device: torch.device, task, n: int) -> Result:
    """Mamba's fused kernels (taken on CUDA when they import) against its pure-PyTorch path."""
    from hookmech.mixers.mamba import fused_kernels_available

    name = f"mamba fused kernels vs pure PyTorch on {device}"
    probe = torch.zeros(1, device=device)
    if not fused_kernels_available(probe):
        why = "not CUDA" if device.type != "cuda" else "mamba-ssm / causal-conv1d do not import"
        return Result(name, None, FUSED_TOL, note=f"skipped ({why})")
    model = make_model(task, "mamba").to(device)
    tokens = task.sample(n, seed=0).tokens.to(device)
    with torch.no_grad():
        fused = model(tokens)
        for block in model.blocks:
            block.mixer.use_fast_path = False
        reference = model(tokens)
    scale = reference.abs().max().clamp(min=1e-12)
    return Result(name + " (relative)", ((fused - reference).abs().max() / scale).item(), FUSED_TOL)


def timed(run: Callable[[], object], device: torch.device, reps: int) -> float:
    """Best of `reps` wall-clock seconds of `run()`, synchronising the device around each."""
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def time_engine(device: torch.device, task, n: int, mixers: list[str], reps: int) -> list[str]:
    """Lines: the plain loop and the engine on `device` (best of `reps`, interleaved), and their ratio."""
    batch = task.sample(n, seed=1).to(device)
    lines = []
    for mixer in mixers:
        model = make_model(task, mixer).to(device)
        patch(model, batch.select(slice(0, 4)), ["L0.block_in"], ["key"])  # warm-up
        plain = engine = float("inf")
        for _ in range(reps):
            plain = min(plain, timed(lambda m=model: plain_loop_patch(m, batch, ["all"], ROLES), device, 1))
            engine = min(engine, timed(lambda m=model: patch(m, batch, ["all"], ROLES), device, 1))
        lines.append(
            f"time  engine, {mixer}, N={n}: plain loop {plain:.3f} s, engine {engine:.3f} s, {plain / engine:.1f}x"
        )
    return lines


def time_training_step(device: torch.device, task, mixers: list[str], steps: int) -> list[str]:
    """Lines: ms per AdamW step (forward, backward, update) of a batch of 32, per mixer."""
    from hookmech.training import answer_loss

    lines = []
    batch = task.sample(32, seed=2).trimmed().to(device)
    for mixer in mixers:
        model = make_model(task, mixer).to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

        def step(model=model, optimizer=optimizer) -> None:
            loss = answer_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        step()  # warm-up
        seconds = timed(lambda: [step() for _ in range(steps)], device, 3) / steps
        lines.append(f"time  training step, {mixer}, batch 32: {seconds * 1e3:.1f} ms")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    parser.add_argument("--n", type=int, default=320, help="examples of the engine's timing")
    parser.add_argument("--quick", action="store_true", help="fewer rows, attention and mamba only, one repetition")
    parser.add_argument("--small-task", action="store_true", help="the CPU proxy task (vocab 64, 4 pairs)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available here (torch.cuda.is_available() is False): nothing was checked; "
            "--device cpu runs the same checks on the CPU as a dry run of this script"
        )
        return 0
    if device.type == "cuda":
        # TF32 matmuls differ from fp32 by ~1e-3: the checks compare fp32 with fp32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    task = make_task(args.small_task)
    mixers = ["attention", "mamba"] if args.quick else benched_mixers()
    n_check, n_time, reps = (8, 16, 1) if args.quick else (32, args.n, 3)
    results = [
        *check_forwards(device, task, n_check),
        *check_engine(device, task, n_check, mixers),
        check_fused_mamba(device, task, n_check),
    ]
    for result in results:
        print(result.line(), flush=True)
    for line in time_engine(device, task, n_time, mixers, reps) + time_training_step(
        device, task, mixers, 2 if args.quick else 20
    ):
        print(line, flush=True)
    failed = [result.name for result in results if not result.passed]
    print(
        f"{len(results) - len(failed)} of {len(results)} checks passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
