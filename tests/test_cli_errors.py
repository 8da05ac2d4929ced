"""Bad input on the command line: one row per case, each one line on stderr with a non-zero exit.

Every row is (argv, expected exit code, a substring of the one-line message). `{tmp}` in an
argument is the test's temporary folder (`{tmpname}` its name), `{ckpt}` the bundled attention fixture. Add a row for every bad input found, so the list
only grows. Rows are grouped by what they protect; setups that need files made first live in
`SETUPS` (a function that prepares `{tmp}` before the command runs).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_cli

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "fixtures" / "attention_ar.safetensors"

TRAIN_SMALL = ["train", "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3",
               "--n-train", "0", "--steps", "4", "--d-model", "16", "--n-dev", "8", "--eval-every", "4"]


def _nothing(tmp: Path) -> None:
    """No setup."""


def _checkpoint_copy(tmp: Path) -> None:
    """{tmp}/m.safetensors: a copy of the attention fixture (an input a command could overwrite)."""
    (tmp / "m.safetensors").write_bytes(FIXTURE.read_bytes())


def _dataset(tmp: Path) -> None:
    """{tmp}/d.h5 and {tmp}/run/model.safetensors: dataset files of the small AR task."""
    from hookmech import tasks
    from hookmech.datasets import save_dataset

    task = tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    save_dataset(task.sample(8, seed=0), task, tmp / "d.h5")
    save_dataset(task.sample(8, seed=0), task, tmp / "run" / "model.safetensors")


def _runs_and_sweep_file(tmp: Path) -> None:
    """{tmp}/runs (a runs folder with results.csv) and {tmp}/s.toml, {tmp}/runs/sweep.json (sweep files)."""
    (tmp / "runs").mkdir()
    (tmp / "runs" / "results.csv").write_text("run_id,status\n")
    (tmp / "s.toml").write_text('name = "s"\n')
    (tmp / "runs" / "sweep.json").write_text('name = "s"\n')  # a sweep file where sweep writes its own


def _cache_of_mamba(tmp: Path) -> None:
    """{tmp}/mamba.h5: a small cache of the Mamba fixture (another model than {ckpt}'s)."""
    import hookmech
    from hookmech.cache import write_cache

    path = FIXTURE.parent / "mamba_ar.safetensors"
    model, task = hookmech.load(path), hookmech.tasks.from_checkpoint(path)
    write_cache(model, task.sample(4, seed=0), tmp / "mamba.h5", ["blocks.1.hook_resid_pre"], task_spec=task.spec)


#: setups by name: each prepares files under the test's temporary folder
SETUPS = {"none": _nothing, "checkpoint copy": _checkpoint_copy, "dataset": _dataset,
          "runs and sweep file": _runs_and_sweep_file, "cache of mamba": _cache_of_mamba}

#: (id, setup, argv, exit code, message substring)
ROWS_USAGE = [
    ("unknown-mixer", "none", [*TRAIN_SMALL, "--mixer", "nosuch", "-o", "{tmp}/r"], 2, "unknown mixer 'nosuch'"),
    ("unknown-site", "none", ["patch", "--ckpt", "{ckpt}", "--site", "L9.block_in", "--pos", "value"], 2,
     "L9.block_in"),
]

#: files: an output that is one of the command's inputs, a cache of another model
ROWS_FILES = [
    ("cache-out-is-ckpt", "checkpoint copy", ["cache", "--ckpt", "{tmp}/m.safetensors", "--n", "4", "-o", "{tmp}/m.safetensors"],
     2, "which is the input --ckpt"),
    ("cache-out-is-ckpt-other-spelling", "checkpoint copy",
     ["cache", "--ckpt", "{tmp}/m.safetensors", "--n", "4", "-o", "{tmp}/../{tmpname}/./m.safetensors"], 2, "which is the input --ckpt"),
    ("patch-per-example-is-ckpt", "checkpoint copy",
     ["patch", "--ckpt", "{tmp}/m.safetensors", "--site", "L1.block_in", "--pos", "value", "--n", "4",
      "--per-example", "{tmp}/m.safetensors"], 2, "--per-example would write"),
    ("patch-per-example-is-data", "dataset",
     ["patch", "--ckpt", "{ckpt}", "--site", "L1.block_in", "--pos", "value", "--data", "{tmp}/d.h5",
      "--per-example", "{tmp}/d.h5"], 2, "which is the input --data"),
    ("train-out-is-data", "dataset", ["train", "--data", "{tmp}/d.h5", "--steps", "2", "-o", "{tmp}/d.h5"], 2,
     "is a file"),
    ("train-writes-over-data", "dataset", ["train", "--data", "{tmp}/run/model.safetensors", "--steps", "2", "-o", "{tmp}/run"],
     2, "which is the input --data"),
    ("report-out-is-runs", "runs and sweep file", ["report", "{tmp}/runs", "-o", "{tmp}/runs"], 2, "which is the input RUNS_DIR"),
    ("report-out-is-results", "runs and sweep file", ["report", "{tmp}/runs", "-o", "{tmp}/runs/results.csv"], 2,
     "is a file"),
    ("sweep-out-is-sweep-file", "runs and sweep file", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/s.toml"], 2,
     "is a file"),
    ("sweep-file-is-runs-sweep-json", "runs and sweep file", ["sweep", "{tmp}/runs/sweep.json", "-o", "{tmp}/runs"], 2,
     "which is the input SWEEP_FILE"),
    ("patch-cache-of-another-model", "cache of mamba",
     ["patch", "--ckpt", "{ckpt}", "--cache", "{tmp}/mamba.h5", "--site", "L1.block_in", "--pos", "value"], 1,
     "was made from another model than"),
]

ALL_ROWS = ROWS_USAGE + ROWS_FILES


def _expand(argv: list[str], tmp: Path) -> list[str]:
    return [arg.replace("{tmp}", str(tmp)).replace("{tmpname}", tmp.name).replace("{ckpt}", str(FIXTURE)) for arg in argv]


@pytest.mark.parametrize(("setup", "argv", "code", "message"), [row[1:] for row in ALL_ROWS],
                         ids=[row[0] for row in ALL_ROWS])
def test_bad_input_is_one_line_and_an_exit_code(setup, argv, code, message, tmp_path, capsys):
    SETUPS[setup](tmp_path)
    got_code, _, err = run_cli(_expand(argv, tmp_path), capsys)
    lines = err.strip().splitlines()
    assert got_code == code, err
    assert len(lines) == 1, err
    assert lines[0].startswith("hookmech: error: "), err
    assert message in lines[0], err
    assert "Traceback" not in err and "unexpected" not in err, err


def test_every_row_has_a_unique_id():
    ids = [row[0] for row in ALL_ROWS]
    assert ids and len(ids) == len(set(ids))
