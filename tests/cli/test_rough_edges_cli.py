"""The command line's side of the rough edges a new user hit (issue 29, section 2); the library's
side is in tests/test_rough_edges.py.

Bad input has the shape of tests/cli/test_errors.py: rows of (id, setup, argv, exit code, a
substring of the one-line message), `{tmp}` the test's temporary folder and `{ckpt}` the bundled
attention fixture. What the commands print and write otherwise is checked by the functions below.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ATTENTION_FIXTURE as FIXTURE
from helpers import run_cli

PATCH = ["patch", "--ckpt", "{ckpt}", "--n", "8"]


def _nothing(tmp: Path) -> None:
    """No setup."""


#: setups by name: each prepares files under the test's temporary folder
SETUPS = {"none": _nothing}

def _folder(tmp: Path) -> None:
    (tmp / "plots").mkdir()


SETUPS["folder"] = _folder
NODES = [*PATCH, "--site", "L1.block_in", "--pos", "key,value"]

ROWS = [
    ("path-resid-single-pair-never-meets", "none",
     [*PATCH, "--sender", "L0.block_out@key", "--receiver", "L1.block_in@value", "--via", "resid"], 2,
     "a resid path carries a position's value to the same position only"),
    ("patch-csv-and-json", "none", [*NODES, "--csv", "--json"], 2, "--csv or --json, not both"),
    ("patch-out-not-png", "none", [*NODES, "-o", "{tmp}/heatmap.csv"], 2,
     "-o writes the heatmap as PNG: give a file name ending in .png"),
    ("patch-out-a-folder", "folder", [*NODES, "-o", "{tmp}/plots"], 2, "plots is a folder; give the heatmap's file name"),
    ("patch-out-onto-the-checkpoint", "none", [*NODES, "-o", "{ckpt}"], 2, "-o writes the heatmap as PNG"),
    ("view-random-repeat-of-a-sweep", "folder", ["view", "{tmp}/plots", "--random-repeat-induction", "-o",
                                                 "{tmp}/p.html"], 2, "--random-repeat-induction belongs to checkpoint"),
]  # fmt: skip


def _expand(argv: list[str], tmp: Path) -> list[str]:
    return [str(arg).replace("{tmp}", str(tmp)).replace("{ckpt}", str(FIXTURE)) for arg in argv]


@pytest.mark.parametrize(("setup", "argv", "code", "message"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
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
    ids = [row[0] for row in ROWS]
    assert ids and len(ids) == len(set(ids))


# -- path patching: pairs left out are a note, not a row of zeros ---------------------------------
def test_a_resid_cross_product_prints_the_pairs_that_meet_and_one_note(capsys):
    argv = [*PATCH, "--sender", "L0.block_out@key", "--receiver", "L1.block_in@key,L1.block_in@value", "--via", "resid"]
    code, out, err = run_cli(_expand(argv, Path(".")), capsys)
    assert code == 0, err
    assert "L1.block_in@key" in out and "L1.block_in@value" not in out
    assert err.splitlines() == [
        "hookmech: note: 1 of 2 resid pairs left out: a resid path carries a position's value to the same "
        "position only, and their positions never coincide (e.g. L0.block_out@key -> L1.block_in@value)"
    ]


# -- one default seed of the examples -------------------------------------------------------------
@pytest.mark.parametrize("command", ["cache", "patch", "view", "report", "data"])
def test_commands_drawing_examples_default_to_the_one_examples_seed(command):
    from hookmech.cli.main import cli

    (seed,) = [param for param in cli.commands[command].params if param.name == "seed"]
    assert seed.default == 1, command  # hookmech.tasks.EXAMPLES_SEED, the demo's and the docs' seed


def test_patch_without_a_seed_is_patch_with_seed_1(capsys):
    argv = _expand([*PATCH, "--site", "L1.block_in", "--pos", "key,value", "--json"], Path("."))
    code, default, err = run_cli(argv, capsys)
    assert code == 0, err
    code, seed_1, err = run_cli([*argv, "--seed", "1"], capsys)
    assert code == 0, err
    assert default == seed_1


# -- progress bars on a terminal ------------------------------------------------------------------
def _terminal(monkeypatch):
    """Make the captured stderr say it is a terminal (the bars are drawn only then)."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


def test_patch_draws_a_bar_of_patches_on_a_terminal_only(capsys, monkeypatch):
    import re

    argv = _expand([*PATCH, "--site", "all", "--pos", "key,value"], Path("."))
    code, _, err = run_cli(argv, capsys)
    assert code == 0 and err == "", err
    _terminal(monkeypatch)
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert re.search(r"patching: 100%.* 28/28 \[.*patch", err), err


def test_a_path_patch_draws_a_bar_of_pairs(capsys, monkeypatch):
    import re

    _terminal(monkeypatch)
    argv = [*PATCH, "--sender", "L0.block_out@all", "--receiver", "L1.block_in@key,L1.block_in@value", "--via", "resid"]
    code, _, err = run_cli(_expand(argv, Path(".")), capsys)
    assert code == 0, err
    assert re.search(r"patching: 100%.* 22/22 \[.*patch", err), err  # 11 sender positions x 2 receivers


def test_view_draws_a_bar_of_patches(tmp_path, capsys, monkeypatch):
    import re

    _terminal(monkeypatch)
    code, _, err = run_cli(["view", "--ckpt", FIXTURE, "--n", "8", "--site", "L*.block_in", "-o", tmp_path / "p.html"],
                           capsys)
    assert code == 0, err
    assert re.search(r"patching: 100%.* 8/8 \[.*patch", err), err  # 2 sites x the 4 roles


def test_das_counts_steps_not_examples(tmp_path, capsys, monkeypatch):
    import re

    code, _, err = run_cli(["cache", "--ckpt", FIXTURE, "--n", "40", "--sites", "L1.block_in", "-o", tmp_path / "c.h5"],
                           capsys)
    assert code == 0, err
    _terminal(monkeypatch)
    code, _, err = run_cli(["das", "--ckpt", FIXTURE, "--cache", tmp_path / "c.h5", "--site", "L1.block_in", "--pos",
                            "value", "--dim", "1,2", "--steps", "3", "-o", tmp_path / "das"], capsys)
    assert code == 0, err
    assert re.search(r"das: 100%.* 6/6 \[.*step", err) and "ex/s" not in err and "s/ex" not in err, err


# -- patch --csv and -o heatmap.png ---------------------------------------------------------------
def test_patch_csv_has_the_numbers_of_patch_json(capsys):
    import csv
    import io
    import json

    argv = _expand([*PATCH, "--site", "L*.block_in", "--pos", "key,value"], Path("."))
    code, out, err = run_cli([*argv, "--json"], capsys)
    assert code == 0, err
    records = json.loads(out)
    code, out, err = run_cli([*argv, "--csv"], capsys)
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == list(records[0])  # the records' fields, in their order
    assert len(rows) == len(records) == 4
    for row, record in zip(rows, records, strict=True):
        for field, value in record.items():
            if isinstance(value, bool):
                assert row[field] == str(value).lower()
            elif isinstance(value, float):
                assert float(row[field]) == value, field  # every digit
            else:
                assert row[field] == str(value), field


@pytest.mark.parametrize(("extra", "rows", "columns"), [
    (["--site", "L*.block_in", "--pos", "key,value,query"], ["L0.block_in", "L1.block_in"], ["key", "value", "query"]),
    (["--sender", "L0.block_out@key,L0.block_out@value", "--receiver", "L1.block_in@key", "--via", "resid"],
     ["L0.block_out@key"], ["L1.block_in@key"]),
], ids=["nodes", "path"])
def test_patch_out_draws_the_reports_heatmap_of_the_records(extra, rows, columns, tmp_path, capsys, monkeypatch):
    import json

    import hookmech.report

    drawn = []
    original = hookmech.report.plot_heatmap
    monkeypatch.setattr(hookmech.report, "plot_heatmap", lambda *args, **kwargs: drawn.append((args, kwargs))
                        or original(*args, **kwargs))
    out = tmp_path / "heatmap.png"
    code, printed, err = run_cli(_expand([*PATCH, *extra, "--json", "-o", out], tmp_path), capsys)
    assert code == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ((records, path, title), options), = drawn
    assert records == json.loads(printed) and Path(path) == out and "attention_ar_cpu.safetensors" in title
    assert list(dict.fromkeys(r[options.get("rows", "site")] for r in records)) == rows
    assert list(dict.fromkeys(r[options.get("columns", "pos")] for r in records)) == columns
    assert f"wrote {out}" in err


# -- the page's induction scores ------------------------------------------------------------------
def test_view_shows_prefix_matching_on_random_repeats_only_when_asked(tmp_path, capsys):
    import hookmech
    from hookmech.view import read_page_data

    page = tmp_path / "p.html"
    code, _, err = run_cli(["view", "--ckpt", FIXTURE, "--n", "8", "--site", "L1.block_in", "--random-repeat-induction",
                            "-o", page], capsys)
    assert code == 0, err
    data = read_page_data(page)["induction"]
    assert data["names"] == ["query->value", "value->key"] and data["n"] == 8
    repeated = hookmech.induction_scores(hookmech.load(FIXTURE), random_repeat=True)
    assert [entry["scores"] for entry in data["random_repeat"]["layers"]] == [
        by_name["prefix_matching"].tolist() for by_name in repeated.values()
    ]
    assert data["random_repeat"]["rows"] == 16 and data["random_repeat"]["seq_len"] == 5
