"""Sweeps: grid expansion, run ids, resume of an interrupted sweep, results.csv, local vs Ray."""
from __future__ import annotations

import csv
import json

import pytest
import torch

import hookmech
from hookmech.errors import UsageError
from hookmech.sweep import (expand, parse_sweep, read_results, run_id, run_sweep, build_run)
from hookmech.sweep import PRESETS, load_preset
from hookmech.training import train

TINY = """
name = "tiny"
[task]
name = "ar"
vocab_size = 16
num_kv_pairs = 3
[train]
steps = 12
n_train = 0
n_dev = 16
batch_size = 8
eval_every = 4
ckpt_every = 4
[model]
tie_embeddings = false
[mixer_options.attention]
"L0.window" = 2
[grid]
mixer = ["attention", "baseconv"]
d_model = [8]
lr = [3e-3]
seed = [0, 1]
"""


def tiny(extra: str = "", grid: str | None = None):
    text = TINY if grid is None else TINY.split("[grid]")[0] + grid
    return parse_sweep(text + extra)


def test_grid_is_the_product_in_file_order_first_key_slowest():
    sweep = parse_sweep(TINY.split("[grid]")[0] + '[grid]\nmixer = ["attention", "hyena"]\nd_model = [8, 16]\n'
                        'lr = [1e-3, 3e-3, 1e-2]\n')
    runs = expand(sweep)
    assert len(runs) == 2 * 2 * 3
    assert [tuple(r.point.values()) for r in runs[:4]] == [("attention", 8, 1e-3), ("attention", 8, 3e-3),
                                                            ("attention", 8, 1e-2), ("attention", 16, 1e-3)]
    assert runs[-1].point == {"mixer": "hyena", "d_model": 16, "lr": 1e-2}
    assert len({r.run_id for r in runs}) == len(runs)


def test_grid_keys_reach_task_trainer_model_and_mixer_options():
    sweep = tiny(grid='[grid]\n"task.num_kv_pairs" = [2, 3]\nwarmup_frac = [0.5]\nmixer = ["mamba"]\nd_conv = [2]\n'
                      'n_layers = [1]\n')
    run = expand(sweep)[0].as_dict()
    task, model_config, train_config = build_run(run)
    assert task.spec["num_kv_pairs"] == 2 and train_config.warmup_frac == 0.5
    assert model_config.mixers == ("mamba",) and model_config.mixer_kwargs[0]["d_conv"] == 2
    # per-mixer options apply only to that mixer's layers, L0.K only to layer 0
    attention = build_run(expand(tiny())[0].as_dict())[1]
    assert attention.mixer_kwargs[0]["window"] == 2 and "window" not in attention.mixer_kwargs[1]


def test_run_ids_are_a_pure_function_of_the_grid_values():
    point = {"mixer": "baseconv,based", "d_model": 64, "lr": 3e-4, "seed": 1}
    assert run_id(point) == run_id(dict(point))
    assert run_id(point).startswith("baseconv+based_d64_lr0.0003_s1_")
    assert run_id(point) != run_id({**point, "mixer": "baseconv-based"})  # same readable part, other hash
    assert run_id(point) != run_id({**point, "seed": 2})


def test_bad_sweeps_are_usage_errors_naming_the_problem():
    with pytest.raises(UsageError, match="trainer option"):
        parse_sweep(TINY.replace("steps = 12", "stepz = 12"))
    with pytest.raises(UsageError, match="non-empty list"):
        parse_sweep(TINY.replace('seed = [0, 1]', "seed = 0"))
    with pytest.raises(UsageError, match="unknown mixer"):
        run_sweep(tiny(grid='[grid]\nmixer = ["atention"]\n'), "/nonexistent/never")


def test_every_preset_expands_and_builds():
    sizes = {name: len(expand(load_preset(name))) for name in PRESETS}
    assert sizes["ar-paper"] == 6 * 5 * 7 and sizes["mamba-dconv"] == 5 * 5 * 7
    for name in PRESETS:
        build_run(expand(load_preset(name))[0].as_dict())


def _rows_without_timing(path):
    with open(path, newline="") as handle:
        return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(handle)]


def test_interrupted_sweep_resumes_and_matches_an_uninterrupted_one(tmp_path):
    sweep = tiny()
    runs = expand(sweep)
    # interrupt the first run after 5 steps (a checkpoint at step 4)
    task, model_config, config = build_run(runs[0].as_dict())

    class Stop(Exception):
        pass

    def stop(step):
        if step == 5:
            raise Stop

    torch.set_num_threads(1)  # the sweep pins 1 thread per run; the interrupted part must match
    with pytest.raises(Stop):
        train(task, model_config, config, tmp_path / "a" / runs[0].run_id, progress=False, on_step=stop)
    messages = []
    run_sweep(sweep, tmp_path / "a", threads=1, log=messages.append)
    assert "4 to run" in messages[0]
    run_sweep(sweep, tmp_path / "b", threads=1, log=lambda m: None)
    for run in runs:
        a = hookmech.load(tmp_path / "a" / run.run_id / "model.safetensors").state_dict()
        b = hookmech.load(tmp_path / "b" / run.run_id / "model.safetensors").state_dict()
        assert a and a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert _rows_without_timing(tmp_path / "a" / "results.csv") == _rows_without_timing(tmp_path / "b" / "results.csv")
    # a second pass retrains nothing
    before = (tmp_path / "a" / runs[1].run_id / "summary.json").stat().st_mtime_ns
    messages.clear()
    run_sweep(sweep, tmp_path / "a", threads=1, log=messages.append)
    assert "4 already done, 0 to run" in messages[0]
    assert (tmp_path / "a" / runs[1].run_id / "summary.json").stat().st_mtime_ns == before


def test_results_csv_schema_nan_rows_and_mech_columns(tmp_path):
    sweep = tiny(extra='[mech]\nsites = ["L1.block_in"]\npositions = ["value", "query"]\nn = 16\n')
    runs = expand(sweep)
    nan_dir = tmp_path / runs[1].run_id  # a run that stopped on a NaN loss
    nan_dir.mkdir(parents=True)
    (nan_dir / "summary.json").write_text(json.dumps({"status": "nan", "steps": 7, "seconds": 1.0}))
    rows = run_sweep(sweep, tmp_path, threads=1, log=lambda m: None)
    with open(tmp_path / "results.csv", newline="") as handle:
        header = next(csv.reader(handle))
    assert header == ["run_id", "mixer", "d_model", "lr", "seed", "status", "dev_acc", "dev_p_answer", "steps",
                      "seconds", "mech_n", "mech_p_clean", "mech_p_corrupt", "mech_passes",
                      "attr:L1.block_in@value", "attr:L1.block_in@query"]
    table = read_results(tmp_path / "results.csv")
    assert [r["run_id"] for r in table] == [r.run_id for r in runs]  # grid order, not completion order
    assert table[1]["status"] == "nan" and table[1]["steps"] == 7 and table[1]["attr:L1.block_in@value"] is None
    finished = table[0]
    assert finished["status"] == "finished" and finished["steps"] == 12 and finished["mech_n"] == 16
    # the stored attribution is the engine's own number on the fixed mech batch
    from hookmech.mech import mech_batch
    from hookmech.patching import patch

    model = hookmech.load(tmp_path / runs[0].run_id / "model.safetensors")
    task = hookmech.tasks.from_checkpoint(tmp_path / runs[0].run_id / "model.safetensors")
    torch.set_num_threads(1)  # as the sweep's run (threads=1): the same computation
    records = patch(model, mech_batch(task, 0, 16), ["L1.block_in"], ["value"])
    expected = records[0]["attribution"]
    got = finished["attr:L1.block_in@value"]
    # the same computation; 1e-12 allows only for the CSV's decimal form of the number
    assert (got is None and expected is None) or got == pytest.approx(expected, abs=1e-12)
    assert rows[0]["dev_acc"] == finished["dev_acc"]


def test_a_run_that_diverges_becomes_a_nan_row(tmp_path):
    sweep = tiny(grid='[grid]\nmixer = ["attention"]\nlr = [1e12]\n')
    rows = run_sweep(sweep, tmp_path, threads=1, log=lambda m: None)
    if rows[0]["status"] != "nan":
        pytest.skip("this lr did not diverge here")
    assert read_results(tmp_path / "results.csv")[0]["status"] == "nan"


def _ray_available():
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _ray_available(), reason="ray is not installed (pip install 'hookmech[dist]')")
def test_local_and_ray_engines_write_the_same_results(tmp_path):
    sweep = tiny(extra='[mech]\npositions = ["value"]\nn = 16\n')
    run_sweep(sweep, tmp_path / "local", engine="local", workers=2, threads=1, log=lambda m: None)
    run_sweep(sweep, tmp_path / "ray", engine="ray", workers=2, threads=1, log=lambda m: None)
    assert _rows_without_timing(tmp_path / "local" / "results.csv") == _rows_without_timing(tmp_path / "ray" / "results.csv")


@pytest.mark.slow
def test_parallel_workers_write_the_results_of_one_worker(tmp_path):
    sweep = tiny()
    run_sweep(sweep, tmp_path / "one", workers=1, threads=1, log=lambda m: None)
    run_sweep(sweep, tmp_path / "two", workers=2, threads=1, log=lambda m: None)
    assert _rows_without_timing(tmp_path / "one" / "results.csv") == _rows_without_timing(tmp_path / "two" / "results.csv")


def test_ray_engine_without_ray_is_a_usage_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UsageError, match="needs Ray"):
        run_sweep(tiny(), tmp_path, engine="ray", threads=1, log=lambda m: None)


def _data_sweep(path, n_train=24, extra_grid=""):
    text = TINY.replace("n_train = 0", f'n_train = {n_train}\ndata = "{path}"')
    return parse_sweep(text.split("[grid]")[0] + '[grid]\nmixer = ["attention"]\nd_model = [8]\nlr = [3e-3]\n'
                       'seed = [0]\n' + extra_grid)


def test_a_sweeps_train_data_file_trains_as_train_given_its_rows(tmp_path):
    from hookmech.datasets import save_dataset
    from hookmech.fileio import sha256_of

    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    rows = task.sample(24, seed=7)
    path = save_dataset(rows, task, tmp_path / "rows.h5")
    sweep = _data_sweep(path)
    [row] = run_sweep(sweep, tmp_path / "runs", threads=1, log=lambda m: None)
    assert row["status"] == "finished"
    run = expand(sweep)[0]
    _, model_config, train_config = build_run(run.as_dict())
    train(task, model_config, train_config, tmp_path / "direct", progress=False, train_set=rows,
          train_set_sha256=sha256_of(path))
    swept = hookmech.load(tmp_path / "runs" / run.run_id / "model.safetensors").state_dict()
    for name, tensor in hookmech.load(tmp_path / "direct" / "model.safetensors").state_dict().items():
        assert torch.equal(tensor, swept[name]), name
    recorded = json.loads((tmp_path / "runs" / run.run_id / "run.json").read_text())
    assert recorded["train_set_sha256"] == sha256_of(path) and "data" not in recorded["train"]
    # a sampled set of the same seed is other data: the file is what trained the sweep's run
    train(task, model_config, train_config, tmp_path / "sampled", progress=False)
    sampled = hookmech.load(tmp_path / "sampled" / "model.safetensors").state_dict()
    assert not all(torch.equal(tensor, swept[name]) for name, tensor in sampled.items())


def test_a_train_data_file_that_does_not_fit_the_sweep_is_refused_before_training(tmp_path):
    from hookmech.datasets import save_dataset
    from hookmech.errors import HookmechError

    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    path = save_dataset(task.sample(24, seed=7), task, tmp_path / "rows.h5")
    other = hookmech.tasks.make("ar", vocab_size=20, num_kv_pairs=3)
    other_path = save_dataset(other.sample(24, seed=7), other, tmp_path / "other.h5")
    for sweep, message in [
        (_data_sweep(path, n_train=23), "holds 24 rows, but n_train is 23"),
        (_data_sweep(other_path), "holds task"),
        (_data_sweep(tmp_path / "absent.h5"), "no such dataset file"),
    ]:
        with pytest.raises(HookmechError, match=message):
            run_sweep(sweep, tmp_path / "runs", threads=1, log=lambda m: None)
        assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").glob("*/run.json"))
    with pytest.raises(UsageError, match=r"\[grid\] data"):
        _data_sweep(path, extra_grid='data = ["a.h5", "b.h5"]\n')
    with pytest.raises(UsageError, match=r"\[train\] data must be"):
        parse_sweep(TINY.replace("n_train = 0", "n_train = 24\ndata = 3"))
