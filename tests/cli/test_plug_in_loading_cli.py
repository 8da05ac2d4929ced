"""Every command that loads a checkpoint imports the plug-in mixer its config names only with
``--allow-mixer SPEC`` (or HOOKMECH_ALLOW_MIXERS); without it, one line naming the mixer and the
flag, exit 2, and none of the mixer's code runs. `inspect` and `probe` never import it. The forged
files and the marker of a module that ran are tests/test_plug_in_loading.py's."""
from __future__ import annotations

import pytest
from helpers import SWEEP_SMALL, run_cli
from test_plug_in_loading import ENV_VAR, forge_cache, forge_checkpoint, hostile_file, ran

CKPT = "{tmp}/m.safetensors"
COMMANDS = {
    "sites": ["sites", "--ckpt", CKPT],
    "cache": ["cache", "--ckpt", CKPT, "--n", "4", "-o", "{tmp}/out.h5"],
    "patch": ["patch", "--ckpt", CKPT, "--site", "L1.block_in", "--pos", "value", "--n", "4"],
    "patch-atp": ["patch", "--ckpt", CKPT, "--site", "L1.block_in", "--pos", "value", "--n", "4", "--method", "atp"],
    "das": ["das", "--ckpt", CKPT, "--cache", "{tmp}/c.h5", "--site", "L1.block_in", "--pos", "value", "--dim", "1",
            "--steps", "1", "-o", "{tmp}/das"],
    "view": ["view", "--ckpt", CKPT, "--n", "4", "--maps", "1", "-o", "{tmp}/v.html"],
}


@pytest.fixture(autouse=True)
def _no_allow_list(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def _argv(argv, tmp_path):
    return [arg.format(tmp=tmp_path) for arg in argv]


@pytest.mark.parametrize("argv", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_command_refuses_a_checkpoints_plug_in_mixer_unless_allowed(argv, tmp_path, capsys):
    evil = hostile_file(tmp_path / "src")
    forge_checkpoint(tmp_path / "m.safetensors", f"{evil}:S")
    code, out, err = run_cli(_argv(argv, tmp_path), capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert f"names the plug-in mixer '{evil}:S'" in lines[0] and f"--allow-mixer {evil}:S" in lines[0], err
    assert not ran(evil)
    assert not (tmp_path / "out.h5").exists() and not (tmp_path / "das").exists() and not (tmp_path / "v.html").exists()


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_allowed_by_the_flag_or_the_environment_the_command_runs(how, tmp_path, capsys, monkeypatch):
    evil = hostile_file(tmp_path / "src")
    checkpoint = forge_checkpoint(tmp_path / "m.safetensors", f"{evil}:S")
    argv = ["patch", "--ckpt", checkpoint, "--site", "L1.block_in", "--pos", "value", "--n", "4", "--json"]
    if how == "flag":
        argv += ["--allow-mixer", f"{evil}:S"]
    else:
        monkeypatch.setenv(ENV_VAR, str(evil))
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert ran(evil) and '"site": "L1.block_in"' in out
    import os

    assert os.environ.get(ENV_VAR) == (None if how == "flag" else str(evil))  # the flag is the command's only


def test_report_heatmaps_refuse_a_run_checkpoints_plug_in_mixer_unless_allowed(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(SWEEP_SMALL)
    code, _, err = run_cli(["sweep", tmp_path / "s.toml", "-o", tmp_path / "runs"], capsys)
    assert code == 0, err
    evil = hostile_file(tmp_path / "src")
    for run in (path for path in (tmp_path / "runs").iterdir() if (path / "model.safetensors").exists()):
        forge_checkpoint(run / "model.safetensors", f"{evil}:S")
    code, _, err = run_cli(["report", tmp_path / "runs", "-o", tmp_path / "report", "--n", "4"], capsys)
    last = err.strip().splitlines()[-1]  # after report's progress lines
    assert code == 2 and last.startswith("hookmech: error: ") and f"names the plug-in mixer '{evil}:S'" in last, err
    assert "Traceback" not in err and not ran(evil)
    code, _, err = run_cli(["report", tmp_path / "runs", "-o", tmp_path / "report", "--n", "4",
                            "--allow-mixer", str(evil)], capsys)
    assert code == 0, err
    assert ran(evil) and (tmp_path / "report" / "report.md").exists()


@pytest.mark.parametrize("argv", [["inspect", "{tmp}/c.h5"],
                                  ["probe", "{tmp}/c.h5", "--site", "L1.block_in", "--pos", "query"]],
                         ids=["inspect", "probe"])
def test_inspect_and_probe_never_import_a_caches_plug_in_mixer(argv, tmp_path, capsys, monkeypatch):
    evil = hostile_file(tmp_path / "src")
    forge_cache(tmp_path / "c.h5", f"{evil}:S")
    monkeypatch.setenv(ENV_VAR, str(evil))  # even allowed: these commands need no model
    code, out, err = run_cli(_argv(argv, tmp_path), capsys)
    assert code == 0, err
    assert not ran(evil)

