"""Starting Ray, or connecting to a cluster, for the commands that share work out over it (`sweep`,
`evaluate` and `patch --engine ray`): one HookmechError line where Ray is missing, does not answer
or does not start. A module of its own so that `hookmech.patching.distributed` and
`hookmech.sweep.engines` import it without either reaching into the other."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

from .errors import HookmechError, UsageError

# ray is optional: imported where used


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
