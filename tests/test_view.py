"""`hookmech view`: the numbers a page embeds are the engine's, the examples' and the report's.

Pages are built through the CLI and read back (`read_page_data`); each embedded number is
compared with an independent source: `hookmech patch --json` of the same examples (exactly),
the per-row lists of `hookmech.patching.patch` (exactly), `hookmech.attention_maps` and
`hookmech.induction_scores`, `hookmech.report`'s figure data, or a hand computation.
The browser test is tests/test_view_browser.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import ATTENTION_FIXTURE, FLOAT64_SUM_TOL, run_cli
from test_report import synthetic_rows

import hookmech
from hookmech.view import pack_floats, pack_ints, read_page_data, unpack
from hookmech.view.checkpoint import SHORT_ROWS, extreme_rows, maps_data
from hookmech.view.page import page_json

MAMBA_FIXTURE = ATTENTION_FIXTURE.parent / "mamba_ar_cpu.safetensors"
ROLES = "key,value,query,divider"


def _patch_json(capsys, *extra):
    code, out, err = run_cli(
        ["patch", "--ckpt", ATTENTION_FIXTURE, "--site", "all", "--pos", ROLES, *extra, "--json"], capsys
    )
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def attention_page(tmp_path_factory):
    """The page of the attention fixture on 12 examples (seed 2), as data."""
    from hookmech.cli.main import main

    path = tmp_path_factory.mktemp("view") / "page.html"
    with _no_exit():
        main(["view", "--ckpt", str(ATTENTION_FIXTURE), "--n", "12", "--seed", "2", "--maps", "3", "-o", str(path)])
    return path, read_page_data(path)


class _no_exit:
    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if kind is SystemExit:
            assert not error.code, f"hookmech view exited {error.code}"
            return True
        return False


def test_page_records_are_the_numbers_of_patch_json(attention_page, capsys):
    _, data = attention_page
    expected = _patch_json(capsys, "--n", "12", "--seed", "2")
    assert [(r["site"], r["pos"]) for r in data["records"]] == [(r["site"], r["pos"]) for r in expected]
    for got, want in zip(data["records"], expected, strict=True):
        assert got == want  # every field, every bit: the same engine on the same examples


def test_per_example_rows_are_the_engines_and_average_to_the_means(attention_page):
    _, data = attention_page
    model, task = hookmech.load(ATTENTION_FIXTURE), hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)
    engine = hookmech.patching.patch(model, task.sample(12, seed=2), "all", ROLES.split(","), per_example=True)
    rows = data["rows"]
    assert unpack(rows["p_clean"]).tolist() == engine[0]["p_clean_rows"]
    assert unpack(rows["p_corrupt"]).tolist() == engine[0]["p_corrupt_rows"]
    for cell, record, reference in zip(data["cells"], data["records"], engine, strict=True):
        p_patched = unpack(cell["p_patched"])
        assert p_patched.tolist() == reference["p_patched_rows"]  # float32 packing loses nothing
        # the record's means are float64 means of the same rows, summed in another order: float64 round-off
        assert p_patched.astype(np.float64).mean() == pytest.approx(record["p_patched"], abs=FLOAT64_SUM_TOL)
    p_clean = unpack(rows["p_clean"]).astype(np.float64).mean()
    assert p_clean == pytest.approx(data["records"][0]["p_clean"], abs=FLOAT64_SUM_TOL)


def test_drill_down_rows_are_the_largest_and_smallest_effects(attention_page):
    _, data = attention_page
    p_corrupt = unpack(data["rows"]["p_corrupt"]).tolist()
    for cell in data["cells"]:
        effect = [p - c for p, c in zip(unpack(cell["p_patched"]).tolist(), p_corrupt, strict=True)]
        by_effect = sorted(range(len(effect)), key=lambda r: (-effect[r], r))
        assert cell["largest"] == by_effect[:5]
        assert cell["smallest"] == sorted(range(len(effect)), key=lambda r: (effect[r], r))[:5]
    assert extreme_rows([0.5, 0.9, 0.1, 0.9], [0.1, 0.1, 0.1, 0.1], 2) == ([1, 3], [2, 0])


def test_examples_and_token_names_are_the_tasks(attention_page):
    _, data = attention_page
    task = hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)
    batch = task.sample(12, seed=2)
    rows = data["rows"]
    shape = (rows["n"], rows["pos"])
    assert np.array_equal(unpack(rows["tokens"]).reshape(shape), batch.tokens.numpy())
    assert np.array_equal(unpack(rows["corrupt_tokens"]).reshape(shape), batch.corrupt_tokens.numpy())
    assert rows["answers"] == batch.answers.tolist() and rows["lengths"] == batch.lengths.tolist()
    assert rows["roles"] == {role: positions.tolist() for role, positions in batch.roles.items()}
    names = data["vocab"]
    assert task.describe_tokens(batch.tokens[0].tolist()) == " ".join(names[t] for t in batch.tokens[0].tolist())
    assert names[0] == "k0" and names[task.vocab_size // 2] == "v0" and "BOS" in names and "DIV" in names


def _square(triangle: np.ndarray, length: int) -> np.ndarray:
    """The causal [length, length] matrix of a lower triangle stored row by row."""
    square = np.zeros((length, length), dtype=np.float32)
    square[np.tril_indices(length)] = triangle
    return square


def test_maps_are_the_effective_attention_of_the_first_examples(attention_page):
    _, data = attention_page
    model, task = hookmech.load(ATTENTION_FIXTURE), hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)
    batch = task.sample(12, seed=2)
    maps = data["maps"]
    assert maps["examples"] == [0, 1, 2] and maps["channels"] is None
    assert [(e["layer"], e["mixer"], e["axis"], e["n"]) for e in maps["layers"]] == [
        (0, "attention", "head", 1),
        (1, "attention", "head", 1),
    ]
    for index, row in enumerate(maps["examples"]):
        length = int(batch.lengths[row])
        reference = hookmech.attention_maps(model, batch.tokens[row : row + 1, :length])
        for layer, packed in enumerate(maps["values"][index]):
            got = _square(unpack(packed), length)
            # one row alone vs the page's batch of rows: the same float32 computation, batched differently
            np.testing.assert_allclose(got, reference[layer][0, 0].numpy(), rtol=0, atol=1e-6)
            assert np.allclose(got.sum(axis=1), 1.0, atol=1e-5)  # softmax rows (attention's M)


def test_per_channel_maps_for_short_rows_average_to_the_channel_mean():
    model, task = hookmech.load(MAMBA_FIXTURE), hookmech.tasks.from_checkpoint(MAMBA_FIXTURE)
    batch = task.sample(3, seed=0)
    assert int(batch.lengths.max()) <= SHORT_ROWS
    maps = maps_data(model, batch, examples=2, budget=1 << 30)
    assert maps["examples"] == [0, 1] and maps["layers"][0]["axis"] == "channel"
    width = maps["layers"][0]["channels"]
    assert width == model.blocks[0].mixer.effective_attention(torch.zeros(1, 2, 64)).shape[1]
    for index, row in enumerate(maps["examples"]):
        length = int(batch.lengths[row])
        size = length * (length + 1) // 2
        for layer in range(2):
            channels = unpack(maps["channels"][index][layer]).reshape(width, size)
            mean = unpack(maps["values"][index][layer])
            # the float32 mean over channels in another order: float32 round-off of values up to ~50
            np.testing.assert_allclose(channels.mean(axis=0), mean, rtol=0, atol=1e-4)


def test_map_budget_keeps_at_least_one_example(attention_page):
    model, task = hookmech.load(ATTENTION_FIXTURE), hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)
    batch = task.sample(6, seed=2)
    assert maps_data(model, batch, examples=6, budget=1)["examples"] == [0]
    one_row = 2 * 4 * 11 * 12 // 2  # two layers of one head, a lower triangle of 11 tokens, float32
    assert maps_data(model, batch, examples=6, budget=3 * one_row)["examples"] == [0, 1, 2]


def test_induction_scores_are_the_librarys_on_the_examples(attention_page):
    """The page's 12 examples (seed 2): the library's scores of them (at most `INDUCTION_ROWS`);
    no random-repeat table unless asked (tests/cli/test_rough_edges_cli.py)."""
    _, data = attention_page
    model, task = hookmech.load(ATTENTION_FIXTURE), hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)
    scores = hookmech.induction_scores(model, task.sample(12, seed=2))
    assert data["induction"]["n"] == 12
    assert [entry["scores"] for entry in data["induction"]["layers"]] == [
        {name: values.tolist() for name, values in by_name.items()} for by_name in scores.values()
    ]
    assert "random_repeat" not in data["induction"]


def test_a_cache_page_has_the_numbers_of_patch_with_that_cache(tmp_path, capsys):
    cache = tmp_path / "c.h5"
    assert run_cli(["cache", "--ckpt", ATTENTION_FIXTURE, "--n", "7", "--seed", "4", "-o", cache], capsys)[0] == 0
    code, _, err = run_cli(
        [
            "view",
            "--ckpt",
            ATTENTION_FIXTURE,
            "--cache",
            cache,
            "--pos",
            "value,query",
            "--site",
            "L1.block_in,L0.mixer_out",
            "-o",
            tmp_path / "p.html",
        ],
        capsys,
    )
    assert code == 0, err
    code, out, err = run_cli(
        [
            "patch",
            "--ckpt",
            ATTENTION_FIXTURE,
            "--cache",
            cache,
            "--site",
            "L1.block_in,L0.mixer_out",
            "--pos",
            "value,query",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    assert read_page_data(tmp_path / "p.html")["records"] == json.loads(out)


def test_pages_are_deterministic_and_self_contained(attention_page, tmp_path):
    path, _ = attention_page
    from hookmech.cli.main import main

    again = tmp_path / "again.html"
    with _no_exit():
        main(["view", "--ckpt", str(ATTENTION_FIXTURE), "--n", "12", "--seed", "2", "--maps", "3", "-o", str(again)])
    text = path.read_text()
    assert again.read_text() == text
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    assert "<script src" not in text and "<link" not in text


def test_page_json_cannot_close_its_script_element():
    """No "</script", "<script" or "<!--" in any case (test_view_browser.py opens such pages)."""
    hostile = {"name": "</script><script>alert(1)</script>", "<!--<SCRIPT>": ["<!--<sCrIpT>", "</ScRiPt >"]}
    text = page_json({**hostile, "x": float("nan")})
    assert "<" not in text and json.loads(text) == {**hostile, "x": None}


@pytest.mark.parametrize(("values", "dtype"), [([0.25, 1.0, 0.1], "f8"), ([0.25, 1.0, float(np.float32(0.1))], "f4")])
def test_packed_floats_are_float32_only_when_that_loses_nothing(values, dtype):
    packed = pack_floats(values)
    assert packed["dtype"] == dtype and unpack(packed).tolist() == values


@pytest.mark.parametrize(("values", "dtype"), [([0, 255], "u1"), ([0, 256], "u2"), ([-1, 3], "i4"), ([70000], "i4")])
def test_packed_ints_take_the_narrowest_type(values, dtype):
    packed = pack_ints(values)
    assert packed["dtype"] == dtype and unpack(packed).tolist() == values


# -- sweep folders ---------------------------------------------------------------------------
def _sweep_folder(tmp_path):
    from hookmech.sweep import write_results

    runs = tmp_path / "runs"
    runs.mkdir()
    rows = synthetic_rows()
    write_results(rows, runs / "results.csv")
    run = runs / rows[0]["run_id"]
    run.mkdir()
    lines = [
        {"step": 2, "loss": 2.0, "lr": 1e-3, "dev_acc": 0.2, "dev_p_answer": 0.1, "seconds": 1.0},
        {
            "step": 4,
            "loss": 1.0,
            "lr": 1e-3,
            "dev_acc": 0.5,
            "dev_p_answer": 0.4,
            "seconds": 2.0,
            "attr:L1.block_in@value": 0.75,
        },
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return runs


def test_sweep_page_holds_the_numbers_of_the_reports_figures(tmp_path, capsys):
    from hookmech.report import attribution_bars, bootstrap_interval, summarise

    runs = _sweep_folder(tmp_path)
    first_run = synthetic_rows()[0]["run_id"]
    code, out, err = run_cli(
        ["view", runs, "--no-heatmaps", "--run", f"{first_run},nan_run", "-o", tmp_path / "s.html"], capsys
    )
    assert code == 0, err
    data = read_page_data(tmp_path / "s.html")
    keys = ["arch", "d_model", "lr", "seed"]
    assert data["kind"] == "sweep" and data["keys"] == keys and data["site"] == "L1.block_in"
    assert data["summary"] == json.loads(json.dumps(summarise(synthetic_rows(), keys)))
    assert data["bars"] == json.loads(json.dumps(attribution_bars(synthetic_rows(), keys, "L1.block_in")))
    # by hand: attention's passing runs are its 4 good-lr runs (seeds 0, 1) and the 2 seed-0 runs at the other lr
    attention = data["bars"][0]
    values = [0.9] * 4 + [0.91] * 2  # value + 0.01 * seed over the 6 passing runs
    assert attention["n"] == 6 and attention["positions"]["value"]["mean"] == pytest.approx(np.mean(values))
    assert (attention["positions"]["value"]["low"], attention["positions"]["value"]["high"]) == bootstrap_interval(
        [
            r["attr:L1.block_in@value"]
            for r in synthetic_rows()
            if r["arch"] == "attention" and r["status"] == "finished" and r["mech_passes"]
        ]
    )
    curve = next(c for c in data["lr_curves"] if c["series"] == "mamba" and c["d_model"] == 32)
    # mamba at d_model 32, lr 1e-2 (its good lr): 0.9 + 0.02 seed + 0.05 over seeds 0, 1
    # (the synthetic accuracies are sums of decimals: float64 round-off, pytest.approx rel 1e-6)
    assert curve["points"][1] == {
        "lr": 1e-2,
        "mean": pytest.approx(0.96),
        "min": pytest.approx(0.95),
        "max": pytest.approx(0.97),
        "n": 2,
    }
    assert len(data["value_query"]) == sum(
        1 for r in synthetic_rows() if r["status"] == "finished" and r["mech_passes"]
    )
    assert [s["run_id"] for s in data["selected"]] == [first_run, "nan_run"]
    assert data["selected"][0]["heatmap"] is None and data["selected"][1]["dynamics"] is None
    assert data["selected"][0]["dynamics"] == {
        "step": [2, 4],
        "loss": [2.0, 1.0],
        "dev_acc": [0.2, 0.5],
        "dev_p_answer": [0.1, 0.4],
        "attr": {"L1.block_in@value": [None, 0.75]},
    }
