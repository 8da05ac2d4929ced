"""`hookmech evaluate`."""

from __future__ import annotations

import click

from .common import (
    CONTEXT,
    OutputPath,
    check_device,
    device_option,
    require_at_least,
    require_name,
    runs_engine_options,
    split_flag,
)

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither


@click.command(context_settings=CONTEXT)
@click.option(
    "--mixer", default=None, help="the mixer of every layer: a built-in, module:Class, file.py:Class or an entry point"
)
@click.option(
    "--arch", default=None, help="a built-in model preset instead (attention, based, mamba, h3, hyena, baseconv, ...)"
)
@click.option("--suite", "suite_name", default="quick", show_default=True, help="quick (CPU variants) or paper")
@click.option(
    "--lr", "lrs", type=float, multiple=True, help="learning rates in order of priority (default: the suite's)"
)
@click.option(
    "--mixer-opt", multiple=True, metavar="[L0.]K=V", help="mixer option for all layers, or L{l}.K=V for one layer"
)
@click.option("--budget-hours", type=float, default=None, help="run only what fits, planned from measured step times")
@click.option(
    "--tasks", "task_names", multiple=True, metavar="NAME,...", help="run only these tasks of the suite (a smoke test)"
)
@click.option(
    "--steps", type=int, default=None, help="train every run for N steps instead of the suite's (a smoke test)"
)
@runs_engine_options
@click.option("--no-view", is_flag=True, help="skip the view page of each task's best run")
@device_option
@click.option("-o", "--out", "out_dir", required=True, type=OutputPath(), help="the evaluation's folder (DIR)")
def evaluate(
    mixer,
    arch,
    suite_name,
    lrs,
    mixer_opt,
    budget_hours,
    task_names,
    steps,
    engine,
    workers,
    threads,
    address,
    gpus_per_run,
    no_view,
    device,
    out_dir,
):
    """Train a mixer on a suite's recall tasks, measure where the answer's information flows, and
    write DIR/card.md: accuracy, the mechanism verdict (induction / direct retrieval / both /
    neither, with its numbers), the learning-rate window and the reference architectures.

    Running it again resumes; --budget-hours leaves out what does not fit and says so
    (every task's first learning rate before any task's second). --tasks and --steps make a
    smoke test: a few steps of one task (--steps is another evaluation: give another -o).
    """
    from hookmech.errors import UsageError
    from hookmech.evaluate import evaluate as run_evaluation
    from hookmech.option_pairs import parse_options

    require_name("--mixer", mixer)
    require_name("--arch", arch)
    require_at_least("--workers", workers, 1)
    require_at_least("--threads", threads, 1)
    require_at_least("--steps", steps, 1)
    if address is not None and engine != "ray":
        raise UsageError("--address needs --engine ray")
    card = run_evaluation(
        out_dir,
        mixer=mixer,
        arch=arch,
        suite_name=suite_name,
        lrs=list(lrs) or None,
        mixer_options=parse_options(mixer_opt, "--mixer-opt"),
        budget_hours=budget_hours,
        tasks=split_flag(task_names) or None,
        steps=steps,
        engine=engine,
        workers=workers,
        threads=threads,
        device=check_device(device),
        address=address,
        gpus_per_run=gpus_per_run,
        views=not no_view,
        log=lambda message: click.echo(message, err=True),
    )
    for task in card["tasks"]:
        found = task["verdict"]
        click.echo(f"{task['task']}: {found['label'] if found else 'no run finished'}")
    click.echo(f"{out_dir}/card.md")
