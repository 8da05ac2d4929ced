"""The patching engine against the plain `run_with_hooks` loop (hookmech.oracles.plain_loop) for every
mixer of the registry, every site kind (block level, inside the mixers, recurrent states,
heads, joint sites) and every option (metric, direction, ablation)."""
from __future__ import annotations

import pytest
import torch

import hookmech
import hookmech.patching.exact
from hookmech.config import build_config
from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY
from hookmech.patching import forwards
from hookmech.patching import attribution_score, corrupt_answers, parse_sites, patch, resample_order
from hookmech.oracles import plain_loop_patch

from helpers import ENGINE_TOL, make_model, unit_variance
from pretrained_folders import FAMILY_CASES, folder_of

POSITIONS = ["key", "value+query"]
ALL_POSITIONS = ["key", "value", "query", "divider", "key+value", "all"]
KEYS = ("p_clean", "p_corrupt", "p_patched", "metric_clean", "metric_corrupt", "metric_patched")


def positional_inside_sites(model) -> list[str]:
    """Every inside-mixer hook that has a position axis."""
    return [name for name, point in model.hook_dict.items()
            if ".mixer." in name and getattr(point, "pos_axis", 1) is not None]


def assert_matches_reference(model, batch, sites, positions=POSITIONS, max_batch=37, sensitive=False, **options):
    """The engine's records equal the plain loop's to ENGINE_TOL; with `sensitive`, some patch also
    moves p(answer) by more than 2 ENGINE_TOL (so that a patch the engine failed to apply would show)."""
    records = patch(model, batch, sites, positions, max_batch=max_batch, **options)
    reference = plain_loop_patch(model, batch, sites, positions, **options)
    assert len(records) == len(reference) > 0
    for record in records:
        expected = reference[record["hook"], record["pos"]]
        for key in KEYS:  # contract: engine vs plain loop, ENGINE_TOL
            assert abs(record[key] - expected[key]) <= ENGINE_TOL, (record["site"], record["pos"], key, record[key],
                                                                   expected[key])
    if sensitive:
        assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in records) > 2 * ENGINE_TOL
    return records


@pytest.mark.parametrize("mixer", sorted(REGISTRY))
def test_engine_equals_plain_loop_for_every_mixer_and_every_site(ar_task, mixer):
    model = unit_variance(make_model(ar_task, mixers=mixer, d_model=16))
    batch = ar_task.sample(4, seed=3)
    inside_last_layer = [site for site in positional_inside_sites(model) if site.startswith("blocks.1.")]
    assert_matches_reference(model, batch, ["L0.block_in", "L0.mixer_out", "L1.*", *inside_last_layer], ["key+value"],
                             sensitive=True)


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_engine_equals_plain_loop_on_pretrained_families(tmp_path, ar_task, case):
    """A tiny random GPT-2 and Pythia (parallel and sequential blocks, rotary q and k) loaded from
    their Hugging Face folders: every block site and inside hook of the last layer, the first
    layer's MLP, at two role positions, as the plain loop computes them. The task's ids are within
    the models' vocabulary; their redrawn weights let patches move p(answer)."""
    pytest.importorskip("transformers")
    model = hookmech.from_pretrained(folder_of(case, tmp_path))
    batch = ar_task.sample(4, seed=3)
    inside_last_layer = [site for site in positional_inside_sites(model) if site.startswith("blocks.1.")]
    records = assert_matches_reference(model, batch, ["L0.block_in", "L0.mixer_out", "L0.mlp_in", "L0.mlp_out",
                                                      "L1.*", *inside_last_layer], ["key", "value+query"],
                                       sensitive=True)
    assert {"blocks.1.mixer.hook_rot_k", "blocks.0.hook_mlp_in"} <= {r["hook"] for r in records} or case == "gpt2"


@pytest.mark.slow
@pytest.mark.parametrize("mixer", sorted(REGISTRY))
def test_engine_equals_plain_loop_at_every_position(ar_task, mixer):
    model = unit_variance(make_model(ar_task, mixers=mixer, d_model=32))
    batch = ar_task.sample(16, seed=13)
    assert_matches_reference(model, batch, ["all", *positional_inside_sites(model)], ALL_POSITIONS, sensitive=True)


#: Mamba-2 as pretrained folders have it (`hookmech.pretrained.mamba2`): heads in groups of B/C,
#: Δ clamped (transformers' time_step_limit: both bounds bite at these weights), biases
MAMBA2_PRETRAINED_OPTIONS = [
    {"ngroups": 2, "headdim": 4},
    {"ngroups": 4, "headdim": 4, "dt_limit": [0.005, 0.02], "bias": True, "conv_bias": False, "chunk_size": 8},
]


@pytest.mark.parametrize("options", MAMBA2_PRETRAINED_OPTIONS, ids=["groups", "groups-clamp-bias"])
def test_engine_equals_plain_loop_for_mamba2_with_groups_and_a_clamped_delta(options):
    """Every block-level site and every inside hook (the state included) at the key, the value and
    the query, on rows of 43 tokens (resumed runs replay from the kept states of every 16th
    position), and the whole-run base forwards with contexts (`fused_forward_with_context`)."""
    task = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=20)
    model = unit_variance(make_model(task, mixers="mamba2", d_model=16, layer_options=[options] * 2))
    batch = task.sample(6, seed=5)
    assert batch.tokens.shape[1] == 43
    assert_matches_reference(model, batch, ["all", *positional_inside_sites(model)], ["key", "value", "query"],
                             max_batch=11, sensitive=True)


@pytest.mark.parametrize("mixer", ["attention", "mamba"])
@pytest.mark.parametrize("metric", ["log_p", "logit_diff", "kl"])
def test_metrics_equal_plain_loop(ar_task, mixer, metric):
    model = make_model(ar_task, mixers=mixer, d_model=16)
    batch = ar_task.sample(8, seed=4)
    records = assert_matches_reference(model, batch, ["L0.block_in", "L1.mixer_in", "L1.block_out"], metric=metric)
    assert all(r["metric"] == metric for r in records)


@pytest.mark.parametrize("mixer", ["attention", "mamba"])
@pytest.mark.parametrize("options", [{"direction": "noise"}, {"ablate": "zero"}, {"ablate": "mean"},
                                     {"ablate": "resample", "ablate_seed": 3}, {"direction": "noise", "metric": "kl"}])
def test_directions_and_ablations_equal_plain_loop(ar_task, mixer, options):
    model = make_model(ar_task, mixers=mixer, d_model=16)
    batch = ar_task.sample(8, seed=5)
    state = [s for s in positional_inside_sites(model) if "state" in s][:1]
    records = assert_matches_reference(model, batch, ["L0.block_out", "L1.mixer_out", *state], **options)
    assert all(r["direction"] == "noise" for r in records)


def test_heads_and_joint_sites_equal_plain_loop(ar_task):
    model = make_model(ar_task, n_heads=2)
    batch = ar_task.sample(8, seed=6)
    sites = ["L1.mixer.z[*]", "L0.mixer.pattern[1]", "L0.block_out+L1.mixer_in", "L1.mixer.q[0]+L1.mixer.k[1]"]
    records = assert_matches_reference(model, batch, sites)
    labels = {r["site"] for r in records}
    assert labels == {"L1.mixer.z[0]", "L1.mixer.z[1]", "L0.mixer.pattern[1]", "L0.block_out+L1.mixer_in",
                      "L1.mixer.q[0]+L1.mixer.k[1]"}


def test_all_heads_together_equal_the_whole_hook(ar_task):
    model = make_model(ar_task, n_heads=2)
    batch = ar_task.sample(12, seed=6)
    both = patch(model, batch, ["L1.mixer.z[0]+L1.mixer.z[1]"], ["key", "value"])
    whole = patch(model, batch, ["L1.mixer.z"], ["key", "value"])
    for a, b in zip(both, whole, strict=True):  # two engine paths (per-head masks, whole hook): ENGINE_TOL
        assert a["p_patched"] == pytest.approx(b["p_patched"], abs=ENGINE_TOL)


def test_noising_the_whole_residual_gives_the_corrupt_run(ar_task):
    model = make_model(ar_task)
    batch = ar_task.sample(20, seed=7)
    record, = patch(model, batch, ["L1.block_in"], ["whole"], direction="noise")
    # a resumed run vs the base run: ENGINE_TOL on p, so on the attribution ENGINE_TOL / its denominator
    assert record["p_patched"] == pytest.approx(record["p_corrupt"], abs=ENGINE_TOL)
    assert record["attribution"] == pytest.approx(1.0, abs=ENGINE_TOL / abs(record["p_clean"] - record["p_corrupt"]))


def test_kl_attribution_formula(ar_task):
    """kl: m_clean = 0, and denoising attribution = (KL_corrupt - KL_patched) / KL_corrupt."""
    model = make_model(ar_task)
    batch = ar_task.sample(20, seed=8)
    record, = patch(model, batch, ["L1.block_in"], ["value"], metric="kl")
    assert record["metric_clean"] == 0.0  # KL of the clean run's own log-softmax against itself: exactly 0
    kl_corrupt, kl_patched = record["metric_corrupt"], record["metric_patched"]
    # the same quotient written another way: float64 round-off
    assert record["attribution"] == pytest.approx((kl_corrupt - kl_patched) / kl_corrupt, rel=1e-12)
    assert record["passes_filter"] == (kl_corrupt > 0.01)
    assert attribution_score(1.0, 0.0, 0.25, "noise") == 0.75  # exact in binary floating point


def test_corrupt_answer_is_the_corrupt_value_or_the_corrupt_runs_best_other_token():
    import hookmech

    value_task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3, corrupt="value")
    batch = value_task.sample(10, seed=0)
    rows = torch.arange(10)
    logits = torch.randn(10, value_task.d_vocab)
    assert torch.equal(corrupt_answers(batch, logits), batch.corrupt_tokens[rows, batch.roles["value"]])
    key_task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    batch = key_task.sample(10, seed=0)
    logits[rows, batch.answers] = 100.0
    logits[rows, 2] = 50.0
    assert torch.equal(corrupt_answers(batch, logits), torch.full((10,), 2))


def test_resample_order_is_a_seeded_derangement():
    order = resample_order(50, seed=1)
    assert sorted(order.tolist()) == list(range(50)) and (order != torch.arange(50)).all()
    assert torch.equal(order, resample_order(50, seed=1)) and not torch.equal(order, resample_order(50, seed=2))


def test_site_errors(ar_task):
    model = make_model(ar_task, mixers="hyena", d_model=16)
    batch = ar_task.sample(4, seed=0)
    with pytest.raises(UsageError, match="no position axis"):
        patch(model, batch, ["L0.mixer.filter"], ["value"])
    with pytest.raises(UsageError, match="no head axis"):
        parse_sites(["L0.block_in[0]"], model)
    attention = make_model(ar_task, n_heads=2)
    with pytest.raises(UsageError, match="2 heads"):
        patch(attention, batch, ["L0.mixer.z[5]"], ["value"])
    with pytest.raises(UsageError, match="direction"):
        patch(attention, batch, ["L0.block_in"], ["value"], ablate="zero", direction="denoise")
    with pytest.raises(UsageError, match="p_answer"):
        patch(attention, batch, ["L0.block_in"], ["value"], metric="p_answr")


def test_skipped_rows_equal_computed_rows(ar_task):
    """Rows a patch leaves unchanged are given the base run's p; that equals running them."""
    model = make_model(ar_task)
    batch = ar_task.sample(16, seed=9)
    record, = patch(model, batch, ["L0.block_in"], ["value"], per_example=True)  # embedding: same in both runs
    with torch.no_grad():
        rows = torch.arange(16)
        p = model(batch.corrupt_tokens)[rows, batch.query_pos].softmax(-1)[rows, batch.answers]
    # the engine's base run vs a plain forward: ENGINE_TOL
    torch.testing.assert_close(torch.tensor(record["p_patched_rows"], dtype=torch.float32), p, rtol=0, atol=ENGINE_TOL)


def test_mean_ablation_over_rows_of_different_lengths_stays_finite():
    """Padded positions of masked attention scores hold -inf; the row mean must not turn them into NaN."""
    import math

    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model = make_model(task, layer_options=[{"window": 2}, {}])  # windowed scores are -inf in every row
    batch = task.sample(6, seed=0)
    short = batch.lengths.clone()
    short[:3] -= 1  # pretend half the rows end one token earlier (their last token is padding)
    batch.lengths = short
    batch.roles = {**batch.roles, "query": short - 1}
    records = patch(model, batch, ["L0.mixer.attn_scores"], ["all", "query"], ablate="mean")
    for record in records:
        assert all(math.isfinite(record[k]) for k in ("p_clean", "p_corrupt", "p_patched")), record["pos"]


# -- resumed runs (patches re-run only from the patched position on) ----------------------
RESUMED_SITES = ["L0.mixer_out", "L0.block_out", "L1.block_in", "L1.mixer_in", "final_norm"]


@pytest.mark.parametrize("mixer", sorted(REGISTRY))
def test_resumed_runs_equal_plain_loop_at_every_start(ar_task, mixer):
    """Windows of every width, in several chunks of different widths (max_batch 5)."""
    model = unit_variance(make_model(ar_task, mixers=mixer, d_model=16))
    batch = ar_task.sample(6, seed=11)
    assert_matches_reference(model, batch, RESUMED_SITES, ["key", "value", "-3", "all", "whole"], max_batch=5,
                             sensitive=True)


@pytest.mark.parametrize("mixer", ["attention", "mamba", "rwkv", "hyena"])
def test_resumed_runs_equal_plain_loop_on_rows_of_different_lengths(mixer):
    """ATR rows end at different positions: windows of short rows are clamped at position 0
    and run past their query."""
    task = hookmech.tasks.make("atr", num_terminals=6, num_nonterminals=6, max_depth=3, max_rhs_len=3, max_length=24)
    model = unit_variance(make_model(task, mixers=mixer, d_model=16))
    batch = task.sample(8, seed=2).trimmed()
    assert len(set(batch.query_pos.tolist())) > 2
    assert_matches_reference(model, batch, RESUMED_SITES, ["key", "value", "all"], max_batch=7, sensitive=True)


@pytest.mark.parametrize("mixer", sorted(REGISTRY))
def test_sites_resumed_together_give_the_plain_loops_numbers(ar_task, monkeypatch, mixer):
    """With every width joining (JOIN_WIDTH 0), the resumed sites' pairs run together, each joining
    the forward at its own block (`joined_pairs`), in chunks of at most 5 pairs: block sites of both
    layers, the final norm (resumed apart), and the last layer's inside hooks (fired on the window,
    or on whole runs by a mixer without window hooks) give the plain loop's records and the
    per-site engine's to ENGINE_TOL (two engine paths)."""
    model = unit_variance(make_model(ar_task, mixers=mixer, d_model=16))
    batch = ar_task.sample(6, seed=11)
    inside = [site for site in positional_inside_sites(model) if site.startswith("blocks.1.")][:3]
    sites = ["L*.block_in", "L0.mixer_out", "L1.mixer_in", "L0.block_out", "final_norm", *inside]
    positions = ["key", "value", "query", "-3"]
    per_site = patch(model, batch, sites, positions, max_batch=5)
    joinings: list[list[int]] = []
    resume = model.resume
    monkeypatch.setattr(model, "resume", lambda *a, **k: joinings.append(k.get("joining")) or resume(*a, **k))
    monkeypatch.setattr(forwards, "JOIN_WIDTH", 0)
    joined = patch(model, batch, sites, positions, max_batch=5)
    assert any(joining is not None and joining[0] < joining[-1] for joining in joinings)  # rows joined late
    reference = plain_loop_patch(model, batch, sites, positions)
    for record, alone in zip(joined, per_site, strict=True):
        assert abs(record["p_patched"] - reference[record["hook"], record["pos"]]["p_patched"]) <= ENGINE_TOL
        assert abs(record["p_patched"] - alone["p_patched"]) <= ENGINE_TOL
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in joined) > 2 * ENGINE_TOL  # patches move p


def _count_probe_rows(monkeypatch) -> list[int]:
    """Spy on the NaN probe (`reachability`): the rows of each of its forwards."""
    import hookmech.patching.reachability as reachability

    rows, replace = [], reachability.replace_hook
    monkeypatch.setattr(reachability, "replace_hook",
                        lambda plan, values, mask: rows.append(len(values)) or replace(plan, values, mask))
    return rows


@pytest.mark.parametrize("probe_share", [0.0, float("inf")], ids=["no-probe", "always-probe"])
@pytest.mark.parametrize("mixer", ["mamba", "mamba2", "deltanet", "based", "attention"])
def test_long_rows_resume_from_kept_states_with_and_without_the_probe(mixer, probe_share, monkeypatch):
    """Rows of 43 tokens, patches starting in each block of the mixers' STATE_STRIDE (16) positions,
    so that resumed runs replay from kept states (Mamba, Mamba-2, DeltaNet, Based); with the NaN probe never
    run (every changed row is run, as at ATR's lengths) and always run: the plain loop's records."""
    import hookmech.patching.reachability as reachability

    monkeypatch.setattr(reachability, "PROBE_SHARE", probe_share)
    probed = _count_probe_rows(monkeypatch)
    task = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=20)
    model = unit_variance(make_model(task, mixers=mixer, d_model=16))
    batch = task.sample(8, seed=5)
    assert batch.tokens.shape[1] == 43 and batch.roles["key"].min() < 16 and batch.roles["key"].max() > 32
    assert_matches_reference(model, batch, ["all"], ["key", "value", "query", "divider"], max_batch=11,
                             sensitive=True)
    assert bool(probed) == (probe_share > 0)


def test_the_probe_runs_only_where_it_costs_less_than_a_quarter_of_what_it_can_skip(monkeypatch):
    """The NaN probe costs a forward on every position per group of rows patched alike: on AR rows
    (few key positions, so few groups, long windows) it runs; where every window is short (here:
    the query alone, one position against the probe's 43, as ATR's patches near the query), it
    would cost more than it can skip, and does not run. Records equal the plain loop's either way
    (`assert_matches_reference`)."""
    probed = _count_probe_rows(monkeypatch)
    ar = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    model = unit_variance(make_model(ar, mixers="attention", d_model=16))
    batch = ar.sample(64, seed=7)
    assert_matches_reference(model, batch, ["L1.mlp_out"], ["key"], sensitive=False)
    assert probed and sum(probed) < len(batch)  # one row per group, far fewer than the rows
    probed.clear()
    task = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=20)
    model = unit_variance(make_model(task, mixers="attention", d_model=16))
    batch = task.sample(8, seed=5)
    assert_matches_reference(model, batch, ["L0.mixer_out"], ["query"], sensitive=True)
    assert not probed


def test_resumed_runs_recompute_only_from_the_patch_to_the_query(ar_task, monkeypatch):
    """A query patch re-runs one position; a key patch the positions from the key to the query;
    nothing patched at block level runs the full model (only the two base runs and the probe)."""
    model = make_model(ar_task)
    batch = ar_task.sample(10, seed=12)
    windows, full_rows = [], []
    resume, forward = model.resume, model.forward
    monkeypatch.setattr(model, "resume", lambda resid, *a, **k: windows.append(resid.shape[:2]) or resume(resid, *a, **k))
    monkeypatch.setattr(model, "forward", lambda x, **kw: full_rows.append(len(x)) or forward(x, **kw))
    patch(model, batch, ["L0.mixer_out"], ["query"])
    assert windows and all(width == 1 for _, width in windows)
    windows.clear(), full_rows.clear()
    patch(model, batch, ["L0.mixer_out"], ["key"])
    widest = int((batch.query_pos - batch.roles["key"]).max()) + 1
    assert max(width for _, width in windows) == widest
    assert sum(rows for rows, _ in windows) <= len(batch)
    assert sum(full_rows) < 3 * len(batch)  # clean + corrupt runs (+ a few probe rows)


@pytest.mark.parametrize("mixer", sorted(REGISTRY))
def test_inside_hooks_resume_from_the_patched_position(ar_task, mixer, monkeypatch):
    """Every inside hook with a position axis (q / k / v, recurrent states, convolutions …) is
    patched in runs resumed at its block on the window from the patch to the query, never from
    the tokens, with the plain loop's numbers; a mixer that fires its hooks on the window
    (`Mixer.window_hooks`) never re-runs the whole sequence for it."""
    model = unit_variance(make_model(ar_task, mixers=mixer, d_model=16))
    batch = ar_task.sample(5, seed=15)
    sites = positional_inside_sites(model)
    windows, starts = [], []
    resume = model.resume
    monkeypatch.setattr(model, "resume",
                        lambda resid, layer, *a, **k: windows.append(resid.shape[1]) or starts.append(layer)
                        or resume(resid, layer, *a, **k))
    mixer_class = type(model.blocks[0].mixer)
    if mixer_class.window_hooks:
        def refuse(*args, **kwargs):
            raise AssertionError("a mixer with window hooks re-ran the whole sequence")

        monkeypatch.setattr(mixer_class, "forward_spliced", refuse)
    monkeypatch.setattr(hookmech.patching.exact, "full_pairs",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran on every position")))
    # each width in its own chunk (short windows otherwise share one: `width_chunks`), so that the
    # windows seen are the patches' own
    monkeypatch.setattr(hookmech.patching.forwards, "WASTE_FLOOR", 0)
    assert_matches_reference(model, batch, sites, ["key", "query"], sensitive=True)
    # (a patch the probe finds cannot reach the query, e.g. a short convolution's at the key, runs nothing)
    assert 1 in starts and set(starts) <= {0, 1}
    assert max(windows) < batch.tokens.shape[1] and min(windows) == 1


def test_block_output_is_patched_once_as_the_next_block_input(ar_task, monkeypatch):
    model = make_model(ar_task)
    batch = ar_task.sample(10, seed=13)
    starts = []
    resume = model.resume
    monkeypatch.setattr(model, "resume", lambda resid, layer, *a, **k: starts.append(layer) or resume(resid, layer, *a, **k))
    out, into = patch(model, batch, ["L0.block_out", "L1.block_in"], ["key"])
    assert set(starts) == {1} and out["p_patched"] == into["p_patched"]
    assert (out["site"], into["site"]) == ("L0.block_out", "L1.block_in")


@pytest.mark.parametrize("mixer", ["attention", "mamba"])
def test_contexts_over_the_memory_budget_fall_back_to_full_runs(ar_task, mixer, monkeypatch):
    """With no room for mixer contexts the engine runs patches on every position: same numbers."""
    model = make_model(ar_task, mixers=mixer, d_model=16)
    batch = ar_task.sample(10, seed=14)
    resumed = []
    resume = model.resume
    monkeypatch.setattr(model, "resume", lambda *a, **k: resumed.append(1) or resume(*a, **k))
    small = patch(model, batch, ["all"], ["key", "value"], context_memory=1, max_batch=4)
    assert not resumed
    roomy = patch(model, batch, ["all"], ["key", "value"], max_batch=4)
    assert resumed
    for a, b in zip(small, roomy, strict=True):  # two engine paths (full runs, resumed runs): ENGINE_TOL
        assert a["p_patched"] == pytest.approx(b["p_patched"], abs=ENGINE_TOL)


@pytest.mark.parametrize("preset", ["based", "baseconv"])
def test_resumed_runs_equal_plain_loop_for_preset_models_on_mqar(preset):
    """Mixed-mixer presets on MQAR, whose queries sit at different positions in each row."""
    from hookmech.config import build_config
    from hookmech.model_presets import expand_preset

    task = hookmech.tasks.make("mqar", vocab_size=64, num_kv_pairs=4, seq_len=24)
    mixers, options = expand_preset(preset, 3)
    torch.manual_seed(0)
    model = hookmech.HookedLM(build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=mixers, layer_options=options,
                                           d_model=16, n_layers=3)).eval()
    batch = task.sample(6, seed=5)
    assert len(set(batch.query_pos.tolist())) > 1
    assert_matches_reference(model, batch, ["L0.block_out", "L1.mixer_out", "L2.mixer_in"], ["key", "value", "query"],
                             max_batch=5)


def test_a_patch_after_the_mixer_reads_the_base_runs_mixer_output(monkeypatch):
    """A resumed patch of ``L0.mixer_out`` leaves block 0's mixer input as the base run's, so
    the mixer is not run again there (its recorded output is used); ``L0.block_in`` runs it
    (ablated: interchanged at the key, the corrupted token, the patched run is the corrupt run)."""
    torch.manual_seed(0)
    model = hookmech.HookedLM(build_config(d_vocab=20, n_ctx=12, mixers="mamba2", d_model=16, n_layers=2)).eval()
    batch = hookmech.tasks.make("ar", vocab_size=12, num_kv_pairs=3).sample(16, seed=0)
    calls = {0: 0, 1: 0}
    for layer, block in enumerate(model.blocks):
        original = block.mixer.forward_from

        def counted(*args, layer=layer, original=original, **kwargs):
            calls[layer] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(block.mixer, "forward_from", counted)
    records = hookmech.patching.patch(model, batch, ["L0.mixer_out"], ["key"])
    assert calls[0] == 0 and calls[1] > 0
    reference = plain_loop_patch(model, batch, ["L0.mixer_out"], ["key"])
    (record,) = records
    assert abs(record["p_patched"] - reference[record["hook"], record["pos"]]["p_patched"]) <= ENGINE_TOL
    hookmech.patching.patch(model, batch, ["L0.block_in"], ["key"], ablate="zero")
    assert calls[0] > 0


@pytest.mark.parametrize("mixer", ["attention", "mamba"])
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_a_patch_that_makes_the_source_run_reads_that_runs_records(monkeypatch, mixer, direction):
    """AR's two runs enter block 0 differing at the key alone, so interchanging ``L0.block_in``
    there makes the patched run the source run: its rows are that run's p(answer), with no
    forward of block 0; ``L1.block_in``, which differs from the key on, still runs its patch.
    Both agree with the plain loop."""
    torch.manual_seed(0)
    model = hookmech.HookedLM(build_config(d_vocab=20, n_ctx=12, mixers=mixer, d_model=16, n_layers=2)).eval()
    batch = hookmech.tasks.make("ar", vocab_size=12, num_kv_pairs=3).sample(16, seed=0)
    differs = (batch.tokens != batch.corrupt_tokens)
    assert (differs.sum(1) == 1).all() and (differs.int().argmax(1) == batch.roles["key"]).all()

    def refused(*args, **kwargs):
        raise AssertionError("block 0 ran")

    monkeypatch.setattr(model.blocks[0].mixer, "forward_from", refused)
    first, second = patch(model, batch, ["L0.block_in", "L1.block_in"], ["key"], direction=direction,
                          per_example=True)
    source_rows = first["p_clean_rows"] if direction == "denoise" else first["p_corrupt_rows"]
    assert first["p_patched_rows"] == source_rows
    assert second["p_patched_rows"] != source_rows
    monkeypatch.undo()
    reference = plain_loop_patch(model, batch, ["L0.block_in", "L1.block_in"], ["key"], direction=direction)
    for record in (first, second):
        assert abs(record["p_patched"] - reference[record["hook"], record["pos"]]["p_patched"]) <= ENGINE_TOL


def test_base_runs_copy_a_patched_hook_only_where_the_patches_read_it(monkeypatch):
    """`CleanCorruptRuns(read_at=...)`: the activations of a hook read only at some positions
    equal the full run's there (chunked: rows of both chunks), whatever is left elsewhere. A
    recurrent state is read from the run's recorded context, its hook never fired."""
    from hookmech.mixers.mamba2 import Mamba2
    from hookmech.patching.runs import CleanCorruptRuns

    torch.manual_seed(0)
    model = hookmech.HookedLM(build_config(d_vocab=20, n_ctx=12, mixers="mamba2", d_model=16, n_layers=2))
    model = model.double().eval()
    batch = hookmech.tasks.make("ar", vocab_size=12, num_kv_pairs=3).sample(10, seed=0)
    hooks = ["blocks.1.mixer.hook_ssm_state", "blocks.0.mixer.hook_B"]
    where = torch.zeros(10, batch.tokens.shape[1], dtype=torch.bool)
    where[torch.arange(10), batch.query_pos] = True
    where[3, 0] = True
    full = CleanCorruptRuns(model, batch, hooks, None, need_logits=False, max_batch=4)

    def refuse(*args, **kwargs):
        raise AssertionError("the base runs materialised every state for the state hook")

    monkeypatch.setattr(Mamba2, "_ssd_through_state_hook", refuse)
    sparse = CleanCorruptRuns(model, batch, hooks, None, need_logits=False, max_batch=4,
                              read_at=dict.fromkeys(hooks, where))
    for which in ("clean", "corrupt"):
        for hook in hooks:
            assert sparse.acts(hook, which).shape == full.acts(hook, which).shape
        # B: the same tensor copied; the state: read from kept states replayed over <= 3 positions, another
        # grouping of the same float64 sums (tests/mixers/test_resume.py's round-off tolerance)
        assert torch.equal(sparse.acts(hooks[1], which)[where], full.acts(hooks[1], which)[where])
        torch.testing.assert_close(sparse.acts(hooks[0], which)[where], full.acts(hooks[0], which)[where],
                                   rtol=1e-9, atol=1e-10)


def test_width_chunks_by_hand(monkeypatch):
    """Resumed pairs, sorted by window width, are chunked where the width grows by more than a
    quarter (and 1) and the chunk would compute more than WASTE_FLOOR positions for nothing, and by
    max_batch: every pair once, in order."""
    from hookmech.patching import forwards
    from hookmech.patching.forwards import width_chunks

    widths = [1, 1, 2, 2, 4, 5, 6, 10, 12, 13, 30, 35]
    monkeypatch.setattr(forwards, "WASTE_FLOOR", 0)  # the growth rule alone
    chunks = list(width_chunks(widths, 3))
    assert [(c.start, c.stop) for c in chunks] == [(0, 3), (3, 4), (4, 6), (6, 7), (7, 9), (9, 10), (10, 12)]
    assert list(width_chunks([], 3)) == []
    assert [(c.start, c.stop) for c in width_chunks([7] * 5, 2)] == [(0, 2), (2, 4), (4, 5)]
    # waste of a chunk = its pairs x its widest width - their widths: [1, 1, 2, 2, 4] wastes
    # 5 * 4 - 10 = 10 (allowed), adding 5 would waste 6 * 5 - 15 = 15; [5, 6, 10] wastes 9, adding
    # 12 would waste 15; [12, 13] then 30 would waste 35; 35 is within a quarter of 30
    monkeypatch.setattr(forwards, "WASTE_FLOOR", 10)
    chunks = list(width_chunks(widths, 100))
    assert [(c.start, c.stop) for c in chunks] == [(0, 5), (5, 8), (8, 10), (10, 12)]
