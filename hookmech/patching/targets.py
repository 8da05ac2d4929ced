"""What a patch replaces: sites (a hook, a head of it, or several patched together) as the
engine sees them, parsed from the site grammar of `hookmech.sites`.

Sites: a site name or pattern (`sites.resolve_sites`), a head of a hook with a ``head`` axis
(``L1.mixer.z[0]``; ``L1.mixer.z[*]`` = every head, one record each), or a joint patch of
several sites in one run (``L0.block_out+L1.mixer_in``, one record). Positions are
`sites.position_patches` (one ``[N, T]`` mask per patch).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import UsageError
from ..hooks import axes_of, axis_size, pos_axis_of
from ..sites import as_specs, hook_to_site, joint_parts, resolve_sites
from .protocol import PatchableModel

_HEAD_SUFFIX = re.compile(r"^(?P<base>.+)\[(?P<head>\d+|\*)\]$")


@dataclass(frozen=True)
class Target:
    """One patched activation: a hook, optionally restricted to one index of its ``head`` axis."""

    hook: str
    head: int | None = None

    @property
    def label(self) -> str:
        """The hook name as records show it (``blocks.1.mixer.hook_z[0]``)."""
        return self.hook + ("" if self.head is None else f"[{self.head}]")

    @property
    def site_label(self) -> str:
        """The site name as records show it (``L1.mixer.z[0]``)."""
        return hook_to_site(self.hook) + ("" if self.head is None else f"[{self.head}]")


@dataclass(frozen=True)
class PatchSite:
    """What one record patches: one or several targets, patched together in one run."""

    targets: tuple[Target, ...]

    @property
    def site(self) -> str:
        return "+".join(t.site_label for t in self.targets)

    @property
    def hook(self) -> str:
        return "+".join(t.label for t in self.targets)


def head_axis_of(model: PatchableModel, hook: str) -> int:
    """Return the index of the ``head`` axis of `hook`'s activation; a UsageError if it has none."""
    axes = axes_of(model.hook_dict[hook]).split()
    if "head" not in axes:
        raise UsageError(
            f"{hook_to_site(hook)} has no head axis (axes: {' '.join(axes) or 'unknown'}); "
            "per-head sites need one, e.g. L1.mixer.z[0] of multi-head attention"
        )
    return axes.index("head")


def n_heads_of(model: PatchableModel, hook: str) -> int:
    """Return the size of `hook`'s head axis, as its hook point declares it (`hooks.axis_size`,
    whatever the mixer calls its head option); a UsageError if it has no head axis or no size."""
    head_axis_of(model, hook)
    n_heads = axis_size(model.hook_dict[hook], "head")
    if n_heads is None:
        raise UsageError(
            f"{hook_to_site(hook)}[*]: its hook does not declare how many heads it has; name a head, e.g. [0]"
        )
    return n_heads


#: what the engine's entry points take as sites: specs (`parse_sites`), or sites parsed already
SiteSpecs = str | Iterable[str] | Iterable[PatchSite]


def parse_sites(specs: SiteSpecs, model: PatchableModel) -> list[PatchSite]:
    """Resolve site specs to `PatchSite`s, in forward order of their first target.

    A spec is a site or pattern, optionally with a head suffix (``[h]`` or ``[*]``), or
    several of those joined by ``+`` (one joint patch); a bare string is one spec. Returns one
    `PatchSite` per record. Sites parsed already (a list of `PatchSite`) are returned as they
    are: a command parses its sites once and passes them down to every step that needs them.
    """
    given = [specs] if isinstance(specs, str) else list(specs)
    if given and all(isinstance(spec, PatchSite) for spec in given):
        return given  # type: ignore[return-value]
    result: list[PatchSite] = []
    for spec in as_specs(given, "site"):  # type: ignore[arg-type]
        parts = joint_parts(spec, "site")
        per_part = [_parse_part(part, model) for part in parts]
        if len(parts) == 1:
            result.extend(PatchSite((target,)) for target in per_part[0])
        else:
            joint = tuple(dict.fromkeys(target for targets in per_part for target in targets))
            result.append(PatchSite(joint))
    if not result:
        raise UsageError("no site given")
    return list(dict.fromkeys(result))


def is_plain(site: PatchSite) -> bool:
    """Return whether `site` patches one whole hook (no joint ``a+b``, no head ``[h]``)."""
    return len(site.targets) == 1 and site.targets[0].head is None


def _parse_part(part: str, model: PatchableModel) -> list[Target]:
    head_spec = None
    if match := _HEAD_SUFFIX.match(part):
        part, head_spec = match.group("base"), match.group("head")
    hooks = resolve_sites([part], model.hook_dict)
    for hook in hooks:
        if pos_axis_of(model.hook_dict[hook]) is None:
            raise UsageError(
                f"{hook_to_site(hook)} has no position axis (it does not depend on the input): "
                "it cannot be patched at a position"
            )
    if head_spec is None:
        return [Target(hook) for hook in hooks]
    targets: list[Target] = []
    for hook in hooks:
        head_axis_of(model, hook)
        heads = range(n_heads_of(model, hook)) if head_spec == "*" else [int(head_spec)]
        targets.extend(Target(hook, head) for head in heads)
    return targets


def equivalent_site(model: PatchableModel, site: PatchSite) -> PatchSite:
    """Return `site` with each target moved to the latest hook holding the same tensor before the
    same computation (`PatchableModel.equivalent_hook`: block l's output is block l+1's input),
    so that its patched runs start as late as possible and equal sites are run once."""
    targets = (Target(model.equivalent_hook(t.hook), t.head) for t in site.targets)
    return PatchSite(tuple(dict.fromkeys(targets)))
