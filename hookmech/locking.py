"""Advisory locks on the folders hookmech writes into (a run folder, a sweep's runs folder).

`folder_lock(folder)` holds an exclusive OS lock (``fcntl.flock``) on ``folder/.lock`` for as
long as the block runs; the file holds the holder's PID, for the message another process gets.
The OS drops the lock when its holder exits, however it exits, so a killed run never leaves a
folder locked; the holder removes the file when it is done. Nested locks on one folder in one
thread are free (a sweep worker locks its run folder, then the trainer locks it again).
Where `fcntl` does not exist (Windows) folders are not locked.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from .errors import HookmechError, UsageError
from .fileio import disk_full_as_error

if sys.platform == "win32":  # pragma: no cover - not on POSIX
    fcntl = None
else:
    import fcntl

LOCK_NAME = ".lock"

_held: dict[Path, tuple[int, int]] = {}  # resolved folder -> (pid, thread) holding its lock
_guard = threading.Lock()


class FolderLocked(HookmechError):
    """Another process (or thread) is writing into the folder."""


def _busy(folder: Path, what: str, pid: str | None) -> FolderLocked:
    holder = f"process {pid}" if pid else "another process"
    return FolderLocked(
        f"{what} {folder} is in use by {holder} (another hookmech run writing into it); "
        "wait for it to finish, or choose another folder"
    )


def _read_pid(fd: int) -> str | None:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return None
    return text if text.isdigit() else None


def _acquire(folder: Path, what: str) -> int:
    """Return an open descriptor of ``folder/.lock`` holding its exclusive lock, or raise `FolderLocked`."""
    path = folder / LOCK_NAME
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:  # the folder was removed under us: make it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise _busy(folder, what, pid) from None
        except BaseException:
            os.close(fd)
            raise
        # the holder before us may have removed the file between our open and our lock: the lock
        # then sits on a file nobody else can see, so start again on the file now at `path`
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            _write_pid(fd, path)
            return fd
        os.close(fd)


def _write_pid(fd: int, path: Path) -> None:
    """Write our PID into the lock file `path` (open as `fd`, locked). If that fails (a full disk
    has room for the file's name, not for its bytes), remove the file and close `fd`, so that no
    empty lock file stays behind, and raise: a full disk as a HookmechError naming `path`."""
    try:
        with disk_full_as_error(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)  # still locked: nobody else holds this file (see `_acquire`)
        os.close(fd)
        raise


@contextlib.contextmanager
def folder_lock(folder: str | Path, what: str = "folder") -> Iterator[Path]:
    """Hold the advisory lock of `folder` for the block; yield the folder. A missing folder is
    made, and removed again at the end if the block left it empty.

    Raises `FolderLocked` (a HookmechError naming the folder and the PID holding it) at once if
    another process, or another thread of this one, holds it. `what` names the folder in that
    message ("run folder", "runs folder").
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{what} {folder} is a file, not a folder")
    made = not folder.exists()
    if fcntl is None:  # pragma: no cover - not on POSIX
        folder.mkdir(parents=True, exist_ok=True)
        yield folder
        return
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    me = (os.getpid(), threading.get_ident())  # a forked child is not the holder
    with _guard:
        holder = _held.get(key)
        if holder is not None and holder != me:
            raise _busy(folder, what, str(os.getpid()))
    if holder == me:  # nested: the outer block holds the lock and releases it
        yield folder
        return
    try:
        fd = _acquire(folder, what)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):  # only if empty, as below
                folder.rmdir()
        raise
    with _guard:
        _held[key] = me
    try:
        yield folder
    finally:
        with _guard:
            del _held[key]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / LOCK_NAME)  # while still locked: see `_acquire`
        os.close(fd)
        if made:
            with contextlib.suppress(OSError):  # only if empty: a block that wrote nothing leaves no folder
                folder.rmdir()
