"""docs/your_mixer.md, end to end: its mixer's source, taken from the page, written into a temporary
folder outside the repository, trained with the command line, cached and patched; the engine's
records against the plain `run_with_hooks` loop (hookmech.oracles.plain_loop) to ENGINE_TOL; the
full-rank DAS against that interchange; the checkpoint's recorded name; the one-line refusal once
the file is gone."""
from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import ENGINE_TOL, REPO, run_cli, unit_variance

import hookmech
from hookmech.cache import CacheFile
from hookmech.checkpoint import read_metadata
from hookmech.das import train as das_train
from hookmech.oracles import plain_loop_patch
from hookmech.patching import patch

PAGE = REPO / "docs" / "your_mixer.md"
KEYS = ("p_clean", "p_corrupt", "p_patched")
SITES = ["L*.block_in", "L0.mixer.k", "L1.mixer.q", "L1.mixer.pattern"]
POSITIONS = ["key", "value", "query"]


def page_mixer_source() -> str:
    """The page's first Python block: the mixer's file, as a reader copies it."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert blocks and "class SmearAttention(Mixer)" in blocks[0]
    return blocks[0]


def test_the_pages_mixer_is_about_forty_lines_and_says_so():
    lines = len(page_mixer_source().splitlines())
    assert 30 <= lines <= 45 and f"## 1. The mixer: {lines} lines" in PAGE.read_text()


def assert_engine_matches_plain_loop(records, reference) -> None:
    assert len(records) == len(reference) > 0
    for record in records:
        expected = reference[record["hook"], record["pos"]]
        for key in KEYS:  # contract: engine vs plain loop, ENGINE_TOL
            assert abs(record[key] - expected[key]) <= ENGINE_TOL, (record["site"], record["pos"], key)
    # a patch the engine failed to apply would show: some patch moves p(answer)
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in records) > 2 * ENGINE_TOL


def test_the_pages_mixer_trains_caches_and_patches_from_a_folder_outside_the_repository(tmp_path, monkeypatch,
                                                                                        capsys):
    folder = tmp_path / "mixers"
    folder.mkdir()
    assert not folder.resolve().is_relative_to(REPO)
    (folder / "smear.py").write_text(page_mixer_source())
    monkeypatch.chdir(folder)  # the page's commands run from the mixer's folder, naming it relatively

    code, out, err = run_cli(["train", "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3",
                              "--n-train", "0", "--steps", "60", "--n-dev", "16", "--eval-every", "30",
                              "--mixer", "smear.py:SmearAttention", "--mixer-opt", "L1.smear=false",
                              "--d-model", "16", "--lr", "1e-2", "-o", "runs/smear"], capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["status"] == "finished"
    checkpoint = folder / "runs" / "smear" / "model.safetensors"
    config = read_metadata(checkpoint)["config"]
    canonical = f"{(folder / 'smear.py').resolve()}:SmearAttention"
    assert config.mixers == (canonical, canonical)
    assert config.mixer_kwargs == ({}, {"smear": False})

    # loading it imports the mixer's file only when allowed (docs/formats.md, "What loading runs")
    code, _, err = run_cli(["cache", "--ckpt", checkpoint, "--n", "24", "--seed", "1", "-o", "runs/smear/cache.h5",
                            "--allow-mixer", "smear.py"], capsys)
    assert code == 0, err
    code, out, err = run_cli(["patch", "--ckpt", checkpoint, "--cache", "runs/smear/cache.h5", "--site",
                              ",".join(SITES), "--pos", ",".join(POSITIONS), "--json", "--allow-mixer", "smear.py"],
                             capsys)
    assert code == 0, err
    records = json.loads(out)
    model = hookmech.load(checkpoint, allow_mixers=["smear.py"]).eval()
    with CacheFile(folder / "runs" / "smear" / "cache.h5") as cache:
        batch = cache.batch()
    reference = {(hook, pos): means for (hook, pos), means in plain_loop_patch(model, batch, SITES, POSITIONS).items()}
    assert_engine_matches_plain_loop(records, reference)

    # DAS at full rank is the vanilla interchange at that cell, on DAS's dev rows (tests/test_das.py)
    site, pos = "L1.block_in", "query"
    cache_path = folder / "runs" / "smear" / "cache.h5"
    result = das_train(model, cache_path, site, pos, dims=[16], steps=2, batch_size=8)
    (record,), dev = result.records, result.dev_rows
    (cell,) = patch(model, cache_path, site, pos, per_example=True)
    with CacheFile(cache_path) as cache:
        p_clean, p_corrupt = (cache.p_answer(which).double()[dev].mean().item() for which in ("clean", "corrupt"))
    p_patched = torch.tensor(cell["p_patched_rows"], dtype=torch.float64)[dev].mean().item()
    assert record["attribution_full"] == pytest.approx((p_patched - p_corrupt) / (p_clean - p_corrupt),
                                                       abs=ENGINE_TOL)

    # the same model with unit-variance weights, whose patches move p(answer) far more: every
    # block site and every inside hook with a position axis, through the library's engine
    strong = unit_variance(model)
    sites = ["all", *(name for name, point in strong.hook_dict.items()
                      if ".mixer." in name and getattr(point, "pos_axis", None) is not None)]
    assert any("mixer.hook_pattern" in site for site in sites)
    assert_engine_matches_plain_loop(patch(strong, batch, sites, ["key", "value+query"], max_batch=7),
                                     plain_loop_patch(strong, batch, sites, ["key", "value+query"]))

    # the checkpoint names the file: moved away, loading it is refused in one line
    (folder / "smear.py").rename(tmp_path / "smear.py")
    code, _, err = run_cli(["sites", "--ckpt", checkpoint, "--allow-mixer", "smear.py"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0] == (f"hookmech: error: {checkpoint}: model config: mixer '{canonical}': "
                        f"no such file {(folder / 'smear.py').resolve()}")
