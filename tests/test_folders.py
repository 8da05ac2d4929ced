"""Folders hookmech writes into: run and sweep folders are locked while a process writes into
them, a run folder is claimed only once training has started, a report folder appears whole."""
from __future__ import annotations

import json
import signal

import pytest

import hookmech
from hookmech.config import build_config
from hookmech.errors import HookmechError
from hookmech.training import TrainConfig, train

from helpers import run_cli
from lock_holder import start_lock_holder, stop_lock_holder


def small_setup(**train_options):
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=8, n_layers=2, tie_embeddings=False)
    options = {"lr": 3e-3, "epochs": None, "steps": 6, "n_train": 0, "n_dev": 16, "batch_size": 8,
               "eval_every": 3, "ckpt_every": 3, **train_options}
    return task, model_config, TrainConfig(**options)


@pytest.fixture
def holder():
    """Start processes holding folder locks; stop them after the test."""
    started = []

    def start(folder):
        started.append(start_lock_holder(folder))
        return started[-1]

    yield start
    for process in started:
        stop_lock_holder(process)


# -- a run folder is locked while a process trains into it -----------------------------------
def test_a_run_folder_another_process_trains_into_is_refused_naming_it_and_the_pid(tmp_path, holder):
    task, model_config, config = small_setup()
    out = tmp_path / "run"
    process = holder(out)
    with pytest.raises(HookmechError, match=rf"{out} is in use by process {process.pid}\b"):
        train(task, model_config, config, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written beside the holder's lock
    stop_lock_holder(process)
    assert train(task, model_config, config, out, progress=False)["status"] == "finished"
    assert not (out / ".lock").exists()  # released and removed when the run ends


def test_a_killed_holder_leaves_no_lock_behind(tmp_path, holder):
    task, model_config, config = small_setup()
    out = tmp_path / "run"
    process = holder(out)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert (out / ".lock").exists()  # its file stays, but the OS dropped its lock
    assert train(task, model_config, config, out, progress=False)["status"] == "finished"


def test_cli_train_into_a_locked_folder_is_one_line_naming_the_pid(tmp_path, holder, capsys):
    process = holder(tmp_path / "r")
    code, out, err = run_cli(["train", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3", "--n-train",
                              "0", "--steps", "2", "--d-model", "8", "--n-dev", "8", "-o", str(tmp_path / "r")], capsys)
    assert code == 1 and err.count("\n") == 1 and err.startswith("hookmech: error: run folder ")
    assert f"in use by process {process.pid}" in err and "Traceback" not in err


# -- a run folder is claimed only once training has started ---------------------------------
def test_a_run_that_fails_before_its_first_step_leaves_the_folder_free(tmp_path, monkeypatch):
    task, model_config, config = small_setup(n_dev=10**8)
    real_sample = type(task).sample

    def sample(self, n, seed):
        if n >= 10**8:
            raise MemoryError("the dev set does not fit")
        return real_sample(self, n, seed)

    monkeypatch.setattr(type(task), "sample", sample)
    out = tmp_path / "run"
    with pytest.raises(MemoryError):
        train(task, model_config, config, out, progress=False)
    assert not out.exists()  # the folder it made is gone
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(MemoryError):
        train(task, model_config, config, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # no run.json claims it
    _, _, corrected = small_setup()
    assert train(task, model_config, corrected, out, progress=False)["status"] == "finished"


def test_a_run_that_fails_in_its_first_step_leaves_the_folder_free(tmp_path, monkeypatch):
    import hookmech.training as training

    task, model_config, config = small_setup(batch_size=8)

    def out_of_memory(model, batch):
        raise MemoryError("batch too large")

    monkeypatch.setattr(training, "answer_loss", out_of_memory)
    with pytest.raises(MemoryError):
        train(task, model_config, config, tmp_path / "run", progress=False)
    monkeypatch.undo()
    _, _, smaller = small_setup(batch_size=4)
    assert train(task, model_config, smaller, tmp_path / "run", progress=False)["status"] == "finished"


def test_a_folder_holding_only_run_json_is_not_a_run_yet(tmp_path):
    """Folders left by a failed start of older versions: run.json and nothing trained."""
    task, model_config, config = small_setup()
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"model_config": {}, "task": {}, "train": {}}))
    assert train(task, model_config, config, out, progress=False)["status"] == "finished"
    assert json.loads((out / "run.json").read_text())["train"]["steps"] == 6
    # once trained, the folder is the run's
    _, _, other = small_setup(lr=1e-2)
    with pytest.raises(HookmechError, match="different run"):
        train(task, model_config, other, out, progress=False)
