"""The trainer: schedule, determinism, resume == uninterrupted, skip when finished, NaN stop."""
from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import ENGINE_TOL, FLOAT64_SUM_TOL, make_model, unit_variance

import hookmech
from hookmech.config import build_config
from hookmech.errors import HookmechError, UsageError
from hookmech.model import HookedLM
from hookmech.training import DataStream, TrainConfig, answer_loss, evaluate, learning_rate, train


def small_setup(**train_options):
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=16, n_layers=2, tie_embeddings=False)
    options = {"lr": 3e-3, "epochs": None, "steps": 30, "n_train": 0, "n_dev": 32, "batch_size": 8,
               "eval_every": 7, "ckpt_every": 10, **train_options}
    return task, model_config, TrainConfig(**options)


def weights(path):
    return hookmech.load(path).state_dict()


def test_learning_rate_schedule_by_hand():
    config = TrainConfig(lr=1.0, warmup_frac=0.1, epochs=None, steps=100, n_train=0)
    # the schedule's float64 formulas vs these hand values: round-off (pytest.approx's rel 1e-6)
    assert learning_rate(0, config) == pytest.approx(0.1)
    assert learning_rate(9, config) == pytest.approx(1.0)
    assert learning_rate(10, config) == pytest.approx(1.0)
    assert learning_rate(55, config) == pytest.approx(0.5)
    assert learning_rate(99, config) == pytest.approx(0.5 * (1 + math.cos(math.pi * 89 / 90)))


@pytest.mark.parametrize("total, warmup_frac", [(50_016, 0.1), (40, 0.1), (37, 0.25), (10, 0.0), (3, 1.0)])
def test_hf_cosine_is_transformers_schedule_as_paper_000s_code_calls_it(total, warmup_frac):
    # tinylang experiment.py: get_cosine_schedule_with_warmup(optimizer, int(T·warmup), T) in a LambdaLR
    from transformers import get_cosine_schedule_with_warmup

    config = TrainConfig(lr=1e-2, warmup_frac=warmup_frac, epochs=None, steps=total, n_train=0, schedule="hf-cosine")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(total * warmup_frac), total)
    assert learning_rate(0, config) == optimizer.param_groups[0]["lr"]  # what LambdaLR set for the first step
    steps = range(total) if total < 100 else [0, 1, 2, 5000, 5001, 5002, 5003, 27_508, 50_014, 50_015]
    for step in steps:
        assert learning_rate(step, config) == 1e-2 * scheduler.lr_lambdas[0](step), step
    if total == 50_016:  # the paper's 16 epochs of 3126 steps: W = 5001, one step behind "cosine"'s 5002
        cosine = TrainConfig(lr=1e-2, epochs=None, steps=total, n_train=0)
        assert learning_rate(0, config) == 0.0 and learning_rate(0, cosine) == pytest.approx(1e-2 / 5002)
        assert learning_rate(5001, config) == 1e-2 and learning_rate(5001, cosine) == pytest.approx(1e-2)


@pytest.mark.parametrize("total, warmup_frac", [(100_032, 0.1), (40, 0.1), (37, 0.25), (10, 0.0), (3, 1.0)])
def test_hf_linear_is_transformers_schedule_as_paper_000s_code_calls_it(total, warmup_frac):
    # tinylang experiment.py: get_linear_schedule_with_warmup(optimizer, int(T·warmup), T) unless cosine
    from transformers import get_linear_schedule_with_warmup

    config = TrainConfig(lr=1e-3, warmup_frac=warmup_frac, epochs=None, steps=total, n_train=0, schedule="hf-linear")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(total * warmup_frac), total)
    assert learning_rate(0, config) == optimizer.param_groups[0]["lr"]
    steps = range(total) if total < 100 else [0, 1, 10_002, 10_003, 10_004, 55_017, 100_000, 100_031]
    for step in steps:
        assert learning_rate(step, config) == 1e-3 * scheduler.lr_lambdas[0](step), step


def test_fixed_training_set_is_replayed_each_epoch_in_a_new_order():
    task, _, _ = small_setup()
    config = TrainConfig(epochs=2, n_train=24, batch_size=8)
    stream = DataStream(task, config)
    first = torch.cat([stream.batch(step).tokens for step in range(3)])
    second = torch.cat([stream.batch(step).tokens for step in range(3, 6)])
    def as_set(tokens):
        return sorted(map(tuple, tokens.tolist()))
    assert as_set(first) == as_set(second) == as_set(stream.train_set.tokens)
    assert not torch.equal(first, second)
    assert config.total_steps() == 6


def test_fixed_order_replays_the_same_batches_in_set_order_every_epoch():
    # tinylang's loop: batch k of every epoch is documents [k·B, (k+1)·B) of the fixed set
    task, _, _ = small_setup()
    config = TrainConfig(epochs=2, n_train=20, batch_size=8, order="fixed")
    stream = DataStream(task, config)
    rows = stream.train_set.tokens
    expected = [rows[0:8], rows[8:16], rows[16:20]]  # the last batch of an epoch is short, as in the set
    assert config.steps_per_epoch() == 3
    for step in range(6):
        assert torch.equal(stream.batch(step).tokens, expected[step % 3]), step


def test_order_and_schedule_are_recorded_only_when_not_the_default(tmp_path):
    task, model_config, _ = small_setup()
    for order, schedule in (("shuffled", "cosine"), ("fixed", "hf-cosine")):
        config = TrainConfig(
            lr=3e-3, epochs=1, n_train=16, n_dev=8, batch_size=8, eval_every=2, order=order, schedule=schedule
        )
        train(task, model_config, config, tmp_path / order, progress=False)
        recorded = json.loads((tmp_path / order / "run.json").read_text())["train"]
        # a run folder written before the options existed has neither, and must still resume
        assert recorded.get("order") == (None if order == "shuffled" else "fixed")
        assert recorded.get("schedule") == (None if schedule == "cosine" else "hf-cosine")

    assert not torch.equal(
        weights(tmp_path / "shuffled" / "model.safetensors")["blocks.0.mixer.Wqkv.weight"],
        weights(tmp_path / "fixed" / "model.safetensors")["blocks.0.mixer.Wqkv.weight"],
    )


@pytest.mark.parametrize("schedule", ["cosine", "hf-cosine", "hf-linear"])
def test_hf_cosine_first_step_leaves_the_weights_as_drawn(tmp_path, schedule):
    # tinylang's first optimizer step runs at lr 0: AdamW records the gradient's moments and moves
    # nothing (weight decay 0); "cosine" moves the weights at its first step
    task, model_config, config = small_setup(steps=20, warmup_frac=0.5, ckpt_every=1, schedule=schedule)

    def stop_after_the_first_step(step):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(task, model_config, config, tmp_path / "run", progress=False, on_step=stop_after_the_first_step)
    torch.manual_seed(config.seed)  # the trainer draws the model right after seeding torch
    drawn = HookedLM(model_config).state_dict()
    after_one_step = weights(tmp_path / "run" / "model.safetensors")
    unchanged = all(torch.equal(tensor, drawn[name]) for name, tensor in after_one_step.items())
    assert unchanged == schedule.startswith("hf-")


def test_training_is_deterministic(tmp_path):
    task, model_config, config = small_setup()
    train(task, model_config, config, tmp_path / "a", progress=False)
    train(task, model_config, config, tmp_path / "b", progress=False)
    for name, tensor in weights(tmp_path / "a" / "model.safetensors").items():
        assert torch.equal(tensor, weights(tmp_path / "b" / "model.safetensors")[name])


@pytest.mark.parametrize("n_train", [0, 40])
def test_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, n_train):
    task, model_config, config = small_setup(n_train=n_train)
    train(task, model_config, config, tmp_path / "whole", progress=False)

    def kill_at_25(step):
        if step == 25:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(task, model_config, config, tmp_path / "broken", progress=False, on_step=kill_at_25)
    assert not (tmp_path / "broken" / "summary.json").exists()
    train(task, model_config, config, tmp_path / "broken", progress=False)
    whole = weights(tmp_path / "whole" / "model.safetensors")
    for name, tensor in weights(tmp_path / "broken" / "model.safetensors").items():
        assert torch.equal(tensor, whole[name]), name
    steps = [json.loads(line)["step"] for line in (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [7, 14, 21, 28, 30]
    whole_metrics = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    broken_metrics = (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()
    for a, b in zip(whole_metrics, broken_metrics, strict=True):  # the same computation resumed: exact
        a, b = json.loads(a), json.loads(b)
        assert (a["step"], a["loss"], a["dev_acc"]) == (b["step"], b["loss"], b["dev_acc"])


def test_finished_run_is_not_retrained(tmp_path):
    task, model_config, config = small_setup()
    first = train(task, model_config, config, tmp_path / "run", progress=False)
    stamp = (tmp_path / "run" / "model.safetensors").stat().st_mtime_ns
    messages = []
    again = train(task, model_config, config, tmp_path / "run", progress=False, log=messages.append)
    assert again == first and "already trained" in messages[0]
    assert (tmp_path / "run" / "model.safetensors").stat().st_mtime_ns == stamp
    assert {"dev_acc", "dev_p_answer", "steps", "seconds"} <= set(first)


def test_resume_state_lives_beside_the_model(tmp_path):
    task, model_config, config = small_setup()
    train(task, model_config, config, tmp_path / "run", progress=False)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "run" / "model.safetensors"), framework="pt") as handle:
        keys = list(handle.keys())
        assert keys and not any(key.startswith("optim.") for key in keys)
    assert (tmp_path / "run" / "resume.safetensors").exists()


def test_folder_of_another_run_is_refused(tmp_path):
    task, model_config, config = small_setup()
    train(task, model_config, config, tmp_path / "run", progress=False)
    _, _, other = small_setup(lr=1e-2)
    with pytest.raises(HookmechError, match="different run"):
        train(task, model_config, other, tmp_path / "run", progress=False)


def test_nan_loss_stops_with_a_clear_message_keeping_the_last_checkpoint(tmp_path, monkeypatch):
    task, model_config, config = small_setup(lr=1e-3)
    import hookmech.training as training

    real_loss = training.answer_loss

    def loss_that_explodes(model, batch, groups=1):
        loss = real_loss(model, batch, groups)
        if loss_that_explodes.calls >= 12:
            return loss * float("nan")
        loss_that_explodes.calls += 1
        return loss

    loss_that_explodes.calls = 0
    monkeypatch.setattr(training, "answer_loss", loss_that_explodes)
    with pytest.raises(HookmechError, match="nan"):
        train(task, model_config, config, tmp_path / "run", progress=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "nan" and summary["steps"] == 12
    assert hookmech.load(tmp_path / "run" / "model.safetensors").cfg == model_config


def test_a_nan_dev_metric_stops_the_run_keeping_the_last_checkpoint(tmp_path, monkeypatch):
    """Finite weights whose forward pass gives NaN on dev documents: the run stops with status "nan"
    at that evaluation (step 14, the second), and the checkpoint of step 10 is the one kept."""
    task, model_config, config = small_setup(lr=1e-3)
    import hookmech.training as training

    real_evaluate = training.evaluate

    def evaluate_that_overflows(model, batch):
        metrics = real_evaluate(model, batch)
        evaluate_that_overflows.calls += 1
        return {**metrics, "dev_p_answer": float("nan")} if evaluate_that_overflows.calls == 2 else metrics

    evaluate_that_overflows.calls = 0
    monkeypatch.setattr(training, "evaluate", evaluate_that_overflows)
    with pytest.raises(HookmechError, match="dev metric dev_p_answer became nan at step 14.*step 10"):
        train(task, model_config, config, tmp_path / "run", progress=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "nan" and summary["steps"] == 14 and summary["checkpoint_step"] == 10
    assert math.isfinite(summary["dev_p_answer"])  # the last finite evaluation (step 7), not the NaN
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [7]


@pytest.mark.parametrize("options", [{"lr": 0}, {"lr": -1}, {"steps": 0}, {"batch_size": 0}, {"n_dev": 0},
                                     {"warmup_frac": 2}, {"epochs": 3}, {"steps": None, "epochs": 2, "n_train": 0},
                                     {"order": "random"}, {"schedule": "linear"},
                                     {"length_groups": 0}, {"length_groups": 33}])
def test_invalid_options_are_refused(options):
    base = {"epochs": None, "steps": 10, "n_train": 0}
    with pytest.raises(UsageError):
        TrainConfig(**{**base, **options})


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_issue_recipe_learns_induction(tmp_path, seed):
    """The fixture recipe (issue 2): dev accuracy >= 0.95 and value attribution >= 0.8."""
    task = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, layer_options=[{"window": 2}, {}],
                                tie_embeddings=False)
    config = TrainConfig(lr=3e-3, warmup_frac=0.5, epochs=None, steps=4000, n_train=0, seed=seed)
    summary = train(task, model_config, config, tmp_path / "run", progress=False)
    model = hookmech.load(tmp_path / "run" / "model.safetensors")
    records = {r["pos"]: r for r in hookmech.patching.patch(model, task.sample(320, seed=1), ["L1.block_in"], ["key", "value"])}
    assert summary["dev_acc"] >= 0.95
    assert records["value"]["attribution"] >= 0.8 and records["key"]["attribution"] <= 0.2


@pytest.mark.parametrize("mixer", ["attention", "mamba", "based", "hyena", "baseconv", "h3"])
def test_length_groups_give_the_padded_batchs_loss_and_gradient(mixer):
    # ATR at L_max 10: rows of 10 to 100 tokens. The reference runs each row alone, uncut by any
    # other row; the padded batch and the groups of rows sorted by length must both equal it
    task = hookmech.tasks.make("atr", max_rhs_len=10, num_terminals=20)
    batch = task.sample(12, seed=3)
    assert batch.lengths.min() * 2 < batch.lengths.max()  # ragged: the groups cut real padding
    torch.manual_seed(0)
    model = HookedLM(build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=16, n_layers=2,
                                  mixers=[mixer] * 2)).double()

    def loss_and_gradient(loss):
        model.zero_grad()
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    rows = [batch.select(slice(row, row + 1)).trimmed() for row in range(len(batch))]
    one_row_at_a_time = loss_and_gradient(sum(answer_loss(model, row) for row in rows) / len(batch))
    for groups in (1, 4, 12, 16):  # 16 groups of 12 rows: 12 of one row each
        loss, gradient = loss_and_gradient(answer_loss(model, batch.trimmed(), groups))
        assert torch.allclose(loss, one_row_at_a_time[0], rtol=0, atol=FLOAT64_SUM_TOL)
        assert torch.allclose(gradient, one_row_at_a_time[1], rtol=0, atol=FLOAT64_SUM_TOL)


def test_evaluation_by_length_gives_each_rows_own_metrics():
    task = hookmech.tasks.make("atr", max_rhs_len=10, num_terminals=20)
    batch = task.sample(40, seed=4)
    model = unit_variance(make_model(task, mixers=["mamba", "attention"]))  # p(answer) varies by row
    rows = [evaluate(model, batch.select(slice(row, row + 1))) for row in range(len(batch))]
    one_row_at_a_time = {name: sum(row[name] for row in rows) / len(rows) for name in rows[0]}
    for metrics in (evaluate(model, batch), evaluate(model, batch, 16, by_length=True)):
        assert metrics["dev_acc"] == one_row_at_a_time["dev_acc"]
        assert math.isclose(metrics["dev_p_answer"], one_row_at_a_time["dev_p_answer"], rel_tol=0, abs_tol=ENGINE_TOL)


def test_length_groups_are_recorded_only_when_not_1_and_train_deterministically(tmp_path):
    task = hookmech.tasks.make("atr", max_rhs_len=10, num_terminals=20)
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=16, n_layers=2)
    for name, groups in (("one", 1), ("four", 4), ("four-again", 4)):
        config = TrainConfig(lr=3e-3, epochs=1, n_train=32, n_dev=8, batch_size=8, eval_every=2, length_groups=groups)
        train(task, model_config, config, tmp_path / name, progress=False)
        recorded = json.loads((tmp_path / name / "run.json").read_text())["train"]
        assert recorded.get("length_groups") == (None if groups == 1 else groups)
    for name, tensor in weights(tmp_path / "four" / "model.safetensors").items():
        assert torch.equal(tensor, weights(tmp_path / "four-again" / "model.safetensors")[name])
