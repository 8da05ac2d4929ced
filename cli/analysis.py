"""`hookmech sites`, `cache` and `patch`: looking inside a trained model."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

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
    load_model,
    load_model_and_task,
    max_batch_option,
    memory_option,
    model_file_identity,
    notes_of,
    patch_count,
    path_count,
    progress,
    prompts_option,
    refuse_overwriting_inputs,
    set_threads,
    split_flag,
    task_options,
    threads_option,
    threshold_option,
    to_json,
    verify_cache_option,
)

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither


@click.command(context_settings=CONTEXT)
@allow_mixer_option
@click.option("--ckpt", required=True, type=ckpt_path, help=CKPT_HELP)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def sites(ckpt, as_json):
    """List every hook site of a checkpoint's model with its hook name and shape."""
    from hookmech.sites import list_sites
    from hookmech.tables import format_table

    rows = list_sites(load_model(ckpt, "cpu"))
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    click.echo(
        format_table(
            ["site", "hook", "shape", "axes", "pos axis"],
            [
                [
                    r["site"],
                    r["hook"],
                    "[" + ", ".join(map(str, r["shape"])) + "]",
                    r["axes"],
                    "-" if r["pos_axis"] is None else r["pos_axis"],
                ]
                for r in rows
            ],
        )
    )


@click.command(context_settings=CONTEXT)
@allow_mixer_option
@click.option("--ckpt", required=True, type=ckpt_path, help=CKPT_HELP)
@click.option("--n", type=int, default=320, show_default=True, help="number of examples")
@click.option("--seed", type=ExamplesSeed(), default=EXAMPLES_SEED, show_default=True, help=EXAMPLES_SEED_HELP)
@click.option("--sites", "site_specs", multiple=True, help="sites to store (default: all block-level sites)")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16"]),
    default="float32",
    show_default=True,
    help="storage dtype of the activations: float16 halves the file (reads give float32; p(answer) stays float32)",
)
@click.option("--compression", type=click.Choice(["none", "gzip", "lzf"]), default="none", show_default=True)
@task_options
@prompts_option
@device_option
@threads_option
@click.option("-o", "--out", "out_path", required=True, type=OutputPath(dir_okay=False))
def cache(
    ckpt,
    n,
    seed,
    site_specs,
    dtype,
    compression,
    device,
    threads,
    out_path,
    task_name=None,
    task_opts=(),
    prompts_path=None,
):
    """Cache clean and corrupt activations of a checkpoint on task examples (HDF5): the
    checkpoint's task, or --task (with --task-opt, and --data for prompts)."""
    from hookmech.cache import write_cache
    from hookmech.errors import UsageError
    from hookmech.sites import resolve_sites
    from hookmech.validate import check_finite_parameters

    if n < 1:
        raise UsageError(f"--n must be >= 1, got {n}")
    refuse_overwriting_inputs([("-o", out_path)], [("--ckpt", ckpt), ("--data", prompts_path)])
    set_threads(threads)
    model, task = load_model_and_task(ckpt, device, task_name, task_opts, prompts_path)
    identity = model_file_identity(ckpt)  # the file's sha256, or the folder's resolved path
    check_finite_parameters(model, ckpt)
    hooks = resolve_sites(split_flag(site_specs) or ["all"], model.hook_dict)
    n = examples_count(task, n)
    batch = task.sample(n, seed=seed)
    with progress(n, "caching") as advance:
        write_cache(
            model,
            batch,
            out_path,
            hooks,
            model_sha256=identity["model_sha256"],
            model_source=identity["model_source"],
            task_spec=task.spec,
            dtype=dtype,
            compression=None if compression == "none" else compression,
            progress=advance,
        )
    click.echo(f"wrote {out_path}: {len(hooks)} sites x {n} examples (clean and corrupt)")


@click.command(context_settings=CONTEXT)
@allow_mixer_option
@click.option("--ckpt", required=True, type=ckpt_path, help=CKPT_HELP)
@click.option("--site", "site_specs", multiple=True, help="site or pattern (repeatable, comma lists)")
@click.option("--pos", "pos_specs", multiple=True, help="position: role, integer, all, whole, a+b")
@click.option(
    "--sender", "senders", multiple=True, metavar="SITE@POS", help="path patching: where the clean value starts"
)
@click.option("--receiver", "receivers", multiple=True, metavar="SITE@POS", help="path patching: where it is received")
@click.option(
    "--via",
    type=click.Choice(["resid", "head", "state", "conv"]),
    default=None,
    help="path patching: the one route the sender's value takes to the receiver (docs/guide.md §10)",
)
@click.option(
    "--cache", "cache_path", type=click.Path(dir_okay=False), default=None, help="activation cache of this checkpoint"
)
@verify_cache_option
@click.option(
    "--data",
    "data_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="examples from a dataset file (hookmech data ... -o FILE) instead of --n/--seed; with --task prompts, "
    "the prompts file (one JSON per line)",
)
@click.option("--n", type=int, default=320, show_default=True, help="examples, without --cache")
@click.option(
    "--seed",
    type=ExamplesSeed(),
    default=EXAMPLES_SEED,
    show_default=True,
    help=EXAMPLES_SEED_HELP + "; without --cache",
)
@click.option(
    "--method",
    type=click.Choice(["exact", "atp", "atp-star"]),
    default="exact",
    show_default=True,
    help="exact interchange; atp: the first-order (gradient) estimate of every cell at once; "
    "atp-star: AtP* (softmax recomputed at the patched position, saturation-free metric; GradDrop with --graddrop)",
)
@click.option(
    "--verify-top",
    type=int,
    default=0,
    metavar="K",
    help="with --method atp or atp-star: re-run the top K cells exactly",
)
@click.option(
    "--graddrop/--no-graddrop",
    default=None,
    help="with --method atp-star: GradDrop's extra backward pass per layer (its `graddrop` score, "
    "which --verify-top also ranks by); off by default, as it changed no ranking on the measured "
    "models; --no-graddrop, the default, is kept for older scripts",
)
@threshold_option
@max_batch_option
@click.option(
    "--context-memory",
    type=int,
    default=2048,
    show_default=True,
    metavar="MIB",
    help="memory for the mixer states that let patches re-run from the patched position only "
    "(beyond it: every position, slower, same numbers)",
)
@memory_option
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="ray: share the --cache's row chunks out over Ray workers (pip install 'hookmech[dist]')",
)
@click.option("--address", default=None, help="with --engine ray: the cluster's address (default: a local Ray)")
@click.option(
    "--workers", type=int, default=None, help="with --engine ray: Ray tasks (default: the cluster's CPUs / --threads)"
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON array")
@click.option("--csv", "as_csv", is_flag=True, help="print CSV: one line per record, its fields as columns")
@click.option(
    "-o",
    "--out",
    "heatmap_path",
    type=OutputPath(file=True),
    default=None,
    help="also draw the records' heatmap into this PNG (site x position; path patches: sender x receiver)",
)
@click.option(
    "--per-example",
    type=OutputPath(dir_okay=False),
    default=None,
    help="also write per-row p_patched to this JSON file",
)
@click.option(
    "--metric",
    type=click.Choice(["p_answer", "log_p", "logit_diff", "kl"]),
    default="p_answer",
    show_default=True,
    help="what is read at the query (logit_diff: answer vs corrupted answer; kl: KL(clean || run))",
)
@click.option(
    "--direction",
    type=click.Choice(["denoise", "noise"]),
    default=None,
    help="denoise: clean into corrupt (default); noise: corrupt into clean (the default with --ablate)",
)
@click.option(
    "--ablate",
    type=click.Choice(["zero", "mean", "resample"]),
    default=None,
    help="patch zero / the mean over rows / another row's clean activation into the clean run",
)
@click.option("--ablate-seed", type=int, default=0, show_default=True, help="seed of --ablate resample's row order")
@click.option(
    "--corrupt",
    type=click.Choice(["key", "value"]),
    default=None,
    help="which token the corrupt document corrupts (rebuilds the task; not with --cache)",
)
@task_options
@device_option
@threads_option
def patch(**options):
    """Interchange interventions: patch clean activations into the corrupt run, per site x position
    (--site, --pos), or along one path from a sender to a receiver (--sender, --receiver, --via)."""
    from hookmech.patching.rows_file import RowsFile

    request = SimpleNamespace(**options)  # the command's options, by their parameter names
    _check_patch_options(request)
    set_threads(request.threads)
    model, source = _model_and_rows(request)
    # per-row outputs go to disk as row chunks are done (then into the --per-example file)
    rows_file = RowsFile(request.per_example) if request.per_example is not None else None
    try:
        with _patch_engine(request, model, source) as engine:
            if request.cache_path is not None:
                # the one identity check; the checkpoint file checks an older cache without model_hash
                source.check_model(model, checkpoint=request.ckpt, hooks=())
            records = _run_patches(engine, model, source, request, rows_file)
        if rows_file is not None:
            rows_file.write(records, to_json)
    finally:
        if request.cache_path is not None:
            source.close()
        if rows_file is not None:
            rows_file.close()
    _print_patch_records(records, request)


def _check_patch_options(request) -> None:
    """Raise a UsageError for options that contradict each other or are out of range, before
    anything is loaded (`request`: the patch command's options). Returns None."""
    from hookmech.errors import UsageError
    from hookmech.row_chunks import memory_bytes

    r = request
    _check_node_or_path(
        r.site_specs, r.pos_specs, r.senders, r.receivers, r.via, r.method, r.verify_top, r.direction, r.ablate
    )
    if r.n < 1:
        raise UsageError(f"--n must be >= 1, got {r.n}")
    if r.context_memory < 0:
        raise UsageError(f"--context-memory must be >= 0 MiB, got {r.context_memory}")
    if r.verify_top < 0 or (r.verify_top and r.method not in ("atp", "atp-star")):
        raise UsageError("--verify-top K needs --method atp or atp-star and K >= 0")
    if r.graddrop is not None and r.method != "atp-star":
        raise UsageError(f"--{'' if r.graddrop else 'no-'}graddrop is an option of --method atp-star")
    if r.corrupt is not None and r.cache_path is not None:
        raise UsageError("--corrupt rebuilds the examples; a --cache holds its own (drop one of them)")
    _check_task_source(r.task_name, r.task_opts, r.cache_path, r.data_path)
    if r.as_csv and r.as_json:
        raise UsageError("print --csv or --json, not both")
    _check_heatmap_path(r.heatmap_path)
    memory_bytes(r.memory)
    _check_engine(r.engine, r.address, r.workers, r.cache_path, r.data_path)
    refuse_overwriting_inputs(
        [("--per-example", r.per_example), ("-o", r.heatmap_path)],
        [("--ckpt", r.ckpt), ("--cache", r.cache_path), ("--data", r.data_path)],
    )


def _model_and_rows(request):
    """Return (model, rows to patch): the rows of --data (a dataset file), of --cache (an open
    `CacheFile`, closed by the caller) or the task's examples (--n, --seed; --task, --corrupt)."""
    from hookmech.cache import CacheFile
    from hookmech.validate import check_finite_parameters

    r = request
    prompts = r.task_name == "prompts"
    dataset = None if prompts else r.data_path
    model, task = load_model_and_task(
        r.ckpt,
        r.device,
        r.task_name,
        r.task_opts,
        r.data_path if prompts else None,
        need_task=(r.cache_path is None and dataset is None) or r.corrupt is not None,
    )
    check_finite_parameters(model, r.ckpt)
    if r.corrupt is not None:
        from hookmech.tasks import from_spec

        task = from_spec({**task.spec, "corrupt": r.corrupt})
    if dataset is not None:
        return model, _patch_rows_from_file(dataset, r.ckpt)
    if r.cache_path is not None:
        return model, CacheFile(r.cache_path, verify=r.verify_cache)
    return model, task.sample(examples_count(task, r.n), seed=r.seed)


class _Engine(NamedTuple):
    """Where the patches run: the library in this process, or Ray workers over a cache's rows.
    `progress(advance, total)` adapts the command's bar to the engine's callback; `exact` is
    `verify_top`'s exact runner (None: the library's)."""

    patch: Callable[..., list[dict[str, Any]]]
    path_patch: Callable[..., list[dict[str, Any]]]
    progress: Callable[[Callable[[int], None], int], Callable[..., None]]
    exact: Callable[..., list[dict[str, Any]]] | None


@contextlib.contextmanager
def _patch_engine(request, model, source) -> Iterator[_Engine]:
    """Yield the `_Engine` of --engine: local, or a started `RayPatchEngine` (stopped after)."""
    from hookmech.patching import patch as run_patch
    from hookmech.patching import path_patch

    if request.engine != "ray":
        yield _Engine(run_patch, path_patch, lambda advance, total: advance, None)
        return
    from hookmech.patching.distributed import RayPatchEngine
    from hookmech.row_chunks import memory_bytes

    threads = request.threads or 1
    with RayPatchEngine(
        request.ckpt, request.cache_path, workers=request.workers, address=request.address, threads=threads
    ) as ray:
        options = (request.threshold, request.max_batch, request.context_memory << 20, memory_bytes(request.memory))
        yield _Engine(ray.patch, ray.path_patch, _in_records, _exact_on(ray, model, source, *options))


def _run_patches(engine: _Engine, model, source, request, rows_file) -> list[dict[str, Any]]:
    """Return the records of the node or path patches `request` asks for (then its --verify-top
    re-runs), with the command's progress bar."""
    from hookmech.cache import CacheFile
    from hookmech.patching import PathSkippedWarning
    from hookmech.row_chunks import memory_bytes

    r = request
    memory_limit = memory_bytes(r.memory)
    shared = dict(
        threshold=r.threshold,
        max_batch=r.max_batch,
        per_example=r.per_example is not None,
        metric=r.metric,
        context_memory=r.context_memory << 20,
        memory=memory_limit,
        rows_sink=rows_file,
    )
    batch = source.batch() if isinstance(source, CacheFile) else source
    if r.via is not None:
        from hookmech.patching.paths import parse_endpoints

        # the endpoints are parsed here once; the bar's total, the engine and its workers take them parsed
        senders = parse_endpoints(split_flag(r.senders), model, "sender")
        receivers = parse_endpoints(split_flag(r.receivers), model, "receiver")
        total = path_count(batch, senders, receivers)
        with notes_of(PathSkippedWarning), progress(total, "patching", unit="patch") as advance:
            return engine.path_patch(
                model, source, senders, receivers, r.via, progress=engine.progress(advance, total), **shared
            )
    from hookmech.patching import parse_sites

    # the sites are parsed here once; the bar's total, the engine and its workers take them parsed
    nodes = (parse_sites(split_flag(r.site_specs), model), split_flag(r.pos_specs))
    total = patch_count(model, batch, *nodes)
    with progress(total, "patching", unit="patch") as advance:
        records = engine.patch(
            model,
            source,
            *nodes,
            progress=engine.progress(advance, total),
            method=r.method,
            direction=r.direction,
            ablate=r.ablate,
            ablate_seed=r.ablate_seed,
            graddrop=r.graddrop,
            **shared,
        )
    if not r.verify_top:
        return records
    from hookmech.patching import verify_top

    return verify_top(
        model,
        source,
        records,
        r.verify_top,
        threshold=r.threshold,
        max_batch=r.max_batch,
        context_memory=r.context_memory << 20,
        memory=memory_limit,
        exact=engine.exact,
    )


def _print_patch_records(records, request) -> None:
    """Draw the -o heatmap and print the records (table, --json or --csv), without the per-row
    lists that went to the --per-example file."""
    from hookmech.tables import format_csv, format_records

    if request.per_example is not None:
        for record in records:
            for rows in ("p_patched_rows", "metric_patched_rows", "p_clean_rows", "p_corrupt_rows"):
                record.pop(rows, None)
    if request.heatmap_path is not None:
        _draw_heatmap(records, request.heatmap_path, request.ckpt, request.method, request.metric, request.via)
    if request.as_json:
        click.echo(to_json(records, indent=1))
    else:
        click.echo(format_csv(records) if request.as_csv else format_records(records))


def _check_engine(engine: str, address, workers, cache_path, data_path) -> None:
    """`patch --engine ray` shards a --cache's rows; --address and --workers are its options.
    A UsageError naming what to give or drop; returns None."""
    from hookmech.errors import UsageError

    if engine == "ray":
        if cache_path is None:
            raise UsageError("--engine ray shares out the rows of a --cache: give --cache (or drop --engine ray)")
        if workers is not None and workers < 1:
            raise UsageError(f"--workers must be >= 1, got {workers}")
        return
    given = [flag for flag, value in (("--address", address), ("--workers", workers)) if value is not None]
    if given:
        raise UsageError(f"{' and '.join(given)} {'are options' if len(given) > 1 else 'is an option'} of --engine ray")


def _in_records(advance, total: int):
    """Return a progress callback of shares of the job (`RayPatchEngine`) that advances `advance`
    by whole records, `total` in all."""
    state = {"share": 0.0, "done": 0}

    def step(share: float) -> None:
        state["share"] += share
        now = min(total, round(state["share"] * total))
        if now > state["done"]:
            advance(now - state["done"])
            state["done"] = now

    return step


def _exact_on(engine, model, cache, threshold, max_batch, context_memory, memory):
    """Return `verify_top`'s exact runner on the Ray `engine` (the same options as locally)."""

    def exact(sites, positions):
        return engine.patch(
            model,
            cache,
            sites,
            positions,
            memory=memory,
            threshold=threshold,
            max_batch=max_batch,
            context_memory=context_memory,
        )

    return exact


def _check_heatmap_path(path: str | None) -> None:
    """`patch -o`: a PNG file name, not a folder; a UsageError otherwise (returns None)."""
    from hookmech.errors import UsageError

    if path is None:
        return
    if Path(path).is_dir():
        raise UsageError(f"-o {path} is a folder; give the heatmap's file name (e.g. heatmap.png)")
    if Path(path).suffix.lower() != ".png":
        raise UsageError(f"-o writes the heatmap as PNG: give a file name ending in .png, got {path}")


def _draw_heatmap(records, path: str, ckpt: str, method: str, metric: str, via: str | None) -> None:
    """Draw `records` with `hookmech.report.plot_heatmap` (a path patch's as sender x receiver) and say so on stderr."""
    from hookmech import report

    title = f"{Path(ckpt).name}: attribution ({'path patching via ' + via if via else method}, {metric})"
    if via is not None:
        report.plot_heatmap(records, path, title, rows="sender", columns="receiver")
    else:
        report.plot_heatmap(records, path, title)
    click.echo(f"wrote {path}", err=True)


def _check_node_or_path(site_specs, pos_specs, senders, receivers, via, method, verify_top, direction, ablate) -> None:
    """`patch` patches nodes (--site and --pos) or one path (--sender, --receiver, --via), never
    both; a path patch is exact denoising. Raises a UsageError naming what to drop or add; returns None."""
    from hookmech.errors import UsageError

    path_given = [flag for flag, value in (("--sender", senders), ("--receiver", receivers), ("--via", via)) if value]
    if not path_given:
        if not site_specs or not pos_specs:
            raise UsageError(
                f"missing {'--site' if not site_specs else '--pos'}: give --site and --pos "
                "(or --sender, --receiver and --via for a path patch)"
            )
        return
    if site_specs or pos_specs:
        raise UsageError("--site/--pos patch nodes and --sender/--receiver/--via one path: give one or the other")
    missing = [flag for flag in ("--sender", "--receiver", "--via") if flag not in path_given]
    if missing:
        raise UsageError(
            f"a path patch needs --sender SITE@POS, --receiver SITE@POS and --via; missing {', '.join(missing)}"
        )
    if method != "exact" or verify_top or direction is not None or ablate is not None:
        raise UsageError("a path patch is exact denoising: drop --method atp, --verify-top, --direction and --ablate")


def _check_task_source(task_name, task_opts, cache_path, data_path) -> None:
    """`patch`: --task/--task-opt choose the examples, which a --cache or a dataset --data holds
    already; a prompts file goes with --task prompts. A UsageError naming what to drop or add."""
    from hookmech.errors import UsageError

    given = [flag for flag, value in (("--task", task_name), ("--task-opt", task_opts)) if value]
    if given and cache_path is not None:
        raise UsageError(f"--cache holds its own examples and their task: drop {' and '.join(given)}")
    if data_path is None or task_name == "prompts":
        return
    if str(data_path).endswith(".jsonl"):
        raise UsageError(f"--data {data_path}: a prompts file is read with --task prompts")
    if given:
        raise UsageError(f"--data {data_path} is a dataset file, which holds its own task: drop {' and '.join(given)}")


def _patch_rows_from_file(data_path, ckpt):
    """`patch --data`: the rows of a dataset file whose task fits the checkpoint's (when it stores
    one); --cache, --n and --seed choose examples too, so giving one of them as well is a usage error."""
    from hookmech.datasets import check_fits_model, load_dataset
    from hookmech.errors import UsageError
    from hookmech.tasks import stored_task_spec

    context = click.get_current_context()
    given = [
        f"--{name}"
        for name in ("cache", "n", "seed")
        if context.get_parameter_source("cache_path" if name == "cache" else name) == ParameterSource.COMMANDLINE
    ]
    if given:
        raise UsageError(f"--data gives the examples; drop {', '.join(given)}")
    data_task, batch = load_dataset(data_path)
    check_fits_model(data_task, stored_task_spec(ckpt), data_path)
    return batch
