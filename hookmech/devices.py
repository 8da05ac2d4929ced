"""Devices: whether torch can use one here (`check_device`) and how much memory it has
(`memory_bytes`), so that a device or a model size the machine lacks is refused by name before
anything is allocated on it."""

from __future__ import annotations

import os

from .errors import UsageError

# torch is imported where used: this module loads without it


def check_device(device) -> str:
    """Return `device` (a string or ``torch.device``) as a string if torch can use it here; raise
    a UsageError naming it otherwise (an unknown name, CUDA or MPS absent, a CUDA index past the
    last device)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"unknown device {device!r} (expected cpu, cuda, cuda:N or mps)") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {str(device)!r}: no CUDA device is available here (use 'cpu')")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise UsageError(
                f"device {str(device)!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
            )
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"device {str(device)!r}: no MPS device is available here (use 'cpu')")
    return str(device)


def memory_bytes(device) -> int | None:
    """Return the memory of `device` in bytes: a CUDA device's total memory, the machine's
    physical memory for the CPU (and anything else); None where it cannot be read."""
    import torch

    parsed = torch.device(device)
    if parsed.type == "cuda":
        index = parsed.index if parsed.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: no limit we can read
        return None
