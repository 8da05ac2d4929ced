"""`hookmech demo`: the paper's mechanistic evaluation on the bundled fixture checkpoints."""

from __future__ import annotations

import importlib.resources
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cache import write_cache
from .checkpoint import load
from .errors import HookmechError, unknown
from .evaluate.verdict import MIN_EFFECT, verdict
from .fileio import sha256_of
from .patching import patch
from .seeds import EXAMPLES_SEED
from .sites import resolve_sites
from .tables import format_records
from .tasks import from_checkpoint

#: (fixture file, short name, what it is) in the order the demo shows them
FIXTURES = (
    (
        "attention_ar_paper.safetensors",
        "attention",
        "2-layer attention (full, tied head) trained at paper 000's AR configuration: vocab 8192, 16 pairs, 16 epochs",
    ),
    (
        "mamba_ar_paper.safetensors",
        "mamba",
        "2-layer Mamba (mamba-ssm's init, no position embedding, tied head) trained at paper 000's AR "
        "configuration, lr 1e-2: dev accuracy 0.87, the paper's 0.81",
    ),
)
DEMO_POSITIONS = ("key", "value", "query", "divider")
DEMO_SITE = "L1.block_in"


def fixture(name: str) -> Path:
    """Return the path of the bundled fixture checkpoint `name` (``"attention_ar_cpu"``,
    ``"attention_ar_paper"``, ``"mamba_ar_cpu"``, ``"mamba_ar_paper"``; the ``.safetensors`` suffix may be given),
    wherever hookmech is installed (fixtures/README.md says what each is and how it was trained).
    Exported as ``hookmech.fixture``: ``hookmech.load(hookmech.fixture("attention_ar_cpu"))``.
    An unknown name is a UsageError listing the bundled ones."""
    folder = fixture_dir()
    bundled = sorted(path.name.removesuffix(".safetensors") for path in folder.glob("*.safetensors"))
    stem = name.removesuffix(".safetensors")
    if stem not in bundled:
        raise unknown("fixture", name, bundled)
    return folder / f"{stem}.safetensors"


def fixture_dir() -> Path:
    """Return the folder of the bundled fixture checkpoints: the package data of
    ``hookmech.fixtures`` (the repository's `fixtures/`, installed into the package), found
    through importlib.resources wherever hookmech is installed."""
    try:
        folder = importlib.resources.files("hookmech.fixtures")
    except ModuleNotFoundError:  # an editable install made before the fixtures were package data
        return Path(__file__).resolve().parent.parent / "fixtures"
    if not isinstance(folder, Path):
        raise HookmechError(f"the bundled fixtures are not files on disk ({folder}); give --fixtures DIR")
    return folder


def explain(records: list[dict[str, Any]], site: str = DEMO_SITE) -> str:
    """Return one sentence saying which mechanism the records of `site` point to.

    Reads the attributions at key / value / query (paper 000 §4): value = induction (the
    association was stored at the value by layer 0), query = direct retrieval by layer 0,
    key = direct retrieval deferred to layer 1.
    """
    by_pos = {r["pos"]: r for r in records if r["site"] == site}
    first = next(iter(by_pos.values()))
    if not first["passes_filter"]:
        return (
            f"p_clean - p_corrupt = {first['p_clean'] - first['p_corrupt']:.3f} is too small: the corruption "
            "barely matters to this model, so its attributions are noise."
        )
    score = {pos: (r["attribution"] or 0.0) for pos, r in by_pos.items()}
    found = mechanism(records, site)
    if found == "induction":
        return (
            f"Restoring {site} at the value alone restores p(answer) (attribution {score['value']:.2f}; key "
            f"{score.get('key', 0):.2f}, query {score.get('query', 0):.2f}): layer 0 stored the key-value "
            "association at the value token and layer 1 reads it there: induction."
        )
    if found == "direct retrieval":
        return (
            f"Nothing is stored at the value (attribution {score.get('value', 0):.2f}): the answer is retrieved "
            f"straight from the context, by layer 0 into the query (attribution {score.get('query', 0):.2f}) "
            f"and by layer 1 through the key's position ({score.get('key', 0):.2f}): direct retrieval."
        )
    effect = first["p_clean"] - first["p_corrupt"]
    if effect < MIN_EFFECT:  # passes the patching filter, yet too weak for the verdict's rules
        return f"p_clean - p_corrupt = {effect:.3f} is below {MIN_EFFECT}: the model barely recalls, so no verdict."
    best = max(score, key=score.__getitem__)
    return f"No single mechanism dominates at {site} (largest attribution: {best} {score[best]:.2f})."


def mechanism(records: list[dict[str, Any]], site: str = DEMO_SITE) -> str:
    """Return the mechanism the records of `site` point to: "induction" (value), "direct
    retrieval" (query or key), or "unclear" (filter failed, both, or no position dominates), by
    `hookmech.evaluate.verdict`'s rules."""
    at_site = [r for r in records if r["site"] == site]
    if not any(r["passes_filter"] for r in at_site):
        return "unclear"
    columns = {f"attr:{site}@{r['pos']}": r["attribution"] for r in at_site}
    columns.update(mech_p_clean=at_site[0]["p_clean"], mech_p_corrupt=at_site[0]["p_corrupt"])
    found = verdict(columns, site)["mechanism"]
    return found if found in ("induction", "direct retrieval") else "unclear"


def contrast(results: list[tuple[str, list[dict[str, Any]]]], site: str = DEMO_SITE) -> str:
    """Return one line per model: its mechanism and its value / query / key attributions at `site`."""
    lines = ["Side by side (attribution at " + site + "):"]
    for name, records in results:
        score = {r["pos"]: r["attribution"] for r in records if r["site"] == site}
        values = ", ".join(f"{pos} {score[pos]:.2f}" for pos in ("value", "query", "key") if score.get(pos) is not None)
        lines.append(f"  {name:<10} {mechanism(records, site):<17} ({values})")
    return "\n".join(lines)


def run_demo(
    fixtures: str | Path | None = None,
    n: int = 320,
    seed: int = EXAMPLES_SEED,
    out: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Cache, patch and explain each fixture checkpoint; print as it goes; return all records."""
    folder = Path(fixtures) if fixtures is not None else fixture_dir()
    all_records, per_model = [], []
    for filename, name, description in FIXTURES:
        ckpt = folder / filename
        if not ckpt.is_file():
            raise HookmechError(f"fixture {ckpt} is missing (give --fixtures DIR, or reinstall hookmech)")
        model, task = load(ckpt), from_checkpoint(ckpt)
        batch = task.sample(n, seed=seed)
        out(f"== {description}\n   checkpoint {ckpt.name}; {n} AR examples (seed {seed}), corrupting the key")
        with tempfile.TemporaryDirectory() as tmp:
            cache_path = Path(tmp) / "cache.h5"
            hooks = resolve_sites(["all"], model.hook_dict)
            write_cache(model, batch, cache_path, hooks, model_sha256=sha256_of(ckpt), task_spec=task.spec)
            records = patch(model, cache_path, [DEMO_SITE], DEMO_POSITIONS)
        out(format_records(records))
        out(explain(records) + "\n")
        all_records.extend(records)
        per_model.append((name, records))
    out(contrast(per_model))
    return all_records
