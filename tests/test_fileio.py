"""Writing files: temporary names carry the writer's PID and dead writers' leftovers are removed,
permissions follow the umask, and a full disk is one clear error with no file left behind."""
from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import hookmech
from hookmech import fileio
from hookmech.cache import write_cache
from hookmech.errors import HookmechError
from hookmech.fileio import TEMP_NAME, atomic_path, remove_stale_temp_files, write_failure_reason, write_text_atomic

from helpers import ATTENTION_FIXTURE, fail_cache_write_on_call

HOOKS = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _temp_name(target: str, pid: int, host: str | None = None) -> str:
    return f".{target}.{pid}@{fileio._host_tag() if host is None else host}.abcd_123.tmp"


# -- temporary files ---------------------------------------------------------------------------
def test_temporary_name_carries_the_writer_pid(tmp_path):
    with atomic_path(tmp_path / "out.h5") as tmp:
        match = TEMP_NAME.match(tmp.name)
        assert match is not None and int(match["pid"]) == os.getpid() and match["name"] == "out.h5"
    assert [p.name for p in tmp_path.iterdir()] == ["out.h5"]


def test_next_writer_removes_dead_writers_temp_files_and_keeps_live_ones(tmp_path):
    dead = tmp_path / _temp_name("c.h5", _dead_pid())
    live = tmp_path / _temp_name("c.h5", os.getpid())
    other_host = tmp_path / _temp_name("c.h5", _dead_pid(), host="elsewhere")
    not_ours = [tmp_path / ".c.h5.x1y2z3ab.tmp", tmp_path / "notes.tmp", tmp_path / f".c.h5.{_dead_pid()}.tmp"]
    for path in [dead, live, other_host, *not_ours]:
        path.write_bytes(b"partial")
    write_text_atomic(tmp_path / "summary.json", "{}")
    assert not dead.exists()
    assert live.exists() and other_host.exists() and all(path.exists() for path in not_ours)
    assert (tmp_path / "summary.json").read_text() == "{}"


def test_stale_cleanup_returns_what_it_removed(tmp_path):
    dead = tmp_path / _temp_name("m.safetensors", _dead_pid())
    dead.write_bytes(b"x")
    assert remove_stale_temp_files(tmp_path) == [dead]
    assert remove_stale_temp_files(tmp_path / "missing") == []


# -- permissions -------------------------------------------------------------------------------
@pytest.fixture
def umask():
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_every_file_gets_the_umask_permissions(tmp_path, ar_model, ar_task, umask, mask, mode):
    umask(mask)
    checkpoint = hookmech.save(ar_model, tmp_path / "m.safetensors", task_spec=ar_task.spec)
    cache = write_cache(ar_model, ar_task.sample(4, seed=0), tmp_path / "c.h5", HOOKS[:1])
    write_text_atomic(tmp_path / "t.json", "{}")
    for path in (checkpoint, cache, tmp_path / "t.json"):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path.name


# -- a full disk ---------------------------------------------------------------------------------
def test_full_disk_during_cache_is_one_error_and_leaves_no_file(tmp_path, ar_model, ar_task, monkeypatch):
    calls = fail_cache_write_on_call(monkeypatch, 9, OSError(errno.ENOSPC, "No space left on device"))
    out = tmp_path / "c.h5"
    with pytest.raises(HookmechError) as error:
        write_cache(ar_model, ar_task.sample(40, seed=0), out, HOOKS, chunk=8)
    assert str(error.value) == f"no space left on device writing {out}"
    assert len(calls) >= 9  # it failed mid-file, after writing chunks
    assert list(tmp_path.iterdir()) == []


def test_full_disk_writing_text_or_a_checkpoint_is_one_error(tmp_path, ar_model, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(HookmechError, match=f"^no space left on device writing {tmp_path / 'a.txt'}$"):
        write_text_atomic(tmp_path / "a.txt", "hello")
    import hookmech.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "save_bytes", full)
    with pytest.raises(HookmechError, match="no space left on device writing .*m.safetensors"):
        hookmech.save(ar_model, tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_real_failing_write_closes_the_hdf5_file_cleanly(tmp_path):
    """With a file size limit the OS refuses the writes themselves (as on a full disk): the
    cache command must end with one line and no file, not h5py's 'Can't decrement id ref count'
    or a segfault while the half-written file is closed."""
    script = ("import resource, signal, sys\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, 600_000))\n"
              "from hookmech.cli.main import main\n"
              "main(sys.argv[1:])\n")
    out = tmp_path / "c.h5"
    done = subprocess.run([sys.executable, "-c", script, "cache", "--ckpt", str(ATTENTION_FIXTURE),
                           "--n", "20", "--threads", "1", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [f"hookmech: error: file size limit exceeded writing {out}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("error", "reason"), [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
    (RuntimeError("Can't decrement id ref count (file write failed: time = X, filename = 'f', errno = 28, "
                  "error message = 'No space left on device')"), "no space left on device"),
    (Exception("Error while serializing: I/O error: No space left on device (os error 28)"), "no space left on device"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded"),
    (OSError(errno.ENOENT, "No such file"), None),
    (ValueError("bad value"), None),
])
def test_write_failure_reason(error, reason):
    assert write_failure_reason(error) == reason


def test_write_failure_reason_follows_the_exception_chain():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("closing failed") from None
    except RuntimeError as error:
        chained = error
    assert chained.__cause__ is None and chained.__context__ is not None
    assert write_failure_reason(chained) == "no space left on device"
