"""The first thing a command shows on a terminal: a status line ("hookmech train: starting
(loading torch)…") while it imports torch and TransformerLens (seconds on a loaded machine),
erased by the command's first output of its own. Nothing is shown when stderr is not a
terminal: logs and pipes get only the command's own lines (an error stays one line)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

#: commands that print at once without loading torch: no status line for them
INSTANT = frozenset({"--help", "-h", "--version"})
ERASE = "\r\033[K"


class _ErasingStream:
    """A stream that erases the status line before its first write, then hands every call to
    `stream` (objects that took it while the status showed, tqdm's bars, keep working)."""

    def __init__(self, stream: TextIO, status: StatusLine):
        self._stream, self._status = stream, status

    def write(self, text: Any) -> int:
        self._status.erase()
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class StatusLine:
    """A status line on the terminal (stderr), erased by the first write to stdout or stderr,
    or by `erase`."""

    def __init__(self) -> None:
        self.shown = False
        self._streams: tuple[TextIO, TextIO] | None = None

    def show(self, text: str) -> None:
        """Write `text` on stderr without a newline, when stderr is a terminal."""
        if not sys.stderr.isatty():
            return
        self._streams = (sys.stdout, sys.stderr)
        sys.stderr.write(ERASE + text)
        sys.stderr.flush()
        self.shown = True
        sys.stdout = _ErasingStream(self._streams[0], self)  # type: ignore[assignment]
        sys.stderr = _ErasingStream(self._streams[1], self)  # type: ignore[assignment]

    def erase(self) -> None:
        """Erase the line (once) and give sys.stdout and sys.stderr back."""
        if not self.shown or self._streams is None:
            return
        self.shown = False
        stdout, stderr = self._streams
        sys.stdout, sys.stderr = stdout, stderr
        stdout.flush()
        stderr.write(ERASE)
        stderr.flush()


def command_name(argv: list[str]) -> str | None:
    """Return the command `argv` runs (its first word that is not an option), or None when it
    only asks for help or the version, or names no command."""
    if any(word in INSTANT for word in argv):
        return None
    return next((word for word in argv if not word.startswith("-")), None)
