"""Atomic file writing: every file hookmech writes appears whole or not at all.

A file is written to a temporary file beside its destination, named
``.<name>.<pid>@<host>.<random>.tmp`` (the writer's process id and host), and renamed onto the
destination when complete. A killed writer leaves its temporary file behind; the next hookmech
writer into the same folder removes the temporary files of writers that are no longer running
on this host (never a live writer's, never a file that does not match this pattern).
Every file gets the permissions a plain ``open()`` would give it under the process's umask.
A full disk is reported as ``HookmechError("no space left on device writing PATH")`` (a full
quota or the file size limit likewise), with the temporary file removed. A JSON file that
does not parse is an error naming it (`read_json`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import HookmechError

# h5py is imported where used: the other files' readers and writers load without it

#: the temporary files atomic_path makes: ``.<name>.<pid>@<host>.<8 random chars>.tmp``
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>[0-9]+)@(?P<host>[A-Za-z0-9-]*)\.[a-z0-9_]{8}\.tmp$")


def _host_tag() -> str:
    """This machine's name as it appears in temporary names (letters, digits, '-'; at most 40)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40]


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.
    A `path` that is a FIFO or a character device is yielded itself, and written in place;
    one that is a folder, a socket or a block device is refused (HookmechError): what exists
    there and is not a regular file is never replaced.

    On error the temporary file is removed and an existing `path` is left untouched; a full
    disk becomes a `HookmechError` naming `path` (`disk_full_as_error`). The file gets the
    umask's permissions (``0o666 & ~umask``) whatever the block wrote it with. Temporary files
    of dead writers in the same folder are removed first (`remove_stale_temp_files`).
    """
    path = Path(path)
    _check_folders(path)
    if writes_in_place(path):
        with disk_full_as_error(path):
            yield path
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path.parent)
    with naming(path):
        fd, tmp_name = tempfile.mkstemp(
            prefix=f".{path.name}.{os.getpid()}@{_host_tag()}.", suffix=".tmp", dir=path.parent
        )
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with disk_full_as_error(path):
            yield tmp
            # mkstemp creates 0600, and some writers (safetensors) replace the file with
            # their own 0600 one: give the file the permissions a plain open() would
            os.chmod(tmp, 0o666 & ~_current_umask())
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Re-raise an OSError of the block (making a temporary file or folder beside `path`: a
    read-only folder) as one naming `path`, the output the user asked for, not the temporary
    name. Yields None."""
    try:
        yield
    except OSError as error:
        raise type(error)(error.errno, error.strerror, str(path)) from None


def destination_kind(path: str | Path) -> str | None:
    """Return what `path` is when it exists and is not a regular file (or a link to one): "a
    folder", "a FIFO (named pipe)", "a character device", "a block device", "a socket"; else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing (or unreadable: the write names the reason)
        return None
    kinds = [
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((kind for test, kind in kinds if test(mode)), None)


#: destinations that are written in place, not replaced: a stream a reader takes the bytes from
WRITTEN_IN_PLACE = ("a FIFO (named pipe)", "a character device")


def writes_in_place(path: str | Path) -> bool:
    """Whether `path` is a FIFO or a character device (/dev/null), which is written directly (a
    rename would replace it with a regular file); a HookmechError for a folder, a socket or a
    block device, which are never written over; False for a regular file or nothing."""
    kind = destination_kind(path)
    if kind is None:
        return False
    if kind not in WRITTEN_IN_PLACE:
        raise HookmechError(f"cannot write {path}: it is {kind}, not a file; give a file path")
    return True


def _check_folders(path: Path) -> None:
    """Raise a HookmechError naming the first folder above `path` that exists as a file."""
    for folder in reversed(path.parents):
        if folder.exists() and not folder.is_dir():
            raise HookmechError(f"cannot write {path}: {folder} is a file, not a folder")


def read_json(path: str | Path) -> Any:
    """Return the JSON value in the file at `path`; a HookmechError naming the file if it is
    not valid JSON (e.g. cut short)."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HookmechError(f"{path}: not valid JSON ({error}); fix or delete the file") from None


def remove_stale_temp_files(folder: str | Path) -> list[Path]:
    """Remove the temporary files of `atomic_path` writers that are no longer running.

    Only files named like `TEMP_NAME` with this host's name and the id of a process that does
    not exist (``os.kill(pid, 0)``) are removed: a live writer's file, another host's and any
    other file are kept. Returns the paths removed.
    """
    removed: list[Path] = []
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


def temp_prefix(path: str | Path) -> str:
    """Return how this process's temporary names for `path` begin: ``.<name>.<pid>@<host>.``
    (`TEMP_NAME`; `tempfile.mkdtemp` adds the random part and the suffix)."""
    return f".{Path(path).name}.{os.getpid()}@{_host_tag()}."


def temp_owner_gone(name: str) -> bool:
    """True when `name` is a temporary name (`TEMP_NAME`, with any suffix in place of ``.tmp``)
    whose writer ran on this host and is no longer running: a name no live process owns."""
    match = TEMP_NAME.match(name.rsplit(".", 1)[0] + ".tmp")
    return match is not None and match["host"] == _host_tag() and not _process_exists(int(match["pid"]))


@contextlib.contextmanager
def disk_full_as_error(path: str | Path) -> Iterator[None]:
    """Turn a full disk (or quota, or file size limit) inside the block into one
    ``HookmechError("no space left on device writing PATH")``, for writers that cannot use
    `atomic_path` (e.g. appending to a log). Yields None."""
    try:
        yield
    except Exception as error:
        reason = write_failure_reason(error)
        if reason is not None:
            raise HookmechError(f"{reason} writing {path}") from None
        raise


#: errno values that mean "the device took no more of this file", and how to say so
_WRITE_FAILURES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit exceeded",
}
# HDF5 and safetensors report the errno inside their messages, not as the exception's errno
_ERRNO_IN_TEXT = re.compile(r"errno = (\d+),|\(os error (\d+)\)|\[Errno (\d+)\]")


def write_failure_reason(error: BaseException) -> str | None:
    """Return "no space left on device" (or "disk quota exceeded", "file size limit
    exceeded") if `error`, or an error it was raised from or during, says so; else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = getattr(current, "errno", None)
        if code in _WRITE_FAILURES:
            return _WRITE_FAILURES[code]
        for match in _ERRNO_IN_TEXT.finditer(str(current)):
            code = int(next(group for group in match.groups() if group is not None))
            if code in _WRITE_FAILURES:
                return _WRITE_FAILURES[code]
        if "No space left on device" in str(current):
            return _WRITE_FAILURES[errno.ENOSPC]
        current = current.__cause__ or current.__context__
    return None


@contextlib.contextmanager
def atomic_h5(path: str | Path) -> Iterator:
    """Yield an `h5py.File` opened for writing on a temporary path; rename it onto `path`
    when the block succeeds (as `atomic_path`).

    If the block, the final flush or the closing fails, the partial file is closed without
    writing anything more to it (`_abandon_h5`: on a full disk, closing it normally fails
    half-way and leaves h5py's ids to crash the interpreter later), then removed. Keep every
    dataset the block creates referenced until the block ends: a dataset freed earlier is
    flushed by h5py's destructor, which can only print a failure and go on.
    """
    import h5py

    if destination_kind(path) == WRITTEN_IN_PLACE[0]:
        raise HookmechError(f"cannot write {path}: it is a FIFO (named pipe), and HDF5 writes a file it can seek in")
    with atomic_path(path) as tmp:
        h5 = h5py.File(tmp, "w")
        try:
            yield h5
            h5.flush()  # raises where closing would only print (a full disk)
            h5.close()
        except BaseException:
            _abandon_h5(h5, tmp)
            raise


def _abandon_h5(h5, tmp: Path) -> None:
    """Close a file that failed, ignoring its errors: it is removed next.

    HDF5 flushes every buffered write while it closes a file, and on a full disk those fail
    half-way, leaving h5py objects that crash the interpreter when they are freed. So the
    file's descriptor is pointed at /dev/null first: the flushes succeed (into nothing) and
    the close completes; the partial file is truncated to give its space back at once.
    """
    with contextlib.suppress(OSError):
        os.truncate(tmp, 0)
    with contextlib.suppress(Exception):
        handle = h5.id.get_vfd_handle()  # the POSIX descriptor of h5py's default (sec2) driver
        if isinstance(handle, int) and handle > 2:
            sink = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(sink, handle)
            finally:
                os.close(sink)
    with contextlib.suppress(Exception):
        h5.close()


def _current_umask() -> int:
    """Return the process's umask (from /proc where it can, since setting it to read it is not thread-safe)."""
    with contextlib.suppress(OSError, ValueError, IndexError):  # no /proc here: fall back below
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
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


def size_text(n_bytes: int) -> str:
    """Return a file size as people read it: "812 B", "49.6 KiB", "3.2 MiB", "1.1 GiB"."""
    if n_bytes < 1024:
        return f"{n_bytes} B"
    size = float(n_bytes)
    for unit in ("KiB", "MiB"):
        size /= 1024
        if size < 1023.95:  # what would print as 1024.0 reads as the next unit
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} GiB"
