"""Long work shows signs of life (issue 45 §1): a training run's progress as bars on a terminal
and lines in a log, a sweep's per-run progress and its finished lines with the run's own time,
events from spawned workers, and a status line within a fraction of a second of any command's
start. References: hand computations, the runs' own summary.json, `python -c "import torch"`
timed beside the command."""

from __future__ import annotations

import importlib.util
import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest
from helpers import ATTENTION_FIXTURE, SWEEP_SMALL

import hookmech.sweep.display as display_module
from hookmech.progress import Events, Lines, RunProgress, duration_text, reporter
from hookmech.sweep import load_sweep, run_sweep
from hookmech.sweep.display import SweepDisplay


def test_durations_read_as_people_read_them():
    assert [duration_text(s) for s in (0.04, 4.25, 42.4, 60, 185, 3600 + 125)] == [
        "0.0 s", "4.2 s", "42 s", "1 min 00 s", "3 min 05 s", "1 h 02 min"]  # fmt: skip


def test_a_progress_line_has_steps_loss_accuracy_its_time_and_the_time_left():
    # resumed at step 100 after 50 s; this session: 400 steps in 20 s -> 3500 steps left at 0.05 s
    event = RunProgress("runs/a", 500, 4000, 70.0, 400, 20.0, loss=1.3862, dev_acc=0.253)
    assert event.seconds_left() == 3500 * 0.05
    assert event.line() == "runs/a: step 500/4000 (12 %), loss 1.386, dev_acc 0.253, 1 min 10 s, ~2 min 55 s left"
    assert RunProgress("a", 0, 10, 0.0, 0, 0.0).line("b") == "b: step 0/10 (0 %), 0.0 s"


def test_lines_come_at_evaluations_at_most_every_so_often(monkeypatch):
    said: list[str] = []
    lines = Lines("run", 100, said.append, every=1e9)
    lines.stepped(10, 1.0)
    lines.evaluated(10, 1.0, 2.0, 0.1)
    lines.evaluated(20, 2.0, 1.5, 0.2)  # too soon after the first
    lines.evaluated(100, 10.0, 1.0, 0.9)  # the last step: the caller's own line follows
    assert said == ["run: step 10/100 (10 %), loss 2.000, dev_acc 0.100, 1.0 s, ~9.0 s left"]


def test_events_are_sent_at_the_start_at_evaluations_and_at_the_end():
    sent: list[RunProgress] = []
    events = Events("run", 10, sent.append, start=4, seconds_before=3.0, every=1e9)
    events.stepped(5, 3.5)  # not sent: the last event is recent
    events.evaluated(6, 4.0, 1.0, 0.5)
    events.close()
    assert [(e.step, e.session_steps, e.dev_acc, e.final) for e in sent] == [(4, 0, None, False), (6, 2, 0.5, False),
                                                                            (6, 2, 0.5, True)]  # fmt: skip


def test_a_reporter_is_a_bar_on_a_terminal_and_lines_in_a_log(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert isinstance(reporter(None, run="r", total=5, start=0, seconds_before=0.0, log=print), Lines)
    assert isinstance(reporter(print, run="r", total=5, start=0, seconds_before=0.0, log=print), Events)


def test_the_display_draws_bars_and_says_each_runs_own_time(capsys):
    said: list[str] = []
    display = SweepDisplay("s", total=3, to_run=2, log=said.append, tty=True)
    display.update(RunProgress("runs/r1", 5, 10, 2.0, 5, 2.0, 1.0, 0.5))
    display.update(RunProgress("runs/r2", 1, 10, 0.5, 1, 0.5))
    assert sorted(display.positions.values()) == [1, 2]
    display.finished("r1", {"status": "finished", "dev_acc": 0.75, "seconds": 38.7})
    display.update(RunProgress("runs/r3", 1, 10, 0.5, 1, 0.5))
    assert display.positions["r3"] == 1  # the freed line
    display.close()
    err = capsys.readouterr().err
    assert "sweep s" in err and "r1" in err and "loss=1.000" in err
    # the line of a finished run: its own training time, the sweep's time named apart
    assert "[2/3] r1: finished dev_acc 0.750, trained in 39 s (sweep: " in err
    assert said == []  # on a terminal everything goes above the bars


def _small_sweep(tmp_path, name="s"):
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP_SMALL)
    return load_sweep(path)


def test_a_logged_sweep_prints_progress_and_each_runs_own_time(tmp_path, monkeypatch):
    monkeypatch.setattr(display_module, "LINE_EVERY_S", 0.0)
    messages: list[str] = []
    sweep = _small_sweep(tmp_path)
    rows = run_sweep(sweep, tmp_path / "runs", threads=1, log=messages.append, progress=False)
    progress_lines = [m for m in messages if m.startswith("  ") and ": step " in m]
    assert progress_lines and all("/" in m and "dev_acc" in m for m in progress_lines)
    for index, row in enumerate(rows, start=1):
        summary = json.loads((tmp_path / "runs" / row["run_id"] / "summary.json").read_text())
        own = f"[{index}/{len(rows)}] {row['run_id']}: finished dev_acc {row['dev_acc']:.3f}, trained in "
        line = next(m for m in messages if m.startswith(own))
        assert line.startswith(own + duration_text(summary["seconds"]) + " (sweep: ")


@pytest.mark.slow
def test_spawned_workers_send_their_progress_to_the_driver(tmp_path, monkeypatch):
    monkeypatch.setattr(display_module, "LINE_EVERY_S", 0.0)
    messages: list[str] = []
    sweep = _small_sweep(tmp_path)
    rows = run_sweep(sweep, tmp_path / "runs", workers=2, threads=1, log=messages.append, progress=False)
    for row in rows:
        assert any(m.startswith(f"  {row['run_id']}: step ") for m in messages), row["run_id"]


def _first_output_seconds(argv: list[str]) -> tuple[float, bytes]:
    """Seconds from starting `argv` with a terminal as stdout and stderr to its first byte, and
    everything it printed."""
    leader, follower = pty.openpty()
    began = time.perf_counter()
    process = subprocess.Popen(argv, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    first, seen = None, b""
    while True:
        ready, _, _ = select.select([leader], [], [], 0.01)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            first = time.perf_counter() - began if first is None else first
            seen += chunk
        elif process.poll() is not None:
            break
    process.wait()
    os.close(leader)
    return (time.perf_counter() - began if first is None else first), seen


def test_a_command_shows_a_status_line_long_before_torch_is_loaded():
    """The first output comes before a bare `import torch` could finish, timed beside it (the
    machine's load moves both); the command's own output erases the status line."""
    torch_seconds = min(_first_output_seconds([sys.executable, "-c", "import torch; print(1)"])[0] for _ in range(2))
    first, seen = _first_output_seconds([sys.executable, "-m", "hookmech.cli.main", "sites", "--ckpt",
                                         str(ATTENTION_FIXTURE)])  # fmt: skip
    assert first < 0.5 * torch_seconds, (first, torch_seconds)
    text = seen.decode()
    assert text.startswith("\r\x1b[Khookmech sites: starting (loading torch)…\r\x1b[K")
    assert "L1.block_in" in text  # the command's own table follows


def test_without_a_terminal_there_is_no_status_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hookmech.cli.main", "sites", "--ckpt", str(tmp_path / "missing.safetensors")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "starting" not in done.stderr + done.stdout



@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (the dist extra)")
def test_ray_workers_send_their_progress_to_the_driver(tmp_path, monkeypatch):
    monkeypatch.setattr(display_module, "LINE_EVERY_S", 0.0)
    messages: list[str] = []
    sweep = _small_sweep(tmp_path)
    rows = run_sweep(sweep, tmp_path / "runs", engine="ray", workers=2, threads=1, log=messages.append, progress=False)
    for row in rows:
        assert any(m.startswith(f"  {row['run_id']}: step ") for m in messages), row["run_id"]
    assert sum(": finished dev_acc" in m and "trained in" in m for m in messages) == len(rows)
