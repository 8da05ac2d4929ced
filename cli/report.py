"""`hookmech report`."""

from __future__ import annotations

import click

from .common import (
    CONTEXT,
    EXAMPLES_SEED,
    OutputPath,
    allow_mixer_option,
    refuse_overwriting_inputs,
    set_threads,
    split_flag,
    threads_option,
)

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither


@click.command(context_settings=CONTEXT)
@allow_mixer_option
@click.argument("runs_dir", type=click.Path(file_okay=False, exists=True))
@click.option(
    "-o",
    "--out",
    "out_dir",
    required=True,
    type=OutputPath(file_okay=False),
    help="report folder (written whole; replaces an earlier report there)",
)
@click.option("--run", "run_ids", multiple=True, help="runs for heatmaps and dynamics (default: best of each series)")
@click.option("--n", type=int, default=320, show_default=True, help="examples per heatmap")
@click.option("--seed", type=int, default=EXAMPLES_SEED, show_default=True, help="seed of the heatmap examples")
@click.option("--no-heatmaps", is_flag=True, help="skip the site x position heatmaps (they patch each selected run)")
@threads_option
def report(runs_dir, out_dir, run_ids, n, seed, no_heatmaps, threads):
    """Write PNG figures and report.md for a sweep folder (RUNS_DIR/results.csv)."""
    from hookmech.errors import UsageError
    from hookmech.report import build_report

    if n < 1:
        raise UsageError(f"--n must be >= 1, got {n}")
    inputs = [("RUNS_DIR", runs_dir), *(("RUNS_DIR", f"{runs_dir}/{name}") for name in ("results.csv", "sweep.json"))]
    refuse_overwriting_inputs([("-o", out_dir), ("-o", f"{out_dir}/report.md")], inputs)
    set_threads(threads)
    path = build_report(
        runs_dir,
        out_dir,
        runs=split_flag(run_ids) or None,
        n=n,
        seed=seed,
        heatmaps=not no_heatmaps,
        log=lambda message: click.echo(message, err=True),
    )
    click.echo(f"wrote {path}")
