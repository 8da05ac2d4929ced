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
