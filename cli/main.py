"""`hookmech` commands. Imports of torch and the library happen inside each command, so
`hookmech --help` stays instant. Errors become one line on stderr and a non-zero exit."""
from __future__ import annotations

import os
import sys

import click

from .analysis import cache, patch, sites
from .common import CONTEXT
from .data import data
from .demo import demo
from .offline import inspect, probe
from .report import report
from .sweep import sweep
from .train import train


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="hookmech")
def cli() -> None:
    """Mechanistic evaluation of sequence models on in-context recall tasks.

    Make data (data), train models (train, sweep), list their hook sites (sites), cache
    activations (cache), measure where the answer's information flows with interchange
    interventions (patch), analyse caches offline (inspect, probe), and plot (report).
    `hookmech demo` runs it all on the bundled fixtures.
    """


for _command in (data, train, sites, cache, patch, inspect, probe, demo, sweep, report):
    cli.add_command(_command)


def _fail(message: str, code: int) -> None:
    click.echo(f"hookmech: error: {message}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning every error into one line on stderr and an exit code
    (2 for usage errors, 1 otherwise). Set HOOKMECH_DEBUG=1 for tracebacks."""
    try:
        cli.main(args=argv, standalone_mode=False, prog_name="hookmech")
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.exceptions.Abort:
        _fail("aborted", 130)
    except click.ClickException as error:
        message = error.format_message().replace("\n", " ")
        context = getattr(error, "ctx", None)
        if context is not None and isinstance(error, click.UsageError):
            message += f" (see '{context.command_path} --help')"
        _fail(message, 2 if isinstance(error, click.UsageError) else 1)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as error:  # the one place that turns any failure into one line
        if os.environ.get("HOOKMECH_DEBUG"):
            raise
        from hookmech.errors import HookmechError

        if isinstance(error, HookmechError):
            _fail(str(error).replace("\n", " "), error.exit_code)
        _fail(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
              "(unexpected; rerun with HOOKMECH_DEBUG=1 for a traceback)", 1)


if __name__ == "__main__":
    main()
