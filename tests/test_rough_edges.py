"""The rough edges a new user hit (issue 29, section 2), one group of tests per edge; the command
line's side of them is in tests/cli/test_rough_edges_cli.py."""

from __future__ import annotations

import warnings

import pytest
from helpers import ENGINE_TOL, make_model, unit_variance

from hookmech.errors import UsageError
from hookmech import patching
from hookmech.patching import path_patch


# -- path patching: a resid pair whose positions never meet ---------------------------------------
def test_a_resid_pair_that_never_meets_is_left_out_of_a_cross_product_with_a_note(ar_task):
    model = unit_variance(make_model(ar_task, mixers="attention", d_model=16))
    batch = ar_task.sample(6, seed=4)
    with pytest.warns(patching.PathSkippedWarning, match=r"1 of 2 resid pairs left out.*L0.block_in@key -> L1.block_in@value"):
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
    with pytest.warns(patching.PathSkippedWarning, match=f"{n_pos * n_pos - n_pos} of {n_pos * n_pos} resid pairs"):
        records = path_patch(model, batch, "L0.block_out@all", "L1.block_in@all", "resid")
    assert [(r["sender"], r["receiver"]) for r in records] == [
        (f"L0.block_out@{p}", f"L1.block_in@{p}") for p in range(n_pos)
    ]


def test_other_routes_keep_every_pair_without_a_note(ar_task):
    model = unit_variance(make_model(ar_task, mixers="attention", d_model=16, layer_options=[{"n_heads": 2}] * 2))
    batch = ar_task.sample(4, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", patching.PathSkippedWarning)
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


# -- report: a sweep with one d_model -------------------------------------------------------------
def _one_d_model_sweep(tmp_path):
    """A sweep folder whose grid varies arch and seed only: results.csv has no d_model column;
    each run's run.json says d_model 64."""
    import json

    from hookmech.sweep import write_results

    runs = tmp_path / "runs"
    runs.mkdir()
    rows = []
    for arch, acc in (("attention", 1.0), ("mamba", 0.5)):
        for seed in (0, 1):
            run_id = f"{arch}_s{seed}"
            (runs / run_id).mkdir()
            (runs / run_id / "run.json").write_text(json.dumps({"model_config": {"d_model": 64, "mixers": [arch]}}))
            rows.append({"run_id": run_id, "arch": arch, "seed": seed, "status": "finished", "dev_acc": acc - 0.1 * seed,
                         "dev_p_answer": 0.5, "steps": 4, "seconds": 1.0})
    write_results(rows, runs / "results.csv")
    (runs / "sweep.json").write_text(json.dumps({"name": "one-d", "grid": {"arch": ["attention", "mamba"], "seed": [0, 1]}}))
    return runs


def test_a_report_of_one_d_model_reads_it_from_run_json_and_draws_it(tmp_path):
    from hookmech.report import build_report, read_sweep_results

    runs = _one_d_model_sweep(tmp_path)
    assert [row["d_model"] for row in read_sweep_results(runs)] == [64, 64, 64, 64]
    report = build_report(runs, tmp_path / "report", heatmaps=False).read_text()
    assert "| attention | 64 |" in report and "| mamba | 64 |" in report
    assert "![accuracy vs d_model](accuracy_vs_d_model.png)" in report
    assert (tmp_path / "report" / "accuracy_vs_d_model.png").stat().st_size > 0


def test_the_sweep_page_has_the_d_model_of_run_json(tmp_path):
    from hookmech.view import sweep_page_data

    data = sweep_page_data(_one_d_model_sweep(tmp_path), heatmaps=False)
    assert {entry["d_model"] for entry in data["summary"]} == {64}


def test_a_run_json_with_a_bad_d_model_is_one_error_naming_it(tmp_path):
    import json

    from hookmech.errors import HookmechError
    from hookmech.report import read_sweep_results

    runs = _one_d_model_sweep(tmp_path)
    (runs / "mamba_s1" / "run.json").write_text(json.dumps({"model_config": {"d_model": "wide"}}))
    with pytest.raises(HookmechError, match=r"mamba_s1/run.json: model_config.d_model 'wide' is not"):
        read_sweep_results(runs)
    (runs / "mamba_s1" / "run.json").write_text("{")
    with pytest.raises(HookmechError, match=r"mamba_s1/run.json: not valid JSON"):
        read_sweep_results(runs)
    (runs / "mamba_s1" / "run.json").unlink()  # a run never started: no d_model, the others keep theirs
    assert [row["d_model"] for row in read_sweep_results(runs)] == [64, 64, 64, None]


# -- DAS: the same numbers at any thread count ----------------------------------------------------
def test_das_gives_the_same_bases_and_records_with_one_or_two_threads(trained_attention, tmp_path):
    """The first gradient of the orthogonal parametrisation differs in its last bits between 1 and 2
    threads (reduction order), and training amplified it (K = 1, 200 steps: attribution 0.089 vs
    0.142); DAS now computes on one thread whatever torch's setting, and leaves the setting as it was."""
    import torch

    import hookmech
    from hookmech.cache import write_cache

    _, model, task = trained_attention
    cache = write_cache(model, task.sample(200, seed=1), tmp_path / "c.h5", ["blocks.1.hook_resid_pre"])
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append(hookmech.das.train(model, cache, "L1.block_in", "value", dims=[1], steps=40, seed=0))
        assert torch.get_num_threads() == threads
    one, two = results
    assert one.records == two.records
    assert torch.equal(one.bases["dim1"], two.bases["dim1"])


# -- progress of patch and path_patch -------------------------------------------------------------
@pytest.mark.parametrize("method", ["exact", "atp", "atp-star"])
def test_patch_reports_progress_in_records(trained_attention, method):
    from hookmech.patching import patch

    _, model, task = trained_attention
    done: list[int] = []
    records = patch(model, task.sample(8, seed=1), ["all"], ["key", "value", "all"], method=method,
                    progress=done.append)
    assert sum(done) == len(records) == 14 * (2 + 11)
    if method == "exact":
        assert done == [13] * 14  # one call per site, as it finishes


def test_path_patch_reports_progress_in_pairs_skipped_ones_included(ar_task):
    model = unit_variance(make_model(ar_task, mixers="attention", d_model=16))
    done: list[int] = []
    with pytest.warns(patching.PathSkippedWarning):
        records = path_patch(model, ar_task.sample(4, seed=2), "L0.block_out@all", "L1.block_in@all", "resid",
                             progress=done.append)
    n_pos = 9  # BOS k v k v k v DIV q
    assert done == [n_pos] * n_pos  # each sender position with every receiver position, left-out ones too
    assert len(records) == n_pos  # each position to itself


# -- induction scores on the task's own documents -------------------------------------------------
def _fixture(name):
    from helpers import REPO

    import hookmech

    path = REPO / "fixtures" / f"{name}.safetensors"
    return hookmech.load(path), hookmech.tasks.from_checkpoint(path)


@pytest.mark.parametrize("name", ["attention_ar_cpu", "attention_ar_paper"])
def test_the_attention_fixtures_score_induction_on_their_documents(name):
    """What patching finds (L1.block_in: value 1.00): layer 0 stores the key at the value, layer 1's
    query reads the value. On random repeated tokens the same heads scored 0.056 and 0.015, below
    uniform: out of distribution (kept as the option random_repeat=True)."""
    import hookmech
    from hookmech.effective_attention import uniform_task_scores

    model, task = _fixture(name)
    batch = task.sample(64, seed=1)
    scores, uniform = hookmech.induction_scores(model, batch), uniform_task_scores(batch)
    assert scores[0]["value->key"].item() > 0.9 > 4 * uniform["value->key"]
    assert scores[1]["query->value"].item() > 0.95 > 10 * uniform["query->value"]
    assert scores[0]["query->value"].item() < 0.05 and scores[1]["value->key"].item() < 0.05
    repeated = hookmech.induction_scores(model, random_repeat=True)
    assert repeated[1]["prefix_matching"].item() < 0.06  # what the page showed before


def test_the_mamba_fixture_stores_no_key_at_the_value():
    import hookmech

    model, task = _fixture("mamba_ar_cpu")
    scores = hookmech.induction_scores(model, task.sample(16, seed=1))
    assert scores[0]["value->key"].shape == (1,)  # the channel mean
    assert abs(scores[0]["value->key"].item()) < 0.1  # direct retrieval: value attribution 0.00


def _direct_scores(model, batch):
    """The task scores read off `attention_maps` of the whole batch at once, by hand."""
    import torch

    import hookmech

    rows = torch.arange(len(batch))
    query, value, key = (batch.roles[role] for role in ("query", "value", "key"))
    later, earlier = torch.maximum(value, key), torch.minimum(value, key)
    return {
        layer: {"query->value": M[rows, :, query, value].double().mean(0), "value->key": M[rows, :, later, earlier].double().mean(0)}
        for layer, M in hookmech.attention_maps(model, batch.tokens).items()
    }


@pytest.mark.parametrize(("mixer", "options"), [("attention", {"n_heads": 2}), ("mamba", {}), ("deltanet", {"num_heads": 2})])
@pytest.mark.parametrize("query_by", ["key", "value"])
def test_task_scores_are_the_maps_entries_of_the_roles_in_any_number_of_chunks(mixer, options, query_by, monkeypatch):
    import torch

    import hookmech
    from hookmech import effective_attention, tasks

    task = tasks.make("ar", vocab_size=16, num_kv_pairs=3, query_by=query_by)
    model = unit_variance(make_model(task, mixers=mixer, d_model=16, layer_options=[options] * 2))
    batch = task.sample(10, seed=3)
    expected = _direct_scores(model, batch)
    for chunk_elements in (effective_attention.MAX_ROW_ELEMENTS, 3 * 9 * 9):  # all rows at once; 3 rows at a time
        monkeypatch.setattr(effective_attention, "MAX_ROW_ELEMENTS", chunk_elements)
        got = hookmech.induction_scores(model, batch)
        for layer, by_name in expected.items():
            for name, values in by_name.items():
                torch.testing.assert_close(got[layer][name].double(), values, rtol=1e-6, atol=1e-7)


def test_uniform_attention_scores_the_uniform_baseline():
    """A layer whose query is zero attends uniformly: it scores `uniform_task_scores`."""
    from test_attention_maps import hand_built_attention

    import hookmech
    from hookmech import tasks
    from hookmech.effective_attention import uniform_task_scores

    batch = tasks.make("ar", vocab_size=16, num_kv_pairs=3).sample(8, seed=0)  # 19 tokens, 9 positions: fits
    scores = hookmech.induction_scores(hand_built_attention(False), batch)
    for name, value in uniform_task_scores(batch).items():
        assert scores[1][name].item() == pytest.approx(value, rel=1e-6)
    assert uniform_task_scores(batch) == {"query->value": pytest.approx(1 / 9), "value->key": pytest.approx(
        sum(1 / (v + 1) for v in batch.roles["value"].tolist()) / 8)}


def test_induction_scores_say_what_they_need(ar_task, ar_model):
    import hookmech

    with pytest.raises(UsageError, match="a Batch\\), got the number 16; .* random_repeat=True, rows=16"):
        hookmech.induction_scores(ar_model, batch=16)
    with pytest.raises(UsageError, match="give a batch of the task's documents"):
        hookmech.induction_scores(ar_model)
    batch = ar_task.sample(4, seed=0)
    with pytest.raises(UsageError, match="not both"):
        hookmech.induction_scores(ar_model, batch, random_repeat=True)
    batch.roles.pop("value")
    with pytest.raises(UsageError, match="the batch has no role 'value'"):
        hookmech.induction_scores(ar_model, batch)


# -- the view page in a browser: the strip plot's rows, the induction table -----------------------
from test_view_browser import _errors, _open, browser  # noqa: E402,F401  (the module's Chromium fixture)


def _page(browser, tmp_path, capsys, *extra):
    """Write the attention fixture's page (16 examples, the L*.block_in rows) and open it; return its path."""
    from helpers import ATTENTION_FIXTURE, run_cli

    page = tmp_path / "attention.html"
    code, _, err = run_cli(["view", "--ckpt", ATTENTION_FIXTURE, "--n", "16", "--site", "L*.block_in", "--maps", "1",
                            *extra, "-o", page], capsys)
    assert code == 0, err
    assert _errors(_open(browser, page)) == []
    return page


def test_the_strip_plot_names_its_rows(browser, tmp_path, capsys):  # noqa: F811
    from selenium.webdriver.common.by import By

    _page(browser, tmp_path, capsys)
    browser.find_element(By.CSS_SELECTOR, 'rect.cell[data-site="L1.block_in"][data-pos="value"]').click()
    strip = browser.find_element(By.CSS_SELECTOR, "#drill svg")
    labels = [text.text for text in strip.find_elements(By.TAG_NAME, "text") if text.get_attribute("text-anchor") == "end"]
    assert labels == ["clean", "corrupt", "patched"]  # were 0, 1, 2


def test_the_induction_table_says_what_its_scores_mean(browser, tmp_path, capsys):  # noqa: F811
    from selenium.webdriver.common.by import By

    _page(browser, tmp_path, capsys, "--random-repeat-induction")
    table = browser.find_element(By.ID, "induction")
    assert [th.text for th in table.find_elements(By.TAG_NAME, "th")][-2:] == ["query → value", "value → key"]
    rows = [[td.text for td in tr.find_elements(By.TAG_NAME, "td")] for tr in table.find_elements(By.TAG_NAME, "tr")[1:]]
    assert [row[:3] for row in rows] == [["0", "attention", "head 0"], ["1", "attention", "head 0"]]
    assert float(rows[1][3]) > 0.95 and float(rows[0][4]) > 0.95  # layer 1 query -> value, layer 0 value -> key
    note = table.find_element(By.XPATH, "preceding-sibling::p[1]").text
    assert "Induction is value → key high in an earlier layer and query → value high in a later one" in note
    assert "Uniform causal attention would score" in note
    heading = browser.find_element(By.ID, "induction-random-repeat").find_element(By.XPATH, "preceding-sibling::h3[1]")
    assert "out of the task's distribution" in heading.text


# -- what the tutorial needs of the public API ----------------------------------------------------
def test_a_bundled_fixture_is_found_by_name():
    from helpers import ATTENTION_FIXTURE

    import hookmech

    assert hookmech.fixture("attention_ar_cpu") == hookmech.fixture("attention_ar_cpu.safetensors")
    assert hookmech.fixture("attention_ar_cpu").read_bytes() == ATTENTION_FIXTURE.read_bytes()
    assert hookmech.fixture("mamba_ar_cpu").is_file() and hookmech.fixture("attention_ar_paper").is_file()
    with pytest.raises(UsageError, match="unknown fixture 'mamba' .*mamba_ar_cpu"):
        hookmech.fixture("mamba")


def test_write_cache_takes_site_specs_and_needs_no_file_hash(trained_attention, tmp_path):
    import hookmech
    from hookmech.cache import write_cache
    from hookmech.sites import resolve_sites

    _, model, task = trained_attention
    batch = task.sample(8, seed=1)
    by_spec = write_cache(model, batch, tmp_path / "a.h5", "all", task_spec=task.spec)
    by_hook = write_cache(model, batch, tmp_path / "b.h5", resolve_sites("all", model.hook_dict), task_spec=task.spec)
    with hookmech.cache.open(by_spec) as a, hookmech.cache.open(by_hook) as b:
        assert a.hooks("clean") == b.hooks("clean") and len(a.hooks("clean")) == 14
        assert a.model_hash == b.model_hash  # the cache's identity, without the checkpoint file's hash
        records = hookmech.patching.patch(model, a, "L1.block_in", "value")
    assert records[0]["attribution"] == pytest.approx(1.0, abs=0.01)
    mixed = write_cache(model, batch, tmp_path / "c.h5", ["blocks.1.hook_resid_pre", "L0.mixer.q", "L1.block_in"])
    with hookmech.cache.open(mixed) as c:
        assert sorted(c.hooks("clean")) == ["blocks.0.mixer.hook_q", "blocks.1.hook_resid_pre"]  # once each
    with pytest.raises(UsageError, match="unknown site 'L9.block_in'"):
        write_cache(model, batch, tmp_path / "d.h5", ["L9.block_in"])


#: the modules a tutorial reader imports besides hookmech's lazy top level (docs/api.md documents them)
TUTORIAL_MODULES = {"probe", "report", "view"}


def _hookmech_names(tree) -> tuple[set[str], set[str]]:
    """(modules imported from hookmech, first attribute of every ``hookmech.X...`` chain) of a module's AST."""
    import ast

    imported, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names if alias.name.startswith("hookmech")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hookmech"):
            imported.add(f"{node.module}:{','.join(alias.name for alias in node.names)}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hookmech":
            used.add(node.attr)
    return imported, used


def test_the_tutorial_uses_the_public_api_and_shows_the_other_tools():
    import ast

    from helpers import REPO

    import hookmech

    source = (REPO / "examples" / "tutorial.py").read_text()
    imported, used = _hookmech_names(ast.parse(source))
    assert imported <= {"hookmech", *(f"hookmech.{name}" for name in TUTORIAL_MODULES)}, imported
    assert used <= set(hookmech.__all__) | TUTORIAL_MODULES, used - set(hookmech.__all__) - TUTORIAL_MODULES
    for internal in ("fixture_dir", "sha256_of", "resolve_sites", "model_sha256", "imshow"):
        assert internal not in source, internal
    assert "hookmech.report.plot_heatmap(" in source  # the report's heatmap, not one of its own
    assert "window of 2" in source  # what forces part of the CPU fixture's value -> key pattern
    closing = source[source.index("## 8. More tools"):]
    for call in ('method=method', '"atp"', "hookmech.das.train(", "hookmech.patching.path_patch(",
                 "hookmech.view.write_page("):
        assert call in closing, call
