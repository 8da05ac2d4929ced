"""Sweep files: the TOML format, parsed into a `Sweep` (unknown sections and keys are UsageErrors).

A sweep file has

    name = "ar-cpu"                 # optional
    [task]    name = "ar", task options …
    [train]   trainer options (`TrainConfig` fields: steps, epochs, n_train, warmup_frac, …), and
              `data`: a dataset file (`hookmech data`) every run trains on, as `train --data`
    [model]   fixed model options (arch — a model preset of `hookmech.model_presets`, e.g. "based"
              = BaseConv and Based layers alternating —, mixer, d_model, n_layers, n_heads, mlp, tie_embeddings,
              pos_emb, mlp_hidden_mult, init) and mixer options (`K` for every layer, `L0.K` for one)
    [mixer_options.<mixer>]   options for the layers whose mixer is <mixer> (e.g. attention)
    [grid]    lists whose product is the sweep: any model or trainer key, a mixer option
              (`d_conv`, `L0.window`) or a task option (`task.num_kv_pairs`); without [grid]
              the sweep is one run, and an empty [grid] is an error
    [mech]    optional: sites, positions (lists), n, seed, threshold, every (0: only at the end)
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import schema
from ..config import INIT_CHOICES, POS_EMBS
from ..errors import UsageError, unknown

# .training is imported where used: it loads torch, which reading a sweep spec does not need

#: model keys a sweep may fix or vary; anything else in [model] or [grid] is a mixer option
MODEL_KEYS = (
    "arch",
    "mixer",
    "d_model",
    "n_layers",
    "n_heads",
    "mlp",
    "tie_embeddings",
    "pos_emb",
    "mlp_hidden_mult",
    "init",
)
MODEL_DEFAULTS = {
    "arch": None,
    "mixer": None,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 1,
    "mlp": None,
    "tie_embeddings": True,
    "pos_emb": None,
    "mlp_hidden_mult": 4,
    "init": None,
}


def model_fields() -> dict[str, schema.Field]:
    """Return what each [model] key may be (MODEL_KEYS): sizes are integers >= 1, flags true or
    false, names non-empty strings."""
    return {
        "arch": schema.name("a model preset name"),
        "mixer": schema.names("a mixer name"),
        "d_model": schema.COUNT,
        "n_layers": schema.COUNT,
        "n_heads": schema.COUNT,
        "mlp": schema.BOOL,
        "tie_embeddings": schema.BOOL,
        "pos_emb": schema.name(choices=POS_EMBS),
        "mlp_hidden_mult": schema.COUNT,
        "init": schema.name(choices=INIT_CHOICES),
    }


MECH_DEFAULTS = {
    "sites": ["L1.block_in"],
    "positions": ["key", "value", "query"],
    "n": 320,
    "seed": 0,
    "threshold": 0.01,
    "every": 0,
}


#: the [train] key naming a dataset file to train on (not a `TrainConfig` field: `build_run` reads it)
TRAIN_DATA = "data"


def train_keys() -> tuple[str, ...]:
    """Return the trainer options a sweep may set: the fields of `TrainConfig`."""
    from ..training import TrainConfig

    return tuple(f.name for f in dataclasses.fields(TrainConfig))


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file. `grid` keeps the file's key order (it orders runs and columns)."""

    name: str
    task: dict[str, Any]
    train: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    mixer_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    mech: dict[str, Any] | None = None


def parse_sweep(text: str, name: str = "sweep", source: str | None = None) -> Sweep:
    """Parse sweep TOML `text`; return a validated `Sweep` named `name` unless it names itself.

    Unknown sections and keys, and values of the wrong type or range (`check_values`), are
    UsageErrors naming `source` (the file; default `name`), the key, the value and what it
    should be."""
    where = source or name
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{where}: invalid TOML ({error})") from None
    sections = ("name", "task", "train", "model", "mixer_options", "grid", "mech")
    for key in data:
        if key not in sections:
            raise unknown(f"sweep section in {where}:", key, sections)
    task = dict(data.get("task", {}))
    if "name" not in task:
        raise UsageError(f'{where}: [task] needs a name (e.g. name = "ar")')
    train = dict(data.get("train", {}))
    trainer_keys = (*train_keys(), TRAIN_DATA)
    for key in train:
        if key not in trainer_keys:
            raise unknown(f"trainer option in {where} [train]:", key, trainer_keys)
    if TRAIN_DATA in train and not (isinstance(train[TRAIN_DATA], str) and train[TRAIN_DATA].strip()):
        raise UsageError(f"{where}: [train] data must be a dataset file's path, got {train[TRAIN_DATA]!r}")
    grid = _flatten(data.get("grid", {}))
    if TRAIN_DATA in grid:
        raise UsageError(f"{where}: [grid] data: every run of a sweep trains on one file; give it in [train]")
    if "grid" in data and not grid:
        raise UsageError(
            f"{where}: [grid] is empty; give each varied key a list (e.g. seed = [0, 1]), "
            "or drop [grid] for a single run"
        )
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise UsageError(f"{where}: [grid] {key} must be a non-empty list, got {values!r}")
        if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
            raise UsageError(f"{where}: [grid] {key} repeats a value")
    mech = data.get("mech")
    if mech is not None:
        for key in mech:
            if key not in MECH_DEFAULTS:
                raise unknown(f"[mech] key in {where}:", key, MECH_DEFAULTS)
        mech = {**MECH_DEFAULTS, **mech}
        for key in ("sites", "positions"):
            if isinstance(mech[key], str):
                mech[key] = [mech[key]]
        _check_mech_values(mech, where)
    model = _flatten(data.get("model", {}))
    check_values(where, train, model, grid)
    mixer_options = data.get("mixer_options", {})
    for mixer, options in mixer_options.items():
        if not isinstance(options, dict):
            raise UsageError(f"{where}: [mixer_options.{mixer}] must be a table of options")
    return Sweep(
        name=str(data.get("name", name)),
        task=task,
        train=train,
        model=model,
        mixer_options={k: _flatten(v) for k, v in mixer_options.items()},
        grid=grid,
        mech=mech,
    )


def check_values(where: str, train: dict[str, Any], model: dict[str, Any], grid: dict[str, list[Any]]) -> None:
    """Raise a UsageError naming `where`, the section, the key, the value and what it should be
    when a trainer or model option ([train], [model], or an entry of a [grid] list) has the
    wrong type or range (`TRAIN_FIELDS`, `model_fields`); return None. Mixer and task options
    are checked when the runs are built (`grid.validate`)."""
    from ..training import TRAIN_FIELDS

    fields = {**TRAIN_FIELDS, **model_fields()}
    for section, table in (("[train]", train), ("[model]", model)):
        for key, value in table.items():
            field = fields.get(key)
            if field is not None and not field.fits(value):
                raise UsageError(f"{where}: {section} {key} = {schema.toml_text(value)}: expected {field.describe()}")
    for key, values in grid.items():
        field = fields.get(key)
        if field is None:  # a mixer or task option
            continue
        for value in values:
            if not field.fits(value):
                raise UsageError(
                    f"{where}: [grid] {key} = {schema.toml_text(values)}: "
                    f"{schema.toml_text(value)} is not {field.describe()}"
                )


def _check_mech_values(mech: dict[str, Any], where: str) -> None:
    """Raise a UsageError naming the [mech] key whose value has the wrong type or range."""
    for key in ("sites", "positions"):
        values = mech[key]
        if not isinstance(values, list) or not values or not all(isinstance(v, str) and v.strip() for v in values):
            raise UsageError(f"{where}: [mech] {key} must be a non-empty list of names, got {values!r}")

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not integer(mech["n"]) or mech["n"] < 1:
        raise UsageError(f"{where}: [mech] n must be an integer >= 1, got {mech['n']!r}")
    if not integer(mech["seed"]) or mech["seed"] < 0:
        raise UsageError(f"{where}: [mech] seed must be an integer >= 0, got {mech['seed']!r}")
    if not integer(mech["every"]) or mech["every"] < 0:
        raise UsageError(f"{where}: [mech] every must be an integer >= 0 (0: only at the end), got {mech['every']!r}")
    threshold = mech["threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise UsageError(f"{where}: [mech] threshold must be a number, got {threshold!r}")


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Undo TOML's dotted keys: ``L0.window = 2`` (a nested table) -> ``{"L0.window": 2}``."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_sweep(path: str | Path) -> Sweep:
    """Read a sweep TOML file; return a `Sweep` named after the file unless it names itself."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"sweep file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")  # TOML is UTF-8, whatever the locale says
    except UnicodeDecodeError as error:
        raise UsageError(
            f"sweep file {path} is not UTF-8 text (byte {error.start}: {error.reason}); TOML is UTF-8"
        ) from None
    return parse_sweep(text, name=path.stem, source=str(path))
