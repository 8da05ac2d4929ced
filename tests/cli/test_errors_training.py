"""Bad input to train and sweep, and checkpoints with a bad config (issue 27): one row per case,
each one line on stderr with a non-zero exit and no "unexpected".

The harness is tests/cli/test_errors.py's: rows of (id, setup, argv, exit code, message
substring), `{tmp}` the test's temporary folder. Cases that need more than a message (nothing
written, a time bound, a simulated full disk or Ray) are the tests below the table.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from helpers import ATTENTION_FIXTURE as FIXTURE
from helpers import SWEEP_SMALL, run_cli
from safetensors import safe_open
from safetensors.torch import save_file

TASK = ["--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3"]
#: a tiny run; each row adds its length (--steps or --epochs) and its bad option
TRAIN = ["train", *TASK, "--d-model", "16", "--n-dev", "8", "--eval-every", "4"]
TRAIN_SMALL = [*TRAIN, "--n-train", "0", "--steps", "4"]



def _nothing(tmp: Path) -> None:
    """No setup."""


def _sweep_with(old: str, new: str):
    """A setup writing {tmp}/s.toml: SWEEP_SMALL with `old` replaced by `new`."""
    assert old in SWEEP_SMALL

    def setup(tmp: Path) -> None:
        (tmp / "s.toml").write_text(SWEEP_SMALL.replace(old, new))
    return setup


def _checkpoint_with_config(**changes):
    """A setup writing {tmp}/m.safetensors: the attention fixture's weights under a config
    with `changes` (a callable value gets the old value and returns the new)."""
    def setup(tmp: Path) -> None:
        from hookmech.checkpoint import write_safetensors

        with safe_open(str(FIXTURE), framework="pt") as handle:
            metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
        config = json.loads(metadata["hookmech_config"])
        for key, value in changes.items():
            config[key] = value(config[key]) if callable(value) else value
        write_safetensors(tensors, tmp / "m.safetensors", {**metadata, "hookmech_config": json.dumps(config)})
    return setup


def _string_window(kwargs):
    return [{**kwargs[0], "window": "abc"}, *kwargs[1:]]


def _header_length_top_bit(tmp: Path) -> None:
    """{tmp}/m.safetensors: the fixture with its 8-byte header length's top bit set (and its
    first byte 0x80, which starts a pickle too)."""
    data = bytearray(FIXTURE.read_bytes())
    data[0] |= 0x80
    data[7] |= 0x80
    (tmp / "m.safetensors").write_bytes(bytes(data))


def _poison_resume_state(path: Path) -> None:
    """Put a NaN into the first model weight of the resume state at `path`."""
    with safe_open(str(path), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    name = next(name for name in tensors if name.startswith("model."))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(path), metadata=metadata)


def _run_resumable_with_nan(tmp: Path) -> None:
    """{tmp}/r: TRAIN_SMALL's run trained to its end, then left as a kill just before its
    summary would leave it (resume state at the last step, no summary.json), with a NaN in
    the resume state's weights."""
    import hookmech
    from hookmech.config import build_config
    from hookmech.training import TrainConfig, train

    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=["attention"], d_model=16, n_layers=2,
                                layer_options=[{}, {}], n_heads=1)
    config = TrainConfig(epochs=None, steps=4, n_train=0, n_dev=8, eval_every=4)
    train(task, model_config, config, tmp / "r", progress=False, log=lambda message: None)
    (tmp / "r" / "summary.json").unlink()
    (tmp / "r" / "run.json").unlink()  # run.json is rewritten from the command's options
    _poison_resume_state(tmp / "r" / "resume.safetensors")


SETUPS = {
    "none": _nothing,
    "sweep": _sweep_with("", ""),
    "sweep d_model abc": _sweep_with("[grid]\n", '[model]\nd_model = "abc"\n[grid]\n'),
    "sweep steps string": _sweep_with("steps = 4", 'steps = "20"'),
    "sweep lr strings": _sweep_with("seed = [0, 1]", 'seed = [0, 1]\nlr = ["x", "y"]'),
    "sweep seed float": _sweep_with("seed = [0, 1]", "seed = [0, 1.5]"),
    "sweep n_layers float": _sweep_with("[grid]\n", "[model]\nn_layers = 2.5\n[grid]\n"),
    "sweep d_model bool": _sweep_with("[grid]\n", "[model]\nd_model = true\n[grid]\n"),
    "sweep arch not a name": _sweep_with("seed = [0, 1]", 'seed = [0, 1]\narch = ["attention", 5]'),
    "sweep n_dev zero": _sweep_with("n_dev = 8", "n_dev = 0"),
    "sweep seed too big": _sweep_with("seed = [0, 1]", "seed = [0, 18446744073709551616]"),
    "sweep warmup above one": _sweep_with("n_dev = 8", "n_dev = 8\nwarmup_frac = 1.5"),
    "ckpt unknown mixer": _checkpoint_with_config(mixers=["nosuch", "attention"]),
    "ckpt float d_model": _checkpoint_with_config(d_model=64.0),
    "ckpt bool d_model": _checkpoint_with_config(d_model=True),
    "ckpt string window": _checkpoint_with_config(mixer_kwargs=_string_window),
    "ckpt huge d_model": _checkpoint_with_config(d_model=200_000),
    "ckpt huge n_ctx": _checkpoint_with_config(n_ctx=10**12),
    "ckpt header length top bit": _header_length_top_bit,
    "run resumable with nan": _run_resumable_with_nan,
}

#: train: zero and negative counts, empty names, a seed out of range, a model too big to allocate
ROWS_TRAIN = [
    ("train-epochs-zero", "none", [*TRAIN, "--n-train", "32", "--epochs", "0", "-o", "{tmp}/r"], 2,
     "--epochs must be >= 1, got 0"),
    ("train-epochs-negative", "none", [*TRAIN, "--n-train", "32", "--epochs", "-2", "-o", "{tmp}/r"], 2,
     "--epochs must be >= 1, got -2"),
    ("train-steps-zero", "none", [*TRAIN, "--n-train", "0", "--steps", "0", "-o", "{tmp}/r"], 2,
     "--steps must be >= 1, got 0"),
    ("train-n-dev-zero", "none", [*TRAIN_SMALL, "--n-dev", "0", "-o", "{tmp}/r"], 2, "--n-dev must be >= 1, got 0"),
    ("train-batch-size-zero", "none", [*TRAIN_SMALL, "--batch-size", "0", "-o", "{tmp}/r"], 2,
     "--batch-size must be >= 1, got 0"),
    ("train-eval-every-negative", "none", [*TRAIN_SMALL, "--eval-every", "-4", "-o", "{tmp}/r"], 2,
     "--eval-every must be >= 1, got -4"),
    ("train-ckpt-every-zero", "none", [*TRAIN_SMALL, "--ckpt-every", "0", "-o", "{tmp}/r"], 2,
     "--ckpt-every must be >= 1, got 0"),
    ("train-length-groups-zero", "none", [*TRAIN_SMALL, "--length-groups", "0", "-o", "{tmp}/r"], 2,
     "--length-groups must be >= 1, got 0"),
    ("train-length-groups-above-the-batch", "none", [*TRAIN_SMALL, "--length-groups", "64", "-o", "{tmp}/r"], 2,
     "length_groups 64 is more than the batch size 32"),
    ("train-n-train-negative", "none", [*TRAIN, "--n-train", "-1", "--steps", "4", "-o", "{tmp}/r"], 2,
     "--n-train must be >= 0, got -1"),
    ("train-n-heads-zero", "none", [*TRAIN_SMALL, "--n-heads", "0", "-o", "{tmp}/r"], 2, "--n-heads must be >= 1, got 0"),
    ("train-threads-zero", "none", [*TRAIN_SMALL, "--threads", "0", "-o", "{tmp}/r"], 2, "--threads must be >= 1, got 0"),
    ("train-mixer-empty", "none", [*TRAIN_SMALL, "--mixer", "", "-o", "{tmp}/r"], 2, "--mixer is empty"),
    ("train-mixer-empty-item", "none", [*TRAIN_SMALL, "--mixer", "attention,", "-o", "{tmp}/r"], 2,
     "--mixer 'attention,' has an empty name"),
    ("train-preset-empty", "none", [*TRAIN_SMALL, "--preset", " ", "-o", "{tmp}/r"], 2, "--preset is empty"),
    ("train-task-empty", "none", ["train", "--task", "", "--n-train", "0", "--steps", "4", "-o", "{tmp}/r"], 2,
     "--task is empty"),
    ("train-seed-2-to-the-64", "none", [*TRAIN_SMALL, "--seed", str(2**64), "-o", "{tmp}/r"], 2,
     f"--seed must be an integer in 0..{2**64 - 1}, got {2**64}"),
    ("train-seed-negative", "none", [*TRAIN_SMALL, "--seed", "-1", "-o", "{tmp}/r"], 2,
     f"--seed must be an integer in 0..{2**64 - 1}, got -1"),
    ("train-d-model-a-million", "none", [*TRAIN_SMALL[:-4], "--d-model", "1000000", *TRAIN_SMALL[-4:], "-o", "{tmp}/r"],
     2, "d_model 1000000"),
    ("train-resume-state-with-nan", "run resumable with nan", [*TRAIN_SMALL, "-o", "{tmp}/r"], 1,
     "/r/resume.safetensors: the resume state holds non-finite values (NaN or inf) in model.blocks.0.ln1.bias"),
]

#: sweep: options, and sweep files checked against their schema before anything runs
ROWS_SWEEP = [
    ("sweep-threads-zero", "sweep", ["sweep", "{tmp}/s.toml", "--threads", "0", "-o", "{tmp}/runs"], 2,
     "--threads must be >= 1, got 0"),
    ("sweep-workers-zero", "sweep", ["sweep", "{tmp}/s.toml", "--workers", "0", "-o", "{tmp}/runs"], 2,
     "--workers must be >= 1, got 0"),
    ("sweep-gpus-per-run-nan", "sweep", ["sweep", "{tmp}/s.toml", "--gpus-per-run", "nan", "-o", "{tmp}/runs"], 2,
     "--gpus-per-run must be a number >= 0, got nan"),
    ("sweep-preset-empty", "none", ["sweep", "--preset", "", "-o", "{tmp}/runs"], 2, "--preset is empty"),
    ("sweep-d-model-a-string", "sweep d_model abc", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     '/s.toml: [model] d_model = "abc": expected an integer >= 1'),
    ("sweep-steps-a-string", "sweep steps string", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     '/s.toml: [train] steps = "20": expected an integer >= 1'),
    ("sweep-lr-strings", "sweep lr strings", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     '/s.toml: [grid] lr = ["x", "y"]: "x" is not a number > 0'),
    ("sweep-seed-a-fraction", "sweep seed float", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     f"/s.toml: [grid] seed = [0, 1.5]: 1.5 is not an integer in 0..{2**64 - 1}"),
    ("sweep-seed-a-fraction-dry-run", "sweep seed float", ["sweep", "{tmp}/s.toml", "--dry-run"], 2,
     "[grid] seed = [0, 1.5]: 1.5 is not an integer"),
    ("sweep-seed-too-big", "sweep seed too big", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     f"18446744073709551616 is not an integer in 0..{2**64 - 1}"),
    ("sweep-n-layers-a-fraction", "sweep n_layers float", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     "/s.toml: [model] n_layers = 2.5: expected an integer >= 1"),
    ("sweep-d-model-a-bool", "sweep d_model bool", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     "/s.toml: [model] d_model = true: expected an integer >= 1"),
    ("sweep-arch-not-a-name", "sweep arch not a name", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     '/s.toml: [grid] arch = ["attention", 5]: 5 is not a model preset name (a string)'),
    ("sweep-n-dev-zero", "sweep n_dev zero", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     "/s.toml: [train] n_dev = 0: expected an integer >= 1"),
    ("sweep-warmup-above-one", "sweep warmup above one", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     "/s.toml: [train] warmup_frac = 1.5: expected a number in [0, 1]"),
]

#: checkpoints whose config cannot be built, or would not fit in memory: refused before allocating
ROWS_CHECKPOINTS = [
    ("ckpt-unknown-mixer", "ckpt unknown mixer", ["sites", "--ckpt", "{tmp}/m.safetensors"], 1,
     "/m.safetensors: model config: unknown mixer 'nosuch'"),
    ("ckpt-float-d-model", "ckpt float d_model", ["sites", "--ckpt", "{tmp}/m.safetensors"], 1,
     "/m.safetensors: model config: d_model = 64.0: expected an integer >= 1"),
    ("ckpt-bool-d-model", "ckpt bool d_model", ["sites", "--ckpt", "{tmp}/m.safetensors"], 1,
     "/m.safetensors: model config: d_model = true: expected an integer >= 1"),
    ("ckpt-string-window", "ckpt string window", ["sites", "--ckpt", "{tmp}/m.safetensors"], 1,
     '/m.safetensors: model config: mixer \'attention\': option window="abc" should be'),
    ("ckpt-d-model-200000", "ckpt huge d_model", ["sites", "--ckpt", "{tmp}/m.safetensors"], 1,
     "/m.safetensors: model config (d_vocab 67, n_ctx 11, d_model 200000, n_layers 2) has"),
    ("ckpt-n-ctx-10-to-the-12", "ckpt huge n_ctx", ["sites", "--ckpt", "{tmp}/m.safetensors"], 1,
     "n_ctx 1000000000000"),
    ("ckpt-header-length-top-bit", "ckpt header length top bit", ["sites", "--ckpt", "{tmp}/m.safetensors"], 1,
     "/m.safetensors: not a valid safetensors file (header length"),
]

ALL_ROWS = ROWS_TRAIN + ROWS_SWEEP + ROWS_CHECKPOINTS


def _expand(argv: list[str], tmp: Path) -> list[str]:
    return [arg.replace("{tmp}", str(tmp)) for arg in argv]


def _one_line(code: int, err: str, expected_code: int, message: str) -> None:
    lines = err.strip().splitlines()
    assert code == expected_code, err
    assert len(lines) == 1, err
    assert lines[0].startswith("hookmech: error: "), err
    assert message in lines[0], err
    assert "Traceback" not in err and "unexpected" not in err, err


@pytest.mark.parametrize(("setup", "argv", "code", "message"), [row[1:] for row in ALL_ROWS],
                         ids=[row[0] for row in ALL_ROWS])
def test_bad_input_is_one_line_and_an_exit_code(setup, argv, code, message, tmp_path, capsys):
    SETUPS[setup](tmp_path)
    got_code, _, err = run_cli(_expand(argv, tmp_path), capsys)
    _one_line(got_code, err, code, message)


def test_every_row_has_a_unique_id():
    ids = [row[0] for row in ALL_ROWS]
    assert ids and len(ids) == len(set(ids))


@pytest.mark.parametrize("setup", ["sweep seed float", "sweep lr strings", "sweep arch not a name"])
def test_a_bad_sweep_file_trains_and_writes_nothing(setup, tmp_path, capsys):
    """`seed = [0, 1.5]` used to pass the up-front check, train its first run, then fail."""
    SETUPS[setup](tmp_path)
    code, _, err = run_cli(["sweep", tmp_path / "s.toml", "-o", tmp_path / "runs"], capsys)
    assert code == 2, err
    assert not (tmp_path / "runs").exists()


def test_a_resume_state_with_nan_is_left_as_it_was(tmp_path, capsys):
    _run_resumable_with_nan(tmp_path)
    before = (tmp_path / "r" / "resume.safetensors").read_bytes()
    code, _, err = run_cli(_expand([*TRAIN_SMALL, "-o", "{tmp}/r"], tmp_path), capsys)
    assert code == 1, err
    assert not (tmp_path / "r" / "summary.json").exists()
    assert (tmp_path / "r" / "resume.safetensors").read_bytes() == before


def test_a_model_too_big_is_refused_before_allocating(tmp_path, capsys):
    """d_model 10^6 is 2.4e13 parameters: refused by arithmetic in well under a second of
    work, nothing written."""
    began = time.perf_counter()
    code, _, err = run_cli(_expand([*TRAIN_SMALL[:-4], "--d-model", "1000000", *TRAIN_SMALL[-4:], "-o", "{tmp}/r"],
                                   tmp_path), capsys)
    assert code == 2 and "memory" in err, err
    assert time.perf_counter() - began < 20
    assert not (tmp_path / "r").exists()


# -- Ray -----------------------------------------------------------------------------------------
def test_ray_not_installed_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    SETUPS["sweep"](tmp_path)
    code, _, err = run_cli(["sweep", tmp_path / "s.toml", "--engine", "ray", "-o", tmp_path / "runs"], capsys)
    _one_line(code, err, 2, "--engine ray needs Ray")
    assert not (tmp_path / "runs").exists()


def _fake_ray(init):
    """A stand-in `ray` module whose `init` is `init` (Ray is not a test dependency)."""
    module = types.ModuleType("ray")
    module.init = init
    module.shutdown = lambda: None
    return module


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_address_nobody_answers_is_one_fast_line(tmp_path, monkeypatch, capsys):
    """Ray itself waits ~40 s for a cluster that is not there; hookmech asks the address first."""
    calls = []
    monkeypatch.setitem(sys.modules, "ray", _fake_ray(lambda *args, **kwargs: calls.append(kwargs)))
    SETUPS["sweep"](tmp_path)
    address = f"127.0.0.1:{_closed_port()}"
    began = time.perf_counter()
    code, _, err = run_cli(["sweep", tmp_path / "s.toml", "--engine", "ray", "--address", address,
                            "-o", tmp_path / "runs"], capsys)
    _one_line(code, err, 1, f"--engine ray: no Ray cluster answers at {address}")
    assert time.perf_counter() - began < 15
    assert calls == [] and not (tmp_path / "runs").exists()


def test_ray_that_cannot_start_is_one_line(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise ConnectionError("Could not start the Ray head node:\nthe GCS did not come up in 30 s")

    monkeypatch.setitem(sys.modules, "ray", _fake_ray(refuse))
    SETUPS["sweep"](tmp_path)
    code, _, err = run_cli(["sweep", tmp_path / "s.toml", "--engine", "ray", "-o", tmp_path / "runs"], capsys)
    _one_line(code, err, 1, "--engine ray: Ray did not start (ConnectionError: Could not start the Ray head node:)")
    assert not (tmp_path / "runs").exists()


# -- a full disk ---------------------------------------------------------------------------------
def test_sweep_on_a_full_disk_names_the_path_and_leaves_no_lock(tmp_path, monkeypatch, capsys):
    """On a full disk the lock file is created (an inode) but its PID cannot be written."""
    import hookmech.locking

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hookmech.locking.os, "pwrite", full)
    SETUPS["sweep"](tmp_path)
    runs = tmp_path / "runs"
    code, _, err = run_cli(["sweep", tmp_path / "s.toml", "-o", runs], capsys)
    _one_line(code, err, 1, f"no space left on device writing {runs / '.lock'}")
    assert not runs.exists()


def test_sweep_on_a_full_disk_keeps_an_existing_runs_folder_without_a_lock(tmp_path, monkeypatch, capsys):
    import hookmech.locking

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "notes.txt").write_text("kept\n")
    monkeypatch.setattr(hookmech.locking.os, "pwrite",
                        lambda fd, data, offset: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    SETUPS["sweep"](tmp_path)
    code, _, err = run_cli(["sweep", tmp_path / "s.toml", "-o", runs], capsys)
    _one_line(code, err, 1, f"writing {runs / '.lock'}")
    assert sorted(path.name for path in runs.iterdir()) == ["notes.txt"]


def test_train_on_a_device_that_is_not_here_is_one_line(tmp_path, capsys):
    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    code, _, err = run_cli(_expand([*TRAIN_SMALL, "--device", device, "-o", "{tmp}/r"], tmp_path), capsys)
    assert code == 2 and device in err and len(err.strip().splitlines()) == 1, err
