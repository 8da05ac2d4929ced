"""`hookmech demo`."""

from __future__ import annotations

import click

from .common import CONTEXT, allow_mixer_option, set_threads, threads_option

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither


@click.command(context_settings=CONTEXT)
@allow_mixer_option
@click.option(
    "--fixtures", type=click.Path(file_okay=False), default=None, help="fixtures folder (default: the bundled ones)"
)
@threads_option
def demo(fixtures, threads):
    """Run the paper's mechanistic evaluation on the bundled fixture checkpoints."""
    from hookmech.demo import run_demo

    set_threads(threads)
    run_demo(fixtures, out=click.echo)
