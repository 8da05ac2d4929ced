"""A fresh model's weights, as `ModelConfig.init` names the scheme: "normal" (GPT-2's), "normal-by-name"
(zoology's), "mamba" (mamba-ssm's, which zoology applies to Mamba blocks).

The draws are made in the order the generator was always consumed in (modules in `apply`'s order,
then the output projections in parameter order), so that seeded inits stay bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn


def initialise(model: nn.Module, scheme: str, n_layers: int, output_projections: Callable[[bool], set[str]]) -> None:
    """Draw the weights of `model` (of `n_layers` blocks) in place by `scheme` (`ModelConfig.init`);
    `output_projections(by_reference_name)` returns the names of the weights writing into the
    residual stream (`Block.output_projection_weights`)."""
    if scheme == "mamba":
        model.apply(_init_weights_mamba)
        _redraw_output_projections_mamba(model, output_projections(False), n_layers)
    else:  # "normal" (GPT-2) and "normal-by-name" (zoology): normal 0.02, output projections scaled
        model.apply(_init_weights)
        _rescale_output_projections(model, output_projections(scheme == "normal-by-name"), n_layers)


def _init_weights_mamba(module: nn.Module) -> None:
    # mamba-ssm's _init_weights (zoology's branch for Mamba blocks): Linear weights keep
    # PyTorch's default (Kaiming-uniform) draw, so dt_proj keeps its own; biases are zeroed
    # except those a mixer marks `_no_reinit` (the dt bias)
    if isinstance(module, nn.Linear):
        if module.bias is not None and not getattr(module.bias, "_no_reinit", False):
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


def _redraw_output_projections_mamba(model: nn.Module, declared: set[str], n_layers: int) -> None:
    # mamba-ssm: out_proj (and fc2) redrawn Kaiming-uniform(a=sqrt(5)), then divided by
    # sqrt(n_residuals_per_layer * n_layers); zoology keeps n_residuals_per_layer at 1
    for name, param in model.named_parameters():
        if name in declared:
            nn.init.kaiming_uniform_(param, a=math.sqrt(5))
            with torch.no_grad():
                param.div_(math.sqrt(n_layers))


def _reinit(param: Tensor | None) -> bool:
    # A mixer marks parameters whose own initialisation matters (Mamba's dt bias) with
    # `_no_reinit`, the convention of zoology and mamba-ssm.
    return param is not None and not getattr(param, "_no_reinit", False)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        if _reinit(module.weight):
            nn.init.normal_(module.weight, std=0.02)
        if _reinit(module.bias):
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding) and _reinit(module.weight):
        nn.init.normal_(module.weight, std=0.02)


def _rescale_output_projections(model: nn.Module, declared: set[str], n_layers: int) -> None:
    # Residual branches add up over 2 sublayers per layer; scaling their output
    # projections keeps the residual stream's variance independent of depth.
    # Each sublayer declares its output projections; they are redrawn in parameter order
    # (the order the generator was always consumed in, so seeded inits stay bit-identical).
    std = 0.02 / math.sqrt(2 * n_layers)
    for name, param in model.named_parameters():
        if name in declared:
            nn.init.normal_(param, std=std)
