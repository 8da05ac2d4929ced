"""The hook-name scheme, in one place: the only module that builds or reads hook-name strings.

Every activation of a `HookedLM` passes a TransformerLens hook point named by its module path:

    hook_embed, hook_pos_embed        the token and the position embedding (`EMBED`, `POS_EMBED`)
    blocks.{l}.hook_{part}            block l's hooks: `BLOCK_PARTS`, in forward order (`block_hook`)
    blocks.{l}.mixer.hook_{inside}    the hooks inside block l's mixer, named by it (``q``, ``ssm_state``;
                                      `mixer_hook`)
    ln_final.hook_normalized          the final norm's output (`FINAL_NORM`)
    blocks.{l}.hook_{alias}           a name a mixer declares for one of its block's hooks, such as
    blocks.{l}.attn.hook_{alias}      TransformerLens's ``attn_out`` for ``mixer_out``, or ``attn.hook_z``
                                      for attention's ``mixer.hook_z`` (`block_aliases`)
    blocks.{l}.ln1.hook_scale, ...    TransformerLens's names of what hookmech computes from a cache
                                      rather than hooks (`TL_SCALE`, `TL_RESULT`, `TL_POST`): norm scales, head results,
                                      MLP neurons (`HookedLM.derived_activation`)

`parse_hook` reads a name back as a `HookName` (layer, part, inside name); `layer_of` gives the
block of any name inside ``blocks.{l}``. The block's layout, which hooks lie on the residual
stream and which belong to a sublayer (its input, its output, inside it), is `RESIDUAL_PARTS` and
`sublayer_of`. A mixer keeps each inside hook as the attribute ``hook_{inside}``
(`hook_attribute`, `inside_name`); anything else inside a block, a weight's name for instance,
is `block_path`.

Why a module of its own rather than `hookmech.sites`: the model, the
mixers' declarations and the patching engine need hook names, not the grammar people type
(``L1.block_in``, wildcards, positions, joints) nor its imports; this module imports nothing of
hookmech nor torch, so any module can ask it without an import cycle, and the site grammar is
one of its users.
tests/test_hook_names.py fails when another module of hookmech or of its CLI builds a hook name
by hand (an f-string or a concatenation giving ``blocks.{l}.`` or ``hook_{name}``, a full hook
name written out) or takes one apart (``.split(".")``, a ``hook_``/``blocks.`` prefix test).
"""

from __future__ import annotations

import re
from typing import NamedTuple

#: the hook of the token embedding, of the learned position embedding, of the final norm's output
EMBED = "hook_embed"
POS_EMBED = "hook_pos_embed"
FINAL_NORM = "ln_final.hook_normalized"

#: a block's own hooks (``blocks.{l}.hook_{part}``), in forward order
BLOCK_PARTS = ("resid_pre", "mixer_in", "mixer_out", "resid_mid", "mlp_in", "mlp_out", "resid_post")
#: the block parts on the residual stream: the block's input, the sum after the mixer, its output
RESIDUAL_PARTS = ("resid_pre", "resid_mid", "resid_post")
#: the sublayers of a block, as `HookName.part` names them for the hooks inside them
MIXER = "mixer"
MLP = "mlp"
#: block part -> the sublayer it is the input or the output of (a sublayer is its own)
_SUBLAYER = {"mixer_in": MIXER, "mixer_out": MIXER, MIXER: MIXER, "mlp_in": MLP, "mlp_out": MLP, MLP: MLP}
#: the block parts only a block with an MLP has
MLP_PARTS = ("resid_mid", "mlp_in", "mlp_out")

# -- TransformerLens's names for what it looks up (its ActivationCache, transformer_lens.patching) --
#: TransformerLens's attention sublayer: hookmech's sequence mixer, whatever it is (`HookName.part`)
TL_ATTN = "attn"
#: TransformerLens's block norms: before the mixer (``ln1``) and before the MLP (``ln2``)
TL_NORMS = ("ln1", "ln2")
#: the final norm's module (``ln_final.hook_normalized`` is `FINAL_NORM`)
FINAL_NORM_MODULE = "ln_final"
#: TransformerLens's names of what hookmech computes from a cache (no hook holds them), as
#: ``(module, inside name)``: a norm's divisor (``blocks.{l}.ln1.hook_scale``, ``ln2``,
#: ``ln_final.hook_scale``), each head's share of the mixer output (``blocks.{l}.attn.hook_result``)
#: and the MLP's hidden activation (``blocks.{l}.mlp.hook_post``)
TL_SCALE = "scale"
TL_RESULT = "result"
TL_POST = "post"

#: how an attribute holding a hook point starts (``hook_q``)
_ATTRIBUTE_PREFIX = "hook_"
#: where a name is one of the scheme's (the site grammar takes such names as they are)
_NAME_STARTS = ("blocks.", _ATTRIBUTE_PREFIX, "ln_final.")
#: ``blocks.{l}.hook_{part}`` or ``blocks.{l}.{sublayer}.hook_{inside}``; a layer is written
#: without leading zeros (``blocks.01`` names no block)
_IN_BLOCK = re.compile(r"^blocks\.(0|[1-9]\d*)\.(?:(\w+)\.)?hook_(\w+)$")
#: ``hook_{part}`` or ``{module}.hook_{inside}`` outside the blocks
_OUTSIDE = re.compile(r"^(?:(\w+)\.)?hook_(\w+)$")
_LAYER = re.compile(r"^blocks\.(\d+)\.")


class HookName(NamedTuple):
    """A hook name read by `parse_hook`.

    `layer`: the block (None outside the blocks). `part`: for a block's own hook its
    `BLOCK_PARTS` entry (or an alias), for a hook inside a sublayer that sublayer (`MIXER`), outside
    the blocks the hook (``embed``, ``pos_embed``) or its module (``ln_final``). `inside`: the
    hook's name inside its sublayer or module (``q``, ``normalized``), None for the others.
    """

    layer: int | None
    part: str
    inside: str | None


def block_hook(layer: int, part: str) -> str:
    """Return the name of block `layer`'s hook `part` (``block_hook(1, "resid_pre")`` ->
    ``blocks.1.hook_resid_pre``; parts: `BLOCK_PARTS`)."""
    return block_path(layer, hook_attribute(part))


def mixer_hook(layer: int, inside: str) -> str:
    """Return the name of the hook `inside` inside block `layer`'s mixer (``mixer_hook(1, "q")`` ->
    ``blocks.1.mixer.hook_q``)."""
    return sublayer_hook(layer, MIXER, inside)


def sublayer_hook(layer: int, sublayer: str, inside: str) -> str:
    """Return the name of the hook `inside` of module `sublayer` of block `layer`
    (``sublayer_hook(0, "attn", "z")`` -> ``blocks.0.attn.hook_z``, TransformerLens's name)."""
    return block_path(layer, f"{sublayer}.{hook_attribute(inside)}")


def final_norm_hook(inside: str) -> str:
    """Return the name of the final norm's hook `inside` (``scale`` -> ``ln_final.hook_scale``)."""
    return f"{FINAL_NORM_MODULE}.{hook_attribute(inside)}"


def block_path(layer: int, path: str) -> str:
    """Return the model-wide name of `path` inside block `layer` (``block_path(0,
    "mixer.out_proj.weight")`` -> ``blocks.0.mixer.out_proj.weight``): hook names, weight names."""
    return f"blocks.{layer}.{path}"


def tl_attention_aliases(**inside_hooks: str) -> dict[str, str]:
    """Return TransformerLens's attention names of a mixer's inside hooks, as paths inside the
    block (`MixerSpec.hook_aliases` uses it): ``tl_attention_aliases(q="q", z="y")`` is
    ``{"attn.hook_q": "mixer.hook_q", "attn.hook_z": "mixer.hook_y"}`` (keyword: TransformerLens's
    name; value: the mixer's own inside hook)."""
    return {f"{TL_ATTN}.{hook_attribute(tl)}": f"{MIXER}.{hook_attribute(ours)}" for tl, ours in inside_hooks.items()}


def block_part_aliases(**parts: str) -> dict[str, str]:
    """Return other names of a block's own hooks, as paths inside the block (`MixerSpec.hook_aliases`
    takes them): ``block_part_aliases(attn_out="mixer_out")`` is ``{"hook_attn_out": "hook_mixer_out"}``
    (keyword: the other name; value: the `BLOCK_PARTS` entry it names)."""
    return {hook_attribute(alias): hook_attribute(part) for alias, part in parts.items()}


def mixer_output_aliases(*inside: str) -> dict[str, str]:
    """Return names inside the mixer that mean the block's ``hook_mixer_out``, as paths inside the
    block: ``mixer_output_aliases("ssm_out")`` is ``{"mixer.hook_ssm_out": "hook_mixer_out"}``
    (TransformerLens's Mamba names the mixer's output so)."""
    return {f"{MIXER}.{hook_attribute(name)}": hook_attribute("mixer_out") for name in inside}


def hook_attribute(name: str) -> str:
    """Return the attribute holding the hook point named `name` in its module (``q`` -> ``hook_q``)."""
    return _ATTRIBUTE_PREFIX + name


def inside_name(attribute: str) -> str:
    """Return the name of the hook point a module keeps as `attribute` (``hook_q`` -> ``q``)."""
    return attribute.removeprefix(_ATTRIBUTE_PREFIX)


def block_aliases(layer: int, aliases: dict[str, str]) -> dict[str, str]:
    """Return ``{alias hook name: hook name}`` in block `layer` for the `aliases` a mixer declares
    (`MixerSpec.hook_aliases`: paths inside the block, ``{"hook_attn_out": "hook_mixer_out",
    "attn.hook_z": "mixer.hook_z"}``): ``{"blocks.0.hook_attn_out": "blocks.0.hook_mixer_out",
    "blocks.0.attn.hook_z": "blocks.0.mixer.hook_z"}``, TransformerLens's names."""
    return {block_path(layer, alias): block_path(layer, attribute) for alias, attribute in aliases.items()}


def parse_hook(name: str) -> HookName | None:
    """Return `name` read as a `HookName` (``blocks.1.hook_resid_pre`` -> ``(1, "resid_pre", None)``,
    ``blocks.1.mixer.hook_q`` -> ``(1, "mixer", "q")``, ``hook_embed`` -> ``(None, "embed", None)``,
    ``ln_final.hook_normalized`` -> ``(None, "ln_final", "normalized")``), or None when it is not
    a name of the scheme."""
    if match := _IN_BLOCK.match(name):
        layer, sublayer, attribute = int(match.group(1)), match.group(2), match.group(3)
        return HookName(layer, attribute, None) if sublayer is None else HookName(layer, sublayer, attribute)
    if name.startswith("blocks."):
        return None
    if match := _OUTSIDE.match(name):
        module, attribute = match.group(1), match.group(2)
        return HookName(None, attribute, None) if module is None else HookName(None, module, attribute)
    return None


def layer_of(name: str) -> int | None:
    """Return l for a name inside ``blocks.{l}`` (a hook, a weight), None for one outside the blocks."""
    match = _LAYER.match(name)
    return None if match is None else int(match.group(1))


def is_hook_name(name: str) -> bool:
    """Return True where `name` is spelt as the scheme's names are (``blocks.…``, ``hook_…``,
    ``ln_final.…``) rather than as a site; whether the model has such a hook is the model's to say."""
    return name.startswith(_NAME_STARTS)


def needs_mlp(name: HookName) -> bool:
    """Return True where hook `name` exists only in a block with an MLP: `MLP_PARTS`, a hook
    inside the MLP (TransformerLens's ``mlp.hook_post``) or of its norm (``ln2.hook_scale``)."""
    return name.layer is not None and (name.part in MLP_PARTS or name.part in (MLP, TL_NORMS[1]))


def sublayer_of(part: str) -> str | None:
    """Return the sublayer (`MIXER`, `MLP`) block part `part` is the input or output of, or that
    `part` is (for the hooks inside it); None for the residual stream (`RESIDUAL_PARTS`)."""
    return _SUBLAYER.get(part)
