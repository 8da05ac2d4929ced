"""The patching package's structure: no import cycle, one written model protocol that HookedLM
satisfies, one options object checked on construction."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import hookmech
from hookmech.errors import HookmechError, UsageError
from hookmech.patching import PatchableConfig, PatchableModel, PatchOptions, PathPatchableModel, patch, path_patch

ROOT = Path(hookmech.__file__).parent


def module_imports(path: Path, package: str) -> set[str]:
    """Return the names `path` imports from hookmech (module `package` for relative imports),
    anywhere in it: a lazy import inside a function closes a cycle as surely, only later."""
    found = set()
    parts = package.split(".")
    for statement in ast.walk(ast.parse(path.read_text())):
        if isinstance(statement, ast.ImportFrom):
            base = parts[: len(parts) - statement.level + 1] if statement.level else []
            module = ".".join(base + ([statement.module] if statement.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in statement.names)
        elif isinstance(statement, ast.Import):
            found.update(alias.name for alias in statement.names)
    return {name for name in found if name.startswith("hookmech")}


def hookmech_import_graph() -> dict[str, set[str]]:
    """Return module -> the hookmech modules it imports, over every module of hookmech."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
        package = name if relative.name == "__init__" else name.rpartition(".")[0]
        modules[name] = (path, package)
    return {name: {m for m in module_imports(path, package) if m in modules and m != name}
            for name, (path, package) in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Return one import cycle of `graph` (a list of modules, first == last), or None."""
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = "open"
        for child in sorted(graph[node]):
            if state.get(child) == "open":
                return trail[trail.index(child):] + [child]
            if child not in state and (cycle := visit(child, [*trail, child])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_hookmech_has_no_import_cycle():
    graph = hookmech_import_graph()
    assert {"hookmech.patching.exact", "hookmech.patching.atp"} <= set(graph)
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_cycle_finder_finds_a_lazy_import_cycle():
    """The shape this package replaced: patching imported atp inside a function, atp imported patching."""
    assert find_cycle({"patching": {"atp"}, "atp": {"patching"}}) == ["atp", "patching", "atp"]


def test_no_library_module_imports_the_oracles():
    graph = hookmech_import_graph()
    oracles = {name for name in graph if name == "hookmech.oracles" or name.startswith("hookmech.oracles.")}
    assert {"hookmech.oracles.plain_loop", "hookmech.oracles.path_patching"} <= oracles
    users = [name for name, imported in graph.items() if imported & oracles and name not in oracles]
    assert users == []


def test_hooked_lm_is_a_patchable_model(ar_model):
    assert isinstance(ar_model, PatchableModel)
    assert isinstance(ar_model.cfg, PatchableConfig)


def test_hooked_lm_is_a_path_patchable_model(ar_model):
    assert isinstance(ar_model, PathPatchableModel)


def test_a_model_without_the_path_methods_is_refused_by_name_for_paths_only(ar_model, ar_task):
    class NodesOnly(torch.nn.Module):
        """A patchable model without `path_ends` / `path_change`: every member but those, delegated."""

        def __init__(self, model):
            super().__init__()
            self.inner = model

        def __getattr__(self, name):
            if name in ("path_ends", "path_change"):
                raise AttributeError(name)
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

        def __call__(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    model, batch = NodesOnly(ar_model), ar_task.sample(4, seed=0)
    assert isinstance(model, PatchableModel) and not isinstance(model, PathPatchableModel)
    with pytest.raises(HookmechError, match="NodesOnly cannot be path-patched: it has no path_ends, path_change"):
        path_patch(model, batch, "L0.block_out@key", "L1.block_in@key", "resid")


def test_a_model_without_the_protocol_is_refused_by_name(ar_task):
    with pytest.raises(HookmechError, match="Linear cannot be patched: it has no cfg, hook_dict"):
        patch(torch.nn.Linear(2, 2), ar_task.sample(4, seed=0), "L0.block_in", "key")


def test_patch_options_are_frozen_and_resolve_the_direction():
    assert PatchOptions().direction == "denoise" and PatchOptions().base == "corrupt"
    ablating = PatchOptions(ablate="zero")
    assert (ablating.direction, ablating.base, ablating.source) == ("noise", "clean", "corrupt")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ablating.metric = "kl"  # type: ignore[misc]
    with pytest.raises(UsageError, match="unknown metric 'logit' "):
        PatchOptions(metric="logit")
    with pytest.raises(UsageError, match="drop direction 'denoise' or the ablation"):
        PatchOptions(direction="denoise", ablate="mean")
