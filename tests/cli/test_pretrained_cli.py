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


# -- a tiny GPT-2 folder through the commands ----------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_folder_and_cache(tmp_path_factory):
    """A tiny random GPT-2 folder and a cache of AR rows within its vocabulary, written by the
    library as `hookmech cache` writes a folder's (its resolved path recorded)."""
    pytest.importorskip("transformers")
    import hookmech
    from hookmech.cache import write_cache
    from pretrained_folders import folder_of

    root = tmp_path_factory.mktemp("gpt2")
    folder = folder_of("gpt2", root)
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model = hookmech.from_pretrained(folder)
    cache = write_cache(model, task.sample(16, seed=0), root / "c.h5", ["L*.block_in", "L0.mixer_in"],
                        model_source=str(folder.resolve()), task_spec=task.spec)
    return folder, cache, model


def test_sites_lists_a_folders_hooks(gpt2_folder_and_cache, capsys):
    folder, _, model = gpt2_folder_and_cache
    code, out, err = run_cli(["sites", "--ckpt", folder, "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)
    assert [row["hook"] for row in rows if row["hook"] in model.hook_dict] == [row["hook"] for row in rows]
    assert {"L0.block_in", "L1.mixer.pattern", "L1.resid_mid"} <= {row["site"] for row in rows}


def test_patch_with_a_folders_cache_needs_no_task_and_gives_the_engines_records(gpt2_folder_and_cache, capsys):
    from hookmech.patching import patch

    folder, cache, model = gpt2_folder_and_cache
    code, out, err = run_cli(["patch", "--ckpt", folder, "--cache", cache, "--site", "L*.block_in",
                              "--pos", "key,value,query", "--json"], capsys)
    assert code == 0, err
    records = json.loads(out)
    expected = patch(model, cache, ["L*.block_in"], ["key", "value", "query"])
    assert [(r["site"], r["pos"], r["p_patched"]) for r in records] == [
        (r["site"], r["pos"], r["p_patched"]) for r in expected]


def test_das_and_inspect_take_a_folders_cache(gpt2_folder_and_cache, tmp_path, capsys):
    folder, cache, _ = gpt2_folder_and_cache
    code, out, err = run_cli(["inspect", cache], capsys)
    assert code == 0 and f"folder {folder.resolve()}" in out, err
    code, _, err = run_cli(["das", "--ckpt", folder, "--cache", cache, "--site", "L1.block_in", "--pos", "value",
                            "--dim", "2", "--steps", "2", "-o", tmp_path / "das"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "das" / "records.json").read_text())[0]["site"] == "L1.block_in"


def test_a_cache_of_another_model_is_refused_for_a_folder(gpt2_folder_and_cache, tmp_path, capsys):
    from pretrained_folders import folder_of

    _, cache, _ = gpt2_folder_and_cache
    other = folder_of("gpt2", tmp_path, seed=1)
    code, _, err = run_cli(["patch", "--ckpt", other, "--cache", cache, "--site", "L0.block_in", "--pos", "key"],
                           capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "made from another model" in err


def test_weights_that_do_not_match_the_config_are_one_line_naming_the_weights_file(tmp_path, capsys):
    pytest.importorskip("transformers")
    from pretrained_folders import folder_of

    folder = folder_of("gpt2", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    code, _, err = run_cli(["sites", "--ckpt", folder], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and str(folder / "model.safetensors") in lines[0]
    assert "missing h.2." in lines[0]
