"""Helpers shared by the tests."""
from __future__ import annotations

import torch

import hookmech
from hookmech.config import build_config


def make_model(task, seed: int = 0, **overrides) -> hookmech.HookedLM:
    """A random-init model for `task` (eval mode), deterministic in `seed`."""
    torch.manual_seed(seed)
    options = {"d_vocab": task.d_vocab, "n_ctx": task.n_ctx, "d_model": 32, "n_layers": 2, **overrides}
    return hookmech.HookedLM(build_config(**options)).eval()


def run_cli(argv, capsys):
    """Run the `hookmech` CLI in-process; return (exit code, stdout, stderr)."""
    from hookmech.cli.main import main

    try:
        main(argv)
        code = 0
    except SystemExit as done:
        code = done.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err
