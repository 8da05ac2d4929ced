"""`hookmech inspect` and `probe`: looking at a cache file without loading a model."""

from __future__ import annotations

import json

import click

from .common import CONTEXT, DEFAULT_MEMORY_MIB, memory_option, set_threads, threads_option

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither


@click.command(context_settings=CONTEXT)
@click.argument("cache_path", metavar="CACHE", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of text")
@memory_option
def inspect(cache_path, as_json, memory=DEFAULT_MEMORY_MIB):
    """Print what an activation cache holds: N, model hash, task, roles, p(answer) means, sites and shapes."""
    from hookmech.cache import CacheFile
    from hookmech.row_chunks import memory_bytes
    from hookmech.tables import format_table

    limit = memory_bytes(memory)
    with CacheFile(cache_path) as cache:
        summary = cache.summary(limit)
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    model = summary["model"]
    mixers = model.get("mixers") or []
    lines = [
        f"cache      {summary['path']} (format v{summary['format_version']}, hookmech {summary['hookmech_version']})",
        f"examples   N={summary['n']}, T={summary['n_pos']}",
        f"model      model_hash {summary['model_hash'] or '- (older cache)'}, "
        + (f"folder {summary['model_source']}; " if summary["model_source"] else "")
        + f"file sha256 {summary['model_sha256'] or '-'}; "
        f"{','.join(dict.fromkeys(mixers)) or '?'} d_model={model.get('d_model')} n_layers={model.get('n_layers')}",
        f"task       {json.dumps(summary['task'], sort_keys=True)}",
        f"roles      {', '.join(summary['roles'])}",
        f"p(answer)  clean {summary['p_clean']:.4f}, corrupt {summary['p_corrupt']:.4f}",
        "",
    ]
    rows = [
        [
            s["site"],
            s["hook"],
            "+".join(s["runs"]),
            "[" + ", ".join(map(str, s["shape"])) + "]",
            s["dtype"],
            s["compression"] or "-",
        ]
        for s in summary["sites"]
    ]
    click.echo("\n".join(lines) + format_table(["site", "hook", "runs", "shape", "dtype", "compression"], rows))


@click.command(context_settings=CONTEXT)
@click.argument("cache_path", metavar="CACHE", type=click.Path(dir_okay=False))
@click.option("--site", required=True, help="cached site (L1.block_in) or hook name")
@click.option("--pos", required=True, help="position: a role (key, value, query, divider) or an integer")
@click.option(
    "--target", type=click.Choice(["key", "value", "answer"]), default="key", show_default=True, help="token to decode"
)
@click.option("--which", type=click.Choice(["clean", "corrupt"]), default="clean", show_default=True, help="which run")
@click.option("--heldout", type=float, default=0.25, show_default=True, help="fraction of documents held out")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the train/held-out split")
@click.option("--weight-decay", type=float, default=1e-3, show_default=True, help="L2 penalty of the probe")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@memory_option
@threads_option
def probe(cache_path, site, pos, target, which, heldout, seed, weight_decay, as_json, memory, threads):
    """Fit a linear probe decoding a token from a cached activation; report held-out accuracy and chance."""
    from hookmech.cache import CacheFile
    from hookmech.probe import fit_probe
    from hookmech.row_chunks import check_memory

    check_memory(memory)
    set_threads(threads)
    with CacheFile(cache_path) as cache:
        result = fit_probe(
            cache,
            site,
            pos,
            target=target,
            which=which,
            heldout_frac=heldout,
            seed=seed,
            weight_decay=weight_decay,
            memory=memory,
        )
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    click.echo(
        f"{result.site} at {result.pos} -> {result.target} ({result.which} run): held-out accuracy "
        f"{result.heldout_accuracy:.3f} (chance {result.chance:.3f}, train {result.train_accuracy:.3f}; "
        f"{result.n_classes} tokens, {result.n_train} train / {result.n_heldout} held-out rows, "
        f"{result.d_features} features)"
    )
