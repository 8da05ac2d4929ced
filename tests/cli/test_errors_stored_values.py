"""Values read from files, and options that look valid, refused in one line that says where the
fault is: a checkpoint's task spec or dtype (one a model computes in: `hookmech.config.DTYPES`)
names the file (exit 1: the file, not the command line, is at fault); a sweep file that is not
UTF-8 names itself; gla's clamp_min above 0 (growth, not decay) is refused before training; a
cache that fails view's check says how to skip it, as view can."""
from __future__ import annotations

import json

import h5py
import pytest
from helpers import ATTENTION_FIXTURE, run_cli
from safetensors import safe_open
from safetensors.torch import save_file

import hookmech
from hookmech.config import ModelConfig
from hookmech.errors import UsageError


def _with_metadata(path, key, change):
    """Write the attention fixture to `path` with metadata `key` (JSON) passed through `change`."""
    with safe_open(str(ATTENTION_FIXTURE), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    save_file(tensors, str(path), {**metadata, key: json.dumps(change(json.loads(metadata[key])))})
    return path


@pytest.mark.parametrize(("change", "words"), [
    (lambda task: {**task, "num_kv_pairs": 400}, "task spec: ar: num_kv_pairs 400 needs vocab_size >= 802"),
    (lambda task: {**task, "name": "nosuch"}, "task spec: unknown task 'nosuch'"),
], ids=["too-many-pairs", "unknown-task"])
def test_a_checkpoints_bad_task_spec_names_the_file_and_exits_1(change, words, tmp_path, capsys):
    checkpoint = _with_metadata(tmp_path / "m.safetensors", "hookmech_task", change)
    code, _, err = run_cli(["patch", "--ckpt", checkpoint, "--site", "L1.block_in", "--pos", "value", "--n", "4"],
                           capsys)
    assert code == 1 and err == f"hookmech: error: {checkpoint}: {words}" + err.split(words, 1)[1], err
    assert err.count("\n") == 1


@pytest.mark.parametrize("dtype", ["int8", "float64"])
def test_a_config_dtype_no_model_computes_in_is_refused(dtype, tmp_path, capsys):
    checkpoint = _with_metadata(tmp_path / "m.safetensors", "hookmech_config", lambda c: {**c, "dtype": dtype})
    code, _, err = run_cli(["sites", "--ckpt", checkpoint], capsys)
    assert code == 1 and err == (f'hookmech: error: {checkpoint}: model config: dtype = "{dtype}": expected '
                                 'one of float32, float16, bfloat16\n')
    config = json.loads(hookmech.load(ATTENTION_FIXTURE).cfg.to_json())
    with pytest.raises(UsageError, match="dtype"):
        ModelConfig.from_json(json.dumps({**config, "dtype": dtype}))


def test_a_sweep_file_that_is_not_utf8_names_itself(tmp_path, capsys):
    (tmp_path / "b.toml").write_bytes(b"\xff\xfe")
    code, _, err = run_cli(["sweep", tmp_path / "b.toml", "-o", tmp_path / "runs"], capsys)
    assert code == 2 and err == (f"hookmech: error: sweep file {tmp_path}/b.toml is not UTF-8 text (byte 0: invalid "
                                 "start byte); TOML is UTF-8\n")


@pytest.mark.parametrize("value", ["1", "0.5"])
def test_gla_refuses_a_clamp_min_that_makes_decay_growth(value, tmp_path, capsys):
    code, _, err = run_cli(["train", "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3",
                            "--mixer", "gla", "--mixer-opt", f"clamp_min={value}", "--d-model", "16", "--steps", "2",
                            "--n-train", "0", "-o", tmp_path / "r"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "gla: clamp_min is a floor of the log decay, a number <= 0, got" in err
    assert not (tmp_path / "r").exists()


def test_view_refuses_an_edited_cache_and_names_the_option_it_has(tmp_path, capsys):
    code, _, err = run_cli(["cache", "--ckpt", ATTENTION_FIXTURE, "--n", "8", "-o", tmp_path / "c.h5"], capsys)
    assert code == 0, err
    with h5py.File(tmp_path / "c.h5", "r+") as h5:
        h5["p_answer/clean"][:] = 0.5  # every row: the checked ones among them
    argv = ["view", "--ckpt", ATTENTION_FIXTURE, "--cache", tmp_path / "c.h5", "--maps", "1", "-o", tmp_path / "v.html"]
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and "(--no-verify-cache;" in err and err.count("\n") == 1, err
    code, _, err = run_cli([*argv, "--no-verify-cache"], capsys)
    assert code == 0, err
    assert (tmp_path / "v.html").exists()
