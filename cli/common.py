"""Options and helpers shared by the commands."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click
from click.core import ParameterSource

from hookmech import seeds

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither

if TYPE_CHECKING:  # tqdm is imported when a bar is drawn
    from tqdm import tqdm

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
#: the default ``--seed`` of the commands that draw examples
EXAMPLES_SEED = seeds.EXAMPLES_SEED
EXAMPLES_SEED_HELP = (
    "seed of the examples: an integer, or mech:S for the examples a sweep's mechanistic "
    "evaluation of a run trained with seed S measured (its own sampling stream)"
)


class ExamplesSeed(click.ParamType):
    """``--seed`` of the commands that draw examples: an integer S (``task.sample(n, S)``) or
    ``mech:S``, the pair ``(S, MECH_STREAM)`` that `hookmech.mech.mech_batch` draws, so that one
    command reproduces the attributions a sweep recorded for a run of seed S."""

    name = "INTEGER|mech:S"

    def convert(self, value, param, ctx) -> int | tuple[int, int]:
        """Return the int, or ``(S, MECH_STREAM)`` for ``mech:S``."""
        if isinstance(value, (int, tuple)):
            return value
        text = str(value).strip()
        prefix, _, rest = text.partition(":")
        try:
            if not rest and not text.startswith("mech:"):
                return int(text)
            if prefix == "mech":
                from hookmech.mech import MECH_STREAM

                if int(rest) >= 0:
                    return (int(rest), MECH_STREAM)
        except ValueError:
            pass
        self.fail(f"{value!r} is neither an integer nor mech:S with an integer S >= 0", param, ctx)


def split_flag(values) -> list[str]:
    """Flatten repeated and comma-separated flag values."""
    from hookmech.option_pairs import split_list

    return split_list(values)


def require_at_least(flag: str, value: int | None, minimum: int) -> None:
    """Raise a UsageError "FLAG must be >= MINIMUM, got VALUE" unless `value` is None or at
    least `minimum` (counts: 0 and negatives are refused before anything runs). Returns None."""
    if value is not None and value < minimum:
        from hookmech.errors import UsageError

        raise UsageError(f"{flag} must be >= {minimum}, got {value}")


def require_name(flag: str, value: str | None) -> None:
    """Raise a UsageError when a name option was given empty (``--mixer ''``, which would
    otherwise mean the default) or as a comma list with an empty item. Returns None."""
    from hookmech.errors import UsageError

    if value is None:
        return
    if not value.strip():
        raise UsageError(f"{flag} is empty; give a name (see '--help')")
    if any(not item.strip() for item in value.split(",")):
        raise UsageError(f"{flag} {value!r} has an empty name in its comma list")


def set_threads(threads: int | None) -> None:
    """Pin torch's CPU threads (None: leave torch's default)."""
    import torch

    if threads is not None:
        require_at_least("--threads", threads, 1)
        torch.set_num_threads(threads)


def check_device(device: str) -> str:
    """Return `device` if torch can use it here, else raise a UsageError naming --device
    (`hookmech.devices.check_device`)."""
    from hookmech.devices import check_device as check
    from hookmech.errors import UsageError

    try:
        return check(device)
    except UsageError as error:
        raise UsageError(f"--device: {error}") from None


class OutputPath(click.Path):
    """A `click.Path` naming what a command writes: refused when empty (``-o ''``); for a file
    (`file`, or ``dir_okay=False``) also when it ends in a path separator (``-o dir/`` names a
    folder) or exists as a socket or a block device, which no file may replace (a FIFO or a
    character device is written in place, `hookmech.fileio.atomic_path`; a folder is refused by
    ``dir_okay=False`` or by the command, with its own words)."""

    def __init__(self, *args, file: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.file = file or not self.dir_okay

    def convert(self, value, param, ctx):
        text = os.fspath(value)
        if not text.strip():
            self.fail("is empty; give a path", param, ctx)
        if self.file:
            from hookmech.fileio import WRITTEN_IN_PLACE, destination_kind

            if text.endswith(("/", os.sep)):
                self.fail(f"{text} ends in '/', which names a folder; give a file name", param, ctx)
            kind = destination_kind(text)
            if kind not in (None, "a folder", *WRITTEN_IN_PLACE):
                self.fail(f"{text} is {kind}, not a file; give a file name", param, ctx)
        return super().convert(value, param, ctx)


device_option = click.option("--device", default="cpu", show_default=True, help="torch device to run on")
threads_option = click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
threshold_option = click.option(
    "--threshold", type=float, default=0.01, show_default=True, help="filter: p_clean - p_corrupt must exceed it"
)
max_batch_option = click.option(
    "--max-batch",
    type=int,
    default=256,
    show_default=True,
    help="rows per forward pass (bounds memory; 256 is fastest on CPU, bench/patch_engine.py)",
)


def runs_engine_options(command):
    """Add the options of commands that train many runs (sweep, evaluate): --engine, --workers,
    --threads, --address, --gpus-per-run; return the decorated command."""
    options = [
        click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True),
        click.option("--workers", type=int, default=1, show_default=True, help="runs in parallel"),
        click.option("--threads", type=int, default=None, help="torch threads per run (default: cores // workers)"),
        click.option("--address", default=None, help="Ray cluster address (default: start a local Ray instance)"),
        click.option(
            "--gpus-per-run", type=float, default=0.0, show_default=True, help="Ray: fraction of a GPU per run"
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


#: `hookmech.row_chunks.DEFAULT_MEMORY_MIB`, spelled here so that parsing imports no torch (a test pins them)
DEFAULT_MEMORY_MIB = 256
memory_option = click.option(
    "--memory",
    type=float,
    default=DEFAULT_MEMORY_MIB,
    show_default=True,
    metavar="MIB",
    help="row data held at once: the cache is read in row chunks of about this many MiB "
    "(records are sums over chunks; the same numbers at any value)",
)


verify_cache_option = click.option(
    "--verify-cache/--no-verify-cache",
    default=True,
    show_default=True,
    help="recompute 4 of the cache's rows with the checkpoint and compare them with its p(answer) and "
    "activations (refuses a cache of another model, or edited there, whatever its model_hash says)",
)


def allow_mixer_option(command):
    """Add ``--allow-mixer SPEC`` (repeatable, comma lists) to a command that loads checkpoints:
    the plug-in mixers their configs may import (`hookmech.mixers.allow_list`), added to
    HOOKMECH_ALLOW_MIXERS while the command runs, so that the worker processes it starts allow
    them too. Returns the decorated command (put it below ``@click.command``)."""

    @functools.wraps(command)
    def run(*args, allow_mixers=(), **kwargs):
        specs = split_flag(allow_mixers)
        if not specs:  # nothing imported early: the mixers' modules come after --threads is set
            return command(*args, **kwargs)
        from hookmech.mixers.allow_list import allowing

        with allowing(specs):
            return command(*args, **kwargs)

    return click.option(
        "--allow-mixer",
        "allow_mixers",
        multiple=True,
        metavar="SPEC",
        help="let the checkpoint's plug-in mixer (module[:Class] or file.py[:Class]) be imported; loading "
        "imports no code a file names otherwise (also HOOKMECH_ALLOW_MIXERS=SPEC,...)",
    )(run)


def refuse_overwriting_inputs(outputs, inputs) -> None:
    """Raise a UsageError if a path the command writes is one of its input files or folders.

    `outputs` and `inputs` are ``(option, path)`` pairs (a None path is skipped); list as
    outputs the files a command writes inside an output folder too. Paths are compared
    resolved: `os.path.samefile` when both exist (links, ``./`` and ``..`` all count), else
    `Path.resolve`. Returns None.
    """
    from hookmech.errors import UsageError

    def same(a: str, b: str) -> bool:
        try:
            return os.path.samefile(a, b)
        except OSError:  # one does not exist (yet)
            return Path(a).resolve() == Path(b).resolve()

    for in_option, in_path in inputs:
        if in_path is None:
            continue
        for out_option, out_path in outputs:
            if out_path is not None and same(out_path, in_path):
                raise UsageError(
                    f"{out_option} would write {out_path}, which is the input {in_option} {in_path}; "
                    "choose another output path"
                )


#: what ``--ckpt`` takes: a hookmech checkpoint file or a Hugging Face model folder
CKPT_HELP = "checkpoint (.safetensors), or a Hugging Face model folder (config.json, weights, tokenizer)"
ckpt_path = click.Path(dir_okay=True)


def load_model(ckpt: str, device: str):
    """Return the model of `ckpt` on `device`: a hookmech checkpoint file or a Hugging Face model
    folder (`hookmech.checkpoint.load`)."""
    from hookmech.checkpoint import load

    return load(ckpt, device=check_device(device))


def model_file_identity(ckpt: str) -> dict[str, str]:
    """Return what a cache records of the model file it was made from (`write_cache`'s arguments
    ``model_sha256`` and ``model_source``): the SHA-256 of a checkpoint file, or the resolved path
    of a model folder or the hub name (whose identity is the cache's model_hash), the other ''."""
    from hookmech.fileio import sha256_of
    from hookmech.pretrained import is_hub_name

    if Path(ckpt).is_dir():
        return {"model_sha256": "", "model_source": str(Path(ckpt).resolve())}
    if is_hub_name(ckpt):
        return {"model_sha256": "", "model_source": str(ckpt)}
    return {"model_sha256": sha256_of(ckpt), "model_source": ""}


#: the names `--task` takes (`hookmech.tasks.REGISTRY`), spelled here: parsing imports no torch (a test pins them)
TASK_NAMES = ("ar", "mqar", "atr", "induction", "nl-ar", "prompts")


def task_options(command):
    """Add --task and --task-opt (the task that gives a checkpoint's examples) to `command`;
    return the decorated command."""
    options = [
        click.option(
            "--task",
            "task_name",
            default=None,
            help=f"task of the examples (default: the checkpoint's own): {', '.join(TASK_NAMES)}",
        ),
        click.option(
            "--task-opt",
            "task_opts",
            multiple=True,
            metavar="K=V",
            help="task option (repeatable), over the checkpoint's task without --task; e.g. num_kv_pairs=4, "
            "tokenizer=PATH (induction, nl-ar, prompts; default: a Hugging Face --ckpt folder's own)",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


prompts_option = click.option(
    "--data",
    "prompts_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="with --task prompts: the prompts, one JSON per line (docs/tasks.md, prompts)",
)


def load_model_and_task(ckpt: str, device: str, task_name=None, task_opts=(), prompts_path=None, need_task=True):
    """Return (model on `device`, task) of a checkpoint: the task `--task` names with its
    `--task-opt`s and `--data` prompts file, else the checkpoint's own (with the options over
    it; `hookmech.tasks.for_checkpoint`). Without `need_task` and with no task option given,
    the task is None (examples from a cache). A task whose ids the model's d_vocab does not
    cover is refused."""
    from hookmech.errors import UsageError
    from hookmech.option_pairs import parse_options
    from hookmech.tasks import check_vocabulary, for_checkpoint

    options = parse_options(task_opts, "--task-opt")
    if prompts_path is not None:
        if task_name != "prompts":
            raise UsageError("--data FILE.jsonl gives the prompts of --task prompts: add --task prompts")
        options["data"] = prompts_path
    wanted = need_task or task_name is not None or bool(options)
    task = for_checkpoint(ckpt, task_name, options) if wanted else None
    model = load_model(ckpt, device)
    if task is not None:
        check_vocabulary(task, model.cfg.d_vocab)
    return model, task


def examples_count(task, n: int) -> int:
    """Return how many examples to draw: `n` (--n), or every prompt of a task whose rows are
    given (`Task.n_rows`) when --n was not typed."""
    given = click.get_current_context().get_parameter_source("n") == ParameterSource.COMMANDLINE
    return n if task.n_rows is None or given else task.n_rows


@contextlib.contextmanager
def notes_of(*categories: type[Warning]) -> Iterator[None]:
    """Within the block, print each warning of `categories` the library gives as one line
    ``hookmech: note: MESSAGE`` on stderr (not Python's two-line warning with a source line);
    other warnings are shown as usual."""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            for category in categories:
                warnings.simplefilter("always", category)
            yield
    finally:
        for warning in caught:
            if issubclass(warning.category, categories):
                click.echo(f"hookmech: note: {warning.message}", err=True)
            else:
                warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


class progress:
    """A tqdm bar on stderr when it is a terminal, nothing otherwise; yields an `advance(n)`
    callback. `unit` names what is counted (examples, steps, patches)."""

    def __init__(self, total: int, label: str, unit: str = "ex"):
        self.total, self.label, self.unit = total, label, unit
        self.bar: tqdm[NoReturn] | None = None

    def __enter__(self):
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.label, unit=self.unit, file=sys.stderr)
            return self.bar.update
        return lambda n: None

    def say(self, message: str) -> None:
        """Print `message` on stderr as a line (above the bar while one is drawn)."""
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            click.echo(message, err=True)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def patch_count(model, batch, site_specs, pos_specs) -> int:
    """Return the number of records `hookmech.patching.patch` makes of `site_specs` (specs, or
    sites parsed already) × `pos_specs` on `batch` (the total of its progress); bad specs raise
    its own UsageErrors."""
    from hookmech.patching import parse_sites
    from hookmech.sites import position_patches

    positions = position_patches(pos_specs, batch.roles, batch.lengths, batch.tokens.shape[1])
    return len(parse_sites(site_specs, model)) * len(positions)


def path_count(batch, senders, receivers) -> int:
    """Return the number of (sender, receiver) pairs of sites and positions of a path patch of
    parsed endpoints (`hookmech.patching.paths.parse_endpoints`) on `batch` (the total of
    `path_patch`'s progress); bad positions raise its own UsageErrors."""
    from hookmech.sites import position_patches

    def count(ends) -> int:
        n_pos = batch.tokens.shape[1]
        return sum(len(position_patches(end.position, batch.roles, batch.lengths, n_pos)) for end in ends)

    return count(senders) * count(receivers)


def to_json(value, **kwargs) -> str:
    """Return strict JSON of `value`: non-finite floats (NaN, ±inf) become null, since JSON has none."""

    def clean(item):
        if isinstance(item, float) and not math.isfinite(item):
            return None
        if isinstance(item, dict):
            return {key: clean(inner) for key, inner in item.items()}
        if isinstance(item, (list, tuple)):
            return [clean(inner) for inner in item]
        return item

    return json.dumps(clean(value), allow_nan=False, **kwargs)
