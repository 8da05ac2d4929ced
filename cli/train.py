"""`hookmech train`."""

from __future__ import annotations

import json

import click

from .common import (
    CONTEXT,
    OutputPath,
    check_device,
    device_option,
    refuse_overwriting_inputs,
    require_at_least,
    require_name,
    set_threads,
    split_flag,
    threads_option,
)

# hookmech's modules (and torch) are imported inside the commands: `hookmech --help` loads neither


@click.command(context_settings=CONTEXT)
@click.option(
    "--task", "task_name", default=None, help="task name: ar, mqar, atr (default ar; with --data, the file's)"
)
@click.option("--task-opt", multiple=True, metavar="K=V", help="task option (repeatable), e.g. vocab_size=64")
@click.option(
    "--mixer",
    default=None,
    help="mixer name (registered, path/to/file.py:Class, module:Class or an entry point of group hookmech.mixers), "
    "or a comma list (one per layer); default attention",
)
@click.option(
    "--preset", default=None, help="a paper's model as a per-layer pattern (based, baseconv, ...; see docs/guide.md)"
)
@click.option(
    "--mixer-opt", multiple=True, metavar="[L0.]K=V", help="mixer option for all layers, or L{l}.K=V for one layer"
)
@click.option("--d-model", type=int, default=64, show_default=True)
@click.option("--n-layers", type=int, default=2, show_default=True)
@click.option("--n-heads", type=int, default=1, show_default=True, help="heads of mixers that have heads")
@click.option("--mlp/--no-mlp", default=None, help="MLP in each block (default: what the mixer declares)")
@click.option("--tie-embeddings/--no-tie-embeddings", default=True, show_default=True)
@click.option(
    "--pos-emb",
    type=click.Choice(["learned", "none"]),
    default=None,
    help="default: learned for attention, none otherwise",
)
@click.option(
    "--init",
    type=click.Choice(["normal", "mamba", "normal-by-name", "zoology"]),
    default=None,
    help="weight init: normal (default: every Linear N(0, 0.02)), mamba (mamba-ssm's), normal-by-name "
    "(zoology's: output projections scaled only where zoology's names match, not Based's), or zoology "
    "(what the paper's code draws: mamba for a Mamba model, normal-by-name or normal otherwise)",
)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--warmup-frac", type=float, default=0.1, show_default=True)
@click.option("--epochs", type=int, default=None, help="epochs over the training set (default 16)")
@click.option("--steps", type=int, default=None, help="optimizer steps (instead of --epochs)")
@click.option(
    "--n-train", type=int, default=None, help="training set size (default 100,032); 0 = fresh documents every step"
)
@click.option(
    "--data",
    "data_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="training set from a dataset file (hookmech data ... -o FILE); the task is the file's",
)
@click.option("--n-dev", type=int, default=320, show_default=True)
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eval-every", type=int, default=200, show_default=True)
@click.option("--ckpt-every", type=int, default=1000, show_default=True)
@click.option(
    "--order",
    type=click.Choice(["shuffled", "fixed"]),
    default="shuffled",
    show_default=True,
    help="how the training set is replayed: a new order every epoch, or the same batches in the same "
    "order every epoch (paper 000's code)",
)
@click.option(
    "--schedule",
    type=click.Choice(["cosine", "hf-cosine", "hf-linear"]),
    default="cosine",
    show_default=True,
    help="learning-rate schedule: cosine warms up at lr·(t+1)/W over W = round(warmup-frac·T) steps; "
    "hf-cosine is Hugging Face's get_cosine_schedule_with_warmup as paper 000's code calls it "
    "(lr·t/W over W = int(warmup-frac·T) steps: step 0 at lr 0), then both decay to 0 by cosine; "
    "hf-linear is its get_linear_schedule_with_warmup (the same warm-up, then a linear decay to 0)",
)
@click.option(
    "--length-groups",
    type=int,
    default=1,
    show_default=True,
    help="run each batch as this many groups of rows of similar length, each cut to its longest row: "
    "the same loss without the padding's compute (long, ragged documents)",
)
@click.option(
    "--mech-every",
    type=int,
    default=None,
    metavar="K",
    help="measure attributions every K steps (a multiple of --eval-every; default: every second "
    "evaluation when --mech-site/--mech-pos is given) and log them to metrics.jsonl",
)
@click.option("--mech-site", "mech_sites", multiple=True, help="site(s) for --mech-every (default L1.block_in)")
@click.option(
    "--mech-pos", "mech_positions", multiple=True, help="position(s) for --mech-every (default key,value,query)"
)
@device_option
@threads_option
@click.option("-o", "--out", "out_dir", required=True, type=OutputPath(file_okay=False), help="run folder")
def train(**options):
    """Train a model on a task; resumable, deterministic; writes OUT/model.safetensors."""
    from hookmech.errors import UsageError
    from hookmech.mixers.allow_list import plug_ins
    from hookmech.training import RUN_FILES
    from hookmech.training import train as run_training

    if options["epochs"] is not None and options["steps"] is not None:
        raise UsageError("give --epochs or --steps, not both")
    _check_options(options)
    out_dir, data_path = options["out_dir"], options["data_path"]
    refuse_overwriting_inputs(
        [("-o", out_dir), *(("-o", f"{out_dir}/{name}") for name in RUN_FILES)], [("--data", data_path)]
    )
    task, train_set, train_set_sha256 = _task_and_training_set(options)
    train_config = _train_config(options, n_train=len(train_set) if train_set is not None else options["n_train"])
    model_config = _model_config(options, task)
    set_threads(options["threads"])
    on_eval = _mech_on_eval(task, model_config, train_config, options)
    summary = run_training(
        task,
        model_config,
        train_config,
        out_dir,
        device=check_device(options["device"]),
        train_set=train_set,
        train_set_sha256=train_set_sha256,
        on_eval=on_eval,
    )
    for name in plug_ins(model_config.mixers):  # the name the checkpoint records, resolved: loading it names it
        click.echo(f"hookmech: note: the checkpoint records mixer {name} (load it with --allow-mixer {name})", err=True)
    click.echo(json.dumps(summary, sort_keys=True))


def _task_and_training_set(options):
    """Return (task, training batch or None, the dataset file's sha256 or None): the task of
    --task/--task-opt, or a dataset file's (--data) with its rows."""
    from hookmech import tasks
    from hookmech.option_pairs import parse_options

    task_options = parse_options(options["task_opt"], "--task-opt")
    if options["data_path"] is None:
        return tasks.make(options["task_name"] or "ar", **task_options), None, None
    return _read_training_set(options["data_path"], options["task_name"], task_options, options["n_train"])


def _train_config(options, n_train):
    """Return the `TrainConfig` of the command's options (`n_train` None: the paper's 100,032)."""
    from hookmech.training import TrainConfig

    steps, epochs = options["steps"], options["epochs"]
    return TrainConfig(
        lr=options["lr"],
        warmup_frac=options["warmup_frac"],
        epochs=None if steps is not None else (16 if epochs is None else epochs),
        steps=steps,
        n_train=100_032 if n_train is None else n_train,
        n_dev=options["n_dev"],
        batch_size=options["batch_size"],
        seed=options["seed"],
        eval_every=options["eval_every"],
        ckpt_every=options["ckpt_every"],
        order=options["order"],
        schedule=options["schedule"],
        length_groups=options["length_groups"],
    )


def _model_config(options, task):
    """Return the validated `ModelConfig` of the command's model options, sized for `task`."""
    from hookmech.config import build_config

    mixers, layer_options = _mixers_and_options(
        options["mixer"], options["preset"], options["mixer_opt"], options["n_layers"]
    )
    return build_config(
        d_vocab=task.d_vocab,
        n_ctx=task.n_ctx,
        mixers=mixers,
        d_model=options["d_model"],
        n_layers=options["n_layers"],
        layer_options=layer_options,
        n_heads=options["n_heads"],
        mlp=options["mlp"],
        tie_embeddings=options["tie_embeddings"],
        pos_emb=options["pos_emb"],
        init=options["init"],
    )


#: the count options of `train` and their least value (--n-train 0 means fresh documents)
_COUNTS = {
    "--d-model": ("d_model", 1),
    "--n-layers": ("n_layers", 1),
    "--n-heads": ("n_heads", 1),
    "--epochs": ("epochs", 1),
    "--steps": ("steps", 1),
    "--n-train": ("n_train", 0),
    "--n-dev": ("n_dev", 1),
    "--batch-size": ("batch_size", 1),
    "--eval-every": ("eval_every", 1),
    "--ckpt-every": ("ckpt_every", 1),
    "--length-groups": ("length_groups", 1),
    "--mech-every": ("mech_every", 1),
    "--threads": ("threads", 1),
}


def _check_options(options) -> None:
    """Refuse, before anything is built, counts below their least value, empty names and a seed
    torch cannot take, naming the option (`options`: the command's arguments by name)."""
    from hookmech.schema import SEED

    for flag, (name, minimum) in _COUNTS.items():
        require_at_least(flag, options[name], minimum)
    for flag, name in (("--task", "task_name"), ("--mixer", "mixer"), ("--preset", "preset")):
        require_name(flag, options[name])
    SEED.check("--seed", options["seed"])


def _mixers_and_options(mixer, preset, mixer_opt, n_layers):
    """Return (mixer per layer, options per layer): a preset's pattern, with --mixer-opt on top."""
    from hookmech.errors import UsageError
    from hookmech.model_presets import expand_preset
    from hookmech.option_pairs import parse_layer_options

    user_options = parse_layer_options(mixer_opt, n_layers)
    if preset is None:
        return split_flag([mixer or "attention"]), user_options
    if mixer is not None:
        raise UsageError("give --mixer or --preset, not both")
    mixers, preset_options = expand_preset(preset, n_layers)
    return mixers, [{**own, **user} for own, user in zip(preset_options, user_options, strict=True)]


def _read_training_set(path, task_name, task_options, n_train):
    """Return (task, training batch, file sha256) of a dataset file, refusing a --task,
    --task-opt or --n-train that disagrees with the file."""
    from hookmech import tasks
    from hookmech.datasets import load_dataset
    from hookmech.errors import UsageError
    from hookmech.fileio import sha256_of

    task, batch = load_dataset(path)
    if task_name is not None and task_name != task.name:
        raise UsageError(f"--task {task_name} disagrees with {path}, which holds task {task.name!r}")
    if task_options:
        file_options = {key: value for key, value in task.spec.items() if key != "name"}
        asked = tasks.make(task.name, **{**file_options, **task_options}).spec
        differ = [key for key in task_options if asked.get(key) != task.spec.get(key)]
        if differ:
            raise UsageError(
                f"--task-opt disagrees with {path}: "
                + ", ".join(f"{key}={asked.get(key)!r} (file: {task.spec.get(key)!r})" for key in differ)
            )
    if n_train is not None and n_train != len(batch):
        raise UsageError(f"--n-train {n_train} disagrees with {path}, which holds {len(batch)} rows")
    return task, batch, sha256_of(path)


def _mech_on_eval(task, model_config, train_config, options):
    """Return the trainer's on_eval for --mech-every/--mech-site/--mech-pos, or None when none is given."""
    every, sites, positions = options["mech_every"], options["mech_sites"], options["mech_positions"]
    if every is None and not sites and not positions:
        return None
    from hookmech.mech import DEFAULT_EVERY_EVALS, DEFAULT_POSITIONS, DEFAULT_SITES, mech_callback

    return mech_callback(
        task,
        model_config,
        sites=split_flag(sites) or DEFAULT_SITES,
        positions=split_flag(positions) or DEFAULT_POSITIONS,
        every=DEFAULT_EVERY_EVALS * train_config.eval_every if every is None else every,
        eval_every=train_config.eval_every,
        total_steps=train_config.total_steps(),
        n=train_config.n_dev,
        seed=train_config.seed,
        device=options["device"],
    )
