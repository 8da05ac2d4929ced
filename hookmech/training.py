"""The trainer (docs/guide.md §4): AdamW, linear warm-up + cosine decay to 0, loss on the answer only.

A run lives in one folder::

    run.json              what was asked (model config, task spec, trainer options)
    model.safetensors     the latest weights (a normal hookmech checkpoint; only finite ones)
    resume.safetensors    weights + optimizer moments + step, written atomically together
    metrics.jsonl         one JSON object per evaluation (each step once, also after a resume)
    summary.json          written last: the run is finished
    .lock                 while a process trains into the folder: its PID (`hookmech.locking`)

The folder is locked while a process trains into it: a second `train` into it fails at once,
naming the PID that holds it. run.json is written once the model and the data are built, and
it claims the folder (a rerun with other options is refused) only once the folder holds
training done (a checkpoint, metrics or a summary): a run that fails before then leaves the
folder free.

Training data is a pure function of (seed, step): a fixed training set sampled once with
seed (seed, 0) — or given (``train(train_set=...)``, e.g. read from a dataset file; its
SHA-256 is part of run.json) — and replayed in a per-epoch order drawn from (seed, 3, epoch),
or, with ``n_train=0``, fresh documents drawn from (seed, 2, step). So a killed run resumed
from its last checkpoint ends with exactly the weights of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.nn import functional as F

from . import schema
from .allocator import keep_freed_memory
from .cache import answer_probs, run_chunks
from .checkpoint import read_metadata, save
from .config import ModelConfig
from .datasets import check_batch
from .devices import check_device
from .errors import HookmechError, UsageError
from .fileio import atomic_path, disk_full_as_error, read_json, write_text_atomic
from .locking import folder_lock
from .model import HookedLM
from .progress import RunProgress, reporter
from .sizes import check_fits
from .tasks import Task
from .tasks.ar import rng_for
from .tasks.batch import Batch
from .validate import first_non_finite_tensor

#: the files `train` writes into a run folder
RUN_FILES = ("run.json", "model.safetensors", "resume.safetensors", "metrics.jsonl", "summary.json")

# seed streams: independent documents for each purpose
_TRAIN_SET, _DEV_SET, _FRESH, _EPOCH_ORDER = 0, 1, 2, 3


#: how a fixed training set is replayed (`TrainConfig.order`): "shuffled" draws a new order every
#: epoch from (seed, epoch); "fixed" takes batch k = rows [k·B, (k+1)·B) in every epoch, as
#: paper 000's code does (tinylang's training loop takes batch ``step % 3126`` of its set)
ORDERS = ("shuffled", "fixed")

#: learning-rate schedules (`TrainConfig.schedule`, `learning_rate`): "cosine" warms up over
#: round(warmup_frac·T) steps at lr·(t+1)/W; "hf-cosine" is Hugging Face's
#: `get_cosine_schedule_with_warmup` as paper 000's code calls it (tinylang `experiment.py`):
#: W = int(warmup_frac·T) steps at lr·t/W, so step 0 runs at lr 0 — one step behind "cosine";
#: "hf-linear" is its `get_linear_schedule_with_warmup`, the same warm-up then a linear decay to 0,
#: which that code uses unless a config says `cosine: true` (its §5.3 runs, `pcfg_gen`)
SCHEDULES = ("cosine", "hf-cosine", "hf-linear")

#: rows per evaluation chunk of a run with length groups (`_Run.evaluate`): at ATR's L_max 10 its
#: 320 dev documents sorted by length take 0.2-0.4 s in chunks of 16 against 4 s padded as one
#: chunk, which was a fifth of the run (docs/performance.md)
RAGGED_EVAL_ROWS = 16

#: what each trainer option may be (`TrainConfig` checks them; sweep files are checked against them)
TRAIN_FIELDS: dict[str, schema.Field] = {
    "lr": schema.number(0, above=True),
    "warmup_frac": schema.number(0, 1),
    "epochs": schema.COUNT,
    "steps": schema.COUNT,
    "n_train": schema.integer(0),
    "n_dev": schema.COUNT,
    "batch_size": schema.COUNT,
    "seed": schema.SEED,
    "eval_every": schema.COUNT,
    "ckpt_every": schema.COUNT,
    "order": schema.name("an order", choices=ORDERS),
    "schedule": schema.name("a schedule", choices=SCHEDULES),
    "length_groups": schema.COUNT,
}


@dataclass(frozen=True)
class TrainConfig:
    """Trainer options (defaults: the paper's recipe, docs/guide.md §4)."""

    lr: float = 1e-3
    warmup_frac: float = 0.1
    epochs: int | None = 16
    steps: int | None = None
    n_train: int = 100_032
    n_dev: int = 320
    batch_size: int = 32
    seed: int = 0
    eval_every: int = 200
    ckpt_every: int = 1000
    #: how the fixed training set is replayed (ORDERS); left out of run.json when "shuffled", so
    #: run folders written before the option existed still resume
    order: str = "shuffled"
    #: the learning-rate schedule (SCHEDULES); left out of run.json when "cosine", as `order`
    schedule: str = "cosine"
    #: each batch runs as this many groups of rows of similar length, each cut to its longest row
    #: (`answer_loss`); left out of run.json when 1, as `order`
    length_groups: int = 1

    def __post_init__(self) -> None:
        for name, field in TRAIN_FIELDS.items():
            value = getattr(self, name)
            if value is not None or name not in ("epochs", "steps"):
                field.check(name, value)
        if (self.epochs is None) == (self.steps is None):
            raise UsageError("give exactly one of epochs and steps")
        if self.n_train == 0 and self.steps is None:
            raise UsageError("n_train 0 (fresh documents every step) needs steps, not epochs")
        if self.length_groups > self.batch_size:
            raise UsageError(f"length_groups {self.length_groups} is more than the batch size {self.batch_size}")

    def total_steps(self) -> int:
        """Number of optimizer steps of the whole run."""
        if self.steps is not None:
            return self.steps
        assert self.epochs is not None  # __post_init__: exactly one of epochs and steps
        return self.epochs * self.steps_per_epoch()

    def steps_per_epoch(self) -> int:
        return math.ceil(self.n_train / self.batch_size)


def learning_rate(step: int, config: TrainConfig) -> float:
    """Return the learning rate of optimizer step `step` (0-based): linear warm-up over
    the first `warmup_frac` of steps, then cosine (or, "hf-linear", linear) decay to 0 at the
    last step (`SCHEDULES`)."""
    total = config.total_steps()
    if config.schedule in ("hf-cosine", "hf-linear"):
        # transformers' lr_lambdas (cosine: num_cycles 0.5), multiplied in as LambdaLR does: base_lr * factor
        warmup = int(config.warmup_frac * total)
        if step < warmup:
            return config.lr * (step / max(1, warmup))
        if config.schedule == "hf-linear":
            return config.lr * max(0.0, float(total - step) / float(max(1, total - warmup)))
        progress = (step - warmup) / max(1, total - warmup)
        return config.lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    warmup = int(round(config.warmup_frac * total))
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return config.lr * 0.5 * (1 + math.cos(math.pi * progress))


class DataStream:
    """Training batches as a pure function of the step.

    `train_set` replaces the sampled training set (its rows must number `config.n_train`)."""

    def __init__(self, task: Task, config: TrainConfig, train_set: Batch | None = None):
        self.task, self.config = task, config
        self.train_set: Batch | None
        if train_set is not None:
            if len(train_set) != config.n_train:
                raise UsageError(f"the training set has {len(train_set)} rows, but n_train is {config.n_train}")
            self.train_set = train_set
        else:
            self.train_set = task.sample(config.n_train, seed=(config.seed, _TRAIN_SET)) if config.n_train else None
        self._order: tuple[int, Tensor] | None = None

    def batch(self, step: int) -> Batch:
        """Return the batch of optimizer step `step`."""
        cfg = self.config
        if self.train_set is None:
            return self.task.sample(cfg.batch_size, seed=(cfg.seed, _FRESH, step))
        per_epoch = cfg.steps_per_epoch()
        epoch, index = divmod(step, per_epoch)
        if cfg.order == "fixed":
            return self.train_set.select(
                torch.arange(index * cfg.batch_size, min((index + 1) * cfg.batch_size, cfg.n_train))
            )
        if self._order is None or self._order[0] != epoch:
            order = rng_for((cfg.seed, _EPOCH_ORDER, epoch)).permutation(cfg.n_train)
            self._order = (epoch, torch.from_numpy(order))
        rows = self._order[1][index * cfg.batch_size : (index + 1) * cfg.batch_size]
        return self.train_set.select(rows)


def answer_loss(model: HookedLM, batch: Batch, groups: int = 1) -> Tensor:
    """Return the mean cross-entropy (a scalar) of the answer at each row's query position (the
    only supervised token).

    With `groups` > 1 the rows, sorted by length, run as that many groups, each cut to its longest
    row: the same loss (a causal model's prediction at the query never reads the padding after
    it) without computing a batch's padding, which at ATR's L_max 10 is 4.8 times its tokens."""
    if groups == 1:
        return F.cross_entropy(_at_least_float32(model(batch.tokens, positions=batch.query_pos)), batch.answers)
    losses = []
    # an epoch's last batch may hold fewer rows than groups: no group is empty
    for rows in torch.tensor_split(torch.argsort(batch.lengths.cpu(), stable=True), min(groups, len(batch))):
        part = batch.select(rows.to(batch.tokens.device)).trimmed()
        logits = _at_least_float32(model(part.tokens, positions=part.query_pos))
        losses.append(F.cross_entropy(logits, part.answers, reduction="sum"))
    return torch.stack(losses).sum() / len(batch)


def _at_least_float32(logits: Tensor) -> Tensor:
    """Return half-precision logits as float32 for the loss (float32 and float64 stay as they are)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


@torch.no_grad()
def evaluate(model: HookedLM, batch: Batch, chunk: int = 512, by_length: bool = False) -> dict[str, float]:
    """Return dev accuracy (argmax at the query == answer) and mean p(answer) over `batch`, run
    `chunk` rows at a time; with `by_length`, the rows sorted by length (each chunk is cut to its
    longest row: the padding of ragged documents is not computed, as `answer_loss`'s groups)."""
    was_training = model.training
    model.eval()
    correct, p_sum = 0, 0.0
    device = next(model.parameters()).device
    order = torch.argsort(batch.lengths.cpu(), stable=True) if by_length else None
    for rows in run_chunks(len(batch), chunk):
        part = batch.select(rows if order is None else order[rows]).trimmed().to(device)
        logits = model(part.tokens, positions=part.query_pos)
        correct += (logits.argmax(-1) == part.answers).sum().item()
        p_sum += answer_probs(logits, part.answers).double().sum().item()
    model.train(was_training)
    return {"dev_acc": correct / len(batch), "dev_p_answer": p_sum / len(batch)}


# -- resume state ---------------------------------------------------------------------------
def _save_resume(path: Path, model: HookedLM, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> None:
    tensors = {f"model.{name}": t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            tensors[f"optim.{index}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"resume": json.dumps(extra)})


#: what a resume state's metadata holds, and what each value may be
_RESUME_FIELDS = {
    "step": schema.integer(0),
    "seconds": schema.number(0),
    "loss_sum": schema.number(),
    "loss_count": schema.integer(0),
}


def _load_resume(path: Path, model: HookedLM, optimizer: torch.optim.Optimizer, total: int) -> dict[str, Any]:
    """Load the resume state at `path` into `model` and `optimizer`; return its metadata. A state
    that does not fit this run (of `total` steps) or holds non-finite values is refused, naming
    the file: resuming it would go on from NaN and could end 'finished'."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            extra = json.loads(handle.metadata()["resume"])
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:
        raise HookmechError(f"{path}: unreadable resume state ({error}); delete it to restart the run") from None
    _check_resume_metadata(path, extra, total)
    found = first_non_finite_tensor(tensors.items())
    if found is not None:
        raise HookmechError(
            f"{path}: the resume state holds non-finite values (NaN or inf) in {found[0]}, so the run "
            "cannot go on from it; delete it to restart the run"
        )
    state: dict[int, dict[str, Tensor]] = {}
    for name, tensor in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = tensor
    try:
        model.load_state_dict({name[6:]: t for name, t in tensors.items() if name.startswith("model.")})
        optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    except (RuntimeError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0]
        raise HookmechError(f"{path}: the resume state does not fit this run's model ({first}); delete it") from None
    return extra


def _check_resume_metadata(path: Path, extra: Any, total: int) -> None:
    """Raise a HookmechError naming `path` and the key when the resume metadata is not what
    `_save_resume` writes (a step in 0..total, finite counters)."""
    if not isinstance(extra, dict):
        raise HookmechError(f"{path}: resume metadata is not a table; delete it to restart the run")
    for key, field in {**_RESUME_FIELDS, "step": schema.integer(0, total)}.items():
        if key not in extra or not field.fits(extra[key]):
            raise HookmechError(
                f"{path}: resume metadata {key} = {schema.toml_text(extra.get(key))} is not {field.describe()}; "
                "delete it to restart the run"
            )


def _run_record(
    model_config: ModelConfig, task: Task, config: TrainConfig, train_set_sha256: str | None
) -> dict[str, Any]:
    record = {
        "model_config": json.loads(model_config.to_json()),
        "task": task.spec,
        "train": dataclasses.asdict(config),
    }
    # the defaults: older run folders, written without these options, still match
    if config.order == "shuffled":
        del record["train"]["order"]
    if config.schedule == "cosine":
        del record["train"]["schedule"]
    if config.length_groups == 1:
        del record["train"]["length_groups"]
    if train_set_sha256 is not None:  # absent for sampled training sets: older run folders still match
        record["train_set_sha256"] = train_set_sha256
    return record


def batch_sha256(batch: Batch) -> str:
    """Return a hex SHA-256 of a batch's contents (every tensor, roles by name), for runs
    given a training set that does not come from a file."""
    digest = hashlib.sha256()
    items = [(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch) if f.name != "roles"]
    items += [(f"roles/{name}", batch.roles[name]) for name in sorted(batch.roles)]
    for name, value in items:
        if isinstance(value, Tensor):
            array = value.detach().cpu().contiguous().to(torch.int64).numpy()
            digest.update(f"{name}:{list(array.shape)};".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the metrics lines of steps <= last_step (a resumed run rewrites the rest)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def train(
    task: Task,
    model_config: ModelConfig,
    config: TrainConfig,
    out_dir: str | Path,
    *,
    device: str = "cpu",
    progress: bool | None | Callable[[RunProgress], Any] = None,
    on_step: Callable[[int], None] | None = None,
    on_eval: Callable[[int, HookedLM], dict[str, Any]] | None = None,
    log: Callable[[str], None] | None = None,
    train_set: Batch | None = None,
    train_set_sha256: str | None = None,
) -> dict[str, Any]:
    """Train a model in `out_dir` (resuming or skipping as the folder says) and return its summary.

    The summary holds at least ``dev_acc``, ``dev_p_answer``, ``steps``, ``seconds``,
    ``status``, and a finished run's ``model_hash`` (of model.safetensors). `on_step(step)` is
    called after each optimizer step (tests use it to interrupt a run); `on_eval(step, model)`
    at each evaluation, its dict is added to that step's metrics line (e.g. attributions
    measured during training). Raises `HookmechError` if
    the loss, the weights or a dev metric become NaN or inf, saying which checkpoint the folder keeps: only
    finite weights are written, and summary.json gets ``status`` "nan" and ``checkpoint_step``
    (None when the run diverged before its first checkpoint). A resume state holding NaN or inf
    is refused. `device` must exist here and the model fit its memory (`check_fits`), or a
    UsageError is raised before anything is written.

    `train_set` (rows of `task`, ``config.n_train`` of them) replaces the sampled training set;
    `train_set_sha256` (default: `batch_sha256` of it; the CLI gives the dataset file's) is
    recorded in run.json, so resuming the run with other training data is refused.

    The folder is locked while the run trains (`hookmech.locking.folder_lock`): a second
    process training into it gets a `HookmechError` naming the PID that holds it.

    `progress` (`hookmech.progress.reporter`): None shows a bar when stderr is a terminal and a
    line through `log` at evaluations otherwise (30 s apart at least), True a bar, False
    nothing, a callable gets `RunProgress` events (a sweep's worker sends them to its driver).
    """
    keep_freed_memory()  # CPU steps allocate multi-MB temporaries: see hookmech/allocator.py
    out = Path(out_dir)
    check_device(device)
    check_fits(model_config, device, copies=4)  # weights, gradients, AdamW's two moments
    log = log or (lambda message: print(message, file=sys.stderr))
    if train_set is not None:
        check_batch(train_set, task, "train_set")
        if len(train_set) != config.n_train:
            raise UsageError(f"the training set has {len(train_set)} rows, but n_train is {config.n_train}")
        train_set_sha256 = train_set_sha256 or batch_sha256(train_set)
    if train_set is None and train_set_sha256 is not None:
        raise UsageError("train_set_sha256 given without a train_set")
    record = _run_record(model_config, task, config, train_set_sha256)
    with folder_lock(out, "run folder"):  # a run that never started leaves no folder it made
        return _train_in_folder(
            task,
            model_config,
            config,
            out,
            record,
            device=device,
            progress=progress,
            on_step=on_step,
            on_eval=on_eval,
            log=log,
            train_set=train_set,
        )


#: files whose presence means a run folder holds training done (run.json alone does not)
PROGRESS_FILES = ("summary.json", "resume.safetensors", "metrics.jsonl", "model.safetensors")


def _train_in_folder(
    task: Task,
    model_config: ModelConfig,
    config: TrainConfig,
    out: Path,
    record: dict[str, Any],
    *,
    device: str,
    progress: bool | None | Callable[[RunProgress], Any],
    on_step,
    on_eval,
    log,
    train_set: Batch | None,
) -> dict[str, Any]:
    """`train`'s work, with the run folder locked."""
    summary_path = out / "summary.json"
    train_set_sha256 = record.get("train_set_sha256")
    run_path = out / "run.json"
    started = any((out / name).exists() for name in PROGRESS_FILES)
    if run_path.exists() and started:
        previous = read_json(run_path)
        if previous != json.loads(json.dumps(record)):
            if previous.get("train_set_sha256") != train_set_sha256:
                raise HookmechError(
                    f"{out} was trained on other data "
                    f"(training set sha256 {previous.get('train_set_sha256') or 'none: sampled'}, "
                    f"now {train_set_sha256 or 'none: sampled'}); give the same data or choose another -o folder"
                )
            raise HookmechError(f"{out} holds a different run (its run.json differs); choose another -o folder")
    if summary_path.exists():
        log(f"{out}: already trained (summary.json exists); not retraining")
        return read_json(summary_path)
    torch.manual_seed(config.seed)
    # build the model and the data before writing run.json: a config the mixers refuse, or data
    # that does not fit in memory, must not claim the folder
    model = HookedLM(model_config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    data = DataStream(task, config, train_set)
    dev = task.sample(config.n_dev, seed=(config.seed, _DEV_SET))
    write_text_atomic(run_path, json.dumps(record, indent=2, sort_keys=True))
    try:
        return _train_loop(
            task,
            config,
            out,
            model,
            optimizer,
            data,
            dev,
            device=device,
            progress=progress,
            on_step=on_step,
            on_eval=on_eval,
            log=log,
        )
    except BaseException:
        if not started and not any((out / name).exists() for name in PROGRESS_FILES):
            run_path.unlink(missing_ok=True)  # failed before its first step: the folder stays free
        raise


def _train_loop(
    task: Task,
    config: TrainConfig,
    out: Path,
    model: HookedLM,
    optimizer: torch.optim.Optimizer,
    data: DataStream,
    dev: Batch,
    *,
    device: str,
    progress: bool | None | Callable[[RunProgress], Any],
    on_step,
    on_eval,
    log,
) -> dict[str, Any]:
    """Run the optimizer steps left in `out` (resuming from its resume state) and return the summary."""
    run = _Run(task, config, out, model, optimizer, dev, log)
    start = run.resume()
    total = config.total_steps()
    bar = reporter(progress, run=str(out), total=total, start=start, seconds_before=run.seconds_before, log=log)
    run.began, run.bar = time.perf_counter(), bar
    for step in range(start, total):
        batch = data.batch(step).trimmed().to(device)
        run.optimizer_step(step, batch)
        done = step + 1
        bar.stepped(done, run.elapsed())
        evaluating = done % config.eval_every == 0 or done == total
        checkpointing = done % config.ckpt_every == 0 or done == total
        if evaluating or checkpointing:
            run.check_weights(done)
        if evaluating:
            run.evaluate_and_log(step, on_eval)
        if checkpointing:
            run.checkpoint(done)
        if on_step is not None:
            on_step(done)
    bar.close()
    return run.finish()


class _Run:
    """One training run's state between steps: the running loss, the last evaluation, the step of
    the checkpoint the folder keeps, and the wall clock (resumed runs add their earlier seconds)."""

    def __init__(self, task, config: TrainConfig, out: Path, model: HookedLM, optimizer, dev: Batch, log):
        self.task, self.config, self.out, self.model, self.optimizer, self.dev, self.log = (
            task, config, out, model, optimizer, dev, log,
        )  # fmt: skip
        self.seconds_before, self.loss_sum, self.loss_count = 0.0, 0.0, 0
        self.kept: int | None = None  # the step of the checkpoint in the folder (model.safetensors, resume state)
        self.last_eval: dict[str, float] = {}
        self.began = time.perf_counter()
        self.bar: Any = None

    def resume(self) -> int:
        """Load the folder's resume state if there is one; return the first step to run."""
        resume_path, start = self.out / "resume.safetensors", 0
        if resume_path.exists():
            extra = _load_resume(resume_path, self.model, self.optimizer, self.config.total_steps())
            start, self.seconds_before = extra["step"], extra["seconds"]
            self.loss_sum, self.loss_count = extra["loss_sum"], extra["loss_count"]
            self.kept = start
            self.log(f"{self.out}: resuming from step {start}")
        _truncate_metrics(self.out / "metrics.jsonl", start)
        return start

    def elapsed(self) -> float:
        """Return the run's training seconds so far, earlier sessions included."""
        return self.seconds_before + time.perf_counter() - self.began

    def optimizer_step(self, step: int, batch: Batch) -> None:
        """Take optimizer step `step` on `batch`; raise the divergence error on a non-finite loss."""
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(step, self.config)
        loss = answer_loss(self.model, batch, self.config.length_groups)
        if not torch.isfinite(loss):
            raise self.diverged(f"loss became {loss.item()}", step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.loss_sum, self.loss_count = self.loss_sum + loss.item(), self.loss_count + 1

    def check_weights(self, done: int) -> None:
        """Raise the divergence error when a weight or AdamW moment is not finite.

        A finite loss can still leave NaN weights (an inf gradient): only finite weights are
        evaluated or written, so the folder's checkpoint is always one to resume from."""
        bad = first_non_finite_tensor(_training_state(self.model, self.optimizer))
        if bad is not None:
            raise self.diverged(f"the weights became non-finite (NaN or inf in {bad[0]})", done)

    def evaluate(self) -> dict[str, float]:
        """Return `evaluate`'s metrics of the model on the dev set; a run that groups its batches by
        length (`TrainConfig.length_groups`) evaluates RAGGED_EVAL_ROWS rows of similar length at a time."""
        if self.config.length_groups > 1:
            return evaluate(self.model, self.dev, RAGGED_EVAL_ROWS, by_length=True)
        return evaluate(self.model, self.dev)

    def evaluate_and_log(self, step: int, on_eval) -> None:
        """Evaluate on the dev set after step `step`, add `on_eval`'s columns and append the line
        to metrics.jsonl; the running loss starts again."""
        done = step + 1
        metrics = self.evaluate()
        if (bad_metric := _first_non_finite_metric(metrics)) is not None:
            # finite weights can still compute NaN on some dev documents (e.g. an overflow in the
            # forward pass): such a model's later numbers would be noise, so the run stops
            raise self.diverged(f"the dev metric {bad_metric} became {metrics[bad_metric]}", done)
        self.last_eval = metrics
        entry = {
            "step": done,
            "loss": self.loss_sum / self.loss_count,
            "lr": learning_rate(step, self.config),
            **metrics,
            "seconds": round(self.elapsed(), 3),
        }
        if on_eval is not None:
            entry.update(on_eval(done, self.model))
            self.model.train()
        metrics_path = self.out / "metrics.jsonl"
        with disk_full_as_error(metrics_path), open(metrics_path, "a") as handle:
            handle.write(json.dumps(entry) + "\n")
        self.loss_sum, self.loss_count = 0.0, 0
        self.bar.evaluated(done, self.elapsed(), entry["loss"], metrics["dev_acc"])

    def checkpoint(self, step: int) -> None:
        """Write the resume state and model.safetensors of step `step`."""
        _save_resume(
            self.out / "resume.safetensors",
            self.model,
            self.optimizer,
            {"step": step, "seconds": self.elapsed(), "loss_sum": self.loss_sum, "loss_count": self.loss_count},
        )
        save(
            self.model,
            self.out / "model.safetensors",
            task_spec=self.task.spec,
            summary={"steps": step, **self.last_eval},
        )
        self.kept = step

    def diverged(self, what: str, step: int) -> HookmechError:
        """Write the "nan" summary; return the error saying what diverged and what was kept."""
        if self.bar is not None:
            self.bar.close()
        summary = {"status": "nan", "steps": step, "checkpoint_step": self.kept, "seconds": self.elapsed()}
        _write_summary(self.out / "summary.json", {**summary, **self.last_eval})
        if self.kept is None:
            first = min(self.config.ckpt_every, self.config.total_steps())
            was_kept = f"no checkpoint was kept (the first was due at step {first})"
        else:
            was_kept = f"kept the checkpoint of step {self.kept} in {self.out / 'model.safetensors'}"
        return HookmechError(f"{what} at step {step}; run stopped, {was_kept}")

    def finish(self) -> dict[str, Any]:
        """Evaluate the final model, write it and summary.json; return the summary."""
        summary = {
            "status": "finished",
            "steps": self.config.total_steps(),
            "seconds": round(self.elapsed(), 3),
            **self.evaluate(),
        }
        # no wall-clock values in the model file: identical runs write identical checkpoints
        save(
            self.model,
            self.out / "model.safetensors",
            task_spec=self.task.spec,
            summary={key: value for key, value in summary.items() if key != "seconds"},
        )
        # the final model's identity, so that its weights are found where the folder does not keep
        # them (a record committed without its checkpoint: `hookmech.run_weights`)
        summary["model_hash"] = read_metadata(self.out / "model.safetensors")["model_hash"]
        _write_summary(self.out / "summary.json", summary)
        return summary


def _first_non_finite_metric(metrics: dict[str, float]) -> str | None:
    """Return the name of the first NaN or infinite value in `metrics`, or None when all are finite."""
    return next((name for name, value in metrics.items() if not math.isfinite(value)), None)


def _training_state(model: HookedLM, optimizer: torch.optim.Optimizer):
    """Yield ``(name, tensor)`` of what a checkpoint writes: the weights, then AdamW's moments."""
    yield from model.named_parameters()
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                yield f"optim.{index}.{key}", value


def _write_summary(path: Path, summary: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(summary, indent=2, sort_keys=True) + "\n")
