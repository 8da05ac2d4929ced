"""`hookmech das`: the records and files it writes against the library's."""

from __future__ import annotations

import json

from helpers import ATTENTION_FIXTURE, run_cli
from safetensors.torch import load_file

import hookmech
from hookmech.cache import write_cache


def _cache(tmp_path):
    model, task = hookmech.load(ATTENTION_FIXTURE), hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)
    return model, write_cache(
        model, task.sample(24, seed=3), tmp_path / "c.h5", ["blocks.1.hook_resid_pre"], task_spec=task.spec
    )


def test_das_writes_the_library_records_and_bases(tmp_path, capsys):
    model, cache = _cache(tmp_path)
    argv = [
        "das",
        "--ckpt",
        ATTENTION_FIXTURE,
        "--cache",
        cache,
        "--site",
        "L1.block_in",
        "--pos",
        "value",
        "--dim",
        "1",
        "--dim",
        "2,4",
        "--steps",
        "4",
        "--batch-size",
        "8",
        "--seed",
        "3",
    ]
    code, out, err = run_cli([*argv, "--json", "-o", tmp_path / "out"], capsys)
    assert code == 0 and err == ""
    printed = json.loads(out)
    expected = hookmech.das.train(model, cache, "L1.block_in", "value", [1, 2, 4], steps=4, batch_size=8, seed=3)
    assert printed == expected.records
    assert json.loads((tmp_path / "out" / "records.json").read_text()) == expected.records
    assert [record["dim"] for record in printed] == [1, 2, 4]
    for key in (
        "site",
        "pos",
        "dim",
        "iia",
        "iia_random",
        "attribution",
        "attribution_random",
        "n_dev",
        "steps",
        "seed",
    ):
        assert key in printed[0], key
    bases = load_file(tmp_path / "out" / "bases.safetensors")
    assert set(bases) == {"dim1", "dim2", "dim4", "random_dim1", "random_dim2", "random_dim4"}
    for name, basis in expected.bases.items():
        assert bases[name].equal(basis), name
    code, out, err = run_cli([*argv, "-o", tmp_path / "table"], capsys)
    assert code == 0 and err == ""
    assert out.startswith("L1.block_in at value (d = 64,") and "IIA random" in out
    assert len(out.strip().splitlines()) == 1 + 2 + 3 + 1  # title, header and rule, one row per K, files
