"""The rough edges a new user hit (issue 29, section 2), one group of tests per edge; the command
line's side of them is in tests/cli/test_rough_edges_cli.py."""

from __future__ import annotations

import warnings

import pytest
from helpers import ENGINE_TOL, make_model, unit_variance

from hookmech.errors import UsageError
from hookmech.patching import PathSkippedWarning, path_patch


# -- path patching: a resid pair whose positions never meet ---------------------------------------
def test_a_resid_pair_that_never_meets_is_left_out_of_a_cross_product_with_a_note(ar_task):
    model = unit_variance(make_model(ar_task, mixers="attention", d_model=16))
    batch = ar_task.sample(6, seed=4)
    with pytest.warns(PathSkippedWarning, match=r"1 of 2 resid pairs left out.*L0.block_in@key -> L1.block_in@value"):
        records = path_patch(model, batch, "L0.block_in@key", ["L1.block_in@key", "L1.block_in@value"], "resid")
    assert [(r["sender"], r["receiver"]) for r in records] == [("L0.block_in@key", "L1.block_in@key")]
    assert abs(records[0]["p_patched"] - records[0]["p_corrupt"]) > 2 * ENGINE_TOL
    # the same pair alone: nothing is left, an error (as before)
    with pytest.raises(UsageError, match="carries a position's value to the same position only"):
        path_patch(model, batch, "L0.block_in@key", "L1.block_in@value", "resid")


def test_resid_paths_at_all_positions_keep_the_diagonal_only(ar_task):
    model = unit_variance(make_model(ar_task, mixers="attention", d_model=16))
    batch = ar_task.sample(4, seed=2)
    n_pos = batch.tokens.shape[1]
    with pytest.warns(PathSkippedWarning, match=f"{n_pos * n_pos - n_pos} of {n_pos * n_pos} resid pairs"):
        records = path_patch(model, batch, "L0.block_out@all", "L1.block_in@all", "resid")
    assert [(r["sender"], r["receiver"]) for r in records] == [
        (f"L0.block_out@{p}", f"L1.block_in@{p}") for p in range(n_pos)
    ]


def test_other_routes_keep_every_pair_without_a_note(ar_task):
    model = unit_variance(make_model(ar_task, mixers="attention", d_model=16, layer_options=[{"n_heads": 2}] * 2))
    batch = ar_task.sample(4, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PathSkippedWarning)
        records = path_patch(model, batch, "L0.mixer.z[0]@key", ["L1.mixer.k@key", "L1.mixer.k@value"], "head")
    assert len(records) == 2


# -- one default seed of the examples -------------------------------------------------------------
def test_the_examples_seed_has_one_default_everywhere():
    import inspect

    import hookmech.tasks
    from hookmech.demo import run_demo
    from hookmech.report import build_report
    from hookmech.view import sweep_page_data

    assert hookmech.tasks.EXAMPLES_SEED == 1  # the seed of every published number (docs/guide.md, "Seeds")
    for function in (run_demo, build_report, sweep_page_data):
        assert inspect.signature(function).parameters["seed"].default == hookmech.tasks.EXAMPLES_SEED, function
