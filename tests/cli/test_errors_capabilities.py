"""The command line on what a mixer or an option does not have: one line on stderr, no traceback.

Rows as tests/cli/test_errors.py's: (id, setup, argv, exit code, a substring of the one-line
message). `{tmp}` is the test's temporary folder, `{ckpt}` the bundled attention fixture; the
setup "core_only" writes `{tmp}/core.safetensors`, a model of the core-only mixer of
tests/test_mixer_capabilities.py (registered for these tests as "core_only").
"""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ATTENTION_FIXTURE as FIXTURE
from helpers import make_model, run_cli
from test_mixer_capabilities import register_core_only

import hookmech

PATCH = ["patch", "--ckpt", "{ckpt}", "--n", "4"]
CORE = ["patch", "--ckpt", "{tmp}/core.safetensors", "--n", "4"]


@pytest.fixture(autouse=True)
def _core_only_registered(monkeypatch):
    register_core_only(monkeypatch)


def _nothing(tmp: Path) -> None:
    """No setup."""


def _core_only(tmp: Path) -> None:
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    hookmech.save(make_model(task, mixers="core_only", d_model=16), tmp / "core.safetensors", task_spec=task.spec)


SETUPS = {"none": _nothing, "core_only": _core_only}

ROWS = [
    ("graddrop-with-plain-atp", "none", [*PATCH, "--site", "L0.block_out", "--pos", "value", "--method", "atp",
                                         "--graddrop"], 2, "--graddrop is an option of --method atp-star"),
    ("graddrop-with-exact", "none", [*PATCH, "--site", "L0.block_out", "--pos", "value", "--graddrop"], 2,
     "--graddrop is an option of --method atp-star"),
    ("head-path-in-a-mixer-without-routes", "core_only",
     [*CORE, "--sender", "L0.mixer.v@key", "--receiver", "L1.mixer.v@query", "--via", "head"], 2,
     "mixer CoreOnly does not implement PathRoutes, which a head path in layer 0 (mixer 'core_only') needs"),
    ("conv-path-in-a-mixer-without-routes", "core_only",
     [*CORE, "--sender", "L1.mixer.v@key", "--receiver", "L1.mixer.mean@query", "--via", "conv"], 2,
     "mixer CoreOnly does not implement PathRoutes, which a conv path in layer 1 (mixer 'core_only') needs"),
]


def _expand(argv: list[str], tmp: Path) -> list[str]:
    return [arg.replace("{tmp}", str(tmp)).replace("{ckpt}", str(FIXTURE)) for arg in argv]


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


@pytest.mark.parametrize("method", ["exact", "atp", "atp-star"])
def test_a_core_only_mixer_is_patched_from_the_command_line(method, tmp_path, capsys):
    """What the core is enough for runs: every method of node patching, and a resid path."""
    _core_only(tmp_path)
    code, out, err = run_cli(_expand([*CORE, "--site", "all", "--pos", "key", "--method", method, "--json"], tmp_path),
                             capsys)
    assert code == 0, err
    code, out, err = run_cli(_expand([*CORE, "--sender", "L0.block_out@key", "--receiver", "L1.block_in@key",
                                      "--via", "resid", "--json"], tmp_path), capsys)
    assert code == 0, err
