"""`hookmech sweep`."""

from __future__ import annotations

import click

from .common import (
    CONTEXT,
    OutputPath,
    check_device,
    device_option,
    refuse_overwriting_inputs,
    require_at_least,
    require_name,
    runs_engine_options,
)

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither


@click.command(context_settings=CONTEXT)
@click.argument("sweep_file", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--preset",
    default=None,
    help="a built-in sweep: ar-paper, ar-paper-d64, ar-paper-d64-pilot, ar-cpu, atr-paper, mamba-dconv, mqar-lr",
)
@click.option("--show-preset", default=None, metavar="NAME", help="print a preset's TOML and exit")
@click.option("-o", "--out", "runs_dir", default=None, type=OutputPath(file_okay=False), help="runs folder (RUNS)")
@runs_engine_options
@click.option("--dry-run", is_flag=True, help="check every run's options, list the runs and exit")
@device_option
def sweep(sweep_file, preset, show_preset, runs_dir, engine, workers, threads, address, gpus_per_run, dry_run, device):
    """Train a grid of runs (SWEEP_FILE or --preset) into RUNS/<run-id> and write RUNS/results.csv.

    Re-running the same sweep skips finished runs and resumes interrupted ones.
    """
    from hookmech.errors import UsageError
    from hookmech.sweep import expand, load_preset, load_sweep, preset_text, run_sweep, validate

    if show_preset is not None:
        click.echo(preset_text(show_preset), nl=False)
        return
    if (sweep_file is None) == (preset is None):
        raise UsageError("give a SWEEP_FILE or --preset NAME (one of them)")
    require_name("--preset", preset)
    require_at_least("--workers", workers, 1)
    require_at_least("--threads", threads, 1)
    if runs_dir is not None and not dry_run:
        refuse_overwriting_inputs(
            [("-o", runs_dir), *(("-o", f"{runs_dir}/{name}") for name in ("sweep.json", "results.csv"))],
            [("SWEEP_FILE", sweep_file)],
        )
    spec = load_sweep(sweep_file) if sweep_file is not None else load_preset(preset)
    if dry_run:
        runs = expand(spec)
        validate(runs)
        for run in runs:
            click.echo(run.run_id)
        click.echo(f"{len(runs)} runs", err=True)
        return
    if runs_dir is None:
        raise UsageError("missing option -o/--out RUNS")
    rows = run_sweep(
        spec,
        runs_dir,
        engine=engine,
        workers=workers,
        threads=threads,
        device=check_device(device),
        address=address,
        gpus_per_run=gpus_per_run,
    )
    finished = sum(row["status"] == "finished" for row in rows)
    click.echo(f"{runs_dir}/results.csv: {len(rows)} runs ({finished} finished)")
