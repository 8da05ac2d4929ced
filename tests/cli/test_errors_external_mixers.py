"""Mixers of your own on the command line (docs/your_mixer.md): every name that does not resolve to a
`Mixer` subclass is one line on stderr and exit 2, in `train` and in a sweep file (which trains and
writes nothing); a checkpoint whose mixer file is gone is one line and exit 1.

The harness is tests/cli/test_errors_training.py's: rows of (id, argv, exit code, message
substring), `{tmp}` the test's temporary folder (also the working folder), which holds the files
`_files` writes."""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import SWEEP_SMALL, run_cli

TRAIN = ["train", "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3", "--d-model", "16",
         "--n-dev", "8", "--n-train", "0", "--steps", "2", "-o", "{tmp}/r", "--mixer"]

MIXER = """
from torch import nn
from hookmech.mixers import Mixer


class Identity(Mixer):
    def __init__(self, d_model: int):
        super().__init__()
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        return self.out_proj(x)


NOT_A_MIXER = "text"
"""

ROWS = [
    ("missing-file", [*TRAIN, "nosuch.py:A"], 2, "mixer 'nosuch.py:A': no such file {tmp}/nosuch.py"),
    ("missing-module", [*TRAIN, "ext_cli_nosuch:A"], 2, "no module named 'ext_cli_nosuch' (install its package"),
    ("missing-class", [*TRAIN, "mine.py:Identiy"], 2, "has no 'Identiy' (did you mean: Identity?)"),
    ("not-a-class", [*TRAIN, "mine.py:NOT_A_MIXER"], 2, "is an object of type str, not a subclass of"),
    ("not-a-mixer", [*TRAIN, "torch.nn:Linear"], 2, "is class torch.nn.modules.linear.Linear, not a subclass of"),
    ("the-base-class", [*TRAIN, "mine.py:Mixer"], 2, "is the base class Mixer itself"),
    ("raises-on-import", [*TRAIN, "broken.py:A"], 2, "broken.py raised ZeroDivisionError: division by zero"),
    ("no-class-part", [*TRAIN, "mine.py:"], 2, "expected module.path:Class or path/to/file.py:Class"),
    ("unknown-name", [*TRAIN, "atention"], 2, "a mixer of your own is named module.path:Class"),
    ("one-layer-of-two", [*TRAIN, "mine.py:Identity,nosuch.py:B"], 2, "mixer 'nosuch.py:B': no such file"),
    ("sweep-missing-file", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     ": mixer 'nosuch.py:A': no such file {tmp}/nosuch.py"),
    ("checkpoint-file-gone", ["sites", "--ckpt", "{tmp}/gone/model.safetensors", "--allow-mixer", "{real}/gone.py"], 1,
     "{tmp}/gone/model.safetensors: model config: mixer '{real}/gone.py:Identity': no such file {real}/gone.py"),
]


def _files(tmp: Path) -> None:
    (tmp / "mine.py").write_text(MIXER)
    (tmp / "broken.py").write_text("1 / 0\n")
    (tmp / "s.toml").write_text(SWEEP_SMALL.replace("[grid]\n", '[grid]\nmixer = ["nosuch.py:A"]\n'))
    # a checkpoint trained from gone.py, which is then removed
    import hookmech
    from hookmech.config import build_config

    (tmp / "gone.py").write_text(MIXER)
    model = hookmech.HookedLM(build_config(d_vocab=8, n_ctx=6, mixers=f"{tmp}/gone.py:Identity", d_model=8))
    (tmp / "gone").mkdir()
    hookmech.save(model, tmp / "gone" / "model.safetensors")
    (tmp / "gone.py").unlink()


@pytest.mark.parametrize(("argv", "code", "message"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_a_mixer_that_does_not_resolve_is_one_line_and_an_exit_code(argv, code, message, tmp_path, monkeypatch,
                                                                     capsys):
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    fill = {"tmp": str(tmp_path), "real": str(tmp_path.resolve())}
    got_code, _, err = run_cli([arg.format(**fill) if "{" in arg else arg for arg in argv], capsys)
    lines = err.strip().splitlines()
    assert got_code == code, err
    assert len(lines) == 1 and lines[0].startswith("hookmech: error: "), err
    assert message.format(**fill) in lines[0], err
    assert "Traceback" not in err and "unexpected" not in err, err
    assert not (tmp_path / "r").exists() and not (tmp_path / "runs").exists()  # nothing trained or written


def test_every_row_has_a_unique_id():
    ids = [row[0] for row in ROWS]
    assert ids and len(ids) == len(set(ids))
