"""The demo contrasts the two mechanisms on the bundled fixtures; its sentences follow the numbers."""
from __future__ import annotations

from hookmech.demo import contrast, explain, mechanism, run_demo


def record(pos, attribution, passes=True):
    return {"site": "L1.block_in", "pos": pos, "attribution": attribution, "passes_filter": passes,
            "p_clean": 0.9, "p_corrupt": 0.1}


def test_mechanism_reads_the_attributions():
    assert mechanism([record("key", 0.0), record("value", 0.97), record("query", 0.0)]) == "induction"
    assert mechanism([record("key", 0.1), record("value", 0.0), record("query", 0.85)]) == "direct retrieval"
    assert mechanism([record("key", 0.6), record("value", 0.0), record("query", 0.3)]) == "direct retrieval"
    assert mechanism([record("key", 0.1), record("value", 0.1), record("query", 0.1)]) == "unclear"
    assert mechanism([record("value", 1.0, passes=False)]) == "unclear"
    assert "noise" in explain([record("value", 1.0, passes=False)])


def test_demo_shows_induction_for_attention_and_direct_retrieval_for_mamba():
    lines = []
    records = run_demo(out=lines.append)
    text = "\n".join(lines)
    assert "induction." in text and "direct retrieval." in text
    by_model = {}
    for name, start in (("attention", 0), ("mamba", 4)):
        by_model[name] = {r["pos"]: r["attribution"] for r in records[start:start + 4]}
    assert by_model["attention"]["value"] > 0.8 and by_model["attention"]["key"] < 0.2
    assert by_model["mamba"]["value"] < 0.2 and by_model["mamba"]["query"] + by_model["mamba"]["key"] > 0.8
    assert contrast([("attention", records[:4]), ("mamba", records[4:])]).count("\n") == 2
