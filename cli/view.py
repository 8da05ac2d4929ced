"""`hookmech view`: one self-contained HTML page of a checkpoint, a cache, a sweep folder or a
`hookmech patch --json` file."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import click
from click.core import ParameterSource

from .common import (
    CKPT_HELP,
    CONTEXT,
    EXAMPLES_SEED,
    EXAMPLES_SEED_HELP,
    ExamplesSeed,
    OutputPath,
    allow_mixer_option,
    ckpt_path,
    device_option,
    examples_count,
    load_model_and_task,
    max_batch_option,
    memory_option,
    patch_count,
    progress,
    prompts_option,
    refuse_overwriting_inputs,
    set_threads,
    split_flag,
    task_options,
    threads_option,
    threshold_option,
    verify_cache_option,
)

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither

#: options of one kind of page, refused with the other (name shown, click parameter name)
CHECKPOINT_ONLY: tuple[tuple[str, str], ...] = (
    ("--cache", "cache_path"),
    ("--site", "site_specs"),
    ("--pos", "pos_specs"),
    ("--maps", "maps"),
    ("--maps-mib", "maps_mib"),
    ("--max-batch", "max_batch"),
    ("--threshold", "threshold"),
    ("--device", "device"),
    ("--random-repeat-induction", "random_repeat_induction"),
    ("--memory", "memory"),
    ("--task", "task_name"),
    ("--task-opt", "task_opts"),
    ("--data", "prompts_path"),
    ("--no-verify-cache", "verify_cache"),
)
SWEEP_ONLY = (("--run", "run_ids"), ("--no-heatmaps", "no_heatmaps"))
#: options of the sweep and checkpoint pages that a patch --json file's page has no use for
RECORDS_REFUSED = (("--n", "n"), ("--seed", "seed"), ("--threads", "threads"))


@click.command(context_settings=CONTEXT)
@allow_mixer_option
@click.argument("runs_dir", metavar="[RUNS_DIR | RECORDS.json]", required=False, type=click.Path(exists=True))
@click.option("--ckpt", type=ckpt_path, default=None, help=f"{CKPT_HELP}, instead of RUNS_DIR")
@click.option(
    "--cache", "cache_path", type=click.Path(dir_okay=False), default=None, help="activation cache of --ckpt (its rows)"
)
@click.option("--site", "site_specs", multiple=True, help="sites (default: every block-level site)")
@click.option("--pos", "pos_specs", multiple=True, help="positions (default: every role of the task)")
@click.option(
    "--n", type=int, default=320, show_default=True, help="examples (checkpoint: patched; sweep: per heatmap)"
)
@click.option("--seed", type=ExamplesSeed(), default=EXAMPLES_SEED, show_default=True, help=EXAMPLES_SEED_HELP)
@threshold_option
@max_batch_option
@click.option(
    "--maps", type=int, default=8, show_default=True, help="examples whose effective attention is embedded (first rows)"
)
@click.option(
    "--maps-mib",
    type=float,
    default=8.0,
    show_default=True,
    help="most MiB of map values embedded (fewer examples beyond it, at least one)",
)
@click.option(
    "--run", "run_ids", multiple=True, help="sweep: runs for heatmaps and dynamics (default: best per series)"
)
@click.option("--no-heatmaps", is_flag=True, help="sweep: skip the heatmaps (they patch each selected run)")
@click.option(
    "--random-repeat-induction",
    is_flag=True,
    help="checkpoint: also show Olsson et al.'s prefix matching on random repeated tokens (out of the task's "
    "distribution) beside the induction scores on the examples",
)
@verify_cache_option
@memory_option
@task_options
@prompts_option
@device_option
@threads_option
@click.option("-o", "--out", "out_path", required=True, type=OutputPath(file=True), help="the HTML file to write")
def view(**options):
    """Write one HTML page (no network needed to open it) of a checkpoint, a sweep folder or the
    records of a `hookmech patch --json` file.

    With --ckpt (and --cache): the site x position attribution heatmap (hookmech patch's
    numbers); click a cell for its per-example p_clean / p_corrupt / p_patched and the examples
    of largest and smallest effect; per layer the effective attention of an example; the
    induction scores on the examples (query -> value, value -> key). With RUNS_DIR: the
    interactive twin of every hookmech report figure (a run whose folder keeps no weights is
    drawn from the bundled fixture that holds them). With RECORDS.json: its heatmap and table.
    """
    from hookmech.fileio import size_text
    from hookmech.view import write_page

    runs_dir = options["runs_dir"]
    records_file = runs_dir is not None and Path(runs_dir).is_file()
    _check_options(options, records_file)
    if records_file:
        from hookmech.view.records import records_page_data

        data = records_page_data(runs_dir)
        title = f"{data['title']}: patch records"
    elif runs_dir is not None:
        set_threads(options["threads"])
        data = _sweep_data(runs_dir, options["run_ids"], options["n"], options["seed"], options["no_heatmaps"])
        title = f"{data['title']}: sweep"
    else:
        set_threads(options["threads"])
        data, title = _checkpoint_data(
            options["ckpt"],
            options["cache_path"],
            options["site_specs"],
            options["pos_specs"],
            options["n"],
            options["seed"],
            options["threshold"],
            options["max_batch"],
            options["maps"],
            options["maps_mib"],
            options["memory"],
            options["device"],
            options["random_repeat_induction"],
            (options["task_name"], options["task_opts"], options["prompts_path"]),
            options["verify_cache"],
        )
    path = write_page(data, options["out_path"], title)
    click.echo(f"wrote {path} ({size_text(path.stat().st_size)})")


def _check_options(options, records_file: bool) -> None:
    """Raise a UsageError for options of another kind of page, counts out of range, --cache with
    what it replaces, or an -o that is a folder or one of the inputs. Returns None."""
    from hookmech.errors import UsageError
    from hookmech.row_chunks import check_memory

    runs_dir, ckpt, cache_path, out_path = (
        options["runs_dir"],
        options["ckpt"],
        options["cache_path"],
        options["out_path"],
    )
    if (runs_dir is None) == (ckpt is None):
        raise UsageError("give a sweep folder RUNS_DIR, a patch --json file or --ckpt CKPT (one of them)")
    given = _given_options()
    if records_file:
        wrong = [name for name, param in (*SWEEP_ONLY, *CHECKPOINT_ONLY, *RECORDS_REFUSED) if param in given]
        if wrong:
            raise UsageError(f"{wrong[0]} does not apply to the page of a patch --json file; drop it")
    wrong = [name for name, param in (SWEEP_ONLY if ckpt else CHECKPOINT_ONLY) if param in given]
    if wrong and not records_file:
        kind = "sweep-folder (RUNS_DIR)" if ckpt else "checkpoint (--ckpt)"
        raise UsageError(f"{wrong[0]} belongs to {kind} pages; drop it")
    if options["n"] < 1:
        raise UsageError(f"--n must be >= 1, got {options['n']}")
    if cache_path is not None and given & {"n", "seed"}:
        raise UsageError("--cache gives the examples; drop --n and --seed")
    if cache_path is not None and given & {"task_name", "task_opts", "prompts_path"}:
        raise UsageError("--cache holds its own examples and their task: drop --task, --task-opt and --data")
    if options["maps"] < 1 or not options["maps_mib"] > 0:
        raise UsageError(f"--maps must be >= 1 and --maps-mib > 0, got {options['maps']} and {options['maps_mib']}")
    check_memory(options["memory"])
    if Path(out_path).is_dir():
        raise UsageError(f"-o {out_path} is a folder; give the page's file name (e.g. page.html)")
    inputs = [("--ckpt", ckpt), ("--cache", cache_path), ("--data", options["prompts_path"]), ("RUNS_DIR", runs_dir)]
    if runs_dir is not None and not records_file:
        inputs += [("RUNS_DIR", f"{runs_dir}/{name}") for name in ("results.csv", "sweep.json")]
    refuse_overwriting_inputs([("-o", out_path)], inputs)


def _sweep_data(runs_dir, run_ids, n, seed, no_heatmaps):
    """Return the page data of a sweep folder, with a bar over its selected runs on a terminal
    (each run's heatmap patches its model)."""
    from hookmech.view import sweep_page_data

    bar = _RunsBar()
    try:
        return sweep_page_data(
            runs_dir,
            runs=split_flag(run_ids) or None,
            n=n,
            seed=seed,
            heatmaps=not no_heatmaps,
            log=bar.say,
            progress=bar,
        )
    finally:
        bar.close()


class _RunsBar:
    """A bar over a sweep page's selected runs (`progress`), made once their number is known;
    `say` prints a line above it."""

    def __init__(self) -> None:
        self.bar: progress | None = None
        self.advance = None
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = progress(total, "runs", unit="run")
            self.advance = self.bar.__enter__()
        assert self.advance is not None
        self.advance(done - self.done)
        self.done = done

    def say(self, message: str) -> None:
        if self.bar is not None:
            self.bar.say(message)
        else:
            click.echo(message, err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


def _given_options() -> set[str]:
    """Return the parameter names given on the command line (not left at their defaults)."""
    context = click.get_current_context()
    return {
        name
        for name in context.params
        if context.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    }


def _checkpoint_data(
    ckpt,
    cache_path,
    site_specs,
    pos_specs,
    n,
    seed,
    threshold,
    max_batch,
    maps,
    maps_mib,
    memory,
    device,
    random_repeat,
    task_choice=(None, (), None),
    verify_cache=True,
):
    """Return (page data, title) of a checkpoint's page: its task's examples (`--n`, `--seed`;
    `task_choice` is --task, --task-opt and --data) or the cache's rows and task, patched in
    chunks within `memory` MiB (the per-row arrays left in temporary files for `write_page`)."""
    from hookmech.cache import CacheFile, UnverifiedCacheWarning
    from hookmech.view import checkpoint_page_data, default_positions
    from hookmech.view.checkpoint import page_chunk_rows

    task_name, task_opts, prompts_path = task_choice
    model, task = load_model_and_task(ckpt, device, task_name, task_opts, prompts_path, need_task=cache_path is None)
    about = {"source": ckpt if cache_path is None else f"{ckpt} with the cache {cache_path}"}
    if task is not None:
        n = examples_count(task, n)
    about.update({"n": n, "seed": seed} if cache_path is None else {"n": None, "seed": None})
    source = task.sample(n, seed=seed) if cache_path is None else CacheFile(cache_path, verify=verify_cache)
    try:
        if cache_path is not None:
            source.check_model(model, checkpoint=ckpt, hooks=())
            task = _cache_task(source, ckpt, model)
        # the first rows tell the roles and the row width; the rest is read a chunk at a time
        first = source.window(slice(0, 1)).batch() if isinstance(source, CacheFile) else source.select(slice(0, 1))
        n_rows = source.n if isinstance(source, CacheFile) else len(source)
        chunks = math.ceil(n_rows / page_chunk_rows(model, source, memory))
        sites = split_flag(site_specs) or ["all"]
        positions = split_flag(pos_specs) or default_positions(task, first)
        with (
            warnings.catch_warnings(),
            progress(patch_count(model, first, sites, positions) * chunks, "patching", "patch") as advance,
        ):
            # an older cache without a model_hash was checked above, by the checkpoint file's hash
            warnings.simplefilter("ignore", UnverifiedCacheWarning)
            data = checkpoint_page_data(
                model,
                task,
                source,
                sites=sites,
                positions=positions,
                threshold=threshold,
                max_batch=max_batch,
                map_examples=maps,
                map_budget=int(maps_mib * 2**20),
                about=about,
                progress=advance,
                random_repeat_induction=random_repeat,
                memory=memory,
                spill=True,
            )
    finally:
        if cache_path is not None:
            source.close()
    mixers = ", ".join(dict.fromkeys(model.cfg.mixers))
    return data, f"{Path(ckpt).name}: {mixers} on {task.name}"


def _cache_task(cache, ckpt, model):
    """Return the task of a cache's rows (their token names and roles): the one the cache
    records, else the checkpoint's own; a HookmechError when neither has one."""
    from hookmech.errors import HookmechError
    from hookmech.tasks import check_vocabulary, from_spec, stored_task_spec

    spec = cache.task or stored_task_spec(ckpt)
    if not spec:
        raise HookmechError(f"neither the cache {cache.path} nor {ckpt} records a task (the page names tokens by it)")
    task = from_spec(spec)
    check_vocabulary(task, model.cfg.d_vocab)
    return task
