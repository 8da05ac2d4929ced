"""transformers' Mamba2ForCausalLM folders loaded into hookmech (`hookmech.pretrained.mamba2`):
several heads in two groups of B/C, the gated RMSNorm, the time-step clamp, biases, lengths that
are and are not multiples of the chunk size (transformers pads to one; hookmech splits into equal
chunks). The logits and every block's residual equal transformers' pure-torch forward; the hook
names are TransformerLens's, with its Mamba-2 bridge's values; the last state is transformers'
cached one; the engine agrees with the plain loop on the loaded model; bad configs get one line.
Tolerance: `PARITY_TOL` (issue 47's 1e-5)."""
from __future__ import annotations

import json
import math

import pytest
import torch

import hookmech
from hookmech.errors import HookmechError
from hookmech.mixers.mamba2 import GatedRMSNorm
from hookmech.oracles import plain_loop_patch
from hookmech.patching import patch
from hookmech.pretrained import mamba2

from helpers import ENGINE_TOL
from ssm_folders import PARITY_TOL, load, mamba2_folder, transformers_run

transformers = pytest.importorskip("transformers")

#: the defaults of `mamba2_folder` (8 heads, 2 groups, chunks of 8), and every option that changes
#: the mapping: 4 groups, biases, no conv bias, another kernel, a tied head, Δ clamped on both sides,
#: another norm epsilon (the gated norm's too)
OPTIONS = {
    "two-groups": {},
    "options": {
        "n_groups": 4,
        "use_bias": True,
        "use_conv_bias": False,
        "conv_kernel": 3,
        "tie_word_embeddings": True,
        "time_step_limit": (0.05, 0.5),
        "layer_norm_epsilon": 1e-2,
    },
}


@pytest.fixture(scope="module", params=list(OPTIONS))
def loaded(request, tmp_path_factory):
    """(hookmech's model, transformers' model) of one folder."""
    folder, theirs = mamba2_folder(tmp_path_factory.mktemp("mamba2"), **OPTIONS[request.param])
    return load(folder), theirs


@pytest.mark.parametrize(("batch", "n_pos"), [(1, 1), (3, 5), (2, 8), (1, 16), (3, 21)])
def test_logits_equal_transformers_at_lengths_on_and_off_the_chunk_size(loaded, batch, n_pos):
    ours, theirs = loaded
    assert theirs.config.chunk_size == ours.blocks[0].mixer.chunk_size == 8
    tokens = torch.randint(0, ours.cfg.d_vocab, (batch, n_pos), generator=torch.Generator().manual_seed(n_pos))
    expected, _ = transformers_run(theirs, tokens)
    with torch.no_grad():
        logits = ours(tokens)
    assert expected.abs().max() > 1  # logits of a size where 1e-5 says something
    torch.testing.assert_close(logits, expected, rtol=0, atol=PARITY_TOL)


def test_each_blocks_residual_equals_transformers_hidden_states(loaded):
    """transformers 5's Mamba2Model returns n_layers + 1 hidden states: the embedding, each block's
    output but the last, then the final norm's output (Mamba's differ: `test_mamba_folders`)."""
    ours, theirs = loaded
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    _, hidden = transformers_run(theirs, tokens)
    with torch.no_grad():
        _, cache = ours.run_with_cache(tokens)
    names = [f"blocks.{layer}.hook_resid_pre" for layer in range(ours.cfg.n_layers)] + ["ln_final.hook_normalized"]
    assert len(hidden) == len(names)
    for name, theirs_hidden in zip(names, hidden, strict=True):
        torch.testing.assert_close(cache[name], theirs_hidden, rtol=0, atol=PARITY_TOL, msg=name)


def test_the_time_step_limit_clamps_delta_as_transformers_does(tmp_path):
    """With ``time_step_limit`` (0.05, 0.5) every Δ of hook_delta lies in it, some on each bound,
    and the logits are transformers' (`test_logits_equal_…[options]`); without the clamp they move."""
    folder, theirs = mamba2_folder(tmp_path, time_step_limit=(0.05, 0.5))
    model = load(folder)
    assert model.cfg.mixer_kwargs[0]["dt_limit"] == [0.05, 0.5]
    tokens = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
    delta = torch.cat([cache[f"blocks.{layer}.mixer.hook_delta"].flatten() for layer in range(3)])
    assert delta.min() == 0.05 and delta.max() == 0.5
    for mixer in (block.mixer for block in model.blocks):
        mixer.dt_limit = None
    with torch.no_grad():
        assert (model(tokens) - logits).abs().max() > 1e-3


def test_the_gated_norm_is_transformers_with_its_groups():
    """hookmech's `GatedRMSNorm` against transformers' `Mamba2RMSNormGated` (gate, then RMS over
    each group of d_inner / n_groups channels, then the weight), same weight and epsilon."""
    from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNormGated

    generator = torch.Generator().manual_seed(7)
    for groups in (1, 2, 4):
        ours, theirs = GatedRMSNorm(64, group_size=64 // groups), Mamba2RMSNormGated(64, 64 // groups, eps=1e-5)
        with torch.no_grad():
            theirs.weight.copy_(torch.randn(64, generator=generator))
            ours.weight.copy_(theirs.weight)
        y, z = torch.randn(2, 5, 64, generator=generator), torch.randn(2, 5, 64, generator=generator)
        torch.testing.assert_close(ours(y, z), theirs(y, z), rtol=0, atol=1e-6)


def test_hook_names_and_values_are_transformer_lens_bridges(loaded):
    """TransformerLens's own Mamba-2 bridge around the same transformers model: every hook the two
    caches share holds the same values (its ln_final.hook_normalized is before the norm's weight:
    hookmech's is the bridge's ln_final.hook_out), and they share the block-level names."""
    bridge_module = pytest.importorskip("transformer_lens.model_bridge")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    ours, theirs = loaded
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"w0": 0}, unk_token="w0")))
    bridge = bridge_module.TransformerBridge.boot_transformers("local", hf_model=theirs, tokenizer=tokenizer,
                                                               device="cpu")
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, tl_cache = bridge.run_with_cache(tokens)
        _, cache = ours.run_with_cache(tokens)
    ours_names = set(ours.hook_dict) | set(ours.hook_aliases)
    shared = [name for name in tl_cache.keys() if name in ours_names]
    block_level = ("hook_resid_pre", "hook_mixer_in", "hook_mixer_out", "hook_resid_post", "mixer.hook_ssm_out")
    expected = {f"blocks.{layer}.{name}" for layer in range(ours.cfg.n_layers) for name in block_level}
    assert expected | {"hook_embed", "ln_final.hook_normalized"} <= set(shared)
    for name in shared:
        theirs_name = "ln_final.hook_out" if name == "ln_final.hook_normalized" else name
        torch.testing.assert_close(cache[name], tl_cache[theirs_name], rtol=0, atol=PARITY_TOL, msg=name)


def test_the_last_state_is_transformers_cached_recurrent_state(loaded):
    """``hook_ssm_state`` ``[batch, pos, head, headdim, d_state]`` at the last position is the state
    transformers keeps for generation (``[batch, head, headdim, d_state]``)."""
    ours, theirs = loaded
    tokens = torch.randint(0, ours.cfg.d_vocab, (3, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        kept = theirs(tokens, use_cache=True).cache
        _, cache = ours.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_ssm_state"))
    for layer in range(ours.cfg.n_layers):
        state = cache[f"blocks.{layer}.mixer.hook_ssm_state"]
        torch.testing.assert_close(state[:, -1], kept.get_recurrent_state(layer), rtol=0, atol=PARITY_TOL)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_patching_engine_equals_the_plain_loop_on_a_loaded_model(tmp_path, name):
    """The exact engine (resumed runs, kept states, inside hooks and the recurrent state) against
    the plain `run_with_hooks` loop on a loaded folder with groups, at every block-level site and
    inside block 1, on rows longer than the mixer's STATE_STRIDE (kept states are replayed)."""
    task = hookmech.tasks.make("ar", vocab_size=24, num_kv_pairs=10)
    folder, _ = mamba2_folder(tmp_path, vocab_size=task.d_vocab, **OPTIONS[name])
    model = load(folder)
    batch = task.sample(5, seed=3)
    assert batch.tokens.shape[1] > model.blocks[0].mixer.STATE_STRIDE
    inside = [hook for hook, point in model.hook_dict.items()
              if hook.startswith("blocks.1.mixer.") and point.pos_axis is not None]
    sites = ["all", *inside]
    records = patch(model, batch, sites, ["key", "value+query"], max_batch=7)
    reference = plain_loop_patch(model, batch, sites, ["key", "value+query"])
    assert len(records) == len(reference) > 0
    for record in records:
        expected = reference[record["hook"], record["pos"]]
        for key in ("p_clean", "p_corrupt", "p_patched"):
            assert abs(record[key] - expected[key]) <= ENGINE_TOL, (record["site"], record["pos"], key)
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in records) > 2 * ENGINE_TOL


def test_a_float16_folder_loads_as_transformers_loads_it(tmp_path):
    """Weights stored in float16 are widened exactly: hookmech's float32 logits equal those of
    transformers' model loaded from the same folder in float32."""
    folder, theirs = mamba2_folder(tmp_path / "half")
    theirs.half().save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float16"
    widened = transformers.Mamba2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, 40, (2, 13), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(load(folder)(tokens), transformers_run(widened, tokens)[0], rtol=0, atol=PARITY_TOL)


# -- the config -------------------------------------------------------------------------------
def test_the_defaults_are_transformers_mamba2_configs():
    reference = transformers.Mamba2Config()
    for name, default in mamba2.MAMBA2_DEFAULTS.items():
        value = getattr(reference, name)
        assert (list(default) if isinstance(default, tuple) else default) == (
            list(value) if isinstance(value, tuple) else value), name


def test_the_mixer_options_are_the_configs(tmp_path):
    folder, _ = mamba2_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert mamba2.model_config(config).mixer_kwargs[0] == {
        "d_state": 8, "d_conv": 4, "expand": 2, "headdim": 8, "ngroups": 2, "bias": False, "conv_bias": True,
        "chunk_size": 8}


@pytest.mark.parametrize(("limit", "dt_limit"), [
    ([0.0, {"__float__": "Infinity"}], None),  # transformers 5's JSON spelling of the default
    ([0.0, math.inf], None),  # older versions' bare Infinity, as json reads it
    ([-1.0, math.inf], None),  # a negative floor clamps nothing: Δ is a softplus
    ([0.001, {"__float__": "Infinity"}], [0.001, None]),
    ([0.0, 0.1], [None, 0.1]),
    ([0.001, 0.1], [0.001, 0.1]),
])
def test_time_step_limit_becomes_the_clamp_it_applies(limit, dt_limit):
    cfg = mamba2.model_config({"hidden_size": 32, "num_heads": 8, "head_dim": 8, "time_step_limit": limit})
    assert cfg.mixer_kwargs[0].get("dt_limit") == dt_limit
    # and the config, written and read back, is the same config (no Infinity in its JSON)
    assert "Infinity" not in cfg.to_json() and hookmech.ModelConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(("fields", "message"), [
    ({"num_heads": 6}, "num_heads 6 x head_dim 8"),
    ({"n_groups": 3}, "num_heads 8 is not divisible by n_groups 3"),
    ({"hidden_act": "relu"}, "hidden_act = 'relu'"),
    ({"layer_norm_epsilon": -1e-6}, "layer_norm_epsilon"),
    ({"n_groups": 0}, "n_groups = 0"),
    ({"time_step_limit": [0.0]}, "time_step_limit"),
    ({"time_step_limit": [0.0, "soon"]}, "time_step_limit holds 'soon'"),
    ({"time_step_limit": [0.0, {"__float__": "NaN"}]}, "time_step_limit holds"),
])
def test_configs_hookmech_does_not_run_or_cannot_read_are_refused_naming_the_field(fields, message):
    with pytest.raises(HookmechError, match=message):
        mamba2.model_config({"hidden_size": 32, "num_heads": 8, "head_dim": 8, **fields})
