"""Effective attention (`hookmech.attention_maps`): for every mixer, M applied to the mixer's
values reproduces the inside hook its docstring names, against the mixer's own forward; and the
induction score on hand-built attention patterns."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import hookmech
from hookmech import effective_attention
from hookmech.errors import HookmechError, UsageError
from hookmech.mixers import REGISTRY, SPECS, EffectiveAttentionMap
from hookmech.mixers.base import Mixer
from hookmech.oracles.mixer_cases import examples_of

from helpers import head_options, make_model

TASK = SimpleNamespace(d_vocab=20, n_ctx=20)
N_POS = 19  # more than one chunk of the chunked kernels below (chunk_size 8)


def per_head(M, values):
    """Σ_s M[b, h, t, s] values[b, s, h, :] -> [b, t, h, e]."""
    return torch.einsum("bhts,bshe->bthe", M, values)


def per_channel(M, values):
    """Σ_s M[b, d, t, s] values[b, s, d] -> [b, t, d]."""
    return torch.einsum("bdts,bsd->btd", M, values)


# mixer -> (inside hooks read, function (M, activations, mixer) -> (from M, the hook's own value))
RECONSTRUCTIONS = {
    "attention": (("v", "z"), lambda M, a, mixer: (per_head(M, a["v"]), a["z"])),
    # hook_y = M u + D ⊙ u; D is zeroed (`SKIP_FREE`) so that hook_y is the SSM part alone
    "mamba": (("conv_act", "y"), lambda M, a, mixer: (per_channel(M, a["conv_act"]) + mixer.D * a["conv_act"], a["y"])),
    "mamba2": (("conv_act", "y"),
               lambda M, a, mixer: (per_head(M, a["conv_act"]) + mixer.D[:, None] * a["conv_act"], a["y"])),
    "deltanet": (("v", "y"), lambda M, a, mixer: (per_head(M, a["v"]), a["y"])),
    "rwkv": (("v", "output"), lambda M, a, mixer: (per_head(M, a["v"]), a["output"])),
    "based": (("v", "y"), lambda M, a, mixer: (per_head(M, a["v"]), a["y"])),
    "h3": (("q", "v", "ssm"),
           lambda M, a, mixer: (per_head(M, a["v"]), torch.einsum("bthi,bthij->bthj", a["q"], a["ssm"]))),
    "hyena": (("v", "y"), lambda M, a, mixer: (per_channel(M, a["v"]), a["y"])),
    # the short convolution's bias is not a function of u: M u = hook_conv ⊙ hook_proj - bias ⊙ hook_proj
    "baseconv": (("proj", "conv"), lambda M, a, mixer: (
        per_channel(M, a["mixer_in"]), (a["conv"] - (0.0 if mixer.long else mixer.conv.bias)) * a["proj"])),
}

# Mixers whose M leaves out a skip D ⊙ u that their hook includes. At init the skip (D = 1)
# outweighs the SSM part by 10^3-10^4, so hook_y would check M on its last digits only, and
# hook_y - D ⊙ u in float32 cancels most of them: the test zeroes D. (M does not read D.)
SKIP_FREE = ("mamba", "mamba2")

CASES = [
    ("attention", {"n_heads": 2}),
    ("attention", {"n_heads": 2, "rotary_pct": 0.5}),  # Pythia's: rotary q and k
    ("attention", {"n_heads": 2, "window": 3, "qkv_conv": "qk"}),
    ("mamba", {}),
    ("mamba", {"gate": False, "d_conv": 0, "dt_min": 0.1, "dt_max": 1.0}),  # larger steps: real decay
    ("mamba2", {"headdim": 8, "chunk_size": 8}),
    ("mamba2", {"headdim": 8, "chunk_size": 8, "dt_min": 0.1, "dt_max": 1.0}),
    ("mamba2", {"headdim": 4, "ngroups": 2, "d_state": 8, "chunk_size": 8}),
    ("deltanet", {"num_heads": 2, "chunk_size": 8}),
    ("deltanet", {"num_heads": 2, "use_beta": False, "conv_size": 0, "mode": "recurrent"}),
    ("rwkv", {"head_size": 8, "chunk_size": 8}),
    ("based", {"num_heads": 2, "num_key_value_heads": 2}),
    ("based", {"train_view": "linear", "chunk_size": 8}),
    ("h3", {}),
    ("hyena", {}),
    ("hyena", {"bias": True, "conv_bias_init": "torch"}),
    ("baseconv", {"conv_bias_init": "torch"}),
    ("baseconv", {"kernel_size": -1}),
    ("baseconv", {"kernel_size": -1, "implicit_long_conv": False}),
]




def spec_reconstruction(values: str, output: str, per):
    """A mixer's `MixerSpec.attention_values`: M applied to hook `values` is hook `output`."""
    return (values, output), lambda M, a, mixer: (per(M, a[values]), a[output])


# a mixer added after the nine above is checked by what its spec states, with its examples' options
# and heads (a test below requires every mixer with a map here)
for _name, _spec in sorted(SPECS.items()):
    if _name not in RECONSTRUCTIONS and _spec.attention_values is not None:
        _per = per_head if _spec.mixer.attention_axis == "head" else per_channel
        RECONSTRUCTIONS[_name] = spec_reconstruction(*_spec.attention_values, _per)
        CASES += [(_name, {**options, **head_options(_name)}) for options in examples_of(_name)]


def test_every_mixer_with_a_map_is_checked():
    for name, cls in REGISTRY.items():
        if issubclass(cls, EffectiveAttentionMap):
            assert name in RECONSTRUCTIONS and any(mixer == name for mixer, _ in CASES), (
                f"{name}: give its spec attention_values (hookmech/mixers/mixer_spec.py)"
            )


def relative_error(approx, exact):
    approx, exact = approx.double(), exact.double()
    return ((approx - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-7)])
@pytest.mark.parametrize("mixer, options", CASES, ids=[f"{m}-{'-'.join(map(str, o.values())) or 'default'}" for m, o in CASES])
def test_effective_attention_reproduces_the_named_hook(mixer, options, dtype, tolerance):
    model = make_model(TASK, mixers=mixer, d_model=16, layer_options=[options] * 2).to(dtype)
    if mixer in SKIP_FREE:
        with torch.no_grad():
            for block in model.blocks:
                block.mixer.D.zero_()
    tokens = torch.randint(0, TASK.d_vocab, (3, N_POS))
    hooks, reconstruct = RECONSTRUCTIONS[mixer]
    _, cache = model.run_with_cache(tokens)
    maps = hookmech.attention_maps(model, tokens, summary=None)
    for layer, block in enumerate(model.blocks):
        M = maps[layer]
        assert M.dtype == torch.float32 and M.shape[0] == 3 and M.shape[2:] == (N_POS, N_POS)
        assert torch.all(M.triu(1) == 0), "M must be causal"
        acts = {name: cache[f"blocks.{layer}.mixer.hook_{name}"].double() for name in hooks}
        acts["mixer_in"] = cache[f"blocks.{layer}.hook_mixer_in"].double()
        from_M, hooked = reconstruct(M.double(), acts, block.mixer)
        assert relative_error(from_M, hooked) <= tolerance


def test_summary_mean_averages_channels_and_keeps_heads():
    tokens = torch.randint(0, TASK.d_vocab, (2, 10))
    mamba = make_model(TASK, mixers="mamba", d_model=16)
    whole, mean = hookmech.attention_maps(mamba, tokens, summary=None), hookmech.attention_maps(mamba, tokens)
    assert whole[0].shape == (2, 32, 10, 10) and mean[0].shape == (2, 1, 10, 10)
    torch.testing.assert_close(mean[0], whole[0].mean(dim=1, keepdim=True))
    attention = make_model(TASK, d_model=16, n_heads=2)
    mean = hookmech.attention_maps(attention, tokens)
    assert mean[1].shape == (2, 2, 10, 10)
    torch.testing.assert_close(mean[1], hookmech.attention_maps(attention, tokens, summary=None)[1])


def test_per_channel_maps_refused_above_the_size_limit(monkeypatch):
    monkeypatch.setattr(effective_attention, "MAX_CHANNEL_ELEMENTS", 1000)
    model = make_model(TASK, mixers="hyena", d_model=16)
    tokens = torch.randint(0, TASK.d_vocab, (2, 10))
    with pytest.raises(HookmechError, match=r"2 rows × 16 channels × 10² positions = 3,200 elements.*summary='mean'"):
        hookmech.attention_maps(model, tokens, summary=None)
    assert hookmech.attention_maps(model, tokens)[0].shape == (2, 1, 10, 10)  # the mean is not limited


def test_errors():
    model = make_model(TASK, d_model=16)
    with pytest.raises(UsageError, match="summary must be 'mean' or None"):
        hookmech.attention_maps(model, torch.zeros(1, 4, dtype=torch.long), summary="max")

    class Plain(Mixer):
        def forward(self, x):
            return x

    with pytest.raises(HookmechError, match="Plain does not define effective_attention"):
        Plain().effective_attention(torch.zeros(1, 3, 4))
    act = make_model(TASK, mixers="baseconv", d_model=16, layer_options=[{"use_act": True}] * 2)
    with pytest.raises(HookmechError, match="use_act=True has no effective attention"):
        hookmech.attention_maps(act, torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(UsageError, match="seq_len must be"):
        hookmech.induction_scores(model, random_repeat=True, seq_len=11)  # 2 * 11 > n_ctx 20


def test_lazy_export_survives_importing_the_module():
    import hookmech.effective_attention  # a submodule import must not shadow the function

    assert hookmech.attention_maps is effective_attention.attention_maps
    assert hookmech.induction_scores is effective_attention.induction_scores


# -- induction scores on random repeated tokens (the task's documents: tests/test_rough_edges.py) --
SEQ_LEN = 8


def hand_built_attention(prefix_matching: bool) -> hookmech.HookedLM:
    """A 2-layer attention model (d_model 32, n_ctx 16) whose layer 1 reads positions only:
    token embeddings and layer 0's outputs are zero, position p's embedding is e_p (a row of a
    Hadamard matrix: mean 0, variance 1, so LayerNorm leaves it alone, and e_p · e_q = 32 [p = q]).
    Layer 1's query is α e_t and its key K e_s = e_{s + SEQ_LEN - 1}: the score is α √32 exactly
    where s = t - SEQ_LEN + 1, the prefix-matching target in a sequence repeated with period
    SEQ_LEN (α = 10: weight 1 - O(t e^-56)). Without `prefix_matching` the query is 0: uniform."""
    model = make_model(SimpleNamespace(d_vocab=20, n_ctx=2 * SEQ_LEN), d_model=32)
    hadamard = torch.ones(1, 1)
    while len(hadamard) < 32:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)])
    positions = hadamard[1 : 2 * SEQ_LEN + 1]  # row 0 is constant: LayerNorm would zero it
    shift = sum(torch.outer(positions[p + SEQ_LEN - 1], positions[p]) for p in range(SEQ_LEN + 1)) / 32
    with torch.no_grad():
        model.embed.weight.zero_()
        model.pos_embed.weight.copy_(positions)
        for module in (model.blocks[0].mixer.out_proj, model.blocks[0].mlp.fc2):
            module.weight.zero_()
            module.bias.zero_()
        Wqkv = model.blocks[1].mixer.Wqkv
        Wqkv.bias.zero_()
        Wqkv.weight[:32] = 10 * torch.eye(32) if prefix_matching else 0.0
        Wqkv.weight[32:64] = shift
    return model


def test_prefix_matching_head_scores_one():
    scores = hookmech.induction_scores(hand_built_attention(True), random_repeat=True, seq_len=SEQ_LEN, rows=3)
    assert scores[1]["prefix_matching"].shape == (1,)
    assert scores[1]["prefix_matching"].item() == pytest.approx(1.0, abs=1e-6)


def test_uniform_pattern_scores_the_mean_of_one_over_t():
    scores = hookmech.induction_scores(hand_built_attention(False), random_repeat=True, seq_len=SEQ_LEN, rows=3)
    # query t (0-based) spreads 1 / (t + 1) over its keys; the second half is t = 8 .. 15
    expected = sum(1 / (t + 1) for t in range(SEQ_LEN, 2 * SEQ_LEN)) / SEQ_LEN
    assert expected == pytest.approx((1 / 9 + 1 / 10 + 1 / 11 + 1 / 12 + 1 / 13 + 1 / 14 + 1 / 15 + 1 / 16) / 8)
    assert scores[1]["prefix_matching"].item() == pytest.approx(expected, rel=1e-6)


def test_induction_tokens_repeat_distinct_tokens_deterministically():
    tokens = effective_attention.repeated_tokens(d_vocab=20, seq_len=8, batch=4, seed=3)
    assert tokens.shape == (4, 16) and torch.equal(tokens[:, :8], tokens[:, 8:])
    assert all(len(set(row[:8].tolist())) == 8 for row in tokens)
    assert torch.equal(tokens, effective_attention.repeated_tokens(20, 8, 4, seed=3))
    assert not torch.equal(tokens, effective_attention.repeated_tokens(20, 8, 4, seed=4))
    model = make_model(TASK, mixers="mamba", d_model=16)
    first = hookmech.induction_scores(model, random_repeat=True, rows=2)
    again = hookmech.induction_scores(model, random_repeat=True, rows=2)
    assert first[0]["prefix_matching"].shape == (1,) and torch.equal(first[0]["prefix_matching"], again[0]["prefix_matching"])
    assert not math.isnan(first[1]["prefix_matching"].item())
