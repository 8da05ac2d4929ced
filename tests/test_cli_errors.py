"""Bad input on the command line: one row per case, each one line on stderr with a non-zero exit.

Every row is (argv, expected exit code, a substring of the one-line message). `{tmp}` in an
argument is the test's temporary folder, `{ckpt}` the bundled attention fixture. Add a row for every bad input found, so the list
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


#: setups by name: each prepares files under the test's temporary folder
SETUPS = {"none": _nothing}

# -- run, sweep and report folders -----------------------------------------------------------
#: processes started by setups (holding folder locks); stopped after each test
_HOLDERS: list = []

SWEEP_SMALL = """
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
d_model = [8]
seed = [0, 1]
"""


@pytest.fixture(autouse=True)
def _stop_lock_holders():
    yield
    from lock_holder import stop_lock_holder

    while _HOLDERS:
        stop_lock_holder(_HOLDERS.pop())


def _hold_lock(folder: Path) -> None:
    from lock_holder import start_lock_holder

    _HOLDERS.append(start_lock_holder(folder))


def _sweep_file(tmp: Path, mech: str | None = None) -> None:
    (tmp / "s.toml").write_text(SWEEP_SMALL + (f"[mech]\n{mech}\n" if mech is not None else ""))


def _runs_with_results(tmp: Path) -> None:
    from hookmech.sweep import write_results

    (tmp / "runs").mkdir()
    write_results([{"run_id": "a", "d_model": 8, "seed": 0, "status": "finished", "dev_acc": 1.0, "dev_p_answer": 0.9,
                    "steps": 4, "seconds": 1.0}], tmp / "runs" / "results.csv")


SETUPS.update({
    "locked-run": lambda tmp: _hold_lock(tmp / "r"),
    "locked-runs": lambda tmp: (_sweep_file(tmp), _hold_lock(tmp / "runs")),
    "sweep-mech-site": lambda tmp: _sweep_file(tmp, 'sites = ["L9.block_in"]'),
    "sweep-mech-position": lambda tmp: _sweep_file(tmp, 'positions = ["value", "nosuchrole"]'),
    "sweep-mech-every": lambda tmp: _sweep_file(tmp, "every = 3"),
    "sweep-mech-n": lambda tmp: _sweep_file(tmp, 'n = "many"'),
    "runs-with-results": _runs_with_results,
})

#: (id, setup, argv, exit code, message substring)
ROWS_USAGE = [
    ("unknown-mixer", "none", [*TRAIN_SMALL, "--mixer", "nosuch", "-o", "{tmp}/r"], 2, "unknown mixer 'nosuch'"),
    ("unknown-site", "none", ["patch", "--ckpt", "{ckpt}", "--site", "L9.block_in", "--pos", "value"], 2,
     "L9.block_in"),
]

#: run folders, sweeps and reports: refused before anything is trained or drawn
ROWS_RUNS = [
    ("train-into-a-locked-run-folder", "locked-run", [*TRAIN_SMALL, "-o", "{tmp}/r"], 1, "/r is in use by process"),
    ("sweep-into-a-locked-runs-folder", "locked-runs", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 1,
     "/runs is in use by process"),
    ("sweep-mech-unknown-site", "sweep-mech-site", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2, "L9.block_in"),
    ("sweep-dry-run-mech-unknown-site", "sweep-mech-site", ["sweep", "{tmp}/s.toml", "--dry-run"], 2, "L9.block_in"),
    ("sweep-mech-unknown-position", "sweep-mech-position", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     "unknown position 'nosuchrole'"),
    ("sweep-mech-every-off-the-evaluations", "sweep-mech-every", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     "[mech] every 3 must be a multiple of eval_every 2"),
    ("sweep-mech-n-not-a-number", "sweep-mech-n", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     "[mech] n must be an integer >= 1"),
    ("report-unknown-run", "runs-with-results", ["report", "{tmp}/runs", "--run", "nosuchrun", "-o", "{tmp}/R"], 2,
     "unknown run 'nosuchrun'"),
    ("report-into-a-folder-that-is-not-a-report", "runs-with-results",
     ["report", "{tmp}/runs", "--no-heatmaps", "-o", "{tmp}/runs"], 2, "is not a report folder (it holds results.csv)"),
]

ALL_ROWS = ROWS_USAGE + ROWS_RUNS


def _expand(argv: list[str], tmp: Path) -> list[str]:
    return [arg.replace("{tmp}", str(tmp)).replace("{ckpt}", str(FIXTURE)) for arg in argv]


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
