"""`hookmech sites`, `cache` and `patch`: looking inside a trained model."""
from __future__ import annotations

import json

import click

from .common import CONTEXT, device_option, load_model_and_task, progress, set_threads, split_flag, threads_option


@click.command(context_settings=CONTEXT)
@click.option("--ckpt", required=True, type=click.Path(dir_okay=False), help="checkpoint (.safetensors)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def sites(ckpt, as_json):
    """List every hook site of a checkpoint's model with its hook name and shape."""
    from hookmech.checkpoint import load
    from hookmech.sites import list_sites
    from hookmech.tables import format_table

    rows = list_sites(load(ckpt))
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    click.echo(format_table(["site", "hook", "shape", "axes", "pos axis"],
                            [[r["site"], r["hook"], "[" + ", ".join(map(str, r["shape"])) + "]", r["axes"],
                              "-" if r["pos_axis"] is None else r["pos_axis"]] for r in rows]))


@click.command(context_settings=CONTEXT)
@click.option("--ckpt", required=True, type=click.Path(dir_okay=False))
@click.option("--n", type=int, default=320, show_default=True, help="number of examples")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the examples")
@click.option("--sites", "site_specs", multiple=True, help="sites to store (default: all block-level sites)")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True)
@click.option("--compression", type=click.Choice(["none", "gzip", "lzf"]), default="none", show_default=True)
@device_option
@threads_option
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False))
def cache(ckpt, n, seed, site_specs, dtype, compression, device, threads, out_path):
    """Cache clean and corrupt activations of a checkpoint on task examples (HDF5)."""
    from hookmech.cache import write_cache
    from hookmech.errors import UsageError
    from hookmech.fileio import sha256_of
    from hookmech.sites import resolve_sites

    if n < 1:
        raise UsageError(f"--n must be >= 1, got {n}")
    set_threads(threads)
    model, task = load_model_and_task(ckpt, device)
    hooks = resolve_sites(split_flag(site_specs) or ["all"], model.hook_dict)
    batch = task.sample(n, seed=seed)
    with progress(n, "caching") as advance:
        write_cache(model, batch, out_path, hooks, model_sha256=sha256_of(ckpt), task_spec=task.spec,
                    dtype=dtype, compression=None if compression == "none" else compression, progress=advance)
    click.echo(f"wrote {out_path}: {len(hooks)} sites x {n} examples (clean and corrupt)")


@click.command(context_settings=CONTEXT)
@click.option("--ckpt", required=True, type=click.Path(dir_okay=False))
@click.option("--site", "site_specs", multiple=True, required=True, help="site or pattern (repeatable, comma lists)")
@click.option("--pos", "pos_specs", multiple=True, required=True, help="position: role, integer, all, whole, a+b")
@click.option("--cache", "cache_path", type=click.Path(dir_okay=False), default=None, help="activation cache of this checkpoint")
@click.option("--n", type=int, default=320, show_default=True, help="examples, without --cache")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the examples, without --cache")
@click.option("--method", type=click.Choice(["exact"]), default="exact", show_default=True)
@click.option("--threshold", type=float, default=0.01, show_default=True, help="filter: p_clean - p_corrupt must exceed it")
@click.option("--max-batch", type=int, default=1024, show_default=True, help="rows per forward pass")
@click.option("--json", "as_json", is_flag=True, help="print one JSON array")
@click.option("--per-example", type=click.Path(dir_okay=False), default=None, help="also write per-row p_patched to this JSON file")
@device_option
@threads_option
def patch(ckpt, site_specs, pos_specs, cache_path, n, seed, method, threshold, max_batch, as_json, per_example, device, threads):
    """Interchange interventions: patch clean activations into the corrupt run, per site x position."""
    from hookmech.cache import CacheFile
    from hookmech.errors import HookmechError, UsageError
    from hookmech.fileio import sha256_of, write_text_atomic
    from hookmech.patching import patch as run_patch
    from hookmech.tables import format_records

    if n < 1:
        raise UsageError(f"--n must be >= 1, got {n}")
    set_threads(threads)
    model, task = load_model_and_task(ckpt, device)
    if cache_path is not None:
        source = CacheFile(cache_path)
        if source.model_sha256 != sha256_of(ckpt):
            source.close()
            raise HookmechError(f"{cache_path} was made from another checkpoint (model_sha256 differs from {ckpt})")
    else:
        source = task.sample(n, seed=seed)
    try:
        records = run_patch(model, source, split_flag(site_specs), split_flag(pos_specs), method=method, threshold=threshold,
                            max_batch=max_batch, per_example=per_example is not None)
    finally:
        if cache_path is not None:
            source.close()
    if per_example is not None:
        write_text_atomic(per_example, json.dumps(records) + "\n")
        for record in records:
            record.pop("p_patched_rows")
    click.echo(json.dumps(records, indent=1) if as_json else format_records(records))
