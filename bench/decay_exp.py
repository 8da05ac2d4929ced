"""Time the Mamba scan with `decay_exp_` against plain `torch.exp` for its decays exp(Δ A).

A Mamba that stays at chance drives many Δ A below -104, where float32 exp is 0 and, on the CPU,
off its fast path (the chance-level models of results/ar-table: 23-43 % of their decays are 0,
0-1.4 % subnormal, in whole channels). Same process, same mixer, the two exps interleaved,
forward+backward of one `Mamba` mixer at d_model 64 (d_inner 128, d_state 16), in three regimes:

* ``default``: mamba-ssm's init, nothing underflows (the cost of the check);
* ``third``: a third of the channels with A_log + 8 and Δ ≈ 3, whose decays are all 0 (as in the
  chance-level models), the rest as initialised;
* ``all-zero``: every decay underflows to 0.

Also exp alone on 2M float32 values at -10, -95 (subnormal) and -200 (zero). Prints the best
time of each and the ratio plain / ours (above 1: ours is faster).

    python bench/decay_exp.py [--batch 32] [--length 256] [--reps 10] [--threads 1]
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from hookmech.mixers import selective_scan as scan_module
from hookmech.mixers.decay_exp import ROUNDS_TO_ZERO_BELOW, decay_exp_
from hookmech.mixers.mamba import Mamba


def best_time(run, reps: int) -> float:
    """Return the best wall time in seconds of `reps` calls of `run` (after one warm-up)."""
    run()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def plain_exp_(x: torch.Tensor, factors=None) -> torch.Tensor:
    return x.exp_()


def timed_both(run, reps: int) -> tuple[float, float]:
    """Best time of `run` with the scan's exp as shipped and with plain exp, interleaved."""
    best = {decay_exp_: float("inf"), plain_exp_: float("inf")}
    for rep in range(reps + 1):
        for exp in best:
            scan_module.decay_exp_ = exp
            start = time.perf_counter()
            run()
            if rep:  # the first round warms up
                best[exp] = min(best[exp], time.perf_counter() - start)
    scan_module.decay_exp_ = decay_exp_
    return best[decay_exp_], best[plain_exp_]


def mixer_in(regime: str, d_model: int) -> Mamba:
    torch.manual_seed(0)
    mixer = Mamba(d_model=d_model)
    channels = slice(None) if regime == "all-zero" else slice(0, mixer.d_inner // 3)
    if regime != "default":
        with torch.no_grad():
            mixer.A_log[channels] += 8.0
            mixer.dt_proj.bias[channels] = 3.0
    return mixer


def underflow_fractions(mixer: Mamba, x: torch.Tensor) -> tuple[float, float]:
    """Fractions of the mixer's Δ A on `x` whose exp is 0 and subnormal."""
    with torch.no_grad():
        in_x, _ = mixer._split(mixer.in_proj(x))
        _, delta, _, _ = mixer._ssm_inputs(mixer._causal_conv(in_x), convolved=True)
        log_decay = delta[..., None] * mixer._A()
    zero = log_decay < ROUNDS_TO_ZERO_BELOW
    subnormal = ~zero & (log_decay < math.log(torch.finfo(torch.float32).tiny))  # below -87.34
    return zero.float().mean().item(), subnormal.float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s)")

    x = torch.randn(args.batch, args.length, args.d_model)
    print(f"Mamba mixer forward+backward, batch {args.batch}, length {args.length}, d_model {args.d_model}:")
    for regime in ("default", "third", "all-zero"):
        mixer = mixer_in(regime, args.d_model)
        zero, subnormal = underflow_fractions(mixer, x)

        def run(mixer=mixer):
            mixer.zero_grad(set_to_none=True)
            mixer(x).square().mean().backward()

        ours, plain = timed_both(run, args.reps)
        print(f"  {regime:9s} (decays 0: {zero:5.1%}, subnormal: {subnormal:4.1%})  plain exp {plain * 1e3:7.1f} ms"
              f"  decay_exp_ {ours * 1e3:7.1f} ms  ratio {plain / ours:5.2f}x")

    print("exp of 2M float32 values, all at one argument:")
    for value in (-10.0, -95.0, -200.0):
        values = torch.full((2_000_000,), value)
        plain = best_time(lambda values=values: values.clone().exp_(), args.reps)
        ours = best_time(lambda values=values: decay_exp_(values.clone()), args.reps)
        times = f"plain exp {plain * 1e3:6.1f} ms  decay_exp_ {ours * 1e3:6.1f} ms"
        print(f"  {value:7.1f}  {times}  ratio {plain / ours:5.2f}x")


if __name__ == "__main__":
    main()
