"""A cache patched in row chunks (`hookmech.patching.chunked`, `memory=`) gives the records of
the cache patched at once (`memory=None`, the engine as it was): each chunk's means weighted by
its rows and added, the attribution a ratio of those sums. The reference is the one-pass engine;
chunks change its batching, so p and the metric agree to ENGINE_TOL, and the invariants of the
sums (a record's mean is the mean of its own per-row values; its attribution is that of its own
means) hold to float64 round-off."""
from __future__ import annotations

import json

import pytest

from hookmech.cache import CacheFile, write_cache
from hookmech.errors import HookmechError, UsageError
from hookmech.patching import attribution_score, patch, path_patch, verify_top
from hookmech.patching.chunked import RecordSums
from hookmech.sites import resolve_sites

from helpers import ENGINE_TOL, FLOAT64_SUM_TOL, make_model, run_cli, unit_variance

N_ROWS = 12
#: a budget below one row's bytes: one row per chunk, the most chunks a cache can have
ONE_ROW = 1
MEANS = ("p_clean", "p_corrupt", "p_patched", "metric_clean", "metric_corrupt", "metric_patched")


@pytest.fixture(scope="module")
def attention_cache(tmp_path_factory, trained_attention):
    path, model, task = trained_attention
    cache = write_cache(model, task.sample(N_ROWS, seed=5), tmp_path_factory.mktemp("c") / "c.h5",
                        resolve_sites(["all"], model.hook_dict))
    return model, cache


def assert_same_records(chunked, whole, per_example=False):
    assert len(chunked) == len(whole)
    for got, want in zip(chunked, whole, strict=True):
        assert list(got) == list(want)  # the same fields, in the same order
        for field, value in want.items():
            if field in MEANS or field == "graddrop":
                assert got[field] == pytest.approx(value, abs=ENGINE_TOL), field
            elif field.endswith("_rows"):
                assert got[field] == pytest.approx(value, abs=ENGINE_TOL), field
            elif field != "attribution":
                assert got[field] == value, field
        # the sums' invariants: float64 round-off
        own = attribution_score(got["metric_clean"], got["metric_corrupt"], got["metric_patched"], got["direction"])
        assert got["attribution"] == pytest.approx(own, abs=FLOAT64_SUM_TOL)
        if per_example:
            assert len(got["p_patched_rows"]) == N_ROWS
            assert sum(got["p_patched_rows"]) / N_ROWS == pytest.approx(got["p_patched"], abs=FLOAT64_SUM_TOL)
            assert sum(got["p_clean_rows"]) / N_ROWS == pytest.approx(got["p_clean"], abs=FLOAT64_SUM_TOL)


@pytest.mark.parametrize("options", [
    {},
    {"ablate": "mean"},
    {"metric": "kl"},
    {"direction": "noise", "metric": "logit_diff"},
    {"per_example": True},
    {"method": "atp", "per_example": True},
    {"method": "atp-star", "graddrop": True},
])
def test_chunks_give_the_records_of_one_pass(attention_cache, options):
    model, cache = attention_cache
    sites, positions = ["L*.block_in", "L0.mixer_out"], ["key", "value", "query"]
    whole = patch(model, cache, sites, positions, memory=None, **options)
    chunked = patch(model, cache, sites, positions, memory=ONE_ROW, **options)
    assert all(record["n"] == N_ROWS for record in chunked)
    assert_same_records(chunked, whole, per_example=bool(options.get("per_example")))


def test_mean_ablation_uses_the_mean_over_all_rows(attention_cache):
    """Each chunk's own mean would patch another value: the first pass's mean over every row is
    the one-pass engine's, so a joint site at every position agrees with it."""
    model, cache = attention_cache
    whole = patch(model, cache, ["L1.mixer.attn_scores", "L0.block_out"], ["all", "whole"], ablate="mean", memory=None)
    chunked = patch(model, cache, ["L1.mixer.attn_scores", "L0.block_out"], ["all", "whole"], ablate="mean", memory=3000)
    assert_same_records(chunked, whole)


def test_a_recurrent_model_in_chunks(tmp_path, ar_task):
    """Mamba: resumed patches from per-chunk contexts, a state site, per-row outputs."""
    model = unit_variance(make_model(ar_task, mixers="mamba"))
    path = write_cache(model, ar_task.sample(N_ROWS, seed=4), tmp_path / "m.h5", resolve_sites(["all"], model.hook_dict))
    sites = ["L1.block_in", "L0.mixer.ssm_state", "L1.mixer_out"]
    whole = patch(model, path, sites, ["key", "value", "query"], per_example=True, memory=None)
    assert_same_records(patch(model, path, sites, ["key", "value", "query"], per_example=True, memory=ONE_ROW), whole,
                        per_example=True)


def test_path_patching_and_verify_top_in_chunks(attention_cache):
    model, cache = attention_cache
    args = (model, cache, ["L0.mixer.z[*]@key", "L0.mixer.z[*]@value"], "L1.mixer.k@whole", "head")
    assert_same_records(path_patch(*args, memory=ONE_ROW), path_patch(*args, memory=None))
    atp = patch(model, cache, ["L*.block_in"], ["key", "value", "query"], method="atp", memory=None)
    whole = verify_top(model, cache, atp, 3, memory=None)
    chunked = verify_top(model, cache, atp, 3, memory=ONE_ROW)
    for got, want in zip(chunked, whole, strict=True):
        assert got["hook"] == want["hook"] and got["pos"] == want["pos"]
        assert got["p_patched_exact"] == pytest.approx(want["p_patched_exact"], abs=ENGINE_TOL)


def test_resample_needs_one_chunk(attention_cache):
    model, cache = attention_cache
    with pytest.raises(UsageError, match="resample") as error:
        patch(model, cache, ["L1.block_in"], ["key"], ablate="resample", memory=ONE_ROW)
    assert "--memory" in str(error.value) and "\n" not in str(error.value)
    assert patch(model, cache, ["L1.block_in"], ["key"], ablate="resample")[0]["n"] == N_ROWS  # one chunk: accepted


def test_record_sums_by_hand():
    """Two chunks of 1 and 3 rows: means weighted by rows, the attribution and filter from them."""
    def record(n, p_clean, p_corrupt, p_patched, layers):
        means = {"p_clean": p_clean, "p_corrupt": p_corrupt, "p_patched": p_patched}
        return {"site": "s", "hook": "h", "pos": "key", "attribution": 0.0, **means, "n": n, "passes_filter": False,
                "method": "atp-star", "metric": "p_answer", "direction": "denoise",
                **{f"metric_{k[2:]}": v for k, v in means.items()}, "graddrop": 0.0, "graddrop_layers": layers}

    sums = RecordSums(threshold=0.5)
    sums.add([record(1, 1.0, 0.0, 0.5, [0.4, -0.4])], slice(0, 1))
    sums.add([record(3, 1.0, 0.2, 0.3, [-0.4, 0.0])], slice(1, 4))
    (out,) = sums.result()
    assert out["n"] == 4 and "graddrop_layers" not in out
    assert out["p_corrupt"] == pytest.approx(0.15) and out["p_patched"] == pytest.approx(0.35)
    assert out["attribution"] == pytest.approx((0.35 - 0.15) / (1.0 - 0.15))
    assert out["passes_filter"] is True
    assert out["graddrop"] == pytest.approx((abs(0.4 - 1.2) / 4 + abs(-0.4) / 4) / 2)
    other = RecordSums(threshold=0.5)
    other.add([record(1, 1.0, 0.0, 0.5, None)], slice(0, 1))
    with pytest.raises(HookmechError, match="--memory"):
        other.add([{**record(1, 1.0, 0.0, 0.5, None), "pos": "value"}], slice(1, 2))


def test_cli_memory_per_example_and_inspect(tmp_path, trained_attention, attention_cache, capsys):
    ckpt, _, _ = trained_attention
    _, cache = attention_cache
    base = ["patch", "--ckpt", ckpt, "--cache", cache, "--site", "L*.block_in", "--pos", "key,value", "--json"]
    files = {}
    for memory in ("0.001", "256"):
        files[memory] = tmp_path / f"rows-{memory}.json"
        code, out, err = run_cli([*base, "--memory", memory, "--per-example", files[memory]], capsys)
        assert code == 0, err
        assert "p_patched_rows" not in out
    chunked, whole = (json.loads(files[m].read_text()) for m in ("0.001", "256"))
    assert_same_records(chunked, whole, per_example=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the rows' temporary folder is gone
    code, _, err = run_cli([*base, "--memory", "0"], capsys)
    assert code == 2 and "--memory" in err and len(err.strip().splitlines()) == 1
    outputs = [run_cli(["inspect", cache, "--json", "--memory", memory], capsys) for memory in ("0.00001", "256")]
    tight, roomy = (json.loads(out) for _, out, _ in outputs)
    assert tight.pop("p_clean") == pytest.approx(roomy.pop("p_clean"), abs=1e-12)
    assert tight.pop("p_corrupt") == pytest.approx(roomy.pop("p_corrupt"), abs=1e-12)
    assert tight == roomy


def test_cli_default_memory_is_the_library_s():
    from hookmech.cli.common import DEFAULT_MEMORY_MIB as CLI_DEFAULT
    from hookmech.row_chunks import DEFAULT_MEMORY_MIB

    assert CLI_DEFAULT == DEFAULT_MEMORY_MIB
