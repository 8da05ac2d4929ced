"""The `patch` command's options reach the library: sites, positions, metric, direction and
corruption as `patching.patch` takes them, `--context-memory`, and `--verify-top` within
`--max-batch`."""
from __future__ import annotations

import json

import pytest

import hookmech
import hookmech.patching
from hookmech.patching import patch, path_patch

from helpers import ENGINE_TOL, REPO, run_cli


def test_cli_patch_options_call_the_library(tmp_path, capsys):
    def run(argv):
        return run_cli(argv, capsys)

    train = ["train", "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3", "--n-train", "0",
             "--steps", "2", "--mixer", "attention", "--mixer-opt", "n_heads=2", "--d-model", "16", "--n-dev", "8",
             "-o", str(tmp_path / "run")]
    assert run(train)[0] == 0
    ckpt = tmp_path / "run" / "model.safetensors"
    code, out, err = run(["patch", "--ckpt", str(ckpt), "--site", "L0.block_out+L1.mixer_in,L1.mixer.z[1]", "--pos", "value",
                          "--n", "10", "--metric", "logit_diff", "--direction", "noise", "--corrupt", "value", "--json"])
    assert code == 0, err
    records = json.loads(out)
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3, corrupt="value")
    expected = patch(hookmech.load(ckpt), task.sample(10, seed=1), ["L0.block_out+L1.mixer_in", "L1.mixer.z[1]"], ["value"],
                     metric="logit_diff", direction="noise")
    assert [r["site"] for r in records] == ["L0.block_out+L1.mixer_in", "L1.mixer.z[1]"]
    for got, want in zip(records, expected, strict=True):
        assert got["metric"] == "logit_diff" and got["direction"] == "noise"
        # the same computation (the CLI calls patch with these options and its defaults): exact
        assert got["metric_patched"] == want["metric_patched"]
    code, _, err = run(["patch", "--ckpt", str(ckpt), "--site", "L1.block_in", "--pos", "value", "--ablate", "mean",
                        "--direction", "denoise"])
    assert code == 2 and "noise" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(["patch", "--ckpt", str(ckpt), "--cache", str(tmp_path / "c.h5"), "--site", "L1.block_in",
                        "--pos", "value", "--corrupt", "key"])
    assert code == 2 and "--corrupt" in err


def test_cli_context_memory(trained_attention, capsys):
    path, _, _ = trained_attention
    base = ["patch", "--ckpt", str(path), "--site", "L0.mixer_out,L1.block_in", "--pos", "key,value", "--n", "40", "--json"]
    code, roomy, err = run_cli(base, capsys)
    assert code == 0, err
    code, tight, err = run_cli([*base, "--context-memory", "0"], capsys)
    assert code == 0, err
    for a, b in zip(json.loads(roomy), json.loads(tight), strict=True):
        # two engine paths (resumed runs, full runs; reductions in another order): ENGINE_TOL
        assert a["p_patched"] == pytest.approx(b["p_patched"], abs=ENGINE_TOL)
    code, _, err = run_cli([*base, "--context-memory", "-1"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--context-memory" in err


def test_cli_verify_top_runs_the_exact_engine_within_max_batch(trained_attention, monkeypatch, capsys):
    """`--verify-top` re-runs its cells with the user's --max-batch (it used the default 256)."""
    from hookmech.cache import run_chunks
    from hookmech.patching import forwards, reachability, runs

    chunks = []

    def spy(n_rows, chunk):
        chunks.append(chunk)
        return run_chunks(n_rows, chunk)

    for module in (runs, reachability, forwards):  # the exact engine's batching (and the runs it starts from)
        monkeypatch.setattr(module, "run_chunks", spy)
    path, _, _ = trained_attention
    code, out, err = run_cli(["patch", "--ckpt", str(path), "--site", "L0.block_out", "--pos", "key,value",
                              "--n", "8", "--method", "atp", "--verify-top", "2", "--max-batch", "3"], capsys)
    assert code == 0, err
    assert chunks and set(chunks) == {3}, chunks


def test_cli_path_patch_calls_path_patch_and_prints_the_route(capsys):
    mamba = REPO / "fixtures" / "mamba_ar_cpu.safetensors"
    base = ["patch", "--ckpt", str(mamba), "--n", "12", "--sender", "L0.mixer.in_x@key",
            "--receiver", "L0.mixer.conv@value,L0.mixer.conv@whole", "--via", "conv"]
    code, out, err = run_cli([*base, "--json", "--metric", "log_p"], capsys)
    assert code == 0, err
    records = json.loads(out)
    task = hookmech.tasks.from_checkpoint(mamba)
    expected = path_patch(hookmech.load(mamba), task.sample(12, seed=1), "L0.mixer.in_x@key",
                          ["L0.mixer.conv@value", "L0.mixer.conv@whole"], "conv", metric="log_p")
    assert [(r["sender"], r["receiver"], r["via"]) for r in records] == [
        ("L0.mixer.in_x@key", "L0.mixer.conv@value", "conv"), ("L0.mixer.in_x@key", "L0.mixer.conv@whole", "conv")]
    for got, want in zip(records, expected, strict=True):
        assert got["metric_patched"] == want["metric_patched"]  # the same computation: exact
    code, out, err = run_cli(base, capsys)
    assert code == 0, err
    header = out.splitlines()[0].split()
    assert header[:3] == ["sender", "receiver", "via"] and "L0.mixer.conv@whole" in out


@pytest.mark.parametrize(("extra", "says"), [
    (["--engine", "ray"], "--cache"),
    (["--address", "127.0.0.1:6379"], "--engine ray"),
    (["--workers", "2"], "--engine ray"),
    (["--engine", "ray", "--cache", "c.h5", "--workers", "0"], "--workers"),
])
def test_cli_engine_options_are_refused_in_one_line(trained_attention, capsys, extra, says):
    """Refused before anything starts (no Ray needed): --engine ray shards a cache's rows."""
    path, _, _ = trained_attention
    code, _, err = run_cli(["patch", "--ckpt", path, "--site", "L1.block_in", "--pos", "key", *extra], capsys)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_cli_seed_mech_draws_the_sweeps_mechanism_batch(trained_attention, capsys):
    """`--seed mech:S` reproduces what a sweep's mechanistic evaluation measured for seed S: the
    examples of `mech_batch(task, S, n)` (stream 4), not those of `--seed S` (stream 0)."""
    from hookmech.mech import mech_batch

    path, _, _ = trained_attention
    base = ["patch", "--ckpt", str(path), "--site", "L1.block_in", "--pos", "key,value,query", "--n", "24", "--json"]
    code, out, err = run_cli([*base, "--seed", "mech:3"], capsys)
    assert code == 0, err
    model = hookmech.load(path)
    want = patch(model, mech_batch(hookmech.tasks.from_checkpoint(path), 3, 24), ["L1.block_in"], ["key", "value", "query"])
    for got, expected in zip(json.loads(out), want, strict=True):
        assert got["metric_patched"] == expected["metric_patched"] and got["p_clean"] == expected["p_clean"]
    code, plain, err = run_cli([*base, "--seed", "3"], capsys)
    assert code == 0, err
    assert json.loads(plain)[0]["p_clean"] != json.loads(out)[0]["p_clean"]  # another stream, other examples
    for bad in ("mech:", "mech:x", "mech:-1", "stream:3", "1.5"):
        code, _, err = run_cli([*base, "--seed", bad], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "mech:S" in err, (bad, err)
