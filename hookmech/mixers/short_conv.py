"""Short causal depthwise convolution, shared by the mixers that use one
(attention's q/k/v convolution, Mamba, Based, DeltaNet ...)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

#: how a short convolution's bias starts: at zero, or as nn.Conv1d's (the mixers' `conv_bias_init`)
CONV_BIAS_INITS = ("zeros", "torch")


class ShortConv(nn.Module):
    """Causal depthwise convolution along positions: ``[batch, pos, channels] -> same``.

    Output at position t sees inputs t-kernel_size+1 .. t only (left padding), so the
    mixer stays causal. Parameters are those of an ``nn.Conv1d(groups=channels)``, named
    ``weight [channels, 1, kernel_size]`` and ``bias [channels]`` as in causal-conv1d.
    The weight starts as ``nn.Conv1d``'s; the bias at zero, or with ``torch_bias_init=True`` as
    ``nn.Conv1d``'s (uniform in ±1/√kernel_size, drawn after the weight): what zoology's
    convolutions start from, since its model-wide initialisation leaves convolutions alone.
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool = True, torch_bias_init: bool = False):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        if torch_bias_init and self.bias is not None:
            bound = 1 / kernel_size**0.5  # nn.Conv1d: 1/sqrt(fan_in), fan_in = in_channels/groups * kernel_size
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        """Return the convolved ``[batch, pos, channels]``."""
        x = x.transpose(1, 2)
        x = F.pad(x, (self.kernel_size - 1, 0))
        y = F.conv1d(x, self.weight, self.bias, groups=x.shape[1])
        return y.transpose(1, 2)

    def taps(self, change: Tensor) -> Tensor:
        """Return the convolution of `change` ``[batch, pos, channels]`` without the bias, ``[batch,
        pos, channels]``: what a change of the input adds to the output (the convolution is linear).
        Exactly zero wherever no tap reaches a nonzero input."""
        return causal_taps(change, self.weight)

    def forward_from(self, window: Tensor, signal: Tensor, rows: Tensor, start: Tensor) -> Tensor:
        """Return the output at positions ``start[i] .. start[i] + W - 1`` of row ``rows[i]``,
        ``[B, W, channels]``, when the input there is `window` ``[B, W, channels]`` and earlier
        inputs are those of `signal` ``[N, T, channels]`` (an unpatched run's input).

        The resume path of the mixers (`Mixer.forward_from`): only the kernel_size - 1 inputs
        before the window are read from `signal` (zeros before position 0, as the causal padding).
        """
        before = start[:, None] - self.kernel_size + 1 + torch.arange(self.kernel_size - 1, device=start.device)
        earlier = signal[rows[:, None], before.clamp(min=0)].masked_fill((before < 0)[..., None], 0.0)
        inputs = torch.cat([earlier, window.to(signal.dtype)], dim=1).transpose(1, 2)  # [B, C, k-1+W]
        return F.conv1d(inputs, self.weight, self.bias, groups=inputs.shape[1]).transpose(1, 2)


def causal_taps(change: Tensor, weight: Tensor) -> Tensor:
    """Return the causal depthwise convolution of `change` ``[batch, pos, channels]`` by `weight`
    ``[channels, 1, kernel_size]`` (``nn.Conv1d``'s layout, tap k - 1 on the current position),
    without a bias: ``[batch, pos, channels]``."""
    padded = F.pad(change.transpose(1, 2), (weight.shape[-1] - 1, 0))
    return F.conv1d(padded, weight, None, groups=weight.shape[0]).transpose(1, 2)
