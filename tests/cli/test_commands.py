"""The command line: every command end to end, and every error path as one line + exit code."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hookmech
from hookmech.cli.main import main

from helpers import CACHE_TOL, run_cli

TRAIN = ["train", "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3", "--n-train", "0",
         "--steps", "12", "--mixer", "attention", "--mixer-opt", "L0.window=2", "--no-tie-embeddings", "--d-model", "16",
         "--n-dev", "16", "--eval-every", "6", "--ckpt-every", "6"]


def run(argv, capsys):
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    return run_cli(argv, capsys)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    try:
        main([*TRAIN, "-o", str(out)])
    except SystemExit as done:
        assert not done.code
    return out / "model.safetensors"


def test_help_does_not_import_torch():
    code = "import sys; from hookmech.cli.main import main\ntry: main(['--help'])\nexcept SystemExit: pass\n" \
           "print('torch' in sys.modules, 'transformer_lens' in sys.modules)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip().splitlines()[-1] == "False False"


def test_train_writes_the_run_folder(trained):
    folder = trained.parent
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == 12 and {"dev_acc", "dev_p_answer", "seconds"} <= set(summary)
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 2
    model = hookmech.load(trained)
    assert model.cfg.mixer_kwargs == ({"window": 2, "n_heads": 1}, {"n_heads": 1})
    assert model.cfg.tie_embeddings is False
    assert hookmech.tasks.from_checkpoint(trained).spec["vocab_size"] == 16


def test_sites_lists_every_hook(trained, capsys):
    code, out, _ = run(["sites", "--ckpt", str(trained)], capsys)
    assert code == 0
    assert "L1.block_in" in out and "blocks.1.hook_resid_pre" in out and "L0.mixer.pattern" in out
    code, out, _ = run(["sites", "--ckpt", str(trained), "--json"], capsys)
    rows = json.loads(out)
    assert len(rows) == len(hookmech.load(trained).hook_dict)


def test_cache_then_patch_agrees_with_patch_from_scratch(trained, tmp_path, capsys):
    cache = tmp_path / "c.h5"
    code, _, err = run(["cache", "--ckpt", str(trained), "--n", "40", "--seed", "1", "-o", str(cache)], capsys)
    assert code == 0, err
    args = ["patch", "--ckpt", str(trained), "--site", "L*.block_in", "--pos", "key", "--pos", "value,query,divider", "--json"]
    code, out, err = run([*args, "--cache", str(cache)], capsys)
    assert code == 0, err
    from_cache = json.loads(out)
    code, out, _ = run([*args, "--n", "40", "--seed", "1"], capsys)
    from_scratch = json.loads(out)
    assert [(r["site"], r["pos"]) for r in from_cache] == [(s, p) for s in ("L0.block_in", "L1.block_in")
                                                          for p in ("key", "value", "query", "divider")]
    for a, b in zip(from_cache, from_scratch, strict=True):  # contract: fp32 cache vs from scratch, CACHE_TOL
        assert abs(a["p_patched"] - b["p_patched"]) <= CACHE_TOL
    code, out, _ = run(args[:-1] + ["--n", "40"], capsys)
    assert "attrib" in out.splitlines()[0] and len(out.splitlines()) == 10


def test_per_example_file(trained, tmp_path, capsys):
    path = tmp_path / "rows.json"
    code, _, _ = run(["patch", "--ckpt", str(trained), "--site", "L1.block_in", "--pos", "value", "--n", "9",
                      "--per-example", str(path)], capsys)
    assert code == 0
    assert len(json.loads(path.read_text())[0]["p_patched_rows"]) == 9


def test_cache_of_another_checkpoint_is_refused(trained, tmp_path, capsys):
    cache = tmp_path / "c.h5"
    run(["cache", "--ckpt", str(trained), "--n", "4", "-o", str(cache)], capsys)
    other = tmp_path / "other.safetensors"
    other.write_bytes(trained.read_bytes()[:-4] + b"    ")
    code, _, err = run(["patch", "--ckpt", str(other), "--cache", str(cache), "--site", "L1.block_in", "--pos", "value"], capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,code,needle", [
    (["trian"], 2, "train"),
    (["patch", "--site", "L1.block_in", "--pos", "value"], 2, "--ckpt"),
    (["patch", "--ckpt", "{ckpt}", "--site", "L1.blok_in", "--pos", "value"], 2, "L1.block_in"),
    (["patch", "--ckpt", "{ckpt}", "--site", "L1.block_in", "--pos", "valeu"], 2, "value"),
    (["patch", "--ckpt", "{ckpt}", "--site", "L1.block_in", "--pos", "value", "--method", "atpp"], 2, "exact"),
    (["patch", "--ckpt", "{ckpt}", "--site", "L1.block_in", "--pos", "value", "--verify-top", "3"], 2, "atp"),
    (["patch", "--ckpt", "{ckpt}", "--site", "L1.block_in", "--pos", "value", "--method", "atp", "--metric", "kl"], 2, "exact"),
    (["patch", "--ckpt", "{ckpt}", "--site", "L1.block_in", "--pos", "value", "--n", "0"], 2, "--n"),
    (["patch", "--ckpt", "/nonexistent.safetensors", "--site", "L1.block_in", "--pos", "value"], 1, "no such"),
    (["patch", "--ckpt", "{ckpt}", "--cache", "/nonexistent.h5", "--site", "L1.block_in", "--pos", "value"], 1, "no such"),
    (["sites", "--ckpt", "{junk}"], 1, "safetensors"),
    (["sites", "--ckpt", "{ckpt}", "--device", "cuda:0"] if not __import__("torch").cuda.is_available() else ["trian"], 2, ""),
    (["train", "-o", "{tmp}/x", "--lr", "0", "--steps", "5", "--n-train", "0"], 2, "lr"),
    (["train", "-o", "{tmp}/x", "--lr", "-1"], 2, "lr"),
    (["train", "-o", "{tmp}/x", "--task", "arr"], 2, "ar"),
    (["train", "-o", "{tmp}/x", "--mixer", "atention"], 2, "attention"),
    (["train", "-o", "{tmp}/x", "--mixer-opt", "windw=2"], 2, "window"),
    (["train", "-o", "{tmp}/x", "--mixer-opt", "L5.window=2"], 2, "layer 5"),
    (["train", "-o", "{tmp}/x", "--mixer-opt", "window"], 2, "K=V"),
    (["train", "-o", "{tmp}/x", "--task-opt", "vocab_sise=64"], 2, "vocab_size"),
    (["train", "-o", "{tmp}/x", "--d-model", "0"], 2, "d-model"),
    (["train", "-o", "{tmp}/x", "--epochs", "2", "--steps", "3"], 2, "not both"),
    (["train", "-o", "{tmp}/x", "--n-train", "0"], 2, "steps"),
    (["train", "-o", "{tmp}/x", "--threads", "0", "--steps", "2", "--n-train", "0"], 2, "threads"),
    (["demo", "--fixtures", "{tmp}"], 1, "missing"),
    (["train", "-o", "{tmp}/x", "--preset", "basde"], 2, "based"),
    (["train", "-o", "{tmp}/x", "--mixer-opt", "window=abc"], 2, "integer"),
    (["train", "-o", "{tmp}/x", "--task-opt", "num_kv_pairs=2.5"], 2, "integer"),
    (["train", "-o", "{tmp}/x", "--mixer", "mamba", "--mixer-opt", "expand=[1]"], 2, "expand"),
    (["patch", "--ckpt", "{ckpt}", "--site", "L1.block_in", "--pos", "-0"], 2, "-0"),
    (["train", "-o", "{tmp}/x", "--preset", "based", "--mixer", "mamba"], 2, "not both"),
])
def test_errors_are_one_line_with_exit_code(argv, code, needle, trained, tmp_path, capsys):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"junk")
    argv = [a.format(ckpt=trained, junk=junk, tmp=tmp_path) for a in argv]
    got, out, err = run(argv, capsys)
    assert got == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hookmech: error:"), err
    assert "Traceback" not in err and needle in lines[0]
    assert not (tmp_path / "x" / "model.safetensors").exists()  # refused before any work


def test_console_script_exit_codes(trained):
    """The installed entry point itself: a usage error is exit 2 with one stderr line."""
    done = subprocess.run([sys.executable, "-m", "hookmech.cli.main", "patch", "--ckpt", str(trained), "--site",
                           "L9.block_in", "--pos", "value"], capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_preset_builds_the_papers_based_model(tmp_path, capsys):
    argv = [a for a in TRAIN if a not in ("--mixer", "attention", "--mixer-opt", "L0.window=2")]
    code, _, err = run([*argv, "--preset", "based", "--mixer-opt", "L0.kernel_size=-1", "--steps", "2", "-o", str(tmp_path / "r")], capsys)
    assert code == 0, err
    config = hookmech.load(tmp_path / "r" / "model.safetensors").cfg
    assert config.mixers == ("baseconv", "based")
    assert config.mixer_kwargs[0]["kernel_size"] == -1 and config.pos_emb == "none"


def test_atp_with_verify_top_reports_both_scores(trained, capsys):
    code, out, err = run(["patch", "--ckpt", str(trained), "--site", "all", "--pos", "key,value", "--n", "16",
                          "--method", "atp", "--verify-top", "3", "--json"], capsys)
    assert code == 0, err
    records = json.loads(out)
    assert len(records) == 3 and all(r["method"] == "atp" and "attribution_exact" in r for r in records)


def test_atp_star_with_verify_top_reports_both_scores(trained, capsys):
    code, out, err = run(["patch", "--ckpt", str(trained), "--site", "all", "--pos", "key,value", "--n", "16",
                          "--method", "atp-star", "--graddrop", "--verify-top", "3", "--json"], capsys)
    assert code == 0, err
    records = json.loads(out)
    assert len(records) == 3
    assert all(r["method"] == "atp-star" and "attribution_exact" in r and r["graddrop"] >= 0 for r in records)


def test_atp_star_without_graddrop_gives_the_same_estimates_and_no_score(trained, capsys):
    """GradDrop is opt-in (--graddrop); without it (the default, or --no-graddrop, kept as its
    alias) AtP* skips GradDrop's backward passes: the estimates are those of the full gradient."""
    args = ["patch", "--ckpt", str(trained), "--site", "all", "--pos", "key,value", "--n", "16", "--method", "atp-star",
            "--json"]
    code, out, err = run([*args, "--graddrop"], capsys)
    assert code == 0, err
    with_graddrop = json.loads(out)
    code, out, err = run(args, capsys)
    assert code == 0, err
    without = json.loads(out)
    code, out, err = run([*args, "--no-graddrop"], capsys)
    assert code == 0, err
    assert json.loads(out) == without
    assert len(without) == len(with_graddrop) > 0
    for a, b in zip(with_graddrop, without, strict=True):
        assert (a["site"], a["pos"]) == (b["site"], b["pos"]) and b["graddrop"] is None and a["graddrop"] >= 0
        # the same backward pass and arithmetic: GradDrop's passes come after and change nothing
        assert a["p_patched"] == b["p_patched"]


def test_a_refused_config_does_not_claim_the_run_folder(tmp_path, capsys):
    base = [a for a in TRAIN if a not in ("--mixer", "attention", "--mixer-opt", "L0.window=2")]
    code, _, _ = run([*base, "--mixer", "mamba", "--mixer-opt", "d_conv=7", "-o", str(tmp_path / "r")], capsys)
    assert code == 2 and not (tmp_path / "r" / "run.json").exists()
    code, _, err = run([*base, "--mixer", "mamba", "--mixer-opt", "d_conv=2", "--steps", "2", "-o", str(tmp_path / "r")], capsys)
    assert code == 0, err


def test_repeated_positions_give_one_record(trained, capsys):
    code, out, _ = run(["patch", "--ckpt", str(trained), "--site", "L1.block_in", "--pos", "key,key,value", "--n", "4", "--json"], capsys)
    assert code == 0 and [r["pos"] for r in json.loads(out)] == ["key", "value"]
