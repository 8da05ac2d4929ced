"""`hookmech evaluate` refuses bad input in one line on stderr, exit 2, before it writes anything
(no -o folder appears), and a folder that holds another evaluation. Rows of (id, argv, message
substring); `{tmp}` is the test's temporary folder."""
from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import run_cli

OUT = ["-o", "{tmp}/e"]
ROWS = [
    ("no-model", ["evaluate", *OUT], "give --mixer SPEC or --arch PRESET (one of them)"),
    ("both", ["evaluate", "--mixer", "attention", "--arch", "mamba", *OUT], "give --mixer SPEC or --arch PRESET"),
    ("suite", ["evaluate", "--mixer", "attention", "--suite", "quik", *OUT], "unknown suite 'quik'"),
    ("budget", ["evaluate", "--mixer", "attention", "--budget-hours", "0", *OUT], "--budget-hours must be a number"),
    ("budget-nan", ["evaluate", "--mixer", "attention", "--budget-hours", "nan", *OUT], "--budget-hours must be"),
    ("mixer", ["evaluate", "--mixer", "atention", *OUT], "atention"),
    ("mixer-file", ["evaluate", "--mixer", "nosuch.py:A", *OUT], "no such file"),
    ("arch", ["evaluate", "--arch", "mambo", *OUT], "unknown model preset 'mambo'"),
    ("address", ["evaluate", "--mixer", "attention", "--address", "auto", *OUT], "--address needs --engine ray"),
    ("workers", ["evaluate", "--mixer", "attention", "--workers", "0", *OUT], "--workers must be >= 1"),
    ("option", ["evaluate", "--mixer", "attention", "--mixer-opt", "nosuch=1", *OUT], "nosuch"),
    ("option-pair", ["evaluate", "--mixer", "attention", "--mixer-opt", "window", *OUT], "--mixer-opt expects K=V"),
    ("empty-name", ["evaluate", "--mixer", "", *OUT], "--mixer"),
    ("lr-zero", ["evaluate", "--mixer", "attention", "--lr", "0", *OUT], "--lr must be a number > 0, got 0.0"),
    ("lr-nan", ["evaluate", "--mixer", "attention", "--lr", "nan", *OUT], "--lr must be a number > 0"),
    ("lr-twice", ["evaluate", "--mixer", "attention", "--lr", "1e-3", "--lr", "0.001", *OUT], "--lr repeats a rate"),
    ("model-setting", ["evaluate", "--mixer", "attention", "--mixer-opt", "d_model=32", *OUT],
     "--mixer-opt d_model: d_model is a model setting the suite fixes, not a mixer option"),
    ("layer-model-setting", ["evaluate", "--mixer", "attention", "--mixer-opt", "L1.mixer=mamba", *OUT],
     "mixer is a model setting the suite fixes"),
    ("gpus-per-run-negative", ["evaluate", "--mixer", "attention", "--gpus-per-run", "-1", "--budget-hours", "0.0001",
                               *OUT], "--gpus-per-run must be a number >= 0, got -1.0"),
    ("gpus-per-run-without-ray", ["evaluate", "--mixer", "attention", "--gpus-per-run", "1", "--budget-hours",
                                  "0.0001", *OUT], "--gpus-per-run needs --engine ray"),
    ("layer-past-the-models", ["evaluate", "--mixer", "attention", "--mixer-opt", "L5.window=2", *OUT],
     "--mixer-opt L5.window: layer 5 does not exist (the model has 2 layers)"),
]
if importlib.util.find_spec("ray") is None:  # the dist extra absent: --engine ray says how to get it
    ROWS.append(("no-dist-extra", ["evaluate", "--mixer", "attention", "--engine", "ray", *OUT],
                 "--engine ray needs Ray: pip install 'hookmech[dist]'"))


@pytest.mark.parametrize(("argv", "message"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_is_one_line_and_writes_nothing(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli([arg.format(tmp=tmp_path) for arg in argv], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("hookmech: error: "), err
    assert message in err
    assert not (tmp_path / "e").exists()


def test_a_folder_holding_another_evaluation_is_refused(tmp_path, capsys):
    (tmp_path / "e").mkdir()
    held = {"suite": "quick", "model": {"mixer": "mamba"}, "mixer_options": {}}
    (tmp_path / "e" / "evaluate.json").write_text(json.dumps(held))
    code, out, err = run_cli(["evaluate", "--mixer", "attention", "-o", tmp_path / "e"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "holds the evaluation of mamba on suite quick, not attention on suite quick; give another -o" in err
    assert json.loads((tmp_path / "e" / "evaluate.json").read_text()) == held
    assert sorted(path.name for path in (tmp_path / "e").iterdir()) == ["evaluate.json"]


def test_an_output_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "e").write_text("mine")
    code, out, err = run_cli(["evaluate", "--mixer", "attention", "-o", tmp_path / "e"], capsys)
    assert code == 2 and "is a file; give a folder" in err and (tmp_path / "e").read_text() == "mine"
