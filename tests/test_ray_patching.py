"""`patch --engine ray` (`hookmech.patching.distributed`): a cache's row chunks shared out over
2 Ray workers of a local Ray give the local engine's records to 1e-12 in the means (each chunk is
computed as the local engine computes it; only the order the float64 sums are added in may
differ). The reference is the local engine (`patch`, `path_patch` with the same `memory`).
Skipped where Ray (the dist extra) is not installed; CI runs them in a venv that has it."""
from __future__ import annotations

import importlib.util
import json

import pytest

from hookmech.cache import CacheFile, write_cache
from hookmech.patching import patch, path_patch, verify_top
from hookmech.sites import resolve_sites

from helpers import ENGINE_TOL, run_cli

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed (the dist extra: pip install 'hookmech[dist]')"
)

#: the contract of --engine ray: the local engine's means, to float64 round-off
RAY_TOL = 1e-12
MEANS = ("p_clean", "p_corrupt", "p_patched", "metric_clean", "metric_corrupt", "metric_patched")
N_ROWS = 24
MEMORY = 1  # one row per chunk: 24 chunks, 12 per worker


@pytest.fixture(scope="module")
def ray_setup(tmp_path_factory, trained_attention):
    from hookmech.patching.distributed import RayPatchEngine

    ckpt, model, task = trained_attention
    path = write_cache(model, task.sample(N_ROWS, seed=6), tmp_path_factory.mktemp("ray") / "c.h5",
                       resolve_sites(["all"], model.hook_dict))
    with RayPatchEngine(ckpt, path, workers=2, threads=1) as engine, CacheFile(path) as cache:
        yield model, cache, engine


def assert_equal_records(got, want, tol=RAY_TOL):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert list(a) == list(b)
        for field, value in b.items():
            if field in MEANS or field in ("attribution", "graddrop"):
                assert a[field] == pytest.approx(value, abs=tol, rel=0), field
            elif field.endswith("_rows"):
                assert a[field] == pytest.approx(value, abs=tol, rel=0), field
            else:
                assert a[field] == value, field


@pytest.mark.parametrize("options", [
    {},
    {"ablate": "mean"},
    {"metric": "logit_diff", "per_example": True},
    {"method": "atp", "per_example": True},
    {"method": "atp-star", "graddrop": True},
])
def test_ray_gives_the_local_records(ray_setup, options):
    model, cache, engine = ray_setup
    sites, positions = ["L*.block_in", "L0.mixer_out"], ["key", "value", "query"]
    local = patch(model, cache, sites, positions, memory=MEMORY, **options)
    shared = engine.patch(model, cache, sites, positions, memory=MEMORY, **options)
    assert_equal_records(shared, local)
    assert {t["rows"] for t in engine.timings if t["kind"] == "patch"} == {N_ROWS // 2}  # both workers had rows


def test_ray_path_patching_and_verify_top(ray_setup):
    model, cache, engine = ray_setup
    ends = (["L0.mixer.z[*]@key"], ["L1.mixer.k@whole"], "head")
    assert_equal_records(engine.path_patch(model, cache, *ends, memory=MEMORY), path_patch(model, cache, *ends, memory=MEMORY))
    atp = patch(model, cache, ["L*.block_in"], ["key", "value", "query"], method="atp", memory=MEMORY)
    local = verify_top(model, cache, atp, 2, memory=MEMORY)
    shared = verify_top(model, cache, atp, 2, exact=lambda s, p: engine.patch(model, cache, s, p, memory=MEMORY))
    assert_equal_records(shared, local)


def test_a_cache_in_one_chunk_is_cut_per_worker(ray_setup):
    """Fewer chunks than workers: one chunk each; the batching differs from the local engine's one
    chunk, so the records agree to the engine's tolerance."""
    model, cache, engine = ray_setup
    local = patch(model, cache, ["L1.block_in"], ["key", "value"])
    shared = engine.patch(model, cache, ["L1.block_in"], ["key", "value"], memory=256 << 20)
    assert_equal_records(shared, local, tol=ENGINE_TOL)
    assert engine.timings[-1]["rows"] == N_ROWS // 2


@pytest.mark.slow
def test_cli_engine_ray(tmp_path, trained_attention, capsys):
    """The command line starts its own local Ray (after the module's engine: run last)."""
    ckpt, model, task = trained_attention
    path = write_cache(model, task.sample(10, seed=2), tmp_path / "c.h5", resolve_sites(["all"], model.hook_dict))
    base = ["patch", "--ckpt", ckpt, "--cache", path, "--site", "L1.block_in", "--pos", "key,value", "--json",
            "--memory", "0.01", "--threads", "1"]
    code, local, err = run_cli(base, capsys)
    assert code == 0, err
    code, shared, err = run_cli([*base, "--engine", "ray", "--workers", "2"], capsys)
    assert code == 0, err
    assert_equal_records(json.loads(shared), json.loads(local))
