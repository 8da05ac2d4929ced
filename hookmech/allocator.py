"""glibc's allocator, tuned for CPU training and patching: keep freed multi-MB blocks instead of
returning them.

glibc serves every allocation above its mmap threshold with fresh pages from the kernel and
gives them back on free, so each large temporary of a forward and backward pass (the selective
scan's per-chunk states, attention scores, activations) pays a page fault per 4 KiB page and the
kernel's zeroing, every step. The threshold is meant to adapt upwards, but in a training step's
mix of sizes it does not settle: measured on a 2-layer d_model 64 Mamba at the paper's AR setting
(batch 32, 35 tokens, 1 thread), the scan took 21 ms forward and 40 ms backward per step with
glibc's defaults and 13 ms and 28 ms with freed blocks kept (the whole step: 81 -> 65 ms;
attention 27 -> 21 ms). Patching (`patch`, `atp_star_patch`) tunes it too: at Mamba-130m's shape
(8 rows of 63 tokens) AtP* over every cell took 10.7-10.8 s against 11.6-12.9 s, the exact engine
8.9-9.6 s against 10.0-10.4 s (docs/performance.md). Numbers are unchanged: only where memory
comes from.

`keep_freed_memory()` raises the mmap threshold to its maximum (32 MiB) and the trim threshold
to 1 GiB, once per process, where the C library is glibc; elsewhere it does nothing. Set
``HOOKMECH_MALLOC_TUNING=0`` to leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit systems
_TRIM_THRESHOLD = 1 << 30

_tuned: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as described above (once); return True when it is tuned."""
    global _tuned
    if _tuned is None:
        _tuned = _tune()
    return _tuned


def _tune() -> bool:
    if os.environ.get("HOOKMECH_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
