"""transformers' ``Mamba2ForCausalLM`` (model_type ``mamba2``) as a `HookedLM`: Mamba's backbone
(`hookmech.pretrained.mamba`: its keys, norms and head) around the `mamba2` mixer, whose parameters
are transformers' own, key for key: ``in_proj, conv1d, dt_bias, A_log, D, norm, out_proj``.

The config's fields become the mixer's options: ``state_size`` d_state, ``conv_kernel`` d_conv,
``expand``, ``head_dim`` headdim (``num_heads`` must be expand · hidden_size / head_dim, as the
mixer derives it), ``n_groups`` ngroups (the heads of a group share its B and C), ``use_bias``
bias, ``use_conv_bias`` conv_bias, ``chunk_size``, and ``time_step_limit`` dt_limit (left out
when it is (0, ∞), which clamps nothing after the softplus; an infinite bound is an unbounded
one, null). transformers' gated norm (`Mamba2RMSNormGated`) gates before it normalises
(mamba-ssm's ``norm_before_gate=False``) over groups of d_inner / n_groups channels, with
``layer_norm_epsilon``: the mixer's `GatedRMSNorm`. The chunk size only groups the chunked SSD's
sums (transformers pads the sequence to a multiple of it, hookmech splits it into equal chunks):
the numbers agree to float round-off at any length. Fields read with transformers' defaults where
a folder leaves them out: `MAMBA2_DEFAULTS`.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ..config import ModelConfig
from ..errors import HookmechError
from ..mixers.mamba2 import GATED_NORM_EPS
from .mamba import backbone_config, backbone_weights, fields_of, mixer_parameters

#: transformers' `Mamba2Config` defaults of the fields read here
MAMBA2_DEFAULTS: dict[str, Any] = {
    "num_heads": 128,
    "head_dim": 64,
    "vocab_size": 32768,
    "hidden_size": 4096,
    "state_size": 128,
    "num_hidden_layers": 64,
    "layer_norm_epsilon": 1e-5,
    "expand": 2,
    "conv_kernel": 4,
    "n_groups": 8,
    "use_bias": False,
    "use_conv_bias": True,
    "hidden_act": "silu",
    "time_step_limit": (0.0, math.inf),
    "chunk_size": 256,
    "tie_word_embeddings": False,
}
#: the parameters of every transformers Mamba-2 mixer (hookmech's `Mamba2` takes them as they are);
#: the biases of in_proj, out_proj and the convolution as the config says
MIXER_WEIGHTS = ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")


def model_config(hf_config: dict[str, Any]) -> ModelConfig:
    """Return the `ModelConfig` of a transformers Mamba-2 ``config.json`` (as a dict): Mamba's
    backbone (`backbone_config`) with one `mamba2` mixer per layer (module docstring)."""
    field = fields_of(hf_config, MAMBA2_DEFAULTS)
    d_inner = field("expand") * field("hidden_size")
    if field("num_heads") * field("head_dim") != d_inner:
        raise HookmechError(
            f"num_heads {field('num_heads')} x head_dim {field('head_dim')} is not expand x hidden_size = {d_inner}"
        )
    if field("num_heads") % field("n_groups"):
        raise HookmechError(f"num_heads {field('num_heads')} is not divisible by n_groups {field('n_groups')}")
    if field("conv_kernel") < 1:
        raise HookmechError(f"conv_kernel = {field('conv_kernel')}: a Mamba-2 layer has a convolution")
    options: dict[str, Any] = {
        "d_state": field("state_size"),
        "d_conv": field("conv_kernel"),
        "expand": field("expand"),
        "headdim": field("head_dim"),
        "ngroups": field("n_groups"),
        "bias": field("use_bias"),
        "conv_bias": field("use_conv_bias"),
        "chunk_size": field("chunk_size"),
    }
    dt_limit = _dt_limit(field("time_step_limit"))
    if dt_limit is not None:
        options["dt_limit"] = dt_limit
    if field("layer_norm_epsilon") != GATED_NORM_EPS:  # the gated norm's too, in transformers
        options["norm_eps"] = field("layer_norm_epsilon")
    return backbone_config(field, "mamba2", options)


def convert_weights(hf_config: dict[str, Any], weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Return `weights` (a transformers Mamba-2 state dict, name -> tensor) under hookmech's names,
    the tensors themselves, for `HookedLM.load_state_dict`; a `WeightsMismatch` naming the keys
    missing or left over (`backbone_weights`)."""
    field = fields_of(hf_config, MAMBA2_DEFAULTS)
    return backbone_weights(field, weights, mixer_parameters(field, MIXER_WEIGHTS))


def _dt_limit(limit: Any) -> list[float | None] | None:
    """Return the mixer's ``dt_limit`` for transformers' ``time_step_limit`` (low, high): None
    where it clamps nothing (low <= 0, high infinite: Δ is a softplus, never negative), else
    [low, high] with None for a bound that clamps nothing. Bounds are numbers, or transformers 5's
    JSON spelling of a non-finite one, ``{"__float__": "Infinity"}``."""
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise HookmechError(f"time_step_limit = {limit!r}: expected [low, high]")
    low, high = (_json_float(bound) for bound in limit)
    bounds = (None if low <= 0 else low, None if math.isinf(high) else high)
    return None if bounds == (None, None) else list(bounds)


def _json_float(value: Any) -> float:
    """Return `value` (a number, or transformers' ``{"__float__": "Infinity"}``) as a float; a
    HookmechError for anything else."""
    spelled = value["__float__"] if isinstance(value, dict) and set(value) == {"__float__"} else value
    number = math.nan
    if isinstance(spelled, (int, float, str)) and not isinstance(spelled, bool):
        try:
            number = float(spelled)
        except ValueError:
            pass
    if math.isnan(number):
        raise HookmechError(f"time_step_limit holds {value!r}, not a number")
    return number
