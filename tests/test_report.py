"""Reports: best-lr selection, bootstrap intervals, figures and report.md produced and deterministic."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hookmech.report import bootstrap_interval, build_report, select_runs, summarise
from hookmech.sweep import parse_sweep, run_sweep, write_results

PNG = b"\x89PNG\r\n\x1a\n"


def synthetic_rows():
    """Two architectures × 2 d_model × 2 lr × 2 seeds with known accuracies and attributions."""
    rows = []
    for arch, value, query in (("attention", 0.9, 0.05), ("mamba", 0.1, 0.8)):
        for d_model in (16, 32):
            for lr in (1e-3, 1e-2):
                for seed in (0, 1):
                    good = (lr == 1e-3) == (arch == "attention")
                    acc = (0.9 if good else 0.3) + 0.02 * seed + (0.05 if d_model == 32 else 0)
                    rows.append({"run_id": f"{arch}_d{d_model}_lr{lr}_s{seed}", "arch": arch, "d_model": d_model,
                                 "lr": lr, "seed": seed, "status": "finished", "dev_acc": acc,
                                 "dev_p_answer": acc - 0.1, "steps": 10, "seconds": 1.0, "mech_n": 8,
                                 "mech_p_clean": 0.9, "mech_p_corrupt": 0.1, "mech_passes": seed == 0 or good,
                                 "attr:L1.block_in@key": 0.0, "attr:L1.block_in@value": value + 0.01 * seed,
                                 "attr:L1.block_in@query": query})
    rows.append({**rows[0], "run_id": "nan_run", "lr": 3e-2, "status": "nan", "dev_acc": None})
    return rows


def test_summary_picks_the_best_lr_by_mean_dev_accuracy_over_seeds():
    summary = summarise(synthetic_rows(), ["arch", "d_model", "lr", "seed"])
    assert [(e["series"], e["d_model"], e["lr"]) for e in summary] == [
        ("attention", 16, 1e-3), ("attention", 32, 1e-3), ("mamba", 16, 1e-2), ("mamba", 32, 1e-2)]
    first = summary[0]
    # means of the synthetic numbers, summed in another order: float64 round-off (pytest.approx's rel 1e-6)
    assert first["dev_acc"] == pytest.approx(np.mean([0.90, 0.92]))
    assert (first["dev_min"], first["dev_max"]) == pytest.approx((0.90, 0.92))
    assert first["attr_value"] == pytest.approx(0.905) and first["n_pass"] == 2
    assert summary[2]["attr_query"] == pytest.approx(0.8)


def test_best_run_of_a_series_breaks_ties_by_smaller_lr_then_larger_d_model():
    def row(run_id, d_model, lr, acc, status="finished"):
        return {"run_id": run_id, "arch": "attention", "d_model": d_model, "lr": lr, "seed": 0, "status": status,
                "dev_acc": acc}

    keys = ["arch", "d_model", "lr", "seed"]
    rows = [row("big_fast", 64, 1e-2, 1.0), row("small_slow", 32, 1e-3, 1.0), row("worse", 128, 1e-4, 0.9),
            row("diverged", 256, 1e-5, None, status="nan")]
    assert [r["run_id"] for r in select_runs(rows, keys)] == ["small_slow"]  # accuracy tie: smaller lr
    rows += [row("small_slow_wide", 64, 1e-3, 1.0), row("small_slow_wide_again", 64, 1e-3, 1.0)]
    assert [r["run_id"] for r in select_runs(rows, keys)] == ["small_slow_wide"]  # then larger d_model, then first


def test_bootstrap_interval_brackets_the_mean_and_is_deterministic():
    values = [0.1, 0.4, 0.5, 0.9, 1.0]
    low, high = bootstrap_interval(values)
    assert low < np.mean(values) < high and 0.1 <= low and high <= 1.0
    assert bootstrap_interval(values) == (low, high)
    assert bootstrap_interval([0.3]) == (0.3, 0.3)


def test_report_from_a_results_table_writes_figures_and_markdown(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    write_results(synthetic_rows(), runs / "results.csv")
    report = build_report(runs, tmp_path / "report", heatmaps=False)
    text = report.read_text()
    for name in ("accuracy_vs_d_model.png", "lr_sensitivity.png", "attribution_value_vs_query.png",
                 "attribution_summary.png"):
        data = (tmp_path / "report" / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
        assert f"({name})" in text
    assert "| attention | 16 | 0.001 | 0.910 ± 0.010 (n=2) | 0.905 | 0.050 | 0.000 | 2/2 |" in text
    assert "1 nan" in text


TINY = """
name = "tiny"
[task]
name = "ar"
vocab_size = 16
num_kv_pairs = 3
[train]
steps = 8
n_train = 0
n_dev = 16
batch_size = 8
eval_every = 4
ckpt_every = 8
[grid]
mixer = ["attention", "baseconv"]
d_model = [8]
lr = [3e-3, 1e-2]
seed = [0]
[mech]
n = 16
every = 4
"""


def test_report_of_a_trained_sweep_has_heatmaps_and_dynamics_and_is_deterministic(tmp_path):
    run_sweep(parse_sweep(TINY), tmp_path / "runs", threads=1, log=lambda m: None)
    first = build_report(tmp_path / "runs", tmp_path / "a", n=16)
    second = build_report(tmp_path / "runs", tmp_path / "b", n=16)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert sum(name.startswith("heatmap_") and name.endswith(".png") for name in names) == 2
    assert sum(name.startswith("heatmap_") and name.endswith(".json") for name in names) == 2
    assert sum(name.startswith("dynamics_") for name in names) == 2
    for name in names:
        data = (tmp_path / "a" / name).read_bytes()
        assert data and data == (tmp_path / "b" / name).read_bytes(), name
        if name.endswith(".png"):
            assert f"({name})" in first.read_text()
    # the heatmap covers every block-level site of layer 0 and 1 at each AR role; its records are
    # kept beside the figure, not in the run folder the report reads
    assert not list((tmp_path / "runs").glob("*/heatmap*"))
    heatmap = json.loads(next((tmp_path / "a").glob("heatmap_*.json")).read_text())["records"]
    assert {r["pos"] for r in heatmap} == {"key", "value", "query", "divider"}
    assert {"L0.block_in", "L1.block_out"} <= {r["site"] for r in heatmap}
    assert second.name == "report.md"
