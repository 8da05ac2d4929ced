"""The option sets the tests build each mixer with, and the inside hooks the benches patch: test and
bench data, kept out of the mixers' modules.

`EXAMPLES`: mixer name -> option sets (the first is its defaults' stand-in: ``{}``, or what a
16-wide model of 12 positions needs); every option that changes a code path. A mixer not listed
(a new one, a plug-in) is built with its defaults: ``({},)`` (`examples_of`).
`BENCH_HOOKS`: mixer name -> the inside hooks the benches patch (its state and its q/k/v-like
hooks); none for a mixer not listed.
"""

from __future__ import annotations

from typing import Any

#: mixer name -> the option sets the tests build it with
EXAMPLES: dict[str, tuple[dict[str, Any], ...]] = {
    "attention": (
        {},
        {"n_heads": 2, "window": 3},
        {"n_heads": 2, "qkv_conv": "qk", "conv_size": 3},
        {"bias": False, "out_bias": False},
        {"n_heads": 2, "rotary_pct": 0.5, "rotary_base": 100.0},
    ),
    "baseconv": (
        {"l_max": 16},
        {"l_max": 16, "kernel_size": 4, "use_act": True},
        {"kernel_size": -1, "l_max": 16},
        {"kernel_size": -1, "l_max": 16, "implicit_long_conv": False, "use_act": True},
    ),
    "based": (
        {},
        {"num_heads": 2, "num_key_value_heads": 2, "feature_dim": 4},
        {"train_view": "linear", "chunk_size": 4},
        {"train_view": "linear", "chunk_size": 1},
    ),
    "deltanet": (
        {},
        {"chunk_size": 4, "num_heads": 2},
        {"mode": "recurrent", "conv_size": 0, "use_beta": False, "output_norm": False},
        {"bias": True, "chunk_size": 4},
    ),
    "gla": (
        {},
        {"num_heads": 2, "chunk_size": 4},
        {"mode": "recurrent", "use_output_gate": False, "expand_k": 1.0, "num_heads": 1},
        {"bias": True, "chunk_size": 5, "clamp_min": -0.05, "gate_logit_normalizer": 1},
        {"use_short_conv": True, "chunk_size": 4},
        {"use_short_conv": True, "conv_size": 2, "conv_bias": True, "mode": "recurrent"},
    ),
    "h3": ({"l_max": 16}, {"l_max": 5, "head_dim": 1}, {"l_max": 16, "d_state": 4, "head_dim": 4}),
    "hyena": (
        {"l_max": 16},
        {"l_max": 16, "filter_bias": True, "short_filter_order": 5},
        {"l_max": 64, "bias": True, "train_filter_z": True, "conv_bias_init": "torch"},
    ),
    "mamba": ({}, {"d_conv": 0}, {"d_conv": 2, "gate": False}),
    "mamba2": (
        {},
        {"d_conv": 0, "chunk_size": 3},
        {"ngroups": 2, "headdim": 8, "chunk_size": 5, "bias": True, "conv_bias": False},
        # transformers' time_step_limit (pretrained Mamba-2 folders): Δ clamped on both sides
        {"ngroups": 4, "headdim": 4, "dt_limit": [0.02, 0.06]},
    ),
    "rwkv": ({}, {"chunk_size": 3}, {"bias": True}),
}

#: mixer name -> the inside hooks the benches patch
BENCH_HOOKS: dict[str, tuple[str, ...]] = {
    "attention": ("q", "k", "v"),
    "baseconv": ("proj", "conv"),
    "based": ("q", "k", "v", "kv_state"),
    "deltanet": ("q", "k", "v", "state"),
    "gla": ("q", "k", "v", "state"),
    "h3": ("q", "k", "v", "kv"),
    "hyena": ("x1", "x2", "v"),
    "mamba": ("B", "C", "ssm_state"),
    "mamba2": ("B", "C", "ssm_state"),
    "rwkv": ("r", "k", "v", "state"),
}


def examples_of(name: str) -> tuple[dict[str, Any], ...]:
    """Return the option sets the tests build mixer `name` with (`EXAMPLES`; ``({},)``: its defaults)."""
    return EXAMPLES.get(name, ({},))
