"""The engines that run a sweep's runs: "local" (in this process, or a pool of spawned worker
processes) and "ray" (a Ray cluster). Each calls `done(run, row)` as runs finish; a run that
raises gets an error row and the others go on."""

from __future__ import annotations

import multiprocessing
import os
import queue
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from .worker import collect_row, execute_run

# ray is optional: imported where used

ENGINES = ("local", "ray")


def default_threads(workers: int) -> int:
    """Torch threads per run when not given: the machine's cores divided among the workers."""
    return max(1, (os.cpu_count() or 1) // workers)


def _error_row(run: dict[str, Any], error: BaseException) -> dict[str, Any]:
    row = collect_row(run, "/nonexistent")
    row["status"] = "error"
    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return row


def run_local(todo, runs_dir, workers, threads, device, done: Callable[[dict, dict], None], progress=None) -> None:
    """Run the run dicts `todo` here (`workers` 1) or in `workers` spawned processes, each with
    `threads` torch threads; call `done(run, row)` as each finishes and `progress(event)` with
    the runs' `RunProgress` events (here, in this thread); return None."""
    if workers == 1:
        for run in todo:
            try:
                row = execute_run(run, runs_dir, threads, device, progress=progress)
            except Exception as error:  # one broken run must not stop the sweep
                row = _error_row(run, error)
            done(run, row)
        return

    # spawn, not fork: a forked child inherits the parent's OpenMP pool state and may hang
    context = multiprocessing.get_context("spawn")
    events = context.Queue() if progress is not None else None
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_set_events_queue, initargs=(events,)
    ) as pool:
        futures = {pool.submit(_execute_in_pool, run, runs_dir, threads, device): run for run in todo}
        while futures:
            finished, _ = wait(futures, timeout=EVENT_POLL_S, return_when=FIRST_COMPLETED)
            _drain(events, progress)
            for future in finished:
                run = futures.pop(future)
                try:
                    row = future.result()
                except Exception as error:
                    row = _error_row(run, error)
                done(run, row)


#: seconds between two looks at the workers' progress events
EVENT_POLL_S = 0.2
#: a pool worker's queue of progress events to the driver (set by the pool's initializer)
_events_queue = None


def _set_events_queue(queue) -> None:
    global _events_queue
    _events_queue = queue


def _execute_in_pool(run, runs_dir, threads, device):
    """`execute_run` in a pool worker, its progress events sent to the driver's queue."""
    send = None if _events_queue is None else _events_queue.put
    return execute_run(run, runs_dir, threads, device, progress=send)


def _drain(events, progress) -> None:
    """Hand every event waiting in queue `events` (multiprocessing's) to `progress`."""
    if events is None or progress is None:
        return
    while True:
        try:
            progress(events.get_nowait())
        except queue.Empty:
            return


def run_ray(ray, todo, runs_dir, threads, device, done, gpus_per_run: float, progress=None) -> None:
    """Run the run dicts `todo` as tasks of the started `ray` (`ray_session`), `threads` CPUs and
    `gpus_per_run` GPUs each; call `done(run, row)` as each finishes and `progress(event)` with
    the runs' `RunProgress` events (sent through a Ray queue); return None."""
    events = _ray_queue(ray) if progress is not None else None
    send = None if events is None else events.put
    remote = ray.remote(num_cpus=threads, num_gpus=gpus_per_run, max_retries=0)(execute_run)
    path = str(Path(runs_dir).resolve())
    pending = {remote.remote(run, path, threads, device, True, send): run for run in todo}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=EVENT_POLL_S)
        _drain_ray(events, progress)
        if not ready:
            continue
        run = pending.pop(ready[0])
        try:
            row = ray.get(ready[0])
        except Exception as error:
            cause = getattr(error, "cause", None) or error
            row = _error_row(run, cause)
        done(run, row)
    _drain_ray(events, progress)


def _ray_queue(ray):
    """Return a Ray queue for the workers' progress events (an actor that holds no CPU), or None
    where this Ray has none."""
    try:
        from ray.util.queue import Queue
    except ImportError:  # pragma: no cover - every Ray >= 2.9 has it
        return None
    return Queue(actor_options={"num_cpus": 0})


def _drain_ray(events, progress) -> None:
    """Hand every event waiting in Ray queue `events` to `progress`."""
    if events is None or progress is None:
        return
    waiting = events.qsize()
    if waiting:
        for event in events.get_nowait_batch(waiting):
            progress(event)
