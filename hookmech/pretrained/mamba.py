"""transformers' ``MambaForCausalLM`` (model_type ``mamba``, e.g. ``state-spaces/mamba-130m-hf``) as
a `HookedLM`: the `mamba` mixer in RMSNorm blocks without an MLP, an RMSNorm final norm, and the
LM head tied to the embedding unless ``tie_word_embeddings`` is false.

Weights, key for key (transformers' mixer keeps mamba-ssm's names, as `hookmech.mixers.mamba` does):

    backbone.embeddings.weight         -> embed.weight          (older folders: backbone.embedding.weight)
    backbone.layers.{l}.norm.weight    -> blocks.{l}.ln1.weight
    backbone.layers.{l}.mixer.NAME     -> blocks.{l}.mixer.NAME  (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj)
    backbone.norm_f.weight             -> ln_final.norm.weight
    lm_head.weight                     -> unembed.weight         (an untied head; a tied one is the embedding)

The config's fields are read with transformers' defaults where a folder leaves them out
(`MAMBA_DEFAULTS`). The ``time_step_*`` fields and ``rescale_prenorm_residual`` only draw a new
model's weights, and ``residual_in_fp32`` only keeps transformers' residual stream in float32 when
the weights are in a lower precision: none changes a float32 forward. ``layer_norm_epsilon`` is
every norm's epsilon (`ModelConfig.norm_eps`). Mamba-2's folders share this backbone
(`backbone_config`, `backbone_weights`); `hookmech.pretrained.mamba2` holds its mixer.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ..config import ModelConfig
from ..errors import HookmechError
from ..hook_names import block_path
from .hf_config import count, flag, number
from .weights import Weights

#: the context a loaded model states (`ModelConfig.n_ctx`, the longest sequence it accepts): the
#: length Mamba's and Mamba-2's language models were trained on (Gu & Dao 2023 §4.2; Dao & Gu 2024
#: §9.2); the recurrence itself runs at any length
N_CTX = 2048
#: the activation of the SSM branch and the gate: transformers' ``hidden_act`` names for SiLU
SILU = ("silu", "swish")

#: transformers' `MambaConfig` defaults of the fields read here (a saved config.json may leave out
#: those equal to the base config's: ``tie_word_embeddings``)
MAMBA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50280,
    "hidden_size": 768,
    "state_size": 16,
    "num_hidden_layers": 32,
    "layer_norm_epsilon": 1e-5,
    "expand": 2,
    "conv_kernel": 4,
    "use_bias": False,
    "use_conv_bias": True,
    "hidden_act": "silu",
    "time_step_rank": "auto",
    "tie_word_embeddings": True,
}
#: the parameters of every transformers Mamba mixer, mamba-ssm's names (hookmech's `Mamba` takes
#: them as they are); the biases of in_proj, out_proj and the convolution as the config says
MIXER_WEIGHTS = (
    "in_proj.weight",
    "conv1d.weight",
    "x_proj.weight",
    "dt_proj.weight",
    "dt_proj.bias",
    "A_log",
    "D",
    "out_proj.weight",
)


def model_config(hf_config: dict[str, Any]) -> ModelConfig:
    """Return the `ModelConfig` of a transformers Mamba ``config.json`` (as a dict): `N_CTX`
    positions, one `mamba` mixer per layer with the folder's sizes and biases."""
    field = fields_of(hf_config, MAMBA_DEFAULTS)
    d_model = field("hidden_size")
    dt_rank = field("time_step_rank")
    if dt_rank != "auto":
        dt_rank = count(hf_config, "time_step_rank")
    options = {
        "d_state": field("state_size"),
        "d_conv": field("conv_kernel"),
        "expand": field("expand"),
        "dt_rank": math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank,
        "bias": field("use_bias"),
        "conv_bias": field("use_conv_bias"),
    }
    if options["d_conv"] not in (1, 2, 3, 4):
        raise HookmechError(f"conv_kernel = {options['d_conv']}: hookmech's mamba takes 1 to 4")
    return backbone_config(field, "mamba", options)


def convert_weights(hf_config: dict[str, Any], weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Return `weights` (a transformers Mamba state dict, name -> tensor) under hookmech's names
    (module docstring), the tensors themselves, for `HookedLM.load_state_dict`; a
    `WeightsMismatch` naming the keys missing or left over."""
    field = fields_of(hf_config, MAMBA_DEFAULTS)
    return backbone_weights(field, weights, mixer_parameters(field, MIXER_WEIGHTS))


# -- the backbone Mamba and Mamba-2 share ------------------------------------------------------
def fields_of(hf_config: dict[str, Any], defaults: dict[str, Any]):
    """Return ``field(name)``: the config's value of `name`, or transformers' default (`defaults`)
    where the file leaves it out, checked to be of the default's kind (`hf_config`: a flag, an
    integer >= 1, a number > 0; a HookmechError naming the key otherwise). A name without a
    default is a bug here, not in the file."""

    def field(name: str) -> Any:
        default = defaults[name]
        if isinstance(default, bool):
            return flag(hf_config, name, default)
        if isinstance(default, int):
            return count(hf_config, name, default)
        if isinstance(default, float):
            return number(hf_config, name, default)
        return hf_config.get(name, default)

    return field


def backbone_config(field, mixer: str, options: dict[str, Any]) -> ModelConfig:
    """Return the `ModelConfig` of a transformers Mamba or Mamba-2 model whose config fields
    `field` (`fields_of`) reads: RMSNorm blocks of mixer `mixer` with `options` and no MLP, an
    RMSNorm final norm (every norm's epsilon ``layer_norm_epsilon``), no position embedding, the
    head tied as ``tie_word_embeddings`` says. A HookmechError naming the field when its
    activation is not SiLU."""
    if field("hidden_act") not in SILU:
        raise HookmechError(f"hidden_act = {field('hidden_act')!r}: hookmech's {mixer} runs SiLU only")
    n_layers = field("num_hidden_layers")
    return ModelConfig(
        d_vocab=field("vocab_size"),
        n_ctx=N_CTX,
        d_model=field("hidden_size"),
        n_layers=n_layers,
        mixers=(mixer,) * n_layers,
        mixer_kwargs=tuple(dict(options) for _ in range(n_layers)),
        mlp=(False,) * n_layers,
        norms=("rmsnorm",) * n_layers,
        pos_emb="none",
        tie_embeddings=field("tie_word_embeddings"),
        final_norm="rmsnorm",
        norm_eps=field("layer_norm_epsilon"),
    )


def backbone_weights(field, weights: dict[str, Tensor], mixer_parameters: list[str]) -> dict[str, Tensor]:
    """Return a transformers Mamba or Mamba-2 state dict `weights` under hookmech's names (the
    tensors themselves): the embedding, block norms and final norm, each layer's
    `mixer_parameters` under the same names, and an untied head (a tied head's copy of the
    embedding is dropped: transformers ties it to the embedding). A `WeightsMismatch` names what
    is missing and what is left over (`Weights.finish`)."""
    source = Weights(dict(weights))
    older = source.has("backbone.embedding.weight") and not source.has("backbone.embeddings.weight")
    state = {
        "embed.weight": source.take("backbone.embedding.weight" if older else "backbone.embeddings.weight"),
        "ln_final.norm.weight": source.take("backbone.norm_f.weight"),
    }
    for layer in range(field("num_hidden_layers")):
        theirs = f"backbone.layers.{layer}"
        state[block_path(layer, "ln1.weight")] = source.take(f"{theirs}.norm.weight")
        for name in mixer_parameters:
            state[block_path(layer, f"mixer.{name}")] = source.take(f"{theirs}.mixer.{name}")
    tied = field("tie_word_embeddings")
    if not tied or source.has("lm_head.weight"):
        head = source.take("lm_head.weight")
        if not tied:
            state["unembed.weight"] = head
    source.finish()
    return state


def mixer_parameters(field, always: tuple[str, ...]) -> list[str]:
    """Return the names of a layer's mixer parameters: `always`, and the biases the config's
    ``use_bias`` (in_proj's and out_proj's) and ``use_conv_bias`` (the convolution's) give."""
    biases = ["in_proj.bias", "out_proj.bias"] if field("use_bias") else []
    return [*always, *biases, *(["conv1d.bias"] if field("use_conv_bias") else [])]
