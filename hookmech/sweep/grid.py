"""The grid of a sweep: its runs (`expand`: the product of the [grid] lists, first key slowest),
their ids, and everything a run builds (`build_run`), checked for every run before any trains
(`validate`).

Run ids are a pure function of the grid values (a readable part plus a hash), so a re-run of
the same sweep finds its folders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..config import build_config
from ..errors import HookmechError, UsageError
from ..fileio import sha256_of
from ..mech import check_sites_and_positions, mech_batch
from ..option_pairs import parse_layer_options, split_list
from .spec import MODEL_DEFAULTS, MODEL_KEYS, TRAIN_DATA, Sweep, train_keys

# torch, the tasks, the model and training are imported where used: a sweep's grid loads without torch

#: short forms of the common grid keys in run ids
_ID_PREFIX = {"arch": "", "mixer": "", "d_model": "d", "n_layers": "L", "lr": "lr", "seed": "s"}


@dataclass(frozen=True)
class Run:
    """One point of a sweep: everything a worker needs to train it (plain JSON-able data)."""

    run_id: str
    point: dict[str, Any]  # the grid values of this run, in grid order
    task: dict[str, Any]  # full task spec
    train: dict[str, Any]  # TrainConfig keyword arguments
    model: dict[str, Any]  # MODEL_KEYS values + "mixer_options": {K or L{l}.K: V}
    mixer_options: dict[str, dict[str, Any]]
    mech: dict[str, Any] | None

    def as_dict(self) -> dict[str, Any]:
        """Return the run as a plain dict (what worker processes receive)."""
        return dataclasses.asdict(self)


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


def run_id(point: dict[str, Any]) -> str:
    """Return the folder name of a grid point: a readable part and a 6-hex hash of the values.

    ``{"mixer": "attention", "d_model": 64, "lr": 0.001, "seed": 0}`` ->
    ``attention_d64_lr0.001_s0_<hash>``; the hash keeps ids distinct when sanitising merges two.
    """
    parts = []
    for key, value in point.items():
        prefix = _ID_PREFIX.get(key, re.sub(r"^task\.", "", key))
        parts.append(f"{prefix}{_format_value(_short_mixers(value) if key == 'mixer' else value)}")
    readable = re.sub(r"[^A-Za-z0-9_.+=-]+", "-", "_".join(parts).replace(",", "+")) or "run"
    digest = hashlib.sha1(json.dumps(point, sort_keys=True).encode()).hexdigest()[:6]
    return f"{readable[:120]}_{digest}"


def _short_mixers(value: Any) -> Any:
    """A mixer grid value as the readable part of a run id shows it: a mixer of your own
    (``module:Class``, ``/path/file.py:Class``) by its class name (the id's hash keeps the rest)."""
    if isinstance(value, str):
        return ",".join(name.rpartition(":")[2] for name in value.split(","))
    return [_short_mixers(name) for name in value] if isinstance(value, list) else value


def canonical_mixers(value: Any) -> Any:
    """Return a sweep's mixer value (a name, a comma list or a list of names) with each mixer of
    your own by its canonical name (`hookmech.mixers.canonical_name`): one run id for two spellings
    of one file, and a name that any worker (another folder, another process) resolves alike. Names
    that do not resolve stay as they are, for `validate` to refuse with the run's id."""
    from ..mixers import canonical_name

    def one(name: Any) -> Any:
        if not isinstance(name, str):
            return name
        try:
            return canonical_name(name.strip())
        except HookmechError:
            return name

    if isinstance(value, str):
        names = value.split(",")
        canonical = [one(name) for name in names]
        return value if canonical == [name.strip() for name in names] else ",".join(canonical)
    return [one(name) for name in value] if isinstance(value, list) else value


def expand(sweep: Sweep) -> list[Run]:
    """Return the runs of a sweep: the product of the grid lists, first key slowest."""
    trainer_keys = train_keys()
    keys = list(sweep.grid)
    # [mixer_options.<mixer>] by canonical name, as the runs' mixers: a worker elsewhere matches them
    mixer_options = {canonical_mixers(name): options for name, options in sweep.mixer_options.items()}
    runs, seen = [], set()
    for values in itertools.product(*(sweep.grid[key] for key in keys)):
        point = dict(zip(keys, values, strict=True))
        task = dict(sweep.task)
        train = dict(sweep.train)
        model = {**MODEL_DEFAULTS, **{k: v for k, v in sweep.model.items() if k in MODEL_KEYS}}
        layer_options = {k: v for k, v in sweep.model.items() if k not in MODEL_KEYS}
        if "mixer" in point:
            point["mixer"] = canonical_mixers(point["mixer"])
        model["mixer"] = canonical_mixers(model["mixer"])
        for key, value in point.items():
            if key.startswith("task."):
                task[key[5:]] = value
            elif key in MODEL_KEYS:
                model[key] = value
            elif key in trainer_keys:
                train[key] = value
            else:
                layer_options[key] = value
        if "steps" in train and "epochs" not in train:
            train["epochs"] = None
        model["mixer_options"] = layer_options
        identifier = run_id(point)
        if identifier in seen:  # only if two points hash alike
            mixer = _format_value(point.get("mixer", ""))
            why = f" (two spellings of one mixer are one mixer: {mixer})" if ":" in mixer else ""
            raise HookmechError(f"two grid points share the run id {identifier}{why}")
        seen.add(identifier)
        runs.append(Run(identifier, point, task, train, model, mixer_options, sweep.mech))
    return runs


def build_run(run: dict[str, Any]):
    """Return ``(task, model_config, train_config)`` of a run dict (validates everything)."""
    from .. import tasks
    from ..training import TrainConfig

    task = tasks.from_spec(run["task"])
    model = run["model"]
    n_layers = model["n_layers"]
    preset_options: list[dict[str, Any]] = [{} for _ in range(n_layers)]
    if model.get("arch") is not None:
        from ..model_presets import expand_preset

        if model.get("mixer") is not None:
            raise UsageError(f"give arch or mixer, not both (arch {model['arch']!r}, mixer {model['mixer']!r})")
        mixers, preset_options = expand_preset(model["arch"], n_layers)
    else:
        mixer = model.get("mixer") or "attention"
        mixers = split_list([mixer]) if isinstance(mixer, str) else list(mixer)
        mixers = [canonical_mixers(name) for name in mixers]  # as the [mixer_options.<mixer>] keys
        if len(mixers) == 1:
            mixers = mixers * n_layers
        if n_layers > 0 and len(mixers) != n_layers:  # build_config's message, before the zip below needs it
            raise UsageError(f"got {len(mixers)} mixers for {n_layers} layers")
    pairs = [f"{key}={json.dumps(value)}" for key, value in model["mixer_options"].items()]
    layer_options = parse_layer_options(pairs, n_layers, flag="[model]/[grid] mixer option")
    per_mixer = {
        canonical_mixers(name): parse_layer_options(
            [f"{k}={json.dumps(v)}" for k, v in options.items()], n_layers, flag=f"[mixer_options.{name}]"
        )
        for name, options in (run.get("mixer_options") or {}).items()
    }
    layer_options = [
        {**preset_options[layer], **(per_mixer[name][layer] if name in per_mixer else {}), **options}
        for layer, (name, options) in enumerate(zip(mixers, layer_options, strict=True))
    ]
    model_config = build_config(
        d_vocab=task.d_vocab,
        n_ctx=task.n_ctx,
        mixers=mixers,
        d_model=model["d_model"],
        n_layers=n_layers,
        layer_options=layer_options,
        n_heads=model["n_heads"],
        mlp=model["mlp"],
        tie_embeddings=model["tie_embeddings"],
        pos_emb=model["pos_emb"],
        mlp_hidden_mult=model["mlp_hidden_mult"],
        init=model.get("init"),
    )
    train = {key: value for key, value in run["train"].items() if key != TRAIN_DATA}
    return task, model_config, TrainConfig(**train)


def check_training_data(run: dict[str, Any], task, train_config) -> None:
    """Raise a UsageError naming the file when the run's [train] data file is missing, holds
    another task or holds other than ``n_train`` rows; return None (also without a file). Reads
    the file's header only."""
    from .. import tasks
    from ..datasets import read_dataset_header

    path = run["train"].get(TRAIN_DATA)
    if path is None:
        return
    header = read_dataset_header(path)
    if tasks.from_spec(header["task"]).spec != task.spec:
        raise UsageError(f"[train] data {path} holds task {header['task']}, not the sweep's {task.spec}")
    if header["n"] != train_config.n_train:
        raise UsageError(
            f"[train] data {path} holds {header['n']} rows, but n_train is {train_config.n_train} "
            "(set [train] n_train to the file's rows)"
        )


def training_data(run: dict[str, Any], task, train_config):
    """Return ``(rows, the file's sha256)`` of the run's [train] data file (checked as
    `check_training_data` does), or ``(None, None)`` when the run samples its training set."""
    from ..datasets import load_dataset

    path = run["train"].get(TRAIN_DATA)
    if path is None:
        return None, None
    check_training_data(run, task, train_config)
    return load_dataset(path)[1], sha256_of(path)


def validate(runs: Iterable[Run]) -> None:
    """Check every option of every run before any run trains; return None, or raise (a
    HookmechError naming the run) on the first bad one.

    Builds each run's task (and its test split, where it has one), model config and trainer
    config, each distinct model on torch's meta device (no memory, no compute; its size must fit
    this machine's memory, `check_fits`), and checks the
    [mech] sites against that model's hooks, the positions against the run's mech batch, and
    ``every`` against the run's ``eval_every``.
    """
    import torch

    from .. import tasks
    from ..model import HookedLM
    from ..sizes import check_fits

    hooks: dict[str, Any] = {}
    batches: dict[str, Any] = {}
    for run in runs:
        try:
            task, model_config, train_config = build_run(run.as_dict())
            check_training_data(run.as_dict(), task, train_config)
            if needs_test_split(run.task):
                tasks.from_spec({**run.task, "split": "test"})
            key = model_config.to_json()
            if key not in hooks:
                with torch.device("meta"):
                    meta_model = HookedLM(model_config)
                check_fits(model_config, copies=4, meta_model=meta_model)  # as `train` will
                hooks[key] = meta_model.hook_dict
            mech = run.mech
            if mech is None:
                continue
            if mech["every"] and mech["every"] % train_config.eval_every:
                raise UsageError(
                    f"[mech] every {mech['every']} must be a multiple of eval_every "
                    f"{train_config.eval_every} (attributions are measured at evaluations), or 0"
                )
            batch_key = json.dumps([task.spec, mech["seed"], mech["n"]], sort_keys=True)
            if batch_key not in batches:
                batches[batch_key] = mech_batch(task, mech["seed"], mech["n"])
            try:
                check_sites_and_positions(hooks[key], batches[batch_key], mech["sites"], mech["positions"])
            except HookmechError as error:
                raise type(error)(f"[mech]: {error}") from None
        except HookmechError as error:
            raise type(error)(f"run {run.run_id}: {error}") from None


def needs_test_split(task_spec: dict[str, Any]) -> bool:
    """True when the run's task trains on a split other than "test", so a test split exists to score."""
    return task_spec.get("split") not in (None, "test")
