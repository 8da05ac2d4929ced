"""AtP*'s corrupt forward and its backward, resumed at each row's first corrupted token.

Every mixer is causal, so before a row's first corrupted token its clean and corrupt runs are the
same computation: a patch there changes nothing, and every estimate there is 0 whatever the
gradient. The corrupt forward recorded for autograd (`atp_star._Estimator._backward`) then needs
only the positions from that token to the query: it resumes from the clean run's mixer contexts
(`PatchableModel.resume`, the exact engine's fast path), rows grouped by the width of their windows
(`forwards.width_chunks`), and its backward passes run through those windows alone.

What the estimates read of the corrupt run (`ResumedCorruptRun.run`): its activations are the
resumed forward's from the first corrupted token to the query and the clean run's elsewhere, equal
to the corrupt run's before that token and never read after the query (nothing there reaches it);
the gradients are the windows' and zero before them, where every clean − corrupt difference is 0.
The estimates are those of the full corrupt forward to float rounding (a window's products run on
fewer rows; a Mamba state is replayed from the last kept one): tests/test_atp_star_resumed.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..cache import answer_probs
from ..errors import HookmechError
from ..hook_names import MIXER, block_hook, parse_hook
from ..hooks import pos_axis_of
from ..mixers.base import window_index, window_of
from ..shapes import Context
from .forwards import resume_window, waste_floor, width_chunks, window_widths
from .metrics import answer_log_odds
from .protocol import PatchableModel
from .runs import CleanCorruptRuns

#: the parts of the last block a resumed run fires on its window (after its mixer: at the query only)
_LAST_BLOCK_WINDOW_PARTS = ("resid_pre", "mixer_in", "mixer_out", MIXER)


def fires_on_windows(model: PatchableModel, hooks: Sequence[str]) -> bool:
    """Return True when a resumed run fires each of `hooks` with the positions on axis 1: hooks in
    the blocks, but those after the last block's mixer (which a resumed run fires at the query
    alone). A hook inside a mixer that fires its hooks on whole runs only (`Mixer.window_hooks`)
    is found out when it fires (`ResumedCorruptRun.run`)."""
    last = model.cfg.n_layers - 1
    for hook in hooks:
        parsed = parse_hook(hook)
        if parsed is None or parsed.layer is None or pos_axis_of(model.hook_dict[hook]) != 1:
            return False
        if parsed.layer == last and parsed.part not in _LAST_BLOCK_WINDOW_PARTS:
            return False
    return True


def first_corrupted(clean: Tensor, corrupt: Tensor, query: Tensor) -> Tensor:
    """Return ``[n]``: each row's first position where the corrupt tokens ``[n, T]`` differ from the
    clean ones, at most its query `query` ``[n]`` (a row corrupted only after it, or not at all, is
    run at the query alone)."""
    differs = clean != corrupt
    first = torch.where(differs.any(dim=1), differs.int().argmax(dim=1), clean.shape[1])
    return torch.minimum(first, query)


def _fired_at(activation: Tensor, window: Tensor, at_query: Tensor) -> Tensor | None:
    """Return the positions ``[B, W or 1]`` a hook fired at in a resumed run, from its
    `activation` ``[B, W or 1, ...]``: the window `window` ``[B, W]``, or the query `at_query`
    ``[B, 1]`` (the last block's mixer output: what follows it runs there alone); None for
    another shape (a mixer firing its hooks on whole runs)."""
    if activation.shape[:2] == window.shape:
        return window
    if activation.shape[:2] == at_query.shape:
        return at_query
    return None


class ResumedCorruptRun:
    """The corrupt forward of a row chunk, resumed at each row's first corrupted token (module docstring).

    `contexts` are the clean run's mixer contexts of every block (`CleanCorruptRuns.resume_contexts`),
    whose activations `runs` holds of every hook the forward records."""

    def __init__(self, model: PatchableModel, runs: CleanCorruptRuns, contexts: dict[int, dict[str, Tensor]]):
        self.model, self.runs, self.contexts = model, runs, contexts
        self.zeros: dict[str, Tensor] = {}
        self.kept: dict[str, Tensor] = {}
        #: a hook fired on whole runs (`run` returned None): the caller ran the whole forward
        self.fell_back = False

    def agreement(self, rows: slice) -> Callable[[int], tuple[Context, Tensor] | None]:
        """Return ``agreement(layer)`` for the row chunk `rows`' `PatchMemo` (`MixerMemo.agree`):
        the clean run's context of block `layer`'s mixer and each row's first corrupted token
        ``[n]``, before which the corrupt run's activations are the clean run's; None for a block
        without a context, or once the forward fell back to the whole run."""
        batch = self.runs.batch
        first = first_corrupted(batch.tokens[rows], batch.corrupt_tokens[rows], batch.query_pos[rows])
        first = first.to(self.runs.device)

        def of_layer(layer: int) -> tuple[Context, Tensor] | None:
            if self.fell_back or layer not in self.contexts:
                return None
            return {name: value[rows] for name, value in self.contexts[layer].items()}, first

        return of_layer

    def hooks(self, leaves: Sequence[str], recorded: Sequence[str]) -> list[tuple[str, object]]:
        """Return the forward hooks of the resumed runs: each activation of `recorded` is kept,
        each of `leaves` gets a zero added, whose gradient is ∂λ/∂activation. Block 0's input hook
        is always among them: a resumed block whose input hook is not in use takes its mixer's
        output from the context, the clean run's (`Block.forward_from`'s `base_input`), where the
        window's input here is the corrupt tokens'."""
        leaf_names, kept_names = set(leaves), set(recorded)

        def hook_of(name: str):
            def add_zero(activation: Tensor, hook=None) -> Tensor:
                if name in kept_names:
                    self.kept[name] = activation.detach()
                if name in leaf_names:
                    self.zeros[name] = torch.zeros_like(activation, requires_grad=True)
                    activation = activation + self.zeros[name]
                return activation

            return add_zero

        names = dict.fromkeys([block_hook(0, "resid_pre"), *leaves, *recorded])
        return [(name, hook_of(name)) for name in names]

    def run(
        self, rows: slice, leaves: Sequence[str], recorded: Sequence[str], max_batch: int
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]] | None:
        """Return (λ ``[n]``, p(answer) ``[n]`` float64 on the CPU, the corrupt run's activations of
        `recorded` ``{hook: [n, T, ...]}``, their gradients at `leaves` ``{hook: [n, T, ...]}``) of
        the rows `rows` (module docstring); None when a hook does not fire on the windows (a mixer
        firing its hooks on whole runs only): the caller runs the whole forward instead. Call
        within autograd (`torch.enable_grad`) and the hooks `hooks` installed."""
        model, runs, batch, device = self.model, self.runs, self.runs.batch, self.runs.device
        query = batch.query_pos[rows].to(device)
        answers = batch.answers[rows].to(device)
        first = first_corrupted(batch.tokens[rows], batch.corrupt_tokens[rows], batch.query_pos[rows]).to(device)
        with torch.no_grad():
            embedded = model(batch.corrupt_tokens[rows].to(device), stop_at_layer=0)
        acts = {hook: runs.acts(hook, "clean")[rows].clone() for hook in recorded}
        grads = {hook: torch.zeros_like(acts[hook]) for hook in leaves}
        log_odds = torch.empty(len(query), device=device, dtype=torch.promote_types(runs.dtype, torch.float32))
        p_answer = torch.empty(len(query), dtype=torch.float64)
        widths = window_widths(first, query)
        order = torch.sort(widths, stable=True).indices
        in_batch = torch.arange(rows.start, rows.stop, device=device)
        for chunk in width_chunks(widths[order].tolist(), max_batch, waste_floor(embedded.shape[-1])):
            members = order[chunk]
            width, start = resume_window(widths[members], query[members])
            self.zeros, self.kept = {}, {}
            resid = window_of(embedded, members, start, width)
            logits = model.resume(resid, 0, self.contexts, in_batch[members], start, query[members])
            window, at_query = window_index(start, width), query[members, None]
            positions: dict[str, Tensor] = {}
            for hook, kept in self.kept.items():
                fired_at = _fired_at(kept, window, at_query)
                if fired_at is None:
                    self.fell_back = True
                    return None
                positions[hook] = fired_at
            missing = [hook for hook in leaves if hook not in self.zeros]
            if missing:
                raise HookmechError(f"hook {missing[0]} did not fire in the resumed forward pass")
            chunk_odds = answer_log_odds(logits, answers[members])
            found = torch.autograd.grad(chunk_odds.sum(), [self.zeros[hook] for hook in leaves], allow_unused=True)
            for hook, gradient in zip(leaves, found, strict=True):
                if gradient is not None:
                    grads[hook][members[:, None], positions[hook]] = gradient
            for hook, kept in self.kept.items():
                # the corrupt run's own values from its first corrupted token on; the clean run's before it
                where = positions[hook]
                live_row, live_pos = (where >= first[members, None]).nonzero(as_tuple=True)
                acts[hook][members[live_row], where[live_row, live_pos]] = kept[live_row, live_pos]
            log_odds[members] = chunk_odds.detach()
            p_answer[members.cpu()] = answer_probs(logits.detach(), answers[members]).double().cpu()
        self.zeros, self.kept = {}, {}
        return log_odds, p_answer, acts, grads
