"""`hookmech inspect` and `hookmech probe`: output against the library, error paths as one line
and an exit code."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

import hookmech
from hookmech.cache import write_cache
from hookmech.probe import fit_probe
from hookmech.sites import resolve_sites

from helpers import run_cli


def run(argv, capsys):
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    return run_cli(argv, capsys)


@pytest.fixture
def cache_path(tmp_path, ar_model, ar_task):
    batch = ar_task.sample(48, seed=2)
    hooks = resolve_sites(["all"], ar_model.hook_dict)
    return write_cache(ar_model, batch, tmp_path / "c.h5", hooks, model_sha256="ab" * 32, task_spec=ar_task.spec,
                       dtype="float16", compression="gzip")


def test_inspect_prints_what_the_file_holds(cache_path, capsys, ar_task):
    code, out, err = run(["inspect", str(cache_path)], capsys)
    assert code == 0 and err == ""
    assert "N=48" in out and "ab" * 32 in out and '"name": "ar"' in out
    assert "divider, key, query, value" in out
    assert "[48, " in out and "float16" in out and "gzip" in out
    assert sum(line.startswith(("L0.", "L1.")) for line in out.splitlines()) == 14
    with hookmech.cache.open(cache_path) as cache:
        expected = cache.summary()
        p_clean = float(cache.p_answer("clean").double().mean())
    assert f"clean {p_clean:.4f}" in out
    code, out, _ = run(["inspect", str(cache_path), "--json"], capsys)
    assert code == 0 and json.loads(out) == expected
    assert json.loads(out)["task"] == ar_task.spec


def test_probe_prints_the_library_result(cache_path, capsys):
    code, out, err = run(["probe", str(cache_path), "--site", "L0.block_in", "--pos", "key", "--target", "key", "--json"],
                         capsys)
    assert code == 0 and err == ""
    with hookmech.cache.open(cache_path) as cache:
        expected = fit_probe(cache, "L0.block_in", "key", "key")
    assert json.loads(out) == expected.to_dict()
    # the embedding of the key itself: decodable (random-init residual = token + position embedding)
    assert expected.heldout_accuracy > 0.5
    code, out, _ = run(["probe", str(cache_path), "--site", "blocks.0.hook_resid_pre", "--pos", "key"], capsys)
    assert code == 0 and out.startswith("L0.block_in at key -> key (clean run): held-out accuracy")


@pytest.mark.parametrize("argv, code, pattern", [
    (["probe", "{missing}", "--site", "L1.block_in", "--pos", "value"], 1, "no such cache file"),
    (["inspect", "{missing}"], 1, "no such cache file"),
    (["inspect", "{text}"], 1, "not an HDF5 cache"),
    (["probe", "{other}", "--site", "L1.block_in", "--pos", "value"], 1, "not a hookmech cache"),
    (["probe", "{cache}", "--site", "L1.blok_in", "--pos", "value"], 2, "did you mean: L1.block_in"),
    (["probe", "{cache}", "--site", "L1.mixer.q", "--pos", "value"], 2, "no clean activations for site 'L1.mixer.q'"),
    (["probe", "{cache}", "--site", "L1.block_in", "--pos", "valeu"], 2, "unknown position 'valeu'"),
    (["probe", "{cache}", "--site", "L1.block_in", "--pos", "value", "--target", "colour"], 2, "colour"),
    (["probe", "{cache}", "--site", "L1.block_in", "--pos", "value", "--heldout", "1.5"], 2, "heldout fraction"),
    (["probe", "{cache}", "--pos", "value"], 2, "--site"),
])
def test_errors_are_one_line_and_an_exit_code(tmp_path, cache_path, capsys, argv, code, pattern):
    (tmp_path / "text.h5").write_text("not hdf5")
    with h5py.File(tmp_path / "other.h5", "w") as h5:
        h5["x"] = np.zeros(2)
    paths = {"missing": tmp_path / "nope.h5", "text": tmp_path / "text.h5", "other": tmp_path / "other.h5",
             "cache": cache_path}
    argv = [arg.format(**paths) for arg in argv]
    got, out, err = run(argv, capsys)
    assert got == code, err
    assert out == "" and len(err.strip().splitlines()) == 1 and pattern in err, err
    assert err.startswith("hookmech: error:")
