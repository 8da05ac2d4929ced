"""AtP*: each of its parts against an independent computation (patched forwards, finite differences
of real state edits, detached backward passes, the exact engine), and the records' contract."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from helpers import (ATTENTION_FIXTURE, CACHE_TOL, ENGINE_TOL, FINITE_DIFFERENCE_RTOL, FLOAT64_SUM_TOL, make_model,
                     state_hooks_of,
                     unit_variance)

import hookmech
from hookmech.cache import write_cache
from hookmech.config import build_config
from hookmech.errors import HookmechError, UsageError
from hookmech.hook_names import hook_attribute, inside_name
from hookmech.hooks import gradients_follow_edits
from hookmech.mixers import REGISTRY
from hookmech.mixers import base as mixer_base
from hookmech.mixers.attention import Attention
from hookmech.mixers.capabilities import ExactPatchEffects, MixerMemo, PatchMemo
from hookmech.mixers.mamba_effects import MambaPatchEffects
from hookmech.patching import atp_star_patch, attribution_patch, patch, verify_top
from hookmech.patching.atp_star import answer_log_odds
from hookmech.sites import resolve_sites

#: float64 computations of the same quantity along two routes (closed form vs forwards): round-off
FLOAT64_TOL = 1e-10


def _activations(model, tokens, hooks):
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=hooks, return_cache_object=False)
    return cache


def test_answer_log_odds_is_log_p_over_one_minus_p():
    logits = torch.randn(5, 9, dtype=torch.float64) * 4
    answers = torch.tensor([0, 3, 8, 2, 2])
    p = logits.softmax(-1)[torch.arange(5), answers]
    torch.testing.assert_close(answer_log_odds(logits, answers), (p / (1 - p)).log())


# -- attention: the softmax recomputed for one patched position -----------------------------------
@pytest.fixture(params=["all", "one"])
def rows_at_once(request, monkeypatch):
    """The exact per-position mixer computations on all rows at once, or one row per block
    (`PATCH_BLOCK_BYTES`)."""
    if request.param == "one":
        monkeypatch.setattr(mixer_base, "PATCH_BLOCK_BYTES", 1)
    return request.param


def _patched_forward_effects(mixer, x, grads, hook):
    """Return (patched, reference): a large patch of the mixer's input (`hook` None) or of its
    inside hook `hook` at every position ``[N, T, ...]``, and ``[V, N, T]`` Σ_t (y'_t − y_t)·g_t per
    gradient in `grads` ``[V, N, T, d_model]`` with position s alone patched, by one forward of
    the mixer per position."""
    n, t, d_model = x.shape
    point = None if hook is None else getattr(mixer, hook_attribute(hook))
    if point is None:
        patched = 3 * torch.randn(n, t, d_model, dtype=torch.float64)
    else:
        seen = {}
        point.add_hook(lambda act, hook: seen.setdefault("base", act.clone()))
        mixer(x)
        point.remove_hooks()
        # large moves: a saturated normalisation is what the closed form must get right
        patched = seen["base"] + 3 * torch.randn_like(seen["base"])
    y = mixer(x)
    reference = torch.zeros(grads.shape[0], n, t, dtype=torch.float64)
    for s in range(t):
        if point is None:
            spliced = x.clone()
            spliced[:, s] = patched[:, s]
            y_patched = mixer(spliced)
        else:
            axis = point.pos_axis

            def replace(act, hook=None, s=s, axis=axis):
                index = [slice(None)] * act.dim()
                index[axis] = s
                act = act.clone()
                act[tuple(index)] = patched[tuple(index)]
                return act

            point.add_hook(replace)
            y_patched = mixer(x)
            point.remove_hooks()
        reference[:, :, s] = torch.einsum("vntd,ntd->vn", grads, y_patched - y)
    if hook == "attn_scores":  # masked scores stay -inf, as a run's own scores do
        patched = torch.where(torch.isinf(seen["base"]), seen["base"], patched)
    return patched, reference


ATTENTION_HOOKS = [None, "q", "k", "v", "attn_scores"]
#: (options, patched hook): every hook of plain, windowed, and rotary attention (Pythia's: q and k
#: rotated for their positions, rot_q / rot_k after the rotation)
ATTENTION_CASES = [({"window": window}, hook) for window in (None, 2) for hook in ATTENTION_HOOKS] + [
    ({"rotary_pct": 0.5}, hook) for hook in [*ATTENTION_HOOKS, "rot_q", "rot_k"]
]


@pytest.mark.parametrize("options, hook", ATTENTION_CASES)
def test_attention_position_effects_equal_patched_forwards(options, hook, rows_at_once):
    """Σ_t (y'_t − y_t)·g_t for each patched position s, against a forward of the mixer with
    position s patched (float64, one forward per position); all rows at once, or a row at a time
    (`PATCH_BLOCK_BYTES`)."""
    torch.manual_seed(0)
    mixer = Attention(16, n_heads=2, **options).double()
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    grads = torch.randn(2, 3, 7, 16, dtype=torch.float64)  # two gradients at once (a leading axis)
    with torch.no_grad():
        patched, reference = _patched_forward_effects(mixer, x, grads, hook)
        effects = mixer.position_patch_effects(x, grads, patched, hook)
    assert reference.abs().max() > 0.1
    torch.testing.assert_close(effects, reference, atol=FLOAT64_TOL, rtol=0)


# -- Based: the normalised kernel recomputed for one patched position -----------------------------
@pytest.mark.parametrize("train_view", ["quadratic", "linear"])
@pytest.mark.parametrize("hook", [None, "q", "k", "phi_q", "phi_k", "v"])
def test_based_position_effects_equal_patched_forwards(train_view, hook, rows_at_once):
    """Based's Σ_t (y'_t − y_t)·g_t for each patched position s, against a forward of the mixer
    with position s patched (float64; both views compute the same y); all rows at once, or a row
    at a time (`PATCH_BLOCK_BYTES`)."""
    from hookmech.mixers.based import Based

    torch.manual_seed(3)
    mixer = Based(16, feature_dim=4, num_heads=2, num_key_value_heads=2, train_view=train_view, chunk_size=3)
    mixer = mixer.double()
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    grads = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    with torch.no_grad():
        patched, reference = _patched_forward_effects(mixer, x, grads, hook)
        effects = mixer.position_patch_effects(x, grads, patched, hook)
    assert reference.abs().max() > 0.1
    torch.testing.assert_close(effects, reference, atol=FLOAT64_TOL, rtol=0)


@pytest.fixture(params=["whole", "small"])
def mamba_blocks(request, monkeypatch):
    """Mamba's patched steps on every pair at once and its adjoint sweep in one segment, or one
    pair per block and segments of 3 positions (`PAIR_BLOCK_BYTES`, `SWEEP_POSITIONS`)."""
    from hookmech.mixers import mamba_effects

    if request.param == "small":
        monkeypatch.setattr(mamba_effects, "PAIR_BLOCK_BYTES", 1)
        monkeypatch.setattr(mamba_effects, "SWEEP_POSITIONS", 3)
    return request.param


# the last options are those a pretrained folder may have (hookmech.pretrained.mamba): biases, no conv bias
@pytest.mark.parametrize("options", [{}, {"d_conv": 0}, {"d_conv": 2, "gate": False},
                                     {"bias": True, "conv_bias": False, "d_conv": 3}])
@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_mamba_effects_by_the_backward_equal_patched_forwards(options, chunk_bytes, monkeypatch):
    """Mamba's effects of a patch of its input computed by the backward pass of resumed windows
    (`MambaPatchEffects.backward_patch_effects`: the scan's chunk states and adjoints) against a
    forward of the mixer with position s patched (float64): three rows resumed at positions 0, 7
    and 20 over windows of 20 of 40 positions, in the scan's chunks of 16 positions (pairs whose
    reach crosses a chunk's end) or of one position (`CHUNK_BYTES`: a reach over several chunks)."""
    from hookmech.mixers import selective_scan
    from hookmech.mixers.mamba import Mamba

    if chunk_bytes is not None:
        monkeypatch.setattr(selective_scan, "CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(1)
    mixer = Mamba(16, d_state=4, **options).double()
    n, t, width = 3, 40, 20
    start = torch.tensor([0, 7, 20])
    x = torch.randn(n, t, 16, dtype=torch.float64)
    in_window = (torch.arange(t) >= start[:, None]) & (torch.arange(t) < start[:, None] + width)
    grads = torch.randn(1, n, t, 16, dtype=torch.float64) * in_window[None, :, :, None]
    with torch.no_grad():
        patched, reference = _patched_forward_effects(mixer, x, grads, None)
        context = mixer.prefix_context(x)
    recorder = mixer.backward_patch_effects(patched, MixerMemo(), 0)
    window = mixer_base.window_of(x, torch.arange(n), start, width).requires_grad_(True)
    with recorder.recording():
        y = mixer.forward_from(window, context, torch.arange(n), start)
    (y * mixer_base.window_of(grads[0], torch.arange(n), start, width)).sum().backward()
    effects = recorder.effects()
    assert effects is not None and reference.abs().max() > 0.1
    torch.testing.assert_close(effects, reference[0] * in_window, atol=FLOAT64_TOL, rtol=0)


def test_mamba_effects_by_the_backward_need_the_scan_to_show_its_states():
    """With the state hook in use the scan materialises its states and shows no chunk: no effects."""
    from hookmech.mixers.mamba import Mamba

    mixer = Mamba(16, d_state=4)
    x = torch.randn(2, 8, 16)
    recorder = mixer.backward_patch_effects(torch.randn(2, 8, 16), MixerMemo(), 0)
    mixer.hook_ssm_state.add_hook(lambda act, hook=None: act)
    with recorder.recording():
        y = mixer.forward_from(x.requires_grad_(True), mixer.prefix_context(x.detach()), torch.arange(2), torch.zeros(2, dtype=torch.long))
    y.sum().backward()
    assert recorder.effects() is None


# the last options are those a pretrained folder may have (hookmech.pretrained.mamba): biases, no conv bias
@pytest.mark.parametrize("options", [{}, {"d_conv": 0}, {"d_conv": 2, "gate": False},
                                     {"bias": True, "conv_bias": False, "d_conv": 3}])
@pytest.mark.parametrize("hook", [None, "in_x"])
def test_mamba_position_effects_equal_patched_forwards(options, hook, rows_at_once, mamba_blocks):
    """Mamba: Δ, B, C and the state recomputed over the convolution's reach, the adjoint state
    after it, against a forward of the mixer with position s patched (float64); all rows at once,
    or a row at a time (`PATCH_BLOCK_BYTES`)."""
    from hookmech.mixers.mamba import Mamba

    torch.manual_seed(1)
    mixer = Mamba(16, d_state=4, **options).double()
    n, t = 3, 8
    x = torch.randn(n, t, 16, dtype=torch.float64)
    grads = torch.randn(2, n, t, 16, dtype=torch.float64)
    with torch.no_grad():
        if hook is None:
            patched = 3 * torch.randn(n, t, 16, dtype=torch.float64)
        else:
            base = mixer._split(mixer.in_proj(x))[0]
            patched = base + 3 * torch.randn_like(base)
        y = mixer(x)
        reference = torch.zeros(2, n, t, dtype=torch.float64)
        for s in range(t):
            if hook is None:
                spliced = x.clone()
                spliced[:, s] = patched[:, s]
                y_patched = mixer(spliced)
            else:

                def replace(act, hook=None, s=s):
                    act = act.clone()
                    act[:, s] = patched[:, s]
                    return act

                mixer.hook_in_x.add_hook(replace)
                y_patched = mixer(x)
                mixer.hook_in_x.remove_hooks()
            reference[:, :, s] = torch.einsum("vntd,ntd->vn", grads, y_patched - y)
        effects = mixer.position_patch_effects(x, grads, patched, hook)
    assert reference.abs().max() > 0.1
    torch.testing.assert_close(effects, reference, atol=FLOAT64_TOL, rtol=0)


# the last options are those a pretrained folder may have (hookmech.pretrained.mamba): biases, no conv bias
@pytest.mark.parametrize("options", [{}, {"d_conv": 0}, {"d_conv": 2, "gate": False},
                                     {"bias": True, "conv_bias": False, "d_conv": 3}])
def test_mamba_position_outputs_equal_patched_forwards_at_the_query(options, rows_at_once, mamba_blocks):
    """Mamba's output change at each row's query `at` for a patch at every s: within the
    convolution's reach of s, beyond it (the state carried by the base run's decays) and after
    the query (zero), against a forward of the mixer with position s patched (float64); all rows
    at once, or a row at a time (`PATCH_BLOCK_BYTES`)."""
    from hookmech.mixers.mamba import Mamba

    torch.manual_seed(2)
    mixer = Mamba(16, d_state=4, **options).double()
    n, t = 3, 9
    x = torch.randn(n, t, 16, dtype=torch.float64)
    patched = 3 * torch.randn(n, t, 16, dtype=torch.float64)
    at = torch.tensor([8, 6, 2])
    rows = torch.arange(n)
    with torch.no_grad():
        y = mixer(x)
        reference = torch.zeros(n, t, 16, dtype=torch.float64)
        for s in range(t):
            spliced = x.clone()
            spliced[:, s] = patched[:, s]
            reference[:, s] = (mixer(spliced) - y)[rows, at]
        outputs = mixer.position_patch_outputs(x, patched, at)
    far = reference[0, :3]  # row 0: s = 0..2 lie beyond the reach of its query 8
    # a random-init state forgets fast, yet far effects stay 1e5 times the tolerance
    assert far.abs().max() > 1e-5 and reference.abs().max() > 0.1
    assert bool((reference[2, 3:] == 0).all())  # after the query
    torch.testing.assert_close(outputs, reference, atol=FLOAT64_TOL, rtol=0)


def test_mamba_patch_computations_share_the_base_run(monkeypatch):
    """Calls given the same memo compute the base run's branch once and give the numbers
    of calls without it, bit for bit; the context made from it (`patch_context`, the first call)
    is `prefix_context`'s."""
    from hookmech.mixers.mamba import Mamba

    torch.manual_seed(4)
    mixer = Mamba(16, d_state=4).double()
    x, patched = torch.randn(2, 6, 16, dtype=torch.float64), torch.randn(2, 6, 16, dtype=torch.float64)
    grads, at = torch.randn(1, 2, 6, 16, dtype=torch.float64), torch.tensor([5, 3])
    in_x_patch = 3 * torch.randn(2, 6, 32).double()
    with torch.no_grad():
        context = mixer.prefix_context(x)
        alone = (
            mixer.position_patch_effects(x, grads, patched),
            mixer.position_patch_outputs(x, patched, at),
            mixer.position_patch_effects(x, grads, in_x_patch, "in_x"),
        )
        calls = []
        compute = mixer._compute_base_branch
        monkeypatch.setattr(mixer, "_compute_base_branch", lambda *args: calls.append(1) or compute(*args))
        memo = MixerMemo()
        made = mixer.patch_context(x, memo)
        together = (
            mixer.position_patch_effects(x, grads, patched, memo=memo),
            mixer.position_patch_effects(x, grads, in_x_patch, "in_x", memo=memo),
            mixer.position_patch_outputs(x, patched, at, memo=memo),
        )
    assert len(calls) == 1
    assert made.keys() == context.keys() == {"state", "in_x"}
    for name in context:  # the same computation; the branch projects the rows a block at a time
        torch.testing.assert_close(made[name], context[name], atol=FLOAT64_TOL, rtol=0)
    assert torch.equal(together[0], alone[0]) and torch.equal(together[2], alone[1])
    assert torch.equal(together[1], alone[2]) and alone[2].abs().max() > 0  # the inside hook's patch


def test_mamba_patch_computations_keep_states_state_major():
    """The patch computations keep states state-major (``[N, T, d_state, d_inner]``, the mamba_effects
    docstring): the base branch's states, transposed, are the reference scan's; the context made
    from them is in the mixer's layout (``[N, K, d_inner, d_state]``, contiguous), bit for bit
    those states every STATE_STRIDE positions."""
    from hookmech.mixers.mamba import Mamba
    from hookmech.mixers.selective_scan import selective_scan_ref

    torch.manual_seed(6)
    mixer = Mamba(16, d_state=4).double()
    x = torch.randn(2, 2 * mixer.STATE_STRIDE + 3, 16, dtype=torch.float64)
    with torch.no_grad():
        in_x, z = mixer._split(mixer.in_proj(x))
        _, delta, _, decay, states, _, _ = mixer._compute_base_branch(in_x, z)
        u, delta_ref, B, C = mixer._ssm_inputs(in_x)
        _, reference = selective_scan_ref(u, delta_ref, mixer._A(), B, C)
        context = mixer.patch_context(x, MixerMemo())
    assert states.shape == (2, x.shape[1], mixer.d_state, mixer.d_inner) == decay.shape
    torch.testing.assert_close(states.transpose(-1, -2), reference, atol=FLOAT64_TOL, rtol=0)
    kept = context["state"]
    assert kept.shape == (2, 2, mixer.d_inner, mixer.d_state) and kept.is_contiguous()
    stride = mixer.STATE_STRIDE
    assert torch.equal(kept, states[:, stride - 1 :: stride].transpose(-1, -2))


def test_mamba_patch_computations_read_the_projections_they_are_given(monkeypatch):
    """Given in_proj's outputs on the base input and on the patched one (`MixerMemo.give`, as
    AtP* gives what its runs computed), the computations read them instead of projecting again,
    and give the numbers of calls without them, bit for bit; reads given for another input (one
    element apart) are not used."""
    from hookmech.mixers.mamba import Mamba

    torch.manual_seed(5)
    mixer = Mamba(16, d_state=4).double()
    x, patched = torch.randn(3, 7, 16, dtype=torch.float64), torch.randn(3, 7, 16, dtype=torch.float64)
    grads, at = torch.randn(2, 3, 7, 16, dtype=torch.float64), torch.tensor([6, 2, 4])
    with torch.no_grad():
        alone = mixer.position_patch_effects(x, grads, patched), mixer.position_patch_outputs(x, patched, at)
        context = mixer.patch_context(x, MixerMemo())

        def reads(values):
            in_x, z = mixer._split(mixer.in_proj(values))
            return {"in_x": in_x, "gate": z}

        memo, other = MixerMemo(), x.clone()
        other[2, 6, 0] += 1
        memo.give(other, reads(other))
        memo.give(x.clone(), reads(x))  # an equal tensor, not the same object
        memo.give(patched, reads(patched))
        projections = []
        forward = mixer.in_proj.forward
        monkeypatch.setattr(mixer.in_proj, "forward", lambda values: projections.append(1) or forward(values))
        given = (
            mixer.position_patch_effects(x, grads, patched, memo=memo),
            mixer.position_patch_outputs(x, patched, at, memo=memo),
        )
        made = mixer.patch_context(x, memo)
        assert projections == []
        memo = MixerMemo()
        memo.give(other, reads(other))
        projections.clear()
        mixer.position_patch_effects(x, grads, patched, memo=memo)
    assert len(projections) == 2  # the base input and the patched one, projected
    assert torch.equal(given[0], alone[0]) and torch.equal(given[1], alone[1])
    assert all(torch.equal(made[name], context[name]) for name in context)
    assert alone[0].abs().max() > 0.1


def test_position_effects_are_absent_where_a_mixer_has_no_exact_form(ar_task):
    x, grads = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    assert Attention(32, qkv_conv="k").position_patch_effects(x, grads, x) is None  # a conv spreads the patch
    assert Attention(32).position_patch_effects(x, grads, torch.randn(2, 5, 1, 32), "z") is None
    model = make_model(ar_task, mixers="rwkv")
    assert not isinstance(model.blocks[0].mixer, ExactPatchEffects)  # a mixer without the capability
    assert model.mixer_patch_effects(0, grads, x, lambda hook: x) is None
    assert model.mixer_patch_outputs(0, x, lambda hook: x, torch.zeros(2, dtype=torch.long)) is None
    based = make_model(ar_task, mixers="based").blocks[0].mixer
    assert based.position_patch_effects(x, grads, torch.randn(2, 5, 1, 32), "y") is None  # after the kernel
    assert Attention(32).position_patch_outputs(x, x, torch.zeros(2, dtype=torch.long)) is None


# -- the route from a block-level hook to the next mixer ------------------------------------------
@pytest.mark.parametrize("mixer, mlp", [("attention", True), ("mamba", False)])
def test_patch_to_next_mixer_is_a_patched_forward_at_each_position(ar_task, mixer, mlp):
    """For every block-level hook and position s: the residual entering the next mixer's block
    and that mixer's input at s, against a forward with the hook patched at s alone."""
    model = unit_variance(make_model(ar_task, mixers=mixer, n_layers=3, mlp=mlp)).double()
    batch = ar_task.sample(4, seed=2)
    block_hooks = [h for h in resolve_sites(["all"], model.hook_dict)]
    wanted = block_hooks + [f"blocks.{layer}.hook_mixer_in" for layer in range(3)]
    clean = _activations(model, batch.tokens, block_hooks)
    corrupt = _activations(model, batch.corrupt_tokens, wanted)
    n_pos = batch.tokens.shape[1]
    for hook in block_hooks:
        with torch.no_grad():
            layer, resid, mixer_in = model.patch_to_next_mixer(hook, clean[hook], corrupt.__getitem__)
        expected_layer = model.layer_of_hook(hook) + (0 if hook.endswith(("resid_pre", "mixer_in")) else 1)
        assert layer == expected_layer, hook
        if mixer_in is None:  # past the last mixer: followed at one position per row alone, the same
            at = torch.tensor([0, 3, n_pos - 1, 2])
            with torch.no_grad():
                _, at_resid, _ = model.patch_to_next_mixer(hook, clean[hook], corrupt.__getitem__, at=at)
            assert at_resid.shape == (4, 1, resid.shape[-1])
            torch.testing.assert_close(at_resid[:, 0], resid[torch.arange(4), at], atol=FLOAT64_TOL, rtol=0)
        resid_hook = model.resid_hook(layer)
        for s in (0, 3, n_pos - 1):

            def replace(act, hook=None, s=s, values=clean[hook]):
                act = act.clone()
                act[:, s] = values[:, s]
                return act

            watched = [resid_hook] + ([] if mixer_in is None else [f"blocks.{layer}.hook_mixer_in"])
            with model.hooks(fwd_hooks=[(hook, replace)]):
                patched = _activations(model, batch.corrupt_tokens, watched)
            if hook.endswith("mixer_in") and model.layer_of_hook(hook) == layer:
                # a mixer-only patch: the residual entering the block is the base run's
                torch.testing.assert_close(resid[:, s], corrupt[resid_hook][:, s], atol=FLOAT64_TOL, rtol=0)
            else:
                torch.testing.assert_close(resid[:, s], patched[resid_hook][:, s], atol=FLOAT64_TOL, rtol=0)
            if mixer_in is not None:
                mixer_hook = f"blocks.{layer}.hook_mixer_in"
                torch.testing.assert_close(mixer_in[:, s], patched[mixer_hook][:, s], atol=FLOAT64_TOL, rtol=0)
    assert model.patch_to_next_mixer("hook_embed", clean["blocks.0.hook_resid_pre"], corrupt.__getitem__) is None


# -- recurrent states: gradients that follow the re-propagated recurrence --------------------------
@pytest.mark.parametrize("mixer, state_hook", [(mixer, f"hook_{state}") for mixer, state in state_hooks_of()])
def test_state_gradients_follow_the_recurrence_of_a_real_edit(ar_task, mixer, state_hook):
    """Under `gradients_follow_edits`, ∂f/∂state at position s (f: a fixed linear read-out of the
    block's output) equals the central finite difference of real edits there, which the mixer
    re-propagates through its recurrence; without it, the gradient is the direct read-out's only."""
    layers = ("baseconv", "based") if mixer == "based" else (mixer,)
    model = unit_variance(make_model(ar_task, mixers=list(layers), n_layers=len(layers))).double()
    layer = len(layers) - 1
    hook, out_hook = f"blocks.{layer}.mixer.{state_hook}", f"blocks.{layer}.hook_mixer_out"
    tokens = ar_task.sample(3, seed=4).corrupt_tokens
    generator = torch.Generator().manual_seed(1)
    base_state = _activations(model, tokens, [hook])[hook]
    weight = torch.randn(
        *_activations(model, tokens, [out_hook])[out_hook].shape, generator=generator, dtype=torch.float64
    )
    direction = torch.randn(base_state.shape, generator=generator, dtype=torch.float64)
    s = 2

    def read_out(edit_scale: float) -> float:
        def edit(act, hook=None):
            act = act.clone()
            act[:, s] = act[:, s] + edit_scale * direction[:, s]
            return act

        with torch.no_grad(), model.hooks(fwd_hooks=[(hook, edit)]):
            out = _activations(model, tokens, [out_hook])[out_hook]
        return float((out * weight).sum())

    def gradient(follow: bool) -> float:
        leaf = {}

        def add_leaf(act, hook=None):
            leaf["zero"] = torch.zeros_like(act, requires_grad=True)
            return act + leaf["zero"]

        seen = {}
        with torch.enable_grad(), gradients_follow_edits([model.hook_dict[hook]] if follow else []):
            model.run_with_hooks(
                tokens, fwd_hooks=[(hook, add_leaf), (out_hook, lambda a, hook: seen.setdefault("out", a))]
            )
            (grad,) = torch.autograd.grad((seen["out"] * weight).sum(), leaf["zero"])
        return float((grad[:, s] * direction[:, s]).sum())

    eps = 1e-6
    finite = (read_out(eps) - read_out(-eps)) / (2 * eps)
    # central differences in float64: truncation O(eps²) (the norms after some states curve: 2e-4
    # relative at eps 1e-4 for deltanet, 2e-6 at 1e-5) plus round-off ~1e-16 / eps relative
    assert gradient(True) == pytest.approx(finite, rel=FINITE_DIFFERENCE_RTOL, abs=FLOAT64_SUM_TOL)
    assert abs(gradient(False) - finite) > 1e-3 * abs(finite)  # the direct read-out alone misses the rest


# -- the estimates ----------------------------------------------------------------------------------
def test_cells_after_the_last_mixer_are_exact(ar_task):
    """After the last mixer only position-wise computation is left, which AtP* runs exactly:
    its per-row estimates are the exact engine's numbers."""
    model = unit_variance(make_model(ar_task, n_layers=2))
    batch = ar_task.sample(12, seed=5)
    sites = ["L1.mixer_out", "L1.resid_mid", "L1.mlp_in", "L1.mlp_out", "L1.block_out", "final_norm"]
    star = atp_star_patch(model, batch, sites, ["query", "value", "all"], per_example=True)
    exact = patch(model, batch, sites, ["query", "value", "all"], per_example=True)
    with torch.no_grad():
        p_corrupt = model(batch.corrupt_tokens, positions=batch.query_pos).softmax(-1)[torch.arange(12), batch.answers]
    assert max((torch.tensor(e["p_patched_rows"]) - p_corrupt).abs().max().item() for e in exact) > 1e-3
    for a, e in zip(star, exact, strict=True):
        assert (a["site"], a["pos"]) == (e["site"], e["pos"])
        # the same numbers, from the engine's resumed runs and from AtP*'s position-wise run: ENGINE_TOL
        torch.testing.assert_close(
            torch.tensor(a["p_patched_rows"]), torch.tensor(e["p_patched_rows"]), atol=ENGINE_TOL, rtol=0
        )


def test_cells_after_the_last_mixer_of_a_parallel_block_are_exact(ar_task):
    """The same in a parallel block (GPT-NeoX's, no resid_mid): the MLP reads the block's input."""
    cfg = build_config(d_vocab=ar_task.d_vocab, n_ctx=ar_task.n_ctx, d_model=32, n_layers=2,
                       layer_options=[{"n_heads": 2, "rotary_pct": 0.5}] * 2, pos_emb="none")
    torch.manual_seed(0)
    model = unit_variance(hookmech.HookedLM(dataclasses.replace(cfg, parallel_residual=True)).eval())
    batch = ar_task.sample(12, seed=5)
    sites = ["L1.mixer_out", "L1.mlp_in", "L1.mlp_out", "L1.block_out", "final_norm"]
    star = atp_star_patch(model, batch, sites, ["query", "value"], per_example=True)
    exact = patch(model, batch, sites, ["query", "value"], per_example=True)
    moved = max(abs(e["p_patched"] - e["p_corrupt"]) for e in exact)
    assert moved > 1e-3
    for a, e in zip(star, exact, strict=True):
        torch.testing.assert_close(
            torch.tensor(a["p_patched_rows"]), torch.tensor(e["p_patched_rows"]), atol=ENGINE_TOL, rtol=0
        )


@pytest.mark.parametrize(("mixers", "query_exact"), [("attention", False), ("based", False), ("mamba", True)])
def test_block_patch_is_exact_through_the_next_mixer_and_the_last_block_at_the_query(ar_task, mixers, query_exact):
    """One cell by brute force: λ_corrupt + g_s·Δr_s + Σ_{t≠q} g_t·(y'_t − y_t) + (λ_q − λ_corrupt),
    with g = ∂λ/∂(mixer output) by autograd, y' a forward of the mixer on the spliced input, and
    λ_q a forward with only the query's mixer output set to y'_q (the last block exact there),
    mapped to p. The patch is before every query, so the residual at the query is unchanged.
    A mixer without `position_patch_outputs` (attention, Based) keeps g_q·(y'_q − y_q) instead of λ_q."""
    model = unit_variance(make_model(ar_task, n_layers=2, mixers=mixers)).double()
    batch = ar_task.sample(6, seed=6)
    rows, query = torch.arange(6), batch.query_pos
    # the last key, within Mamba's convolution of the query (a random-init SSM forgets fast)
    s = int(batch.roles["key"].max())
    assert bool((query - s < 4).all() & (query > s).all())
    resid_hook, in_hook, out_hook = "blocks.0.hook_resid_pre", "blocks.0.hook_mixer_in", "blocks.0.hook_mixer_out"
    clean = _activations(model, batch.tokens, [resid_hook])
    corrupt = _activations(model, batch.corrupt_tokens, [resid_hook, in_hook])
    leaf = {}

    def add_leaf(act, hook=None):
        leaf["zero"] = torch.zeros_like(act, requires_grad=True)
        return act + leaf["zero"]

    with torch.enable_grad():
        logits = model.run_with_hooks(batch.corrupt_tokens, positions=query, fwd_hooks=[(out_hook, add_leaf)])
        log_odds = answer_log_odds(logits, batch.answers)
        (grad,) = torch.autograd.grad(log_odds.sum(), leaf["zero"])
    with torch.no_grad():
        mixer, norm = model.blocks[0].mixer, model.blocks[0].ln1
        spliced = corrupt[resid_hook].clone()
        spliced[:, s] = clean[resid_hook][:, s]
        moved = mixer(norm(spliced)) - mixer(corrupt[in_hook])
        moved_elsewhere = moved.clone()
        if query_exact:
            moved_elsewhere[rows, query] = 0
        change = (moved_elsewhere * grad).sum((1, 2))
        change += (grad[:, s] * (clean[resid_hook][:, s] - corrupt[resid_hook][:, s])).sum(-1)

        def query_moved(act, hook=None):
            out = act.clone()
            out[rows, query] += moved[rows, query]
            return out

        at_query = model.run_with_hooks(batch.corrupt_tokens, positions=query, fwd_hooks=[(out_hook, query_moved)])
        if query_exact:
            change += answer_log_odds(at_query, batch.answers) - log_odds
        p_corrupt = logits.softmax(-1)[rows, batch.answers]
        expected = p_corrupt + torch.sigmoid(log_odds + change) - torch.sigmoid(log_odds)
    (record,) = atp_star_patch(model, batch, ["L0.block_in"], [str(s)], per_example=True)
    assert (expected - p_corrupt).abs().max() > 1e-3
    # the records' base p is a float32 softmax (hookmech.cache.answer_probs): float32 round-off
    torch.testing.assert_close(torch.tensor(record["p_patched_rows"], dtype=torch.float64), expected, atol=1e-6, rtol=0)


def test_graddrop_equals_backward_passes_through_detached_sublayers(ar_task):
    """GradDrop's pass for layer ℓ against a backward pass with ℓ's sublayer inputs detached (a
    separate route: `detach` in the forward instead of AtP*'s backward gate). For the embedding
    (a linear estimate) the score is the mean over ℓ of |mean change of p| under those gradients;
    for the final norm, after every layer, it is the estimate itself."""
    model = unit_variance(make_model(ar_task, n_layers=2)).double()
    batch = ar_task.sample(8, seed=7)
    hook = "hook_embed"
    clean, corrupt = (_activations(model, tokens, [hook])[hook] for tokens in (batch.tokens, batch.corrupt_tokens))
    shifts = []
    for layer in range(2):
        leaf = {}

        def add_leaf(act, hook=None, leaf=leaf):
            leaf["zero"] = torch.zeros_like(act, requires_grad=True)
            return act + leaf["zero"]

        detach = [
            (f"blocks.{layer}.{name}", lambda act, hook: act.detach()) for name in ("hook_mixer_in", "hook_mlp_in")
        ]
        with torch.enable_grad():
            logits = model.run_with_hooks(
                batch.corrupt_tokens, positions=batch.query_pos, fwd_hooks=[(hook, add_leaf), *detach]
            )
            log_odds = answer_log_odds(logits, batch.answers)
            (grad,) = torch.autograd.grad(log_odds.sum(), leaf["zero"])
        per_position = ((clean - corrupt) * grad).sum(-1)  # [N, T]
        shifts.append(torch.sigmoid(log_odds[:, None] + per_position) - torch.sigmoid(log_odds[:, None]))
    expected = torch.stack(shifts).mean(1).abs().mean(0)  # mean over layers of |mean over rows|: [T]
    records = atp_star_patch(model, batch, ["embed", "final_norm"], ["all"], graddrop=True)
    by = {(r["site"], r["pos"]): r for r in records}
    assert expected.max() > 1e-4  # the corrupted key's embedding moves p along either route
    for position in range(batch.tokens.shape[1]):
        # float64 model; the two routes sum the same products in other orders
        assert by["embed", str(position)]["graddrop"] == pytest.approx(expected[position].item(), abs=FLOAT64_SUM_TOL)
        final = by["final_norm", str(position)]
        assert final["graddrop"] == pytest.approx(abs(final["p_patched"] - final["p_corrupt"]), abs=FLOAT64_SUM_TOL)


@pytest.mark.slow
def test_atp_star_fixes_the_saturated_cells_of_the_trained_fixture():
    """The trained attention fixture (induction through a saturated layer-1 softmax): against the
    exact engine, AtP*'s error on the 10 strongest cells and the share of them among its 20
    strongest both beat plain AtP's (docs/performance.md has the full table)."""
    import hookmech

    model, task = hookmech.load(ATTENTION_FIXTURE), hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)
    batch = task.sample(64, seed=1)
    exact = torch.tensor([r["p_patched"] - r["p_corrupt"] for r in patch(model, batch, ["all"], ["all"])])
    top = torch.argsort(-exact.abs())[:10]
    threshold = exact.abs()[top[-1]] - 1e-6  # ties with the 10th count as found
    scores = {}
    for method in ("atp", "atp-star"):
        records = patch(model, batch, ["all"], ["all"], method=method)
        estimate = torch.tensor([r["p_patched"] - r["p_corrupt"] for r in records])
        priority = torch.tensor([max(abs(r["p_patched"] - r["p_corrupt"]), r.get("graddrop") or 0) for r in records])
        found = (exact.abs()[torch.argsort(-priority)[:20]] >= threshold).sum().item()
        scores[method] = ((estimate[top] - exact[top]).abs().max().item(), found)
    (atp_error, atp_found), (star_error, star_found) = scores["atp"], scores["atp-star"]
    assert star_error < atp_error - 0.05 and star_found > atp_found, scores


@pytest.mark.parametrize("mixer", sorted(REGISTRY))
def test_every_mixer_and_site_kind_gets_a_finite_estimate(ar_task, mixer):
    """Block sites, the embeddings and every inside hook with a position axis, for every mixer:
    estimates are finite probabilities, and the last block's output is exact (only position-wise
    computation follows it)."""
    model = unit_variance(make_model(ar_task, mixers=mixer, d_model=16))
    batch = ar_task.sample(4, seed=11)
    inside = [name for name, point in model.hook_dict.items() if ".mixer." in name and point.pos_axis is not None]
    records = atp_star_patch(model, batch, ["all", "embed", *inside], ["key", "query"], per_example=True)
    assert len(records) == 2 * (15 + len(inside)) - 2 * (not model.blocks[0].has_mlp) * 6
    for record in records:
        rows = torch.tensor(record["p_patched_rows"])
        assert torch.isfinite(rows).all() and (rows >= 0).all() and (rows <= 1).all(), record["site"]
    last = [r for r in records if r["site"] == "L1.block_out"]
    exact = patch(model, batch, ["L1.block_out"], ["key", "query"])
    for a, e in zip(last, exact, strict=True):
        assert a["p_patched"] == pytest.approx(e["p_patched"], abs=ENGINE_TOL)  # both exact: ENGINE_TOL


# -- records and arguments --------------------------------------------------------------------------
def test_records_have_the_contract_fields(ar_model, ar_task):
    batch = ar_task.sample(10, seed=8)
    star = patch(
        ar_model, batch, ["all"], ["key", "value", "key+value"], method="atp-star", per_example=True, graddrop=True
    )
    atp = attribution_patch(ar_model, batch, ["all"], ["key", "value", "key+value"])
    assert len(star) == len(atp) == 7 * 2 * 3
    for a, b in zip(star, atp, strict=True):
        assert set(a) == set(b) | {"p_patched_rows", "p_clean_rows", "p_corrupt_rows", "graddrop"}
        assert (a["site"], a["hook"], a["pos"], a["n"], a["passes_filter"]) == (
            b["site"],
            b["hook"],
            b["pos"],
            b["n"],
            b["passes_filter"],
        )
        assert a["method"] == "atp-star" and 0 <= a["p_patched"] <= 1 and a["graddrop"] >= 0
        assert a["p_corrupt"] == b["p_corrupt"] and a["p_clean"] == b["p_clean"]  # the same unpatched runs
        # the mean of the rows, summed in another order: float64 round-off
        assert sum(a["p_patched_rows"]) / 10 == pytest.approx(a["p_patched"], abs=FLOAT64_SUM_TOL)
    no_graddrop = atp_star_patch(ar_model, batch, ["all"], ["key"])  # GradDrop is opt-in
    assert all(r["graddrop"] is None for r in no_graddrop)
    through_patch = patch(ar_model, batch, ["all"], ["key"], method="atp-star", graddrop=False)
    assert [r["p_patched"] for r in through_patch] == [r["p_patched"] for r in no_graddrop]
    with pytest.raises(UsageError, match="graddrop=False is an option of method 'atp-star'"):
        patch(ar_model, batch, ["all"], ["key"], method="atp", graddrop=False)


@pytest.mark.parametrize(
    ("mixers", "sites"),
    [
        ("attention", ["all", "embed", "L1.mixer.k", "L0.mixer.q"]),
        ("mamba", ["all", "embed", "L1.mixer.in_x"]),
        ("attention", ["L1.block_in", "L1.mixer_out", "L1.mlp_out"]),  # from block 1 (a cache resumes there)
    ],
)
def test_batching_and_cache_give_the_same_estimates(tmp_path, ar_task, mixers, sites):
    """From tokens the corrupt run is read off AtP*'s own gradient forward, run from the tokens
    (and Mamba's last block resumes from each chunk's contexts); from a cache it is read from the
    file, the contexts made of the whole run: the same estimates, in one chunk or many."""
    model = make_model(ar_task, mixers=mixers)
    batch = ar_task.sample(13, seed=9)
    path = write_cache(model, batch, tmp_path / "c.h5", resolve_sites(["all"], model.hook_dict))
    positions = ["key", "value", "query"]
    one = atp_star_patch(model, batch, sites, positions, max_batch=64, graddrop=True)
    chunked = atp_star_patch(model, batch, sites, positions, max_batch=4, graddrop=True)
    cached = atp_star_patch(model, path, sites, positions, max_batch=8, graddrop=True)
    assert {site for site in sites if site != "all"} <= {r["site"] for r in one}
    assert len(one) == 3 * len({r["site"] for r in one})
    for a, b, c in zip(one, chunked, cached, strict=True):
        for field in ("p_patched", "p_corrupt", "graddrop"):
            assert a[field] == pytest.approx(b[field], abs=ENGINE_TOL)  # two batchings: ENGINE_TOL
            assert a[field] == pytest.approx(c[field], abs=CACHE_TOL)  # contract: fp32 cache, CACHE_TOL


def test_verify_top_checks_graddrop_flagged_cells_first(ar_model, ar_task):
    batch = ar_task.sample(12, seed=10)
    records = atp_star_patch(ar_model, batch, ["all"], ["key", "value", "query"])
    flagged = dict(min(records, key=lambda r: abs(r["p_patched"] - r["p_corrupt"])), graddrop=1.0)
    others = [r for r in records if (r["hook"], r["pos"]) != (flagged["hook"], flagged["pos"])]
    verified = verify_top(ar_model, batch, [*others, flagged], 2)
    assert (verified[0]["hook"], verified[0]["pos"]) == (flagged["hook"], flagged["pos"])
    (reference,) = patch(ar_model, batch, [flagged["site"]], [flagged["pos"]])
    assert verified[0]["p_patched_exact"] == pytest.approx(reference["p_patched"], abs=ENGINE_TOL)
    assert verified[0]["method"] == "atp-star"


@pytest.mark.parametrize("mixers", ["mamba", "attention"])
def test_verify_top_runs_the_clean_and_corrupt_runs_once(monkeypatch, ar_task, mixers):
    """From tokens, `verify_top` patches the cells of every hook on one pair of clean and corrupt
    runs (it made them once per hook), and its exact figures are `patch`'s, hook by hook."""
    from hookmech.patching import exact as exact_module

    model = make_model(ar_task, mixers=mixers, n_layers=3)
    batch = ar_task.sample(8, seed=11)
    records = atp_star_patch(model, batch, ["L*.block_in", "L1.mixer_out"], ["key", "value", "query", "all"])
    made = []
    runs = exact_module.CleanCorruptRuns
    monkeypatch.setattr(exact_module, "CleanCorruptRuns", lambda *args, **kwargs: made.append(1) or runs(*args, **kwargs))
    verified = verify_top(model, batch, records, 9)
    assert len(made) == 1 and len({r["hook"] for r in verified}) > 2
    for record in verified:
        (reference,) = patch(model, batch, [record["hook"]], [record["pos"]])
        assert record["p_patched_exact"] == reference["p_patched"]
        assert record["attribution_exact"] == reference["attribution"]


def test_atp_star_leaves_the_parameters_as_they_were(ar_task):
    """The backward passes run with every parameter frozen (no parameter gradient computed) and
    give the estimates of a model whose parameters require none; each parameter's requires_grad is
    as it was after, an error included."""
    model = make_model(ar_task, mixers="mamba", n_layers=2)
    batch = ar_task.sample(6, seed=12)
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    wanting = atp_star_patch(model, batch, ["L*.block_in"], ["key", "all"], graddrop=True)
    assert not frozen.requires_grad and all(p.requires_grad for p in list(model.parameters())[1:])
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    none = atp_star_patch(model, batch, ["L*.block_in"], ["key", "all"], graddrop=True)
    assert [(r["p_patched"], r["graddrop"]) for r in wanting] == [(r["p_patched"], r["graddrop"]) for r in none]
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    with pytest.raises(HookmechError):
        atp_star_patch(model, batch, ["L0.block_in", "L1.mixer.nonexistent"], ["key"])
    assert all(p.requires_grad for p in model.parameters())


def test_atp_star_reads_the_mixer_projections_off_its_runs(monkeypatch, ar_task):
    """From tokens, Mamba's patch computations read in_proj's outputs of the corrupt and clean
    mixer inputs off AtP*'s own runs (`mixer_patch_reads`), projecting neither again, and give
    the estimates of computations that project them, bit for bit."""
    model = make_model(ar_task, mixers="mamba", n_layers=3)
    batch = ar_task.sample(8, seed=13)
    sites, positions = ["L*.block_in", "L1.mixer.in_x"], ["key", "value", "all"]
    found = []
    projected = MambaPatchEffects._projected
    monkeypatch.setattr(
        MambaPatchEffects, "_projected", lambda self, x, reads, rows: found.append(reads is not None) or projected(self, x, reads, rows)
    )
    read = atp_star_patch(model, batch, sites, positions)
    assert found and all(found)
    monkeypatch.setattr(type(model), "mixer_patch_reads", lambda self, layer: [])
    found.clear()
    computed = atp_star_patch(model, batch, sites, positions)
    assert found and not any(found)
    assert [r["p_patched"] for r in read] == [r["p_patched"] for r in computed]


def test_bad_arguments_are_usage_errors(ar_model, ar_task):
    batch = ar_task.sample(4, seed=0)
    for options, needle in (
        ({"metric": "log_p"}, "method 'atp-star' estimates interchange denoising of p_answer only"),
        ({"direction": "noise"}, "method 'atp-star' estimates interchange denoising of p_answer only"),
        ({"sites": ["L0.block_out+L1.mixer_in"]}, "method 'atp-star' takes plain sites"),
        ({"sites": ["L1.mixer.z[0]"]}, "method 'atp-star' takes plain sites"),
        ({"max_batch": 0}, "max_batch must be >= 1"),
    ):
        arguments = {"sites": ["L1.block_in"], **options}
        with pytest.raises(UsageError, match=needle):
            patch(ar_model, batch, arguments.pop("sites"), ["value"], method="atp-star", **arguments)
    with pytest.raises(UsageError, match="L0.mixer.filter.*no position axis"):
        atp_star_patch(make_model(ar_task, mixers="hyena"), batch, ["L0.mixer.filter"], ["value"])


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_what_patches_exactly_claims_position_patch_effects_computes(ar_task, name):
    """AtP* asks `ExactPatchEffects.patches_exactly` before its backward passes which hooks need no gradient of
    their own: for the input and every inside hook, a claimed patch gives finite effects ``[1, N,
    T]`` (the mixer's `exact_patch_effects`), any other None."""
    mixer = make_model(ar_task, mixers=name, n_layers=1, d_model=16).blocks[0].mixer
    x = torch.randn(2, 6, 16)
    grad = torch.randn(1, 2, 6, 16)
    activations = {}
    points = {local: point for local, point in mixer.named_modules() if local.startswith("hook_")}
    for local, point in points.items():
        point.add_hook(lambda act, hook, local=local: activations.setdefault(local, act.detach().clone()))
    with torch.no_grad():
        mixer(x)
    for point in points.values():
        point.remove_hooks()
    asked = {None: x + 1, **{inside_name(local): act + 1 for local, act in activations.items()}}
    assert len(asked) > 1
    exact = isinstance(mixer, ExactPatchEffects)  # without the capability: no exact patch anywhere
    for hook, patched in asked.items():
        with torch.no_grad():
            found = mixer.position_patch_effects(x, grad, patched, hook) if exact else None
        if exact and mixer.patches_exactly(hook):
            assert found is not None and found.shape == (1, 2, 6) and bool(found.isfinite().all()), hook
        else:
            assert found is None, hook


def test_a_mixer_that_claims_an_exact_patch_it_does_not_compute_is_named(ar_task):
    """AtP* takes no gradient at a hook whose patch the next mixer says it computes exactly; a mixer
    that says so without computing it (no `exact_patch_effects`) gets a HookmechError naming it,
    not a silent linear estimate with a missing gradient."""
    from hookmech.mixers.rwkv import RWKV6

    class ClaimingRWKV6(RWKV6, ExactPatchEffects):
        def patches_exactly(self, hook=None):
            return hook is None

    model = make_model(ar_task, mixers="rwkv")
    model.blocks[0].mixer.__class__ = ClaimingRWKV6
    with pytest.raises(HookmechError, match="mixer ClaimingRWKV6 computes no patch exactly"):
        atp_star_patch(model, ar_task.sample(4, seed=0), ["L0.block_in"], ["key"])


def test_context_memory_reaches_atp_star_and_changes_no_estimate(monkeypatch, ar_model, ar_task):
    """`patch(method="atp-star", context_memory=...)` bounds the resume contexts of AtP*'s corrupt
    run (it used a constant instead); 0 keeps none, which changes the path, not the numbers."""
    import hookmech.patching.atp_star as atp_star

    budgets = []
    original = atp_star.CleanCorruptRuns

    def spy(*args, **kwargs):
        budgets.append(kwargs["context_memory"])
        return original(*args, **kwargs)

    monkeypatch.setattr(atp_star, "CleanCorruptRuns", spy)
    batch = ar_task.sample(12, seed=3)
    roomy = patch(ar_model, batch, ["all"], ["key", "value"], method="atp-star")
    tight = patch(ar_model, batch, ["all"], ["key", "value"], method="atp-star", context_memory=0)
    assert budgets[-1] == 0 and budgets[-2] > 0
    for a, b in zip(roomy, tight, strict=True):
        # two paths of the last block's exact query step (kept contexts, or every position): ENGINE_TOL
        assert a["p_patched"] == pytest.approx(b["p_patched"], abs=ENGINE_TOL)


def test_mixer_memos_live_only_while_their_blocks_are_patched(monkeypatch, ar_task):
    """Each block's mixer memo (a Mamba block's base decays and states, 12 MB a row at Mamba-130m's
    shape) is dropped once no later hook reads it: at most the block being computed and the last
    two (the query step's) are alive (every block's were kept to the chunk's end, and outgrew the
    memory: 74 GB at 256 rows). Forgetting changes no estimate, bit for bit."""
    from hookmech.mixers.capabilities import PatchMemo

    model = make_model(ar_task, mixers="mamba", n_layers=6, d_model=16)
    batch = ar_task.sample(6, seed=4)
    sites = ["L*.block_in", "L2.mixer_in", "L1.mixer.in_x"]
    alive = []
    of_layer = PatchMemo.of_layer

    def counting(self, layer):
        found = of_layer(self, layer)
        alive.append((layer, set(self._by_layer)))
        return found

    monkeypatch.setattr(PatchMemo, "of_layer", counting)
    # the effects after the backward, which keep the memos (not those by the backward passes)
    monkeypatch.setattr(MambaPatchEffects, "backward_patch_effects", lambda self, *args: None)
    released = atp_star_patch(model, batch, sites, ["key", "value", "all"])
    # the hooks of block 1 (its input and in_x) and of block 2 (its input and mixer input) share a memo
    assert {layer for layer, _ in alive} == set(range(6))
    assert all(layers <= {layer, 4, 5} for layer, layers in alive), alive
    monkeypatch.setattr(PatchMemo, "forget", lambda self, layer: None)  # keep every block's to the end
    alive.clear()
    kept = atp_star_patch(model, batch, sites, ["key", "value", "all"])
    assert alive[-1][1] == set(range(6))
    assert [r["p_patched"] for r in released] == [r["p_patched"] for r in kept]


def test_atp_star_leaves_no_reference_cycle(ar_task):
    """Reference counting frees everything AtP* made when it returns: a cycle through a chunk's memo
    (its gifts' closure referred back to the estimator) kept a Mamba block's base decays and states
    (1.1 GB at Mamba-130m's shape) to the next cyclic collection, and memory grew call after call."""
    from hookmech.patching import atp_star as atp_star_module

    model = make_model(ar_task, mixers="mamba", n_layers=2)
    batch = ar_task.sample(6, seed=1)
    gc.collect()
    gc.disable()
    try:
        atp_star_patch(model, batch, ["L*.block_in"], ["key", "value"])
        left = [o for o in gc.get_objects() if type(o) in (PatchMemo, atp_star_module._Estimator)]
    finally:
        gc.enable()
    assert left == []
