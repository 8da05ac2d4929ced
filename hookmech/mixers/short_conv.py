"""Short causal depthwise convolution, shared by the mixers that use one
(attention's q/k/v convolution, Mamba, Based, DeltaNet ...)."""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class ShortConv(nn.Module):
    """Causal depthwise convolution along positions: ``[batch, pos, channels] -> same``.

    Output at position t sees inputs t-kernel_size+1 .. t only (left padding), so the
    mixer stays causal. Parameters are those of an ``nn.Conv1d(groups=channels)``, named
    ``weight [channels, 1, kernel_size]`` and ``bias [channels]`` as in causal-conv1d.
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool = True):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: Tensor) -> Tensor:
        """Return the convolved ``[batch, pos, channels]``."""
        x = x.transpose(1, 2)
        x = F.pad(x, (self.kernel_size - 1, 0))
        y = F.conv1d(x, self.weight, self.bias, groups=x.shape[1])
        return y.transpose(1, 2)
