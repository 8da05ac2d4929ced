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

#: (id, setup, argv, exit code, message substring)
ROWS_USAGE = [
    ("unknown-mixer", "none", [*TRAIN_SMALL, "--mixer", "nosuch", "-o", "{tmp}/r"], 2, "unknown mixer 'nosuch'"),
    ("unknown-site", "none", ["patch", "--ckpt", "{ckpt}", "--site", "L9.block_in", "--pos", "value"], 2,
     "L9.block_in"),
]

ALL_ROWS = ROWS_USAGE


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


@pytest.mark.parametrize(("error", "words"), [
    (PermissionError(13, "Permission denied", "/ro/d.h5"), "/ro/d.h5: Permission denied"),
    (FileNotFoundError(2, "No such file or directory", "/gone/d.h5"), "/gone/d.h5: No such file or directory"),
    (IsADirectoryError(21, "Is a directory", "/out/d.h5"), "/out/d.h5: Is a directory"),
    (NotADirectoryError(20, "Not a directory", "/file/d.h5"), "/file/d.h5: Not a directory"),
    (FileExistsError(17, "File exists", "/out"), "/out: File exists"),
    (OSError(28, "No space left on device", "/full/d.h5"), "/full/d.h5: No space left on device"),
    (OSError(28, "No space left on device"), "No space left on device"),
    (OSError(30, "Read-only file system", "/ro/d.h5"), "/ro/d.h5: Read-only file system"),
], ids=["permission", "not-found", "is-a-directory", "not-a-directory", "exists", "no-space", "no-space-no-name",
        "read-only"])
def test_os_errors_the_user_can_fix_are_one_plain_line(error, words, monkeypatch, capsys):
    """Writing an output the system refuses (root runs these tests, so the refusal is simulated)."""
    import hookmech.datasets

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(hookmech.datasets, "save_dataset", refuse)
    code, _, err = run_cli(["data", "ar", "--n", "4", "-o", "/ro/d.h5"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0] == f"hookmech: error: {words}", err


def test_other_os_errors_are_still_unexpected(monkeypatch, capsys):
    import hookmech.datasets

    def fail(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(hookmech.datasets, "save_dataset", fail)
    code, _, err = run_cli(["data", "ar", "--n", "4", "-o", "/x/d.h5"], capsys)
    assert code == 1 and "unexpected" in err and len(err.strip().splitlines()) == 1, err
