"""The weights of a `HookedLM` by TransformerLens's names: what its ActivationCache, its
`SVDInterpreter` and its users read of a model (docs/guide.md, "TransformerLens's own tools").

The embedding and unembedding (`W_E`, `W_pos`, `W_U`, `b_U`) exist on every model. The attention
weights (`W_Q`, `W_K`, `W_V`, `W_O`, their biases, and the `FactoredMatrix` products `QK` and `OV`)
exist where block l's mixer has TransformerLens's attention heads (the `AttentionWeights`
capability; ``blocks[l].attn`` is that mixer); the MLP weights (`W_in`, `b_in`, `W_out`, `b_out`)
where block l has an MLP. The model's own are stacked over the layers as TransformerLens stacks
them (``W_Q`` ``[n_layers, n_heads, d_model, d_head]``); a model with a block that lacks the part
refuses them with a `NoComponentError` naming the block. Each is a view of the parameters (not a
copy), so gradients reach them; no norm is folded in (the weights are the model's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch
from torch import Tensor, nn
from transformer_lens import FactoredMatrix, HookedRootModule
from transformer_lens.hook_points import HookPoint

from .config import ModelConfig
from .errors import NoComponentError, UsageError
from .hook_names import FINAL_NORM_MODULE, MLP, TL_ATTN, TL_NORMS, block_path
from .mixers.capabilities import ATTENTION_WEIGHTS, AttentionWeights
from .validate import check_tokens

#: TransformerLens's names of an MLP's weights (`hookmech.model.MLP`)
MLP_WEIGHTS = ("W_in", "b_in", "W_out", "b_out")


class Norm(Protocol):
    """What the TransformerLens layer reads of a norm (`hookmech.model.make_norm`: a LayerNorm or an RMSNorm)."""

    @property
    def eps(self) -> float: ...

    @property
    def weight(self) -> Tensor: ...


class NormHolder(Protocol):
    """The final norm's module (`hookmech.model.FinalNorm`): its norm, and its hook on its output."""

    @property
    def norm(self) -> Norm: ...

    @property
    def hook_normalized(self) -> HookPoint: ...

    def __call__(self, resid: Tensor) -> Tensor: ...


class Neurons(Protocol):
    """What the TransformerLens layer reads of an MLP (`hookmech.model.MLP`) besides TransformerLens's weights."""

    @property
    def b_out(self) -> Tensor: ...

    def neurons(self, x: Tensor) -> Tensor: ...


class TLBlock(Protocol):
    """What the TransformerLens layer reads of a block (`hookmech.model.Block`): written here, so
    that this module and `hookmech.tl_compat` need not import the model that inherits them."""

    @property
    def layer(self) -> int: ...

    @property
    def has_mlp(self) -> bool: ...

    @property
    def parallel(self) -> bool: ...

    @property
    def ln1(self) -> Norm: ...

    @property
    def ln2(self) -> Norm: ...

    @property
    def mlp(self) -> Neurons: ...

    @property
    def has_attention_weights(self) -> bool: ...

    def tl_attention(self, name: str) -> AttentionWeights: ...

    def head_result_bias(self) -> Tensor: ...

    def head_results(self, mixer_in: Tensor, mixer_out: Tensor) -> Tensor: ...


#: the model's block class (`hookmech.model.Block`)
BlockT = TypeVar("BlockT", bound=TLBlock)


def _stacked_weight(name: str, shape: str) -> property:
    """A property returning every block's TransformerLens weight `name` stacked over the layers."""

    def read(model: TransformerLensWeights) -> Tensor:
        return model.stacked_weight(name)

    read.__doc__ = f"Every block's `{name}` stacked, ``{shape}`` (TransformerLens's model.{name})."
    return property(read)


class TransformerLensWeights(HookedRootModule, Generic[BlockT]):
    """The part of `HookedLM` that answers TransformerLens's weight names (module docstring)."""

    if TYPE_CHECKING:  # for mypy only: HookedLM's
        embed: nn.Embedding
        pos_embed: nn.Embedding
        unembed: nn.Module
        ln_final: NormHolder

        @property
        def cfg(self) -> ModelConfig: ...

        # `blocks` is an nn.ModuleList (its items typed Module) of Block
        @property
        def blocks(self) -> Sequence[BlockT]: ...

        @blocks.setter
        def blocks(self, value: nn.ModuleList) -> None: ...

    @property
    def W_E(self) -> Tensor:
        """The token embedding ``[d_vocab, d_model]`` (the parameter itself)."""
        return self.embed.weight

    @property
    def W_pos(self) -> Tensor:
        """The learned position embedding ``[n_ctx, d_model]``; a `NoComponentError` for a model
        without one (``pos_emb = "none"``)."""
        if self.cfg.pos_emb != "learned":
            raise NoComponentError(f"W_pos: this model has no position embedding (pos_emb {self.cfg.pos_emb!r})")
        return self.pos_embed.weight

    @property
    def W_U(self) -> Tensor:
        """The unembedding ``[d_model, d_vocab]``: logits = ``ln_final(resid) @ W_U + b_U`` (the
        embedding's transpose when the head is tied, else the LM head's weight transposed)."""
        return self.unembed.weight.T if isinstance(self.unembed, nn.Linear) else self.embed.weight.T

    @property
    def b_U(self) -> Tensor:
        """The unembedding's bias ``[d_vocab]``: zeros (the LM head has none)."""
        return torch.zeros(self.cfg.d_vocab, dtype=self.W_E.dtype, device=self.W_E.device)

    W_Q = _stacked_weight("W_Q", "[n_layers, n_heads, d_model, d_head]")
    W_K = _stacked_weight("W_K", "[n_layers, n_heads, d_model, d_head]")
    W_V = _stacked_weight("W_V", "[n_layers, n_heads, d_model, d_head]")
    W_O = _stacked_weight("W_O", "[n_layers, n_heads, d_head, d_model]")
    b_Q = _stacked_weight("b_Q", "[n_layers, n_heads, d_head]")
    b_K = _stacked_weight("b_K", "[n_layers, n_heads, d_head]")
    b_V = _stacked_weight("b_V", "[n_layers, n_heads, d_head]")
    b_O = _stacked_weight("b_O", "[n_layers, d_model]")
    W_in = _stacked_weight("W_in", "[n_layers, d_model, d_mlp]")
    b_in = _stacked_weight("b_in", "[n_layers, d_mlp]")
    W_out = _stacked_weight("W_out", "[n_layers, d_mlp, d_model]")
    b_out = _stacked_weight("b_out", "[n_layers, d_model]")

    @property
    def QK(self) -> FactoredMatrix:
        """``W_Q @ W_Kᵀ`` per layer and head, ``[n_layers, n_heads, d_model, d_model]`` (a
        TransformerLens `FactoredMatrix`; without biases, the 1/√d_head scale or rotary embeddings)."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """``W_V @ W_O`` per layer and head, ``[n_layers, n_heads, d_model, d_model]`` (a
        TransformerLens `FactoredMatrix`; without biases)."""
        return FactoredMatrix(self.W_V, self.W_O)

    def stacked_weight(self, name: str) -> Tensor:
        """Return TransformerLens's weight `name` of every block (`ATTENTION_WEIGHTS`: of
        ``blocks[l].attn``; `MLP_WEIGHTS`: of ``blocks[l].mlp``) stacked, ``[n_layers, ...]``;
        a NoComponentError naming the first block without that part, or when the layers'
        weights differ in shape (different head counts)."""
        weights = [self._block_weight(layer, name) for layer in range(self.cfg.n_layers)]
        shapes = [tuple(weight.shape) for weight in weights]
        if len(set(shapes)) > 1:
            raise NoComponentError(
                f"W_{name.split('_')[-1]}: this model's layers have {name} of shapes {shapes}, which do not stack; "
                f"read blocks[l].{TL_ATTN if name in ATTENTION_WEIGHTS else MLP}.{name} of each layer"
            )
        return torch.stack(weights)

    def _block_weight(self, layer: int, name: str) -> Tensor:
        """Block `layer`'s TransformerLens weight `name`, or a NoComponentError saying it lacks the part."""
        block, mixer = self.blocks[layer], self.cfg.mixers[layer]
        if name in MLP_WEIGHTS:
            if not block.has_mlp:
                raise NoComponentError(f"{name}: block {layer} ({mixer}) has no MLP, so no {', '.join(MLP_WEIGHTS)}")
            return getattr(block.mlp, name)
        if name not in ATTENTION_WEIGHTS:
            raise UsageError(
                f"{name} is none of TransformerLens's weights {', '.join(ATTENTION_WEIGHTS + MLP_WEIGHTS)}"
            )
        return getattr(block.tl_attention(name), name)

    def tl_parameters(self) -> dict[str, Tensor]:
        """Return ``{TransformerLens's parameter name: tensor}``, what TransformerLens's
        `SVDInterpreter` reads of a model: ``embed.W_E``, ``pos_embed.W_pos`` (learned positions),
        ``unembed.W_U``, ``unembed.b_U``, each block's ``attn.W_Q`` ... ``attn.b_O`` (blocks whose
        mixer has them), ``mlp.W_in`` ... ``mlp.b_out`` (blocks with an MLP), the norms' ``ln1.w``,
        ``ln1.b``, ``ln2.w``, ``ln2.b`` (unfolded: these models keep their norms' weights) and the
        final norm's ``ln_final.w``, ``ln_final.b`` (an RMSNorm has no ``.b``)."""
        params = {"embed.W_E": self.W_E, "unembed.W_U": self.W_U, "unembed.b_U": self.b_U}
        if self.cfg.pos_emb == "learned":
            params["pos_embed.W_pos"] = self.W_pos
        for layer, block in enumerate(self.blocks):
            parts: list[tuple[str, Norm]] = [(TL_NORMS[0], block.ln1)]
            if block.has_attention_weights:
                attention = block.tl_attention(TL_ATTN)
                params.update(
                    {block_path(layer, f"{TL_ATTN}.{name}"): getattr(attention, name) for name in ATTENTION_WEIGHTS}
                )
            if block.has_mlp:
                params.update({block_path(layer, f"{MLP}.{name}"): getattr(block.mlp, name) for name in MLP_WEIGHTS})
                parts.append((TL_NORMS[1], block.ln2))
            for module_name, norm in parts:
                params.update(
                    {block_path(layer, key): value for key, value in _norm_parameters(module_name, norm).items()}
                )
        params.update(_norm_parameters(FINAL_NORM_MODULE, self.ln_final.norm))
        return params

    def tokens_to_residual_directions(self, tokens: int | str | Tensor) -> Tensor:
        """Return the direction in the residual stream whose dot product with the final norm's
        normalised input (centred and divided by the norm's scale, before its weight) is each
        token's logit, less a constant per token: the final norm's weight times the token's
        column of `W_U`, ``[..., d_model]`` for token ids of any shape, ``[d_model]`` for one
        (TransformerLens's shapes). This is what TransformerLens's own models give once the final
        norm is folded into W_U (its default), and what its ``logit_attrs`` needs: for components
        summing to the residual stream, with the run's scale (``ln_final.hook_scale``),
        Σ logit_attrs + ln_final bias · W_U[:, t] + b_U[t] is the logit of t.
        Token ids only (a UsageError for a string: these models have no tokenizer)."""
        if isinstance(tokens, str):
            raise UsageError(
                f"tokens_to_residual_directions: give token ids, not {tokens!r} (hookmech models have no tokenizer)"
            )
        ids = torch.as_tensor(tokens, device=self.W_E.device)
        check_tokens(ids.reshape(1, -1), self.cfg, "tokens_to_residual_directions")
        if ids.numel() == 1:
            ids = ids.reshape(())
        return self.W_U.T[ids] * self.ln_final.norm.weight

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """Return ``[d_model]``: the biases the sublayers before block `layer` add to the residual
        stream apart from their head results and neurons (TransformerLens's `accumulated_bias`,
        the ``bias`` row of ``get_full_resid_decomposition``): each mixer's `Block.head_result_bias`
        and, with `include_mlp_biases`, each MLP's output bias; with `mlp_input` block `layer`'s
        mixer's too."""
        if not 0 <= layer <= self.cfg.n_layers or (mlp_input and layer == self.cfg.n_layers):
            raise UsageError(f"accumulated_bias: layer must be in 0..{self.cfg.n_layers - int(mlp_input)}, got {layer}")
        total = torch.zeros(self.cfg.d_model, dtype=self.W_E.dtype, device=self.W_E.device)
        for block in self.blocks[:layer]:
            total = total + block.head_result_bias()
            if include_mlp_biases and block.has_mlp:
                total = total + block.mlp.b_out
        if mlp_input:
            total = total + self.blocks[layer].head_result_bias()
        return total


def _norm_parameters(module_name: str, norm: Norm) -> dict[str, Tensor]:
    """TransformerLens's names of a norm's weight and bias (``ln1.w``, ``ln1.b``): the bias where it has one."""
    params: dict[str, Tensor] = {f"{module_name}.w": norm.weight}
    bias = getattr(norm, "bias", None)  # an RMSNorm has none
    if bias is not None:
        params[f"{module_name}.b"] = bias
    return params
