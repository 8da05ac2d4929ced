"""A broken plug-in mixer is named in one line by `train` and `evaluate`, before anything trains:
one that raises (or exits) while it is imported or built, returns the wrong shape, a tuple or
another dtype, recurses without end, takes no d_model, reads later positions or gives two answers
to one input (hookmech.mixers.plug_in_check)."""
from __future__ import annotations

import pytest
from helpers import run_cli

MIXERS = '''
import sys
import torch
from torch import nn
from hookmech.mixers import Mixer


class Plain(Mixer):
    def __init__(self, d_model: int):
        super().__init__()
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        return self.out_proj(x)


class Raises(Plain):
    def __init__(self, d_model: int):
        raise RuntimeError("boom")


class Exits(Plain):
    def __init__(self, d_model: int):
        raise SystemExit(4)


class Wider(Plain):
    def forward(self, x):
        return torch.cat([self.out_proj(x), x[..., :1]], dim=-1)


class Shorter(Plain):
    def forward(self, x):
        return self.out_proj(x)[:, :-1]


class Pair(Plain):
    def forward(self, x):
        return self.out_proj(x), x


class Double(Plain):
    def forward(self, x):
        return self.out_proj(x).double()


class Recursive(Plain):
    def forward(self, x):
        return self(x)


class NoWidth(Mixer):
    def __init__(self, width: int = 8):
        super().__init__()
        self.out_proj = nn.Linear(width, width)

    def forward(self, x):
        return self.out_proj(x)


class Peeks(Plain):
    """Reads position t + 1: not causal."""

    def forward(self, x):
        return self.out_proj(x + torch.cat([x[:, 1:], x[:, -1:]], dim=1))


class Noisy(Plain):
    def forward(self, x):
        return self.out_proj(x) + torch.rand_like(x)
'''

CASES = [
    ("raises", "m.py:Raises", "building mixer {real}/m.py:Raises raised RuntimeError: boom"),
    ("exits-in-init", "m.py:Exits", "building mixer {real}/m.py:Exits raised SystemExit: 4"),
    ("exits-on-import", "exits.py:A", "mixer 'exits.py:A': importing {real}/exits.py raised SystemExit: 3"),
    ("wider", "m.py:Wider", "mixer {real}/m.py:Wider returned [2, {T}, {d_plus_1}] for input [2, {T}, {d}]"),
    ("shorter", "m.py:Shorter", "mixer {real}/m.py:Shorter returned [2, {T_minus_1}, {d}] for input [2, {T}, {d}]"),
    ("tuple", "m.py:Pair", "mixer {real}/m.py:Pair returned a tuple for input [2, {T}, {d}]"),
    ("float64", "m.py:Double", "mixer {real}/m.py:Double returned float64 for a float32 input [2, {T}, {d}]"),
    ("recursion", "m.py:Recursive", "mixer {real}/m.py:Recursive raised RecursionError: maximum recursion depth"),
    ("no-d-model", "m.py:NoWidth", "mixer '{real}/m.py:NoWidth' takes no d_model parameter"),
    # the check changes the input from position T // 2 on first: the position before reads it
    ("not-causal", "m.py:Peeks", "mixer {real}/m.py:Peeks is not causal: changing its input from position {half} on "
                                 "changed its output at position {half_minus_1} by"),
    ("not-deterministic", "m.py:Noisy", "mixer {real}/m.py:Noisy is not deterministic in eval mode"),
]
D_MODEL = 16
TRAIN = ["train", "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3", "--d-model",
         str(D_MODEL), "--n-dev", "8", "--n-train", "0", "--steps", "2", "-o", "{tmp}/out", "--mixer"]
EVALUATE = ["evaluate", "-o", "{tmp}/out", "--mixer"]


@pytest.mark.parametrize("command", ["train", "evaluate"])
@pytest.mark.parametrize(("mixer", "message"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_a_broken_plug_in_mixer_is_named_in_one_line(command, mixer, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "m.py").write_text(MIXERS)
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.chdir(tmp_path)
    argv = [arg.format(tmp=tmp_path) for arg in (TRAIN if command == "train" else EVALUATE)] + [mixer]
    code, _, err = run_cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("hookmech: error: "), err
    assert message.format(real=tmp_path.resolve(), **_sizes(command)) in lines[0], err
    assert "unexpected" not in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def _sizes(command: str) -> dict[str, int]:
    """The check's input [2, T, d] for `command`'s model: T = min(n_ctx, 16) positions of its first
    task (TRAIN's AR of 3 pairs; evaluate's quick suite's first task) and its d_model."""
    from hookmech import tasks
    from hookmech.evaluate.suites import suite

    if command == "train":
        n_ctx, d_model = tasks.make("ar", vocab_size=16, num_kv_pairs=3).n_ctx, D_MODEL
    else:
        first = suite("quick").tasks[0]
        n_ctx, d_model = tasks.from_spec(dict(first.task)).n_ctx, first.model["d_model"]
    n_pos = min(n_ctx, 16)
    return {"T": n_pos, "T_minus_1": n_pos - 1, "d": d_model, "d_plus_1": d_model + 1, "half": n_pos // 2,
            "half_minus_1": n_pos // 2 - 1}


def test_the_mixer_the_checks_pass_trains(tmp_path, capsys, monkeypatch):
    """The harness's own control: the plain mixer of the same file trains, and its note names what
    the checkpoint records."""
    (tmp_path / "m.py").write_text(MIXERS)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli([arg.format(tmp=tmp_path) for arg in TRAIN] + ["m.py:Plain"], capsys)
    assert code == 0, err
    real = f"{tmp_path.resolve()}/m.py:Plain"
    assert err == f"hookmech: note: the checkpoint records mixer {real} (load it with --allow-mixer {real})\n"
