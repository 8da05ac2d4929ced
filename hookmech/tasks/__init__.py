"""Recall tasks: `make(name, **options)`, `from_spec`, `from_checkpoint`, `for_checkpoint`.

The synthetic tasks (ar, mqar, atr) have their own token ids; induction, nl-ar and prompts
are made of a tokenizer's tokens (`hookmech.tasks.tokenized`), for pretrained models.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from ..errors import HookmechError, UsageError, unknown
from ..pretrained import is_pretrained
from ..seeds import EXAMPLES_SEED
from .ar import AssociativeRecall
from .atr import AssociativeTreecall
from .base import Task, check_task_options
from .batch import Batch
from .induction import Induction
from .mqar import MultiQueryAR
from .nl_ar import NaturalLanguageAR
from .prompts import Prompts

# .checkpoint is imported where used: it loads TransformerLens, which the tasks do not need

REGISTRY: dict[str, type[Task]] = {
    "ar": AssociativeRecall,
    "mqar": MultiQueryAR,
    "atr": AssociativeTreecall,
    "induction": Induction,
    "nl-ar": NaturalLanguageAR,
    "prompts": Prompts,
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

    if is_pretrained(path):
        raise UsageError(f"{path} is a Hugging Face model folder, which stores no task: give the task (--task)")

    spec = read_metadata(path).get("task")
    if spec is None:
        raise HookmechError(f"{path}: checkpoint stores no task spec")
    if not isinstance(spec, dict):
        raise HookmechError(f"{path}: the checkpoint's task spec is not a table")
    try:
        return from_spec(spec)
    except HookmechError as error:  # the file's fault, not the command line's: exit 1, naming the file
        raise HookmechError(f"{path}: task spec: {error}") from None


def stored_task_spec(path: str | Path) -> dict[str, Any] | None:
    """Return the task spec a checkpoint stores, or None: a checkpoint trained without one, or a
    Hugging Face model folder (whose tokenizer tasks name on the command line)."""
    if Path(path).is_dir():
        return None
    from ..checkpoint import read_metadata

    return read_metadata(path).get("task")


def for_checkpoint(path: str | Path, name: str | None = None, options: dict[str, Any] | None = None) -> Task:
    """Return the task to run the checkpoint at `path` on: task `name` with `options` (a task
    reading a tokenizer takes the checkpoint's folder's own when `options` names none), else
    the checkpoint's stored task with `options` over its own. A UsageError when there is none."""
    options = dict(options or {})
    if name is None:
        spec = stored_task_spec(path)
        if spec is None:
            raise UsageError(f"{path} stores no task: give one with --task NAME ({', '.join(REGISTRY)})")
        if not options:  # the stored spec alone: a fault of it is the file's, named
            return from_checkpoint(path)
        return from_spec({**spec, **options})
    if name in REGISTRY and "tokenizer" in inspect.signature(REGISTRY[name].__init__).parameters:
        if "tokenizer" not in options and Path(path).is_dir():
            options["tokenizer"] = str(path)
    return make(name, **options)


def check_vocabulary(task: Task, d_vocab: int) -> None:
    """Raise a HookmechError unless a model of `d_vocab` token ids covers the task's ids
    (``0 .. task.d_vocab - 1``; a tokenizer task's: its tokenizer's). Returns None."""
    if task.d_vocab > d_vocab:
        source = getattr(getattr(task, "text_tokenizer", None), "path", None)
        of = f"tokenizer {source}" if source is not None else f"task {task.name!r}"
        raise HookmechError(
            f"{of} has token ids 0..{task.d_vocab - 1}, beyond the model's d_vocab {d_vocab}: "
            "the model cannot run these tokens (a tokenizer of this model, or a task of its vocabulary)"
        )


__all__ = [
    "EXAMPLES_SEED",
    "REGISTRY",
    "Batch",
    "Task",
    "check_vocabulary",
    "for_checkpoint",
    "from_checkpoint",
    "from_spec",
    "make",
    "stored_task_spec",
]
