"""Atomic file writing: every file hookmech writes appears whole or not at all.

A file is written to a temporary file beside its destination, named
``.<name>.<pid>@<host>.<random>.tmp`` (the writer's process id and host), and renamed onto the
destination when complete. A killed writer leaves its temporary file behind; the next hookmech
writer into the same folder removes the temporary files of writers that are no longer running
on this host (never a live writer's, never a file that does not match this pattern).
Every file gets the permissions a plain ``open()`` would give it under the process's umask.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: the temporary files atomic_path makes: ``.<name>.<pid>@<host>.<8 random chars>.tmp``
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>[0-9]+)@(?P<host>[A-Za-z0-9-]*)\.[a-z0-9_]{8}\.tmp$")


def _host_tag() -> str:
    """This machine's name as it appears in temporary names (letters, digits, '-'; at most 40)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40]


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.

    On error the temporary file is removed and an existing `path` is left untouched. The file
    gets the umask's permissions (``0o666 & ~umask``) whatever the block wrote it with. Temporary files
    of dead writers in the same folder are removed first (`remove_stale_temp_files`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path.parent)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}@{_host_tag()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        # mkstemp creates 0600, and some writers (safetensors) replace the file with their
        # own 0600 one: give the file the permissions a plain open() would
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def remove_stale_temp_files(folder: str | Path) -> list[Path]:
    """Remove the temporary files of `atomic_path` writers that are no longer running.

    Only files named like `TEMP_NAME` with this host's name and the id of a process that does
    not exist (``os.kill(pid, 0)``) are removed: a live writer's file, another host's and any
    other file are kept. Returns the paths removed.
    """
    removed = []
    host = _host_tag()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = TEMP_NAME.match(entry.name)
        if match is None or match["host"] != host or not entry.is_file(follow_symlinks=False):
            continue
        if _process_exists(int(match["pid"])):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def _process_exists(pid: int) -> bool:
    """True if a process `pid` exists here (also one of another user; unknown answers count as alive)."""
    if pid <= 0:
        return True  # not a writer's id: never treat it as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _current_umask() -> int:
    """Return the process's umask (from /proc where it can, since setting it to read it is not thread-safe)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def sha256_of(path: str | Path) -> str:
    """Return the hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
