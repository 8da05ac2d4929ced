"""The plain reference path patching is tested against, written the way a TransformerLens user
would: full forwards with `run_with_hooks`, loops over rows and positions, recurrences one
position at a time. No module of the library imports it (tests/test_patching_package.py checks
it).

* `path_patch_reference`: path patching (`hookmech.patching.path_patch`) in two passes —
  **record** the receiver's value along the path in a corrupt run with everything off the path
  frozen, then **patch** it into the corrupt run at the receiver's positions and read the
  metric at the query.

How each route is recorded (docs/guide.md §10 defines them):

    resid   the corrupt run with the sender clean at its positions and every sublayer output
            between the sender and the receiver (mixer_out, mlp_out) frozen to the corrupt run's:
            the receiver (a block's input) then differs by the sender's change only;
    head    the same, with the sender one head of a mixer's output and the receiver an input
            hook inside a later mixer;
    conv    the corrupt run with the mixer's input clean at the sender positions, recording the
            convolution's output hook: the input reaches it through position-wise maps and the
            convolution only, so at position j exactly the taps from the sender positions differ;
    state   the recurrence written out position by position from the two runs' hooked
            activations: the corrupt run's transitions, its writes except at the sender
            positions (the clean run's there), its read-out (each mixer's loop:
            `hookmech.oracles.state_loops`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..cache import answer_probs
from ..errors import HookmechError
from ..hook_names import MIXER, block_hook, mixer_hook, parse_hook
from ..patching.metrics import corrupt_answers
from ..patching.targets import Target, parse_sites
from ..sites import PositionPatch, position_patches
from ..tasks.batch import Batch
from .plain_loop import plain_metric
from .state_loops import STATE_LOOPS

__all__ = ["path_patch_reference"]


@torch.no_grad()
def path_patch_reference(
    model, batch: Batch, sender: str, receiver: str, via: str, metric: str = "p_answer"
) -> dict[tuple[str, str], dict[str, float]]:
    """Return ``{(sender label, receiver label): {"p_clean", "p_corrupt", "p_patched",
    "metric_clean", "metric_corrupt", "metric_patched"}}`` (means over rows) for the path from
    `sender` to `receiver` (``SITE@POS`` each: one site, optionally one head; any position
    spec) along `via`, labels as `hookmech.patching.path_patch` writes them (``L0.mixer.z[0]@key``)."""
    (send_target, send_patches), (receive_target, receive_patches) = (
        _endpoint(spec, model, batch) for spec in (sender, receiver)
    )
    rows, query = torch.arange(len(batch)), batch.query_pos
    clean_logits, clean = model.run_with_cache(batch.tokens)
    corrupt_logits, corrupt = model.run_with_cache(batch.corrupt_tokens)
    clean_q, corrupt_q = clean_logits[rows, query], corrupt_logits[rows, query]
    other = corrupt_answers(batch, corrupt_q)

    def score(query_logits: Tensor) -> tuple[float, float]:
        return (
            answer_probs(query_logits, batch.answers).double().mean().item(),
            plain_metric(metric, query_logits, batch.answers, other, clean_q).double().mean().item(),
        )

    (p_clean, m_clean), (p_corrupt, m_corrupt) = score(clean_q), score(corrupt_q)
    results = {}
    for send_patch in send_patches:
        # pass 1: the receiver's value along the path, at every position
        patched_hook, recorded = _RECORDERS[via](
            model, batch, clean, corrupt, send_target, send_patch.mask, receive_target.hook
        )
        for receive_patch in receive_patches:
            # pass 2: the corrupt run with the receiver replaced at its positions
            hook = _write_at(recorded, receive_patch.mask, receive_target.head, model.hook_dict[patched_hook])
            logits = model.run_with_hooks(batch.corrupt_tokens, fwd_hooks=[(patched_hook, hook)])
            p_patched, m_patched = score(logits[rows, query])
            key = (f"{send_target.site_label}@{send_patch.label}", f"{receive_target.site_label}@{receive_patch.label}")
            results[key] = {
                "p_clean": p_clean,
                "p_corrupt": p_corrupt,
                "p_patched": p_patched,
                "metric_clean": m_clean,
                "metric_corrupt": m_corrupt,
                "metric_patched": m_patched,
            }
    return results


def _endpoint(spec: str, model, batch: Batch) -> tuple[Target, list[PositionPatch]]:
    site, _, position = spec.partition("@")
    (patch_site,) = parse_sites(site, model)
    (target,) = patch_site.targets
    return target, position_patches(position, batch.roles, batch.lengths, batch.tokens.shape[1])


def _write_at(values: Tensor, mask: Tensor, head: int | None, point) -> Callable:
    """A forward hook writing `values` ``[N, T, ...]`` at the masked (row, position) pairs (and
    the head), one by one."""
    head_axis = point.axes.split().index("head") if head is not None else None

    def hook(activation: Tensor, hook=None) -> Tensor:
        activation = activation.clone()
        for row, position in mask.nonzero().tolist():
            index: list[Any] = [row, position] + [slice(None)] * (activation.dim() - 2)
            if head_axis is not None:
                index[head_axis] = head
            activation[tuple(index)] = values[tuple(index)]
        return activation

    return hook


def _frozen(corrupt_value: Tensor) -> Callable:
    """A forward hook replacing a whole activation by the corrupt run's."""
    return lambda activation, hook=None: corrupt_value


def _layer(hook: str) -> int:
    parsed = parse_hook(hook)
    assert parsed is not None and parsed.layer is not None  # both ends of a path are in blocks
    return parsed.layer


def _record(model, tokens: Tensor, hooks: list, name: str) -> Tensor:
    """Run `tokens` with `hooks` and return the activation of hook `name`."""
    captured = {}

    def capture(activation: Tensor, hook=None) -> None:
        captured["value"] = activation.clone()

    model.run_with_hooks(tokens, fwd_hooks=[*hooks, (name, capture)])
    return captured["value"]


def _frozen_between(model, corrupt, sender: str, receive_layer: int) -> list:
    """Freeze every sublayer output after `sender` and before block `receive_layer`'s input: in the
    sender's own block, those after it in the forward (block_in < mixer < mixer_out < resid_mid <
    mlp_out < block_out), then every later block's mixer_out and mlp_out."""
    parsed = parse_hook(sender)
    assert parsed is not None and parsed.layer is not None  # a sender is in a block
    send_layer = parsed.layer
    own = {"resid_pre": ["mixer_out", "mlp_out"], "mixer_out": ["mlp_out"], "resid_mid": ["mlp_out"]}
    inside_mixer = parsed.part == MIXER and parsed.inside is not None
    outs = own.get(parsed.part, []) if parsed.inside is None else ["mlp_out"] if inside_mixer else []
    after = [block_hook(send_layer, out) for out in outs]
    after += [
        block_hook(layer, out) for layer in range(send_layer + 1, receive_layer) for out in ("mixer_out", "mlp_out")
    ]
    return [(hook, _frozen(corrupt[hook])) for hook in after if hook in model.hook_dict]


def _record_resid(model, batch, clean, corrupt, target: Target, senders: Tensor, receiver: str):
    point = model.hook_dict[target.hook]
    hooks = [
        (target.hook, _write_at(clean[target.hook], senders, None, point)),
        *_frozen_between(model, corrupt, target.hook, _layer(receiver)),
    ]
    return receiver, _record(model, batch.corrupt_tokens, hooks, receiver)


def _record_head(model, batch, clean, corrupt, target: Target, senders: Tensor, receiver: str):
    point = model.hook_dict[target.hook]
    hooks = [
        (target.hook, _write_at(clean[target.hook], senders, target.head, point)),
        *_frozen_between(model, corrupt, target.hook, _layer(receiver)),
    ]
    return receiver, _record(model, batch.corrupt_tokens, hooks, receiver)


def _record_conv(model, batch, clean, corrupt, target: Target, senders: Tensor, receiver: str):
    mixer_in = block_hook(_layer(receiver), "mixer_in")
    hooks = [(mixer_in, _write_at(clean[mixer_in], senders, None, model.hook_dict[mixer_in]))]
    return receiver, _record(model, batch.corrupt_tokens, hooks, receiver)


def _record_state(model, batch, clean, corrupt, target: Target, senders: Tensor, receiver: str):
    layer = _layer(receiver)
    mixer = model.blocks[layer].mixer
    loop = STATE_LOOPS.get(model.cfg.mixers[layer])
    if loop is None:
        raise HookmechError(
            f"mixer {model.cfg.mixers[layer]!r} has no state loop in hookmech.oracles.state_loops (STATE_LOOPS)"
        )
    return mixer_hook(layer, mixer.state_readout), loop(
        mixer, lambda name, which: (clean if which == "clean" else corrupt)[mixer_hook(layer, name)], senders
    )


_RECORDERS = {"resid": _record_resid, "head": _record_head, "conv": _record_conv, "state": _record_state}
