"""Sweeps (docs/guide.md §8): a grid of runs, each a normal resumable `train` into ``RUNS/<run-id>``.

A sweep file (TOML) has

    name = "ar-cpu"                 # optional
    [task]    name = "ar", task options …
    [train]   trainer options (`TrainConfig` fields: steps, epochs, n_train, warmup_frac, …)
    [model]   fixed model options (arch — a model preset of `hookmech.presets`, e.g. "based"
              = BaseConv and Based layers alternating —, mixer, d_model, n_layers, n_heads, mlp, tie_embeddings,
              pos_emb, mlp_hidden_mult) and mixer options (`K` for every layer, `L0.K` for one)
    [mixer_options.<mixer>]   options for the layers whose mixer is <mixer> (e.g. attention)
    [grid]    lists whose product is the sweep: any model or trainer key, a mixer option
              (`d_conv`, `L0.window`) or a task option (`task.num_kv_pairs`); without [grid]
              the sweep is one run, and an empty [grid] is an error
    [mech]    optional: sites, positions (lists), n, seed, threshold, every (0: only at the end)

Run ids are a pure function of the grid values (a readable part plus a hash), so a re-run of
the same sweep finds its folders: finished runs (``summary.json``) are skipped and broken ones
resume from their last checkpoint. ``RUNS/results.csv`` has one row per run, in grid order.

Every option of every run ([mech] sites and positions included) is checked before the first run
trains (`validate`). The sweep holds ``RUNS/.lock`` while it runs (one sweep per runs folder) and
each worker holds its run folder's lock while it trains and evaluates (`hookmech.locking`).
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import sys
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import HookmechError, UsageError, unknown
from .fileio import atomic_path, read_json, write_text_atomic
from .locking import folder_lock

#: model keys a sweep may fix or vary; anything else in [model] or [grid] is a mixer option
MODEL_KEYS = ("arch", "mixer", "d_model", "n_layers", "n_heads", "mlp", "tie_embeddings", "pos_emb", "mlp_hidden_mult")
MODEL_DEFAULTS = {"arch": None, "mixer": None, "d_model": 64, "n_layers": 2, "n_heads": 1, "mlp": None,
                  "tie_embeddings": True, "pos_emb": None, "mlp_hidden_mult": 4}
MECH_DEFAULTS = {"sites": ["L1.block_in"], "positions": ["key", "value", "query"], "n": 320, "seed": 0,
                 "threshold": 0.01, "every": 0}
ENGINES = ("local", "ray")
#: short forms of the common grid keys in run ids
_ID_PREFIX = {"arch": "", "mixer": "", "d_model": "d", "n_layers": "L", "lr": "lr", "seed": "s"}
#: results.csv columns before the grid-dependent ones
BASE_COLUMNS = ("run_id",)
RESULT_COLUMNS = ("status", "dev_acc", "dev_p_answer", "test_acc", "test_p_answer", "steps", "seconds")
MECH_COLUMNS = ("mech_n", "mech_p_clean", "mech_p_corrupt", "mech_passes")
#: columns that measure time and may differ between two executions of one sweep
TIMING_COLUMNS = ("seconds",)


def _train_keys() -> tuple[str, ...]:
    from .training import TrainConfig

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


# -- reading sweep files -------------------------------------------------------------------
def parse_sweep(text: str, name: str = "sweep") -> Sweep:
    """Parse sweep TOML `text`; return a validated `Sweep` (unknown sections/keys are UsageErrors)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{name}: invalid TOML ({error})") from None
    sections = ("name", "task", "train", "model", "mixer_options", "grid", "mech")
    for key in data:
        if key not in sections:
            raise unknown(f"sweep section in {name}:", key, sections)
    task = dict(data.get("task", {}))
    if "name" not in task:
        raise UsageError(f"{name}: [task] needs a name (e.g. name = \"ar\")")
    train = dict(data.get("train", {}))
    train_keys = _train_keys()
    for key in train:
        if key not in train_keys:
            raise unknown(f"trainer option in {name} [train]:", key, train_keys)
    grid = _flatten(data.get("grid", {}))
    if "grid" in data and not grid:
        raise UsageError(f"{name}: [grid] is empty; give each varied key a list (e.g. seed = [0, 1]), "
                         "or drop [grid] for a single run")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise UsageError(f"{name}: [grid] {key} must be a non-empty list, got {values!r}")
        if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
            raise UsageError(f"{name}: [grid] {key} repeats a value")
    mech = data.get("mech")
    if mech is not None:
        for key in mech:
            if key not in MECH_DEFAULTS:
                raise unknown(f"[mech] key in {name}:", key, MECH_DEFAULTS)
        mech = {**MECH_DEFAULTS, **mech}
        for key in ("sites", "positions"):
            if isinstance(mech[key], str):
                mech[key] = [mech[key]]
        _check_mech_values(mech, name)
    mixer_options = data.get("mixer_options", {})
    for mixer, options in mixer_options.items():
        if not isinstance(options, dict):
            raise UsageError(f"{name}: [mixer_options.{mixer}] must be a table of options")
    return Sweep(name=str(data.get("name", name)), task=task, train=train, model=_flatten(data.get("model", {})),
                 mixer_options={k: _flatten(v) for k, v in mixer_options.items()}, grid=grid, mech=mech)


def _check_mech_values(mech: dict[str, Any], name: str) -> None:
    """Raise a UsageError naming the [mech] key whose value has the wrong type or range."""
    for key in ("sites", "positions"):
        values = mech[key]
        if not isinstance(values, list) or not values or not all(isinstance(v, str) and v.strip() for v in values):
            raise UsageError(f"{name}: [mech] {key} must be a non-empty list of names, got {values!r}")

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not integer(mech["n"]) or mech["n"] < 1:
        raise UsageError(f"{name}: [mech] n must be an integer >= 1, got {mech['n']!r}")
    if not integer(mech["seed"]) or mech["seed"] < 0:
        raise UsageError(f"{name}: [mech] seed must be an integer >= 0, got {mech['seed']!r}")
    if not integer(mech["every"]) or mech["every"] < 0:
        raise UsageError(f"{name}: [mech] every must be an integer >= 0 (0: only at the end), got {mech['every']!r}")
    threshold = mech["threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise UsageError(f"{name}: [mech] threshold must be a number, got {threshold!r}")


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
    return parse_sweep(path.read_text(), name=path.stem)


# -- expanding the grid --------------------------------------------------------------------
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
        parts.append(f"{prefix}{_format_value(value)}")
    readable = re.sub(r"[^A-Za-z0-9_.+=-]+", "-", "_".join(parts).replace(",", "+")) or "run"
    digest = hashlib.sha1(json.dumps(point, sort_keys=True).encode()).hexdigest()[:6]
    return f"{readable[:120]}_{digest}"


def expand(sweep: Sweep) -> list[Run]:
    """Return the runs of a sweep: the product of the grid lists, first key slowest."""
    train_keys = _train_keys()
    keys = list(sweep.grid)
    runs, seen = [], set()
    for values in itertools.product(*(sweep.grid[key] for key in keys)):
        point = dict(zip(keys, values))
        task = dict(sweep.task)
        train = dict(sweep.train)
        model = {**MODEL_DEFAULTS, **{k: v for k, v in sweep.model.items() if k in MODEL_KEYS}}
        layer_options = {k: v for k, v in sweep.model.items() if k not in MODEL_KEYS}
        for key, value in point.items():
            if key.startswith("task."):
                task[key[5:]] = value
            elif key in MODEL_KEYS:
                model[key] = value
            elif key in train_keys:
                train[key] = value
            else:
                layer_options[key] = value
        if "steps" in train and "epochs" not in train:
            train["epochs"] = None
        model["mixer_options"] = layer_options
        identifier = run_id(point)
        if identifier in seen:  # only if two points hash alike
            raise HookmechError(f"two grid points share the run id {identifier}")
        seen.add(identifier)
        runs.append(Run(identifier, point, task, train, model, sweep.mixer_options, sweep.mech))
    return runs


def build_run(run: dict[str, Any]):
    """Return ``(task, model_config, train_config)`` of a run dict (validates everything)."""
    from . import tasks
    from .config import build_config
    from .options import parse_layer_options, split_list
    from .training import TrainConfig

    task = tasks.from_spec(run["task"])
    model = run["model"]
    n_layers = model["n_layers"]
    preset_options: list[dict[str, Any]] = [{} for _ in range(n_layers)]
    if model.get("arch") is not None:
        from .presets import expand_preset

        if model.get("mixer") is not None:
            raise UsageError(f"give arch or mixer, not both (arch {model['arch']!r}, mixer {model['mixer']!r})")
        mixers, preset_options = expand_preset(model["arch"], n_layers)
    else:
        mixer = model.get("mixer") or "attention"
        mixers = split_list([mixer]) if isinstance(mixer, str) else list(mixer)
        if len(mixers) == 1:
            mixers = mixers * n_layers
    pairs = [f"{key}={json.dumps(value)}" for key, value in model["mixer_options"].items()]
    layer_options = parse_layer_options(pairs, n_layers, flag="[model]/[grid] mixer option")
    per_mixer = {name: parse_layer_options([f"{k}={json.dumps(v)}" for k, v in options.items()], n_layers,
                                           flag=f"[mixer_options.{name}]")
                 for name, options in (run.get("mixer_options") or {}).items()}
    layer_options = [{**preset_options[layer], **(per_mixer[name][layer] if name in per_mixer else {}), **options}
                     for layer, (name, options) in enumerate(zip(mixers, layer_options))]
    model_config = build_config(
        d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=mixers, d_model=model["d_model"], n_layers=n_layers,
        layer_options=layer_options, n_heads=model["n_heads"], mlp=model["mlp"],
        tie_embeddings=model["tie_embeddings"], pos_emb=model["pos_emb"], mlp_hidden_mult=model["mlp_hidden_mult"],
    )
    return task, model_config, TrainConfig(**run["train"])


def validate(runs: Iterable[Run]) -> None:
    """Check every option of every run before any run trains; return None, or raise (a
    HookmechError naming the run) on the first bad one.

    Builds each run's task (and its test split, where it has one), model config and trainer
    config, each distinct model on torch's meta device (no memory, no compute), and checks the
    [mech] sites against that model's hooks, the positions against the run's mech batch, and
    ``every`` against the run's ``eval_every``.
    """
    import torch

    from . import tasks
    from .mech import check_sites_and_positions, mech_batch
    from .model import HookedLM

    hooks: dict[str, Any] = {}
    batches: dict[str, Any] = {}
    for run in runs:
        try:
            task, model_config, train_config = build_run(run.as_dict())
            if _needs_test_split(run.task):
                tasks.from_spec({**run.task, "split": "test"})
            key = model_config.to_json()
            if key not in hooks:
                with torch.device("meta"):
                    hooks[key] = HookedLM(model_config).hook_dict
            mech = run.mech
            if mech is None:
                continue
            if mech["every"] and mech["every"] % train_config.eval_every:
                raise UsageError(f"[mech] every {mech['every']} must be a multiple of eval_every "
                                 f"{train_config.eval_every} (attributions are measured at evaluations), or 0")
            batch_key = json.dumps([task.spec, mech["seed"], mech["n"]], sort_keys=True)
            if batch_key not in batches:
                batches[batch_key] = mech_batch(task, mech["seed"], mech["n"])
            try:
                check_sites_and_positions(hooks[key], batches[batch_key], mech["sites"], mech["positions"])
            except HookmechError as error:
                raise type(error)(f"[mech]: {error}") from None
        except HookmechError as error:
            raise type(error)(f"run {run.run_id}: {error}") from None


# -- one run -------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    return read_json(path) if path.exists() else None


def _needs_test_split(task_spec: dict[str, Any]) -> bool:
    return task_spec.get("split") not in (None, "test")


def run_is_complete(run: dict[str, Any], runs_dir: str | Path) -> bool:
    """True when the run's folder holds everything its results row needs."""
    out = Path(runs_dir) / run["run_id"]
    summary = _read_json(out / "summary.json")
    if summary is None:
        return False
    if summary.get("status") != "finished":
        return True
    mech = _read_json(out / "mech.json")
    if run["mech"] is not None and (mech is None or mech.get("config") != run["mech"]):
        return False
    return not _needs_test_split(run["task"]) or (out / "test.json").exists()


def execute_run(run: dict[str, Any], runs_dir: str, threads: int | None = None, device: str = "cpu",
                quiet: bool = True) -> dict[str, Any]:
    """Train one run into ``runs_dir/<run_id>`` (skip/resume as its folder says), then add the
    test-split accuracy and the end-of-run attributions; return its results row.

    A run stopped by a NaN loss returns its row with ``status = "nan"``.
    """
    import torch

    from .training import train

    if threads is not None:
        torch.set_num_threads(threads)
    task, model_config, train_config = build_run(run)
    out = Path(runs_dir) / run["run_id"]
    mech_config = run["mech"]
    on_eval = None
    if mech_config is not None and mech_config.get("every"):
        from .mech import mech_callback

        on_eval = mech_callback(task, model_config, sites=mech_config["sites"], positions=mech_config["positions"],
                                every=mech_config["every"], eval_every=train_config.eval_every,
                                total_steps=train_config.total_steps(), n=mech_config["n"],
                                seed=mech_config["seed"], threshold=mech_config["threshold"], device=device)
    log = (lambda message: None) if quiet else None
    with folder_lock(out, "run folder"):  # training, test.json and mech.json: one process at a time
        try:
            summary = train(task, model_config, train_config, out, device=device, progress=False, on_eval=on_eval,
                            log=log)
        except HookmechError:
            summary = _read_json(out / "summary.json")
            if summary is None or summary.get("status") != "nan":
                raise
        if summary.get("status") == "finished":
            _finish_run(run, out, task, train_config, device)
    return collect_row(run, runs_dir)


def _finish_run(run: dict[str, Any], out: Path, task, train_config, device: str) -> None:
    """Write test.json (test-split accuracy) and mech.json (end-of-run attributions) if missing."""
    from .checkpoint import load

    model = None
    if _needs_test_split(run["task"]) and not (out / "test.json").exists():
        from . import tasks
        from .training import evaluate

        model = load(out / "model.safetensors", device=device)
        test_task = tasks.from_spec({**run["task"], "split": "test"})
        scores = evaluate(model, test_task.sample(train_config.n_dev, seed=(train_config.seed, 1)))
        write_text_atomic(out / "test.json", json.dumps({"test_acc": scores["dev_acc"],
                                                         "test_p_answer": scores["dev_p_answer"]}, indent=1))
    mech_config = run["mech"]
    if mech_config is not None:
        existing = _read_json(out / "mech.json")
        if existing is None or existing.get("config") != mech_config:
            from .mech import evaluate_mechanism, mech_batch

            model = model or load(out / "model.safetensors", device=device)
            batch = mech_batch(task, mech_config["seed"], mech_config["n"])
            records, columns = evaluate_mechanism(model, batch, mech_config["sites"], mech_config["positions"],
                                                  threshold=mech_config["threshold"])
            write_text_atomic(out / "mech.json", json.dumps({"config": mech_config, "columns": columns,
                                                             "records": records}, indent=1))


def collect_row(run: dict[str, Any], runs_dir: str | Path) -> dict[str, Any]:
    """Return the results row of a run from its folder (``status = "missing"`` if never trained)."""
    out = Path(runs_dir) / run["run_id"]
    row: dict[str, Any] = {"run_id": run["run_id"], **run["point"]}
    summary = _read_json(out / "summary.json") or {"status": "missing"}
    for key in RESULT_COLUMNS:
        row[key] = summary.get(key)
    row.update(_read_json(out / "test.json") or {})
    mech = _read_json(out / "mech.json")
    if mech is not None and summary.get("status") == "finished":
        row.update(mech["columns"])
    return row


# -- engines -------------------------------------------------------------------------------
def default_threads(workers: int) -> int:
    """Torch threads per run when not given: the machine's cores divided among the workers."""
    return max(1, (os.cpu_count() or 1) // workers)


def _error_row(run: dict[str, Any], error: BaseException) -> dict[str, Any]:
    row = collect_row(run, "/nonexistent")
    row["status"] = "error"
    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return row


def _run_local(todo, runs_dir, workers, threads, device, done: Callable[[dict, dict], None]) -> None:
    if workers == 1:
        for run in todo:
            try:
                row = execute_run(run, runs_dir, threads, device)
            except Exception as error:  # one broken run must not stop the sweep
                row = _error_row(run, error)
            done(run, row)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawn, not fork: a forked child inherits the parent's OpenMP pool state and may hang
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(execute_run, run, runs_dir, threads, device): run for run in todo}
        for future in as_completed(futures):
            run = futures[future]
            try:
                row = future.result()
            except Exception as error:
                row = _error_row(run, error)
            done(run, row)


def _run_ray(todo, runs_dir, workers, threads, device, done, address: str | None, gpus_per_run: float) -> None:
    try:
        import ray
    except ImportError:
        raise UsageError("--engine ray needs Ray: pip install 'hookmech[dist]' (ray[default,tune])") from None
    if address is None:
        ray.init(num_cpus=workers * threads, include_dashboard=False, ignore_reinit_error=True,
                 log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, configure_logging=False)
    try:
        remote = ray.remote(num_cpus=threads, num_gpus=gpus_per_run, max_retries=0)(execute_run)
        pending = {remote.remote(run, str(Path(runs_dir).resolve()), threads, device): run for run in todo}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            run = pending.pop(ready[0])
            try:
                row = ray.get(ready[0])
            except Exception as error:
                cause = getattr(error, "cause", None) or error
                row = _error_row(run, cause)
            done(run, row)
    finally:
        if address is None:
            ray.shutdown()


def run_sweep(
    sweep: Sweep,
    runs_dir: str | Path,
    *,
    engine: str = "local",
    workers: int = 1,
    threads: int | None = None,
    device: str = "cpu",
    address: str | None = None,
    gpus_per_run: float = 0.0,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every run of `sweep` not yet complete in `runs_dir` and write ``runs_dir/results.csv``.

    `workers` runs go in parallel, each pinned to `threads` torch threads (default: cores //
    workers). Returns the rows in grid order. Runs that fail with anything but a NaN loss get
    ``status = "error"``; the sweep then raises a HookmechError after writing the table.

    Every run is checked (`validate`) before anything is written; a bad option of any run raises
    then, naming the run. Raises `hookmech.locking.FolderLocked` if another process holds
    `runs_dir`.
    """
    if engine not in ENGINES:
        raise unknown("engine", engine, ENGINES)
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    if gpus_per_run < 0:
        raise UsageError(f"--gpus-per-run must be >= 0, got {gpus_per_run}")
    if gpus_per_run > 0 and engine != "ray":
        raise UsageError("--gpus-per-run needs --engine ray")
    threads = threads or default_threads(workers)
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    log = log or (lambda message: print(message, file=sys.stderr))
    runs = expand(sweep)
    validate(runs)
    runs_dir = Path(runs_dir)
    # one sweep at a time in a runs folder (its results.csv is rewritten as runs finish); each
    # worker then locks only its own run folder, so workers never wait for each other
    with folder_lock(runs_dir, "runs folder"):
        write_text_atomic(runs_dir / "sweep.json", json.dumps(dataclasses.asdict(sweep), indent=1, sort_keys=True))
        as_dicts = [run.as_dict() for run in runs]
        rows: dict[str, dict[str, Any]] = {}
        todo = []
        for run in as_dicts:
            if run_is_complete(run, runs_dir):
                rows[run["run_id"]] = collect_row(run, runs_dir)
            else:
                todo.append(run)
        log(f"sweep {sweep.name}: {len(runs)} runs, {len(runs) - len(todo)} already done, {len(todo)} to run "
            f"({engine}, {workers} workers x {threads} threads)")
        began = time.perf_counter()

        def done(run: dict[str, Any], row: dict[str, Any]) -> None:
            rows[run["run_id"]] = row
            acc = row.get("dev_acc")
            detail = row.get("error") or (f"dev_acc {acc:.3f}" if isinstance(acc, float) else "")
            log(f"[{len(rows)}/{len(runs)}] {run['run_id']}: {row['status']} {detail} "
                f"({time.perf_counter() - began:.0f} s)")
            write_results([rows[r["run_id"]] for r in as_dicts if r["run_id"] in rows], runs_dir / "results.csv")

        if todo:
            if engine == "local":
                _run_local(todo, str(runs_dir), workers, threads, device, done)
            else:
                _run_ray(todo, str(runs_dir), workers, threads, device, done, address, gpus_per_run)
        ordered = [rows[run["run_id"]] for run in as_dicts]
        write_results(ordered, runs_dir / "results.csv")
        failed = [row["run_id"] for row in ordered if row["status"] == "error"]
        if failed:
            raise HookmechError(f"{len(failed)} of {len(runs)} runs failed ({', '.join(failed[:3])}"
                                f"{', …' if len(failed) > 3 else ''}); results.csv has the rest; rerun to retry")
        return ordered


# -- results.csv ---------------------------------------------------------------------------
def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(value + 0.0)  # -0.0 -> 0.0
    if isinstance(value, (int, str)):
        return str(value)
    return json.dumps(value, sort_keys=True)


def result_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Return the results.csv header of `rows`: run_id, grid keys, results, mech columns
    (``attr:<site>@<pos>`` in first-appearance order), then ``error`` if any run failed."""
    seen: list[str] = []
    for row in rows:
        for key in row:
            if key not in seen:
                seen.append(key)
    fixed = set(BASE_COLUMNS) | set(RESULT_COLUMNS) | set(MECH_COLUMNS) | {"error"}
    grid = [k for k in seen if k not in fixed and not k.startswith("attr:")]
    optional = [k for k in ("test_acc", "test_p_answer") if any(row.get(k) is not None for row in rows)]
    results = [k for k in RESULT_COLUMNS if k not in ("test_acc", "test_p_answer") or k in optional]
    mech = [k for k in MECH_COLUMNS if k in seen] + [k for k in seen if k.startswith("attr:")]
    return [*BASE_COLUMNS, *grid, *results, *mech, *(["error"] if "error" in seen else [])]


def write_results(rows: list[dict[str, Any]], path: str | Path) -> None:
    """Write `rows` as CSV (atomically); None becomes an empty cell, lists JSON."""
    columns = result_columns(rows)
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(columns)
            for row in rows:
                writer.writerow([_cell(row.get(column)) for column in columns])


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Read a results.csv; numbers become int/float, empty cells None, true/false bools."""
    path = Path(path)
    if not path.exists():
        raise HookmechError(f"{path} does not exist (run `hookmech sweep` first)")
    with open(path, newline="") as handle:
        return [{key: _parse_cell(value) for key, value in row.items()} for row in csv.DictReader(handle)]


def _parse_cell(text: str) -> Any:
    if text == "":
        return None
    if text in ("true", "false"):
        return text == "true"
    if not re.fullmatch(r"[-+0-9.eE]+", text):  # "nan" is a status, not a number
        return text
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
