"""Building a plug-in mixer (one from outside the package, `external`; `build_plug_in`, which
`hookmech.mixers.build_mixer` calls) and the checks it passes the first time a process builds it:
a broken one is named in one line, and one that reads later positions is refused, since the
patching engine assumes causality (a patch at position p changes nothing before p).

The check runs the freshly built mixer (eval mode, no gradients, the RNG states kept) on a random
``[2, T, d_model]`` input, T = min(n_ctx, 16): its output must be a tensor of the input's shape
and dtype. Then the input is redrawn from a late position p on (p = T - 1, then T // 2): an output
before p that changes by more than `MixerSpec.causal_tolerance` times the output's largest magnitude
is a leak, refused naming the first position it reached (as is an output that changes when the
same input is run twice: the engine compares runs of the same rows). The tolerance (1e-5 by default, the
engine's own exactness) is there for mixers that are causal up to float rounding (FFT
convolutions); a mixer sets it higher (a class attribute ``causal_tolerance`` or its spec's field,
`external`), or to None to skip the check. Registered mixers are tested
by the package's tests instead.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor

from ..errors import HookmechError, UsageError
from .base import Mixer
from .mixer_spec import MixerSpec

#: the most positions the check runs
CHECK_POSITIONS = 16
#: (canonical name, d_model, options) of the plug-in mixers checked in this process
_CHECKED: set[tuple[str, int, str]] = set()


def build_plug_in(name: str, spec: MixerSpec, d_model: int, options: dict[str, Any], n_ctx: int) -> Mixer:
    """Return the plug-in mixer of `spec` (named `name`) built as ``spec.mixer(d_model=d_model,
    **options)``: a constructor that raises (SystemExit included) is one UsageError naming it, and
    its first build in this process for these settings is checked (`check_plug_in`) in a model of
    `n_ctx` positions."""
    try:
        mixer = spec.mixer(d_model=d_model, **options)
    except HookmechError:
        raise
    except (Exception, SystemExit) as error:  # the user's code may raise anything, or exit
        raise UsageError(f"building mixer {name} raised {_described(error)}") from None
    key = (name, d_model, json.dumps(options, sort_keys=True, default=repr))
    if key not in _CHECKED and torch.empty(0).device.type != "meta":  # a meta model only sizes: nothing runs
        check_plug_in(name, mixer, d_model, n_ctx, spec.causal_tolerance)
        _CHECKED.add(key)
    return mixer


def check_plug_in(name: str, mixer: Mixer, d_model: int, n_ctx: int, tolerance: float | None) -> None:
    """Raise a UsageError naming mixer `name` when `mixer` fails on a ``[2, T, d_model]`` input,
    returns anything but a tensor of its shape and dtype, or is not deterministic or not causal up
    to `tolerance` (`MixerSpec.causal_tolerance`; None skips these two; module docstring); return
    None. The caller's RNG states and the mixer's train/eval mode are kept."""
    n_pos = max(1, min(n_ctx, CHECK_POSITIONS))
    parameter = next(mixer.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, n_pos, d_model, generator=generator).to(device)
    was_training = mixer.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            mixer.eval()
            out = _output(name, mixer, x)
            if tolerance is None:  # the mixer's author vouches for it
                return
            _refuse_change(name, out, _output(name, mixer, x), n_pos, tolerance, "running it twice on one input")
            for start in sorted({n_pos - 1, n_pos // 2} - {0}):
                changed = x.clone()
                changed[:, start:] = torch.randn(2, n_pos - start, d_model, generator=generator).to(device)
                changed_out = _output(name, mixer, changed)
                _refuse_change(name, out, changed_out, start, tolerance, f"changing its input from position {start} on")
    finally:
        mixer.train(was_training)


def _output(name: str, mixer: Mixer, x: Tensor) -> Tensor:
    """Return ``mixer(x)``, checked to be a tensor of `x`'s shape and dtype."""
    shape = _shape(x)
    try:
        out = mixer(x)
    except HookmechError:
        raise
    except (Exception, SystemExit) as error:  # RecursionError included
        raise UsageError(f"mixer {name} raised {_described(error)} on an input {shape}") from None
    if not isinstance(out, Tensor):
        raise UsageError(
            f"mixer {name} returned a {type(out).__name__} for input {shape}; "
            "a mixer returns one tensor of its input's shape"
        )
    if out.shape != x.shape:
        raise UsageError(
            f"mixer {name} returned {_shape(out)} for input {shape}; "
            "a mixer maps [batch, pos, d_model] to the same shape"
        )
    if out.dtype != x.dtype:
        raise UsageError(
            f"mixer {name} returned {str(out.dtype).removeprefix('torch.')} for a "
            f"{str(x.dtype).removeprefix('torch.')} input {shape}; a mixer returns its input's dtype"
        )
    return out


def _refuse_change(name: str, out: Tensor, other: Tensor, start: int, tolerance: float, how: str) -> None:
    """Raise a UsageError when `other` (the output after `how`) differs from `out` before position
    `start` by more than `tolerance` x the largest |out|, naming the first position that moved."""
    scale = float(out.abs().max())
    change = (other[:, :start] - out[:, :start]).abs().amax(dim=(0, 2))  # [start]: per position
    moved = (change > tolerance * scale).nonzero()
    if len(moved):
        first = int(moved[0])
        what = "not causal" if start < out.shape[1] else "not deterministic in eval mode"
        raise UsageError(
            f"mixer {name} is {what}: {how} changed its output at position {first} by "
            f"{float(change[first]):.3g} (more than causal_tolerance {tolerance:g} x its largest output {scale:.3g}); "
            "the patching engine assumes a causal, deterministic mixer (a mixer causal up to float rounding "
            "sets causal_tolerance higher, or None to skip this check)"
        )


def _shape(tensor: Tensor) -> str:
    return "[" + ", ".join(str(size) for size in tensor.shape) + "]"


def _described(error: BaseException) -> str:
    """``Type: first line of the message`` (a SystemExit by its code)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
