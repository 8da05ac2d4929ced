"""`evaluate`: train a mixer on a suite's tasks over its learning rates (one sweep per task, on
the sweep machinery: local or Ray), measure the attributions at every ``L{l}.block_in`` and the
mixer's inside hooks, and write the report card (`card`).

The output folder ``DIR`` holds ``evaluate.json`` (what is evaluated: suite, model, options),
one runs folder per task (``DIR/<task>/``, a sweep's: resumable, ``results.csv``), the pages of
each task's best run (``DIR/<task>/view-<run-id>.html``), ``card.json`` and ``card.md``. Running
the same evaluation again resumes it; another suite or model in the same folder is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import HookmechError, UsageError, unknown
from ..fileio import read_json, write_text_atomic
from ..locking import FolderLocked, folder_lock
from ..mech import mech_batch
from ..option_pairs import parse_layer_options
from ..progress import duration_text
from ..ray_session import check_ray_address, import_ray
from ..sweep import (
    MECH_DEFAULTS,
    MODEL_KEYS,
    Sweep,
    build_run,
    expand,
    read_results,
    run_is_complete,
    run_sweep,
    validate,
    write_results,
)
from ..sweep.driver import check_gpus_per_run
from ..sweep.engines import default_threads
from ..sweep.grid import canonical_mixers
from .budget import Planned, check_budget, next_run, plan, run_seconds, step_seconds, wall_seconds
from .card import best_row, build_card, task_rows, write_card
from .suites import Suite, SuiteTask, suite, with_rates, with_steps, with_tasks

# torch, the tasks, the model and its modules are imported where used: this module loads without torch

#: the examples the attributions are measured on (every run), as the sweep presets' [mech]
MECH_N, MECH_SEED = 320, 0


def evaluate(
    out: str | Path,
    *,
    mixer: str | None = None,
    arch: str | None = None,
    suite_name: str = "quick",
    lrs: Sequence[float] | None = None,
    mixer_options: dict[str, Any] | None = None,
    budget_hours: float | None = None,
    tasks: Sequence[str] | None = None,
    steps: int | None = None,
    engine: str = "local",
    workers: int = 1,
    threads: int | None = None,
    device: str = "cpu",
    address: str | None = None,
    gpus_per_run: float = 0.0,
    views: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Evaluate `mixer` (every layer; a registry name or one of your own, `hookmech.mixers`) or
    model preset `arch` on suite `suite_name` into folder `out`; return the card (`card.json`'s
    data).

    `lrs` replaces every task's learning rates (in order of priority; default: the suite's).
    `tasks` (names of the suite's tasks) runs only those; the card still shows every task of
    the suite that the folder holds runs of. `steps` trains every run for that many steps
    instead of the suite's (a smoke test: another evaluation, recorded in evaluate.json).
    `mixer_options` (``{K: V}`` for every layer, ``{"L0.K": V}`` for one) go to every run; a
    suite's own mixer option that the evaluated mixer does not take (the paper suite's ``bias``)
    is left out and the card says so. `budget_hours` keeps the runs that fit (`budget.plan`)
    and lists the rest in the card. Every run's options, and Ray, are checked before anything is
    written (UsageError). A run, or a view page, that fails is marked so in the card and the
    others go on.
    """
    log = log or (lambda message: None)
    check_budget(budget_hours)
    if (mixer is None) == (arch is None):
        raise UsageError("give --mixer SPEC or --arch PRESET (one of them)")
    chosen = suite(suite_name) if lrs is None else with_rates(suite(suite_name), lrs)
    chosen = chosen if steps is None else with_steps(chosen, steps)
    selected = [task.name for task in (chosen if tasks is None else with_tasks(chosen, tasks)).tasks]
    model_key = _model_key(mixer, arch)
    options = dict(mixer_options or {})
    _refuse_model_keys(options)
    threads = default_threads(workers) if threads is None else threads
    check_gpus_per_run(gpus_per_run, engine)
    if engine == "ray":  # Ray absent or far away: one line before the folder is touched
        import_ray()
        check_ray_address(address)
    out = Path(out)
    with _caller_state_kept(device):
        # every run's options are checked before anything is written
        built = {task.name: _task_sweep(chosen, task, model_key, options) for task in chosen.tasks}
        sweeps = {name: sweep for name, (sweep, _) in built.items()}
        not_applied = {name: dropped for name, (_, dropped) in built.items() if dropped}
        if out.exists() and not out.is_dir():
            raise UsageError(f"-o {out} is a file; give a folder")
        # two evaluations into one folder would mix their runs and cards: one at a time
        with folder_lock(out, "evaluation folder"):
            _claim_folder(out, chosen, model_key, options, steps)
            planned = _plan(chosen, selected, sweeps, out, budget_hours, workers, threads, device, log)
            errors = _run(chosen, sweeps, planned, out, engine, workers, threads, device, address, gpus_per_run, log)
            mixers = model_key["mixer"].split(",") if "mixer" in model_key else []
            view_errors = _write_views(chosen, out, device, log, mixers) if views else {}
            card = build_card(
                out, chosen, model_key, options, planned, errors, view_errors, not_applied, selected, steps
            )
            write_card(card, out)
    log(f"wrote {out / 'card.md'} and {out / 'card.json'}")
    return card


def _refuse_model_keys(options: dict[str, Any]) -> None:
    """Raise a UsageError for a --mixer-opt that is a model setting of the suite (d_model,
    mixer, …): the suite fixes those, so that cards and references compare."""
    for key in options:
        if key.rpartition(".")[2] in MODEL_KEYS:
            raise UsageError(
                f"--mixer-opt {key}: {key.rpartition('.')[2]} is a model setting the suite fixes, not a mixer option"
            )


@contextlib.contextmanager
def _caller_state_kept(device: str = "cpu") -> Iterator[None]:
    """Give the caller back its torch thread count and RNG states (CPU, and CUDA when runs use
    it): runs train in this process when there is one worker, and they set both."""
    import torch

    threads = torch.get_num_threads()
    cuda = list(range(torch.cuda.device_count())) if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def _model_key(mixer: str | None, arch: str | None) -> dict[str, Any]:
    """Return the [model] key naming what is evaluated: the mixer by its canonical name (two
    spellings of one file are one evaluation) or the preset."""
    if arch is not None:
        from ..model_presets import MODEL_PRESETS

        if arch not in MODEL_PRESETS:
            raise unknown("model preset", arch, MODEL_PRESETS)
        return {"arch": arch}

    name = canonical_mixers(str(mixer).strip())
    from ..mixers import spec_of

    for one in name.split(","):
        spec_of(one)  # a name that does not resolve is refused now, in one line
    return {"mixer": name}


def _claim_folder(
    out: Path, chosen: Suite, model_key: dict[str, Any], options: dict[str, Any], steps: int | None = None
) -> None:
    """Write ``out/evaluate.json``, or refuse a folder that holds another evaluation (another
    suite, model, option set or ``--steps``; ``steps`` is recorded only when given, so folders
    written before the option keep resuming)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out} is a file; give a folder")
    what: dict[str, Any] = {"suite": chosen.name, "model": model_key, "mixer_options": options}
    if steps is not None:
        what["steps"] = steps
    path = out / "evaluate.json"
    if path.exists():
        held = read_json(path)
        if held != what:
            raise UsageError(
                f"{out} holds the evaluation of {_describe(held)}, not {_describe(what)}; give another -o folder"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(what, indent=1, sort_keys=True))


def _describe(what: Any) -> str:
    if not isinstance(what, dict):
        return "something else"
    model = what.get("model") or {}
    name = model.get("mixer") or model.get("arch") or "?"
    options = what.get("mixer_options") or {}
    shown = "".join(f" {key}={value}" for key, value in sorted(options.items()))
    steps = f" with --steps {what['steps']}" if what.get("steps") is not None else ""
    return f"{name}{shown} on suite {what.get('suite')}{steps}"


def _task_sweep(chosen: Suite, task: SuiteTask, model_key: dict[str, Any], options: dict[str, Any]):
    """Return (the `Sweep` of one task, every learning rate of the suite, checked; the suite's
    mixer options left out because the evaluated mixers do not take them). Its sites are every
    ``L{l}.block_in`` with l >= 1 and the mixers' inside hooks, its positions the task's roles."""
    settings = {key: value for key, value in task.model.items() if key in MODEL_KEYS}
    suite_options = {key: value for key, value in task.model.items() if key not in MODEL_KEYS}
    # a layer the suite's models lack, in this command's words (the sweep's would name its file's tables)
    parse_layer_options([f"{key}=0" for key in options], settings.get("n_layers", 2), "--mixer-opt")
    taken = _options_taken(model_key, settings.get("n_layers", 2))
    dropped = sorted(key for key in suite_options if key not in taken)
    kept = {key: value for key, value in suite_options.items() if key in taken}
    model = {**settings, **kept, **model_key, **options}
    base = Sweep(
        name=f"evaluate-{chosen.name}-{task.name}",
        task=dict(task.task),
        train=dict(task.train),
        model=model,
        mixer_options=dict(task.mixer_options),
        grid={"lr": list(task.lrs), "seed": [0]},
        mech=None,
    )
    first = expand(base)[0]
    sites, positions = _mech_sites(first.as_dict())
    sweep = dataclasses.replace(base, mech=_mech(sites, positions))
    validate(expand(sweep))
    return sweep, dropped


def _options_taken(model_key: dict[str, Any], n_layers: int) -> set[str]:
    """Return the option names every layer's mixer of the evaluated model takes."""
    from ..mixers import mixer_class, mixer_options
    from ..model_presets import expand_preset

    if "arch" in model_key:
        names = expand_preset(model_key["arch"], n_layers)[0]
    else:
        names = [name.strip() for name in model_key["mixer"].split(",")]
    per_layer = [set(mixer_options(mixer_class(name))) for name in names]
    return set.intersection(*per_layer)


def _mech(sites: list[str], positions: list[str]) -> dict[str, Any]:
    return {**MECH_DEFAULTS, "sites": sites, "positions": positions, "n": MECH_N, "seed": MECH_SEED}


def _mech_sites(run: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Return (sites, positions) measured on every run of this task's models: the inside hooks
    are those with a position axis (a filter that does not depend on the input, as Hyena's,
    cannot be patched at a position)."""
    import torch

    from ..hooks import pos_axis_of
    from ..model import HookedLM
    from ..sites import hook_to_site, resolve_sites

    task, model_config, _ = build_run(run)
    with torch.random.fork_rng(devices=[]):
        hook_dict = HookedLM(model_config).hook_dict
    sites = [f"L{layer}.block_in" for layer in range(1, model_config.n_layers)]
    if not sites:
        raise UsageError("the mechanistic evaluation needs at least two layers (it reads L1.block_in)")
    try:
        inside = resolve_sites(["L*.mixer.*"], hook_dict)  # hook names, in forward order
    except UsageError:  # a mixer without inside hooks
        inside = []
    sites += [hook_to_site(hook) for hook in inside if pos_axis_of(hook_dict[hook]) is not None]
    return sites, list(task.roles)


def _plan(
    chosen: Suite, selected: list[str], sweeps, out: Path, budget_hours, workers: int, threads: int, device: str, log
) -> list[Planned]:
    """Return the plan of every run of the `selected` tasks: round k holds every task's k-th
    learning rate (`budget.plan`). With a budget, log what one run of each task costs here,
    what is kept, and what the next run left out would need."""
    by_task = {name: expand(sweep) for name, sweep in sweeps.items()}
    tasks = [task for task in chosen.tasks if task.name in selected]
    step_time: dict[str, float] = {}
    entries = []
    for index in range(max(len(task.lrs) for task in tasks)):
        for task in tasks:
            if index >= len(task.lrs):
                continue
            run = by_task[task.name][index].as_dict()
            done = run_is_complete(run, out / task.name)
            total = build_run(run)[2].total_steps()
            seconds = 0.0
            if budget_hours is not None and not done:
                if task.name not in step_time:
                    step_time[task.name] = step_seconds(run, device, threads=threads)
                    log(
                        f"{task.name}: {step_time[task.name] * 1e3:.1f} ms a step here: one run of {total} steps "
                        f"≈ {duration_text(run_seconds(step_time[task.name], total))}"
                    )
                seconds = run_seconds(step_time[task.name], total)
            entries.append((task.name, float(task.lrs[index]), seconds, done))
    planned = plan(entries, budget_hours, workers)
    if budget_hours is not None:
        _log_plan(planned, budget_hours, workers, log)
    return planned


def _log_plan(planned: list[Planned], budget_hours: float, workers: int, log) -> None:
    """Log the budget's plan: the runs kept and their estimated time, the runs left out, and
    the budget the next of them would need."""
    todo = [p for p in planned if p.kept and not p.done]
    estimate = wall_seconds([(p.task, p.seconds) for p in todo], workers)
    log(
        f"--budget-hours {budget_hours:g} ({duration_text(budget_hours * 3600)}): {len(todo)} runs to train, "
        f"estimated {duration_text(estimate)}"
        + (f" ({', '.join(f'{p.task} lr {p.lr:g}' for p in todo)})" if todo else "")
    )
    following = next_run(planned, workers)
    if following is None:
        return
    left = [p for p in planned if not p.kept]
    first, hours = following
    log(
        f"--budget-hours {budget_hours:g}: leaving out {len(left)} runs ("
        + ", ".join(f"{p.task} lr {p.lr:g}" for p in left)
        + f"); the next, {first.task} lr {first.lr:g}, needs ≈ {duration_text(first.seconds)}: "
        f"--budget-hours {_round_up(hours):g} would keep it"
    )


def _round_up(hours: float) -> float:
    """`hours` rounded up to two significant digits (a budget to type)."""
    if hours <= 0:
        return hours
    scale = 10 ** (math.floor(math.log10(hours)) - 1)
    return math.ceil(hours / scale - 1e-9) * scale


def _run(chosen: Suite, sweeps, planned, out: Path, engine, workers, threads, device, address, gpus_per_run, log):
    """Run each task's kept runs (one task after another; up to `workers` runs of a task at
    once); return ``{task: error message}`` of tasks whose runs failed."""
    errors: dict[str, str] = {}
    for task in chosen.tasks:
        lrs = [p.lr for p in planned if p.task == task.name and p.kept]
        if not lrs:
            continue
        runs_dir = out / task.name
        table = runs_dir / "results.csv"
        # rows of runs this budget leaves out (a failure among them) outlive the sweep's rewrite
        earlier = [row for row in read_results(table) if row["lr"] not in lrs] if table.exists() else []
        sweep = dataclasses.replace(sweeps[task.name], grid={"lr": lrs, "seed": [0]})
        try:
            run_sweep(sweep, runs_dir, engine=engine, workers=workers, threads=threads, device=device,
                      address=address, gpus_per_run=gpus_per_run, log=log)  # fmt: skip
        except (UsageError, FolderLocked):
            raise
        except HookmechError as error:  # some runs failed: the card says which; go on
            if not table.exists():
                raise
            errors[task.name] = str(error)
            log(f"{task.name}: {error}")
        if earlier:
            write_results(sorted(read_results(table) + earlier, key=lambda row: row["lr"]), table)
    return errors


def _write_views(chosen: Suite, out: Path, device: str, log, mixers: list[str]) -> dict[str, str]:
    """Write the `hookmech view` page of each task's best run, unless it is there already;
    return ``{task: error}`` of pages that could not be made (the card still is). The runs'
    checkpoints are loaded allowing the evaluated `mixers` (the user named them)."""
    errors: dict[str, str] = {}
    for task in chosen.tasks:
        best = best_row(task_rows(out / task.name))
        if best is None:
            continue
        page = out / task.name / f"view-{best['run_id']}.html"
        if page.exists():
            continue
        try:
            _write_view(out / task.name / best["run_id"], page, device, mixers)
        except HookmechError as error:
            errors[task.name] = str(error)
            log(f"{task.name}: no view page ({error})")
            continue
        log(f"wrote {page}")
    return errors


def _write_view(run_dir: Path, page: Path, device: str, mixers: list[str]) -> None:
    """Write the checkpoint page of the run in `run_dir`: its task's MECH_N examples of the card."""
    from .. import tasks
    from ..checkpoint import load, read_metadata
    from ..view import checkpoint_page_data, write_page

    checkpoint = run_dir / "model.safetensors"
    model = load(checkpoint, device=device, allow_mixers=mixers)
    task = tasks.from_spec(read_metadata(checkpoint)["task"])
    batch = mech_batch(task, MECH_SEED, MECH_N).trimmed()  # the rows the card's numbers come from
    about = {"run": run_dir.name, "evaluated by": "hookmech evaluate"}
    data = checkpoint_page_data(model, task, batch, about=about)
    write_page(data, page, f"{run_dir.parent.name}: {run_dir.name}")
