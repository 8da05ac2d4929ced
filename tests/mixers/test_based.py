"""Based linear attention: views agree with a sequential loop, causality, hooks, state patching.

Tolerances (float64): two formulations of one computation (quadratic, linear and sequential
views; hooked vs unhooked forward; the Taylor feature map vs its closed form) agree to 1e-10..1e-12,
float64 round-off over a few dozen terms; hand recurrences of a patched state use torch's float64
defaults (rtol 1e-7), and what a patch cannot reach is compared exactly.
"""
from __future__ import annotations

import math

import pytest
import torch

from hookmech.config import build_config
from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY, SPECS
from hookmech.mixers import based as based_module
from hookmech.mixers.based import Based, TaylorExp
from hookmech.model import HookedLM

from helpers import assert_causal, assert_state_edit_propagates, first_edits

D_MODEL = 32


def make_based(**kwargs) -> Based:
    torch.manual_seed(0)
    mixer = REGISTRY["based"](d_model=D_MODEL, **kwargs).double()
    # larger weights than the backbone's 0.02 init, so that every term of phi matters
    for param in mixer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return mixer


def sequential_based(mixer: Based, x: torch.Tensor) -> torch.Tensor:
    """Reference: the recurrence y_t = phi(q_t)ᵀ S_t / phi(q_t)ᵀ z_t, one position at a time,
    with phi written out as 1 + qᵀk/√d + (qᵀk)²/(2d) via explicit feature lists."""
    batch, n_pos, _ = x.shape
    heads, d_feat, d_head = mixer.num_heads, mixer.feature_dim, mixer.d_head
    q = (x @ mixer.proj_q.weight.T).view(batch, n_pos, heads, d_feat)
    k = (x @ mixer.proj_k.weight.T).view(batch, n_pos, heads, d_feat)
    v = (x @ mixer.proj_v.weight.T).view(batch, n_pos, heads, d_head)

    def phi(vec: torch.Tensor) -> torch.Tensor:
        terms = [torch.ones_like(vec[..., :1])]
        terms += [vec[..., i : i + 1] / d_feat**0.25 for i in range(d_feat)]
        terms += [vec[..., i : i + 1] * vec[..., j : j + 1] / math.sqrt(2 * d_feat)
                  for i in range(d_feat) for j in range(d_feat)]
        return torch.cat(terms, dim=-1)

    n_feat = 1 + d_feat + d_feat**2
    kv_state = x.new_zeros(batch, heads, n_feat, d_head)
    k_state = x.new_zeros(batch, heads, n_feat)
    ys = []
    for t in range(n_pos):
        phi_k, phi_q = phi(k[:, t]), phi(q[:, t])
        kv_state = kv_state + phi_k.unsqueeze(-1) * v[:, t].unsqueeze(-2)
        k_state = k_state + phi_k
        num = torch.einsum("bhf,bhfd->bhd", phi_q, kv_state)
        den = torch.einsum("bhf,bhf->bh", phi_q, k_state)
        ys.append(num / (den.unsqueeze(-1) + mixer.eps))
    y = torch.stack(ys, dim=1).reshape(batch, n_pos, -1)
    return y @ mixer.out_proj.weight.T


def test_taylor_feature_map_approximates_exp_kernel():
    torch.manual_seed(0)
    d = 8
    fmap = TaylorExp(d)
    q, k = torch.randn(5, d, dtype=torch.float64), torch.randn(5, d, dtype=torch.float64)
    dot = (q * k).sum(-1)
    expected = 1 + dot / math.sqrt(d) + dot**2 / (2 * d)
    assert fmap(q).shape == (5, 1 + d + d * d)
    torch.testing.assert_close((fmap(q) * fmap(k)).sum(-1), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_heads", [1, 2])
def test_output_shape_and_defaults(num_heads):
    mixer = REGISTRY["based"](d_model=D_MODEL, num_heads=num_heads, num_key_value_heads=num_heads)
    assert mixer(torch.randn(3, 7, D_MODEL)).shape == (3, 7, D_MODEL)
    default = REGISTRY["based"](d_model=64)
    assert (default.feature_dim, default.num_heads, default.train_view) == (8, 1, "quadratic")
    spec = SPECS["based"]
    assert spec.block_norm == "layernorm" and spec.block_mlp and spec.default_pos_emb == "none"


@pytest.mark.parametrize("train_view", ["quadratic", "linear"])
def test_gradients_reach_every_parameter(train_view):
    mixer = make_based(train_view=train_view, chunk_size=4)
    mixer(torch.randn(2, 9, D_MODEL, dtype=torch.float64)).square().sum().backward()
    for name, param in mixer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("num_heads", [1, 2])
@pytest.mark.parametrize("train_view", ["quadratic", "linear"])
def test_views_match_sequential_reference(train_view, num_heads):
    mixer = make_based(train_view=train_view, num_heads=num_heads, num_key_value_heads=num_heads, chunk_size=4)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(mixer(x), sequential_based(mixer, x), rtol=1e-10, atol=1e-10)


def test_recurrent_state_path_matches_quadratic_view():
    mixer = make_based()
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    expected = mixer(x)
    cached = {}
    mixer.hook_kv_state.add_hook(lambda act, hook: cached.setdefault("kv", act))
    assert mixer.hook_kv_state.is_active
    got = mixer(x)
    mixer.hook_kv_state.remove_hooks()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert cached["kv"].shape == (2, 11, 1, 73, D_MODEL)


@pytest.mark.parametrize("path", ["quadratic", "linear", "state_hook"])
def test_causal(path):
    mixer = make_based(train_view="linear" if path == "linear" else "quadratic", chunk_size=3)
    if path == "state_hook":
        mixer.hook_kv_state.add_hook(lambda act, hook: act)
    assert_causal(mixer, D_MODEL)


def test_inside_hooks_fire_in_model_with_documented_shapes():
    cfg = build_config(d_vocab=16, n_ctx=12, mixers="based", n_layers=2, d_model=D_MODEL)
    model = HookedLM(cfg)
    tokens = torch.randint(0, 16, (3, 12))
    _, cache = model.run_with_cache(tokens)
    n_feat = 1 + 8 + 64
    expected = {
        "q": (3, 12, 1, 8), "k": (3, 12, 1, 8), "v": (3, 12, 1, D_MODEL),
        "phi_q": (3, 12, 1, n_feat), "phi_k": (3, 12, 1, n_feat),
        "kv_state": (3, 12, 1, n_feat, D_MODEL), "k_state": (3, 12, 1, n_feat),
        "y": (3, 12, 1, D_MODEL),
    }
    for layer in range(2):
        for name, shape in expected.items():
            hook = model.hook_dict[f"blocks.{layer}.mixer.hook_{name}"]
            assert tuple(cache[f"blocks.{layer}.mixer.hook_{name}"].shape) == shape, name
            assert len(hook.axes.split()) == len(shape) and hook.pos_axis == 1
    assert cfg.mlp == (True, True) and cfg.norms == ("layernorm", "layernorm")


def test_state_not_materialised_without_hook(monkeypatch):
    calls = []
    real = based_module.propagate_additive
    monkeypatch.setattr(based_module, "propagate_additive", lambda *a: calls.append(1) or real(*a))
    mixer = make_based()
    x = torch.randn(1, 5, D_MODEL, dtype=torch.float64)
    mixer(x)
    assert calls == []
    mixer.hook_k_state.add_hook(lambda act, hook: act)
    mixer(x)
    assert len(calls) == 2


def _model_and_inputs():
    cfg = build_config(d_vocab=16, n_ctx=12, mixers="based", n_layers=1, d_model=D_MODEL)
    torch.manual_seed(1)
    model = HookedLM(cfg).double()
    for param in model.blocks[0].mixer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return model, torch.randint(0, 16, (2, 12))


@pytest.mark.parametrize("in_place", [False, True])
def test_kv_state_patch_propagates_to_later_positions(in_place):
    model, tokens = _model_and_inputs()
    mixer = model.blocks[0].mixer
    # row 0 edited at position 3 and again at 7 (the later edit wins from 7 on); row 1 at 5
    edits = {(0, 3): torch.randn(1, 73, D_MODEL), (0, 7): torch.randn(1, 73, D_MODEL),
             (1, 5): torch.randn(1, 73, D_MODEL)}
    edits = {key: value.double() for key, value in edits.items()}

    def reference(cache, edits):
        phi_q, phi_k, v = (cache[f"blocks.0.mixer.hook_{n}"] for n in ("phi_q", "phi_k", "v"))
        k_state, y = cache["blocks.0.mixer.hook_k_state"], cache["blocks.0.mixer.hook_y"].clone()
        for row, first in first_edits(edits).items():
            state = None
            for t in range(first, 12):
                if (row, t) in edits:
                    state = edits[(row, t)]
                else:
                    state = state + phi_k[row, t].unsqueeze(-1) * v[row, t].unsqueeze(-2)
                num = torch.einsum("hf,hfd->hd", phi_q[row, t], state)
                den = torch.einsum("hf,hf->h", phi_q[row, t], k_state[row, t])
                y[row, t] = num / (den.unsqueeze(-1) + mixer.eps)
        return y

    # TransformerLens hooks often edit in place and return None: both must propagate
    assert_state_edit_propagates(model, tokens, "blocks.0.mixer.hook_kv_state", "blocks.0.mixer.hook_y", edits,
                                 reference, style="in_place" if in_place else "copy")


def test_k_state_patch_propagates_to_later_positions():
    model, tokens = _model_and_inputs()
    mixer = model.blocks[0].mixer
    p = 4
    new_state = torch.rand(2, 1, 73, dtype=torch.float64) * 10

    def reference(cache, edits):
        phi_q, phi_k = cache["blocks.0.mixer.hook_phi_q"], cache["blocks.0.mixer.hook_phi_k"]
        kv_state, y = cache["blocks.0.mixer.hook_kv_state"], cache["blocks.0.mixer.hook_y"].clone()
        z = new_state
        for t in range(p, 12):
            if t > p:
                z = z + phi_k[:, t]
            num = torch.einsum("bhf,bhfd->bhd", phi_q[:, t], kv_state[:, t])
            den = torch.einsum("bhf,bhf->bh", phi_q[:, t], z)
            y[:, t] = num / (den.unsqueeze(-1) + mixer.eps)
        return y

    assert_state_edit_propagates(model, tokens, "blocks.0.mixer.hook_k_state", "blocks.0.mixer.hook_y",
                                 {(0, p): new_state[0], (1, p): new_state[1]}, reference, style="copy")


@pytest.mark.parametrize("options", [
    {"train_view": "cubic"}, {"feature_name": "performer"}, {"num_heads": 3},
    {"num_heads": 2, "num_key_value_heads": 1}, {"feature_dim": 0}, {"chunk_size": 0}, {"eps": -1.0},
])
def test_invalid_options_raise_usage_error(options):
    with pytest.raises(UsageError, match="based"):
        REGISTRY["based"](d_model=D_MODEL, **options)
