"""One parse per site per command (issue 44 §1): `hookmech patch` parses its --site values once
and passes the parsed sites to the progress bar's count, the row-chunk plan, the mean ablation and
every row chunk of the engine, instead of parsing them again at each step; a path patch does the
same with its --sender and --receiver sites."""
from __future__ import annotations

import json

import pytest

import hookmech.patching.targets as targets

from helpers import REPO, run_cli

FIXTURE = str(REPO / "fixtures" / "attention_ar_cpu.safetensors")


@pytest.fixture(scope="module")
def cache_path(tmp_path_factory):
    import hookmech
    from hookmech.cache import write_cache

    path = tmp_path_factory.mktemp("parses") / "cache.h5"
    model = hookmech.load(FIXTURE)
    write_cache(model, hookmech.tasks.from_checkpoint(FIXTURE).sample(48, seed=1), path, ["all"])
    return path


@pytest.fixture
def parses(monkeypatch):
    """Count the parses of one site part (`targets._parse_part`, what `parse_sites` does per part)."""
    seen: list[str] = []
    original = targets._parse_part

    def counting(part, model):
        seen.append(part)
        return original(part, model)

    monkeypatch.setattr(targets, "_parse_part", counting)
    return seen


SITES = "L0.block_out,L1.block_in,L1.mixer.z[0]"


@pytest.mark.parametrize("extra", [[], ["--ablate", "mean"]], ids=["interchange", "mean-ablation"])
def test_patch_parses_each_site_once_over_many_row_chunks(cache_path, parses, capsys, extra):
    # --memory small enough for several row chunks: each chunk used to parse the sites again
    argv = ["patch", "--ckpt", FIXTURE, "--cache", str(cache_path), "--site", SITES, "--pos", "key,value",
            "--memory", "0.05", "--json", *extra]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert len(json.loads(out)) == 6
    assert sorted(parses) == sorted(SITES.split(","))


def test_atp_star_parses_each_site_once(cache_path, parses, capsys):
    argv = ["patch", "--ckpt", FIXTURE, "--cache", str(cache_path), "--site", "L0.block_out,L1.block_in",
            "--pos", "key,value", "--method", "atp-star", "--memory", "0.05", "--json"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert sorted(parses) == ["L0.block_out", "L1.block_in"]


def test_path_patch_parses_each_endpoint_site_once_over_many_row_chunks(cache_path, parses, capsys):
    # the endpoints used to be parsed for the bar's count and again by every row chunk
    argv = ["patch", "--ckpt", FIXTURE, "--cache", str(cache_path), "--sender", "L0.mixer.z[*]@key",
            "--receiver", "L1.mixer.q@query,L1.mixer.k@key", "--via", "head", "--memory", "0.05", "--json"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert len(json.loads(out)) == 2  # every head of z (the fixture has one), to each receiver
    assert sorted(parses) == ["L0.mixer.z[*]", "L1.mixer.k", "L1.mixer.q"]
