"""transformers' MambaForCausalLM folders loaded into hookmech (`hookmech.pretrained.mamba`): the
logits and every block's residual equal transformers' own forward (its pure-torch path, the
reference here), and mambapy's; the hook names are TransformerLens's, with the values of
TransformerLens's own Mamba bridge around the same model; the last state is transformers' cached
one; the patching engine agrees with the plain loop on the loaded model; bad folders get one line.
Tolerance: `PARITY_TOL` (issue 47's 1e-5)."""
from __future__ import annotations

import json
import math

import pytest
import torch

import hookmech
from hookmech.errors import HookmechError
from hookmech.oracles import plain_loop_patch
from hookmech.patching import patch
from hookmech.pretrained import mamba
from hookmech.pretrained.weights import WeightsMismatch

from helpers import ENGINE_TOL
from ssm_folders import PARITY_TOL, load, mamba_folder, transformers_run

transformers = pytest.importorskip("transformers")

#: the defaults, and every option that changes the mapping: biases, no conv bias, an explicit
#: dt_rank, another kernel and expansion, an untied head, another norm epsilon
OPTIONS = {
    "defaults": {},
    "options": {
        "use_bias": True,
        "use_conv_bias": False,
        "time_step_rank": 5,
        "conv_kernel": 3,
        "expand": 3,
        "tie_word_embeddings": False,
        "layer_norm_epsilon": 1e-2,
    },
}


@pytest.fixture(scope="module", params=list(OPTIONS))
def loaded(request, tmp_path_factory):
    """(hookmech's model, transformers' model) of one folder."""
    folder, theirs = mamba_folder(tmp_path_factory.mktemp("mamba"), **OPTIONS[request.param])
    return load(folder), theirs


@pytest.mark.parametrize(("batch", "n_pos"), [(1, 1), (3, 7), (2, 20)])
def test_logits_equal_transformers(loaded, batch, n_pos):
    ours, theirs = loaded
    tokens = torch.randint(0, ours.cfg.d_vocab, (batch, n_pos), generator=torch.Generator().manual_seed(n_pos))
    expected, _ = transformers_run(theirs, tokens)
    with torch.no_grad():
        logits = ours(tokens)
    assert expected.abs().max() > 1  # logits of a size where 1e-5 says something
    torch.testing.assert_close(logits, expected, rtol=0, atol=PARITY_TOL)


def test_each_blocks_residual_equals_transformers_hidden_states(loaded):
    """transformers 5's MambaModel returns n_layers + 1 hidden states: each block's output, then
    the final norm's (no embedding; Mamba-2's differ: `test_mamba2_folders`)."""
    ours, theirs = loaded
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    _, hidden = transformers_run(theirs, tokens)
    with torch.no_grad():
        _, cache = ours.run_with_cache(tokens)
    n_layers = ours.cfg.n_layers
    names = [f"blocks.{layer}.hook_resid_post" for layer in range(n_layers)] + ["ln_final.hook_normalized"]
    assert len(hidden) == len(names)
    for name, theirs_hidden in zip(names, hidden, strict=True):
        torch.testing.assert_close(cache[name], theirs_hidden, rtol=0, atol=PARITY_TOL, msg=name)


def test_hook_names_and_values_are_transformer_lens_bridges(loaded):
    """TransformerLens's own Mamba bridge (`TransformerBridge`) around the same transformers model:
    every hook the two caches share holds the same values, and they share the block-level names."""
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
        # the bridge's hook_normalized is x / rms(x) before the norm's weight (HookedTransformer
        # folds that weight into the next layer); hookmech's is the norm's output, the bridge's hook_out
        theirs_name = "ln_final.hook_out" if name == "ln_final.hook_normalized" else name
        torch.testing.assert_close(cache[name], tl_cache[theirs_name], rtol=0, atol=PARITY_TOL, msg=name)


def test_the_last_state_is_transformers_cached_recurrent_state(loaded):
    """``hook_ssm_state`` ``[batch, pos, d_inner, d_state]`` at the last position is the state
    transformers keeps for generation (``[batch, d_inner, d_state]``)."""
    ours, theirs = loaded
    tokens = torch.randint(0, ours.cfg.d_vocab, (3, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        kept = theirs(tokens, use_cache=True).cache
        _, cache = ours.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_ssm_state"))
    for layer in range(ours.cfg.n_layers):
        state = cache[f"blocks.{layer}.mixer.hook_ssm_state"]
        torch.testing.assert_close(state[:, -1], kept.get_recurrent_state(layer), rtol=0, atol=PARITY_TOL)


def test_logits_equal_mambapys_with_the_same_weights(tmp_path):
    """mambapy's Mamba (its blocks, with its RMSNorm as the final norm and the tied head) on the
    folder's weights: a second reference."""
    mambapy = pytest.importorskip("mambapy.mamba")
    folder, theirs = mamba_folder(tmp_path, use_bias=True, time_step_rank=3)
    config = theirs.config
    peer = mambapy.Mamba(mambapy.MambaConfig(
        d_model=config.hidden_size, n_layers=config.num_hidden_layers, d_state=config.state_size,
        expand_factor=config.expand, d_conv=config.conv_kernel, dt_rank=3, bias=True, pscan=False))
    weights = theirs.state_dict()
    peer.load_state_dict({key.removeprefix("backbone."): value for key, value in weights.items()
                          if key.startswith("backbone.layers.")})
    norm_f = mambapy.RMSNorm(config.hidden_size, config.layer_norm_epsilon)
    norm_f.load_state_dict({"weight": weights["backbone.norm_f.weight"]})
    tokens = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(4))
    embedding = weights["backbone.embeddings.weight"]
    with torch.no_grad():
        expected = norm_f(peer(embedding[tokens])) @ embedding.T
        logits = load(folder)(tokens)
    torch.testing.assert_close(logits, expected, rtol=0, atol=PARITY_TOL)


def test_residual_in_fp32_changes_nothing_in_float32(tmp_path):
    """transformers keeps the residual in float32 with ``residual_in_fp32``; in a float32 model
    that is no change: the same weights give the same logits either way (and hookmech's)."""
    folder, with_fp32 = mamba_folder(tmp_path / "a", residual_in_fp32=True)
    _, without = mamba_folder(tmp_path / "b", residual_in_fp32=False)
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(5))
    assert torch.equal(transformers_run(with_fp32, tokens)[0], transformers_run(without, tokens)[0])
    with torch.no_grad():
        torch.testing.assert_close(load(folder)(tokens), transformers_run(without, tokens)[0], rtol=0, atol=PARITY_TOL)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_patching_engine_equals_the_plain_loop_on_a_loaded_model(tmp_path, name):
    """The exact engine (resumed runs, kept states, inside hooks and the recurrent state) against
    the plain `run_with_hooks` loop on a loaded folder, at every block-level site and inside block 1."""
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    folder, _ = mamba_folder(tmp_path, vocab_size=task.d_vocab, **OPTIONS[name])
    model = load(folder)
    batch = task.sample(6, seed=3)
    inside = [name for name, point in model.hook_dict.items()
              if name.startswith("blocks.1.mixer.") and point.pos_axis is not None]
    sites = ["all", *inside]
    records = patch(model, batch, sites, ["key", "value+query"], max_batch=7)
    reference = plain_loop_patch(model, batch, sites, ["key", "value+query"])
    assert len(records) == len(reference) > 0
    for record in records:
        expected = reference[record["hook"], record["pos"]]
        for key in ("p_clean", "p_corrupt", "p_patched"):
            assert abs(record[key] - expected[key]) <= ENGINE_TOL, (record["site"], record["pos"], key)
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in records) > 2 * ENGINE_TOL


# -- the config -------------------------------------------------------------------------------
def test_the_defaults_are_transformers_mamba_configs():
    """A config.json leaves out what equals the base config's defaults (``tie_word_embeddings``):
    the fields read default to transformers' own `MambaConfig` values."""
    reference = transformers.MambaConfig()
    for name, default in mamba.MAMBA_DEFAULTS.items():
        value = getattr(reference, name)
        if name == "time_step_rank":  # transformers resolves "auto" when it builds the config
            assert (default, value) == ("auto", math.ceil(reference.hidden_size / 16))
        else:
            assert default == value, name


def test_a_config_with_only_the_sizes_is_the_full_configs(tmp_path):
    folder, _ = mamba_folder(tmp_path)
    full = json.loads((folder / "config.json").read_text())
    sizes = {key: full[key] for key in ("model_type", "vocab_size", "hidden_size", "state_size", "num_hidden_layers")}
    assert mamba.model_config(sizes) == mamba.model_config(full)
    assert mamba.model_config(full).mixer_kwargs[0] == {
        "d_state": 8, "d_conv": 4, "expand": 2, "dt_rank": 2, "bias": False, "conv_bias": True}


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("layer_norm_epsilon", 0, "layer_norm_epsilon = 0"),
    ("state_size", 2.5, "state_size = 2.5"),
    ("use_bias", "no", "use_bias = 'no'"),
    ("conv_kernel", 5, "conv_kernel = 5"),
])
def test_options_hookmech_does_not_run_or_cannot_read_are_refused_naming_the_field(field, value, message):
    config = {"model_type": "mamba", "hidden_size": 32, field: value}
    with pytest.raises(HookmechError, match=message):
        mamba.model_config(config)


# -- the weights ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder_weights(tmp_path_factory):
    from safetensors.torch import load_file

    folder, _ = mamba_folder(tmp_path_factory.mktemp("weights"))
    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


def test_older_folders_embedding_name_is_taken(folder_weights):
    """Folders converted before transformers renamed it hold ``backbone.embedding.weight``."""
    config, weights = folder_weights
    older = {key.replace("embeddings.", "embedding."): value for key, value in weights.items()}
    assert "backbone.embedding.weight" in older
    converted = mamba.convert_weights(config, older)
    assert converted.keys() == mamba.convert_weights(config, weights).keys()
    assert converted["embed.weight"] is weights["backbone.embeddings.weight"]


def test_a_tied_heads_copy_of_the_embedding_is_dropped_and_an_untied_one_loaded(folder_weights):
    config, weights = folder_weights
    with_head = {**weights, "lm_head.weight": weights["backbone.embeddings.weight"].clone()}
    assert "unembed.weight" not in mamba.convert_weights(config, with_head)
    untied = {**config, "tie_word_embeddings": False}
    assert mamba.convert_weights(untied, with_head)["unembed.weight"] is with_head["lm_head.weight"]
    with pytest.raises(WeightsMismatch, match=r"missing lm_head\.weight"):
        mamba.convert_weights(untied, weights)


@pytest.mark.parametrize(("change", "message"), [
    (lambda w: {**w, "backbone.layers.3.norm.weight": w["backbone.norm_f.weight"]},
     "unexpected backbone.layers.3.norm.weight"),
    (lambda w: {**w, "backbone.layers.0.mixer.dt_bias": w["backbone.layers.0.mixer.D"]},
     "unexpected backbone.layers.0.mixer.dt_bias"),
    (lambda w: {k: v for k, v in w.items() if k != "backbone.norm_f.weight"}, "missing backbone.norm_f.weight"),
    (lambda w: {k: v for k, v in w.items() if "embeddings" not in k}, "missing backbone.embeddings.weight"),
    (lambda w: {k: v for k, v in w.items() if not k.endswith("conv1d.bias")},
     "missing backbone.layers.0.mixer.conv1d.bias, backbone.layers.1.mixer.conv1d.bias, "
     "backbone.layers.2.mixer.conv1d.bias"),
])
def test_weights_that_are_not_this_configs_are_refused_naming_the_key(folder_weights, change, message):
    config, weights = folder_weights
    with pytest.raises(WeightsMismatch, match=message.replace(".", r"\.")):
        mamba.convert_weights(config, change(weights))


def test_a_wrong_folder_is_one_line_naming_its_file(tmp_path):
    """Through `from_pretrained`: a config option hookmech does not run names config.json, weights
    of another config (biases the config does not have) name the weights file."""
    folder, _ = mamba_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(HookmechError) as error:
        load(folder)
    assert "\n" not in str(error.value) and str(error.value).startswith(f"{folder / 'config.json'}: hidden_act")
    (folder / "config.json").write_text(json.dumps({**config, "use_conv_bias": False}))
    with pytest.raises(HookmechError) as error:
        load(folder)
    assert "\n" not in str(error.value) and str(error.value).startswith(f"{folder / 'model.safetensors'}: ")
    assert "unexpected backbone.layers.0.mixer.conv1d.bias" in str(error.value)


def test_loading_undrawn_keeps_the_flags_mamba_sets_on_its_parameters(tmp_path, monkeypatch):
    """from_pretrained builds the model undrawn (the meta device) and fills it: the flags Mamba sets
    on A_log, D and dt's bias (`_no_weight_decay`, `_no_reinit`) stay, as in a model drawn first,
    and torch's global generator is left as it was."""
    import hookmech.pretrained as pretrained

    folder, _ = mamba_folder(tmp_path)
    before = torch.random.get_rng_state()
    undrawn = load(folder)
    assert torch.equal(torch.random.get_rng_state(), before)
    monkeypatch.setattr(pretrained, "_unfilled_model", lambda model_class, cfg: model_class(cfg))
    drawn = load(folder)
    flags = [{name: dict(vars(p)) for name, p in model.named_parameters() if vars(p)} for model in (undrawn, drawn)]
    assert flags[0] == flags[1] and any("_no_weight_decay" in flag for flag in flags[0].values())
