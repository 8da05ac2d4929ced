"""`hookmech view` of what is committed: run records without their weights (found among the
bundled fixtures by model_hash, or by config, task and final numbers for older records), the
page of a `patch --json` file, and the sizes it reports. References: the engine's own records
of the fixture (`evaluate_mechanism` on the fixture file), the file's own records, a hand count."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import ATTENTION_FIXTURE, REPO, run_cli

from hookmech.fileio import size_text
from hookmech.view import read_page_data
from hookmech.run_weights import fixture_of, run_weights

ATTENTION_RECORD = REPO / "results" / "ar-paper-d64" / "attention_lr0.001_s0_9e1ba1"
PAPER_FIXTURE = REPO / "fixtures" / "attention_ar_paper.safetensors"


def test_a_committed_record_finds_its_weights_among_the_fixtures():
    # the record keeps no model file; the fixture is its final checkpoint (fixtures/README.md)
    assert not (ATTENTION_RECORD / "model.safetensors").exists()
    assert run_weights(ATTENTION_RECORD) == PAPER_FIXTURE
    # the paper-configuration Mamba of the same folder was never bundled (N(0, 0.02) init, positions)
    assert run_weights(ATTENTION_RECORD.parent / "mamba_lr0.001_s0_cb91e7") is None
    # the bundled Mamba fixture is the record of results/ar-table it says it is
    mamba = REPO / "results" / "ar-table" / "d64-mamba-lr1e-2-s0" / "mamba_lr0.01_s0_432a19"
    assert run_weights(mamba) == REPO / "fixtures" / "mamba_ar_paper.safetensors"


def test_an_older_record_matches_only_with_its_own_numbers(tmp_path):
    record = tmp_path / "attention_run"
    shutil.copytree(ATTENTION_RECORD, record)
    assert fixture_of(record) == PAPER_FIXTURE
    summary = json.loads((record / "summary.json").read_text())
    (record / "summary.json").write_text(json.dumps({**summary, "dev_acc": summary["dev_acc"] - 1 / 320}))
    assert fixture_of(record) is None  # another run of the same configuration
    (record / "summary.json").write_text(json.dumps({**summary, "status": "nan"}))
    assert fixture_of(record) is None


def _trained_run(tmp_path):
    """A 6-step run; returns its folder (its summary.json now records model_hash)."""
    from hookmech import tasks
    from hookmech.config import build_config
    from hookmech.training import TrainConfig, train

    task = tasks.make("ar", vocab_size=16, num_kv_pairs=2)
    config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=16, n_layers=2)
    out = tmp_path / "run"
    train_config = TrainConfig(epochs=None, steps=6, n_train=0, eval_every=3, n_dev=16)
    train(task, config, train_config, out, progress=False)
    return out


def test_a_new_run_is_found_by_its_model_hash(tmp_path):
    from hookmech.checkpoint import read_metadata

    run = _trained_run(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model_hash"] == read_metadata(run / "model.safetensors")["model_hash"]
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    shutil.copy(ATTENTION_FIXTURE, fixtures / "other.safetensors")
    (run / "model.safetensors").rename(fixtures / "kept.safetensors")
    assert run_weights(run, fixtures) == fixtures / "kept.safetensors"
    (run / "summary.json").write_text(json.dumps({**summary, "model_hash": "0" * 64}))
    assert fixture_of(run, fixtures) is None  # a recorded hash is the only test: no fallback


def test_the_sweep_page_of_committed_records_draws_the_fixtures_heatmap(tmp_path, capsys):
    from hookmech import tasks
    from hookmech.checkpoint import load
    from hookmech.mech import evaluate_mechanism, mech_batch

    page = tmp_path / "x.html"
    code, out, err = run_cli(
        ["view", ATTENTION_RECORD.parent, "--run", ATTENTION_RECORD.name, "--n", 8, "-o", page], capsys
    )
    assert code == 0, err
    assert "from attention_ar_paper.safetensors" in err and "KiB)" in out
    entry = read_page_data(page)["selected"][0]
    assert entry["no_heatmap"] is None and "attention_ar_paper.safetensors" in entry["weights"]
    task = tasks.from_checkpoint(PAPER_FIXTURE)
    batch = mech_batch(task, 1, 8)  # the page's examples: --n 8 drawn with view's seed (1)
    roles = [role for role in ("key", "value", "query", "divider") if role in batch.roles]
    expected, _ = evaluate_mechanism(load(PAPER_FIXTURE), batch, ["all"], roles)
    assert entry["heatmap"] == json.loads(json.dumps(expected))


def test_a_run_without_weights_says_which_file_to_pass(tmp_path, capsys):
    mamba = ATTENTION_RECORD.parent / "mamba_lr0.001_s0_cb91e7"
    code, _, err = run_cli(["view", mamba.parent, "--run", mamba.name, "--n", 4, "-o", tmp_path / "m.html"], capsys)
    assert code == 0, err
    assert "no bundled fixture holds this run's weights" in err and "hookmech view --ckpt FILE" in err


def test_the_page_of_a_patch_json_file_holds_its_records(tmp_path, capsys):
    code, out, err = run_cli(
        ["patch", "--ckpt", ATTENTION_FIXTURE, "--site", "L0.block_out,L1.block_in", "--pos", "key,value",
         "--n", 8, "--json"], capsys,
    )  # fmt: skip
    assert code == 0, err
    records = json.loads(out)
    (tmp_path / "p.json").write_text(out)
    code, out, err = run_cli(["view", tmp_path / "p.json", "-o", tmp_path / "p.html"], capsys)
    assert code == 0, err
    data = read_page_data(tmp_path / "p.html")
    assert data["kind"] == "records" and data["about"]["records"] == 4 == len(records)
    assert data["records"] == records and not data["about"]["paths"]
    assert "hook" in data["columns"] and "method" in data["columns"]


def test_path_patching_records_are_drawn_sender_by_receiver(tmp_path, capsys):
    code, out, err = run_cli(
        ["patch", "--ckpt", ATTENTION_FIXTURE, "--sender", "L0.mixer_out@value", "--receiver", "L1.block_in@value",
         "--via", "resid", "--n", 8, "--json"], capsys,
    )  # fmt: skip
    assert code == 0, err
    (tmp_path / "path.json").write_text(out)
    code, _, err = run_cli(["view", tmp_path / "path.json", "-o", tmp_path / "path.html"], capsys)
    assert code == 0, err
    [record] = read_page_data(tmp_path / "path.html")["records"]
    assert (record["site"], record["pos"]) == ("L0.mixer_out@value", "L1.block_in@value")
    assert (record["receiver_site"], record["receiver_pos"]) == ("L1.block_in", "value")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{}", "expected a JSON list of patch records (hookmech patch --json), got an object"),
        ("[]", "got an empty list"),
        ("[1]", "record 0 is int, not an object"),
        ('[{"site": "L1.block_in"}]', "record 0 lacks pos, attribution"),
        ("[{", "not valid JSON"),
    ],
)
def test_a_file_that_is_not_patch_records_is_one_line(tmp_path, capsys, text, message):
    (tmp_path / "bad.json").write_text(text)
    code, _, err = run_cli(["view", tmp_path / "bad.json", "-o", tmp_path / "b.html"], capsys)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b.html").exists()


def test_sweep_and_checkpoint_options_are_refused_with_a_records_file(tmp_path, capsys):
    (tmp_path / "p.json").write_text("[]")
    code, _, err = run_cli(["view", tmp_path / "p.json", "--no-heatmaps", "-o", tmp_path / "b.html"], capsys)
    assert code == 2 and "--no-heatmaps does not apply to the page of a patch --json file" in err


def test_sizes_read_as_people_read_them():
    assert [size_text(n) for n in (0, 1023, 1024, 50_800, 2**20 - 1, 3 * 2**20 + 2**19, 5 * 2**30)] == [
        "0 B", "1023 B", "1.0 KiB", "49.6 KiB", "1.0 MiB", "3.5 MiB", "5.0 GiB"]  # fmt: skip
