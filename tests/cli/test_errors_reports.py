"""`hookmech report` and `hookmech view` on sweep folders: bad files are one line on stderr with a
non-zero exit; valid folders (a grid of seeds only, a run without its model, a read-only copy)
give a report and a page, say what they leave out, and write nothing into the folder they read.

The table has the shape of tests/cli/test_errors.py: rows of (id, setup, argv, exit code, a
substring of the one-line message); `{tmp}` is the test's temporary folder. Every row runs
through both commands (`COMMANDS`): they read a sweep folder with the same checks.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ATTENTION_FIXTURE as FIXTURE, run_cli

HEADER = "run_id,d_model,seed,status,dev_acc,dev_p_answer,steps,seconds"


def _runs(tmp: Path, results: str | bytes | None = None, *, sweep_json: str | None = None, model: bool = False) -> Path:
    """{tmp}/runs: results.csv (`results`, default two finished runs a and b), run folders a and b
    with a metrics.jsonl (and the attention fixture as model.safetensors with `model`), and
    sweep.json (`sweep_json`) if given."""
    runs = tmp / "runs"
    runs.mkdir()
    if results is None:
        results = f"{HEADER}\na,8,0,finished,0.5,0.4,4,1.0\nb,8,1,finished,0.75,0.6,4,1.0\n"
    (runs / "results.csv").write_bytes(results if isinstance(results, bytes) else results.encode())
    for run_id in ("a", "b"):
        (runs / run_id).mkdir()
        line = {"step": 4, "loss": 1.0, "dev_acc": 0.5, "dev_p_answer": 0.4, "attr:L1.block_in@value": 0.5}
        (runs / run_id / "metrics.jsonl").write_text(json.dumps(line) + "\n")
        if model:
            shutil.copyfile(FIXTURE, runs / run_id / "model.safetensors")
    if sweep_json is not None:
        (runs / "sweep.json").write_text(sweep_json)
    return runs


def _results(*rows: str, header: str = HEADER):
    return lambda tmp: _runs(tmp, "\n".join([header, *rows]) + "\n")


def _truncated_metrics(tmp: Path) -> None:
    runs = _runs(tmp)
    with open(runs / "b" / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 8, "loss": 0.')  # a line cut short


def _truncated_heatmap_cache(tmp: Path) -> None:
    """An earlier report in {tmp}/rep whose heatmap_b.json (the records it keeps) is cut short."""
    _runs(tmp, model=True)
    (tmp / "rep").mkdir()
    (tmp / "rep" / "report.md").write_text("# Report\n")
    (tmp / "rep" / "heatmap_b.json").write_text('{"n": 4, "seed": 0, "records": [{"site": "L0.bl')


#: setups by name: each prepares files under the test's temporary folder
SETUPS = {
    "not utf-8": lambda tmp: _runs(tmp, f"{HEADER}\na,8,0,finished,0.5,0.4,4,1.0\n".encode() + b"\xff\xfe,8,1\n"),
    "a png": lambda tmp: _runs(tmp, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x01\x00"),
    "empty": lambda tmp: _runs(tmp, ""),
    "header only": lambda tmp: _runs(tmp, HEADER + "\n"),
    "prose": lambda tmp: _runs(tmp, "these are my notes\nnot a table\n"),
    "no status": _results("a,8,0,0.5", header="run_id,d_model,seed,dev_acc"),
    "no dev_acc": _results("a,8,0,finished", header="run_id,d_model,seed,status"),
    "junk accuracy": _results("a,8,0,finished,abc,0.4,4,1.0"),
    "accuracy 7.5": _results("a,8,0,finished,7.5,0.4,4,1.0"),
    "inf probability": _results("a,8,0,finished,0.5,inf,4,1.0"),
    "junk d_model": _results("a,eight,0,finished,0.5,0.4,4,1.0"),
    "finished without dev_acc": _results("a,8,0,finished,,0.4,4,1.0"),
    "extra cells": _results("a,8,0,finished,0.5,0.4,4,1.0,surplus"),
    "short row": _results("a,8,0,finished"),
    "run id climbing out": _results("../../etc,8,0,finished,0.5,0.4,4,1.0"),
    "empty run id": _results(",8,0,finished,0.5,0.4,4,1.0"),
    "run id twice": _results("a,8,0,finished,0.5,0.4,4,1.0", "a,8,1,finished,0.5,0.4,4,1.0"),
    "numeric status": _results("a,8,0,3,0.5,0.4,4,1.0"),
    "junk mech_passes": _results("a,8,0,finished,0.5,0.4,4,1.0,maybe", header=HEADER + ",mech_passes"),
    "truncated sweep.json": lambda tmp: _runs(tmp, sweep_json='{"name": "s", "grid": {"se'),
    "sweep.json a list": lambda tmp: _runs(tmp, sweep_json="[1, 2]"),
    "sweep.json name a number": lambda tmp: _runs(tmp, sweep_json='{"name": 5, "grid": {"seed": [0, 1]}}'),
    "sweep.json of another grid": lambda tmp: _runs(tmp, sweep_json='{"name": "s", "grid": {"arch": ["x"]}}'),
    "truncated metrics.jsonl": _truncated_metrics,
}

RESULTS = "{tmp}/runs/results.csv"
#: (id, setup, arguments after the command, exit code, message substring)
ROWS = [
    ("results-not-utf-8", "not utf-8", [], 1, f"{RESULTS}: not a results table (line 3: byte 0xff is not UTF-8 text)"),
    ("results-a-png", "a png", [], 1, f"{RESULTS}: not a results table (line 1: byte 0x89 is not UTF-8"),
    ("results-empty", "empty", [], 1, f"{RESULTS} is empty"),
    ("results-no-runs", "header only", [], 1, f"{RESULTS} has no runs"),
    ("results-prose", "prose", [], 1, f"{RESULTS} lacks the column run_id (its header: these are my notes)"),
    ("results-no-status", "no status", [], 1, f"{RESULTS} lacks the column status"),
    ("results-no-dev-acc", "no dev_acc", [], 1, f"{RESULTS} lacks the column dev_acc"),
    ("results-junk-accuracy", "junk accuracy", [], 1, f"{RESULTS} line 2 (run a): dev_acc 'abc' is not a number"),
    ("results-accuracy-above-1", "accuracy 7.5", [], 1, f"{RESULTS} line 2 (run a): dev_acc 7.5 is outside [0, 1]"),
    ("results-inf-probability", "inf probability", [], 1, "dev_p_answer 'inf' is not a number"),
    ("results-junk-d-model", "junk d_model", [], 1, "line 2 (run a): d_model 'eight' is not a number"),
    ("results-finished-without-accuracy", "finished without dev_acc", [], 1, "a finished run without dev_acc"),
    ("results-extra-cells", "extra cells", [], 1, f"{RESULTS} line 2: 9 cells, the header has 8"),
    ("results-short-row", "short row", [], 1, f"{RESULTS} line 2: 4 cells, the header has 8"),
    ("results-run-id-climbing-out", "run id climbing out", [], 1,
     "line 2: run_id '../../etc' is not the name of a run folder"),
    ("results-empty-run-id", "empty run id", [], 1, "line 2: run_id '' is not the name of a run folder"),
    ("results-run-id-twice", "run id twice", [], 1, "line 3: run_id 'a' appears twice"),
    ("results-numeric-status", "numeric status", [], 1, "status 3 is not a run status"),
    ("results-junk-mech-passes", "junk mech_passes", [], 1, "mech_passes 'maybe' is not true or false"),
    ("sweep-json-truncated", "truncated sweep.json", [], 1, "{tmp}/runs/sweep.json: not valid JSON"),
    ("sweep-json-a-list", "sweep.json a list", [], 1, "{tmp}/runs/sweep.json: expected a JSON object with a grid"),
    ("sweep-json-name-a-number", "sweep.json name a number", [], 1, "sweep.json: name 5 is not a string"),
    ("sweep-json-of-another-grid", "sweep.json of another grid", [], 1,
     f"{RESULTS} has no column arch, a grid key of {{tmp}}/runs/sweep.json"),
    ("metrics-truncated", "truncated metrics.jsonl", ["--run", "b"], 1,
     "{tmp}/runs/b/metrics.jsonl line 2: not valid JSON"),
]

#: each command with its output: rows run through both
COMMANDS = {"report": ["-o", "{tmp}/rep"], "view": ["-o", "{tmp}/page.html"]}


def _format(argv: list[str], tmp: Path) -> list[str]:
    return [arg.replace("{tmp}", str(tmp)) for arg in argv]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("setup", "args", "code", "words"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_a_bad_sweep_folder_is_one_line(command, setup, args, code, words, tmp_path, capsys):
    SETUPS[setup](tmp_path)
    argv = _format([command, "{tmp}/runs", "--no-heatmaps", *args, *COMMANDS[command]], tmp_path)
    got, _, err = run_cli(argv, capsys)
    lines = err.strip().splitlines()
    assert got == code and len(lines) == 1, err
    assert _format([words], tmp_path)[0] in lines[0] and "unexpected" not in lines[0], err
    assert not (tmp_path / "rep").exists() and not (tmp_path / "page.html").exists()


def test_a_cut_short_heatmap_cache_of_an_earlier_report_is_one_line(tmp_path, capsys):
    _truncated_heatmap_cache(tmp_path)
    argv = _format(["report", "{tmp}/runs", "--run", "b", "--n", "4", "-o", "{tmp}/rep"], tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and len(err.strip().splitlines()) == 2, err  # "heatmap b", then the error
    assert err.strip().splitlines()[-1].startswith(f"hookmech: error: {tmp_path}/rep/heatmap_b.json: not valid JSON")


def test_rows_have_unique_ids():
    ids = [row[0] for row in ROWS]
    assert ids and len(ids) == len(set(ids)) and all(row[1] in SETUPS for row in ROWS)


# -- valid sweep folders ---------------------------------------------------------------------
SEEDS_ONLY = """
name = "seeds only"
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
[grid]
seed = [0, 1]
"""


@pytest.fixture(scope="module")
def seeds_only(tmp_path_factory):
    """A trained sweep whose grid varies only the seed (no lr or d_model column in results.csv)."""
    from hookmech.sweep import parse_sweep, run_sweep

    runs = tmp_path_factory.mktemp("seeds") / "runs"
    run_sweep(parse_sweep(SEEDS_ONLY), runs, threads=1, log=lambda message: None)
    return runs


def _snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under `folder` (itself included): its kind, mode, mtime and bytes (files)."""
    entries = {}
    for path in [folder, *sorted(folder.rglob("*"))]:
        stat = path.lstat()
        data = path.read_bytes() if path.is_file() else None
        entries[str(path.relative_to(folder))] = (stat.st_mode, stat.st_mtime_ns, stat.st_size, data)
    return entries


@pytest.fixture
def read_only_seeds(seeds_only, tmp_path):
    """A read-only copy of `seeds_only` (chmod -R a-w; root writes anyway, hence `_snapshot`)."""
    runs = tmp_path / "runs"
    shutil.copytree(seeds_only, runs)
    for path in [runs, *runs.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    yield runs
    for path in [runs, *runs.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)


def test_report_and_view_of_a_grid_of_seeds_only_read_a_read_only_copy_and_write_nothing_into_it(
    read_only_seeds, tmp_path, capsys
):
    from hookmech.view import read_page_data

    before = _snapshot(read_only_seeds)
    rows = (read_only_seeds / "results.csv").read_text().splitlines()
    assert rows[0].startswith("run_id,seed,status,") and "lr" not in rows[0].split(",")

    code, out, err = run_cli(["report", read_only_seeds, "--n", 4, "-o", tmp_path / "rep"], capsys)
    assert code == 0, err
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "No learning-rate figure: results.csv has no lr." in text
    # no d_model column either: the runs' run.json give it (the trainer's default width)
    assert "![accuracy vs d_model](accuracy_vs_d_model.png)" in text
    assert "| all | 64 |" in text
    assert text.count("![heatmap ") == 1
    kept = list((tmp_path / "rep").glob("heatmap_*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["n"] == 4  # beside the output, not in the runs

    code, out, err = run_cli(["view", read_only_seeds, "--n", 4, "-o", tmp_path / "page.html"], capsys)
    assert code == 0, err
    data = read_page_data(tmp_path / "page.html")
    assert data["lr_curves"] == [] and len(data["summary"]) == 1 and data["summary"][0]["series"] == "all"
    assert data["selected"][0]["heatmap"] == json.loads(kept[0].read_text())["records"]  # the same numbers

    assert _snapshot(read_only_seeds) == before


def test_a_report_reuses_its_own_heatmap_records_and_only_for_the_same_model_n_and_seed(seeds_only, tmp_path, capsys,
                                                                                       monkeypatch):
    import hookmech.report

    computed = []
    original = hookmech.report.heatmap_records
    monkeypatch.setattr(hookmech.report, "heatmap_records",
                        lambda *args: computed.append(args[1:]) or original(*args))
    out = tmp_path / "rep"
    for n in (4, 4, 5):
        code, _, err = run_cli(["report", seeds_only, "--n", n, "-o", out], capsys)
        assert code == 0, err
    assert computed == [(4, 1), (5, 1)]  # the default seed of the examples


def _without_model_or_folder(tmp: Path) -> Path:
    """Runs a (its model file gone) and b (in results.csv, its folder gone), both finished."""
    runs = _runs(tmp, model=True)
    (runs / "a" / "model.safetensors").unlink()
    shutil.rmtree(runs / "b")
    return runs


@pytest.mark.parametrize(("run", "reason"), [
    ("a", "{runs}/a/model.safetensors does not exist and no bundled fixture holds this run's weights (retrain "
          "it, or view its checkpoint with hookmech view --ckpt FILE)"),
    ("b", "results.csv names it but {runs}/b does not exist"),
])
def test_a_run_without_its_model_or_folder_is_named_in_the_output_and_the_report(run, reason, tmp_path, capsys):
    from hookmech.view import read_page_data

    runs = _without_model_or_folder(tmp_path)
    reason = reason.format(runs=runs)
    code, _, err = run_cli(["report", runs, "--run", run, "--n", 4, "-o", tmp_path / "rep"], capsys)
    assert code == 0, err
    assert f"no heatmap for {run}: {reason}" in err
    assert f"No heatmap for {run}: {reason}." in (tmp_path / "rep" / "report.md").read_text()
    code, _, err = run_cli(["view", runs, "--run", run, "--n", 4, "-o", tmp_path / "page.html"], capsys)
    assert code == 0, err
    assert f"no heatmap for {run}: {reason}" in err
    assert read_page_data(tmp_path / "page.html")["selected"][0]["no_heatmap"] == reason


def test_a_cut_short_heatmap_json_left_in_a_run_folder_is_not_read(tmp_path, capsys):
    """Earlier releases kept heatmap.json in the run folders; reports no longer read (or write) them."""
    runs = _runs(tmp_path, model=True)
    (runs / "b" / "heatmap.json").write_text('{"n": 4, "seed": 0, "records": [{"site": "L0.bl')
    code, _, err = run_cli(["report", runs, "--run", "b", "--n", 4, "-o", tmp_path / "rep"], capsys)
    assert code == 0, err
    assert (tmp_path / "rep" / "heatmap_b.png").exists()


# -- a report killed while it builds -----------------------------------------------------------
_KILLED_REPORT = """
import sys
import hookmech.report as report

def stop(self, *args, **kwargs):
    print("building", flush=True)
    sys.stdin.read()  # until killed

report._Report.write = stop
report.build_report(sys.argv[1], sys.argv[2], heatmaps=False)
"""


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_rerun_removes_what_a_report_killed_with_sigkill_left_and_nothing_else(tmp_path, capsys):
    from hookmech.fileio import temp_prefix

    runs = _runs(tmp_path)
    out = tmp_path / "rep"
    killed = subprocess.Popen([sys.executable, "-c", _KILLED_REPORT, str(runs), str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout.readline().strip() == "building"
        left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".rep.")]
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        killed.stdout.close()
    assert len(left) == 1 and left[0].startswith(f".rep.{killed.pid}@") and left[0].endswith(".tmp")
    # beside it: a running report's folder (this process is alive), another report's, an unrelated one
    keep = [temp_prefix(out) + "abcd1234.tmp", temp_prefix(tmp_path / "other") + "abcd1234.tmp", ".rep.abcd1234.tmp"]
    keep.append(f".other.{_dead_pid()}@{temp_prefix(out).split('@')[1]}abcd1234.tmp")
    for name in keep:
        (tmp_path / name).mkdir()
    code, _, err = run_cli(["report", runs, "--no-heatmaps", "-o", out], capsys)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted(keep)
    assert (out / "report.md").exists()


def test_a_report_killed_between_its_renames_gets_the_earlier_report_back(tmp_path):
    """Killed after moving the earlier report aside (".old") and before renaming the new one in."""
    from hookmech.fileio import temp_prefix
    from hookmech.report import _remove_stale_report_folders

    out = tmp_path / "rep"
    dead = temp_prefix(out).replace(f".{os.getpid()}@", f".{_dead_pid()}@")
    (tmp_path / f"{dead}abcd1234.old").mkdir()
    (tmp_path / f"{dead}abcd1234.old" / "report.md").write_text("# the earlier report\n")
    (tmp_path / f"{dead}efgh5678.tmp").mkdir()
    assert _remove_stale_report_folders(out) == [tmp_path / f"{dead}efgh5678.tmp"]
    assert [p.name for p in tmp_path.iterdir()] == ["rep"]
    assert (out / "report.md").read_text() == "# the earlier report\n"


def test_hostile_names_stay_text_in_report_md_and_the_figures(tmp_path, capsys):
    """A name holding "<!--" would hide the rest of report.md where markdown is rendered, "|" split
    its table, and "$...$" is a formula to matplotlib (an unknown symbol fails the drawing)."""
    from test_report import synthetic_rows

    from hookmech.sweep import write_results

    runs = tmp_path / "runs"
    runs.mkdir()
    name = r"<!--<script> $\nosuchsymbol$ [x](y)"
    rows = [{**row, "arch": "a|b $\\frac$"} if row["arch"] == "mamba" else row for row in synthetic_rows()]
    write_results(rows, runs / "results.csv")
    grid = {"arch": ["attention", "a|b $\\frac$"], "d_model": [16, 32], "lr": [1e-3, 1e-2], "seed": [0, 1]}
    (runs / "sweep.json").write_text(json.dumps({"name": name, "grid": grid}))
    code, _, err = run_cli(["report", runs, "--no-heatmaps", "-o", tmp_path / "rep"], capsys)
    assert code == 0, err
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "<" not in text and "# Report: &lt;!--&lt;script&gt; $\\nosuchsymbol$ \\[x\\](y)\n" in text
    assert "| a\\|b $\\frac$ | 16 |" in text
    assert len(list((tmp_path / "rep").glob("*.png"))) == 4
