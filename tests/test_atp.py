"""Attribution patching: exact where the model is linear in the patched activation, the
first-order term of finite differences for tiny patches, a hand-written gradient, and the
records' contract."""
from __future__ import annotations

import pytest
import torch

from hookmech.cache import write_cache
from hookmech.errors import UsageError
from hookmech.patching import Metric, attribution_patch, first_order_effects, patch, verify_top
from hookmech.sites import resolve_sites

from helpers import CACHE_TOL, ENGINE_TOL, FLOAT64_SUM_TOL, make_model

CONTRACT = {"site", "hook", "pos", "attribution", "p_clean", "p_corrupt", "p_patched", "n", "passes_filter", "method"}


def _run_patched(model, tokens, hook, clean, position, query, metric):
    """Exact reference: the full corrupt forward with `hook` set to `clean` at `position` (every row)."""
    axis = model.hook_dict[hook].pos_axis

    def replace(activation, hook=None):
        activation = activation.clone()
        index = [slice(None)] * activation.dim()
        index[axis] = position
        activation[tuple(index)] = clean[tuple(index)]
        return activation

    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=[(hook, replace)])
    return metric(logits[torch.arange(len(tokens)), query])


def _activations(model, tokens, hooks):
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=hooks, return_cache_object=False)
    return cache


def test_logit_estimate_is_exact_where_the_rest_of_the_model_is_linear(ar_task):
    """After `ln_final.hook_normalized` only the unembedding is left: a logit difference is
    linear in that activation, so the first-order estimate is the exact change, at every position."""
    model = make_model(ar_task, n_layers=1, mlp=False, tie_embeddings=False).double()
    batch = ar_task.sample(12, seed=3)
    hook = "ln_final.hook_normalized"
    clean = _activations(model, batch.tokens, [hook])[hook]
    other = (batch.answers + 1) % model.cfg.d_vocab
    logit = lambda logits: (logits.gather(-1, batch.answers[:, None]) - logits.gather(-1, other[:, None])).squeeze(-1)  # noqa: E731
    base, effects = first_order_effects(model, batch.corrupt_tokens, {hook: clean}, batch.query_pos, batch.answers,
                                        metric=Metric("logit_diff", batch.answers, corrupt_answers=other))
    with torch.no_grad():
        corrupt_logits = model(batch.corrupt_tokens)[torch.arange(12), batch.query_pos]
    # float64 model, two forwards of the same inputs: round-off far below torch's float64 defaults
    torch.testing.assert_close(base, logit(corrupt_logits))
    for position in range(batch.tokens.shape[1]):
        exact = _run_patched(model, batch.corrupt_tokens, hook, clean, position, batch.query_pos, logit) - base
        # linear: gradient·Δ equals the change up to float64 round-off of a d_model-long dot product
        torch.testing.assert_close(effects[hook][:, position], exact, atol=1e-10, rtol=1e-9)
    # only the query row reaches the query's logit
    off_query = torch.ones_like(effects[hook], dtype=torch.bool)
    off_query[torch.arange(12), batch.query_pos] = False
    assert (effects[hook][off_query] == 0).all()
    assert (effects[hook][~off_query].abs() > 0).any()


def test_p_estimate_is_the_hand_written_softmax_gradient(ar_task):
    """Through the records: for the final norm at the query, Δlogits = W_U Δx exactly and
    Δp_a ≈ p_a (Δl_a − Σ_j p_j Δl_j) (the softmax Jacobian), computed here by hand."""
    model = make_model(ar_task, n_layers=1, mlp=False, tie_embeddings=False).double()
    batch = ar_task.sample(20, seed=4)
    hook = "ln_final.hook_normalized"
    rows = torch.arange(20)
    clean = _activations(model, batch.tokens, [hook])[hook][rows, batch.query_pos]
    corrupt = _activations(model, batch.corrupt_tokens, [hook])[hook][rows, batch.query_pos]
    with torch.no_grad():
        probs = model.unembed(corrupt).softmax(-1)
        delta_logits = model.unembed.weight @ (clean - corrupt).T  # [d_vocab, N]
    p_answer = probs[rows, batch.answers]
    delta_p = p_answer * (delta_logits.T[rows, batch.answers] - (probs * delta_logits.T).sum(-1))
    record, = attribution_patch(model, batch, ["final_norm"], ["query"], per_example=True)
    # float64 model, but the records' base p(answer) is a float32 softmax (hookmech.cache.answer_probs):
    # float32 round-off, below 1e-6
    assert record["p_corrupt"] == pytest.approx(p_answer.mean().item(), abs=1e-6)
    torch.testing.assert_close(torch.tensor(record["p_patched_rows"], dtype=torch.float64),  # the same float32 base p
                               p_answer + delta_p, atol=1e-6, rtol=1e-6)
    assert record["p_patched"] == pytest.approx((p_answer + delta_p).mean().item(), abs=1e-6)


@pytest.mark.parametrize("mixer, hooks", [
    ("attention", ["hook_embed", "blocks.0.hook_resid_pre", "blocks.0.mixer.hook_pattern", "blocks.0.mixer.hook_v",
                   "blocks.1.hook_mlp_in", "blocks.1.hook_resid_post"]),
    ("mamba", ["blocks.0.hook_mixer_in", "blocks.0.mixer.hook_in_x", "blocks.1.mixer.hook_C", "blocks.1.hook_mixer_out"]),
])
@pytest.mark.parametrize("metric", ["p_answer", "log_p"])
def test_estimate_matches_finite_differences_for_tiny_patches(ar_task, mixer, hooks, metric):
    """A clean activation eps away from the corrupt one: the exact change is eps·(estimate/eps) + O(eps²)."""
    model = make_model(ar_task, mixers=mixer).double()
    batch = ar_task.sample(6, seed=5)
    corrupt = _activations(model, batch.corrupt_tokens, hooks)
    generator = torch.Generator().manual_seed(0)
    # the error is O(eps²): at 1e-5 of each activation's scale it is ~1e-5 of the estimate
    clean = {hook: corrupt[hook] + 1e-5 * corrupt[hook].std() * torch.randn(corrupt[hook].shape, generator=generator,
                                                                              dtype=torch.float64)
             for hook in hooks}
    p = lambda logits: logits.softmax(-1).gather(-1, batch.answers[:, None]).squeeze(-1)  # noqa: E731
    measure = p if metric == "p_answer" else (lambda logits: p(logits).log())
    base, effects = first_order_effects(model, batch.corrupt_tokens, clean, batch.query_pos, batch.answers,
                                        metric=metric)
    for hook in hooks:
        scale = effects[hook].abs().max().item()
        assert scale > 1e-13, hook  # far above float64 round-off of p ~ 0.05
        for position in (int(batch.roles["key"][0]), int(batch.roles["value"][0]), int(batch.query_pos[0])):
            exact = _run_patched(model, batch.corrupt_tokens, hook, clean[hook], position, batch.query_pos, measure) - base
            torch.testing.assert_close(effects[hook][:, position], exact, atol=1e-3 * scale, rtol=0,
                                       msg=f"{hook} at {position}")


def test_joint_positions_add_up(ar_model, ar_task):
    batch = ar_task.sample(16, seed=6)
    records = attribution_patch(ar_model, batch, ["L0.block_in", "L1.mixer.q"], ["key", "value", "key+value", "whole", "all"])
    by = {(r["site"], r["pos"]): r for r in records}
    for site in ("L0.block_in", "L1.mixer.q"):
        change = {pos: by[site, pos]["p_patched"] - by[site, pos]["p_corrupt"] for (s, pos) in by if s == site}
        # joint estimates are float64 sums of the same per-position terms: float64 round-off
        assert change["key+value"] == pytest.approx(change["key"] + change["value"], abs=FLOAT64_SUM_TOL)
        every = sum(change[str(p)] for p in range(batch.tokens.shape[1]))
        assert change["whole"] == pytest.approx(every, abs=FLOAT64_SUM_TOL)


def test_records_have_the_contract_fields_and_the_exact_means(ar_model, ar_task):
    batch = ar_task.sample(10, seed=7)
    atp = attribution_patch(ar_model, batch, ["all"], ["key", "value", "-2"], per_example=True)
    exact = patch(ar_model, batch, ["all"], ["key", "value", "-2"])
    assert len(atp) == len(exact) == 2 * 7 * 3
    for a, e in zip(atp, exact, strict=True):
        assert set(a) == set(e) | {"p_patched_rows", "p_clean_rows", "p_corrupt_rows"} and set(e) >= CONTRACT and a["method"] == "atp"
        assert (a["site"], a["hook"], a["pos"], a["n"]) == (e["site"], e["hook"], e["pos"], e["n"])
        # the base runs of AtP (plain forwards) and of the engine (forwards that keep mixer contexts): ENGINE_TOL
        assert a["p_clean"] == pytest.approx(e["p_clean"], abs=ENGINE_TOL)
        assert a["p_corrupt"] == pytest.approx(e["p_corrupt"], abs=ENGINE_TOL)
        assert a["passes_filter"] == e["passes_filter"]
        assert len(a["p_patched_rows"]) == 10
        # the mean of the rows, summed in another order: float64 round-off
        assert sum(a["p_patched_rows"]) / 10 == pytest.approx(a["p_patched"], abs=FLOAT64_SUM_TOL)


@pytest.mark.parametrize(("sites", "n_sites"), [(["all", "embed"], 15), (["L1.block_in", "L1.mixer_out"], 2)])
def test_batching_and_cache_give_the_same_estimates(tmp_path, ar_model, ar_task, sites, n_sites):
    """From tokens the gradient forward runs from the tokens and is the corrupt run; from a cache
    the corrupt run is read from the file and the forward resumes at the lowest patched block."""
    batch = ar_task.sample(21, seed=8)
    path = write_cache(ar_model, batch, tmp_path / "c.h5", resolve_sites(["all"], ar_model.hook_dict))
    one = attribution_patch(ar_model, batch, sites, ["key", "value", "query"], max_batch=64)
    chunked = attribution_patch(ar_model, batch, sites, ["key", "value", "query"], max_batch=4)
    cached = attribution_patch(ar_model, path, sites, ["key", "value", "query"], max_batch=8)
    assert len(one) == n_sites * 3
    for a, b, c in zip(one, chunked, cached, strict=True):
        for field in ("p_patched", "p_corrupt"):
            assert a[field] == pytest.approx(b[field], abs=ENGINE_TOL)  # two batchings: ENGINE_TOL
            assert a[field] == pytest.approx(c[field], abs=CACHE_TOL)  # contract: fp32 cache, CACHE_TOL


def test_verify_top_reruns_the_strongest_exactly(ar_model, ar_task):
    batch = ar_task.sample(12, seed=9)
    atp = attribution_patch(ar_model, batch, ["all"], ["key", "value", "query", "all"])
    verified = verify_top(ar_model, batch, atp, 5)
    strengths = [abs(r["p_patched"] - r["p_corrupt"]) for r in verified]
    assert strengths == sorted(strengths, reverse=True)
    assert strengths[-1] >= max(abs(r["p_patched"] - r["p_corrupt"]) for r in atp if r not in [
        {k: v for k, v in x.items() if k not in ("attribution_exact", "p_patched_exact")} for x in verified])
    assert len(verified) == 5
    for record in verified:
        reference, = patch(ar_model, batch, [record["site"]], [record["pos"]])
        # the engine with other position sets (other row groups and batches): ENGINE_TOL on p, and
        # on the attribution ENGINE_TOL / its denominator
        assert record["p_patched_exact"] == pytest.approx(reference["p_patched"], abs=ENGINE_TOL)
        gap = abs(reference["p_clean"] - reference["p_corrupt"])
        assert record["attribution_exact"] == pytest.approx(reference["attribution"], abs=ENGINE_TOL / gap)
        assert record["method"] == "atp"


def test_hooks_without_a_position_axis_are_refused(ar_task):
    model = make_model(ar_task, mixers="hyena")
    with pytest.raises(UsageError, match="L0.mixer.filter.*no position axis"):
        attribution_patch(model, ar_task.sample(4, seed=0), ["L0.mixer.filter"], ["value"])


def test_bad_arguments_are_usage_errors(ar_model, ar_task):
    batch = ar_task.sample(4, seed=0)
    with pytest.raises(UsageError):
        attribution_patch(ar_model, batch, ["L1.block_in"], ["value"], max_batch=0)
    with pytest.raises(UsageError, match="unknown site"):
        attribution_patch(ar_model, batch, ["L1.blok_in"], ["value"])
    with pytest.raises(UsageError, match="unknown metric"):
        first_order_effects(ar_model, batch.corrupt_tokens, {}, batch.query_pos, batch.answers, metric="logit")
    with pytest.raises(UsageError, match="'kl' needs the clean run's log-probabilities"):
        first_order_effects(ar_model, batch.corrupt_tokens, {}, batch.query_pos, batch.answers, metric="kl")
