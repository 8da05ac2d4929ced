"""`hookmech das`: distributed alignment search at one (site, position), from an activation cache."""

from __future__ import annotations

from pathlib import Path

import click

from .common import (
    CKPT_HELP,
    CONTEXT,
    OutputPath,
    allow_mixer_option,
    ckpt_path,
    device_option,
    load_model,
    memory_option,
    progress,
    refuse_overwriting_inputs,
    set_threads,
    split_flag,
    to_json,
    verify_cache_option,
)

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither


@click.command(context_settings=CONTEXT)
@allow_mixer_option
@click.option("--ckpt", required=True, type=ckpt_path, help=CKPT_HELP)
@click.option(
    "--cache",
    "cache_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="activation cache of this checkpoint holding the site's clean activations",
)
@verify_cache_option
@click.option("--site", required=True, help="one site with a position axis (L1.block_in, L0.mixer.ssm_state)")
@click.option("--pos", required=True, help="one position per row: a role (key, value, query) or an integer")
@click.option("--dim", "dim_specs", multiple=True, help="subspace dimensions K to learn (repeatable, comma lists)")
@click.option("--boundless", is_flag=True, help="Boundless DAS: learn the dimension (a rotation and a boundary)")
@click.option("--steps", type=int, default=200, show_default=True, help="Adam steps per dimension")
@click.option("--lr", type=float, default=1e-2, show_default=True, help="Adam learning rate of the basis")
@click.option("--batch-size", type=int, default=64, show_default=True, help="training rows per step")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the split, bases and data order")
@click.option("--json", "as_json", is_flag=True, help="print the records as one JSON array")
@memory_option
@device_option
@click.option(
    "--threads",
    type=int,
    default=None,
    help="torch CPU threads for loading the model and checking the cache (default: torch's); the search itself "
    "computes on one, so that its numbers do not depend on the thread count",
)
@click.option(
    "-o", "--out", "out_dir", required=True, type=OutputPath(), help="folder for records.json and bases.safetensors"
)
def das(
    ckpt,
    cache_path,
    site,
    pos,
    dim_specs,
    boundless,
    steps,
    lr,
    batch_size,
    seed,
    as_json,
    memory,
    device,
    threads,
    out_dir,
    verify_cache=True,
):
    """Distributed alignment search: learn the subspace of an activation that carries the answer.

    For each --dim K, an orthonormal basis Q [d, K] of the activation at SITE and POS is trained so
    that the corrupt run with x -> x + Q Q^T (x_clean - x) predicts the clean answer; it is scored
    on held-out documents (interchange-intervention accuracy, attribution) against a random basis
    of the same K and the whole activation's interchange. Writes records.json and bases.safetensors
    into -o.
    """
    from hookmech.cache import CacheFile
    from hookmech.das import train
    from hookmech.locking import folder_lock
    from hookmech.validate import check_finite_parameters

    dims = _check_options(ckpt, cache_path, dim_specs, boundless, steps, lr, batch_size, seed, memory, out_dir)
    out = Path(out_dir)
    # two runs into one folder would mix their records and bases: one at a time, as train's run folders
    with folder_lock(out, "das folder"):
        set_threads(threads)
        model = load_model(ckpt, device)
        check_finite_parameters(model, ckpt)
        with CacheFile(cache_path, verify=verify_cache) as cache:
            # the one identity check; the checkpoint file checks an older cache without model_hash
            cache.check_model(model, checkpoint=ckpt, hooks=())
            total = steps * (1 if boundless else len(dims or []))
            with progress(total, "das", unit="step") as advance:
                result = train(
                    model,
                    cache,
                    site,
                    pos,
                    dims,
                    boundless=boundless,
                    steps=steps,
                    lr=lr,
                    batch_size=batch_size,
                    seed=seed,
                    memory=memory,
                    progress=advance,
                )
        result.save(out)
    _print_result(result, out, steps, as_json)


def _check_options(ckpt, cache_path, dim_specs, boundless, steps, lr, batch_size, seed, memory, out_dir):
    """Return the --dim values (None with --boundless); raise a UsageError for a missing or doubled
    choice of dimensions, a search option out of range, or an -o that is a file or an input."""
    from hookmech.das import BASES_FILE, RECORDS_FILE, DasOptions
    from hookmech.errors import UsageError
    from hookmech.row_chunks import check_memory

    dims = _parse_dims(split_flag(dim_specs)) if dim_specs else None
    if dims is not None and boundless:
        raise UsageError("give the subspace dimensions (--dim) or --boundless, not both")
    if dims is None and not boundless:
        raise UsageError("give the subspace dimensions to learn (--dim K[,K...]) or --boundless")
    DasOptions(steps=steps, lr=lr, batch_size=batch_size, seed=seed)  # checks them before anything is loaded
    check_memory(memory)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out_dir} is a file; das writes a folder (records.json, bases.safetensors)")
    refuse_overwriting_inputs(
        [("-o", out_dir), ("-o", str(out / RECORDS_FILE)), ("-o", str(out / BASES_FILE))],
        [("--ckpt", ckpt), ("--cache", cache_path)],
    )
    return dims


def _print_result(result, out, steps: int, as_json: bool) -> None:
    """Print the records (JSON, or a table with a heading) and where they were written."""
    from hookmech.das import BASES_FILE, RECORDS_FILE
    from hookmech.tables import format_table

    if as_json:
        click.echo(to_json(result.records, indent=1))
        return
    columns = ["dim", "iia", "iia_random", "iia_full", "attribution", "attribution_random", "attribution_full"]
    headers = ["K", "IIA", "IIA random", "IIA full", "attrib", "attrib random", "attrib full"]
    first = result.records[0]
    click.echo(f"{first['site']} at {first['pos']} (d = {first['d']}, {first['n_dev']} dev rows, {steps} steps)")
    click.echo(format_table(headers, [[record[c] for c in columns] for record in result.records]))
    click.echo(f"wrote {out / RECORDS_FILE} and {out / BASES_FILE}")


def _parse_dims(specs: list[str]) -> list[int]:
    """The integers of --dim values; a UsageError naming a value that is not one."""
    from hookmech.errors import UsageError

    dims = []
    for spec in specs:
        try:
            dims.append(int(spec))
        except ValueError:
            raise UsageError(f"--dim takes integers (subspace dimensions), got {spec!r}") from None
    return dims
