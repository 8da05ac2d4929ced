"""GPT-NeoX and Pythia (transformers' ``GPTNeoXForCausalLM``, ``model_type: gpt_neox``) as a
hookmech `HookedLM`.

A GPT-NeoX block is hookmech's attention block with rotary position embeddings on a fraction of
each head (``rotary_pct``, base ``rotary_emb_base``; Pythia: 0.25 and 10000) and, by default, a
parallel residual (``r + attn(ln1(r)) + mlp(ln2(r))``, `ModelConfig.parallel_residual`); the MLP
uses the exact GELU; the LM head (``embed_out``) is its own matrix, without a bias. There is no
learned position embedding. ``query_key_value`` lays its output out head by head, each head's q,
k, v together (``[head, 3, d_head]``); hookmech's ``Wqkv`` wants q, k, v one after the other
(``[3, head, d_head]``): its rows are reordered here.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..config import ModelConfig
from ..errors import HookmechError
from ..hook_names import block_path
from .hf_config import count, flag, hidden_multiple, mlp_activation, number
from .weights import Weights, strip_prefix

#: buffers older checkpoints store (the causal mask, the rotary frequencies), which hookmech computes
IGNORED = ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq")


def rotary_options(hf_config: dict[str, Any]) -> tuple[float, float]:
    """Return ``(rotary_pct, rotary_base)`` of `hf_config`: transformers 5's ``rope_parameters``
    (``partial_rotary_factor``, ``rope_theta``), or the older ``rope_scaling``, ``rotary_pct`` and
    ``rotary_emb_base`` keys (GPTNeoXConfig's defaults 0.25 and 10000); a HookmechError for a
    scaled rotary embedding (``rope_type`` other than default), which hookmech does not compute."""
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise HookmechError(f"rope_parameters = {rope!r}: expected a table")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HookmechError(f"rope_type {rope_type!r} is not supported: hookmech computes the default rotary embedding")
    fraction = rope.get("partial_rotary_factor", hf_config.get("rotary_pct", 0.25))
    base = rope.get("rope_theta", hf_config.get("rotary_emb_base", 10000.0))
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise HookmechError(f"partial_rotary_factor (rotary_pct) = {fraction!r}: expected a number in (0, 1]")
    return float(fraction), number({"rope_theta": base}, "rope_theta", 10000.0)


def model_config(hf_config: dict[str, Any]) -> ModelConfig:
    """Return the `ModelConfig` of GPT-NeoX config `hf_config` (transformers' ``GPTNeoXConfig``
    defaults where a key is absent); a HookmechError naming the key of an option hookmech does
    not build."""
    d_model, n_heads = count(hf_config, "hidden_size", 6144), count(hf_config, "num_attention_heads", 64)
    n_layers = count(hf_config, "num_hidden_layers", 44)
    if d_model % n_heads:
        raise HookmechError(f"hidden_size {d_model} is not divisible by num_attention_heads {n_heads}")
    rotary_pct, rotary_base = rotary_options(hf_config)
    bias = flag(hf_config, "attention_bias", True)
    attention = {"n_heads": n_heads, "rotary_pct": rotary_pct, "rotary_base": rotary_base}
    if not bias:
        attention.update(bias=False, out_bias=False)
    return ModelConfig(
        d_vocab=count(hf_config, "vocab_size", 50432),
        n_ctx=count(hf_config, "max_position_embeddings", 2048),
        d_model=d_model,
        n_layers=n_layers,
        mixers=("attention",) * n_layers,
        mixer_kwargs=tuple(dict(attention) for _ in range(n_layers)),
        mlp=(True,) * n_layers,
        norms=("layernorm",) * n_layers,
        pos_emb="none",
        tie_embeddings=flag(hf_config, "tie_word_embeddings", False),
        mlp_hidden_mult=hidden_multiple(
            count(hf_config, "intermediate_size", 4 * d_model), d_model, "intermediate_size"
        ),
        final_norm="layernorm",
        mlp_act=mlp_activation(hf_config, "hidden_act", "gelu"),
        norm_eps=number(hf_config, "layer_norm_eps", 1e-5),
        parallel_residual=flag(hf_config, "use_parallel_residual", True),
    )


def convert_weights(hf_config: dict[str, Any], weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Return GPT-NeoX `weights` (names with or without ``gpt_neox.``) as a hookmech state dict of
    `model_config(hf_config)`; a `WeightsMismatch` naming what is missing, left over or misshapen."""
    cfg = model_config(hf_config)
    source = Weights(strip_prefix(weights, "gpt_neox."), ignore=IGNORED)
    d_model, n_heads = cfg.d_model, cfg.n_heads
    state = {
        "embed.weight": source.take("embed_in.weight", (cfg.d_vocab, d_model)),
        "ln_final.norm.weight": source.take("final_layer_norm.weight", (d_model,)),
        "ln_final.norm.bias": source.take("final_layer_norm.bias", (d_model,)),
    }
    for layer in range(cfg.n_layers):
        state.update(_block(source, layer, d_model, n_heads, cfg.mlp_hidden_mult * d_model, _has_bias(cfg, layer)))
    if not cfg.tie_embeddings:
        state["unembed.weight"] = source.take("embed_out.weight", (cfg.d_vocab, d_model))
    elif source.has("embed_out.weight"):  # a tied head saved anyway: the embedding's copy
        source.take("embed_out.weight", (cfg.d_vocab, d_model))
    source.finish()
    return state


def _has_bias(cfg: ModelConfig, layer: int) -> bool:
    return bool(cfg.mixer_kwargs[layer].get("bias", True))


def _block(source: Weights, layer: int, d_model: int, n_heads: int, hidden: int, bias: bool) -> dict[str, Tensor]:
    """Block `layer`'s weights in hookmech's names (query_key_value's rows reordered)."""
    prefix = f"layers.{layer}."
    d_head = d_model // n_heads

    def take(name: str, shape: tuple[int, ...]) -> Tensor:
        return source.take(prefix + name, shape)

    def by_projection(rows: Tensor) -> Tensor:
        # [head, 3 (q k v), d_head, ...] -> [3, head, d_head, ...]: q, k, v one after the other
        return rows.unflatten(0, (n_heads, 3, d_head)).transpose(0, 1).flatten(0, 2).contiguous()

    state = {
        "ln1.weight": take("input_layernorm.weight", (d_model,)),
        "ln1.bias": take("input_layernorm.bias", (d_model,)),
        "ln2.weight": take("post_attention_layernorm.weight", (d_model,)),
        "ln2.bias": take("post_attention_layernorm.bias", (d_model,)),
        "mixer.Wqkv.weight": by_projection(take("attention.query_key_value.weight", (3 * d_model, d_model))),
        "mixer.out_proj.weight": take("attention.dense.weight", (d_model, d_model)),
        "mlp.fc1.weight": take("mlp.dense_h_to_4h.weight", (hidden, d_model)),
        "mlp.fc1.bias": take("mlp.dense_h_to_4h.bias", (hidden,)),
        "mlp.fc2.weight": take("mlp.dense_4h_to_h.weight", (d_model, hidden)),
        "mlp.fc2.bias": take("mlp.dense_4h_to_h.bias", (d_model,)),
    }
    if bias:
        state["mixer.Wqkv.bias"] = by_projection(take("attention.query_key_value.bias", (3 * d_model,)))
        state["mixer.out_proj.bias"] = take("attention.dense.bias", (d_model,))
    return {block_path(layer, name): tensor for name, tensor in state.items()}
