"""`hookmech train`."""
from __future__ import annotations

import json

import click

from .common import CONTEXT, check_device, device_option, set_threads, split_flag, threads_option


@click.command(context_settings=CONTEXT)
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
        d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=split_flag([mixer]), d_model=d_model, n_layers=n_layers,
        layer_options=parse_layer_options(mixer_opt, n_layers), n_heads=n_heads, mlp=mlp,
        tie_embeddings=tie_embeddings, pos_emb=pos_emb,
    )
    set_threads(threads)
    summary = run_training(task, model_config, train_config, out_dir, device=check_device(device))
    click.echo(json.dumps(summary, sort_keys=True))
