"""HookedLM: the backbone every architecture shares.

token embedding (+ learned position embedding) -> n pre-norm blocks -> final norm -> LM head.
A block is ``r = r + mixer(norm1(r))`` and, where it has one, ``r = r + mlp(norm2(r))``.
The backbone only reads what each mixer class declares; it never names a mixer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import ModelConfig
from .errors import HookmechError, NoComponentError, UsageError
from .hook_names import (
    FINAL_NORM,
    MIXER,
    TL_ATTN,
    block_aliases,
    block_hook,
    block_path,
    parse_hook,
)
from .hooks import AxisHookPoint, declare_sizes, hooks_silenced
from .initialisation import initialise
from .mixer_patch_effects import MixerPatchEffects
from .mixers import build_mixer, spec_of
from .mixers.base import Mixer, hook_in_use, take_window, window_of
from .mixers.capabilities import AttentionWeights, ExactPatchEffects, MissingCapability, MixerMemo, PatchMemo
from .path_routes import ActsReader, PathEnds, path_change, path_ends
from .shapes import (
    Acts,
    Context,
    HeadResults,
    KeptWindow,
    QueryLogits,
    Resid,
    RowInts,
    RunActs,
    RunMask,
    RunResid,
    Tokens,
    Window,
)
from .tl_compat import ModelOutput, TransformerLensCompat
from .validate import check_tokens


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019), as in mamba-ssm's blocks."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind: str, d_model: int, eps: float = 1e-5) -> nn.LayerNorm | RMSNorm:
    """Return a LayerNorm or RMSNorm over the last axis, with epsilon `eps`."""
    return nn.LayerNorm(d_model, eps=eps) if kind == "layernorm" else RMSNorm(d_model, eps=eps)


class MLP(nn.Module):
    """fc1 -> GELU -> fc2, zoology's state mixer. `act` (`ModelConfig.mlp_act`): the exact GELU,
    or its tanh approximation (GPT-2's ``gelu_new``)."""

    #: as `MixerSpec.output_projections`: the submodule writing into the residual stream
    output_projections = ("fc2",)

    def __init__(self, d_model: int, hidden_mult: int, act: str = "gelu"):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden_mult * d_model)
        self.fc2 = nn.Linear(hidden_mult * d_model, d_model)
        #: F.gelu's `approximate`: "none" (exact) or "tanh"
        self.approximate = "tanh" if act == "gelu_tanh" else "none"

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.neurons(x))

    def neurons(self, x: Acts) -> Acts:
        """Return the hidden activation ``[..., d_mlp]`` of input `x` (TransformerLens's ``mlp.hook_post``)."""
        return F.gelu(self.fc1(x), approximate=self.approximate)

    @property
    def W_in(self) -> Tensor:
        """fc1's weight as TransformerLens lays it out, ``[d_model, d_mlp]``: neuron i reads column i."""
        return self.fc1.weight.T

    @property
    def b_in(self) -> Tensor:
        """fc1's bias ``[d_mlp]`` (TransformerLens's name)."""
        return self.fc1.bias

    @property
    def W_out(self) -> Tensor:
        """fc2's weight as TransformerLens lays it out, ``[d_mlp, d_model]``: neuron i writes row i."""
        return self.fc2.weight.T

    @property
    def b_out(self) -> Tensor:
        """fc2's bias ``[d_model]`` (TransformerLens's name)."""
        return self.fc2.bias


#: the key under which a block's context keeps its mixer's input (`Block.mixer_context`)
MIXER_INPUT = "mixer_in"
#: the key of the base run's mixer output in a context recorded with the run (`collecting_contexts`)
MIXER_OUTPUT = "mixer_out"


class Block(nn.Module):
    """One pre-norm residual block with hooks at every sublayer boundary (docs/sites.md)."""

    #: the block's hook_resid_post is the one residual stream the next block (or the final norm)
    #: reads: what TransformerLens's logit lens asks of a block before it reads one
    hook_out_is_single_residual_stream: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.ln1 = make_norm(cfg.norms[layer], cfg.d_model, cfg.norm_eps)
        self.mixer: Mixer = build_mixer(cfg.mixers[layer], cfg.d_model, cfg.mixer_kwargs[layer], cfg.n_ctx)
        #: what the package knows of the mixer besides its class (its block, its heads: `MixerSpec`)
        self.spec = spec_of(cfg.mixers[layer])
        self.hook_resid_pre = AxisHookPoint()
        self.hook_mixer_in = AxisHookPoint()
        self.hook_mixer_out = AxisHookPoint()
        self.hook_resid_post = AxisHookPoint()
        self.layer = layer
        self.has_mlp = cfg.mlp[layer]
        #: the MLP reads the block's input, beside the mixer (`ModelConfig.parallel_residual`)
        self.parallel = self.has_mlp and cfg.parallel_residual
        #: (n_heads, d_head) of the mixer (`ModelConfig.head_shape`), for its head results
        self.head_shape = cfg.head_shape(layer)
        if self.spec.heads is not None:
            # the head count its spec states, read by the ``[*]`` sites (`hookmech.hooks.axis_size`)
            declare_sizes(self.mixer, head=self.head_shape[0])
        self.contexts: list[Context] | None = None  # see HookedLM.collecting_contexts
        if isinstance(self.mixer, AttentionWeights):
            # TransformerLens's name of the attention module: the mixer itself, as a plain
            # attribute (a submodule of its own would list, save and hook it twice)
            object.__setattr__(self, "attn", self.mixer)
        if self.has_mlp:
            self.ln2 = make_norm(cfg.norms[layer], cfg.d_model, cfg.norm_eps)
            self.mlp = MLP(cfg.d_model, cfg.mlp_hidden_mult, cfg.mlp_act)
            if not self.parallel:  # TransformerLens's parallel blocks have no residual between the sublayers
                self.hook_resid_mid = AxisHookPoint()
            self.hook_mlp_in = AxisHookPoint()
            self.hook_mlp_out = AxisHookPoint()

    def __getattr__(self, name: str) -> Tensor | nn.Module:
        """nn.Module's, except that ``attn`` of a block whose mixer has no attention weights is a
        `MissingCapability` (an AttributeError: ``getattr(block, "attn", None)`` is None) saying so."""
        if name == TL_ATTN:
            raise MissingCapability(
                f"blocks[{self.layer}].attn: block {self.layer}'s mixer ({type(self.mixer).__name__}) has no attention "
                f"weights (only softmax attention has them); its output is {block_hook(self.layer, 'mixer_out')}"
            )
        return super().__getattr__(name)

    @property
    def has_attention_weights(self) -> bool:
        """True where the mixer has TransformerLens's attention weights (``attn``, `AttentionWeights`)."""
        return isinstance(self.mixer, AttentionWeights)

    def tl_attention(self, name: str) -> AttentionWeights:
        """Return ``attn``, the mixer, for TransformerLens's weight `name`; a NoComponentError where
        the mixer has no such weights (only softmax attention has them)."""
        if not isinstance(self.mixer, AttentionWeights):
            raise NoComponentError(
                f"{name}: block {self.layer}'s mixer ({type(self.mixer).__name__}) has no attention weights "
                "(W_Q, W_K, W_V, W_O and their biases: only softmax attention has them), and no blocks[l].attn"
            )
        return self.mixer

    def output_projection_weights(self, by_reference_name: bool = False) -> list[str]:
        """Return the names (inside the block) of the weights its sublayers declare as output
        projections (`MixerSpec.output_projections`, `MLP.output_projections`), e.g. ``mixer.out_proj.weight``;
        with `by_reference_name`, only those the reference init scales (`MixerSpec.reference_scales_output`)."""
        sublayers = [
            ("mixer", self.spec.output_projections),
            *([("mlp", self.mlp.output_projections)] if self.has_mlp else []),
        ]
        if by_reference_name and not self.spec.reference_scales_output:
            sublayers = sublayers[1:]
        return [f"{prefix}.{name}.weight" for prefix, names in sublayers for name in names]

    def forward(self, resid: Resid) -> Resid:
        return self._after_mixer(*self._mix(resid))

    def forward_at(self, resid: Resid, positions: RowInts) -> KeptWindow:
        """Return the block's output at one position per row, ``[batch, 1, d_model]``: the mixer
        runs on every position of `resid` ``[batch, pos, d_model]`` (its hooks, and those before
        it, fire there), what follows it (position-wise) at ``positions[i]`` of row i only."""
        resid, mixer_out = self._mix(resid)
        return self._after_mixer(take_window(resid, positions, 1), take_window(mixer_out, positions, 1))

    def after_mixer_hooked(self) -> bool:
        """Return True when a hook after the mixer's output (resid_mid, mlp_in, mlp_out, resid_post) is in use."""
        points = [self.hook_resid_post]
        if self.has_mlp:
            points += [self.hook_mlp_in, self.hook_mlp_out]
        if self.has_mlp and not self.parallel:
            points.append(self.hook_resid_mid)
        return any(hook_in_use(point) for point in points)

    def _mix(self, resid: Resid) -> tuple[Resid, Resid]:
        """Return (the block's input, the mixer's output) on every position, through their hooks."""
        resid = self.hook_resid_pre(resid)
        mixer_in = self.hook_mixer_in(self.ln1(resid))
        if self.contexts is None:
            mixer_out = self.mixer(mixer_in)
        else:  # HookedLM.collecting_contexts: the mixer's context of this run, from the same pass
            mixer_out, context = self.mixer.forward_with_context(mixer_in)
            self.contexts.append({**self._with_input(context, mixer_in), MIXER_OUTPUT: mixer_out})
        return resid, self.hook_mixer_out(mixer_out)

    def mixer_context(self, mixer_in: RunResid, memo: MixerMemo | None = None) -> Context:
        """Return the context `forward_from` resumes the mixer from (`Mixer.prefix_context`; with
        AtP*'s `memo`, `ExactPatchEffects.patch_context` where the mixer has it), with the mixer's
        input itself where the mixer fires no inside hook on a window."""
        if memo is not None and isinstance(self.mixer, ExactPatchEffects):
            context = self.mixer.patch_context(mixer_in, memo)
        else:
            context = self.mixer.prefix_context(mixer_in)
        return self._with_input(context, mixer_in)

    def _with_input(self, context: Context, mixer_in: Tensor) -> Context:
        if type(self.mixer).window_hooks:
            return context
        return {**context, MIXER_INPUT: mixer_in}

    def forward_from(
        self,
        resid: Window,
        context: Context,
        rows: RowInts,
        start: RowInts,
        keep: RowInts | None = None,
        base_input: bool = False,
    ) -> Window | KeptWindow:
        """Return the block's output on a window of positions (`Mixer.forward_from`): `resid`
        ``[B, W, d_model]`` is the residual at positions ``start[i] ..`` of row ``rows[i]`` of
        the run `context` was made from. With `keep` ``[B]`` (window indices) only those
        positions go on after the mixer, and the output is ``[B, 1, d_model]``.

        `base_input`: `resid` is that run's own residual; then, unless a hook at or before the
        mixer's output is in use, the mixer's output is that run's (when the context holds it)."""
        if base_input and MIXER_OUTPUT in context and not self._mixer_hooked():
            # a patch after the mixer: its input, hence its output, is the base run's
            if keep is None:  # the window's rows and positions only, never whole rows
                mixed = window_of(context[MIXER_OUTPUT], rows, start, resid.shape[1])
            else:
                mixed = window_of(context[MIXER_OUTPUT], rows, start + keep, 1)
            if keep is not None:
                resid = take_window(resid, keep, 1)
            return self._after_mixer(resid, self.hook_mixer_out(mixed))
        resid = self.hook_resid_pre(resid)
        mixer_in = self.hook_mixer_in(self.ln1(resid))
        if self.mixer.inside_hooks_in_use() and not type(self.mixer).window_hooks:
            # an inside hook is patched, and this mixer fires its hooks on whole runs only
            mixed = self.mixer.forward_spliced(mixer_in, context[MIXER_INPUT], rows, start, keep)
        else:
            mixed = self.mixer.forward_from(mixer_in, context, rows, start, keep)
        mixer_out = self.hook_mixer_out(mixed)
        if keep is not None:
            resid = take_window(resid, keep, 1)
        return self._after_mixer(resid, mixer_out)

    def _mixer_hooked(self) -> bool:
        """Return True when a hook at or before the mixer's output (but that output's own) is in use."""
        points = (self.hook_resid_pre, self.hook_mixer_in)
        return any(hook_in_use(point) for point in points) or self.mixer.inside_hooks_in_use()

    # -- each head's share of the mixer's output (TransformerLens's attn.hook_result) ------------
    def head_results(self, mixer_in: Resid, mixer_out: Resid) -> HeadResults:
        """Return ``[batch, pos, head, d_model]``: what each head of the mixer writes into the
        residual stream in the run whose mixer input and output were `mixer_in` and `mixer_out`:
        the output projection applied to the head's part of its input (`MixerSpec.output_head_axes`),
        without the projection's bias (`head_result_bias`), so that the heads sum to the output
        less that bias. Whatever the mixer computes across heads before the projection (Mamba-2's
        gated RMSNorm) is the run's own: the frozen-scale convention of TransformerLens's
        decompositions. A mixer without heads is one head: its output, bias included.

        The projection's input is no hook's, so the mixer runs again on `mixer_in`, with the hooks
        inside it silenced; a HookmechError when that run's output is not `mixer_out` (a run edited
        inside the mixer, whose head results cannot be recomputed from its input)."""
        axes = self.spec.output_head_axes
        if not axes:
            return mixer_out[:, :, None, :]
        projection = self._head_projection()
        captured: list[Tensor] = []
        handle = projection.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
        try:
            with hooks_silenced(self.mixer):
                recomputed = self.mixer(mixer_in)
        finally:
            handle.remove()
        self._check_recomputed(recomputed, mixer_out)
        if len(captured) != 1:
            raise HookmechError(
                f"{type(self.mixer).__name__} called its output projection {len(captured)} times, not once"
            )
        inputs, weight = self._by_head(captured[0], axes), self._by_head(projection.weight, axes)
        return torch.einsum("bphd,mhd->bphm", inputs, weight)

    def _check_recomputed(self, recomputed: Tensor, mixer_out: Tensor) -> None:
        """Raise a HookmechError unless the mixer's output recomputed from its cached input is the
        cached `mixer_out` to float round-off (the recomputation may take another path than the
        run: a scan instead of a loop)."""
        scale = mixer_out.abs().max().item()
        gap = (recomputed.to(mixer_out.dtype) - mixer_out).abs().max().item()
        if gap > 1e-4 * max(scale, 1e-6):
            raise HookmechError(
                f"attn.hook_result of block {self.layer}: the mixer's output recomputed from its cached input "
                f"differs from the cached hook_mixer_out by {gap:.3g} (largest |output| {scale:.3g}): the run was "
                "edited inside the mixer, and head results are computed from the mixer's input; read them from "
                "a cache of an unedited run"
            )

    def head_result_bias(self) -> Tensor:
        """Return what the mixer adds to its heads' `head_results` ``[d_model]``: its output
        projection's bias (zeros without one, or without heads). TransformerLens's b_O."""
        bias = self._head_projection().bias if self.spec.output_head_axes else None
        return torch.zeros_like(self.ln1.weight) if bias is None else bias

    def _head_projection(self) -> nn.Linear:
        """The mixer's one output projection (`MixerSpec.output_projections`)."""
        names = self.spec.output_projections
        projection = getattr(self.mixer, names[0]) if len(names) == 1 else None
        if not isinstance(projection, nn.Linear):
            raise HookmechError(
                f"{type(self.mixer).__name__} declares heads but not one nn.Linear output projection: {names}"
            )
        return projection

    def _by_head(self, flat: Tensor, axes: str) -> Tensor:
        """Return `flat` ``[..., n_heads * d_head]`` as ``[..., head, d_head]``, its last axis laid
        out as `axes` says (`MixerSpec.output_head_axes`)."""
        n_heads, d_head = self.head_shape
        if axes == "head d_head":
            return flat.unflatten(-1, (n_heads, d_head))
        if axes == "d_head head":
            return flat.unflatten(-1, (d_head, n_heads)).transpose(-1, -2)
        raise HookmechError(f"{self.spec.name}'s output_head_axes = {axes!r}: expected 'head d_head' or 'd_head head'")

    def _after_mixer(self, resid: Tensor, mixer_out: Tensor) -> Tensor:
        """Return the block's output given its input `resid` and its mixer's output (position-wise)."""
        if not self.has_mlp:
            return self.hook_resid_post(resid + mixer_out)
        if self.parallel:  # the MLP reads the block's input (GPT-NeoX's and TransformerLens's order of adds)
            mlp_out = self.hook_mlp_out(self.mlp(self.hook_mlp_in(self.ln2(resid))))
            return self.hook_resid_post(resid + mlp_out + mixer_out)
        resid = self.hook_resid_mid(resid + mixer_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.hook_mlp_in(self.ln2(resid))))
        return self.hook_resid_post(resid + mlp_out)


class FinalNorm(nn.Module):
    """The final norm, with `hook_normalized` (TransformerLens's `ln_final.hook_normalized`)."""

    def __init__(self, kind: str, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.norm = make_norm(kind, d_model, eps)
        self.hook_normalized = AxisHookPoint()

    def forward(self, resid: Tensor) -> Tensor:
        return self.hook_normalized(self.norm(resid))


class TiedUnembed(nn.Module):
    """The LM head of a model whose head is tied to its token embedding: ``resid @ W_E.T``, with
    no parameter of its own (`HookedLM.unembed` of such a model, as TransformerLens calls it)."""

    embed: nn.Embedding

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        # a plain attribute, not a submodule: the weight is saved once, as the embedding's
        object.__setattr__(self, "embed", embed)

    def forward(self, resid: Tensor) -> Tensor:
        return resid @ self.embed.weight.T


class HookedLM(TransformerLensCompat[Block], MixerPatchEffects[Block]):
    """A causal language model whose every intermediate activation is a named hook.

    A TransformerLens `HookedRootModule` whose ``cfg`` answers what TransformerLens's code reads
    (`ModelConfig`); what else its code and users call on a model is `hookmech.tl_compat`'s and
    `hookmech.tl_weights`' (docs/guide.md §6: which of its tools run on which mixer)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self._cfg = cfg.held_by(self)
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.hook_embed = AxisHookPoint()
        if cfg.pos_emb == "learned":
            self.pos_embed = nn.Embedding(cfg.n_ctx, cfg.d_model)
            self.hook_pos_embed = AxisHookPoint()
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        self.ln_final = FinalNorm(cfg.final_norm, cfg.d_model, cfg.norm_eps)
        #: the LM head, ``ln_final(resid) -> logits`` (`W_U`): a tied head has no weight of its own
        self.unembed: nn.Linear | TiedUnembed = (
            TiedUnembed(self.embed) if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)
        )
        self._initialise()
        self.setup()

    @property
    def cfg(self) -> ModelConfig:
        """The model's config: equal to the one it was built from, and held by this model, so
        that its `ModelConfig.device` is this model's (also in a copy or an unpickled model)."""
        cfg = self._cfg
        if cfg.holder() is not self:  # a deep copy or an unpickled model: take its own copy
            cfg = self._cfg = cfg.held_by(self)
        return cfg

    def setup(self) -> None:
        """TransformerLens's `setup` (`mod_dict` and `hook_dict`, the hooks in forward order),
        plus the hook aliases of the mixers' specs (`MixerSpec.hook_aliases`): in `mod_dict`,
        so that `run_with_hooks`/`hooks`/`add_hook` take them by name, never in `hook_dict`
        (each hook is listed, cached and patched under its own name once)."""
        super().setup()
        #: alias hook name -> the hook name it stands for (e.g. blocks.0.hook_attn_out -> blocks.0.hook_mixer_out)
        self.hook_aliases: dict[str, str] = {}
        for layer, block in enumerate(self.blocks):
            declared = block.spec.hook_aliases(block.mixer)  # attribute names: hook_attn_out -> hook_mixer_out
            named = block_aliases(layer, declared)  # the same as hook names, in the same order
            for (alias, hook), (name, target) in zip(declared.items(), named.items(), strict=True):
                if name in self.mod_dict or target not in self.hook_dict:
                    raise HookmechError(
                        f"{type(block.mixer).__name__} declares the hook alias {alias} for {hook}, "
                        f"but its block {'already has a ' + alias if name in self.mod_dict else 'has no ' + hook}"
                    )
                self.hook_aliases[name] = target
                self.mod_dict[name] = self.hook_dict[target]

    # -- initialisation (ModelConfig.init; hookmech/initialisation.py) ---------------------
    def _initialise(self) -> None:
        initialise(self, self.cfg.init, self.cfg.n_layers, self._output_projection_names)

    def _output_projection_names(self, by_reference_name: bool = False) -> set[str]:
        return {
            block_path(layer, name)
            for layer, block in enumerate(self.blocks)
            for name in block.output_projection_weights(by_reference_name)
        }

    # -- forward ------------------------------------------------------------------------
    def embed_tokens(self, tokens: Tokens) -> Resid:
        """Return the residual stream entering block 0, ``[batch, pos, d_model]``."""
        if tokens.shape[1] > self.cfg.n_ctx:
            raise UsageError(f"sequence of {tokens.shape[1]} tokens exceeds n_ctx {self.cfg.n_ctx}")
        resid = self.hook_embed(self.embed(tokens))
        if self.cfg.pos_emb == "learned":
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            resid = resid + self.hook_pos_embed(self.pos_embed(positions).expand_as(resid))
        return resid

    def unembed_resid(self, resid: Tensor) -> Tensor:
        """Return logits ``[..., d_vocab]`` of a final-normed residual ``[..., d_model]``."""
        return resid @ self.embed.weight.T if self.cfg.tie_embeddings else self.unembed(resid)

    def forward(
        self,
        input: Tokens | Resid,
        return_type: str | None = "logits",
        loss_per_token: bool = False,
        *,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        positions: RowInts | None = None,
        tail_at_positions: bool = False,
    ) -> ModelOutput:
        """Run the model.

        `return_type`, `loss_per_token`: TransformerLens's ("logits", "loss", "both", None;
        `TransformerLensCompat.model_output`); a loss is of the tokens' next-token predictions,
        so it needs tokens and every position's logits (not with the three options below).

        `input` is tokens ``[batch, pos]``, or, with `start_at_layer=l`, the residual
        stream entering block l ``[batch, pos, d_model]`` (hooks of block l fire on it).
        Returns logits ``[batch, pos, d_vocab]``; with `positions` ``[batch]`` only the
        logits at each row's position, ``[batch, d_vocab]``; with `stop_at_layer=l` the
        residual entering block l instead of logits.

        `tail_at_positions` (with `positions`): what follows the last block's mixer, all of it
        position-wise (its MLP, the final norm), runs at `positions` only, unless a hook there
        is in use (then every position, as without it). The logits are the same computation on
        fewer rows (equal to float rounding); the patching engine asks for it, training does not.
        """
        self.check_return_type(return_type, start_at_layer, stop_at_layer, positions)
        if start_at_layer is None:  # an id outside the vocabulary: an IndexError on CPU, a device assert on CUDA
            check_tokens(input, self.cfg, "HookedLM")
        resid = self.embed_tokens(input) if start_at_layer is None else input
        blocks = list(self.blocks[start_at_layer or 0 : stop_at_layer])
        if tail_at_positions and positions is not None and stop_at_layer is None and not self._tail_hooked():
            for block in blocks[:-1]:
                resid = block(resid)
            resid = blocks[-1].forward_at(resid, positions) if blocks else take_window(resid, positions, 1)
            return self.unembed_resid(self.ln_final(resid)[:, 0])
        for block in blocks:
            resid = block(resid)
        if stop_at_layer is not None:
            return resid
        normed = self.ln_final(resid)
        if positions is not None:
            return self.unembed_resid(normed[torch.arange(normed.shape[0], device=normed.device), positions])
        return self.model_output(self.unembed_resid(normed), input, return_type, loss_per_token)

    def _tail_hooked(self) -> bool:
        """Return True when a hook after the last block's mixer (or the final norm's) is in use."""
        return self.blocks[-1].after_mixer_hooked() or hook_in_use(self.ln_final.hook_normalized)

    # -- resuming a run from a position (the patching engine's fast path) -----------------
    def layer_context(self, layer: int, mixer_in: RunResid) -> Context:
        """Return block `layer`'s mixer context of a run whose mixer input was `mixer_in`
        ``[N, T, d_model]`` (`Mixer.prefix_context`), for `resume`."""
        return self.blocks[layer].mixer_context(mixer_in)

    def layer_patch_context(self, layer: int, mixer_in: RunResid, memo: PatchMemo) -> Context:
        """Return `layer_context(layer, mixer_in)` for AtP*, made from what its exact computations on
        that run keep in `memo` where the mixer can (`ExactPatchEffects.patch_context`)."""
        return self.blocks[layer].mixer_context(mixer_in, memo.of_layer(layer))

    @contextmanager
    def collecting_contexts(self) -> Iterator[dict[int, list[Context]]]:
        """Within the `with` block every forward also records each block's mixer context of its
        run (`Mixer.forward_with_context`: computed in the same pass where the mixer can).
        Yields ``{layer: [context of each forward, in call order]}``."""
        collected: dict[int, list[Context]] = {layer: [] for layer in range(self.cfg.n_layers)}
        for layer, block in enumerate(self.blocks):
            block.contexts = collected[layer]
        try:
            yield collected
        finally:
            for block in self.blocks:
                block.contexts = None

    def resume(
        self,
        resid: Window,
        start_at_layer: int,
        contexts: dict[int, Context],
        rows: RowInts,
        start: RowInts,
        query: RowInts,
        unembed: bool = True,
        joining: list[int] | None = None,
    ) -> QueryLogits:
        """Return the logits at `query` ``[B, d_vocab]`` of a run resumed on a window (`unembed`
        False: the final-normed residual there ``[B, d_model]``, for `unembed_resid`).

        `resid` ``[B, W, d_model]`` is the residual entering block `start_at_layer`
        (`n_layers` = the final norm's input) at positions ``start[i] .. start[i] + W - 1`` of
        row ``rows[i]`` of a base run; `contexts[l]` is block l's `layer_context` of that
        run, for every l >= start_at_layer. Valid for causal mixers when the positions before
        ``start[i]`` are the base run's in every layer (e.g. after a patch at start[i] or
        later) and ``start[i] <= query[i] < start[i] + W``. Block hooks and the final norm's
        hook fire on the window (``[B, W, ...]``), or, after the last mixer, on the query
        only (``[B, 1, ...]``); hooks inside a mixer fire on the window too
        (`Mixer.window_hooks`), or, for a mixer without, on the whole run's T positions.

        `joining` ``[n_layers - start_at_layer]``: rows that join at later blocks (several
        patches' runs in one forward): block l runs the first ``joining[l - start_at_layer]``
        rows, and row i's `resid` is its residual entering the first block that runs it.
        """
        keep = query - start
        last = self.cfg.n_layers - 1
        joined = resid if joining is None else resid[: joining[0]]
        for layer in range(start_at_layer, self.cfg.n_layers):
            block, n_rows = self.blocks[layer], len(joined)
            if joining is not None and joining[layer - start_at_layer] > n_rows:
                n_rows = joining[layer - start_at_layer]
                joined = torch.cat([joined, resid[len(joined) : n_rows]])
            # only the first block's rows all enter it with the base run's own residual
            keep_here, base_input = (keep[:n_rows] if layer == last else None), layer == start_at_layer
            joined = block.forward_from(
                joined, contexts[layer], rows[:n_rows], start[:n_rows], keep_here, base_input=base_input
            )
        resid = joined
        if start_at_layer == self.cfg.n_layers:
            resid = take_window(resid, keep, 1)
        normed = self.ln_final(resid)[:, 0]
        return self.unembed_resid(normed) if unembed else normed

    def state_reader(self, hook_name: str) -> Callable[[Context, RowInts, RowInts], Tensor] | None:
        """Return a reader of state hook `hook_name` (``blocks.{l}.mixer.hook_<state>``, one of the
        mixer's `state_hooks`) from block l's recorded context: ``read(context, rows, positions)`` ->
        ``[B, ...]``, what the hook fired with at ``positions[i]`` of row ``rows[i]`` of the run the
        context was made from (`Mixer.state_from_context`); None for any other hook."""
        parsed = parse_hook(hook_name)
        if parsed is None or parsed.layer is None or parsed.part != MIXER or parsed.inside is None:
            return None
        mixer = self.blocks[parsed.layer].mixer
        name = parsed.inside
        if name not in type(mixer).state_hooks:
            return None
        return lambda context, rows, positions: mixer.state_from_context(name, context, rows, positions)

    # -- one position patched, through the next mixer exactly (AtP*; its mixers' part: mixer_patch_effects.py)
    def patch_to_next_mixer(
        self, hook_name: str, values: Tensor, base: Callable[[str], Tensor], at: RowInts | None = None
    ) -> tuple[int, RunResid, RunResid | None] | None:
        """Follow a patch of `hook_name` to the input of the next mixer, every position at once.

        `values` ``[N, T, ...]`` is what the hook takes at each position, `base(hook)` the base
        run's activation of any hook ``[N, T, ...]``. Everything from a block-level hook to the
        next mixer is position-wise (norms, the MLP, residual adds), so patching every position
        at once gives, at each position s, what patching s alone gives there. Returns
        ``(L, resid, mixer_in)``: the next mixer's block L, the residual entering block L and
        that mixer's input ``[N, T, d_model]`` at every position under its own patch; after the
        last block's mixer ``(n_layers, resid, None)``, the residual entering the final norm,
        and with `at` ``[N]`` only at position ``at[n]`` of each row (``[N, 1, d_model]``: all a
        read-out there needs); None for hooks that are not block-level (embeddings, inside a
        mixer, the final norm).
        """
        parsed = parse_hook(hook_name)
        if parsed is None or parsed.layer is None or parsed.inside is not None:
            return None
        layer, name = parsed.layer, parsed.part
        block = self.blocks[layer]
        if name == "resid_pre":
            return layer, values, block.ln1(values)
        if name == "mixer_in":
            return layer, base(block_hook(layer, "resid_pre")), values
        if at is not None and layer + 1 == self.cfg.n_layers:  # past the last mixer: at `at` alone
            values, base = take_window(values, at, 1), _at_positions(base, at)
        out = self._after_hook(layer, name, values, base)
        if layer + 1 == self.cfg.n_layers:
            return layer + 1, out, None
        return layer + 1, out, self.blocks[layer + 1].ln1(out)

    def _after_hook(self, layer: int, name: str, values: Tensor, base: Callable[[str], Tensor]) -> Tensor:
        """Return block `layer`'s output ``[N, W, d_model]`` when its hook `name` (a block part after
        the mixer) takes `values` ``[N, W, ...]`` and everything before that hook is the base run's
        (read with `base`, ``[N, W, ...]``; W = T, or 1 at one position per row)."""
        if name == "resid_post":
            return values
        block = self.blocks[layer]
        if name == "mlp_out" and block.parallel:  # the block's input and its mixer's output are the base run's
            return base(block_hook(layer, "resid_pre")) + values + base(block_hook(layer, "mixer_out"))
        if name == "mlp_out":  # the residual before the MLP is the base run's
            return base(block_hook(layer, "resid_mid")) + values
        resid = base(block_hook(layer, "resid_pre"))
        if name == "mixer_out":
            return block._after_mixer(resid, values)
        # resid_mid, mlp_in: the rest of the block, with the hook replaced
        with self.hooks(fwd_hooks=[(block_hook(layer, name), lambda activation, hook=None: values)]):
            return block._after_mixer(resid, base(block_hook(layer, "mixer_out")))

    def resume_layer(self, hook_name: str) -> int | None:
        """Return the block whose resumed run fires `hook_name` (`resume`), `n_layers` for
        the final norm, None for hooks a resumed run does not fire (the embeddings)."""
        if hook_name == FINAL_NORM:
            return self.cfg.n_layers
        parsed = parse_hook(hook_name)
        if parsed is None or parsed.layer is None:
            return None
        if parsed.inside is None or parsed.part == MIXER:  # inside the mixer: Block.forward_from fires it
            return parsed.layer
        return None

    def equivalent_hook(self, hook_name: str) -> str:
        """Return the latest hook whose activation is the same tensor as `hook_name`'s and feeds
        the same computation: block l's output (``hook_resid_post``) is block l+1's input
        (``hook_resid_pre``); any other hook is its own."""
        parsed = parse_hook(hook_name)
        if parsed is not None and parsed.layer is not None and parsed.part == "resid_post" and parsed.inside is None:
            if parsed.layer + 1 < self.cfg.n_layers:
                return block_hook(parsed.layer + 1, "resid_pre")
        return hook_name

    def resid_hook(self, layer: int) -> str:
        """Return the hook holding the residual entering block `layer` (`n_layers`: the final norm's input)."""
        if layer == self.cfg.n_layers:
            return block_hook(layer - 1, "resid_post")
        return block_hook(layer, "resid_pre")

    # -- path patching (the engine's `hookmech.patching.path_patch`; hookmech/path_routes.py) ---
    def path_ends(self, via: str, sender: str, receiver: str) -> PathEnds:
        """Return the checked path from hook `sender` to hook `receiver` along `via` (`path_routes.path_ends`):
        the hook it patches and the hooks it reads; a UsageError if the model has no such path."""
        return path_ends(self, via, sender, receiver)

    def path_change(self, ends: PathEnds, acts: ActsReader, senders: RunMask, head: int | None = None) -> RunActs:
        """Return the change ``[N, pos, ...]`` of `ends.patched` along the path `ends` with the sender
        clean at the `senders` positions ``[N, pos]`` (its head `head` only, if given; `path_routes.path_change`)."""
        return path_change(self, ends, acts, senders, head)


def _at_positions(base: Callable[[str], Tensor], at: RowInts) -> Callable[[str], Tensor]:
    """Return a reader of `base`'s activations ``[N, T, ...]`` at position ``at[n]`` of each row,
    ``[N, 1, ...]``."""
    return lambda hook: take_window(base(hook), at, 1)
