"""`hookmech view` pages in a real browser: headless Chromium from Debian's `chromium` and
`chromium-driver` packages, driven by selenium through the system chromedriver (nothing is
downloaded: selenium-manager is kept offline).

The page must draw without a console error; clicking a heatmap cell must show, in the
drill-down, the numbers `hookmech patch --json` prints for that cell. Outside CI (no `CI`
variable) the tests are skipped when the browser is missing; in CI they must run (.ci/run
installs the packages). A screenshot of each page is saved beside the test's files.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import ATTENTION_FIXTURE, run_cli
from test_view import _sweep_folder

from hookmech.view.browser import browser_missing, headless_chromium

N, SEED = 16, 1
ROLES = "key,value,query,divider"


@pytest.fixture(scope="module")
def browser():
    reason = browser_missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {reason}")
        pytest.skip(reason)
    driver = headless_chromium()
    yield driver
    driver.quit()


def _open(driver, path):
    """Load a page, wait until its script has drawn it; return the console's entries."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(path.as_uri())
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
    return driver.get_log("browser")


def _errors(log):
    return [entry for entry in log if entry["level"] in ("SEVERE", "ERROR")]


def test_clicking_a_cell_shows_the_numbers_of_patch_json(browser, tmp_path, capsys):
    from selenium.webdriver.common.by import By

    page = tmp_path / "attention.html"
    code, _, err = run_cli(
        ["view", "--ckpt", ATTENTION_FIXTURE, "--n", N, "--seed", SEED, "--maps", 4, "-o", page], capsys
    )
    assert code == 0, err
    code, out, err = run_cli(
        ["patch", "--ckpt", ATTENTION_FIXTURE, "--site", "all", "--pos", ROLES, "--n", N, "--seed", SEED, "--json"],
        capsys,
    )
    assert code == 0, err
    expected = {(r["site"], r["pos"]): r for r in json.loads(out)}

    log = _open(browser, page)
    assert _errors(log) == []
    cells = browser.find_elements(By.CSS_SELECTOR, "rect.cell")
    assert len(cells) == len(expected) == 14 * 4
    for site, pos in (("L1.block_in", "value"), ("L0.mlp_out", "query")):
        cell = browser.find_element(By.CSS_SELECTOR, f'rect.cell[data-site="{site}"][data-pos="{pos}"]')
        cell.click()
        drill = browser.find_element(By.ID, "drill")
        assert (drill.get_attribute("data-site"), drill.get_attribute("data-pos")) == (site, pos)
        record = expected[site, pos]
        for field in ("attribution", "p_clean", "p_corrupt", "p_patched", "n", "passes_filter"):
            shown = drill.find_element(By.CSS_SELECTOR, f'td[data-field="{field}"]')
            assert json.loads(shown.get_attribute("data-exact")) == record[field], field  # the very number
            if isinstance(record[field], float):
                # the text shows it to 4 decimals (or 4 significant digits below 0.01)
                assert float(shown.text) == pytest.approx(record[field], rel=1e-3, abs=5e-5), field
        # the per-example strips: one dot per example and run; 5 + 5 example rows with their tokens
        assert len(drill.find_elements(By.CSS_SELECTOR, "svg circle")) == 3 * N
        for listing in ("largest effect", "smallest effect"):
            rows = drill.find_elements(By.CSS_SELECTOR, f'table[data-list="{listing}"] tr[data-row]')
            assert len(rows) == 5
            assert "BOS" in rows[0].text and "answer" in rows[0].text
    assert len(browser.find_elements(By.CSS_SELECTOR, ".mapbox canvas")) == 2  # one map per layer
    assert _errors(browser.get_log("browser")) == []
    assert browser.save_screenshot(str(tmp_path / "attention.png"))


def test_a_sweep_page_draws_without_errors(browser, tmp_path, capsys):
    from selenium.webdriver.common.by import By

    runs = _sweep_folder(tmp_path)
    page = tmp_path / "sweep.html"
    first = sorted(p.name for p in runs.iterdir() if p.is_dir())[0]
    code, _, err = run_cli(["view", runs, "--no-heatmaps", "--run", first, "-o", page], capsys)
    assert code == 0, err
    assert _errors(_open(browser, page)) == []
    titles = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "section h2")]
    assert titles == [
        "Headline",
        "Accuracy vs d_model",
        "Learning-rate sensitivity",
        "Mechanisms (L1.block_in)",
        "Selected runs",
    ]
    assert (
        len(browser.find_elements(By.CSS_SELECTOR, "svg")) >= 1 + 2 + 2 + 3
    )  # accuracy, lr panels, mechanisms, dynamics
    assert browser.save_screenshot(str(tmp_path / "sweep.png"))


def test_the_page_of_a_patch_json_file_draws_its_records(browser, tmp_path, capsys):
    from selenium.webdriver.common.by import By

    code, out, err = run_cli(
        ["patch", "--ckpt", ATTENTION_FIXTURE, "--site", "all", "--pos", ROLES, "--n", N, "--seed", SEED, "--json"],
        capsys,
    )
    assert code == 0, err
    records = json.loads(out)
    (tmp_path / "records.json").write_text(out)
    page = tmp_path / "records.html"
    code, _, err = run_cli(["view", tmp_path / "records.json", "-o", page], capsys)
    assert code == 0, err
    assert _errors(_open(browser, page)) == []
    assert len(browser.find_elements(By.CSS_SELECTOR, "rect.cell")) == len(records) == 14 * 4
    rows = browser.find_elements(By.CSS_SELECTOR, "table#records tr")
    assert len(rows) == 1 + len(records)
    first = [cell.text for cell in rows[1].find_elements(By.TAG_NAME, "td")]
    assert first[:2] == [records[0]["site"], records[0]["pos"]]
    assert float(first[3]) == pytest.approx(records[0]["p_clean"], rel=1e-3, abs=5e-5)
    assert browser.save_screenshot(str(tmp_path / "records.png"))


# -- hostile names: text from files and folders must stay text ---------------------------------
#: names that break a page embedding them raw in its script element: "<!--<script>" puts the
#: tokenizer in the script-data double-escaped state (the real "</script>" no longer ends the
#: element), "</script>" ends it early; any case; and markup that would run if parsed as HTML
HOSTILE = "<!--<script>"
HOSTILE_TEXT = "</SCRIPT><!--<ScRiPt>x</script><img src=x onerror=window.pwned=1><script>window.pwned=1</script>"


def _hostile_sweep(tmp_path, title_from):
    """A sweep folder named HOSTILE whose run id, series value and (with `title_from` "sweep.json")
    sweep name hold hostile text; returns (folder, the title the page should show, the run id)."""
    from test_report import synthetic_rows

    from hookmech.sweep import write_results

    runs = tmp_path / f"runs {HOSTILE}"
    runs.mkdir()
    rows = synthetic_rows()
    run_id = f"{HOSTILE}run"
    rows[0] = {**rows[0], "run_id": run_id, "arch": HOSTILE_TEXT}
    write_results(rows, runs / "results.csv")
    (runs / run_id).mkdir()
    line = {"step": 2, "loss": 1.0, "dev_acc": 0.5, "dev_p_answer": 0.4, f"attr:{HOSTILE}@value": 0.5}
    (runs / run_id / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    title = runs.name
    if title_from == "sweep.json":
        title = f"{HOSTILE_TEXT} {HOSTILE}"
        grid = {"arch": ["attention", "mamba"], "d_model": [16, 32], "lr": [1e-3, 1e-2], "seed": [0, 1]}
        (runs / "sweep.json").write_text(json.dumps({"name": title, "grid": grid}))
    return runs, title, run_id


def _assert_drawn_as_text(driver, log, title):
    """The page drew (its script ran to the end), ran nothing from the data, and shows `title` as text."""
    from selenium.webdriver.common.by import By

    assert _errors(log) == []
    assert driver.execute_script("return window.pwned === undefined && document.images.length === 0")
    assert driver.find_element(By.TAG_NAME, "h1").text == title
    assert driver.title == title


@pytest.mark.parametrize("title_from", ["sweep.json", "folder name"])
def test_hostile_names_in_a_sweep_page_stay_text(browser, tmp_path, capsys, title_from):
    from selenium.webdriver.common.by import By

    runs, name, run_id = _hostile_sweep(tmp_path, title_from)
    page = tmp_path / "sweep.html"
    code, _, err = run_cli(["view", runs, "--no-heatmaps", "--run", run_id, "-o", page], capsys)
    assert code == 0, err
    _assert_drawn_as_text(browser, _open(browser, page), f"{name}: sweep")
    assert str(runs) in browser.find_element(By.ID, "about").text
    box = browser.find_element(By.CSS_SELECTOR, "#page div[data-run]")
    assert box.get_attribute("data-run") == run_id
    assert box.find_element(By.TAG_NAME, "h3").text.startswith(f"{run_id}: {HOSTILE_TEXT}, d_model 16")
    cells = [cell.text for cell in browser.find_elements(By.CSS_SELECTOR, "section table td:first-child")]
    assert HOSTILE_TEXT in cells  # the series, in the headline table
    legend = [text.text for text in browser.find_elements(By.CSS_SELECTOR, "g.legend text")]
    assert f"{HOSTILE}@value" in legend  # the attribution's name, in the dynamics chart


def test_hostile_names_in_a_checkpoint_page_stay_text(browser, tmp_path, capsys):
    from selenium.webdriver.common.by import By

    folder = tmp_path / HOSTILE
    folder.mkdir()
    ckpt = folder / f"{HOSTILE}.safetensors"
    ckpt.write_bytes(ATTENTION_FIXTURE.read_bytes())
    page = tmp_path / "ckpt.html"
    code, _, err = run_cli(["view", "--ckpt", ckpt, "--n", 4, "--maps", 1, "-o", page], capsys)
    assert code == 0, err
    _assert_drawn_as_text(browser, _open(browser, page), f"{ckpt.name}: attention on ar")
    assert f"source {ckpt}" in browser.find_element(By.ID, "about").text
    assert len(browser.find_elements(By.CSS_SELECTOR, "rect.cell")) == 14 * 4
