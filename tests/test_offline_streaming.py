"""probe, das and view read an activation cache in row chunks sized from a memory budget
(hookmech.row_chunks, issue 31): forced into many small chunks, each gives what the whole cache
read at once gives (the probe and DAS to round-off, view's patched rows to the engine's batching
contract ENGINE_TOL), and none reads more rows at a time than its chunk."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import ENGINE_TOL, FLOAT64_SUM_TOL, REPO
from torch.nn import functional as F

import hookmech
from hookmech.cache import CacheFile, write_cache
from hookmech.row_chunks import MEMORY_MIB, check_memory, chunk_rows, row_chunks
from hookmech.das import train
from hookmech.das.data import ORDER_ROWS, DasData
from hookmech.errors import UsageError
from hookmech.patching import patch
from hookmech.probe import _fit_logistic_chunks, fit_probe, probe_data
from hookmech.sites import site_to_hook
from hookmech.splits import split_by_document
from hookmech.view import checkpoint_page_data, read_page_data, render_page, unpack, write_page
from hookmech.view import spill as spill_module
from hookmech.view.checkpoint import _Extremes, extreme_rows, rows_data
from hookmech.view.encode import pack_floats, pack_ints
from hookmech.view.spill import Spill

ATTENTION = REPO / "fixtures" / "attention_ar_cpu.safetensors"
SITES = ["L0.block_in", "L1.block_in", "L1.mixer_in", "L1.mlp_out"]


@pytest.fixture(scope="module")
def attention_cache(tmp_path_factory):
    """The CPU attention fixture, its task, and a 90-row cache (seed 3) of four sites."""
    model, task = hookmech.load(ATTENTION), hookmech.tasks.from_checkpoint(ATTENTION)
    path = tmp_path_factory.mktemp("stream") / "c.h5"
    hooks = [site_to_hook(site) for site in SITES]
    write_cache(model, task.sample(90, seed=3), path, hooks, task_spec=task.spec)
    return model, task, path


@pytest.fixture
def row_reads(monkeypatch):
    """The largest number of rows read from a cache file at once (row columns and activations)."""
    largest = {"rows": 0}
    rows_of, read_of = CacheFile._rows, CacheFile.read_rows

    def count(rows: slice, n: int) -> None:
        start, stop, _ = rows.indices(n)
        largest["rows"] = max(largest["rows"], stop - start)

    def rows_spy(self, rows):
        count(rows, self.n)  # a window's reads come here with the window's own rows
        return rows_of(self, rows)

    def read_spy(self, hook, which, rows):
        count(rows, self.n)
        return read_of(self, hook, which, rows)

    monkeypatch.setattr(CacheFile, "_rows", rows_spy)
    monkeypatch.setattr(CacheFile, "read_rows", read_spy)
    return largest


# -- the planner -------------------------------------------------------------------------------
def test_chunk_rows_are_the_rows_that_fit_in_the_budget():
    assert chunk_rows(2**20, 256) == 256  # 1 MiB rows in 256 MiB, by hand
    assert chunk_rows(3 * 2**10, 1) == 341  # floor(1024 / 3)
    assert chunk_rows(2**30, 1) == 1  # one row over the budget is still read
    assert chunk_rows(100, 256, at_most=512) == 512
    assert [(s.start, s.stop) for s in row_chunks(10, 4)] == [(0, 4), (4, 8), (8, 10)]
    assert MEMORY_MIB == 256
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="--memory"):
            check_memory(bad)


# -- a window of rows --------------------------------------------------------------------------
def test_a_window_reads_the_files_rows(attention_cache):
    _, _, path = attention_cache
    hook = site_to_hook("L1.block_in")
    with CacheFile(path) as cache:
        whole = cache.batch()
        window = cache.window(slice(31, 57))
        part = window.batch()
        assert window.n == 26
        for name in ("tokens", "corrupt_tokens", "answers", "lengths", "doc_index"):
            assert torch.equal(getattr(part, name), getattr(whole, name)[31:57]), name
        assert torch.equal(window.p_answer("corrupt"), cache.p_answer("corrupt")[31:57])
        assert np.array_equal(window.read_rows(hook, "clean", slice(2, 9)), cache.read_rows(hook, "clean", slice(33, 40)))
        assert torch.equal(window.at(hook, "value", "corrupt"), cache.at(hook, "value", "corrupt")[31:57])
        positions = np.arange(26) % 5
        assert np.array_equal(window.gather(hook, positions).numpy(), cache[hook][31:57][np.arange(26), positions])
        with pytest.raises(UsageError, match="one position per row"):
            window.gather(hook, positions[:3])
        window.close()
        assert cache.n == 90 and len(cache.batch()) == 90  # the file stays open


# -- probe -------------------------------------------------------------------------------------
def whole_cache_probe(cache, site, pos, target, seed=0, weight_decay=1e-3, max_iter=100):
    """The probe as it was before row chunks, written out: every row's features at once,
    float32 statistics, one full-batch L-BFGS. Returns (held-out acc, train acc, W, b)."""
    hook = cache.hook_of(site)
    features, labels, doc_index = probe_data(cache, hook, pos, target)
    train_rows, heldout = split_by_document(doc_index, 0.25, seed)
    classes, train_labels = torch.unique(labels[train_rows], return_inverse=True)
    mean = features[train_rows].mean(0)
    std = features[train_rows].std(0, unbiased=False).clamp_min(1e-6)
    standard = (features - mean) / std
    x = standard[train_rows].double()
    weight = torch.zeros(x.shape[1], len(classes), dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(len(classes), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1, max_iter=max_iter, history_size=20,
                                  line_search_fn="strong_wolfe", tolerance_grad=1e-9, tolerance_change=1e-12)

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, train_labels) + 0.5 * weight_decay * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    correct = classes[(standard.double() @ weight + bias).argmax(-1)] == labels
    return correct[heldout].double().mean().item(), correct[train_rows].double().mean().item(), weight, bias


@pytest.mark.parametrize(("site", "pos", "target"), [("L1.block_in", "value", "key"), ("L1.mlp_out", "query", "answer")])
def test_a_probe_in_small_chunks_is_the_whole_cache_probe(attention_cache, row_reads, site, pos, target):
    """Accuracies are counts: equal. 0.01 MiB is below the 90 rows' features, so they also go
    through the temporary file."""
    _, _, path = attention_cache
    with CacheFile(path) as cache:
        heldout, trained, _, _ = whole_cache_probe(cache, site, pos, target)
        row_reads["rows"] = 0
        chunked = fit_probe(cache, site, pos, target, chunk=7, memory=0.01)
        assert row_reads["rows"] <= 7
        in_memory = fit_probe(cache, site, pos, target, chunk=7)
    assert (chunked.heldout_accuracy, chunked.train_accuracy) == (heldout, trained)
    assert chunked == in_memory  # the same sums, from memory or from the file


def test_a_chunked_logistic_fit_is_the_full_batch_fit():
    """L-BFGS on the gradient summed over 13 chunks follows the full batch's steps: the fits
    agree to far below a step (float64 sums in another order; a chunk lost or double-counted
    moves W by > 1e-2)."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(200, 12, generator=generator, dtype=torch.float64)
    labels = (features[:, :3].argmax(-1) + (torch.rand(200, generator=generator) < 0.2).long()) % 3
    whole = _fit_logistic_chunks([(features, labels)], 12, 3, 1e-3, 100)
    parts = list(zip(features.split(16), labels.split(16), strict=True))
    chunked = _fit_logistic_chunks(parts, 12, 3, 1e-3, 100)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    wrong = _fit_logistic_chunks(parts[1:], 12, 3, 1e-3, 100)
    assert (wrong[0] - whole[0]).abs().max() > 1e-2


# -- DAS ---------------------------------------------------------------------------------------
def test_das_rows_per_chunk_follow_the_budget(attention_cache, row_reads):
    model, _, path = attention_cache
    hook = site_to_hook("L1.block_in")
    with CacheFile(path) as cache:
        assert DasData(model, cache, hook, "value").chunk_rows == ORDER_ROWS  # 512 rows fit in 256 MiB
        data = DasData(model, cache, hook, "value", memory=0.1)
        # per row, by hand: L1.block_in clean and corrupt and L1.mixer_in corrupt (T x 64 float32,
        # stored and as float) and one resumed block's context (4 x T x 64 float32)
        n_pos = cache.n_pos
        per_row = 3 * n_pos * 64 * (4 + 4) + 4 * n_pos * 64 * 4
        assert data.chunk_rows == math.floor(0.1 * 2**20 / per_row) < 90
        row_reads["rows"] = 0
        for _ in data.chunks(data.dev):
            pass
        assert row_reads["rows"] <= data.chunk_rows


def test_das_records_do_not_depend_on_the_budget_while_it_holds_512_rows(attention_cache):
    """The default budget gives the chunk DAS always read (512 rows), so the same bases; a budget
    of a few rows reads the cache a few rows at a time and still trains and scores every row."""
    model, _, path = attention_cache
    options = {"dims": [2], "steps": 8, "batch_size": 4}
    default = train(model, path, "L1.block_in", "value", **options)
    fixed = train(model, path, "L1.block_in", "value", chunk_rows=512, **options)
    assert default.records == fixed.records
    torch.testing.assert_close(default.bases["dim2"], fixed.bases["dim2"], rtol=0, atol=0)
    small = train(model, path, "L1.block_in", "value", memory=0.05, **options)
    record, reference = small.records[0], default.records[0]
    assert record["n_dev"] == reference["n_dev"] and record["n_train"] == reference["n_train"]
    # the whole activation's interchange does not depend on the data order: the same to the engine's batching
    assert record["iia_full"] == reference["iia_full"]
    assert record["attribution_full"] == pytest.approx(reference["attribution_full"], abs=ENGINE_TOL)


# -- view --------------------------------------------------------------------------------------
def whole_cache_page(model, task, cache):
    """The page's rows, cells and records as they were made before row chunks: one `patch` of
    every row with per-example lists, `rows_data` and `extreme_rows` of all rows."""
    batch = cache.batch()
    records = patch(model, cache, ["L*.block_in"], ["key", "value"], per_example=True)
    rows = rows_data(batch, records[0]["p_clean_rows"], records[0]["p_corrupt_rows"])
    cells = [record.pop("p_patched_rows") for record in records]
    for record in records:
        for name in ("p_clean_rows", "p_corrupt_rows", "metric_patched_rows"):
            record.pop(name, None)
    return rows, cells, records


def test_a_page_in_small_chunks_has_the_whole_caches_numbers(attention_cache, row_reads, tmp_path):
    model, task, path = attention_cache
    with CacheFile(path) as cache:
        rows, cells, records = whole_cache_page(model, task, cache)
        row_reads["rows"] = 0
        data = checkpoint_page_data(model, task, cache, sites=["L*.block_in"], positions=["key", "value"], chunk=8,
                                    spill=True)
        assert row_reads["rows"] <= max(8, 64)  # the chunks, and the first rows for maps and induction
        page = tmp_path / "page.html"
        write_page(data, page, "chunked")
    got = read_page_data(page)
    # the rows themselves: exactly
    for name in ("n", "pos", "lengths", "answers", "roles"):
        assert got["rows"][name] == rows[name], name
    for name in ("tokens", "corrupt_tokens", "p_clean", "p_corrupt"):
        assert got["rows"][name]["dtype"] == rows[name]["dtype"]
        assert np.array_equal(unpack(got["rows"][name]), unpack(rows[name])), name
    # each row patched in another batch: the engine's batching contract; the means to it too
    assert len(got["records"]) == len(records) == len(got["cells"])
    for record, reference in zip(got["records"], records, strict=True):
        assert record.keys() == reference.keys()
        for key, value in reference.items():
            if isinstance(value, float):
                assert record[key] == pytest.approx(value, abs=ENGINE_TOL), key
            else:
                assert record[key] == value, key
    p_corrupt = unpack(got["rows"]["p_corrupt"]).astype(np.float64)
    for cell, record, reference in zip(got["cells"], got["records"], cells, strict=True):
        p_patched = unpack(cell["p_patched"]).astype(np.float64)
        np.testing.assert_allclose(p_patched, reference, rtol=0, atol=ENGINE_TOL)
        # the record's mean is its rows' mean (a weighted mean of the chunks' means)
        assert record["p_patched"] == pytest.approx(p_patched.mean(), abs=FLOAT64_SUM_TOL)
        # the drill-down rows are those of all rows at once, of the page's own numbers
        largest, smallest = extreme_rows(p_patched.tolist(), p_corrupt.tolist(), 5)
        assert (cell["largest"], cell["smallest"]) == (largest, smallest)


def test_a_page_in_one_chunk_is_the_unstreamed_page(attention_cache, tmp_path):
    """The default budget holds the 90 rows: the written page is `render_page` of the data made in
    memory, byte for byte, and its records are `patch`'s own."""
    model, task, path = attention_cache
    options = {"sites": ["L1.block_in"], "positions": ["value"]}
    in_memory = checkpoint_page_data(model, task, path, **options)
    spilled = checkpoint_page_data(model, task, path, spill=True, **options)
    write_page(spilled, tmp_path / "page.html", "one chunk")
    assert (tmp_path / "page.html").read_text(encoding="utf-8") == render_page(in_memory, "one chunk")
    reference = patch(model, path, ["L1.block_in"], ["value"])
    assert in_memory["records"] == reference


@pytest.mark.parametrize(
    ("kind", "values"),
    [
        ("floats", np.float32(np.random.default_rng(0).random(1000)).astype(np.float64)),  # float32-exact: f4
        ("floats", np.random.default_rng(1).random(1000)),  # f8
        ("ints", np.arange(700) % 200),  # u1
        ("ints", np.arange(700) * 90),  # u2
        ("ints", np.arange(700) - 5),  # i4
        ("list", np.arange(700) % 13),
        ("floats", np.zeros(0)),
    ],
)
def test_a_spill_writes_what_packing_the_whole_array_writes(monkeypatch, kind, values):
    monkeypatch.setattr(spill_module, "PIECE", 9)  # many pieces, each a multiple of 3 values
    spill = Spill(kind)
    for part in np.array_split(values, 17):
        spill.append(part)
    whole = {"floats": pack_floats, "ints": pack_ints, "list": lambda v: v.tolist()}[kind](values)
    written = __import__("io").StringIO()
    spill.write_json(written)
    assert written.getvalue() == json.dumps(whole, separators=(",", ":"))
    assert spill.packed() == whole
    spill.close()


def test_extremes_kept_chunk_by_chunk_are_those_of_all_rows():
    """Ties (effects rounded to 0.1) go to the lower row, as `extreme_rows` picks them."""
    rng = np.random.default_rng(4)
    p_patched, p_corrupt = rng.random(500).round(1), np.zeros(500)
    largest, smallest = _Extremes(5, largest=True), _Extremes(5, largest=False)
    for rows in row_chunks(500, 23):
        for top in (largest, smallest):
            top.add(p_patched[rows] - p_corrupt[rows], rows.start)
    assert (largest.rows(), smallest.rows()) == extreme_rows(p_patched.tolist(), p_corrupt.tolist(), 5)


# -- the command line --------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["probe", "das", "view"])
def test_a_memory_that_is_not_a_positive_number_is_one_line(attention_cache, tmp_path, capsys, command):
    from hookmech.cli.main import main

    _, _, path = attention_cache
    arguments = {
        "probe": ["probe", str(path), "--site", "L1.block_in", "--pos", "value"],
        "das": ["das", "--ckpt", str(ATTENTION), "--cache", str(path), "--site", "L1.block_in", "--pos", "value",
                "--dim", "1", "-o", str(tmp_path / "das")],
        "view": ["view", "--ckpt", str(ATTENTION), "--cache", str(path), "-o", str(tmp_path / "page.html")],
    }[command]
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--memory", "0"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--memory must be a number of MiB > 0" in error
