"""The engines that run a sweep's runs: "local" (in this process, or a pool of spawned worker
processes) and "ray" (a Ray cluster). Each calls `done(run, row)` as runs finish; a run that
raises gets an error row and the others go on."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import HookmechError, UsageError
from .worker import collect_row, execute_run

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
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

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
    import queue

    if events is None or progress is None:
        return
    while True:
        try:
            progress(events.get_nowait())
        except queue.Empty:
            return


def import_ray():
    """Return the `ray` module, or raise a UsageError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError("--engine ray needs Ray: pip install 'hookmech[dist]' (ray[default,tune])") from None
    return ray


#: seconds to wait for a Ray cluster's address to accept a connection (Ray itself waits ~40 s)
RAY_CONNECT_TIMEOUT_S = 5.0


def check_ray_address(address: str | None, timeout: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Raise a HookmechError naming `address` when it is ``HOST:PORT`` (or ``ray://HOST:PORT``)
    and nothing accepts a TCP connection there within `timeout` seconds; return None. Other
    addresses ("auto", "local", None: start a local Ray) are left to Ray."""
    import socket

    if address is None:
        return
    plain = address.removeprefix("ray://")
    host, sep, port = plain.rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return
    except OSError as error:
        raise HookmechError(
            f"--engine ray: no Ray cluster answers at {address} ({error.strerror or error}); start one "
            "there (ray start --head) or drop --address to start a local Ray"
        ) from None


def _init_ray(ray, workers: int, threads: int, address: str | None) -> None:
    """Start a local Ray of `workers` x `threads` CPUs, or connect to `address`; a failure is one
    HookmechError line (Ray's own messages run over many)."""
    try:
        if address is None:
            ray.init(
                num_cpus=workers * threads,
                include_dashboard=False,
                ignore_reinit_error=True,
                log_to_driver=False,
                configure_logging=False,
            )
        else:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, configure_logging=False)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        where = f" at {address}" if address is not None else ""
        raise HookmechError(f"--engine ray: Ray did not start{where} ({type(error).__name__}: {first})") from None


@contextlib.contextmanager
def ray_session(workers: int, threads: int, address: str | None) -> Iterator[Any]:
    """Start a local Ray of `workers` × `threads` CPUs (`address` None) or connect to the
    cluster at `address`; yield the `ray` module; shut a local Ray down at the end. A Ray that
    does not start is one HookmechError line."""
    ray = import_ray()
    _init_ray(ray, workers, threads, address)
    try:
        yield ray
    finally:
        if address is None:
            ray.shutdown()


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
