"""The `train`, `sweep` and `report` commands: options that reach the trainer (`--mech-*`), a
locked run folder, sweep dry runs and presets, a report without results."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from hookmech.cli.main import cli
from hookmech.errors import HookmechError, UsageError
from hookmech.sweep import expand, parse_sweep

from helpers import run_cli
from test_sweep import TINY, tiny


# -- train -------------------------------------------------------------------------------------
def test_cli_train_mech_every_writes_attributions(tmp_path):
    args = ["train", "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3", "--n-train", "0",
            "--steps", "8", "--d-model", "16", "--n-dev", "16", "--batch-size", "8", "--eval-every", "4",
            "--mech-pos", "key,value", "-o", str(tmp_path / "run")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # default K: every second evaluation (steps 8), not step 4
    assert [line["step"] for line in lines if {"attr:L1.block_in@key", "attr:L1.block_in@value"} <= set(line)] == [8]
    assert [line["step"] for line in lines] == [4, 8]
    result = CliRunner().invoke(cli, args[:-2] + ["--mech-every", "6", "-o", str(tmp_path / "bad")])
    assert isinstance(result.exception, UsageError)


def test_cli_train_into_a_locked_folder_is_one_line_naming_the_pid(tmp_path, holder, capsys):
    process = holder(tmp_path / "r")
    code, out, err = run_cli(["train", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3", "--n-train",
                              "0", "--steps", "2", "--d-model", "8", "--n-dev", "8", "-o", str(tmp_path / "r")], capsys)
    assert code == 1 and err.count("\n") == 1 and err.startswith("hookmech: error: run folder ")
    assert f"in use by process {process.pid}" in err and "Traceback" not in err


def test_cli_train_schedule_reaches_the_trainer(tmp_path, capsys):
    args = ["train", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3", "--n-train", "0", "--steps", "20",
            "--d-model", "8", "--n-dev", "8", "--eval-every", "1"]
    code, _, err = run_cli([*args, "--schedule", "hf-cosine", "-o", str(tmp_path / "hf")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "hf" / "run.json").read_text())["train"]["schedule"] == "hf-cosine"
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    # warm-up int(0.1·20) = 2 steps at lr·t/2 (step 0 at lr 0), then cosine over the other 18
    assert lrs[:3] == pytest.approx([0.0, 0.5e-3, 1e-3])
    assert lrs[19] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 17 / 18)))
    code, _, err = run_cli([*args, "--schedule", "linear", "-o", str(tmp_path / "bad")], capsys)
    assert code == 2 and "--schedule" in err and "Traceback" not in err


# -- sweep -------------------------------------------------------------------------------------
def test_cli_sweep_dry_run_and_errors(tmp_path):
    sweep_file = tmp_path / "tiny.toml"
    sweep_file.write_text(TINY)
    result = CliRunner().invoke(cli, ["sweep", str(sweep_file), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert [line for line in result.stdout.splitlines()] == [r.run_id for r in expand(tiny())]
    result = CliRunner().invoke(cli, ["sweep", "--show-preset", "ar-cpu"])
    assert result.exit_code == 0 and parse_sweep(result.stdout).name == "ar-cpu"
    result = CliRunner().invoke(cli, ["sweep", "--preset", "ar-cpux", "-o", str(tmp_path / "r")])
    assert isinstance(result.exception, UsageError) and "ar-cpu" in str(result.exception)


# -- report ------------------------------------------------------------------------------------
def test_cli_report_needs_results(tmp_path):
    result = CliRunner().invoke(cli, ["report", str(tmp_path), "-o", str(tmp_path / "out")])
    assert isinstance(result.exception, HookmechError) and "results.csv" in str(result.exception)
