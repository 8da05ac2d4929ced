"""The mixer contract split by capability (hookmech/mixers/base.py, capabilities.py) and the model
contract split the same way (hookmech/patching/protocol.py): a mixer implementing only the core
works wherever the core is needed (the exact engine through its correct-before-fast defaults, AtP,
AtP*'s first-order estimate, residual paths) and a capability it lacks is refused in one line naming
the mixer and the capability; exact patching asks nothing of AtP*; GradDrop is opt-in; one
predicate says whether a hook is in use."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import ENGINE_TOL, make_model, state_hooks_of, unit_variance
from torch import nn

import hookmech
from hookmech.errors import HookmechError, UsageError
from hookmech.hooks import AxisHookPoint
from hookmech.mixers import REGISTRY, SPECS, MissingCapability, Mixer, MixerSpec
from hookmech.oracles import plain_loop_patch
from hookmech.oracles.path_patching import path_patch_reference
from hookmech.patching import atp_star_patch, attribution_patch, patch, path_patch
from hookmech.patching.atp_star import answer_log_odds

KEYS = ("p_clean", "p_corrupt", "p_patched", "metric_clean", "metric_corrupt", "metric_patched")


class CoreOnly(Mixer):
    """The core alone: a gated causal running mean, ``y_t = W_out(σ(g_t) ⊙ mean_{s<=t} v_s)`` with
    two inside hooks. Every resume member is the base class's default (correct before fast), and it
    opts into no capability."""

    def __init__(self, d_model: int):
        super().__init__()
        self.in_proj = nn.Linear(d_model, 2 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.hook_v = AxisHookPoint("batch pos d_model")
        self.hook_mean = AxisHookPoint("batch pos d_model")

    def forward(self, x):
        v, gate = self.in_proj(x).chunk(2, dim=-1)
        v = self.hook_v(v)
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
        mean = self.hook_mean(v.cumsum(dim=1) / counts)
        return self.out_proj(mean * torch.sigmoid(gate))


#: CoreOnly's spec: what the package needs to know of it besides its class
CORE_ONLY_SPEC = MixerSpec(
    name="core_only",
    mixer=CoreOnly,
    heads=None,
    meanings={"v": "value branch", "mean": "running mean of v"},
    output_projections=("out_proj",),
)


def register_core_only(monkeypatch) -> None:
    """Register `CoreOnly` as "core_only", with its spec, for the test."""
    monkeypatch.setitem(SPECS, "core_only", CORE_ONLY_SPEC)
    monkeypatch.setitem(REGISTRY, "core_only", CoreOnly)


@pytest.fixture
def core_only(monkeypatch, ar_task):
    """A 2-layer model of `CoreOnly` mixers (registered as "core_only" for the test)."""
    register_core_only(monkeypatch)
    return unit_variance(make_model(ar_task, mixers="core_only", d_model=16))


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# -- the core alone works wherever the core is needed ----------------------------------------
@pytest.mark.parametrize("context_memory", [2 << 30, 0], ids=["resumed", "every-position"])
def test_a_core_only_mixer_patches_exactly_as_the_plain_loop(core_only, ar_task, monkeypatch, context_memory):
    """The engine against the plain loop (hookmech/oracles/plain_loop.py) at block sites and the
    mixer's own hooks; resumed runs go through the base class's `forward_from` (its spliced forward)."""
    calls = []
    default = Mixer.forward_from
    monkeypatch.setattr(CoreOnly, "forward_from", lambda self, *args: calls.append(1) or default(self, *args))
    batch = ar_task.sample(6, seed=3)
    sites = ["L0.block_in", "L0.mixer_out", "L1.*", "L0.mixer.v", "L1.mixer.v", "L1.mixer.mean"]
    positions = ["key+value", "query"]
    records = patch(core_only, batch, sites, positions, max_batch=5, context_memory=context_memory)
    reference = plain_loop_patch(core_only, batch, sites, positions)
    assert len(records) == len(reference) > 0
    for record in records:
        expected = reference[record["hook"], record["pos"]]
        for key in KEYS:  # contract: engine vs plain loop, ENGINE_TOL
            assert abs(record[key] - expected[key]) <= ENGINE_TOL, (record["site"], record["pos"], key)
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in records) > 2 * ENGINE_TOL  # a patch moves p
    assert bool(calls) == (context_memory > 0)  # resumed from its context only while contexts fit


def test_a_core_only_mixer_keeps_the_first_order_estimate_in_atp_star(core_only, ar_task):
    """AtP* without `ExactPatchEffects`: no exact patch is claimed, and a patch before the mixer is
    estimated to first order, (clean − corrupt) · ∂λ/∂activation mapped back to p per row, as a
    backward pass of the answer's log-odds λ computes it; AtP runs too."""
    batch = ar_task.sample(8, seed=4)
    assert not any(core_only.mixer_patches_exactly(layer) for layer in range(2))
    resid = torch.zeros(8, batch.tokens.shape[1], 16)
    assert core_only.mixer_patch_effects(0, resid[None], resid, lambda hook: resid) is None
    (record,) = atp_star_patch(core_only, batch, ["L0.block_in"], ["key"], per_example=True)
    hook = "blocks.0.hook_resid_pre"
    with torch.no_grad():
        _, clean = core_only.run_with_cache(batch.tokens, names_filter=[hook], return_cache_object=False)
    leaf = {}

    def add_leaf(activation, hook=None):
        leaf["corrupt"] = activation.detach()
        leaf["zero"] = torch.zeros_like(activation, requires_grad=True)
        return activation + leaf["zero"]

    with torch.enable_grad():
        logits = core_only.run_with_hooks(batch.corrupt_tokens, positions=batch.query_pos, fwd_hooks=[(hook, add_leaf)])
        log_odds = answer_log_odds(logits, batch.answers)
        (gradient,) = torch.autograd.grad(log_odds.sum(), leaf["zero"])
    key = batch.roles["key"]
    rows = torch.arange(len(batch))
    change = ((clean[hook] - leaf["corrupt"]) * gradient)[rows, key].sum(-1).double()
    p_corrupt = torch.tensor(record["p_corrupt_rows"], dtype=torch.float64)
    expected = p_corrupt + torch.sigmoid(log_odds.double() + change) - torch.sigmoid(log_odds.double())
    torch.testing.assert_close(torch.tensor(record["p_patched_rows"], dtype=torch.float64), expected, atol=1e-6, rtol=0)
    assert abs(record["p_patched"] - record["p_corrupt"]) > 1e-4  # the estimate moves
    assert len(attribution_patch(core_only, batch, ["all"], ["key"])) == 14  # 7 block sites x 2 layers


def test_a_resid_path_runs_and_the_routes_inside_are_refused_in_one_line(core_only, ar_task):
    batch = ar_task.sample(6, seed=5)
    (record,) = path_patch(core_only, batch, "L0.block_out@key", "L1.block_in@key", "resid")
    expected = path_patch_reference(core_only, batch, "L0.block_out@key", "L1.block_in@key", "resid")
    (reference,) = expected.values()
    assert abs(record["p_patched"] - reference["p_patched"]) <= ENGINE_TOL
    for sender, receiver, via in (
        ("L0.mixer.v@key", "L1.mixer.v@query", "head"),
        ("L1.mixer.mean@key", "L1.mixer.mean@query", "state"),
        ("L1.mixer.v@key", "L1.mixer.mean@key", "conv"),
    ):
        with pytest.raises(UsageError) as error:
            path_patch(core_only, batch, sender, receiver, via)
        assert "mixer CoreOnly does not implement PathRoutes, which a " + via in _one_line(error)


def test_effective_attention_is_refused_in_one_line(core_only):
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(HookmechError) as error:
        hookmech.attention_maps(core_only, tokens)
    assert "mixer CoreOnly does not implement EffectiveAttentionMap, which attention_maps (layer 0)" in _one_line(error)
    mixer = core_only.blocks[0].mixer
    assert not hasattr(mixer, "effective_attention") and not hasattr(mixer, "head_outputs")
    for member, capability in (("effective_attention", "EffectiveAttentionMap"), ("patches_exactly", "ExactPatchEffects"),
                               ("conv_path", "PathRoutes")):
        with pytest.raises(MissingCapability) as error:
            getattr(mixer, member)
        assert f"mixer CoreOnly does not define {member}: it does not implement the capability {capability}" in (
            _one_line(error))


# -- the model contract: exact patching asks nothing of AtP* ----------------------------------
ATP_STAR_MEMBERS = ("patch_to_next_mixer", "mixer_patches_exactly", "mixer_patch_effects", "mixer_patch_outputs",
                    "layer_patch_context")


class WithoutAtpStar(nn.Module):
    """A patchable model without AtP*'s members: every other member delegated to `model`."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def __getattr__(self, name):
        if name in ATP_STAR_MEMBERS:
            raise AttributeError(name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_exact_patching_and_atp_ask_nothing_of_atp_star(ar_model, ar_task):
    batch = ar_task.sample(6, seed=6)
    model = WithoutAtpStar(ar_model)
    sites, positions = ["L0.block_out", "L1.mixer.k"], ["key", "value"]
    for method in ("exact", "atp"):
        assert patch(model, batch, sites, positions, method=method) == patch(ar_model, batch, sites, positions,
                                                                             method=method)
    with pytest.raises(HookmechError) as error:
        atp_star_patch(model, batch, sites, positions)
    assert (f"WithoutAtpStar cannot be patched with AtP*: it has no {', '.join(ATP_STAR_MEMBERS)} "
            "(hookmech.patching.AtpStarModel") in _one_line(error)


# -- GradDrop is opt-in ----------------------------------------------------------------------
def test_graddrop_is_opt_in(ar_model, ar_task):
    batch = ar_task.sample(6, seed=7)
    default = atp_star_patch(ar_model, batch, ["all"], ["key"])
    assert all(r["graddrop"] is None for r in default)
    assert patch(ar_model, batch, ["all"], ["key"], method="atp-star") == default
    asked = patch(ar_model, batch, ["all"], ["key"], method="atp-star", graddrop=True)
    assert all(r["graddrop"] >= 0 for r in asked)
    assert [r["p_patched"] for r in asked] == [r["p_patched"] for r in default]  # GradDrop changes no estimate
    with pytest.raises(UsageError, match="graddrop=True is an option of method 'atp-star'"):
        patch(ar_model, batch, ["all"], ["key"], graddrop=True)


# -- context_memory bounds AtP*'s contexts from tokens too -----------------------------------
def test_atp_star_from_tokens_keeps_its_contexts_within_context_memory(ar_task, monkeypatch):
    """From tokens, the last block's exact query step resumes from each chunk's own contexts; they
    count against `context_memory` as the whole run's would (it compared with a constant)."""
    from hookmech.patching.atp_star_query import QueryStep

    model = make_model(ar_task, mixers="mamba", n_layers=3, d_model=16)
    batch = ar_task.sample(6, seed=8)
    kept = []
    original = QueryStep._contexts

    def spy(self, *args):
        found = original(self, *args)
        kept.append(found is not None)
        return found

    monkeypatch.setattr(QueryStep, "_contexts", spy)
    estimates = {}
    for budget in (2 << 30, 0):
        kept.clear()
        estimates[budget] = atp_star_patch(model, batch, ["L1.block_in"], ["key", "value"], context_memory=budget)
        assert kept and all(kept) == (budget > 0) and any(kept) == (budget > 0), budget
    for a, b in zip(estimates[2 << 30], estimates[0], strict=True):  # resumed vs every position: ENGINE_TOL
        assert a["p_patched"] == pytest.approx(b["p_patched"], abs=ENGINE_TOL)


# -- one predicate for "is this hook in use", one template for forward_with_context -------------
@pytest.mark.parametrize(("mixer", "state"), state_hooks_of())
def test_a_backward_hook_on_a_state_hook_fires(ar_task, mixer, state):
    """A backward hook alone puts a hook in use (the activation must pass through it): the mixers that
    asked `is_active` (forward hooks only) skipped materialising the state and the hook never fired."""
    model = make_model(ar_task, mixers=mixer, d_model=16)
    tokens = ar_task.sample(2, seed=9).tokens
    seen = []
    logits = model.run_with_hooks(tokens, bwd_hooks=[(f"blocks.0.mixer.hook_{state}", lambda grad, hook: seen.append(1))],
                                  reset_hooks_end=False)
    logits.sum().backward()
    model.reset_hooks()
    assert seen


def test_no_module_tests_a_hook_point_by_hand_and_no_mixer_branches_forward_with_context():
    """`hookmech.hooks.hook_in_use` is the one predicate; `Mixer.forward_with_context` the one
    template (mixers give their one-pass computation in `fused_forward_with_context`)."""
    package = Path(hookmech.__file__).parent
    by_hand = re.compile(r"\.(is_active|fwd_hooks|bwd_hooks)\b")
    found = [f"{path.relative_to(package)}:{number}" for path in sorted(package.rglob("*.py")) if path.name != "hooks.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if by_hand.search(line)]
    assert found == []
    assert [name for name, cls in REGISTRY.items() if "forward_with_context" in vars(cls)] == []
