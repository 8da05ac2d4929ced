"""DeltaNet: chunked form vs recurrence vs explicit matrices, causality, hooks, state patching.

Tolerances (float64): the recurrence vs explicit matrices 1e-12, the chunked form (a triangular
solve per chunk) vs either 1e-10, float64 round-off; hand-computed small cases and hand recurrences
of a patched state use torch's float64 defaults (rtol 1e-7), and unpatched prefixes 1e-12.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from hookmech.config import build_config
from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY, SPECS
from hookmech.mixers import deltanet as deltanet_module
from hookmech.mixers.deltanet import DeltaNet, delta_rule_chunked, delta_rule_recurrent, delta_rule_states
from hookmech.model import HookedLM

from helpers import assert_causal, assert_state_edit_propagates, first_edits

D_MODEL = 16


def make_deltanet(**kwargs) -> DeltaNet:
    torch.manual_seed(0)
    mixer = REGISTRY["deltanet"](d_model=D_MODEL, **kwargs).double()
    for name, param in mixer.named_parameters():
        if "o_norm" not in name:
            torch.nn.init.normal_(param, std=0.4)
    return mixer


def random_qkvb(batch=2, n_pos=13, heads=2, d_head=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(batch, n_pos, heads, d_head, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(batch, n_pos, heads, d_head, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, n_pos, heads, generator=gen, dtype=torch.float64)
    return q, k, v, beta


def explicit_delta_rule(q, k, v, beta):
    """Reference with explicit matrices: S_t = S_{t-1} (I - beta k kᵀ) + beta v kᵀ, o_t = S_t q_t."""
    batch, n_pos, heads, d_k = k.shape
    eye = torch.eye(d_k, dtype=k.dtype)
    out = torch.zeros(batch, n_pos, heads, v.shape[-1], dtype=k.dtype)
    for b in range(batch):
        for h in range(heads):
            state = torch.zeros(v.shape[-1], d_k, dtype=k.dtype)
            for t in range(n_pos):
                kt, vt, bt = k[b, t, h], v[b, t, h], beta[b, t, h]
                state = state @ (eye - bt * torch.outer(kt, kt)) + bt * torch.outer(vt, kt)
                out[b, t, h] = state @ q[b, t, h]
    return out


def test_delta_rule_hand_computed_overwrite():
    # beta = 1 and orthonormal keys: the state is an exact key -> value memory, and writing
    # a key again replaces its value (the delta rule's point) instead of adding to it.
    e = torch.eye(3, dtype=torch.float64)
    k = torch.stack([e[0], e[1], e[0]]).view(1, 3, 1, 3)
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64).view(1, 3, 1, 3)
    q = torch.stack([e[0], e[0], e[0]]).view(1, 3, 1, 3)
    beta = torch.ones(1, 3, 1, dtype=torch.float64)
    for out, state in (delta_rule_recurrent(q, k, v, beta), delta_rule_chunked(q, k, v, beta, chunk_size=2)):
        torch.testing.assert_close(out[0, :, 0], torch.tensor([[1.0, 2, 3], [1, 2, 3], [7, 8, 9]], dtype=torch.float64))
        expected_state = torch.zeros(3, 3, dtype=torch.float64)
        expected_state[:, 0] = torch.tensor([7.0, 8, 9])
        expected_state[:, 1] = torch.tensor([4.0, 5, 6])
        torch.testing.assert_close(state[0, 0], expected_state)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 64])
def test_chunked_and_recurrent_match_explicit_matrices(chunk_size):
    q, k, v, beta = random_qkvb()
    expected = explicit_delta_rule(q, k, v, beta)
    recurrent_out, recurrent_state = delta_rule_recurrent(q, k, v, beta)
    chunked_out, chunked_state = delta_rule_chunked(q, k, v, beta, chunk_size)
    _, all_states = delta_rule_chunked(q, k, v, beta, chunk_size, return_states=True)
    torch.testing.assert_close(recurrent_out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked_out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(chunked_state, recurrent_state, rtol=1e-10, atol=1e-10)
    assert all_states.shape == (2, 13, 2, 5, 5)
    torch.testing.assert_close(all_states[:, -1], recurrent_state, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.einsum("bthvk,bthk->bthv", all_states, q), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [4, 5, 13, 16])
def test_chunked_keeps_the_state_after_each_whole_chunk(chunk_size):
    """``return_states="chunks"`` (the engine's base runs): the recurrence's states after positions
    chunk_size - 1, 2 chunk_size - 1, ... (none for a run shorter than a chunk), outputs unchanged."""
    q, k, v, beta = random_qkvb()
    n_pos = k.shape[1]
    expected = explicit_delta_rule(q, k, v, beta)
    out, kept = delta_rule_chunked(q, k, v, beta, chunk_size, return_states="chunks")
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    assert kept.shape == (k.shape[0], n_pos // chunk_size, k.shape[2], v.shape[-1], k.shape[-1])
    for index in range(n_pos // chunk_size):  # the sequential recurrence up to the chunk's last position
        end = (index + 1) * chunk_size
        want = delta_rule_recurrent(q[:, :end], k[:, :end], v[:, :end], beta[:, :end])[1]
        torch.testing.assert_close(kept[:, index], want, rtol=1e-10, atol=1e-10)


def test_chunked_continues_from_an_initial_state():
    q, k, v, beta = random_qkvb()
    initial = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    expected_out, expected_state = delta_rule_recurrent(q, k, v, beta, initial_state=initial)
    out, states = delta_rule_chunked(q, k, v, beta, 4, return_states=True, initial_state=initial)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(states[:, -1], expected_state, rtol=1e-10, atol=1e-10)
    # the in-place states (runs without autograd) are the chunked form's
    torch.testing.assert_close(delta_rule_states(q, k, v, beta, initial), states, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(delta_rule_states(q, k, v, beta)[:, -1], delta_rule_recurrent(q, k, v, beta)[1],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_heads", [1, 2])
def test_mixer_modes_agree(num_heads):
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    chunked = make_deltanet(num_heads=num_heads, chunk_size=4)(x)
    recurrent = make_deltanet(num_heads=num_heads, mode="recurrent")(x)
    torch.testing.assert_close(chunked, recurrent, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("options", [{}, {"num_heads": 2}, {"conv_size": 0, "output_norm": False}])
def test_output_shape(options):
    mixer = REGISTRY["deltanet"](d_model=D_MODEL, **options)
    assert mixer(torch.randn(3, 7, D_MODEL)).shape == (3, 7, D_MODEL)


def test_defaults():
    mixer = REGISTRY["deltanet"](d_model=64)
    assert (mixer.num_heads, mixer.conv_size) == (1, 4)
    assert mixer.q_conv1d.weight.shape == (64, 1, 4) and mixer.q_conv1d.bias is None
    assert isinstance(mixer.o_norm, torch.nn.RMSNorm)
    spec = SPECS["deltanet"]
    assert spec.block_norm == "layernorm" and spec.block_mlp and spec.default_pos_emb == "none"


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gradients_reach_every_parameter(mode):
    mixer = make_deltanet(mode=mode, num_heads=2, conv_bias=True, chunk_size=4)
    mixer(torch.randn(2, 9, D_MODEL, dtype=torch.float64)).square().sum().backward()
    for name, param in mixer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("path", ["chunk", "recurrent", "state_hook"])
def test_causal(path):
    mixer = make_deltanet(mode="recurrent" if path == "recurrent" else "chunk", chunk_size=3)
    if path == "state_hook":
        mixer.hook_state.add_hook(lambda act, hook: act)
    assert_causal(mixer, D_MODEL)


def test_state_hook_path_matches_fast_path():
    mixer = make_deltanet(chunk_size=4)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    expected = mixer(x)
    mixer.hook_state.add_hook(lambda act, hook: act)
    torch.testing.assert_close(mixer(x), expected, rtol=1e-10, atol=1e-10)


def test_inside_hooks_fire_in_model_with_documented_shapes():
    cfg = build_config(d_vocab=16, n_ctx=12, mixers="deltanet", n_layers=2, d_model=D_MODEL,
                       layer_options=[{"num_heads": 2}, {}])
    model = HookedLM(cfg)
    tokens = torch.randint(0, 16, (3, 12))
    _, cache = model.run_with_cache(tokens)
    for layer, heads in ((0, 2), (1, 1)):
        d_head = D_MODEL // heads
        expected = {
            "q": (3, 12, heads, d_head), "k": (3, 12, heads, d_head), "v": (3, 12, heads, d_head),
            "beta": (3, 12, heads), "state": (3, 12, heads, d_head, d_head), "y": (3, 12, heads, d_head),
        }
        for name, shape in expected.items():
            hook = model.hook_dict[f"blocks.{layer}.mixer.hook_{name}"]
            assert tuple(cache[f"blocks.{layer}.mixer.hook_{name}"].shape) == shape, name
            assert len(hook.axes.split()) == len(shape) and hook.pos_axis == 1
    # q and k are L2-normalised (slightly below 1: the norm adds 1e-6 to |k|², as fla does)
    norms = cache["blocks.0.mixer.hook_k"].norm(dim=-1)
    assert (norms <= 1).all() and (norms > 0.98).all()
    assert cfg.mlp == (True, True) and cfg.norms == ("layernorm", "layernorm")


def test_state_not_materialised_without_hook(monkeypatch):
    calls = []
    real = deltanet_module.delta_rule_chunked
    monkeypatch.setattr(deltanet_module, "delta_rule_chunked",
                        lambda *a, **kw: calls.append(kw.get("return_states", False)) or real(*a, **kw))
    mixer = make_deltanet()
    x = torch.randn(1, 5, D_MODEL, dtype=torch.float64)
    mixer(x)
    assert calls == [False]
    mixer.hook_state.add_hook(lambda act, hook: act)
    mixer(x)
    assert calls == [False, True]


@pytest.mark.parametrize("in_place", [False, True])
def test_state_patch_propagates_to_later_positions(in_place):
    cfg = build_config(d_vocab=16, n_ctx=12, mixers="deltanet", n_layers=1, d_model=D_MODEL)
    torch.manual_seed(1)
    model = HookedLM(cfg).double()
    tokens = torch.randint(0, 16, (2, 12))
    # row 0 edited at 3 and again at 8 (the later edit wins from 8 on); row 1 at 6
    gen = torch.Generator().manual_seed(2)
    edits = {key: torch.randn(1, D_MODEL, D_MODEL, generator=gen, dtype=torch.float64)
             for key in ((0, 3), (0, 8), (1, 6))}
    eye = torch.eye(D_MODEL, dtype=torch.float64)

    def reference(cache, edits):
        q, k, v, beta = (cache[f"blocks.0.mixer.hook_{n}"] for n in ("q", "k", "v", "beta"))
        y = cache["blocks.0.mixer.hook_y"].clone()
        for row, first in first_edits(edits).items():
            state = None
            for t in range(first, 12):
                if (row, t) in edits:
                    state = edits[(row, t)][0]
                else:
                    kt, vt, bt = k[row, t, 0], v[row, t, 0], beta[row, t, 0]
                    state = state @ (eye - bt * torch.outer(kt, kt)) + bt * torch.outer(vt, kt)
                y[row, t, 0] = state @ q[row, t, 0]
        return y

    # TransformerLens hooks often edit in place and return None: both must propagate. Row 1's
    # prefix is recomputed from row 0's first edit on (round-off, 3e-18 measured).
    assert_state_edit_propagates(model, tokens, "blocks.0.mixer.hook_state", "blocks.0.mixer.hook_y", edits, reference,
                                 style="in_place" if in_place else "copy", prefix_atol=1e-12)


@pytest.mark.parametrize("options", [
    {"num_heads": 3}, {"conv_size": -1}, {"mode": "fused"}, {"chunk_size": 0},
])
def test_invalid_options_raise_usage_error(options):
    with pytest.raises(UsageError, match="deltanet"):
        REGISTRY["deltanet"](d_model=D_MODEL, **options)
