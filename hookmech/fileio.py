"""Files: every file hookmech writes appears whole or not at all (`atomic_path`); a JSON file
that does not parse is an error naming it (`read_json`)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import HookmechError


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.

    On error the temporary file is removed and an existing `path` is left untouched.
    """
    path = Path(path)
    _check_folders(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:  # name the file asked for, not the temporary one
        raise type(error)(error.errno, error.strerror, str(path)) from None
    os.close(fd)
    # mkstemp creates 0600; give the file the permissions a plain open() would
    os.chmod(tmp_name, 0o666 & ~_current_umask())
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


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


def _current_umask() -> int:
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
