"""The parts of `hookmech evaluate` with hand-computed answers: the budget's plan, the measured
step time, the best run and the learning-rate window, the card's Markdown, the suites."""
from __future__ import annotations

import math

import pytest
import torch

from hookmech.errors import UsageError
from hookmech.evaluate import suite
from hookmech.evaluate.budget import OVERHEAD, next_run, plan, run_seconds, step_seconds, wall_seconds
from hookmech.evaluate.card import WINDOW, best_row, card_markdown, inside_attributions, lr_window
from hookmech.sites import site_to_hook


def test_the_plan_keeps_runs_in_order_while_they_fit():
    runs = [("ar", 3e-3, 10.0, False), ("mqar", 3e-3, 30.0, False), ("atr", 3e-3, 5.0, True), ("ar", 1e-3, 10.0, False)]
    kept = [p.kept for p in plan(runs, budget_hours=25 / 3600)]
    # 10 s; then 30 s does not fit; a finished run is free; ar's second rate would fit (20 s) but
    # mqar has not had its first: every task's first rate comes before any task's second
    assert kept == [True, False, True, False]
    assert all(p.kept for p in plan(runs, budget_hours=None))
    assert [p.kept for p in plan(runs, budget_hours=1e-9)] == [False, False, True, False]
    # a shorter run of the same round still fits after a longer one is left out
    runs = [("ar", 3e-3, 10.0, False), ("mqar", 3e-3, 30.0, False), ("atr", 3e-3, 5.0, False)]
    assert [p.kept for p in plan(runs, budget_hours=25 / 3600)] == [True, False, True]


def test_the_issues_budget_gives_every_task_its_first_rate_before_a_second():
    """--budget-hours 0.1 with 2 workers once trained AR at three rates and MQAR at one and left
    ATR out: ar's runs shared the workers (3 x 90 s on 2 workers = 135 s) while ATR's first run
    (213 s) did not fit after them. Now nothing of round 2 runs before ATR's first rate."""
    rates = (3e-3, 1e-3, 1e-2)
    seconds = {"ar": 90.0, "mqar": 175.0, "atr": 213.0}
    runs = [(task, lr, seconds[task], False) for lr in rates for task in ("ar", "mqar", "atr")]
    kept = [(p.task, p.lr) for p in plan(runs, budget_hours=0.1, workers=2) if p.kept]
    assert kept == [("ar", 3e-3), ("mqar", 3e-3)]  # 265 s; ATR's 213 s more would be 478 s > 360 s
    following = next_run(plan(runs, budget_hours=0.1, workers=2), workers=2)
    assert following is not None
    run, hours = following
    assert (run.task, run.lr, run.seconds) == ("atr", 3e-3, 213.0) and hours == pytest.approx(478 / 3600)
    kept = [(p.task, p.lr) for p in plan(runs, budget_hours=478 / 3600, workers=2) if p.kept]
    # with it, the second rates come free (each task's two runs share the 2 workers); a third does not fit
    assert kept == [(task, lr) for lr in rates[:2] for task in ("ar", "mqar", "atr")]
    assert next_run(plan(runs, budget_hours=None), workers=2) is None


def test_workers_share_a_task_not_the_suite():
    # tasks run one after another; two ar runs of 10 s on 2 workers take 10 s, ar + mqar take 20 s
    assert wall_seconds([("ar", 10.0), ("ar", 10.0)], workers=2) == 10.0
    assert wall_seconds([("ar", 10.0), ("mqar", 10.0)], workers=2) == 20.0
    assert wall_seconds([("ar", 10.0), ("ar", 6.0), ("ar", 2.0)], workers=2) == 9.0
    runs = [("ar", 3e-3, 10.0, False), ("mqar", 3e-3, 10.0, False), ("ar", 1e-3, 10.0, False)]
    assert [p.kept for p in plan(runs, budget_hours=20 / 3600, workers=2)] == [True, True, True]
    # 19 s: mqar's first rate does not fit, so ar's second waits too (it would have fitted)
    assert [p.kept for p in plan(runs, budget_hours=19 / 3600, workers=2)] == [True, False, False]


@pytest.mark.parametrize("budget", [0.0, -1.0, math.nan, math.inf])
def test_a_budget_must_be_a_positive_number(budget):
    with pytest.raises(UsageError, match="--budget-hours must be a number > 0"):
        plan([], budget_hours=budget)


def test_run_seconds_is_the_steps_with_the_overhead():
    # binary-exact operands: the estimate is steps × step time × OVERHEAD with no rounding on any CPU
    assert run_seconds(0.5, 1000) == 500 * OVERHEAD


def test_step_seconds_measures_without_moving_the_callers_rng():
    from hookmech.sweep import Sweep, expand

    sweep = Sweep(name="s", task={"name": "ar", "vocab_size": 16, "num_kv_pairs": 2},
                  train={"steps": 10, "n_train": 0}, model={"mixer": "attention", "d_model": 16})
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    threads = torch.get_num_threads()
    seconds = step_seconds(expand(sweep)[0].as_dict(), steps=2, threads=threads + 1)
    assert 0 < seconds < 10
    assert torch.equal(torch.rand(3), expected) and torch.get_num_threads() == threads


def row(run_id, lr, acc, status="finished", **columns):
    return {"run_id": run_id, "lr": lr, "dev_acc": acc, "status": status, **columns}


def test_the_best_run_is_the_most_accurate_finished_one_ties_to_the_smaller_rate():
    rows = [row("a", 1e-3, 0.8), row("b", 3e-3, 0.8), row("c", 1e-2, 0.95, status="nan"), row("d", 3e-2, None)]
    assert best_row(rows)["run_id"] == "a"
    assert best_row([row("c", 1e-2, 0.95, status="nan")]) is None
    assert best_row([]) is None


def test_the_window_is_every_rate_within_WINDOW_of_the_best():
    best = 0.96
    rows = [row("a", 1e-3, best - WINDOW - 1e-9), row("b", 3e-3, best - WINDOW + 1e-9), row("c", 1e-2, best),
            row("d", 3e-4, 0.2)]
    assert lr_window(rows) == [3e-3, 1e-2]
    assert lr_window([row("a", 1e-3, 0.5), row("b", 3e-3, 0.2)]) == [1e-3]
    assert lr_window([]) == []


def test_inside_attributions_are_the_largest_in_magnitude():
    columns = {"attr:L1.block_in@value": 1.0, "attr:L0.mixer.k@key": 0.2, "attr:L1.mixer.z@query": -0.9,
               "attr:L1.mixer.v@value": None, "attr:L0.mixer.q@query": 0.5}
    found = inside_attributions(row("a", 1e-3, 0.9, **columns), top=2)
    assert found == [{"site": "L1.mixer.z", "pos": "query", "attribution": -0.9},
                     {"site": "L0.mixer.q", "pos": "query", "attribution": 0.5}]


def test_the_markdown_shows_noise_in_parentheses_and_what_was_left_out():
    recalls = {"label": "induction at layer 1", "reason": "value 1.00, key 0.00, query 0.00 at L1.block_in",
               "recalls": True, "numbers": {"value": 1.0, "key": 0.0, "query": 0.0}}
    noise = {"label": "neither", "reason": "does not recall: p_clean − p_corrupt = 0.001 < 0.05", "recalls": False,
             "numbers": {"value": 3.0, "key": -2.0, "query": 0.0}}
    card = {
        "suite": "quick", "about": "about", "model": {"mixer": "mine.py:M"}, "mixer_options": {"k": 2},
        "rules": {"strong": 0.5, "present": 0.25, "min_effect": 0.05, "window": 0.05}, "verdict_site": "L1.block_in",
        "tasks": [{
            "task": "ar", "spec": {"name": "ar", "vocab_size": 64}, "best": "a", "verdict": recalls, "inside": [],
            "runs": [{"run_id": "a", "lr": 1e-3, "status": "finished", "dev_acc": 0.97, "verdict": recalls},
                     {"run_id": "b", "lr": 1e-2, "status": "finished", "dev_acc": 0.01, "verdict": noise},
                     {"run_id": "c", "lr": 3e-2, "status": "nan", "dev_acc": None, "verdict": None}],
            "lr_window": [1e-3], "left_out": [3e-3], "error": None, "view": None,
            "references": [{"label": "attention", "lr": 1e-3, "dev_acc": 0.99, "paper_acc": 1.0, "verdict": recalls}],
            "not_applied": ["bias"], "view_error": None,
            "references_pending": [{"label": "Mamba", "paper_acc": 0.9625}, {"label": "H3", "paper_acc": None}],
        }],
    }
    text = card_markdown(card)
    assert "# Mechanistic evaluation: mine.py:M, k=2" in text
    assert "| 0.001 | finished | 0.970 | induction at layer 1 | 1.00 / 0.00 / 0.00 |" in text
    assert "| 0.01 | finished | 0.010 | neither | (3.00 / -2.00 / 0.00) |" in text
    assert "| 0.03 | nan | – | – | – |" in text
    assert "**Verdict: induction at layer 1**" in text and "0.001 — 1 of 2 rates trained" in text
    assert "Left out by the budget: lr 0.003." in text
    assert "The suite's mixer options `bias` were not applied: this mixer does not take them." in text
    assert "| attention | 0.001 | 0.990 | 1.000 | induction at layer 1 | 1.00 / 0.00 / 0.00 |" in text
    assert "Not bundled yet (their runs have not finished): Mamba (paper 0.963), H3." in text
    card["tasks"][0]["references"] = []
    without_runs = card_markdown(card)
    assert "No reference runs are bundled for this task.\nThe paper reports: Mamba (paper 0.963), H3." in without_runs
    del card["tasks"][0]["references_pending"]  # a card.json from before the field
    assert "The paper reports" not in card_markdown(card)


def test_rates_replace_every_tasks_in_their_order():
    from hookmech.evaluate.suites import with_rates

    quick = with_rates(suite("quick"), [1e-2, 3e-4])
    assert [task.lrs for task in quick.tasks] == [(1e-2, 3e-4)] * 3
    assert [task.train for task in quick.tasks] == [task.train for task in suite("quick").tasks]


def test_the_suites():
    quick, paper = suite("quick"), suite("paper")
    assert [t.name for t in quick.tasks] == ["ar", "mqar", "atr"] and [t.name for t in paper.tasks] == ["ar", "atr"]
    assert all(t.train["steps"] == 4000 and t.model["d_model"] == 64 for t in quick.tasks)
    assert paper.tasks[0].train["epochs"] == 16 and paper.tasks[1].train["epochs"] == 32
    assert max(paper.tasks[1].lrs) <= 3e-3  # the paper's ATR range
    with pytest.raises(UsageError, match="unknown suite 'quik'"):
        suite("quik")


@pytest.mark.parametrize("model", [{"arch": "hyena"}, {"arch": "based"}, {"arch": "h3"}, {"mixer": "mamba"}])
def test_the_measured_sites_are_every_block_input_and_the_inside_hooks_with_a_position(model):
    """Hyena's and BaseConv's long-convolution filters do not depend on the input: they have no
    position to patch at, and a run measuring them would fail after training."""
    from hookmech.evaluate.runner import _mech_sites, _task_sweep
    from hookmech.hooks import pos_axis_of
    from hookmech.model import HookedLM
    from hookmech.sites import hook_to_site
    from hookmech.sweep import build_run, expand

    quick = suite("quick")
    sweep, _ = _task_sweep(quick, quick.tasks[0], model, {})
    run = expand(sweep)[0].as_dict()
    sites, positions = _mech_sites(run)
    hooks = HookedLM(build_run(run)[1]).hook_dict
    inside = [hook_to_site(h) for h, point in hooks.items() if ".mixer." in hook_to_site(h)]
    with_position = [site for site in inside if pos_axis_of(hooks[site_to_hook(site)]) is not None]
    assert sites == ["L1.block_in", *with_position] and positions == ["key", "value", "query", "divider"]
    assert len(with_position) > 0
    assert run["mech"]["sites"] == sites
