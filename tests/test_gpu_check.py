"""bench/gpu_check.py: what it does without CUDA, its checks' verdicts, and a dry run on the CPU."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from helpers import REPO


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_says_so_and_checks_nothing(monkeypatch, capsys):
    gpu_check = _script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    called = []
    monkeypatch.setattr(gpu_check, "check_forwards", lambda *a: called.append(1))
    assert gpu_check.main(["--device", "cuda"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "CUDA is not available" in out[0] and "nothing was checked" in out[0]
    assert not called


def test_a_difference_over_its_tolerance_fails_the_run(monkeypatch, capsys):
    gpu_check = _script()
    fine, bad = gpu_check.Result("a", 1e-6, 1e-4), gpu_check.Result("b", 2e-4, 1e-4)
    skipped = gpu_check.Result("c", None, 1e-4, note="skipped (not CUDA)")
    assert fine.passed and not bad.passed and skipped.passed
    assert bad.line().startswith("FAIL") and skipped.line().startswith("SKIP")
    monkeypatch.setattr(gpu_check, "check_forwards", lambda *a: [fine, bad])
    monkeypatch.setattr(gpu_check, "check_engine", lambda *a: [])
    monkeypatch.setattr(gpu_check, "check_fused_mamba", lambda *a: skipped)
    monkeypatch.setattr(gpu_check, "time_engine", lambda *a: [])
    monkeypatch.setattr(gpu_check, "time_training_step", lambda *a: [])
    assert gpu_check.main(["--device", "cpu", "--quick", "--small-task"]) == 1
    assert "2 of 3 checks passed; failed: b" in capsys.readouterr().out


@pytest.mark.slow
def test_dry_run_on_the_cpu_passes(capsys):
    """Every check and timing of the script, on the CPU (device and CPU agree trivially)."""
    assert _script().main(["--device", "cpu", "--quick", "--small-task"]) == 0
    out = capsys.readouterr().out
    assert "checks passed" in out and "FAIL" not in out
    assert "engine vs plain loop, mamba on cpu" in out and "training step, attention" in out
