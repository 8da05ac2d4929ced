"""TransformerLens's idioms on a `HookedLM`: its `run_with_hooks` and `run_with_cache` (with
gradients, ``incl_bwd=True``), ``model(tokens, return_type="loss")``, ``to_tokens`` and
``to_str_tokens``, and the `ActivationCache` that answers TransformerLens's names (docs/guide.md,
"TransformerLens's own tools").

`TransformerLensCompat` is the part of `HookedLM` that TransformerLens's code and its users call
(the weights are `hookmech.tl_weights`'); `AliasedActivationCache` is what its `run_with_cache`
returns. What a model lacks (an MLP, a head hook, a block norm of the kind TransformerLens would
apply) is refused in one line, a `NoComponentError` naming the part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformer_lens import ActivationCache, head_detector
from transformer_lens import patching as tl_patching
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities import get_act_name, lm_cross_entropy_loss

from .errors import HookmechError, NoComponentError, UsageError, unknown
from .hook_names import (
    FINAL_NORM_MODULE,
    MIXER,
    MLP,
    MLP_PARTS,
    TL_ATTN,
    TL_NORMS,
    TL_POST,
    TL_RESULT,
    TL_SCALE,
    block_hook,
    layer_of,
    needs_mlp,
    parse_hook,
    sublayer_hook,
)
from .shapes import Acts, Logits, QueryLogits, Resid
from .tl_weights import BlockT, Norm, TransformerLensWeights
from .validate import check_tokens
from .vocabulary import Vocabulary, vocabulary_of


def norm_scale(norm: Norm, x: Acts) -> Acts:
    """Return what `norm` divides `x` ``[batch, pos, d_model]`` by, ``[batch, pos, 1]``:
    sqrt(variance + eps) for a LayerNorm (after centring), sqrt(mean square + eps) for an
    RMSNorm (TransformerLens's ``hook_scale``)."""
    if isinstance(norm, nn.LayerNorm):
        x = x - x.mean(-1, keepdim=True)
    return (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()


def norm_kind(norm: Norm) -> str:
    """Return TransformerLens's name of `norm`'s kind (`ModelConfig.normalization_type`): "LN" or "RMS"."""
    return "LN" if isinstance(norm, nn.LayerNorm) else "RMS"


class AliasedActivationCache(ActivationCache):
    """TransformerLens's `ActivationCache`, whose keys are the model's hook names, that also
    answers to TransformerLens's names for the rest of what its methods look up (by full name or
    TransformerLens's shorthand, ``cache["attn_out", 0]``):

    - the model's hook aliases (`HookedLM.hook_aliases`): ``cache["blocks.0.hook_attn_out"]`` is
      ``cache["blocks.0.hook_mixer_out"]``;
    - what no hook holds, computed from the cached hooks on each read
      (`HookedLM.derived_activation`): norm scales, head results, MLP neurons;
    - a part the model does not have (a Mamba block's MLP, a head hook of a mixer without
      heads): a `NoComponentError` saying so in one line.

    Keys, length and iteration are the hooks' own."""

    def __getitem__(self, key):
        if isinstance(key, str) and key in self.cache_dict:
            return self.cache_dict[key]
        model = getattr(self, "model", None)
        if model is None or not hasattr(model, "hook_aliases"):
            return super().__getitem__(key)
        name = self._full_name(key)
        if name in self.cache_dict:
            return self.cache_dict[name]
        model.check_heads_uniform(name.removesuffix(GRAD_SUFFIX))
        if name in model.hook_aliases:
            return self.cache_dict[model.hook_aliases[name]]
        if name.endswith(GRAD_SUFFIX) and name.removesuffix(GRAD_SUFFIX) in model.hook_aliases:
            return self.cache_dict[model.hook_aliases[name.removesuffix(GRAD_SUFFIX)] + GRAD_SUFFIX]
        derived = model.derived_activation(name, self._read)
        if derived is not None:
            return derived if self.has_batch_dim else derived[0]
        missing = model.missing_component(name)
        if missing is not None:
            raise missing
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        """True for what `cache[key]` returns: a hook, an alias of one, or a value computed from
        the cached hooks (computing it, for the last)."""
        if key in self.cache_dict:
            return True
        try:
            self[key]
        except (KeyError, HookmechError):
            return False
        return True

    def _full_name(self, key) -> str:
        """Return the hook name `key` means: itself, or TransformerLens's name for its shorthand
        (``"attn_out"``, ``("resid_pre", -1)``: a negative layer counts from the last, as TL does)."""
        if isinstance(key, str):
            return get_act_name(key)
        if len(key) > 1 and key[1] is not None and key[1] < 0:
            key = (key[0], self.model.cfg.n_layers + key[1], *key[2:])
        return get_act_name(*key)

    def _read(self, hook: str) -> Tensor:
        """Return the cached activation of `hook` with its batch axis (added back where the
        cache's was removed), for `HookedLM.derived_activation`."""
        if hook not in self.cache_dict:
            raise KeyError(
                f"{hook} is not in this cache (a names_filter left it out), and what was asked is computed from it"
            )
        activation = self.cache_dict[hook]
        return activation if self.has_batch_dim else activation[None]

    def _uses_ln_centering(self, layer: int | None) -> bool:
        # TransformerLens (>= 4.3) asks whether the norm before `layer` centres (a LayerNorm) by its
        # one normalization_type, the final norm's: each of these models' norms answers for itself,
        # so that apply_ln_to_stack(layer=l) on a Mamba block's RMSNorm under a final LayerNorm is that RMSNorm
        blocks = self.model.blocks
        norm = self.model.ln_final.norm if layer is None or not 0 <= layer < len(blocks) else blocks[layer].ln1
        return norm_kind(norm) == "LN"

    def _ensure_head_results(self) -> bool:
        # TransformerLens computes head results from attn.hook_z and blocks[l].attn.W_O, which
        # only attention has; here they are computed on each read (`Block.head_results`)
        return True

    def compute_head_results(self) -> None:
        """Do nothing: head results (``blocks.{l}.attn.hook_result``) are computed on each read,
        from the cached mixer input (`Block.head_results`), and never stored in the cache."""

    def apply_slice_to_batch_dim(self, batch_slice):
        """TransformerLens's `apply_slice_to_batch_dim`, returning an `AliasedActivationCache`."""
        sliced = super().apply_slice_to_batch_dim(batch_slice)
        return AliasedActivationCache(sliced.cache_dict, self.model, has_batch_dim=sliced.has_batch_dim)


#: what a forward returns: logits (of every position, or of one per row), a residual stream
#: (`stop_at_layer`), a loss, ``(logits, loss)``, or None (TransformerLens's `return_type`)
ModelOutput = Logits | QueryLogits | Resid | Tensor | tuple[Logits, Tensor] | None
#: TransformerLens's `forward(return_type=...)`: what a run returns (`TransformerLensCompat.model_output`)
RETURN_TYPES = ("logits", "loss", "both", None)
#: how TransformerLens's SSM bridges name the hooks of their mixers (``mixer.hook_ssm_out``, ``hook_ssm_state``)
TL_SSM_PREFIX = "ssm_"
#: the suffix TransformerLens gives a hook's gradient in a cache (``run_with_cache(incl_bwd=True)``)
GRAD_SUFFIX = "_grad"


class TransformerLensCompat(TransformerLensWeights[BlockT]):
    """The part of `HookedLM` TransformerLens's code and its users call (module docstring)."""

    #: what `vocabulary` is made from (`set_vocabulary`), or the vocabulary once made; None: none
    vocabulary_source: Any = None

    if TYPE_CHECKING:  # HookedLM's
        hook_aliases: dict[str, str]

        def resid_hook(self, layer: int) -> str: ...

    def run_with_hooks(self, *model_args: Any, **kwargs: Any) -> Any:
        """Run the model with `fwd_hooks` and `bwd_hooks` attached; return its output (`ModelOutput`:
        what `forward` returns for the arguments).

        TransformerLens's own, after two checks that turn its raw errors into a UsageError: the
        tokens (`check_tokens`, unless the input is a residual stream given with `start_at_layer`)
        and every hook named in `fwd_hooks` and `bwd_hooks` (a hook name or alias of this model;
        a filter function is TransformerLens's to apply).
        """
        self._check_model_input("run_with_hooks", model_args, kwargs)
        hooks = [*kwargs.get("fwd_hooks", ()), *kwargs.get("bwd_hooks", ())]
        for name, function in hooks:
            if not callable(function):
                shown = name if isinstance(name, str) else "a filter"
                raise UsageError(f"run_with_hooks: the hook for {shown} is a {type(function).__name__}, not a function")
        for name in (name for name, _ in hooks if isinstance(name, str)):
            if name not in self.mod_dict or not isinstance(self.mod_dict[name], HookPoint):
                raise unknown("hook", name, [*self.hook_dict, *self.hook_aliases])
            self.check_heads_uniform(name)
        return super().run_with_hooks(*model_args, **kwargs)

    def check_heads_uniform(self, name: str) -> None:
        """Raise a NoComponentError for TransformerLens's per-head name `name` (``attn.hook_*``)
        on a model whose layers differ in head count: TransformerLens sizes every layer's head
        axis by one `cfg.n_heads` (layer 0's), so its head sweeps and labels would silently skip
        or mislabel the other layers' heads."""
        parsed = parse_hook(name)
        if parsed is None or parsed.part != TL_ATTN:
            return
        counts = [self.cfg.head_shape(layer)[0] for layer in range(self.cfg.n_layers)]
        if len(set(counts)) > 1:
            raise NoComponentError(
                f"{name}: this model's layers have {counts} heads, and TransformerLens's per-head tools "
                f"size every layer by one n_heads ({counts[0]}); use hookmech's own names "
                "(blocks.{l}.mixer.hook_*) and `hookmech patch` for per-head patches"
            )

    def _check_model_input(self, caller: str, model_args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """`check_tokens` on the input of `caller` unless it is a residual stream (`start_at_layer`)."""
        if kwargs.get("start_at_layer") is not None:
            return
        if not model_args and "input" not in kwargs:
            raise UsageError(f"{caller}: give the tokens [batch, pos] to run the model on")
        check_tokens(model_args[0] if model_args else kwargs["input"], self.cfg, caller)

    def run_with_cache(
        self, *model_args: Any, return_cache_object: bool = True, **kwargs: Any
    ) -> tuple[Any, AliasedActivationCache | dict[str, Tensor]]:
        """Run the model, returning ``(output, cache)`` (the output: `ModelOutput`, what `forward`
        returns for the arguments).

        As TransformerLens's HookedTransformer: the cache is an `ActivationCache` (an
        `AliasedActivationCache`, which also answers to `hook_aliases`) unless
        `return_cache_object=False` (then a plain dict of hook name -> tensor). A `names_filter`
        given as a name or a list of names may use hook aliases; the cache keys them by the
        hooks' own names. Tokens are checked first (`check_tokens`; a UsageError).
        With ``incl_bwd=True`` the output, which must be the mean loss (``return_type="loss"``),
        is backpropagated and each hook's gradient is in the cache as ``{hook}_grad``, as
        TransformerLens keeps it (an alias's too: ``blocks.0.hook_attn_out_grad``).
        """
        self._check_model_input("run_with_cache", model_args, kwargs)
        if kwargs.get("incl_bwd") and (kwargs.get("return_type") != "loss" or kwargs.get("loss_per_token")):
            raise UsageError(
                "run_with_cache(incl_bwd=True) backpropagates the model's output, which must be one number: "
                "give return_type='loss' (the mean loss)"
            )
        names_filter = kwargs.get("names_filter")
        if isinstance(names_filter, str):
            kwargs["names_filter"] = self.hook_aliases.get(names_filter, names_filter)
        elif isinstance(names_filter, (list, tuple)):
            kwargs["names_filter"] = [self.hook_aliases.get(name, name) for name in names_filter]
        output, cache_dict = super().run_with_cache(*model_args, **kwargs)
        if not return_cache_object:
            return output, cache_dict
        return output, AliasedActivationCache(cache_dict, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))

    def model_output(
        self, logits: Logits, tokens: Tensor, return_type: str | None, loss_per_token: bool
    ) -> Logits | Tensor | tuple[Logits, Tensor] | None:
        """Return what TransformerLens's ``forward(return_type=...)`` returns for the run of
        `tokens` ``[batch, pos]`` whose logits are `logits` ``[batch, pos, d_vocab]``: "logits"
        the logits, "loss" the mean cross-entropy of each next token (``[batch, pos - 1]`` with
        `loss_per_token`: TransformerLens's `lm_cross_entropy_loss`), "both" ``(logits, loss)``,
        None nothing."""
        if return_type == "logits":
            return logits
        if return_type is None:
            return None
        loss = lm_cross_entropy_loss(logits, tokens, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def check_return_type(self, return_type: str | None, *other_outputs: Any) -> None:
        """Raise a UsageError unless `return_type` is one of TransformerLens's (`RETURN_TYPES`) and,
        unless it is "logits", the forward's `other_outputs` options (`start_at_layer`,
        `stop_at_layer`, `positions`) are all None: a loss is of a run of tokens to every
        position's logits."""
        if return_type not in RETURN_TYPES:
            raise UsageError(f"return_type must be one of {', '.join(map(repr, RETURN_TYPES))}, got {return_type!r}")
        if return_type != "logits" and any(option is not None for option in other_outputs):
            raise UsageError(
                f"return_type={return_type!r} is for a run of tokens to the logits of every position: "
                "not with start_at_layer, stop_at_layer or positions"
            )

    # -- text (TransformerLens's to_tokens, to_string, to_str_tokens; hookmech.vocabulary) ---------
    def set_vocabulary(self, source: Any) -> None:
        """Give the model the vocabulary `to_tokens` and `to_string` use: a task (its token names),
        a tokenizer or its path, or the `d_vocab` token names (`vocabulary_of`; made on first use)."""
        self.vocabulary_source = source

    @property
    def vocabulary(self) -> Vocabulary:
        """The model's `Vocabulary` (`set_vocabulary`); a UsageError where it has none."""
        source = self.vocabulary_source
        if source is None:
            raise UsageError(
                "this model has no vocabulary: give it its task's, model.set_vocabulary(task) (a checkpoint's: "
                "hookmech.tasks.from_checkpoint(path)), or load a pretrained folder with a tokenizer"
            )
        vocabulary = vocabulary_of(source, self.cfg.d_vocab)
        self.vocabulary_source = vocabulary
        return vocabulary

    def to_tokens(self, input: str | list[str], prepend_bos: bool | None = None) -> Tensor:
        """Return the token ids ``[batch, pos]`` (int64, on the model's device) of a text or a list
        of texts of as many tokens each (no padding). A BOS is prepended only with
        `prepend_bos=True` (a task's texts write it: ``"BOS k1 v2 DIV k1"``); a UsageError where the
        vocabulary has none, for a word outside it, or for texts of different lengths."""
        texts = [input] if isinstance(input, str) else list(input)
        rows = [self.vocabulary.encode(text) for text in texts]
        if prepend_bos:
            bos = self.vocabulary.bos_id
            if bos is None:
                raise UsageError("to_tokens: prepend_bos=True, but this model's vocabulary has no BOS token")
            rows = [[bos, *row] for row in rows]
        if not rows or len({len(row) for row in rows}) != 1 or not rows[0]:
            raise UsageError(
                f"to_tokens: give texts of one token count each, at least one; got {[len(r) for r in rows]}"
            )
        return torch.tensor(rows, dtype=torch.int64, device=self.cfg.device)

    def to_string(self, tokens: Tensor | list[int]) -> str | list[str]:
        """Return the text of token ids ``[pos]`` (a string) or ``[batch, pos]`` (one per row)."""
        ids = torch.as_tensor(tokens)
        if ids.dim() == 2:
            return [self.vocabulary.decode(row) for row in ids.tolist()]
        return self.vocabulary.decode(ids.reshape(-1).tolist())

    def to_str_tokens(self, input: str | Tensor | list[int], prepend_bos: bool | None = None) -> list[str]:
        """Return the text of each token of a text, or of token ids ``[pos]`` or ``[1, pos]``."""
        ids = self.to_tokens(input, prepend_bos) if isinstance(input, str) else torch.as_tensor(input)
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise UsageError(f"to_str_tokens: give one row of tokens, got shape {list(ids.shape)}")
        return self.vocabulary.token_texts(ids.reshape(-1).tolist())

    def layer_of_hook(self, hook_name: str) -> int | None:
        """Return l for a hook inside ``blocks.{l}``, None for hooks outside the blocks."""
        return layer_of(hook_name)

    def derived_activation(self, name: str, read: Callable[[str], Tensor]) -> Tensor | None:
        """Return TransformerLens's activation `name` that no hook holds, computed from the
        activations of a run (``read(hook)`` -> ``[batch, pos, ...]``), or None for any other name
        (and for a part the block lacks: `missing_component` says so):

        - ``ln_final.hook_scale``, ``blocks.{l}.ln1.hook_scale``, ``ln2.hook_scale``: the norm's
          divisor on its input ``[batch, pos, 1]`` (`norm_scale`). TransformerLens applies every norm
          as `ModelConfig.normalization_type` (the final norm's kind) says: a block norm of the other
          kind (Mamba's RMSNorm under a final LayerNorm) is a `NoComponentError`;
        - ``blocks.{l}.attn.hook_result``: each head's share of the mixer output ``[batch, pos,
          head, d_model]`` (`Block.head_results`);
        - ``blocks.{l}.mlp.hook_post``: the MLP's hidden activation ``[batch, pos, d_mlp]``.
        """
        parsed = parse_hook(name)
        if parsed is None or parsed.inside not in (TL_SCALE, TL_RESULT, TL_POST):
            return None
        if parsed.layer is None:
            if (parsed.part, parsed.inside) != (FINAL_NORM_MODULE, TL_SCALE):
                return None
            return norm_scale(self.ln_final.norm, read(self.resid_hook(self.cfg.n_layers)))
        layer = parsed.layer
        if layer >= self.cfg.n_layers or (needs_mlp(parsed) and not self.blocks[layer].has_mlp):
            return None
        block, part = self.blocks[layer], (parsed.part, parsed.inside)
        if part == (TL_NORMS[0], TL_SCALE):
            return self._block_norm_scale(name, block.ln1, read(block_hook(layer, "resid_pre")))
        if part == (TL_NORMS[1], TL_SCALE):
            ln2_input = block_hook(layer, "resid_pre" if block.parallel else "resid_mid")
            return self._block_norm_scale(name, block.ln2, read(ln2_input))
        if part == (TL_ATTN, TL_RESULT):
            self.check_heads_uniform(name)
            return block.head_results(read(block_hook(layer, "mixer_in")), read(block_hook(layer, "mixer_out")))
        if part == (MLP, TL_POST):
            return block.mlp.neurons(read(block_hook(layer, "mlp_in")))
        return None

    def _block_norm_scale(self, name: str, norm: Norm, resid: Resid) -> Tensor:
        """`norm_scale` of a block norm; refused where TransformerLens would apply it as the other kind
        (a TransformerLens without `ActivationCache._uses_ln_centering`, which the cache answers per norm)."""
        if norm_kind(norm) != self.cfg.normalization_type and not hasattr(ActivationCache, "_uses_ln_centering"):
            raise NoComponentError(
                f"{name}: this block's norm is {type(norm).__name__}, but TransformerLens's apply_ln applies "
                f"every norm as the final one (cfg.normalization_type {self.cfg.normalization_type!r}): "
                "apply the final norm instead (layer None or n_layers)"
            )
        return norm_scale(norm, resid)

    def missing_component(self, name: str) -> NoComponentError | None:
        """Return the error for TransformerLens's name `name` of a part of block l that it lacks,
        one line saying what is missing: the MLP's hooks (`MLP_PARTS`, ``mlp.*``, ``ln2.*``) of a
        block without one (Mamba's), an ``attn.*`` name the block's mixer does not answer to (the
        head output ``attn.hook_z`` of a mixer without heads); None for any other name."""
        parsed = parse_hook(name)
        if parsed is None or parsed.layer is None or parsed.layer >= self.cfg.n_layers:
            return None
        layer, mixer = parsed.layer, self.cfg.mixers[parsed.layer]
        if needs_mlp(parsed) and not self.blocks[layer].has_mlp:
            return NoComponentError(
                f"{name}: block {layer} ({mixer}) has no MLP, so it has no {', '.join(MLP_PARTS)} "
                "or MLP norm; TransformerLens's MLP sweeps and names do not apply to it "
                "(hookmech.tl_compat.get_act_patch_block_every sweeps the parts it has)"
            )
        if parsed.part == "resid_mid" and parsed.inside is None and self.blocks[layer].parallel:
            return NoComponentError(
                f"{name}: block {layer} is a parallel block (parallel_residual): its MLP reads the block's input "
                "beside the mixer, so there is no residual between them (hook_resid_mid), as in TransformerLens"
            )
        if parsed.part == TL_ATTN:
            known = [alias for alias in self.hook_aliases if _in_sublayer(alias, layer, TL_ATTN)]
            known.append(sublayer_hook(layer, TL_ATTN, TL_RESULT))
            return NoComponentError(
                f"{name}: block {layer}'s mixer ({mixer}) has no such hook; of TransformerLens's attn names "
                f"it answers to {', '.join(known)}"
            )
        if parsed.part == MIXER and parsed.inside is not None and parsed.inside.startswith(TL_SSM_PREFIX):
            known = [hook for hook in [*self.hook_dict, *self.hook_aliases] if _is_tl_ssm_name(hook, layer)]
            return NoComponentError(
                f"{name}: block {layer}'s mixer ({mixer}) has no such hook; of TransformerLens's SSM names "
                f"(mixer.hook_ssm_*) it answers to {', '.join(known) or 'none: it is no state-space model'}"
            )
        return None


def _is_tl_ssm_name(hook_name: str, layer: int) -> bool:
    """Return True where `hook_name` is a hook (or alias) of block `layer`'s mixer named as
    TransformerLens's SSM bridges name theirs (``mixer.hook_ssm_out``)."""
    parsed = parse_hook(hook_name)
    return (
        parsed is not None
        and (parsed.layer, parsed.part) == (layer, MIXER)
        and (parsed.inside or "").startswith(TL_SSM_PREFIX)
    )


def _in_sublayer(hook_name: str, layer: int, sublayer: str) -> bool:
    """Return True where `hook_name` is a hook of module `sublayer` of block `layer`."""
    parsed = parse_hook(hook_name)
    return parsed is not None and parsed.layer == layer and parsed.part == sublayer and parsed.inside is not None


#: the parts TransformerLens's `get_act_patch_block_every` patches, in its order, and its sweep of each
BLOCK_EVERY_SWEEPS: dict[str, Callable[..., Any]] = {
    "resid_pre": tl_patching.get_act_patch_resid_pre,
    "attn_out": tl_patching.get_act_patch_attn_out,
    "mlp_out": tl_patching.get_act_patch_mlp_out,
}


def block_every_parts(model: TransformerLensCompat) -> tuple[str, ...]:
    """Return the parts `get_act_patch_block_every` patches on `model`: ``resid_pre``, ``attn_out``
    (the mixer's output) and, where every block has an MLP, ``mlp_out``."""
    parts = tuple(BLOCK_EVERY_SWEEPS)
    return parts if all(block.has_mlp for block in model.blocks) else parts[:2]


def get_act_patch_block_every(
    model: TransformerLensCompat,
    corrupted_tokens: Tensor,
    clean_cache: ActivationCache,
    metric: Callable,
    **kwargs: Any,
) -> Any:
    """Return TransformerLens's `patching.get_act_patch_block_every` ``[part, n_layers, pos]`` for
    the parts `model` has (`block_every_parts`): its own result (3 parts; a `PatchingResult` with
    its `reduce` or `baseline` options) where every block has an MLP; on a model whose blocks
    lack one (Mamba's) its resid_pre and attn_out sweeps stacked (2 parts), where
    TransformerLens's own refuses the missing MLP."""
    parts = block_every_parts(model)
    if len(parts) == len(BLOCK_EVERY_SWEEPS):
        return tl_patching.get_act_patch_block_every(model, corrupted_tokens, clean_cache, metric, **kwargs)
    results = [BLOCK_EVERY_SWEEPS[part](model, corrupted_tokens, clean_cache, metric, **kwargs) for part in parts]
    if not all(isinstance(result, Tensor) for result in results):
        raise UsageError(
            f"get_act_patch_block_every: {', '.join(kwargs)} give PatchingResults, which do not stack: "
            f"call transformer_lens.patching's sweeps of {', '.join(parts)} one by one"
        )
    return torch.stack(results)


class _TorchDtypeConfig:
    """A model's config that answers ``dtype`` as a torch dtype (TransformerLens's), the rest as itself."""

    def __init__(self, cfg: Any):
        self._cfg = cfg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self._cfg.dtype)


class _TorchDtypeView:
    """A model whose ``cfg.dtype`` is a torch dtype: what TransformerLens's head detector reads."""

    def __init__(self, model: TransformerLensCompat):
        self._model = model
        self.cfg = _TorchDtypeConfig(model.cfg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def detect_head(model: TransformerLensCompat, seq: str | list[str], detection_pattern: Any, **kwargs: Any) -> Tensor:
    """Return TransformerLens's `head_detector.detect_head` ``[n_layers, n_heads]`` on `model`: its own
    function, given the model with ``cfg.dtype`` as the torch dtype it reads (a hookmech config
    records the dtype's name, ``"float32"``, which TransformerLens's own call refuses with a TypeError).
    `seq` is text in the model's vocabulary (`TransformerLensCompat.to_tokens`)."""
    return head_detector.detect_head(_TorchDtypeView(model), seq, detection_pattern, **kwargs)  # type: ignore[arg-type]
