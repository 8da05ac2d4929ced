"""`hookmech` commands. Imports of torch and the library happen inside each command, so
`hookmech --help` stays instant. Errors become one line on stderr and a non-zero exit."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import click

from .analysis import cache, patch, sites
from .common import CONTEXT
from .das import das
from .data import data
from .demo import demo
from .evaluate import evaluate
from .offline import inspect, probe
from .report import report
from .startup import StatusLine, command_name
from .sweep import sweep
from .train import train
from .view import view


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="hookmech")
def cli() -> None:
    """Mechanistic evaluation of sequence models on in-context recall tasks.

    Make data (data), train models (train, sweep), list their hook sites (sites), cache
    activations (cache), measure where the answer's information flows with interchange
    interventions (patch) and in which subspace (das), analyse caches offline (inspect, probe),
    plot (report), look at results in a browser (view), and evaluate a mixer end to end
    (evaluate: accuracy and mechanism on a suite of tasks, as a report card).
    `hookmech demo` runs it all on the bundled fixtures.
    """


for _command in (data, train, sites, cache, patch, das, inspect, probe, demo, sweep, report, view, evaluate):
    cli.add_command(_command)


def _fail(message: str, code: int) -> None:
    click.echo(f"hookmech: error: {message}", err=True)
    sys.exit(code)


#: errnos of file-system refusals the user can fix (a path, its permissions, a full disk):
#: they are reported as one plain line naming the path, not as unexpected errors
_FIXABLE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EACCES",
        "EPERM",
        "ENOENT",
        "EISDIR",
        "ENOTDIR",
        "EEXIST",
        "ENOSPC",
        "EDQUOT",
        "EROFS",
        "ENAMETOOLONG",
        "ELOOP",
    )
    if hasattr(errno, name)
)


def _fixable_os_error(error: OSError) -> str | None:
    """Return ``"PATH: reason"`` for an OSError the user can fix (`_FIXABLE_ERRNOS`; a full disk
    may name no path), else None."""
    if error.errno is None or error.errno not in _FIXABLE_ERRNOS:
        return None
    if error.filename is None and error.errno != errno.ENOSPC:
        return None
    reason = error.strerror or os.strerror(error.errno)
    paths = [str(name) for name in (error.filename, error.filename2) if name is not None]
    if error.errno == errno.ENOTDIR and len(paths) == 1:
        files = [folder for folder in reversed(Path(paths[0]).parents) if folder.is_file()]
        if files:
            return f"{paths[0]}: {files[0]} is a file, not a folder"
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning every error into one line on stderr and an exit code
    (2 for usage errors, 1 otherwise; a path the system refuses is named plainly, other
    unforeseen errors are marked unexpected). Set HOOKMECH_DEBUG=1 for tracebacks. On a
    terminal a status line shows within a fraction of a second of the start, until the command
    prints (`startup.StatusLine`). Returns None."""
    status = StatusLine()
    name = command_name(sys.argv[1:] if argv is None else argv)
    if name in cli.commands:
        status.show(f"hookmech {name}: starting (loading torch)…")
    try:
        _run(argv)
    finally:
        status.erase()


def _run(argv: list[str] | None) -> None:
    """`main`'s work: the CLI, its errors turned into lines and exit codes."""
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
        if isinstance(error, OSError) and (fixable := _fixable_os_error(error)):
            _fail(fixable, 1)
        if isinstance(error, MemoryError):  # a size the user asked for (--n, --n-dev, --n-train, --max-batch)
            _fail("out of memory: ask for fewer rows (--n, --n-dev, --n-train) or a smaller --max-batch", 1)
        _fail(
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
            "(unexpected; rerun with HOOKMECH_DEBUG=1 for a traceback)",
            1,
        )


if __name__ == "__main__":
    main()
