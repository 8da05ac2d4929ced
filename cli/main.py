"""`hookmech` commands. Imports of torch and the library happen inside each command, so
`hookmech --help` stays instant. Errors become one line on stderr and a non-zero exit."""
from __future__ import annotations

import json
import os
import sys

import click

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _list(values) -> list[str]:
    from hookmech.options import split_list

    return split_list(values)


def _set_threads(threads: int | None) -> None:
    import torch

    if threads is not None:
        if threads < 1:
            from hookmech.errors import UsageError

            raise UsageError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def _check_device(device: str) -> str:
    import torch

    from hookmech.errors import UsageError

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device {device!r} (try cpu or cuda)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here")
    return device


device_option = click.option("--device", default="cpu", show_default=True, help="torch device to run on")
threads_option = click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="hookmech")
def cli() -> None:
    """Mechanistic evaluation of sequence models on in-context recall tasks.

    Train small models (train), list their hook sites (sites), cache activations (cache),
    and measure where the answer's information flows with interchange interventions (patch).
    """


@cli.command(context_settings=CONTEXT)
@click.option("--task", "task_name", default="ar", show_default=True, help="task name (ar)")
@click.option("--task-opt", multiple=True, metavar="K=V", help="task option (repeatable), e.g. vocab_size=64")
@click.option("--mixer", default="attention", show_default=True, help="mixer name, or a comma list (one per layer)")
@click.option("--mixer-opt", multiple=True, metavar="[L0.]K=V", help="mixer option for all layers, or L{l}.K=V for one layer")
@click.option("--d-model", type=int, default=64, show_default=True)
@click.option("--n-layers", type=int, default=2, show_default=True)
@click.option("--n-heads", type=int, default=1, show_default=True, help="heads of mixers that have heads")
@click.option("--mlp/--no-mlp", default=None, help="MLP in each block (default: what the mixer declares)")
@click.option("--tie-embeddings/--no-tie-embeddings", default=True, show_default=True)
@click.option("--pos-emb", type=click.Choice(["learned", "none"]), default=None, help="default: learned for attention, none otherwise")
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--warmup-frac", type=float, default=0.1, show_default=True)
@click.option("--epochs", type=int, default=None, help="epochs over the training set (default 16)")
@click.option("--steps", type=int, default=None, help="optimizer steps (instead of --epochs)")
@click.option("--n-train", type=int, default=100_032, show_default=True, help="training set size; 0 = fresh documents every step")
@click.option("--n-dev", type=int, default=320, show_default=True)
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eval-every", type=int, default=200, show_default=True)
@click.option("--ckpt-every", type=int, default=1000, show_default=True)
@device_option
@threads_option
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="run folder")
def train(task_name, task_opt, mixer, mixer_opt, d_model, n_layers, n_heads, mlp, tie_embeddings, pos_emb, lr,
          warmup_frac, epochs, steps, n_train, n_dev, batch_size, seed, eval_every, ckpt_every, device, threads, out_dir):
    """Train a model on a task; resumable, deterministic; writes OUT/model.safetensors."""
    from hookmech import tasks
    from hookmech.config import build_config
    from hookmech.errors import UsageError
    from hookmech.options import parse_layer_options, parse_options
    from hookmech.training import TrainConfig
    from hookmech.training import train as run_training

    if epochs is not None and steps is not None:
        raise UsageError("give --epochs or --steps, not both")
    if d_model <= 0 or n_layers <= 0 or n_heads <= 0:
        raise UsageError("--d-model, --n-layers and --n-heads must be > 0")
    task = tasks.make(task_name, **parse_options(task_opt, "--task-opt"))
    train_config = TrainConfig(lr=lr, warmup_frac=warmup_frac, epochs=None if steps is not None else (epochs or 16),
                               steps=steps, n_train=n_train, n_dev=n_dev, batch_size=batch_size, seed=seed,
                               eval_every=eval_every, ckpt_every=ckpt_every)
    model_config = build_config(
        d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=_list([mixer]), d_model=d_model, n_layers=n_layers,
        layer_options=parse_layer_options(mixer_opt, n_layers), n_heads=n_heads, mlp=mlp,
        tie_embeddings=tie_embeddings, pos_emb=pos_emb,
    )
    _set_threads(threads)
    summary = run_training(task, model_config, train_config, out_dir, device=_check_device(device))
    click.echo(json.dumps(summary, sort_keys=True))


@cli.command(context_settings=CONTEXT)
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


def _load_model_and_task(ckpt: str, device: str):
    from hookmech.checkpoint import load
    from hookmech.tasks import from_checkpoint

    return load(ckpt, device=_check_device(device)), from_checkpoint(ckpt)


@cli.command(context_settings=CONTEXT)
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
    _set_threads(threads)
    model, task = _load_model_and_task(ckpt, device)
    hooks = resolve_sites(_list(site_specs) or ["all"], model.hook_dict)
    batch = task.sample(n, seed=seed)
    with _progress(n, "caching") as advance:
        write_cache(model, batch, out_path, hooks, model_sha256=sha256_of(ckpt), task_spec=task.spec,
                    dtype=dtype, compression=None if compression == "none" else compression, progress=advance)
    click.echo(f"wrote {out_path}: {len(hooks)} sites x {n} examples (clean and corrupt)")


@cli.command(context_settings=CONTEXT)
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
    _set_threads(threads)
    model, task = _load_model_and_task(ckpt, device)
    if cache_path is not None:
        source = CacheFile(cache_path)
        if source.model_sha256 != sha256_of(ckpt):
            source.close()
            raise HookmechError(f"{cache_path} was made from another checkpoint (model_sha256 differs from {ckpt})")
    else:
        source = task.sample(n, seed=seed)
    try:
        records = run_patch(model, source, _list(site_specs), _list(pos_specs), method=method, threshold=threshold,
                            max_batch=max_batch, per_example=per_example is not None)
    finally:
        if cache_path is not None:
            source.close()
    if per_example is not None:
        write_text_atomic(per_example, json.dumps(records) + "\n")
        for record in records:
            record.pop("p_patched_rows")
    click.echo(json.dumps(records, indent=1) if as_json else format_records(records))


@cli.command(context_settings=CONTEXT)
@click.option("--fixtures", type=click.Path(file_okay=False), default=None, help="fixtures folder (default: the repository's)")
@threads_option
def demo(fixtures, threads):
    """Run the paper's mechanistic evaluation on the bundled fixture checkpoints."""
    from hookmech.demo import run_demo

    _set_threads(threads)
    run_demo(fixtures, out=click.echo)


class _progress:
    """A tqdm bar on a terminal, nothing otherwise; yields an `advance(n)` callback."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.bar = total, label, None

    def __enter__(self):
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.label, unit="ex", file=sys.stderr)
            return self.bar.update
        return lambda n: None

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def _fail(message: str, code: int) -> None:
    click.echo(f"hookmech: error: {message}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning every error into one line on stderr and an exit code
    (2 for usage errors, 1 otherwise). Set HOOKMECH_DEBUG=1 for tracebacks."""
    try:
        cli.main(args=argv, standalone_mode=False, prog_name="hookmech")
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.exceptions.Abort:
        _fail("aborted", 130)
    except click.ClickException as error:
        message = error.format_message().replace("\n", " ")
        context = getattr(error, "ctx", None)
        if context is not None and isinstance(error, click.UsageError):
            message += f" (see '{context.command_path} --help')"
        _fail(message, 2 if isinstance(error, click.UsageError) else 1)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as error:  # the one place that turns any failure into one line
        if os.environ.get("HOOKMECH_DEBUG"):
            raise
        from hookmech.errors import HookmechError

        if isinstance(error, HookmechError):
            _fail(str(error).replace("\n", " "), error.exit_code)
        _fail(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
              "(unexpected; rerun with HOOKMECH_DEBUG=1 for a traceback)", 1)


if __name__ == "__main__":
    main()
