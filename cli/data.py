"""`hookmech data`: write a task's rows to a dataset file, or print the task's statistics."""

from __future__ import annotations

import json

import click

from .common import CONTEXT, EXAMPLES_SEED, OutputPath

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither

_WRITE_N, _STATS_N = 100_032, 10_000


@click.command(context_settings=CONTEXT)
@click.argument("task_name", metavar="TASK")
@click.option("--task-opt", multiple=True, metavar="K=V", help="task option (repeatable), e.g. num_terminals=20")
@click.option(
    "--n",
    type=int,
    default=None,
    help=f"rows (default: {_WRITE_N:,} to write, {_STATS_N:,} for --stats; prompts: all of them)",
)
@click.option("--seed", type=int, default=EXAMPLES_SEED, show_default=True, help="seed of the rows")
@click.option("--stats", is_flag=True, help="print the task's statistics instead of writing a file")
@click.option("--json", "as_json", is_flag=True, help="with --stats: print JSON")
@click.option(
    "-o", "--out", "out_path", type=OutputPath(dir_okay=False), default=None, help="dataset file to write (HDF5)"
)
def data(task_name, task_opt, n, seed, stats, as_json, out_path):
    """Write TASK's rows to a dataset file (-o), or print its statistics (--stats).

    The file holds tokens, corrupt tokens, answers, roles (and ATR's tree) with the task spec;
    `hookmech train --data FILE` and `hookmech patch --data FILE` read it.
    """
    from hookmech import tasks
    from hookmech.datasets import save_dataset, task_statistics
    from hookmech.errors import UsageError
    from hookmech.option_pairs import parse_options

    if stats == (out_path is not None):
        raise UsageError("give -o FILE to write a dataset, or --stats to print statistics (not both)")
    if as_json and not stats:
        raise UsageError("--json goes with --stats")
    if n is not None and n < 1:
        raise UsageError(f"--n must be >= 1, got {n}")
    if seed < 0:
        raise UsageError(f"--seed must be >= 0, got {seed}")
    task = tasks.make(task_name, **parse_options(task_opt, "--task-opt"))
    if n is None:  # a task of given rows (the user's prompts): all of them
        n = task.n_rows if task.n_rows is not None else (_STATS_N if stats else _WRITE_N)
    if stats:
        result = task_statistics(task, n, seed)
        click.echo(json.dumps(result, indent=1) if as_json else _format_stats(result))
        return
    batch = task.sample(n, seed=seed)
    save_dataset(batch, task, out_path, seed=seed)
    click.echo(
        f"wrote {out_path}: {len(batch)} rows of {task.name}, {batch.tokens.shape[1]} positions wide (seed {seed})"
    )


def _format_stats(result: dict) -> str:
    """Render nested statistics as `key: value` lines (sub-dicts on one line)."""
    lines = []
    for key, value in result.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={_number(v)}" for k, v in value.items())
        else:
            value = _number(value)
        lines.append(f"{key}: {value}")
    return "\n".join(lines)


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
