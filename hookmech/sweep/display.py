"""What a sweep shows while it runs: on a terminal, an overall bar (runs done, the sweep's time,
the time left) and a bar per run in flight (steps, loss, dev accuracy, the time left); in a log,
plain lines (a run's progress at its evaluations, `hookmech.progress.LINE_EVERY_S` apart at
least; every finished run with its own time and the sweep's). The workers send `RunProgress`
events (`hookmech.progress.Events`); the driver alone draws, so bars of parallel runs never
tear each other.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..progress import LINE_EVERY_S, RunProgress, duration_text

# tqdm is imported where a bar is drawn: this module loads without it


class SweepDisplay:
    """The progress of a sweep of `total` runs, `to_run` of them left to train: `update` with a
    run's events, `finished` as runs end, `close` at the end. `tty` None: bars when stderr is a
    terminal. `log` gets the plain lines (and, on a terminal, the lines printed above the bars)."""

    def __init__(
        self,
        name: str,
        total: int,
        to_run: int,
        log: Callable[[str], None],
        tty: bool | None = None,
        workers: int = 1,
    ):
        self.name, self.total, self.to_run, self.log, self.workers = name, total, to_run, log, workers
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.began = time.perf_counter()
        self.done = total - to_run
        self.finished_now = 0  # runs this sweep has finished (their pace estimates the time left)
        self.bars: dict[str, Any] = {}
        self.positions: dict[str, int] = {}  # each bar's line below the overall one
        self.last_line: dict[str, float] = {}
        self.overall = None
        if self.tty and to_run:
            from tqdm import tqdm

            self.overall = tqdm(
                total=total, initial=self.done, desc=f"sweep {name}", unit="run", position=0, file=sys.stderr,
                dynamic_ncols=True, leave=True,
            )  # fmt: skip

    def say(self, message: str) -> None:
        """Print `message` as a line (above the bars on a terminal)."""
        if self.overall is not None:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stderr)
        else:
            self.log(message)

    def update(self, event: RunProgress) -> None:
        """Show a run's progress event: its bar on a terminal, a line now and then otherwise."""
        run_id = Path(event.run).name
        if self.overall is not None:
            self._bar(run_id, event)
            return
        now = time.monotonic()
        evaluated = event.dev_acc is not None
        last_step = event.final or event.step >= event.total  # the "[k/n] … finished" line follows
        if evaluated and not last_step and now - self.last_line.get(run_id, -math.inf) >= LINE_EVERY_S:
            self.last_line[run_id] = now
            self.log("  " + event.line(run_id))

    def _bar(self, run_id: str, event: RunProgress) -> None:
        from tqdm import tqdm

        bar = self.bars.get(run_id)
        if bar is None:
            position = min(set(range(1, len(self.bars) + 2)) - set(self.positions.values()))
            self.positions[run_id] = position
            bar = tqdm(
                total=event.total, initial=event.step, desc=f"  {run_id}", unit="step", position=position,
                file=sys.stderr, dynamic_ncols=True, leave=False,
            )  # fmt: skip
            self.bars[run_id] = bar
        bar.update(event.step - bar.n)
        if event.dev_acc is not None:
            bar.set_postfix(loss=f"{event.loss:.3f}", acc=f"{event.dev_acc:.3f}", refresh=False)
        bar.refresh()

    def finished(self, run_id: str, row: dict[str, Any]) -> None:
        """A run ended with results row `row`: close its bar; print "[k/n] RUN: finished dev_acc
        0.272, trained in 38.7 s (sweep: 1 min 24 s, ~2 min left)"."""
        bar = self.bars.pop(run_id, None)
        self.positions.pop(run_id, None)
        if bar is not None:
            bar.close()
        self.done += 1
        self.finished_now += 1
        acc, seconds = row.get("dev_acc"), row.get("seconds")
        detail = row.get("error") or (f"dev_acc {acc:.3f}" if isinstance(acc, float) else "")
        own = ""
        if isinstance(seconds, (int, float)) and _number(seconds) and not row.get("error"):
            own = f", trained in {duration_text(seconds)}"
        elapsed = time.perf_counter() - self.began
        left = self._seconds_left(elapsed)
        sweep = f"sweep: {duration_text(elapsed)}" + (f", ~{duration_text(left)} left" if left else "")
        status = " ".join(part for part in (str(row["status"]), detail) if part)
        self.say(f"[{self.done}/{self.total}] {run_id}: {status}{own} ({sweep})")
        if self.overall is not None:
            self.overall.update(1)

    def _seconds_left(self, elapsed: float) -> float | None:
        """The sweep's time left at its pace so far (None when nothing is left or known)."""
        remaining = self.total - self.done
        if remaining <= 0 or self.finished_now == 0:
            return None
        return elapsed / self.finished_now * remaining

    def close(self) -> None:
        """Close every bar."""
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()
        self.positions.clear()
        if self.overall is not None:
            self.overall.close()
            self.overall = None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
