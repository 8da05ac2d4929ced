"""AtP*'s corrupt forward resumed at each row's first corrupted token (`atp_star_resumed`): the
same estimates as the whole corrupt forward, which stays the path of GradDrop, caches, several row
chunks and hooks a window does not fire."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import ENGINE_TOL, make_model, unit_variance

import hookmech
from hookmech.config import build_config
from hookmech.mixers import REGISTRY, mamba_effects
from hookmech.mixers.base import state_before
from hookmech.mixers.mamba import Mamba
from hookmech.mixers.mamba_effects import MambaPatchEffects, _consecutive_runs, _times_state_before
from hookmech.patching import atp_star, atp_star_patch
from hookmech.patching.atp_star_resumed import ResumedCorruptRun, first_corrupted

POSITIONS = ["key", "value", "query", "all"]
#: Pythia's attention: rotary embeddings on half of each head
ROTARY = {"n_heads": 2, "rotary_pct": 0.5}
EVERY_BLOCK = ["L*.block_in", "L1.mixer_out"]
PYTHIA_SITES = ["L*.block_in", "L0.mlp_out", "L2.mixer_out"]


def test_first_corrupted_is_the_first_differing_token_at_most_the_query():
    clean = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])
    corrupt = torch.tensor([[1, 9, 3, 9, 5], [1, 2, 3, 4, 9], [1, 2, 3, 4, 5], [9, 2, 3, 4, 5]])
    query = torch.tensor([4, 3, 4, 4])
    # row 1 is corrupted after its query only, row 2 nowhere: both run at the query alone
    assert first_corrupted(clean, corrupt, query).tolist() == [1, 3, 4, 0]


def _windows_used(monkeypatch) -> list[bool]:
    """Record, per row chunk, whether the resumed forward ran (True) or fell back (False)."""
    used: list[bool] = []
    run = ResumedCorruptRun.run

    def spy(self, *args, **kwargs):
        found = run(self, *args, **kwargs)
        used.append(found is not None)
        return found

    monkeypatch.setattr(ResumedCorruptRun, "run", spy)
    return used


def _whole_forward(monkeypatch, model, batch, sites, **options):
    with monkeypatch.context() as patched:
        patched.setattr(atp_star, "fires_on_windows", lambda model, hooks: False)
        return atp_star_patch(model, batch, sites, POSITIONS, per_example=True, **options)


def _assert_same_estimates(resumed, whole):
    assert [(r["hook"], r["pos"]) for r in resumed] == [(r["hook"], r["pos"]) for r in whole]
    for a, b in zip(resumed, whole, strict=True):
        # the clean run keeps its contexts too, which some mixers compute by another scan (Mamba-2's)
        assert a["p_clean"] == pytest.approx(b["p_clean"], abs=ENGINE_TOL)
        assert a["p_corrupt"] == pytest.approx(b["p_corrupt"], abs=ENGINE_TOL)
        assert a["p_patched_rows"] == pytest.approx(b["p_patched_rows"], abs=ENGINE_TOL)


@pytest.mark.parametrize(
    ("options", "sites"),
    [
        # BaseConv's random weights at seed 0 move p by 1e-4 at most: seed 1's by 5e-4
        *[({"mixers": name, "seed": int(name == "baseconv")}, EVERY_BLOCK) for name in sorted(REGISTRY)],
        ({"mixers": "attention"}, ["L*.block_in", "L*.mixer_out", "L1.mixer.q", "L2.mixer.v"]),
        ({"mixers": "mamba"}, ["L*.block_in", "L*.mixer_out", "L1.mixer.in_x", "L1.mixer.ssm_state"]),
        ({"mixers": "mamba2"}, ["L2.mixer_in"]),
        # no site in block 0: the forward still runs it, on the corrupt tokens
        ({"mixers": "mamba"}, ["L2.block_in"]),
        ({"mixers": "attention"}, ["L1.block_in", "L2.mixer_out"]),
        ({"mixers": "based"}, ["L1.block_out"]),
        # GPT-2's learned positions and MLPs; Pythia's rotary fraction and parallel blocks
        ({"mixers": "attention", "pos_emb": "learned", "mlp": True}, ["L*.block_in", "L1.mlp_out"]),
        ({"mixers": "attention", "layer_options": [ROTARY] * 3, "mlp": True, "parallel": True}, PYTHIA_SITES),
    ],
)
def test_the_resumed_forward_gives_the_whole_forwards_estimates(monkeypatch, ar_task, options, sites):
    """Resumed (one row chunk, from tokens) against the whole corrupt forward: the same records to
    the engine's tolerance between two of its paths."""
    options = dict(options)
    parallel, seed = options.pop("parallel", False), options.pop("seed", 0)
    config = build_config(d_vocab=ar_task.d_vocab, n_ctx=ar_task.n_ctx, d_model=32, n_layers=3, **options)
    torch.manual_seed(seed)
    model = hookmech.HookedLM(dataclasses.replace(config, parallel_residual=parallel)).eval()
    model = unit_variance(model, seed=seed + 1)
    batch = ar_task.sample(12, seed=5)
    assert (first_corrupted(batch.tokens, batch.corrupt_tokens, batch.query_pos) > 0).any()  # something skipped
    used = _windows_used(monkeypatch)
    resumed = atp_star_patch(model, batch, sites, POSITIONS, per_example=True)
    assert used == [True]
    whole = _whole_forward(monkeypatch, model, batch, sites)
    assert used == [True]  # the whole forward does not try the windows
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in whole) > 10 * ENGINE_TOL  # patches move p
    _assert_same_estimates(resumed, whole)


def test_the_resumed_forward_runs_from_the_first_corrupted_token_only(monkeypatch, ar_task):
    """The windows start at each row's first corrupted token (or earlier, shared with a wider row
    of the chunk) and end at its query: positions before every row's first corruption never run."""
    model = make_model(ar_task, mixers="mamba", n_layers=2)
    batch = ar_task.sample(10, seed=2)
    first = first_corrupted(batch.tokens, batch.corrupt_tokens, batch.query_pos)
    widths: list[int] = []
    resume = type(model).resume

    def spy(self, resid, start_at_layer, contexts, rows, start, query, *args, **kwargs):
        if start_at_layer == 0:  # the corrupt forward (the query step resumes at the last block)
            widths.append(resid.shape[1])
            assert (start <= first[rows]).all() and (start + resid.shape[1] - 1 >= query).all()
        return resume(self, resid, start_at_layer, contexts, rows, start, query, *args, **kwargs)

    monkeypatch.setattr(type(model), "resume", spy)
    atp_star_patch(model, batch, ["L*.block_in"], ["key"])
    assert widths and sum(widths) < len(batch) * batch.tokens.shape[1]
    assert max(widths) == int((batch.query_pos - first).max()) + 1


@pytest.mark.parametrize(
    "options",
    [{"graddrop": True}, {"max_batch": 5}],
    ids=["graddrop", "several-chunks"],
)
def test_graddrop_and_several_row_chunks_run_the_whole_forward(monkeypatch, ar_task, options):
    model = make_model(ar_task, mixers="mamba", n_layers=2)
    batch = ar_task.sample(12, seed=3)
    used = _windows_used(monkeypatch)
    atp_star_patch(model, batch, ["L*.block_in"], ["key"], **options)
    assert used == []


def test_a_mixer_firing_its_hooks_on_whole_runs_falls_back_to_the_whole_forward(monkeypatch, ar_task):
    """A mixer whose inside hooks fire on whole runs in a resumed run (`Mixer.window_hooks` False:
    a plug-in's default) is found when its hook fires; that chunk and the rest run whole."""
    model = unit_variance(make_model(ar_task, mixers="mamba", n_layers=2))
    batch = ar_task.sample(12, seed=4)
    sites = ["L*.block_in", "L1.mixer.in_x"]
    whole = _whole_forward(monkeypatch, model, batch, sites)
    monkeypatch.setattr(Mamba, "window_hooks", False)
    used = _windows_used(monkeypatch)
    found = atp_star_patch(model, batch, sites, POSITIONS, per_example=True)
    assert used == [False]
    _assert_same_estimates(found, whole)


def test_mambas_effects_scan_from_the_clean_runs_state_where_the_runs_agree(monkeypatch):
    """Resumed, each block's base run for Mamba's exact effects (`MambaPatchEffects._base_branch`)
    starts from the clean run's kept state at the last STATE_STRIDE multiple before its row
    block's first corrupted token (`MixerMemo.agree`): the same bytes as the scan from position 0.
    Two rows corrupted from 32 on, two before 16 (whose block scans from 0), in blocks of two."""
    task = hookmech.tasks.make("ar", vocab_size=96, num_kv_pairs=20)  # 43 positions
    model = unit_variance(make_model(task, mixers="mamba", n_layers=3))
    sample = task.sample(40, seed=7)
    first = first_corrupted(sample.tokens, sample.corrupt_tokens, sample.query_pos)
    late = (first >= 2 * Mamba.STATE_STRIDE).nonzero()[:2, 0]
    early = ((first > 0) & (first < Mamba.STATE_STRIDE)).nonzero()[:2, 0]
    batch = sample.select(torch.cat([late, early]))
    assert len(batch) == 4
    monkeypatch.setattr(mamba_effects, "row_blocks", lambda n, _: [slice(i, min(n, i + 2)) for i in range(0, n, 2)])
    starts: list[int] = []
    compute = MambaPatchEffects._compute_base_branch

    def spy(self, in_x, z, agreed=None):
        starts.append(0 if agreed is None else agreed[0])
        return compute(self, in_x, z, agreed)

    monkeypatch.setattr(MambaPatchEffects, "_compute_base_branch", spy)
    # the effects after the backward, which read the base branch (not those by the backward passes)
    monkeypatch.setattr(MambaPatchEffects, "backward_patch_effects", lambda self, *args: None)
    sites = ["L*.block_in", "L1.mixer.in_x"]
    agreed = atp_star_patch(model, batch, sites, POSITIONS, per_example=True)
    assert set(starts) == {0, 2 * Mamba.STATE_STRIDE}
    starts.clear()
    monkeypatch.setattr(ResumedCorruptRun, "agreement", lambda self, rows: lambda layer: None)
    from_zero = atp_star_patch(model, batch, sites, POSITIONS, per_example=True)
    assert starts and set(starts) == {0}
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in from_zero) > 10 * ENGINE_TOL  # patches move p
    assert [r["p_patched_rows"] for r in agreed] == [r["p_patched_rows"] for r in from_zero]


def test_the_patched_steps_read_the_state_before_each_pair_in_place():
    """`_times_state_before` (views over stretches of consecutive positions) multiplies by what
    `base.state_before` copies out: across rows, gaps and position 0 (zeros)."""
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(3, 7, 2, 5, generator=generator)
    rows = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    positions = torch.tensor([0, 1, 2, 5, 6, 0, 0, 1, 4, 6])
    x = torch.randn(len(rows), 2, 5, generator=generator)
    expected = x * state_before(states, rows, positions)
    found = _times_state_before(x.clone(), states.flatten(0, 1), rows, positions, states.shape[1])
    assert torch.equal(found, expected)
    assert _consecutive_runs(torch.tensor([4, 5, 6, 9, 3, 4])) == [(0, 3, 4), (3, 4, 9), (4, 6, 3)]
    assert _consecutive_runs(torch.tensor([7, 7])) == [(0, 1, 7), (1, 2, 7)]
    assert _consecutive_runs(torch.tensor([], dtype=torch.int64)) == []


def test_mambas_effects_by_the_backward_are_those_computed_after_it(monkeypatch):
    """Resumed, each Mamba block computes the effects of its input's patches by the backward passes
    (`MambaPatchEffects.backward_patch_effects`): every block but the first does (nothing below
    block 0 asks for a gradient, so its scan has no backward pass), over windows of up to 43
    positions (three scan chunks), and the estimates are those of the computation after the
    backward (the base run scanned again), to float rounding; a patch inside the mixer (in_x) is
    still computed after it."""
    task = hookmech.tasks.make("ar", vocab_size=96, num_kv_pairs=20)  # 43 positions
    model = unit_variance(make_model(task, mixers="mamba", n_layers=3))
    batch = task.sample(6, seed=7)
    sites = ["L*.block_in", "L1.mixer.in_x"]
    recorded: list[bool] = []
    make = MambaPatchEffects.backward_patch_effects

    def spy(self, *args):
        recorder = make(self, *args)
        effects = recorder.effects
        recorder.effects = lambda: recorded.append(effects() is not None) or effects()  # type: ignore[method-assign]
        return recorder

    monkeypatch.setattr(MambaPatchEffects, "backward_patch_effects", spy)
    by_backward = atp_star_patch(model, batch, sites, POSITIONS, per_example=True)
    assert recorded == [False, True, True]
    monkeypatch.setattr(MambaPatchEffects, "backward_patch_effects", lambda self, *args: None)
    after = atp_star_patch(model, batch, sites, POSITIONS, per_example=True)
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in after) > 10 * ENGINE_TOL  # patches move p
    _assert_same_estimates(by_backward, after)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_atp_star_on_a_half_precision_mamba(dtype):
    """AtP* on a Mamba computing in bfloat16 or float16 (a pretrained folder's `--dtype`): Mamba's
    decays are float32 (A is, as in mamba-ssm), so its patched steps' states are too, and each
    read-out casts C to them (it raised a dtype error). The estimated shifts p_patched − p_corrupt
    are the float32 model's to 10 % of the largest: measured 4 % (bfloat16, 8 bits of mantissa
    rounding every activation of three blocks) and 1.2 % (float16), where a value read in the
    wrong format or place is off by the whole shift."""
    task = hookmech.tasks.make("ar", vocab_size=96, num_kv_pairs=20)
    batch = task.sample(8, seed=7)
    sites, positions = ["L*.block_in"], ["key", "value", "all"]
    reference = atp_star_patch(unit_variance(make_model(task, mixers="mamba", n_layers=3)), batch, sites, positions)
    half = unit_variance(make_model(task, mixers="mamba", n_layers=3)).to(dtype)
    found = atp_star_patch(half, batch, sites, positions)
    shifts = torch.tensor([[r["p_patched"] - r["p_corrupt"] for r in records] for records in (found, reference)])
    assert shifts[1].abs().max() > 10 * ENGINE_TOL  # patches move p
    assert (shifts[0] - shifts[1]).abs().max() <= 0.1 * shifts[1].abs().max()
