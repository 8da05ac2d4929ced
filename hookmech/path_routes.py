"""What travels along a path, in the model's own terms: the model's side of path patching
(`hookmech.patching.path_patch`, docs/guide.md §10).

A path patch carries the clean run's value of a *sender* (a hook at some positions) to a
*receiver* (a hook at some positions) along one route only; every other quantity is the corrupt
run's. This file says, for each route (``via``), which hook the path changes and by how much:

    resid   a residual-stream site of layer a -> ``L{b}.block_in``, b > a: the sender's
            clean-minus-corrupt value is added to the residual entering block b at its own
            position (the sublayers in between do not see it);
    head    a head's output inside layer a's mixer -> a q/k/v-like input inside layer b's, b > a:
            the mixer's output with that head clean, minus the corrupt output, is added to the
            residual entering block b, which goes through block b's norm into its mixer, whose
            receiver hook is recomputed (the head-to-head path of Wang et al. 2022);
    state   position i's write into layer l's recurrent state -> what position j reads of it: the
            mixer's own computation (`PathRoutes.state_path`);
    conv    position i's input of layer l's short convolution -> its output at j, one tap
            (`PathRoutes.conv_path`).

The backbone's part (the residual stream, the blocks' norms) is here; what happens inside a mixer
is the mixer's (its `PathRoutes`, `hookmech/mixers/capabilities.py`). `HookedLM.path_ends` and
`HookedLM.path_change` are the entry points the patching engine calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from .errors import UsageError, suggest
from .hook_names import MIXER, RESIDUAL_PARTS, HookName, block_hook, hook_attribute, mixer_hook, parse_hook
from .hooks import axes_of, pos_axis_of
from .mixers.base import Mixer
from .mixers.capabilities import PathRoutes, require
from .shapes import RunActs, RunMask
from .sites import hook_to_site


class _Block(Protocol):
    """What this file reads of a block: its mixer and the norm before it."""

    @property
    def mixer(self) -> Mixer: ...

    @property
    def ln1(self) -> nn.Module: ...


class _Config(Protocol):
    @property
    def mixers(self) -> tuple[str, ...]: ...


@runtime_checkable
class PathModel(Protocol):
    """What this file reads of the model: `hookmech.model.HookedLM` (which imports this file)."""

    @property
    def blocks(self) -> Sequence[_Block]: ...

    @property
    def cfg(self) -> _Config: ...

    @property
    def hook_dict(self) -> dict[str, Any]: ...

    def hooks(self, *args: Any, **kwargs: Any) -> AbstractContextManager[Any]: ...


#: the routes a path patch can take (``--via``)
VIA = ("resid", "head", "state", "conv")
#: block-level hooks on the residual stream or written into it: where a `resid` path may start
#: (as hook attributes of a block: ``hook_resid_pre`` ...)
RESIDUAL_WRITES = tuple(hook_attribute(part) for part in (*RESIDUAL_PARTS, "mixer_out", "mlp_out"))

#: what `path_change` reads: ``acts(hook, which)`` -> the hook's activations of the "clean" or
#: "corrupt" run, ``[N, ...]`` on the model's device
ActsReader = Callable[[str, str], Tensor]


@dataclass(frozen=True)
class PathEnds:
    """One checked path: its route, its two ends (hook names), the hook whose value the path
    replaces at the receiver's positions (`patched`: the receiver itself, or, for a state, the
    hook holding what each position reads out of it), and the hooks whose activations of both
    runs `path_change` reads."""

    via: str
    sender: str
    receiver: str
    patched: str
    reads: tuple[str, ...]


def path_ends(model: PathModel, via: str, sender: str, receiver: str) -> PathEnds:
    """Return the `PathEnds` of a path from hook `sender` to hook `receiver` along `via`, or raise
    a UsageError saying why no such path exists (an unknown route, a route the mixer does not
    have, ends in the wrong order or of the wrong kind)."""
    if via not in VIA:
        raise UsageError(f"unknown path kind {via!r}{suggest(via, VIA)} (available: {', '.join(VIA)})")
    send, receive = parse_hook(sender), parse_hook(receiver)
    if via == "resid":
        send_part, receive_part = _block_part(send), _block_part(receive)
        if send is None or send.layer is None or send_part is None or hook_attribute(send_part) not in RESIDUAL_WRITES:
            raise UsageError(
                f"a resid path starts at a residual-stream site of a layer (block_in, resid_mid, block_out, "
                f"mixer_out, mlp_out), not {hook_to_site(sender)}"
            )
        if receive is None or receive_part != "resid_pre":
            raise UsageError(f"a resid path ends at a block's input L{{b}}.block_in, not {hook_to_site(receiver)}")
        _check_order(sender, receiver, send.layer, receive.layer)
        return PathEnds(via, sender, receiver, receiver, (sender,))
    send_inside, receive_inside = _mixer_inside(send), _mixer_inside(receive)
    if send_inside is None or receive_inside is None:
        raise UsageError(
            f"a {via} path runs between hooks inside mixers (L{{l}}.mixer.NAME), not "
            f"{hook_to_site(sender)} -> {hook_to_site(receiver)}"
        )
    send_layer, receive_layer = _layer(sender), _layer(receiver)
    send_mixer, receive_mixer = _routes(model, send_layer, via), _routes(model, receive_layer, via)
    mixer_in = block_hook(receive_layer, "mixer_in")
    if via == "head":
        _check_declared(model, send_layer, send_inside, send_mixer.head_outputs, via, "head outputs", sender)
        _check_declared(model, receive_layer, receive_inside, receive_mixer.head_inputs, via, "head inputs", receiver)
        _check_order(sender, receiver, send_layer, receive_layer)
        reads = (sender, block_hook(send_layer, "mixer_in"), block_hook(receive_layer, "resid_pre"))
        return PathEnds(via, sender, receiver, receiver, reads)
    if send_layer != receive_layer:
        raise UsageError(
            f"a {via} path stays inside one layer's mixer: {hook_to_site(sender)} and "
            f"{hook_to_site(receiver)} are in layers {send_layer} and {receive_layer}"
        )
    if via == "state":
        state_hooks = model.blocks[send_layer].mixer.state_hooks
        _check_declared(model, send_layer, send_inside, state_hooks, via, "state hooks", sender)
        _check_declared(model, send_layer, receive_inside, state_hooks, via, "state hooks", receiver)
        patched = mixer_hook(send_layer, send_mixer.state_readout)
        return PathEnds(via, sender, receiver, patched, (mixer_in,))
    convs = send_mixer.conv_hooks()
    _check_declared(model, send_layer, receive_inside, tuple(convs), via, "short-convolution outputs", receiver)
    senders = convs[receive_inside]
    if send_inside not in senders:
        raise UsageError(
            f"{hook_to_site(sender)} is not the input of the convolution of {hook_to_site(receiver)}; "
            f"name it {' or '.join(f'L{send_layer}.mixer.{name}' for name in senders)}"
        )
    return PathEnds(via, sender, receiver, receiver, (mixer_in,))


@torch.no_grad()
def path_change(
    model: PathModel, ends: PathEnds, acts: ActsReader, senders: RunMask, head: int | None = None
) -> RunActs:
    """Return the change ``[N, pos, ...]`` of hook `ends.patched` along the path `ends` when the
    sender is the clean run's at the `senders` positions ``[N, pos]`` (and only in its head `head`
    when given, for a `head` path): exactly zero where the path does not reach. `acts(hook,
    which)` gives the activations of `ends.reads` for "clean" and "corrupt" ``[N, ...]``."""
    if head is not None and ends.via != "head":
        raise UsageError(f"a {ends.via} path carries the whole {hook_to_site(ends.sender)}, not one head of it")
    if ends.via == "resid":
        clean, corrupt = acts(ends.sender, "clean"), acts(ends.sender, "corrupt")
        return torch.where(senders[..., None], clean - corrupt, torch.zeros_like(corrupt))
    if ends.via == "head":
        return _head_change(model, ends, acts, senders, head)
    layer = _layer(ends.receiver)
    mixer = _routes(model, layer, ends.via)
    clean, corrupt = (acts(block_hook(layer, "mixer_in"), which) for which in ("clean", "corrupt"))
    if ends.via == "state":
        return mixer.state_path(clean, corrupt, senders)
    receiver = _mixer_inside(parse_hook(ends.receiver))
    assert receiver is not None  # path_ends checked it
    return mixer.conv_path(receiver, clean, corrupt, senders)


def _head_change(model: PathModel, ends: PathEnds, acts: ActsReader, senders: Tensor, head: int | None) -> Tensor:
    """The change of the receiver of a `head` path: the sender mixer's output with the sender
    head clean minus its output with nothing changed (the same computation, so that positions
    the head does not reach change by exactly zero) goes into the residual entering the
    receiver's block, through its norm, into its mixer."""
    send_layer, receive_layer = _layer(ends.sender), _layer(ends.receiver)
    point = model.hook_dict[ends.sender]
    clean = acts(ends.sender, "clean")
    mask = _sender_mask(senders, clean.shape, point, head, ends.sender)
    mixer_in = acts(block_hook(send_layer, "mixer_in"), "corrupt")

    def sender_hook(activation: Tensor, hook=None) -> Tensor:
        return torch.where(mask, clean.to(activation.dtype), activation)

    send_block = model.blocks[send_layer]
    with model.hooks(fwd_hooks=[(ends.sender, sender_hook)]):
        patched_out = send_block.mixer(mixer_in)
    with model.hooks(fwd_hooks=[(ends.sender, lambda activation, hook=None: activation)]):
        base_out = send_block.mixer(mixer_in)
    # a head output reaches the mixer's output at its own position only (`PathRoutes.head_outputs`)
    change = torch.where(senders[..., None], patched_out - base_out, torch.zeros_like(base_out))
    resid = acts(block_hook(receive_layer, "resid_pre"), "corrupt")
    receive_block = model.blocks[receive_layer]
    received = []
    for written in (change, torch.zeros_like(change)):
        captured: dict[str, Tensor] = {}

        def capture(activation: Tensor, hook=None, captured=captured) -> Tensor:
            captured["value"] = activation
            return activation

        with model.hooks(fwd_hooks=[(ends.receiver, capture)]):
            receive_block.mixer(receive_block.ln1(resid + written))
        received.append(captured["value"])
    # causal: nothing before a row's first sender position changes
    positions = torch.arange(senders.shape[1], device=senders.device)
    first = torch.where(senders, positions, senders.shape[1]).amin(dim=1)
    reached = _sender_mask(
        positions[None, :] >= first[:, None], received[0].shape, model.hook_dict[ends.receiver], None, ends.receiver
    )
    return torch.where(reached, received[0] - received[1], torch.zeros_like(received[1]))


def _sender_mask(senders: Tensor, shape: torch.Size, point, head: int | None, hook: str) -> Tensor:
    """Broadcast a ``[N, pos]`` mask of positions (and the head, if given) against an activation
    of `shape` of hook point `point` (the `hook`)."""
    pos_axis = pos_axis_of(point)
    assert pos_axis is not None  # head outputs have a position axis
    view = [1] * len(shape)
    view[0], view[pos_axis] = shape[0], shape[pos_axis]
    mask = senders.view(view)
    if head is None:
        return mask
    axes = axes_of(point).split()
    if "head" not in axes:
        raise UsageError(f"{hook_to_site(hook)} has no head axis (axes: {' '.join(axes)})")
    head_axis = axes.index("head")
    if not 0 <= head < shape[head_axis]:
        raise UsageError(f"{hook_to_site(hook)}[{head}]: it has {shape[head_axis]} heads")
    heads = torch.zeros(shape[head_axis], dtype=torch.bool, device=senders.device)
    heads[head] = True
    head_view = [1] * len(shape)
    head_view[head_axis] = shape[head_axis]
    return mask & heads.view(head_view)


def _block_part(name: HookName | None) -> str | None:
    """The block part of a block's own hook (``resid_pre``), None for any other hook."""
    return name.part if name is not None and name.layer is not None and name.inside is None else None


def _mixer_inside(name: HookName | None) -> str | None:
    """The name of a hook inside a block's mixer (``q``), None for any other hook."""
    return name.inside if name is not None and name.layer is not None and name.part == MIXER else None


def _layer(hook: str) -> int:
    """The block of an end `path_ends` has checked is inside one."""
    name = parse_hook(hook)
    assert name is not None and name.layer is not None  # path_ends checked it
    return name.layer


def _routes(model: PathModel, layer: int, via: str) -> PathRoutes:
    """Return block `layer`'s mixer as its `PathRoutes`, or raise a UsageError naming the mixer and
    the capability when it has none (a `via` path cannot run inside it)."""
    needed_for = f"a {via} path in layer {layer} (mixer {model.cfg.mixers[layer]!r})"
    return require(model.blocks[layer].mixer, PathRoutes, needed_for, UsageError)


def _check_order(sender: str, receiver: str, send_layer: int, receive_layer: int | None) -> None:
    if receive_layer is None or receive_layer <= send_layer:
        raise UsageError(
            f"the receiver {hook_to_site(receiver)} must be in a later layer than the sender "
            f"{hook_to_site(sender)} (layer {send_layer})"
        )


def _check_declared(
    model: PathModel, layer: int, name: str, declared: tuple[str, ...], via: str, what: str, hook: str
) -> None:
    """Raise a UsageError unless inside hook `name` is among the mixer's `declared` ones."""
    mixer_name = model.cfg.mixers[layer]
    if not declared:
        raise UsageError(f"path kind {via!r} does not exist for mixer {mixer_name!r} (layer {layer}): it has no {what}")
    if name not in declared:
        sites = ", ".join(f"L{layer}.mixer.{d}" for d in declared)
        raise UsageError(
            f"{hook_to_site(hook)} is not one of the {what} of mixer {mixer_name!r} (layer {layer}): {sites}"
        )
