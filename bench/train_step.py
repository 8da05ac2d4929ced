"""Training step time of each architecture of a sweep preset, against attention in the same run.

    python bench/train_step.py [--preset ar-paper-d64 | --sweep FILE ...] [--threads 1] [--steps 30]
        [--reps 3] [--length-groups 1,8]

For each architecture of the preset's grid (the first grid point of each; or of each sweep file),
builds exactly the model, task and trainer the sweep would run, and times full optimizer steps
(forward, backward, AdamW) on its training batches. Repetitions are interleaved across
architectures (the machine is shared and noisy); the best block of each is reported, in ms per step
and as a ratio to attention's step measured in the same run. Also prints what a run of the
preset's length costs. `--length-groups` times each architecture at each of these
`TrainConfig.length_groups` (the file's own when not given), the first the baseline of the last
column.
"""

from __future__ import annotations

import argparse
import time

import torch

from hookmech.allocator import keep_freed_memory
from hookmech.model import HookedLM
from hookmech.sweep import build_run, expand, load_preset, load_sweep
from hookmech.training import DataStream, answer_loss, learning_rate


def one_run_per_arch(sweep) -> dict[str, dict]:
    """Return {architecture: the first run dict of the sweep (a parsed preset or file) with it}."""
    runs = {}
    for run in expand(sweep):
        arch = run.point.get("arch") or run.point.get("mixer") or run.model.get("arch") or run.model.get("mixer")
        runs.setdefault(str(arch), run.as_dict())
    return runs


class Stepper:
    """One architecture's model, optimizer and data stream; `step(i)` runs optimizer step i."""

    def __init__(self, run: dict, n_train: int, length_groups: int | None = None):
        task, model_config, train_config = build_run(run)
        if length_groups is not None:
            train_config = type(train_config)(**{**train_config.__dict__, "length_groups": length_groups})
        self.config = train_config
        torch.manual_seed(train_config.seed)
        self.model = HookedLM(model_config).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train_config.lr, weight_decay=0.0)
        # a small training set of the same documents: generation cost is not the step's
        small = type(train_config)(**{**train_config.__dict__, "n_train": n_train, "epochs": 1, "steps": None})
        self.data = DataStream(task, small)
        self.total_steps = train_config.total_steps()

    def step(self, index: int) -> None:
        batch = self.data.batch(index % self.data.config.steps_per_epoch()).trimmed()
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(index, self.config)
        loss = answer_loss(self.model, batch, self.config.length_groups)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def time_block(stepper: Stepper, start: int, steps: int) -> float:
    began = time.perf_counter()
    for index in range(start, start + steps):
        stepper.step(index)
    return (time.perf_counter() - began) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ar-paper-d64")
    parser.add_argument("--sweep", nargs="+", default=None, help="sweep files instead of the preset")
    parser.add_argument("--length-groups", default=None, help="comma list: time each architecture at each")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30, help="steps per timed block")
    parser.add_argument("--reps", type=int, default=3, help="interleaved blocks per architecture")
    parser.add_argument("--only", default=None, help="comma list of architectures (attention is always kept)")
    parser.add_argument(
        "--plain-malloc", action="store_true", help="leave glibc's allocator as it is (the trainer tunes it)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.plain_malloc:
        keep_freed_memory()  # as hookmech.training.train does
    if args.sweep:
        runs = {arch: run for path in args.sweep for arch, run in one_run_per_arch(load_sweep(path)).items()}
    else:
        runs = one_run_per_arch(load_preset(args.preset))
    if args.only:
        keep = set(args.only.split(",")) | {"attention"}
        runs = {arch: run for arch, run in runs.items() if arch in keep}
    groupings = [None] if args.length_groups is None else [int(g) for g in args.length_groups.split(",")]
    steppers = {
        (arch, groups): Stepper(run, n_train=32 * 64, length_groups=groups)
        for arch, run in runs.items()
        for groups in groupings
    }
    for stepper in steppers.values():
        time_block(stepper, 0, 3)  # warm-up: allocator, first-call dispatch
    best = {arch: float("inf") for arch in steppers}
    for rep in range(args.reps):
        for arch, stepper in steppers.items():
            best[arch] = min(best[arch], time_block(stepper, 3 + rep * args.steps, args.steps))
    allocator = "glibc defaults" if args.plain_malloc else "freed blocks kept, as the trainer does"
    source = " ".join(args.sweep) if args.sweep else f"preset {args.preset}"
    print(f"{source}, {args.threads} thread(s), best of {args.reps} blocks of {args.steps} steps, {allocator}")
    print(
        f"{'architecture':<12} {'groups':>6} {'ms/step':>8} {'x attention':>12} {'steps/run':>10} {'run (h)':>8} "
        f"{'x groups ' + str(groupings[0]):>12}"
    )
    for (arch, groups), seconds in best.items():
        stepper = steppers[arch, groups]
        base = best.get(("attention", groups))
        ratio = f"{seconds / base:.2f}" if base else "-"
        first = best[arch, groupings[0]] / seconds
        print(
            f"{arch:<12} {stepper.config.length_groups:>6} {seconds * 1e3:8.1f} {ratio:>12} {stepper.total_steps:>10} "
            f"{seconds * stepper.total_steps / 3600:8.2f} {first:>12.2f}"
        )


if __name__ == "__main__":
    main()
