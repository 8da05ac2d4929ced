"""Patching: the engine against the plain TransformerLens loop, hand computations and the free
invariants of interchange interventions."""
from __future__ import annotations

import math

import pytest
import torch

from hookmech.errors import UsageError
from hookmech.patching import attribution_score, patch
from hookmech.oracles import plain_loop_patch

from helpers import ENGINE_TOL, FLOAT64_SUM_TOL, make_model, unit_variance

POSITIONS = ["key", "value", "query", "divider", "whole", "key+value", "-2"]


def test_attribution_formula_by_hand():
    # float64 round-off of the formula (0.9 - 0.1 is not 0.8 exactly): pytest.approx's rel 1e-6
    assert attribution_score(0.9, 0.1, 0.5) == pytest.approx(0.5)
    assert attribution_score(0.9, 0.1, 0.1) == 0.0
    assert attribution_score(0.9, 0.1, 0.9) == pytest.approx(1.0)
    assert attribution_score(0.3, 0.3, 0.5) is None


@pytest.mark.parametrize("sites", [["all"], ["L0.mixer.*", "L1.mixer.*"], ["embed", "pos_embed", "final_norm"]])
def test_engine_equals_the_plain_run_with_hooks_loop(ar_task, sites):
    model = make_model(ar_task, layer_options=[{"window": 2}, {"qkv_conv": "k"}])
    batch = ar_task.sample(40, seed=7)
    records = patch(model, batch, sites, POSITIONS, max_batch=64)
    reference = plain_loop_patch(model, batch, sites, POSITIONS)
    assert len(records) == len(reference) > 0
    for record in records:
        expected = reference[record["hook"], record["pos"]]
        for key in ("p_clean", "p_corrupt", "p_patched"):  # contract: engine vs plain loop, ENGINE_TOL
            assert abs(record[key] - expected[key]) <= ENGINE_TOL, (record["site"], record["pos"], key)


def test_ratio_of_means_by_hand(ar_model, ar_task):
    """attribution = (mean p_patched - mean p_corrupt) / (mean p_clean - mean p_corrupt),
    with per-row probabilities computed here by plain forwards."""
    batch = ar_task.sample(30, seed=1)
    rows = torch.arange(30)
    with torch.no_grad():
        p_clean = ar_model(batch.tokens)[rows, batch.query_pos].softmax(-1)[rows, batch.answers]
        p_corrupt = ar_model(batch.corrupt_tokens)[rows, batch.query_pos].softmax(-1)[rows, batch.answers]
    # patching the embedding at the key restores the clean input exactly: p_patched = p_clean per row
    # (the engine vs plain forwards here: ENGINE_TOL throughout)
    record, = patch(ar_model, batch, ["embed"], ["key"], per_example=True)
    torch.testing.assert_close(torch.tensor(record["p_patched_rows"]), p_clean, rtol=0, atol=ENGINE_TOL)
    assert record["p_clean"] == pytest.approx(p_clean.double().mean().item(), abs=ENGINE_TOL)
    assert record["p_corrupt"] == pytest.approx(p_corrupt.double().mean().item(), abs=ENGINE_TOL)
    assert record["p_patched"] == pytest.approx(record["p_clean"], abs=ENGINE_TOL)
    # the ratio of the record's own means (the same float64 quotient, its terms summed in any order)
    ratio = (record["p_patched"] - record["p_corrupt"]) / (record["p_clean"] - record["p_corrupt"])
    assert record["attribution"] == pytest.approx(ratio, rel=FLOAT64_SUM_TOL)
    # and the embedding anywhere else is identical in both runs: nothing changes
    record, = patch(ar_model, batch, ["embed"], ["value"])
    assert record["p_patched"] == pytest.approx(record["p_corrupt"], abs=ENGINE_TOL)


def test_patching_the_residual_stream_at_every_position_restores_p_clean(ar_model, ar_task):
    """The residual stream is the whole state of a causal model: restoring it everywhere
    restores the clean run (a sublayer input alone does not: the residual keeps the corruption)."""
    batch = ar_task.sample(30, seed=2)
    records = patch(ar_model, batch, ["L*.block_in", "L*.resid_mid", "L*.block_out", "final_norm"], ["whole"])
    assert len(records) == 7
    for record in records:  # a patched engine run vs the engine's clean run: ENGINE_TOL
        assert record["p_patched"] == pytest.approx(record["p_clean"], abs=ENGINE_TOL), record["site"]


def test_layer0_block_in_matters_only_at_the_key(ar_model, ar_task):
    batch = ar_task.sample(30, seed=3)
    records = {r["pos"]: r for r in patch(ar_model, batch, ["L0.block_in"], ["key", "value", "query", "divider", "all"])}
    for pos, record in records.items():
        if pos in ("key",):
            continue
        if pos.isdigit() and (batch.roles["key"] == int(pos)).any():
            continue
        # nothing changes: p_patched is the corrupt run's (the engine vs a plain run: ENGINE_TOL)
        assert record["p_patched"] == pytest.approx(record["p_corrupt"], abs=ENGINE_TOL), pos


def test_block_out_equals_next_block_in(ar_task):
    """Block 0's output is block 1's input. The engine runs both sites as one patch, so comparing
    its two records would compare a value with itself: each site is checked against the plain
    `run_with_hooks` loop on its own hook instead, and the two loops against each other."""
    model = unit_variance(make_model(ar_task))  # patches move p(answer) well beyond ENGINE_TOL
    batch = ar_task.sample(30, seed=4)
    positions = ["key", "value", "query", "divider"]
    loops = {}
    for site, hook in (("L0.block_out", "blocks.0.hook_resid_post"), ("L1.block_in", "blocks.1.hook_resid_pre")):
        records = patch(model, batch, [site], positions)
        assert [(r["hook"], r["pos"]) for r in records] == [(hook, pos) for pos in positions]
        loops[site] = plain_loop_patch(model, batch, [hook], positions)
        for record in records:  # contract: engine vs plain loop, ENGINE_TOL
            expected = loops[site][hook, record["pos"]]
            assert abs(record["p_patched"] - expected["p_patched"]) <= ENGINE_TOL, (site, record["pos"])
        # a patch the engine failed to apply (or applied at another hook) would show
        assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in records) > 2 * ENGINE_TOL, site
    # two plain loops, the same tensor patched on either side of the block boundary: exact
    out, nxt = loops["L0.block_out"].values(), loops["L1.block_in"].values()
    for a, b in zip(out, nxt, strict=True):
        assert a["p_patched"] == b["p_patched"]


def test_batching_does_not_change_results(ar_model, ar_task):
    batch = ar_task.sample(25, seed=5)
    small = patch(ar_model, batch, ["all"], ["key", "value"], max_batch=3)
    large = patch(ar_model, batch, ["all"], ["key", "value"], max_batch=4096)
    for a, b in zip(small, large, strict=True):  # two engine batchings: ENGINE_TOL
        assert a["p_patched"] == pytest.approx(b["p_patched"], abs=ENGINE_TOL)


def test_zero_denominator_gives_null_and_fails_the_filter(ar_task):
    model = make_model(ar_task)
    batch = ar_task.sample(5, seed=0)
    batch.corrupt_tokens = batch.tokens.clone()
    record, = patch(model, batch, ["L1.block_in"], ["value"])
    assert record["attribution"] is None and record["passes_filter"] is False


def test_filter_threshold(ar_model, ar_task):
    batch = ar_task.sample(10, seed=0)
    record, = patch(ar_model, batch, ["L1.block_in"], ["value"], threshold=-1.0)
    assert record["passes_filter"] is True
    record, = patch(ar_model, batch, ["L1.block_in"], ["value"], threshold=1.0)
    assert record["passes_filter"] is False


def test_records_have_the_contract_fields(ar_model, ar_task):
    record, = patch(ar_model, ar_task.sample(4, seed=0), ["L1.block_in"], ["value"])
    assert set(record) == {"site", "hook", "pos", "attribution", "p_clean", "p_corrupt", "p_patched", "n", "passes_filter", "method",
                           "metric", "direction", "metric_clean", "metric_corrupt", "metric_patched"}
    assert record["site"] == "L1.block_in" and record["hook"] == "blocks.1.hook_resid_pre" and record["n"] == 4
    assert record["method"] == "exact" and record["metric"] == "p_answer" and record["direction"] == "denoise"
    assert record["metric_patched"] == record["p_patched"] and record["metric_clean"] == record["p_clean"]
    assert all(math.isfinite(record[k]) for k in ("p_clean", "p_corrupt", "p_patched"))


def test_unknown_method_and_bad_batch_are_errors(ar_model, ar_task):
    batch = ar_task.sample(4, seed=0)
    with pytest.raises(UsageError):
        patch(ar_model, batch, ["L1.block_in"], ["value"], method="gradient")
    with pytest.raises(UsageError):
        patch(ar_model, batch, ["L1.block_in"], ["value"], max_batch=0)


def test_engine_leaves_user_hooks_alone(ar_model, ar_task):
    calls = []
    ar_model.blocks[0].hook_resid_pre.add_hook(lambda act, hook: calls.append(1), is_permanent=True)
    try:
        patch(ar_model, ar_task.sample(4, seed=0), ["L1.block_in"], ["value"])
        assert calls and ar_model.blocks[0].hook_resid_pre.fwd_hooks
    finally:
        ar_model.reset_hooks(including_permanent=True)


def test_trained_fixture_shows_induction(trained_attention):
    _, model, task = trained_attention
    batch = task.sample(320, seed=1)
    records = {r["pos"]: r for r in patch(model, batch, ["L1.block_in"], ["key", "value", "query", "divider"])}
    assert records["value"]["attribution"] >= 0.8
    assert records["key"]["attribution"] <= 0.2
    assert records["value"]["p_clean"] - records["value"]["p_corrupt"] > 0.5


@pytest.mark.parametrize("method", ["exact", "atp", "atp-star"])
def test_a_float64_model_patches_from_a_float32_cache(tmp_path, ar_task, method):
    """The cache keeps float32; a float64 model reads it in its own precision: the numbers of the
    same patch from the batch, to the cache's rounding (CACHE_TOL)."""
    from helpers import CACHE_TOL

    from hookmech.cache import write_cache
    from hookmech.sites import resolve_sites

    model = unit_variance(make_model(ar_task)).double()
    batch = ar_task.sample(6, seed=1)
    path = write_cache(model, batch, tmp_path / "c.h5", resolve_sites(["all"], model.hook_dict))
    cached = patch(model, path, ["all"], ["key", "query"], method=method)
    direct = patch(model, batch, ["all"], ["key", "query"], method=method)
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in direct) > 1e-3
    for a, b in zip(cached, direct, strict=True):
        assert (a["hook"], a["pos"]) == (b["hook"], b["pos"])
        assert a["p_patched"] == pytest.approx(b["p_patched"], abs=CACHE_TOL)
