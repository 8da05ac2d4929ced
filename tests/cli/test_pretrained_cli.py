"""`--ckpt DIR`: a Hugging Face model folder wherever a command takes a checkpoint; a wrong
folder is one line naming the file, a folder's missing task one line asking for it."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli
from safetensors.torch import save_file


@pytest.fixture
def bad_folders(tmp_path):
    """Folders that are not models hookmech loads: (folder, the file the error names)."""
    made = {}
    for name, config in [("no-config", None), ("bad-json", "{oops"), ("unknown-type", {"model_type": "llama"})]:
        folder = tmp_path / name
        folder.mkdir()
        if config is not None:
            (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
        made[name] = (folder, folder / "config.json")
    return made


@pytest.mark.parametrize("case", ["no-config", "bad-json", "unknown-type"])
@pytest.mark.parametrize("command", [["sites"], ["das", "--cache", "c.h5", "--site", "L0.block_in", "--pos", "0",
                                                 "--dim", "1", "-o", "out"]])
def test_a_wrong_folder_is_one_line_naming_the_file(bad_folders, capsys, case, command):
    folder, named = bad_folders[case]
    code, _, err = run_cli([command[0], "--ckpt", folder, *command[1:]], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and str(named) in err


@pytest.mark.parametrize("command", [["cache", "-o", "{tmp}/c.h5"], ["patch", "--site", "L0.block_in", "--pos", "0"],
                                     ["view", "-o", "{tmp}/page.html"]])
def test_a_folder_stores_no_task_and_the_commands_that_need_one_say_so(bad_folders, tmp_path, capsys, command):
    folder, _ = bad_folders["unknown-type"]
    argv = [command[0], "--ckpt", folder, *(arg.replace("{tmp}", str(tmp_path)) for arg in command[1:])]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "stores no task" in err and "--task" in err
