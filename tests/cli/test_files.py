"""The command line and the files it reads and writes: outputs never overwrite inputs, and
`patch --cache` accepts exactly the caches of the checkpoint's model."""
from __future__ import annotations

import json

import h5py
import pytest

import hookmech
from hookmech.identity import model_hash

from helpers import ATTENTION_FIXTURE as FIXTURE, REPO, run_cli

TRAIN_SMALL = ["train", "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3",
               "--n-train", "0", "--steps", "4", "--d-model", "16", "--n-dev", "8", "--eval-every", "2"]
PATCH = ["--site", "L1.block_in", "--pos", "value", "--json"]


def test_cache_onto_its_own_checkpoint_is_refused_and_the_checkpoint_kept(tmp_path, capsys):
    ckpt = tmp_path / "m.safetensors"
    ckpt.write_bytes(FIXTURE.read_bytes())
    code, _, err = run_cli(["cache", "--ckpt", str(ckpt), "--n", "4", "-o", str(ckpt)], capsys)
    assert code == 2 and "which is the input --ckpt" in err
    assert ckpt.read_bytes() == FIXTURE.read_bytes()
    link = tmp_path / "link.safetensors"
    link.symlink_to(ckpt)
    code, _, err = run_cli(["cache", "--ckpt", str(link), "--n", "4", "-o", str(ckpt)], capsys)
    assert code == 2 and "which is the input --ckpt" in err
    assert ckpt.read_bytes() == FIXTURE.read_bytes()


def test_patch_accepts_the_cache_of_a_retrained_identical_model(tmp_path, capsys):
    for run in ("a", "b"):
        code, _, err = run_cli([*TRAIN_SMALL, "-o", str(tmp_path / run)], capsys)
        assert code == 0, err
    first, second = tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors"
    cache = tmp_path / "a.h5"
    code, _, err = run_cli(["cache", "--ckpt", str(first), "--n", "6", "-o", str(cache)], capsys)
    assert code == 0, err
    code, out, err = run_cli(["patch", "--ckpt", str(second), "--cache", str(cache), *PATCH], capsys)
    assert code == 0, err
    assert json.loads(out)[0]["n"] == 6


def test_patch_refuses_a_cache_of_another_model_naming_both(tmp_path, capsys):
    mamba = REPO / "fixtures" / "mamba_ar_cpu.safetensors"
    cache = tmp_path / "mamba.h5"
    assert run_cli(["cache", "--ckpt", str(mamba), "--n", "4", "--sites", "L1.block_in", "-o", str(cache)], capsys)[0] == 0
    code, _, err = run_cli(["patch", "--ckpt", str(FIXTURE), "--cache", str(cache), *PATCH], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1
    for needle in (str(cache), str(FIXTURE), model_hash(hookmech.load(mamba)), model_hash(hookmech.load(FIXTURE))):
        assert needle in err


@pytest.fixture
def old_cache(tmp_path, capsys):
    """A cache of the fixture as hookmech wrote them before model_hash: model_sha256 only."""
    cache = tmp_path / "old.h5"
    assert run_cli(["cache", "--ckpt", str(FIXTURE), "--n", "4", "--sites", "L1.block_in", "-o", str(cache)], capsys)[0] == 0
    with h5py.File(cache, "r+") as h5:
        del h5.attrs["model_hash"]
    return cache


def test_old_cache_is_checked_by_the_checkpoint_file_hash(old_cache, tmp_path, capsys):
    code, out, err = run_cli(["patch", "--ckpt", str(FIXTURE), "--cache", str(old_cache), *PATCH], capsys)
    assert code == 0 and err == ""  # checked by file hash: no warning that it could not be checked
    assert json.loads(out)[0]["n"] == 4
    same_weights = hookmech.save(hookmech.load(FIXTURE), tmp_path / "resaved.safetensors",
                                 task_spec=hookmech.tasks.from_checkpoint(FIXTURE).spec, summary={"note": "other bytes"})
    code, _, err = run_cli(["patch", "--ckpt", str(same_weights), "--cache", str(old_cache), *PATCH], capsys)
    assert code == 1 and "model_sha256" in err and len(err.strip().splitlines()) == 1


def test_inspect_shows_the_model_hash(old_cache, tmp_path, capsys):
    code, out, _ = run_cli(["inspect", str(old_cache)], capsys)
    assert code == 0 and "model_hash - (older cache)" in out
    cache = tmp_path / "new.h5"
    run_cli(["cache", "--ckpt", str(FIXTURE), "--n", "4", "--sites", "L1.block_in", "-o", str(cache)], capsys)
    code, out, _ = run_cli(["inspect", str(cache)], capsys)
    assert f"model_hash {model_hash(hookmech.load(FIXTURE))}" in out
