"""Writing files: temporary names carry the writer's PID and dead writers' leftovers are removed,
and permissions follow the umask."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import hookmech
from hookmech import fileio
from hookmech.cache import write_cache
from hookmech.fileio import TEMP_NAME, atomic_path, remove_stale_temp_files, write_text_atomic

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
