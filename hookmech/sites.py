"""Sites and positions: the short names people type, and the hooks they mean (docs/guide.md §5, docs/sites.md).

Sites:  ``L1.block_in`` <-> ``blocks.1.hook_resid_pre``; ``L1.mixer.q`` <-> ``blocks.1.mixer.hook_q``;
``embed``, ``pos_embed``, ``final_norm``. Wildcards: ``L*.block_in``, ``L1.*``, ``all`` (block-level
sites), ``L1.mixer.*`` / ``L*.mixer.state`` (inside hooks, named explicitly). Hook names are
accepted as they are. The hook names themselves are `hookmech.hook_names`' (the one module that
builds and reads them); import them from there.

Positions (per row of a batch): a role (``key``, ``value``, ``query``, ``divider``), an integer
(``5``; negative counts back from each row's last token, ``-1`` = the query in AR), ``all``
(every position, one patch each), ``whole`` (every position in one joint patch), and joints
``key+value`` (several positions patched together).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import UsageError, suggest
from .hook_names import (
    EMBED,
    FINAL_NORM,
    MIXER,
    POS_EMBED,
    block_hook,
    hook_attribute,
    is_hook_name,
    mixer_hook,
    parse_hook,
)

# .hooks is imported where used: it loads TransformerLens, which parsing site names does not need

__all__ = [
    "BLOCK_SITES",
    "GLOBAL_SITES",
    "PositionPatch",
    "as_specs",
    "hook_to_site",
    "joint_parts",
    "list_sites",
    "position_patches",
    "forward_order",
    "resolve_sites",
    "row_positions",
    "site_to_hook",
]

#: block-level site -> the block part it names (`hookmech.hook_names.BLOCK_PARTS`), in forward order
_SITE_PARTS = {
    "block_in": "resid_pre",
    "mixer_in": "mixer_in",
    "mixer_out": "mixer_out",
    "resid_mid": "resid_mid",
    "mlp_in": "mlp_in",
    "mlp_out": "mlp_out",
    "block_out": "resid_post",
}
#: block-level site -> hook attribute inside ``blocks.{l}``, in forward order
BLOCK_SITES = {site: hook_attribute(part) for site, part in _SITE_PARTS.items()}
GLOBAL_SITES = {"embed": EMBED, "pos_embed": POS_EMBED, "final_norm": FINAL_NORM}
_PART_TO_BLOCK_SITE = {part: site for site, part in _SITE_PARTS.items()}
_HOOK_TO_GLOBAL_SITE = {hook: site for site, hook in GLOBAL_SITES.items()}
#: a layer is written without leading zeros, as in hook names (``L01`` names no block)
_BLOCK_SITE = re.compile(r"^L(0|[1-9]\d*)\.(\w+)$")
_MIXER_SITE = re.compile(r"^L(0|[1-9]\d*)\.mixer\.(\w+)$")


def hook_to_site(hook: str) -> str:
    """Return the short site name of a hook name (``blocks.1.hook_resid_pre`` -> ``L1.block_in``)."""
    if hook in _HOOK_TO_GLOBAL_SITE:
        return _HOOK_TO_GLOBAL_SITE[hook]
    name = parse_hook(hook)
    if name is None or name.layer is None:
        return hook
    if name.part == MIXER and name.inside is not None:
        return f"L{name.layer}.mixer.{name.inside}"
    if name.inside is None and name.part in _PART_TO_BLOCK_SITE:
        return f"L{name.layer}.{_PART_TO_BLOCK_SITE[name.part]}"
    return hook


def site_to_hook(site: str) -> str:
    """Return the hook name of a site (``L1.block_in`` -> ``blocks.1.hook_resid_pre``).

    Names that are already hook names are returned unchanged; a malformed name is a UsageError.
    """
    if site in GLOBAL_SITES:
        return GLOBAL_SITES[site]
    if match := _MIXER_SITE.match(site):
        return mixer_hook(int(match.group(1)), match.group(2))
    if (match := _BLOCK_SITE.match(site)) and match.group(2) in _SITE_PARTS:
        return block_hook(int(match.group(1)), _SITE_PARTS[match.group(2)])
    if is_hook_name(site):
        return site
    raise UsageError(f"malformed site {site!r}{suggest(site, [*BLOCK_SITES, *GLOBAL_SITES])}")


#: what each kind of spec may be, for the message refusing one that is not a string
_ACCEPTED = {
    "site": "a site or pattern such as 'L1.block_in' or 'L*.mixer_out', or a hook name",
    "position": "a role such as 'value', an integer as text such as '3' or '-1', 'all', 'whole', or 'key+value'",
    "sender": "SITE@POS such as 'L0.block_out@value'",
    "receiver": "SITE@POS such as 'L1.block_in@value'",
}


def as_specs(specs: str | Iterable[str], kind: str = "spec") -> list[str]:
    """Return site or position specs (`kind`: "site", "position" ...) as a list: a bare string
    is one spec (``"L1.block_in"``), not a list of characters. A spec that is not a string (an
    integer position) is a UsageError naming it and what is accepted."""
    if isinstance(specs, str):
        return [specs]
    listed: list[object]
    try:
        listed = list(specs)
    except TypeError:  # one spec that is not a string, e.g. positions=3
        listed = [specs]
    for spec in listed:
        if not isinstance(spec, str):
            accepted = _ACCEPTED.get(kind, "strings")
            raise UsageError(
                f"{kind} {spec!r} is a {type(spec).__name__}, not a string: {kind}s are strings ({accepted})"
            )
    return [str(spec) for spec in listed]


def joint_parts(spec: str, kind: str) -> list[str]:
    """Return the stripped ``+``-separated parts of a joint `kind` spec ("site", "position"); a
    UsageError naming the spec as typed if a part is empty (``"value+"``)."""
    parts = [part.strip() for part in spec.split("+")]
    if "" in parts:
        example = "L0.block_out+L1.mixer_in" if kind == "site" else "key+value"
        raise UsageError(
            f"{kind} {spec.strip()!r} has an empty part: a joint {kind} joins {kind}s with '+', e.g. {example}"
        )
    return parts


def _is_inside(site: str) -> bool:
    return ".mixer." in site


def resolve_sites(patterns: str | Iterable[str], hook_names: Iterable[str]) -> list[str]:
    """Expand site patterns (a bare string is one pattern) against a model's hooks; return hook
    names in forward order.

    `hook_names` is the model's hook list in forward order (``model.hook_dict``). Block-level
    wildcards never reach inside hooks; inside hooks need ``L{l}.mixer.<name or *>``. An
    unknown site is a UsageError naming close matches.
    """
    patterns = as_specs(patterns, "site")
    ordered = list(hook_names)
    sites = [hook_to_site(hook) for hook in ordered]
    block_level = [s for s in sites if _BLOCK_SITE.match(s) and not _is_inside(s)]
    chosen: set[str] = set()
    for pattern in patterns:
        pattern = pattern.strip()
        if pattern == "all":
            chosen.update(block_level)
            continue
        if any(ch in pattern for ch in "*?["):
            pool = [s for s in sites if _is_inside(s)] if _is_inside(pattern) else block_level
            matches = fnmatch.filter(pool, pattern)
            if not matches:
                raise UsageError(f"site pattern {pattern!r} matches no site of this model{suggest(pattern, sites)}")
            chosen.update(matches)
            continue
        try:
            site = hook_to_site(site_to_hook(pattern))
        except UsageError:
            site = pattern
        if site not in sites:
            raise UsageError(f"unknown site {pattern!r}{suggest(pattern, sites)}")
        chosen.add(site)
    return forward_order([site_to_hook(site) for site in chosen], ordered)


def forward_order(hooks: Iterable[str], hook_names: Iterable[str]) -> list[str]:
    """Return `hooks` once each, in forward order (`resolve_sites`'s order: embeddings, then per
    layer the inside-mixer hooks after mixer_in and the block sites, then the final norm);
    `hook_names` is the model's hook list in forward order."""
    sites = [hook_to_site(hook) for hook in hook_names]
    order = {site: index for index, site in enumerate(sorted(sites, key=_forward_key(sites)))}
    return [site_to_hook(site) for site in sorted({hook_to_site(hook) for hook in hooks}, key=order.__getitem__)]


def _forward_key(sites: Sequence[str]):
    """Sort key: embeddings, then per layer inside-mixer hooks in model order after mixer_in
    and the block sites in forward order, then the final norm."""
    model_order = {site: index for index, site in enumerate(sites)}
    block_rank = {name: rank for rank, name in enumerate(BLOCK_SITES)}

    def key(site: str) -> tuple:
        if site in ("embed", "pos_embed"):
            return (-1, 0, model_order[site])
        if site == "final_norm":
            return (1 << 30, 0, 0)
        if match := _MIXER_SITE.match(site):
            return (int(match.group(1)), block_rank["mixer_in"], 1, model_order[site])
        if match := _BLOCK_SITE.match(site):
            return (int(match.group(1)), block_rank.get(match.group(2), 99), 0, 0)
        return (1 << 29, 0, model_order[site])

    return key


# -- positions ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PositionPatch:
    """One patch's positions: `label` as reported, `mask` ``[N, T]`` True where patched."""

    label: str
    mask: Tensor


def row_positions(spec: str, roles: dict[str, Tensor], lengths: Tensor) -> Tensor:
    """Return the ``[N]`` position of each row named by one role or integer spec.

    Integers count from the start; negative ones back from each row's last token (``-1`` is the
    last), so ``-0`` is refused rather than read as position 0.
    """
    if re.fullmatch(r"-?\d+", spec):
        if spec.startswith("-") and int(spec) == 0:
            raise UsageError("position -0 is ambiguous: use 0 (the first token) or -1 (each row's last)")
        index, shortest = int(spec), int(lengths.min())
        # inside every row: 0 <= index < length, or 0 <= length + index for a negative index
        # (checked on plain ints first: an index past int64 cannot become a tensor)
        if not -shortest <= index < shortest:
            raise UsageError(f"position {index} is outside some rows (lengths {shortest}..{int(lengths.max())})")
        return lengths + index if index < 0 else torch.full_like(lengths, index)
    if spec not in roles:
        raise UsageError(
            f"unknown position {spec!r}{suggest(spec, [*roles, 'all', 'whole'])}; this task's roles: {', '.join(roles)}"
        )
    return roles[spec]


def _single_mask(spec: str, roles: dict[str, Tensor], lengths: Tensor, n_pos: int) -> Tensor:
    mask = torch.zeros(len(lengths), n_pos, dtype=torch.bool)
    if spec == "whole":
        return mask | (torch.arange(n_pos)[None, :] < lengths[:, None])
    mask[torch.arange(len(lengths)), row_positions(spec, roles, lengths)] = True
    return mask


def position_patches(
    specs: str | Iterable[str], roles: dict[str, Tensor], lengths: Tensor, n_pos: int
) -> list[PositionPatch]:
    """Turn position specs into per-row masks ``[N, T]``, one `PositionPatch` per patch.

    ``all`` expands to one patch per position 0..T-1 (rows shorter than a position are not
    patched there); ``a+b`` patches a and b jointly. A bare string is one spec.
    """
    patches: list[PositionPatch] = []
    for spec in dict.fromkeys(spec.strip() for spec in as_specs(specs, "position")):  # a repeated spec is one patch
        if spec == "all":
            patches.extend(
                PositionPatch(
                    str(p),
                    torch.zeros(len(lengths), n_pos, dtype=torch.bool).index_fill_(1, torch.tensor([p]), True)
                    & (p < lengths)[:, None],
                )
                for p in range(n_pos)
            )
            continue
        parts = joint_parts(spec, "position")
        if "all" in parts:
            raise UsageError(
                f"'all' cannot be part of the joint position {spec!r} (it is one patch per position); "
                "use 'whole' to patch every position at once"
            )
        mask = torch.zeros(len(lengths), n_pos, dtype=torch.bool)
        for part in parts:
            mask |= _single_mask(part, roles, lengths, n_pos)
        patches.append(PositionPatch(spec, mask))
    if not patches:
        raise UsageError("no position given")
    return patches


#: the two sequence lengths `list_sites` measures shapes at (fewer where `n_ctx` is shorter): a
#: forward of n_ctx positions would cache every hook at its full length (GBs at Pythia's 2048)
SHAPE_PROBE_LENGTHS = (3, 4)


def list_sites(model) -> list[dict]:
    """Return one dict per hook of `model` (forward order): ``site, hook, shape, axes, pos_axis``.

    ``shape`` is the activation's shape for one sequence of `n_ctx` tokens (batch axis 1),
    measured with forwards of `SHAPE_PROBE_LENGTHS` all-zeros tokens, not of n_ctx: an axis
    whose size changes with the length (positions; an attention pattern's two; a long
    convolution's filter lags) is extrapolated linearly to n_ctx (exact for every built-in
    mixer, whose such axes are as long as the sequence); the others are as measured.
    """
    from .hooks import axes_of, pos_axis_of  # here: hooks imports TransformerLens, which the grammar needs not

    hooks = resolve_sites([*_all_site_names(model)], model.hook_dict)
    shapes = _shapes_at_n_ctx(model)
    rows = []
    for hook in hooks:
        point = model.hook_dict[hook]
        rows.append(
            {
                "site": hook_to_site(hook),
                "hook": hook,
                "shape": shapes.get(hook),
                "axes": axes_of(point),
                "pos_axis": pos_axis_of(point),
            }
        )
    return rows


def _shapes_at_n_ctx(model) -> dict[str, list[int]]:
    """Every cached hook's shape for one sequence of `n_ctx` tokens, from forwards of at most two
    short lengths (`SHAPE_PROBE_LENGTHS`): sizes that differ between them grow linearly to n_ctx."""
    n_ctx = model.cfg.n_ctx
    lengths = sorted({min(n_ctx, length) for length in SHAPE_PROBE_LENGTHS})
    device = next(model.parameters()).device
    measured = []
    for length in lengths:
        tokens = torch.zeros(1, length, dtype=torch.long, device=device)
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, return_cache_object=False)
        measured.append({hook: list(value.shape) for hook, value in cache.items()})
    if len(lengths) == 1:  # n_ctx itself is short enough to measure
        return measured[0]
    (short, long), (at_short, at_long) = lengths, measured
    step = long - short
    return {
        hook: [size + (at_long[hook][axis] - size) * (n_ctx - short) // step for axis, size in enumerate(shape)]
        for hook, shape in at_short.items()
        if hook in at_long
    }


def _all_site_names(model) -> list[str]:
    return [hook_to_site(hook) for hook in model.hook_dict]
