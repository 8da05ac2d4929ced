"""What an output path names is never replaced unless it is a regular file (docs/formats.md): a
FIFO is written in place (a reader gets the bytes; HDF5, which seeks, refuses one), a folder is
refused in one line, `-o ''` and a file output ending in '/' are usage errors, and a folder the
system refuses to write into is named as the -o the user gave, not a temporary name. Tested with
a FIFO and folders in the test's temporary folder, never with /dev/null."""
from __future__ import annotations

import os
import tempfile
import threading

import pytest
from helpers import ATTENTION_FIXTURE, SWEEP_SMALL, run_cli

import hookmech
from hookmech.errors import HookmechError
from hookmech.fileio import atomic_path

PATCH = ["patch", "--ckpt", ATTENTION_FIXTURE, "--site", "L1.block_in", "--pos", "value", "--n", "4"]


def _reader(fifo):
    """Start a thread reading `fifo` to its end; return (thread, the list its bytes go into)."""
    got: list[bytes] = []

    def read():
        with open(fifo, "rb") as handle:
            got.append(handle.read())

    thread = threading.Thread(target=read, daemon=True)  # blocked for good if nothing ever writes
    thread.start()
    return thread, got


def test_a_fifo_is_written_in_place_not_replaced(tmp_path, capsys):
    fifo = tmp_path / "rows.json"
    os.mkfifo(fifo)
    thread, got = _reader(fifo)
    code, _, err = run_cli([*PATCH, "--per-example", fifo], capsys)
    assert code == 0, err
    assert fifo.is_fifo()
    thread.join(timeout=60)
    assert got and got[0].startswith(b'[{"site": "L1.block_in"') and b'"p_patched_rows": [' in got[0]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rows.json"]  # no temporary left beside it


def test_an_hdf5_output_refuses_a_fifo_in_one_line(tmp_path, capsys):
    fifo = tmp_path / "c.h5"
    os.mkfifo(fifo)
    code, _, err = run_cli(["cache", "--ckpt", ATTENTION_FIXTURE, "--n", "4", "-o", fifo], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert f"cannot write {fifo}: it is a FIFO (named pipe), and HDF5 writes a file it can seek in" in err
    assert fifo.is_fifo()


def test_the_writer_refuses_a_folder_in_one_line_and_leaves_it(tmp_path):
    (tmp_path / "m.safetensors").mkdir()
    (tmp_path / "m.safetensors" / "keep").write_text("mine")
    with pytest.raises(HookmechError, match="it is a folder, not a file; give a file path"):
        hookmech.save(hookmech.load(ATTENTION_FIXTURE), tmp_path / "m.safetensors")
    assert (tmp_path / "m.safetensors" / "keep").read_text() == "mine"
    with pytest.raises(HookmechError, match="it is a folder"), atomic_path(tmp_path / "m.safetensors"):
        pass


@pytest.mark.parametrize("argv", [
    ["cache", "--ckpt", ATTENTION_FIXTURE, "--n", "4", "-o", ""],
    ["view", "--ckpt", ATTENTION_FIXTURE, "-o", ""],
    [*PATCH, "--per-example", ""],
    ["das", "--ckpt", ATTENTION_FIXTURE, "--cache", "c.h5", "--site", "L1.block_in", "--pos", "value", "--dim", "1",
     "-o", ""],
    ["train", "--task", "ar", "--steps", "1", "-o", ""],
], ids=["cache", "view", "per-example", "das", "train"])
def test_an_empty_output_path_is_a_usage_error(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "is empty; give a path" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["cache", "--ckpt", ATTENTION_FIXTURE, "--n", "4", "-o", "out/"],
    ["view", "--ckpt", ATTENTION_FIXTURE, "-o", "out/"],
    [*PATCH, "--per-example", "out/"],
    ["data", "ar", "--n", "4", "-o", "out/"],
], ids=["cache", "view", "per-example", "data"])
def test_a_file_output_ending_in_a_slash_is_a_usage_error(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "out/ ends in '/', which names a folder; give a file name" in err
    assert list(tmp_path.iterdir()) == []


def _refuse_temporary_folders(monkeypatch):
    """Make every temporary folder fail as a read-only folder does, naming the temporary path."""
    def refuse(suffix=None, prefix=None, dir=None):
        raise PermissionError(13, "Permission denied", os.path.join(dir or "/tmp", f"{prefix}xxxxxxxx{suffix or ''}"))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)


def test_a_read_only_per_example_folder_names_the_file_asked_for(tmp_path, capsys, monkeypatch):
    _refuse_temporary_folders(monkeypatch)
    code, _, err = run_cli([*PATCH, "--per-example", tmp_path / "ro" / "rows.json"], capsys)
    assert code == 1 and err == f"hookmech: error: {tmp_path}/ro/rows.json: Permission denied\n", err


def test_a_read_only_report_folder_names_the_folder_asked_for(tmp_path, capsys, monkeypatch):
    (tmp_path / "s.toml").write_text(SWEEP_SMALL)
    code, _, err = run_cli(["sweep", tmp_path / "s.toml", "-o", tmp_path / "runs"], capsys)
    assert code == 0, err
    _refuse_temporary_folders(monkeypatch)
    code, _, err = run_cli(["report", tmp_path / "runs", "-o", tmp_path / "ro" / "report", "--no-heatmaps"], capsys)
    assert code == 1 and err.strip().splitlines()[-1] == f"hookmech: error: {tmp_path}/ro/report: Permission denied"
