"""Pretrained families against transformers (issue 47 §2): small random models of each family's
real structure, saved with save_pretrained, loaded with hookmech.from_pretrained. hookmech's
logits and every block's residual equal transformers' (float32, eval); the cache's names and
values are TransformerLens's own (its TransformerBridge built from the same local folder)."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import ENGINE_TOL
from pretrained_folders import FAMILY_CASES, WORDS, folder_of, gpt2, pythia, save

import hookmech
import hookmech.pretrained as pretrained
from hookmech.config import build_config
from hookmech.errors import HookmechError
from hookmech.identity import model_hash

transformers = pytest.importorskip("transformers")

#: hookmech's logits and residuals against transformers': the issue's 1e-5 (the engine contract's
#: tolerance, `helpers.ENGINE_TOL`); measured differences are below 2e-6 on these models
PARITY_TOL = ENGINE_TOL
#: (batch, length) of the inputs compared: one token, odd lengths, a batch, the full context
SHAPES = [(1, 1), (1, 7), (3, 13), (2, 40)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    return {case: folder_of(case, root) for case in FAMILY_CASES}


def _hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def _tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, len(WORDS), (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
@pytest.mark.parametrize("batch, length", SHAPES)
def test_logits_and_every_residual_equal_transformers(folders, case, batch, length):
    reference, model = _hf_model(folders[case]), hookmech.from_pretrained(folders[case])
    tokens = _tokens(batch, length, seed=length)
    with torch.no_grad():
        expected = reference(tokens, output_hidden_states=True)
        logits, cache = model.run_with_cache(tokens)
    assert (logits - expected.logits).abs().max() <= PARITY_TOL
    assert expected.logits.std() > 0.5  # redrawn weights: logits that differ by far more than the tolerance
    hidden = expected.hidden_states  # the embedding, each block's output but the last, the final norm's output
    for layer in range(model.cfg.n_layers):
        assert (cache[f"blocks.{layer}.hook_resid_pre"] - hidden[layer]).abs().max() <= PARITY_TOL, layer
    assert (cache["ln_final.hook_normalized"] - hidden[-1]).abs().max() <= PARITY_TOL


def test_pythia_keeps_its_structure(folders):
    """The structure the parity stands on: a quarter of each head rotates, both sublayers read
    the block's input (no resid_mid), the head is untied; and the sequential variant has resid_mid."""
    parallel = hookmech.from_pretrained(folders["pythia"])
    assert parallel.cfg.parallel_residual and not parallel.cfg.tie_embeddings
    assert parallel.blocks[0].mixer.rotary_dim == 2 and parallel.cfg.mlp_act == "gelu"
    assert "blocks.0.hook_resid_mid" not in parallel.hook_dict
    assert {"blocks.0.mixer.hook_rot_q", "blocks.0.mixer.hook_rot_k"} <= set(parallel.hook_dict)
    sequential = hookmech.from_pretrained(folders["pythia-sequential"])
    assert not sequential.cfg.parallel_residual and "blocks.0.hook_resid_mid" in sequential.hook_dict
    assert sequential.blocks[0].mixer.rotary_dim == 4
    gpt = hookmech.from_pretrained(folders["gpt2"])
    assert gpt.cfg.tie_embeddings and gpt.cfg.mlp_act == "gelu_tanh" and gpt.cfg.pos_emb == "learned"


def test_the_mlp_of_a_parallel_block_reads_the_blocks_input(folders):
    """In a parallel block, patching the mixer's output leaves the MLP's input alone."""
    model = hookmech.from_pretrained(folders["pythia"])
    tokens = _tokens(2, 9)
    _, clean = model.run_with_cache(tokens)
    zero = [("blocks.0.hook_mixer_out", lambda act, hook: torch.zeros_like(act))]
    with model.hooks(fwd_hooks=zero):
        _, patched = model.run_with_cache(tokens)
    assert torch.equal(patched["blocks.0.hook_mlp_in"], clean["blocks.0.hook_mlp_in"])
    expected = clean["blocks.0.hook_resid_pre"] + clean["blocks.0.hook_mlp_out"]
    assert (patched["blocks.0.hook_resid_post"] - expected).abs().max() <= 1e-6


def _bridge(folder):
    """TransformerLens's own model of the folder, offline: its TransformerBridge around the
    transformers model loaded from the local folder (raw weights: no LayerNorm folding)."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(folder), hf_model=_hf_model(folder))
    return bridge.eval()


#: TransformerLens's names no hookmech hook holds: the norms' outputs before the affine map (hookmech's
#: mixer_in and mlp_in are after it), the MLP's pre-activation, its bridge's own plumbing (hook_in/out,
#: attn.hook_hidden_states, the rotary tables hook_cos/hook_sin) and the unembedding's output (the logits)
TL_ONLY = (".hook_in", ".hook_out", "ln1.hook_normalized", "ln2.hook_normalized", "mlp.hook_pre",
           "attn.hook_hidden_states", "hook_cos", "hook_sin", "hook_unembed")


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_the_cache_is_transformer_lens_own(folders, case, monkeypatch):
    """Every name TransformerLens's cache holds (but `TL_ONLY`) is answered by hookmech's cache of
    the same tokens with the same values: the residual stream, the sublayers' outputs, q, k, v,
    scores, pattern, z, the norms' scales and the MLP's neurons."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bridge, model = _bridge(folders[case]), hookmech.from_pretrained(folders[case])
    tokens = _tokens(2, 11)
    with torch.no_grad():
        _, theirs = bridge.run_with_cache(tokens)
        _, ours = model.run_with_cache(tokens)
    compared = []
    for name in theirs.keys():
        if name.endswith(TL_ONLY) and not name.endswith(("hook_attn_out", "hook_mlp_out")):
            continue
        expected, got = theirs[name], ours[name]
        if name == "ln_final.hook_normalized":  # TransformerLens's is before the weight and bias, hookmech's after
            norm = model.ln_final.norm
            expected = expected * norm.weight + norm.bias
        assert got.shape == expected.shape, name
        finite = torch.isfinite(got)
        if name.endswith("attn_scores"):  # masked scores: hookmech's -inf, TransformerLens's float32 minimum
            assert (expected[~finite] == torch.finfo(torch.float32).min).all() and (got[~finite] == -torch.inf).all()
        assert finite.any() and torch.isfinite(expected[finite]).all(), name
        assert (got[finite] - expected[finite]).abs().max() <= PARITY_TOL, name
        compared.append(name)
    assert {"blocks.1.hook_resid_pre", "blocks.1.attn.hook_pattern", "blocks.1.mlp.hook_post"} <= set(compared)
    assert ("blocks.0.hook_resid_mid" in compared) == (case != "pythia")


def test_run_with_cache_names_are_transformer_lens_names(folders):
    model = hookmech.from_pretrained(folders["pythia"])
    _, cache = model.run_with_cache(_tokens(1, 5))
    for name in ("blocks.0.hook_resid_pre", "blocks.0.hook_attn_out", "blocks.0.attn.hook_q", "blocks.0.attn.hook_rot_q",
                 "blocks.0.attn.hook_rot_k", "blocks.1.hook_mlp_out", "blocks.1.hook_resid_post", "blocks.1.mlp.hook_post"):
        assert name in cache, name
    assert torch.equal(cache["blocks.0.attn.hook_rot_q"], cache["blocks.0.mixer.hook_rot_q"])
    with pytest.raises(HookmechError, match="parallel block"):
        cache["blocks.0.hook_resid_mid"]


# -- what a folder may hold ------------------------------------------------------------------
@pytest.mark.parametrize("make", [gpt2, pythia], ids=["gpt2", "pythia"])
def test_a_float16_folder_loads_and_computes_in_float32(tmp_path, make):
    model = make()
    save(model.half(), tmp_path / "half")
    assert "float16" in (tmp_path / "half" / "config.json").read_text()
    loaded = hookmech.from_pretrained(tmp_path / "half")
    assert all(p.dtype == torch.float32 for p in loaded.parameters()) and loaded.cfg.dtype == "float32"
    tokens = _tokens(2, 9)
    with torch.no_grad():
        expected = model.float()(tokens).logits  # the float16 weights, widened exactly
        assert (loaded(tokens) - expected).abs().max() <= PARITY_TOL
    as_bf16 = hookmech.from_pretrained(tmp_path / "half", dtype="bfloat16")
    assert as_bf16.embed.weight.dtype == torch.bfloat16 and as_bf16.cfg.dtype == "bfloat16"
    assert (as_bf16(tokens).float() - expected).abs().max() < 0.5  # bfloat16's 8 bits of mantissa
    assert model_hash(as_bf16) != model_hash(loaded)


def test_a_pytorch_model_bin_folder_loads_like_safetensors(tmp_path):
    model = gpt2()
    model.save_pretrained(tmp_path / "bin", safe_serialization=False) if _takes_safe_serialization() else None
    folder = tmp_path / "bin"
    if not (folder / "pytorch_model.bin").exists():  # transformers 5 writes safetensors only: write the .bin itself
        folder.mkdir(exist_ok=True)
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    assert not list(folder.glob("*.safetensors"))
    save(model, tmp_path / "safe")
    from_bin, from_safe = hookmech.from_pretrained(folder), hookmech.from_pretrained(tmp_path / "safe")
    assert model_hash(from_bin) == model_hash(from_safe)


def _takes_safe_serialization() -> bool:
    import inspect

    return "safe_serialization" in inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters


def test_a_sharded_folder_loads_like_one_file(tmp_path):
    model = pythia()
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    save(model, tmp_path / "one")
    assert model_hash(hookmech.from_pretrained(tmp_path / "sharded")) == model_hash(hookmech.from_pretrained(tmp_path / "one"))


def test_model_hash_is_the_weights_and_config_not_the_folder(tmp_path):
    first, second = gpt2(tmp_path / "a"), gpt2(tmp_path / "b")
    assert model_hash(hookmech.from_pretrained(tmp_path / "a")) == model_hash(hookmech.from_pretrained(tmp_path / "b"))
    gpt2(tmp_path / "c", seed=1)
    assert model_hash(hookmech.from_pretrained(tmp_path / "a")) != model_hash(hookmech.from_pretrained(tmp_path / "c"))
    assert first is not second


def test_an_untied_gpt2_head_loads_its_own_weight(tmp_path):
    model = gpt2(tmp_path / "untied", tie_word_embeddings=False)
    loaded = hookmech.from_pretrained(tmp_path / "untied")
    assert not loaded.cfg.tie_embeddings
    assert torch.equal(loaded.unembed.weight, model.lm_head.weight.detach())


# -- wrong folders: one line naming the file --------------------------------------------------
def test_weights_of_another_size_name_the_weights_file(tmp_path):
    gpt2(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    with pytest.raises(HookmechError) as error:
        hookmech.from_pretrained(tmp_path / "m")
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "m" / "model.safetensors"))
    assert "wte.weight has shape (48, 32), the config gives (48, 64)" in message


def test_weights_of_another_depth_name_what_is_missing_and_left_over(tmp_path):
    pythia(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(HookmechError, match=r"model.safetensors: weights do not match the config: missing layers\.2\."):
        hookmech.from_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(HookmechError, match=r"unexpected layers\.1\."):
        hookmech.from_pretrained(tmp_path / "m")


@pytest.mark.parametrize("key, value, says", [
    ("activation_function", "relu", "activation_function = 'relu'"),
    ("scale_attn_weights", False, "scale_attn_weights = False is not supported"),
    ("n_inner", 100, "n_inner = 100"),
    ("n_layer", 0, "n_layer = 0: expected an integer >= 1"),
])
def test_a_gpt2_option_hookmech_does_not_build_names_config_json(tmp_path, key, value, says):
    gpt2(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(HookmechError) as error:
        hookmech.from_pretrained(tmp_path / "m")
    assert str(error.value).startswith(str(tmp_path / "m" / "config.json")) and says in str(error.value)


def test_a_scaled_rotary_embedding_is_refused(tmp_path):
    pythia(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HookmechError, match="config.json: rope_type 'linear' is not supported"):
        hookmech.from_pretrained(tmp_path / "m")


def test_the_older_rotary_keys_are_read(tmp_path):
    """Pythia's own config.json (written before transformers 5) says rotary_pct and rotary_emb_base."""
    from hookmech.pretrained.gpt_neox import model_config

    old = {"model_type": "gpt_neox", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
           "intermediate_size": 128, "vocab_size": 50, "rotary_pct": 0.5, "rotary_emb_base": 500}
    cfg = model_config(old)
    assert cfg.mixer_kwargs[0]["rotary_pct"] == 0.5 and cfg.mixer_kwargs[0]["rotary_base"] == 500.0


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_loading_draws_no_random_weights(folders, case, monkeypatch):
    """from_pretrained builds the model undrawn (every weight comes from the folder): torch's
    global generator is left as it was, and the model equals one built by drawing its weights
    first and loading over them (the ordinary way)."""
    before = torch.random.get_rng_state()
    loaded = hookmech.from_pretrained(folders[case])
    assert torch.equal(torch.random.get_rng_state(), before)

    monkeypatch.setattr(pretrained, "_unfilled_model", lambda model_class, cfg: model_class(cfg))
    drawn_first = hookmech.from_pretrained(folders[case])
    assert model_hash(loaded) == model_hash(drawn_first)
    tokens = _tokens(2, 9)
    assert torch.equal(loaded(tokens), drawn_first(tokens))
    flags = [{name: dict(vars(parameter)) for name, parameter in model.named_parameters()} for model in (loaded, drawn_first)]
    assert flags[0] == flags[1]  # Mamba's _no_weight_decay and _no_reinit on A_log, D, dt's bias


def test_a_model_with_constructed_buffers_is_built_the_ordinary_way():
    """Hyena's filter positions are buffers no state dict carries: left undrawn they would be
    empty, so such a model is built (and drawn) as usual."""
    cfg = build_config(d_vocab=12, n_ctx=8, mixers="hyena", d_model=16, n_layers=1)
    built = pretrained._unfilled_model(hookmech.HookedLM, cfg)
    torch.manual_seed(0)
    reference = hookmech.HookedLM(cfg)
    for name, buffer in reference.named_buffers():
        assert torch.equal(dict(built.named_buffers())[name], buffer), name
