"""A second process holding a folder's lock (`hookmech.locking.folder_lock`), for the tests of
runs and sweeps that must refuse a folder another process is writing into."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_HOLD = """
import sys
from hookmech.locking import folder_lock
with folder_lock(sys.argv[1]):
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes our stdin (or kills us)
"""


def start_lock_holder(folder: str | Path) -> subprocess.Popen:
    """Start a Python process that locks `folder` and holds the lock until `stop_lock_holder`
    (or its death); return it once it holds the lock."""
    process = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if line.strip() != "ready":
        process.kill()
        raise RuntimeError(f"the lock holder did not start: {line!r}")
    return process


def stop_lock_holder(process: subprocess.Popen) -> None:
    """Let the holder release its lock and exit; wait for it."""
    if process.poll() is None:
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    process.stdout.close()
