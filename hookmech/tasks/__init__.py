"""Synthetic recall tasks: `make(name, **options)`, `from_spec`, `from_checkpoint`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import HookmechError, UsageError, unknown
from ..seeds import EXAMPLES_SEED
from .ar import AssociativeRecall
from .atr import AssociativeTreecall
from .base import Task, check_task_options
from .batch import Batch
from .mqar import MultiQueryAR

REGISTRY: dict[str, type[Task]] = {
    "ar": AssociativeRecall,
    "mqar": MultiQueryAR,
    "atr": AssociativeTreecall,
}


def make(name: str, **options: Any) -> Task:
    """Return the task `name` built with `options` (unknown names/options are UsageErrors)."""
    if name not in REGISTRY:
        raise unknown("task", name, REGISTRY)
    cls = REGISTRY[name]
    check_task_options(cls, options)
    return cls(**options)


def from_spec(spec: dict[str, Any]) -> Task:
    """Rebuild a task from its `spec` dict (``{"name": ..., **options}``)."""
    options = dict(spec)
    name = options.pop("name", None)
    if name is None:
        raise HookmechError("task spec has no 'name'")
    return make(name, **options)


def from_checkpoint(path: str | Path) -> Task:
    """Rebuild the task stored in a checkpoint's metadata. A Hugging Face model folder stores
    none: a UsageError says a task must be given."""
    from ..checkpoint import read_metadata
    from ..pretrained import is_pretrained

    if is_pretrained(path):
        raise UsageError(f"{path} is a Hugging Face model folder, which stores no task: give the task (--task)")

    spec = read_metadata(path).get("task")
    if spec is None:
        raise HookmechError(f"{path}: checkpoint stores no task spec")
    return from_spec(spec)


__all__ = ["EXAMPLES_SEED", "REGISTRY", "Batch", "Task", "from_checkpoint", "from_spec", "make"]
