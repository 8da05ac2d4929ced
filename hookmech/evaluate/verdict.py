"""The mechanism verdict: which of paper 000's two recall mechanisms the interchange attributions
at ``L{l}.block_in`` show (§4, fig. 3b/3c).

Patching the residual stream entering layer l at one position of the clean document into the
corrupted run (the key of the queried pair changed) restores p(answer) by the share of the
answer's information that sits at that position there:

- **value** — an earlier layer stored the key–value association at the value token and layer l
  (or a later one) reads it there: **induction at layer l**;
- **query** — an earlier layer already fetched the answer into the query position: **direct
  retrieval at layer l − 1** (for the two-layer models of both suites: layer 0);
- **key** — the answer still sits at the key's own position, and layer l retrieves it from
  there directly: **direct retrieval at layer l** (exact when l is the last layer).

The rules, with the thresholds stated (calibrated on the committed runs of docs/results.md; the
cases are the tests' `tests/test_evaluate_verdict.py`):

1. the model must react to the corruption: ``p_clean − p_corrupt ≥ MIN_EFFECT`` (0.05), else
   **neither** ("does not recall"): attributions are ratios of two tiny differences then (H3,
   Hyena and BaseConv at the paper's AR configuration: 0.019, 0.005 and −0.0004; the weakest
   model that recalls, Mamba at 19 % accuracy with learned positions, 0.15; attention on the
   CPU variant of ATR, whose corrupted key leaves the heuristics intact, 0.10);
2. ``value ≥ STRONG`` (0.5) with ``key + query < PRESENT`` (0.25): **induction**;
3. ``key + query ≥ STRONG`` with ``value < PRESENT``: **direct retrieval**, at each layer whose
   position holds at least PRESENT (Mamba at lr 3e-3: key 0.43, query 0.55 → layers 0 and 1);
4. ``value ≥ PRESENT`` and ``key + query ≥ PRESENT``: **both**;
5. otherwise **neither** ("no position carries the answer"), with the largest attribution.

Two filters, both named wherever they show: rule 1's **recall threshold** (MIN_EFFECT, 0.05),
which the verdict applies, and the **patching filter** of paper 000's eq. 1 and of ``hookmech
patch --threshold`` (PATCH_FILTER: p_clean − p_corrupt > 0.01), which decides whether an
attribution is reported at all. A run between the two (H3 at the paper's AR configuration:
0.019) gets "neither" and, beside it, what rules 2–5 read at the patching filter
(``patch_filter``): "direct retrieval at layer 0" for H3, the reading of docs/results.md.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import UsageError

#: an attribution this large at a position means the position carries the mechanism
STRONG = 0.5
#: an attribution this large means the position carries part of it
PRESENT = 0.25
#: the least p_clean - p_corrupt for which attributions mean anything (rule 1: the recall threshold)
MIN_EFFECT = 0.05
#: the patching filter: p_clean - p_corrupt must exceed it for a record to pass (paper 000 eq. 1;
#: `hookmech patch --threshold`'s default, `PatchOptions.threshold`: a test pins the two together)
PATCH_FILTER = 0.01
MECHANISMS = ("induction", "direct retrieval", "both", "neither")

_BLOCK_IN = re.compile(r"^L(\d+)\.block_in$")


def site_layer(site: str) -> int:
    """Return l of ``L{l}.block_in`` (l >= 1: the residual stream entering layer l of a later
    layer's reading); other sites are a UsageError (the verdict is defined on block inputs)."""
    match = _BLOCK_IN.match(site)
    if match is None or int(match.group(1)) < 1:
        raise UsageError(f"the mechanism verdict reads L{{l}}.block_in with l >= 1, got {site!r}")
    return int(match.group(1))


def attribution(columns: dict[str, Any], site: str, pos: str) -> float:
    """Return the attribution ``attr:<site>@<pos>`` of a run's columns (0.0 where it is missing
    or undefined: a position the task lacks, or a run that failed the patching filter)."""
    value = columns.get(f"attr:{site}@{pos}")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def verdict(columns: dict[str, Any], site: str = "L1.block_in") -> dict[str, Any]:
    """Return the mechanism of one run at `site` from its attribution columns (a results.csv row
    or mech.json's ``columns``: ``attr:<site>@<pos>``, ``mech_p_clean``, ``mech_p_corrupt``).

    Returns ``{"mechanism": one of MECHANISMS, "layers": {"induction": [l], "direct retrieval":
    [layers]}, "label": "direct retrieval at layer 1", "reason": str, "site": site, "recalls":
    bool (rule 1), "numbers": {"key", "value", "query", "divider"?, "effect"}, "patch_filter":
    {"threshold": PATCH_FILTER, "passes": bool, "label": str | None}}`` by the module's rules;
    ``patch_filter["label"]`` is what rules 2–5 read when the run passes the patching filter but
    not the recall threshold (None otherwise: the verdict's own label stands).
    """
    layer = site_layer(site)
    numbers: dict[str, Any] = {pos: attribution(columns, site, pos) for pos in ("key", "value", "query")}
    if columns.get(f"attr:{site}@divider") is not None:
        numbers["divider"] = attribution(columns, site, "divider")
    p_clean, p_corrupt = columns.get("mech_p_clean"), columns.get("mech_p_corrupt")
    effect = (p_clean - p_corrupt) if isinstance(p_clean, float) and isinstance(p_corrupt, float) else None
    numbers["effect"] = effect
    recalls = effect is not None and effect >= MIN_EFFECT
    passes = effect is not None and effect > PATCH_FILTER
    read = _read_positions(numbers, layer, site)
    patch_filter = {
        "threshold": PATCH_FILTER,
        "passes": passes,
        "label": None if recalls or not passes else read["label"],
    }
    base = {"site": site, "numbers": numbers, "layers": {}, "recalls": recalls, "patch_filter": patch_filter}
    if not recalls:
        shown = "not measured" if effect is None else f"p_clean − p_corrupt = {effect:.3f} < {MIN_EFFECT}"
        return {**base, "mechanism": "neither", "label": "neither", "reason": f"does not recall: {shown}"}
    return {**base, **read}


def _read_positions(numbers: dict[str, Any], layer: int, site: str) -> dict[str, Any]:
    """Rules 2–5 on the attributions at `site` (entering `layer`): ``{"mechanism", "label",
    "reason", "layers"}``."""
    value, key, query = numbers["value"], numbers["key"], numbers["query"]
    retrieval_layers = [layer - 1] * (query >= PRESENT) + [layer] * (key >= PRESENT)
    if not retrieval_layers and key + query >= PRESENT:  # split evenly: name the larger
        retrieval_layers = [layer - 1 if query >= key else layer]
    retrieval = "direct retrieval at " + _layers_text(retrieval_layers) if retrieval_layers else ""
    induction = f"induction at layer {layer}"
    if value >= STRONG and key + query < PRESENT:
        found, label, layers = "induction", induction, {"induction": [layer]}
    elif key + query >= STRONG and value < PRESENT:
        found, label, layers = "direct retrieval", retrieval, {"direct retrieval": retrieval_layers}
    elif value >= PRESENT and key + query >= PRESENT:
        found, label = "both", f"both: {induction}, {retrieval}"
        layers = {"induction": [layer], "direct retrieval": retrieval_layers}
    else:
        positions = {pos: numbers[pos] for pos in ("key", "value", "query", "divider") if pos in numbers}
        largest = max(positions, key=positions.__getitem__)
        reason = f"no position carries the answer (largest: {largest} {positions[largest]:.2f})"
        return {"mechanism": "neither", "label": "neither", "reason": reason, "layers": {}}
    reason = f"value {value:.2f}, key {key:.2f}, query {query:.2f} at {site}"
    return {"mechanism": found, "label": label, "reason": reason, "layers": layers}


def _layers_text(layers: list[int]) -> str:
    """``[1]`` -> "layer 1", ``[0, 1]`` -> "layers 0 and 1"."""
    if len(layers) == 1:
        return f"layer {layers[0]}"
    return "layers " + ", ".join(str(layer) for layer in layers[:-1]) + f" and {layers[-1]}"
