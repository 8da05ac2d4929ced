"""GPT-2 (transformers' ``GPT2LMHeadModel``, ``model_type: gpt2``) as a hookmech `HookedLM`.

GPT-2 is hookmech's own pre-norm attention block: learned absolute position embeddings,
LayerNorm, attention with q/k/v and output biases, an MLP with the tanh-approximated GELU
(``gelu_new``), a final LayerNorm and an LM head tied to the token embedding. Its ``Conv1D``
layers store their weights as ``[in, out]`` (``y = x W + b``), transposed here into
``nn.Linear``'s ``[out, in]``; ``c_attn``'s output is q, k, v one after the other, each head by
head, as hookmech's ``Wqkv`` lays them out.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..config import ModelConfig
from ..hook_names import block_path
from .hf_config import count, flag, hidden_multiple, mlp_activation, number, refuse
from .weights import Weights, strip_prefix

#: buffers older GPT-2 checkpoints store (the causal mask), which hookmech computes
IGNORED = ("attn.bias", "attn.masked_bias")


def model_config(hf_config: dict[str, Any]) -> ModelConfig:
    """Return the `ModelConfig` of GPT-2 config `hf_config` (transformers' ``GPT2Config`` defaults
    where a key is absent); a HookmechError naming the key of an option hookmech does not build."""
    d_model, n_heads = count(hf_config, "n_embd", 768), count(hf_config, "n_head", 12)
    n_layers = count(hf_config, "n_layer", 12)
    refuse(hf_config, "scale_attn_weights", False, True, "hookmech's attention scales scores by 1/sqrt(d_head)")
    refuse(hf_config, "scale_attn_by_inverse_layer_idx", True, False, "hookmech's attention scales every layer alike")
    refuse(hf_config, "add_cross_attention", True, False, "GPT2LMHeadModel's causal language model has none")
    inner = hf_config.get("n_inner") or 4 * d_model
    return ModelConfig(
        d_vocab=count(hf_config, "vocab_size", 50257),
        n_ctx=count(hf_config, "n_positions", 1024),
        d_model=d_model,
        n_layers=n_layers,
        mixers=("attention",) * n_layers,
        mixer_kwargs=tuple({"n_heads": n_heads} for _ in range(n_layers)),
        mlp=(True,) * n_layers,
        norms=("layernorm",) * n_layers,
        pos_emb="learned",
        tie_embeddings=flag(hf_config, "tie_word_embeddings", True),
        mlp_hidden_mult=hidden_multiple(count({"n_inner": inner}, "n_inner"), d_model, "n_inner"),
        final_norm="layernorm",
        mlp_act=mlp_activation(hf_config, "activation_function", "gelu_new"),
        norm_eps=number(hf_config, "layer_norm_epsilon", 1e-5),
    )


def convert_weights(hf_config: dict[str, Any], weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Return GPT-2 `weights` (names with or without ``transformer.``) as a hookmech state dict of
    `model_config(hf_config)`; a `WeightsMismatch` naming what is missing, left over or misshapen."""
    cfg = model_config(hf_config)
    source = Weights(strip_prefix(weights, "transformer."), ignore=IGNORED)
    d_model, hidden = cfg.d_model, cfg.mlp_hidden_mult * cfg.d_model
    state = {
        "embed.weight": source.take("wte.weight", (cfg.d_vocab, d_model)),
        "pos_embed.weight": source.take("wpe.weight", (cfg.n_ctx, d_model)),
        "ln_final.norm.weight": source.take("ln_f.weight", (d_model,)),
        "ln_final.norm.bias": source.take("ln_f.bias", (d_model,)),
    }
    for layer in range(cfg.n_layers):
        state.update(_block(source, layer, d_model, hidden))
    if not cfg.tie_embeddings:
        state["unembed.weight"] = source.take("lm_head.weight", (cfg.d_vocab, d_model))
    elif source.has("lm_head.weight"):  # a tied head saved anyway: the embedding's copy
        source.take("lm_head.weight", (cfg.d_vocab, d_model))
    source.finish()
    return state


def _block(source: Weights, layer: int, d_model: int, hidden: int) -> dict[str, Tensor]:
    """Block `layer`'s weights in hookmech's names (Conv1D weights transposed)."""
    prefix = f"h.{layer}."

    def linear(name: str, n_in: int, n_out: int) -> tuple[Tensor, Tensor]:
        weight = source.take(f"{prefix}{name}.weight", (n_in, n_out))
        return weight.T.contiguous(), source.take(f"{prefix}{name}.bias", (n_out,))

    parts = {
        "ln1": (source.take(f"{prefix}ln_1.weight", (d_model,)), source.take(f"{prefix}ln_1.bias", (d_model,))),
        "mixer.Wqkv": linear("attn.c_attn", d_model, 3 * d_model),
        "mixer.out_proj": linear("attn.c_proj", d_model, d_model),
        "ln2": (source.take(f"{prefix}ln_2.weight", (d_model,)), source.take(f"{prefix}ln_2.bias", (d_model,))),
        "mlp.fc1": linear("mlp.c_fc", d_model, hidden),
        "mlp.fc2": linear("mlp.c_proj", hidden, d_model),
    }
    state = {}
    for name, (weight, bias) in parts.items():
        state[block_path(layer, f"{name}.weight")] = weight
        state[block_path(layer, f"{name}.bias")] = bias
    return state
