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
from lock_holder import stop_lock_holder


def small_setup(**train_options):
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=8, n_layers=2, tie_embeddings=False)
    options = {"lr": 3e-3, "epochs": None, "steps": 6, "n_train": 0, "n_dev": 16, "batch_size": 8,
               "eval_every": 3, "ckpt_every": 3, **train_options}
    return task, model_config, TrainConfig(**options)


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


def test_a_run_folder_that_is_a_file_is_a_usage_error(tmp_path):
    from hookmech.errors import UsageError

    task, model_config, config = small_setup()
    (tmp_path / "run").write_text("not a folder")
    with pytest.raises(UsageError, match=r"run folder .*run is a file, not a folder"):
        train(task, model_config, config, tmp_path / "run", progress=False)


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

    def out_of_memory(model, batch, groups=1):
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


# -- sweeps: the runs folder is locked; each worker locks only its run's folder --------------
SWEEP = """
name = "tiny"
[task]
name = "ar"
vocab_size = 16
num_kv_pairs = 3
[train]
steps = 4
n_train = 0
n_dev = 8
batch_size = 8
eval_every = 2
ckpt_every = 2
[grid]
d_model = [8]
seed = [0, 1]
"""


def test_a_sweep_into_a_runs_folder_another_sweep_holds_is_refused(tmp_path, holder):
    from hookmech.sweep import parse_sweep, run_sweep

    process = holder(tmp_path / "runs")
    with pytest.raises(HookmechError, match=rf"runs folder {tmp_path / 'runs'} is in use by process {process.pid}\b"):
        run_sweep(parse_sweep(SWEEP), tmp_path / "runs", threads=1, log=lambda m: None)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [".lock"]  # nothing trained, no results.csv


def test_a_sweep_run_whose_folder_another_process_holds_fails_alone(tmp_path, holder):
    from hookmech.sweep import expand, parse_sweep, read_results, run_sweep

    sweep = parse_sweep(SWEEP)
    first, second = expand(sweep)
    process = holder(tmp_path / "runs" / first.run_id)
    with pytest.raises(HookmechError, match="1 of 2 runs failed"):
        run_sweep(sweep, tmp_path / "runs", threads=1, log=lambda m: None)
    rows = {row["run_id"]: row for row in read_results(tmp_path / "runs" / "results.csv")}
    assert rows[first.run_id]["status"] == "error" and f"in use by process {process.pid}" in rows[first.run_id]["error"]
    assert rows[second.run_id]["status"] == "finished"  # the other run trained meanwhile
    assert not (tmp_path / "runs" / ".lock").exists() and not (tmp_path / "runs" / second.run_id / ".lock").exists()


# -- sweeps check every option of every run before the first run trains ---------------------
@pytest.mark.parametrize(("mech", "message"), [
    ('sites = ["L9.block_in"]', "L9.block_in"),
    ('positions = ["nosuchrole"]', "nosuchrole"),
    ("every = 3", "[mech] every 3 must be a multiple of eval_every 2"),
])
def test_a_sweep_with_a_bad_mech_option_fails_before_training_anything(tmp_path, capsys, mech, message):
    sweep_file = tmp_path / "bad.toml"
    sweep_file.write_text(SWEEP + f"[mech]\n{mech}\n")
    code, _, err = run_cli(["sweep", str(sweep_file), "-o", str(tmp_path / "runs")], capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hookmech: error: run d8_s0_") and message in err, err
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing written


# -- a report folder appears whole, or not at all -------------------------------------------
@pytest.fixture
def runs_with_results(tmp_path):
    from hookmech.sweep import write_results

    from test_report import synthetic_rows

    runs = tmp_path / "runs"
    runs.mkdir()
    write_results(synthetic_rows(), runs / "results.csv")
    return runs


def _beside(folder):
    """Names in `folder`'s parent that belong to a report being built (temporary folders)."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def test_a_report_of_an_unknown_run_writes_nothing(runs_with_results, tmp_path, capsys):
    out = tmp_path / "report"
    code, _, err = run_cli(["report", str(runs_with_results), "--run", "nosuchrun", "--no-heatmaps", "-o", str(out)],
                           capsys)
    assert code == 2 and err.count("\n") == 1 and "unknown run 'nosuchrun'" in err, err
    assert not out.exists() and _beside(out) == []


def test_a_report_replaces_an_earlier_report_whole(runs_with_results, tmp_path):
    from hookmech.report import build_report

    out = tmp_path / "report"
    build_report(runs_with_results, out, heatmaps=False)
    (out / "heatmap_of_an_earlier_selection.png").write_bytes(b"\x89PNG old")
    before = sorted(p.name for p in out.iterdir())
    path = build_report(runs_with_results, out, heatmaps=False)
    assert path == out / "report.md" and path.exists()
    assert sorted(p.name for p in out.iterdir()) == [name for name in before if not name.startswith("heatmap_")]
    assert _beside(out) == []


def test_a_report_that_fails_midway_leaves_the_earlier_report_as_it_was(runs_with_results, tmp_path, monkeypatch):
    import hookmech.report as report

    out = tmp_path / "report"
    report.build_report(runs_with_results, out, heatmaps=False)
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(*args, **kwargs):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(report, "plot_value_vs_query", broken)
    with pytest.raises(RuntimeError, match="drawing failed"):
        report.build_report(runs_with_results, out, heatmaps=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier
    assert _beside(out) == []


def test_a_report_into_a_folder_that_is_not_a_report_is_refused(runs_with_results, tmp_path):
    from hookmech.errors import UsageError
    from hookmech.report import build_report

    with pytest.raises(UsageError, match=r"is not a report folder \(it holds results.csv\)"):
        build_report(runs_with_results, runs_with_results, heatmaps=False)
    assert sorted(p.name for p in runs_with_results.iterdir()) == ["results.csv"]
    (tmp_path / "empty").mkdir()
    assert build_report(runs_with_results, tmp_path / "empty", heatmaps=False).exists()


# -- every command that writes a folder locks it -------------------------------------------------
def test_das_into_a_folder_another_process_writes_is_refused_and_writes_nothing(tmp_path, holder, capsys):
    from helpers import ATTENTION_FIXTURE

    code, _, err = run_cli(["cache", "--ckpt", ATTENTION_FIXTURE, "--n", "8", "-o", tmp_path / "c.h5"], capsys)
    assert code == 0, err
    out = tmp_path / "das"
    process = holder(out)
    argv = ["das", "--ckpt", ATTENTION_FIXTURE, "--cache", tmp_path / "c.h5", "--site", "L1.block_in", "--pos",
            "value", "--dim", "1", "--steps", "2", "--batch-size", "4", "-o", out]
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and err == f"hookmech: error: das folder {out} is in use by process {process.pid} (another " \
                                "hookmech run writing into it); wait for it to finish, or choose another folder\n"
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
    stop_lock_holder(process)
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["bases.safetensors", "records.json"]  # the lock file gone


def test_an_evaluation_into_a_folder_another_process_writes_is_refused(tmp_path, holder, capsys):
    out = tmp_path / "e"
    process = holder(out)
    code, _, err = run_cli(["evaluate", "--mixer", "attention", "--budget-hours", "0.0001", "-o", out], capsys)
    assert code == 1 and f"evaluation folder {out} is in use by process {process.pid}" in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no evaluate.json, no task folder
