"""How a training run shows that it is alive: its progress (step, loss, dev accuracy, its own
time, the time left) as a tqdm bar on a terminal, as plain lines in a log, or as events sent to
the process that draws them (a sweep's driver: `hookmech.sweep.display`).

The training loop talks to a `Reporter`: ``stepped`` after every optimizer step, ``evaluated``
after every evaluation, ``close`` at the end. `reporter` picks one for `train`'s ``progress``
argument: a bar on a terminal, lines otherwise (`LINE_EVERY_S` apart at most once), nothing when
asked for nothing.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# tqdm is imported where a bar is drawn: this module loads without it

#: a log gets a progress line of a run at most this often (at its evaluations)
LINE_EVERY_S = 30.0
#: a sweep's driver gets a run's progress at most this often between evaluations
EVENT_EVERY_S = 0.5


def duration_text(seconds: float) -> str:
    """Return `seconds` as people read a duration: "4.2 s", "42 s", "3 min 05 s", "1 h 02 min"."""
    seconds = max(0.0, float(seconds))
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


@dataclass(frozen=True)
class RunProgress:
    """Where a training run stands: `step` of `total` optimizer steps, its own training time in
    `seconds` (earlier sessions of a resumed run included), the steps and seconds of this session
    (they estimate the time left), and the last evaluation's loss and dev accuracy (None before
    the first). `final` marks the run's last report."""

    run: str
    step: int
    total: int
    seconds: float
    session_steps: int
    session_seconds: float
    loss: float | None = None
    dev_acc: float | None = None
    final: bool = False

    def seconds_left(self) -> float | None:
        """Return the estimated seconds to the last step at this session's pace, or None before a
        step of this session has been timed."""
        if self.session_steps <= 0 or self.session_seconds <= 0:
            return None
        return (self.total - self.step) * self.session_seconds / self.session_steps

    def line(self, label: str | None = None) -> str:
        """Return the run's progress as one plain line: "RUN: step 500/4000 (12 %), loss 1.386,
        dev_acc 0.253, 21 s, ~2 min 27 s left" (RUN: `label`, default the run's name)."""
        parts = [f"step {self.step}/{self.total} ({100 * self.step // max(1, self.total)} %)"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if self.dev_acc is not None:
            parts.append(f"dev_acc {self.dev_acc:.3f}")
        parts.append(duration_text(self.seconds))
        left = self.seconds_left()
        if left is not None and self.step < self.total:
            parts.append(f"~{duration_text(left)} left")
        return f"{self.run if label is None else label}: " + ", ".join(parts)


class Reporter(Protocol):
    """What the training loop calls (`hookmech.training.train`)."""

    def stepped(self, step: int, seconds: float) -> None:
        """After optimizer step `step` (1-based), `seconds` of the run's own time so far."""

    def evaluated(self, step: int, seconds: float, loss: float, dev_acc: float) -> None:
        """After the evaluation at `step`: the mean training loss since the last one and dev accuracy."""

    def close(self) -> None:
        """At the end of the run (finished, stopped or failed)."""


class _Tracker:
    """The state every reporter keeps: the run's steps and this session's pace."""

    def __init__(self, run: str, total: int, start: int, seconds_before: float):
        self.run, self.total, self.start, self.seconds_before = run, total, start, seconds_before
        self.loss: float | None = None
        self.dev_acc: float | None = None

    def progress(self, step: int, seconds: float, final: bool = False) -> RunProgress:
        return RunProgress(
            self.run,
            step,
            self.total,
            seconds,
            step - self.start,
            seconds - self.seconds_before,
            self.loss,
            self.dev_acc,
            final,
        )


class Silent:
    """No progress shown."""

    def stepped(self, step: int, seconds: float) -> None:
        """Nothing to show."""

    def evaluated(self, step: int, seconds: float, loss: float, dev_acc: float) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to close."""


class Bar:
    """A tqdm bar on stderr: steps, the time left (tqdm's), loss and dev accuracy as they come."""

    def __init__(self, run: str, total: int, start: int = 0, label: str | None = None):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, initial=start, desc=label, unit="step", dynamic_ncols=True, file=sys.stderr, leave=True
        )

    def stepped(self, step: int, seconds: float) -> None:
        """Advance the bar by the steps done since the last call."""
        self.bar.update(step - self.bar.n)

    def evaluated(self, step: int, seconds: float, loss: float, dev_acc: float) -> None:
        """Show the evaluation's loss and dev accuracy beside the bar."""
        self.bar.set_postfix(loss=f"{loss:.3f}", acc=f"{dev_acc:.3f}")

    def close(self) -> None:
        """Close the bar (it stays on screen)."""
        self.bar.close()


class Lines:
    """Plain lines through `log` at evaluations, `every` seconds apart at least (a log file's
    progress: `RunProgress.line`), and one at the end."""

    def __init__(
        self,
        run: str,
        total: int,
        log: Callable[[str], None],
        start: int = 0,
        seconds_before: float = 0.0,
        every: float = LINE_EVERY_S,
    ):
        self.tracker = _Tracker(run, total, start, seconds_before)
        self.log, self.every = log, every
        self.last_line = -math.inf
        self.last: RunProgress | None = None

    def stepped(self, step: int, seconds: float) -> None:
        """Remember the step (the closing line reports it)."""
        self.last = self.tracker.progress(step, seconds)

    def evaluated(self, step: int, seconds: float, loss: float, dev_acc: float) -> None:
        """Log a line if the last one is `every` seconds old."""
        self.tracker.loss, self.tracker.dev_acc = loss, dev_acc
        self.last = self.tracker.progress(step, seconds)
        now = time.monotonic()
        if now - self.last_line >= self.every and step < self.tracker.total:
            self.last_line = now
            self.log(self.last.line())

    def close(self) -> None:
        """Nothing more: the caller says how the run ended."""


class Events:
    """`RunProgress` events sent through `send` (a sweep worker's queue to its driver): at every
    evaluation, at most every `every` seconds between them, and a final one at `close`."""

    def __init__(
        self,
        run: str,
        total: int,
        send: Callable[[RunProgress], Any],
        start: int = 0,
        seconds_before: float = 0.0,
        every: float = EVENT_EVERY_S,
    ):
        self.tracker = _Tracker(run, total, start, seconds_before)
        self.send, self.every = send, every
        self.sent = -math.inf
        self.last = self.tracker.progress(start, seconds_before)
        self._send(self.last)

    def _send(self, event: RunProgress) -> None:
        self.sent = time.monotonic()
        self.send(event)

    def stepped(self, step: int, seconds: float) -> None:
        """Send the step if the last event is `every` seconds old."""
        self.last = self.tracker.progress(step, seconds)
        if time.monotonic() - self.sent >= self.every:
            self._send(self.last)

    def evaluated(self, step: int, seconds: float, loss: float, dev_acc: float) -> None:
        """Send the evaluation."""
        self.tracker.loss, self.tracker.dev_acc = loss, dev_acc
        self.last = self.tracker.progress(step, seconds)
        self._send(self.last)

    def close(self) -> None:
        """Send the last state, marked final."""
        last = self.last
        self._send(RunProgress(**{**last.__dict__, "final": True}))


def reporter(
    progress: bool | None | Callable[[RunProgress], Any],
    *,
    run: str,
    total: int,
    start: int,
    seconds_before: float,
    log: Callable[[str], None],
) -> Reporter:
    """Return the reporter of a run of `total` steps resuming at `start`: `progress` True a bar,
    False none, None a bar when stderr is a terminal and `Lines` through `log` otherwise, a
    callable `Events` sent to it."""
    if callable(progress):
        return Events(run, total, progress, start, seconds_before)
    if progress is None:
        progress = sys.stderr.isatty()
        if not progress:
            return Lines(run, total, log, start, seconds_before)
    return Bar(run, total, start) if progress else Silent()
