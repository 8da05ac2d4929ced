"""The toolkit on pretrained families (a tiny random GPT-2 and Pythia loaded from their Hugging
Face folders): caches identify the model (model_hash) and record the folder, patching from a
cache equals patching from scratch, path patching equals its two-pass reference, DAS at full
rank is the interchange, and the view's records are the engine's. AR examples whose ids are
within the models' vocabulary stand for the tokenizer tasks."""
from __future__ import annotations

import h5py
import pytest
import torch
from helpers import CACHE_TOL, ENGINE_TOL
from pretrained_folders import folder_of

import hookmech
from hookmech.cache import CacheFile, write_cache
from hookmech.errors import HookmechError
from hookmech.identity import model_hash
from hookmech.oracles import path_patch_reference
from hookmech.patching import patch, path_patch

pytest.importorskip("transformers")

KEYS = ("p_clean", "p_corrupt", "p_patched")
METRIC_KEYS = ("metric_clean", "metric_corrupt", "metric_patched")
SITES = ["L0.block_in", "L1.block_in", "L0.mixer_out", "L1.mlp_in", "L1.mixer.rot_k", "L1.mixer.v"]


@pytest.fixture(scope="module")
def pythia_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")
    return folder_of("pythia", root), folder_of("pythia", root / "other", seed=1)


@pytest.fixture(scope="module")
def task():
    return hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)


@pytest.fixture(scope="module")
def cached(pythia_folders, task, tmp_path_factory):
    folder, _ = pythia_folders
    model = hookmech.from_pretrained(folder)
    batch = task.sample(24, seed=1)
    path = tmp_path_factory.mktemp("cache") / "c.h5"
    write_cache(model, batch, path, SITES, model_source=str(folder.resolve()), task_spec=task.spec)
    return model, batch, path


def test_a_cache_of_a_folder_model_records_its_identity_and_folder(cached, pythia_folders):
    model, _, path = cached
    with h5py.File(path, "r") as h5:
        assert h5.attrs["model_hash"] == model_hash(model)
        assert h5.attrs["model_source"] == str(pythia_folders[0].resolve()) and h5.attrs["model_sha256"] == ""
    with CacheFile(path) as cache:
        cache.check_model(model, checkpoint=pythia_folders[0])
        assert cache.summary()["model_source"] == str(pythia_folders[0].resolve())
        other = hookmech.from_pretrained(pythia_folders[1])
        with pytest.raises(HookmechError, match="was made from another model"):
            cache.check_model(other, checkpoint=pythia_folders[1])


def test_patching_from_a_cache_equals_patching_from_scratch(cached):
    model, batch, path = cached
    from_cache = patch(model, path, SITES, ["key", "value"])
    from_scratch = patch(model, batch, SITES, ["key", "value"])
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in from_scratch) > 100 * CACHE_TOL
    for got, want in zip(from_cache, from_scratch, strict=True):
        assert (got["site"], got["pos"]) == (want["site"], want["pos"])
        for key in KEYS:  # contract: patching from an fp32 cache vs from scratch
            assert abs(got[key] - want[key]) <= CACHE_TOL, (got["site"], key)


@pytest.mark.parametrize("case", ["gpt2", "pythia", "pythia-sequential"])
@pytest.mark.parametrize(
    "sender, receiver, via",
    [("L0.mixer_out@key+value", "L1.block_in@whole", "resid"), ("L0.mixer.z[1]@key", "L1.mixer.k[0]@whole", "head"),
     ("L0.mlp_out@key", "L1.block_in@whole", "resid")],  # a parallel block: the MLP at the query sees its token only
    ids=["resid", "head", "resid-from-mlp"],
)
def test_path_patching_equals_the_two_pass_reference(tmp_path, task, case, sender, receiver, via):
    model = hookmech.from_pretrained(folder_of(case, tmp_path))
    batch = task.sample(6, seed=2)
    # log p: a random model's p(answer) is near 1/48, which a path moves by little in p
    records = path_patch(model, batch, sender, receiver, via, max_batch=5, metric="log_p")
    reference = path_patch_reference(model, batch, sender, receiver, via, metric="log_p")
    assert len(records) == len(reference) > 0
    for record in records:
        expected = reference[record["sender"], record["receiver"]]
        for key in (*KEYS, *METRIC_KEYS):  # contract: engine vs plain reference, ENGINE_TOL
            assert abs(record[key] - expected[key]) <= ENGINE_TOL, (record["sender"], record["receiver"], key)
    assert max(abs(r["metric_patched"] - r["metric_corrupt"]) for r in records) > 2 * ENGINE_TOL


def test_full_rank_das_is_the_interchange_at_that_cell(cached):
    """K = d_model: DAS's attribution on its dev rows is the exact engine's at that cell."""
    from hookmech.das import train

    model, _, path = cached
    result = train(model, path, "L1.block_in", "value", dims=[model.cfg.d_model], steps=2, batch_size=8, seed=2)
    (record,) = result.records
    dev = result.dev_rows
    (cell,) = patch(model, path, "L1.block_in", "value", per_example=True)
    with hookmech.cache.open(path) as cache:
        p_clean, p_corrupt = (cache.p_answer(which).double()[dev].mean().item() for which in ("clean", "corrupt"))
    p_patched = torch.tensor(cell["p_patched_rows"], dtype=torch.float64)[dev].mean().item()
    expected = (p_patched - p_corrupt) / (p_clean - p_corrupt)
    assert record["attribution_full"] == pytest.approx(expected, abs=ENGINE_TOL)


def test_atp_star_runs_every_site_of_a_parallel_model(cached):
    """AtP* on a parallel model with rotary heads: a finite estimate for every block site and inside hook."""
    from hookmech.patching import atp_star_patch

    model, batch, _ = cached
    records = atp_star_patch(model, batch, ["all", "L1.mixer.*"], ["key", "query"])
    assert records and all(0.0 <= r["p_patched"] <= 1.0 for r in records)
    assert {"blocks.1.mixer.hook_rot_q", "blocks.1.hook_mlp_in"} <= {r["hook"] for r in records}


def test_the_views_records_are_the_engines(cached, task):
    from hookmech.view import checkpoint_page_data

    model, batch, _ = cached
    data = checkpoint_page_data(model, task, batch, sites=["L*.block_in"], positions=["key", "value"], map_examples=2)
    expected = patch(model, batch, ["L*.block_in"], ["key", "value"])
    assert [(r["site"], r["pos"], r["p_patched"]) for r in data["records"]] == [
        (r["site"], r["pos"], r["p_patched"]) for r in expected
    ]
    assert len(data["maps"]) > 0
