"""What the package knows of a mixer besides its class, declared once, beside the class: a
`MixerSpec`.

Each mixer's module ends with ``SPEC = MixerSpec(...)``; `hookmech.mixers` collects every module's
``SPEC`` into `SPECS` (and `REGISTRY`, name -> class). From the specs come: the registry, the
head axis of every model (`ModelConfig.head_shape`, ``--n-heads``, the ``[*]`` sites' head count),
the model presets (`hookmech.model_presets`), the block around the mixer (its norm, MLP,
position embedding, init and output projections: `hookmech.config`, `hookmech.model`), its
TransformerLens names, the site reference and the mixer table of the docs
(``scripts/make_site_reference.py``), the benches' mixer lists and the tests' parametrisation.
Options and their types are the class's constructor signature; a spec does not repeat them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..errors import HookmechError
from ..hook_names import block_part_aliases, hook_attribute, mixer_output_aliases, tl_attention_aliases
from .base import mixer_options

if TYPE_CHECKING:
    from .base import Mixer

#: a model preset's repeating pattern of layers: (mixer name, options) per layer (`hookmech.model_presets`)
PresetPattern = tuple[tuple[str, dict[str, Any]], ...]
#: (mixer, hook) -> (the input of the output projection per head ``[batch, pos, head, d_head]``,
#: the projection's weight per head ``[d_model, head, d_head]``), from the run's cached inside
#: hooks (``hook(name)``, without "hook_"): TransformerLens's head results, written out plainly
HeadResultsFn = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Heads:
    """How a mixer's options give the head axis of its per-head hooks: ``(n_heads, d_head)``.

    One of `count` (the option that is the number of heads; it receives ``--n-heads``) and
    `width` (the option that is one head's width: the heads are as many as fit) is set. The heads
    split d_model, or, with `split`, d_model times that option (Mamba-2's ``expand``: its heads
    split d_inner). `same_as_count`: options that must equal the head count (Based's
    ``num_key_value_heads``), set with it where a test asks for a number of heads.
    """

    count: str = ""
    width: str = ""
    split: str = ""
    same_as_count: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if bool(self.count) == bool(self.width):
            raise HookmechError("Heads: give exactly one of count (the head-count option) and width (the head width's)")

    def shape(self, d_model: int, options: Mapping[str, Any]) -> tuple[int, int]:
        """Return ``(n_heads, d_head)`` of a mixer built with `options` (every option, defaults
        filled in: `MixerSpec.options_with`)."""
        inner = int(d_model * options[self.split]) if self.split else d_model
        if self.count:
            n_heads = int(options[self.count])
            return n_heads, inner // max(n_heads, 1)
        d_head = int(options[self.width])
        return inner // max(d_head, 1), d_head

    def options_for(self, n_heads: int, d_model: int, options: Mapping[str, Any]) -> dict[str, Any]:
        """Return the options (on top of `options`, defaults filled in) that give `n_heads` heads at
        `d_model`: what the tests build multi-head models with."""
        if self.count:
            return {self.count: n_heads, **{name: n_heads for name in self.same_as_count}}
        inner = int(d_model * options[self.split]) if self.split else d_model
        return {self.width: inner // n_heads}


#: the `MixerSpec` fields that describe the block around the mixer (the class docstring)
BLOCK_FIELDS = tuple(
    "block_norm block_mlp default_pos_emb reference_init output_projections reference_scales_output "
    "output_head_axes tl_attention tl_mixer_out causal_tolerance".split()
)


@dataclass(frozen=True)
class MixerSpec:
    """Everything the package needs to know of one mixer besides its class, in one place.

    - `name`: the registry name (``--mixer NAME``); `mixer`: the class, built as
      ``mixer(d_model=..., **options)``; its keyword options, their defaults and types are its
      constructor's signature (`options`).
    - `heads`: its head axis (`Heads`), or None for a mixer without heads (one head as wide as the
      model). Stated here only: the model config, ``--n-heads`` and the hooks' head sizes read it.
    - `meanings`: each inside hook (its name without "hook_") -> what it holds (docs/sites.md);
      every inside hook has one (a test checks). `notes`: a paragraph the site reference adds
      after the mixer's table (TransformerLens's names that mean something else).
    - `presets`: the model presets (``--preset NAME``) this spec defines, name -> pattern of layers;
      None: one, the mixer's name, with every layer this mixer and its defaults.
    - `bench`: whether the benches include it (the hooks they patch, the option sets the tests
      build it with and the reference loop of its `state` route are test data:
      `hookmech.oracles.mixer_cases`, `hookmech.oracles.state_loops`).
    - `head_results`: where its output projection's input splits into heads
      (`output_head_axes`), that input per head written out from the cached hooks.
    - `attention_values`: for a mixer with an `EffectiveAttentionMap` whose map gives one inside
      hook exactly from another, ``(values, output)``: ``output[b, t, h] = Σ_s M[b, h, t, s]
      values[b, s, h]`` (h: a head or a channel, `EffectiveAttentionMap.attention_axis`), which the
      tests check (the nine first mixers' maps, some with a skip or a product, are checked by hand).

    The block around it (`BLOCK_FIELDS`, read by the config and the backbone; a mixer from outside
    the package may state them as class attributes, `external`): `block_norm` ("layernorm" or
    "rmsnorm"), `block_mlp` (an MLP after the mixer by default), `default_pos_emb` ("learned" or
    "none"); `reference_init`, what ``init = "zoology"`` picks (`hookmech.config.INITS`: zoology
    draws mamba-ssm's scheme for Mamba blocks only); `output_projections`, the submodules writing
    into the residual stream, drawn with std 0.02 / sqrt(2 n_layers) (zoology, GPT-2: the stream's
    variance does not grow with depth), and `reference_scales_output`, whether the reference init
    scales them too (zoology's finds them by name, ``out_proj``, ``fc2``: one named otherwise keeps
    N(0, 0.02) under ``init = "normal-by-name"``); `output_head_axes`, how the input of its one
    output projection splits into heads, "head d_head", "d_head head" or "" (no heads: one head),
    for TransformerLens's head results; `tl_attention` (TransformerLens's attention hook names ->
    its inside hooks, ``{"z": "y"}``) and `tl_mixer_out` (TransformerLens's names inside the mixer
    for its output, ``"ssm_out"``), the block's aliases (`hook_aliases`); `causal_tolerance`, of a
    plug-in's causality check (`plug_in_check`): the largest change of an earlier output, relative
    to the largest output, taken as float rounding (1e-5: the engine's exactness; None: no check).
    """

    name: str
    mixer: type[Mixer]
    heads: Heads | None
    meanings: Mapping[str, str]
    notes: str = ""
    presets: Mapping[str, PresetPattern] | None = None
    bench: bool = True
    head_results: HeadResultsFn | None = None
    attention_values: tuple[str, str] | None = None
    block_norm: str = "layernorm"
    block_mlp: bool = True
    default_pos_emb: str = "none"
    reference_init: str = "normal"
    output_projections: tuple[str, ...] = ()
    reference_scales_output: bool = True
    output_head_axes: str = ""
    tl_attention: Mapping[str, str] = field(default_factory=dict)
    tl_mixer_out: tuple[str, ...] = ()
    causal_tolerance: float | None = 1e-5
    #: filled in from `presets` (None: the mixer's own single-mixer preset)
    model_presets: Mapping[str, PresetPattern] = field(init=False)

    def __post_init__(self) -> None:
        own: Mapping[str, PresetPattern] = {self.name: ((self.name, {}),)}
        object.__setattr__(self, "model_presets", own if self.presets is None else dict(self.presets))

    def hook_aliases(self, mixer: Mixer) -> dict[str, str]:
        """Return TransformerLens's names of the block's hooks around `mixer` (built from this spec),
        ``{alias: hook}`` as paths inside the block: ``hook_attn_out`` (every mixer is TL's attention
        sublayer), the `tl_attention` names of the inside hooks `mixer` has, and `tl_mixer_out`."""
        present = {tl: own for tl, own in self.tl_attention.items() if hasattr(mixer, hook_attribute(own))}
        return {
            **block_part_aliases(attn_out="mixer_out"),
            **tl_attention_aliases(**present),
            **mixer_output_aliases(*self.tl_mixer_out),
        }

    @property
    def options(self) -> dict[str, Any]:
        """Return the mixer's keyword options (besides d_model) with their defaults."""
        return mixer_options(self.mixer)

    def options_with(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Return every option of the mixer: `options` over the defaults."""
        return {**self.options, **options}

    def head_shape(self, d_model: int, options: Mapping[str, Any]) -> tuple[int, int]:
        """Return ``(n_heads, d_head)`` of the mixer built with `options` at `d_model`: the size
        of the ``head`` axis of its per-head hooks and the width of one head there; ``(1, d_model)``
        for a mixer without heads (`heads` None)."""
        if self.heads is None:
            return 1, d_model
        return self.heads.shape(d_model, self.options_with(options))

    def head_count_option(self) -> str | None:
        """Return the option that receives ``--n-heads`` (`Heads.count`), or None."""
        return self.heads.count if self.heads is not None and self.heads.count else None

    def with_heads(self, n_heads: int, d_model: int, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Return `options` with those giving `n_heads` heads at `d_model` on top (`Heads.options_for`);
        a HookmechError for a mixer without heads."""
        if self.heads is None:
            raise HookmechError(f"mixer {self.name!r} has no heads")
        options = dict(options or {})
        return {**options, **self.heads.options_for(n_heads, d_model, self.options_with(options))}
