"""Reading a Hugging Face model folder (hookmech.pretrained.folder, from_pretrained's refusals):
what a folder may hold, read without running anything, and one line naming the file at fault."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import hookmech
from hookmech.errors import HookmechError, UsageError
from hookmech.pretrained import FAMILIES, from_pretrained, is_pretrained_folder
from hookmech.pretrained.folder import read_folder, read_weights
from hookmech.pretrained.weights import Weights, WeightsMismatch


def _folder(tmp_path: Path, config: dict | str | None = None, weights: dict | None = None) -> Path:
    """A folder with `config` (a dict as JSON, a string verbatim, None: no config.json) and
    `weights` in model.safetensors (None: no weights file)."""
    folder = tmp_path / "model"
    folder.mkdir()
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (folder / "config.json").write_text(text)
    if weights is not None:
        save_file(weights, str(folder / "model.safetensors"))
    return folder


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(HookmechError) as error:
        from_pretrained(tmp_path / "absent" / "dir")
    assert "no such model folder" in _one_line(error)


def test_a_folder_without_config_names_config_json(tmp_path):
    folder = _folder(tmp_path, None, {"w": torch.zeros(2)})
    assert not is_pretrained_folder(folder)
    with pytest.raises(HookmechError) as error:
        from_pretrained(folder)
    assert f"{folder / 'config.json'}: missing" in _one_line(error)


@pytest.mark.parametrize(
    "config, says",
    [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object"), ({"n_layer": 2}, "no model_type")],
    ids=["bad-json", "not-an-object", "no-model-type"],
)
def test_a_bad_config_names_config_json(tmp_path, config, says):
    folder = _folder(tmp_path, config, {"w": torch.zeros(2)})
    with pytest.raises(HookmechError) as error:
        from_pretrained(folder)
    message = _one_line(error)
    assert message.startswith(str(folder / "config.json")) and says in message


def test_an_unknown_model_type_is_refused_naming_the_supported_ones(tmp_path):
    folder = _folder(tmp_path, {"model_type": "llama"}, {"w": torch.zeros(2)})
    with pytest.raises(HookmechError) as error:
        from_pretrained(folder)
    message = _one_line(error)
    assert "config.json" in message and "'llama'" in message
    assert all(name in message for name in ("gpt2", "gpt_neox", "mamba", "mamba2"))


def test_a_family_without_its_module_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(FAMILIES, "future_family", "no_such_family_module")
    folder = _folder(tmp_path, {"model_type": "future_family"}, {"w": torch.zeros(2)})
    with pytest.raises(HookmechError) as error:
        from_pretrained(folder)
    assert "hookmech.pretrained.no_such_family_module" in _one_line(error)


def test_a_folder_without_weights_is_named(tmp_path):
    folder = _folder(tmp_path, {"model_type": "gpt2"})
    with pytest.raises(HookmechError) as error:
        read_folder(folder)
    message = _one_line(error)
    assert str(folder) in message and "model.safetensors" in message and "pytorch_model.bin" in message


def test_a_checkpoint_file_given_as_a_folder_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(HookmechError, match="not a model folder"):
        from_pretrained(path)


def test_sharded_safetensors_read_as_their_index_says(tmp_path):
    folder = _folder(tmp_path, {"model_type": "gpt2"})
    first, second = {"a": torch.arange(3.0)}, {"b": torch.ones(2, 2), "c": torch.zeros(1)}
    save_file(first, str(folder / "model-00001-of-00002.safetensors"))
    save_file(second, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    found = read_folder(folder)
    assert found.weights_file.name == "model.safetensors.index.json"
    tensors = found.weights()
    assert sorted(tensors) == ["a", "b", "c"]
    assert all(torch.equal(tensors[name], {**first, **second}[name]) for name in tensors)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "absent.safetensors"])
def test_a_shard_outside_the_folder_or_absent_is_refused(tmp_path, shard):
    folder = _folder(tmp_path, {"model_type": "gpt2"})
    save_file({"a": torch.zeros(1)}, str(tmp_path / "outside.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(HookmechError) as error:
        read_weights(folder / "model.safetensors.index.json")
    assert "model.safetensors.index.json" in _one_line(error) and repr(shard) in str(error.value)


class _NotATensor:
    """An object torch.load(weights_only=True) refuses to rebuild (it would run this class's code)."""


def test_pytorch_model_bin_is_read_with_weights_only(tmp_path):
    folder = _folder(tmp_path, {"model_type": "gpt2"})
    torch.save({"w": torch.arange(4.0)}, folder / "pytorch_model.bin")
    found = read_folder(folder)
    assert found.weights_file.name == "pytorch_model.bin"
    assert torch.equal(found.weights()["w"], torch.arange(4.0))
    torch.save({"w": torch.zeros(1), "code": _NotATensor()}, folder / "pytorch_model.bin")
    with pytest.raises(HookmechError) as error:
        read_folder(folder).weights()
    assert "weights_only=True" in _one_line(error) and "pytorch_model.bin" in str(error.value)


def test_safetensors_are_preferred_to_pytorch_model_bin(tmp_path):
    folder = _folder(tmp_path, {"model_type": "gpt2"}, {"w": torch.ones(2)})
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    assert read_folder(folder).weights_file.name == "model.safetensors"


def test_the_tokenizer_is_found_beside_the_weights(tmp_path):
    folder = _folder(tmp_path, {"model_type": "gpt2"}, {"w": torch.ones(2)})
    assert read_folder(folder).tokenizer is None
    (folder / "tokenizer.json").write_text("{}")
    assert read_folder(folder).tokenizer == folder / "tokenizer.json"


def test_weights_report_what_is_missing_and_left_over():
    weights = Weights({"a": torch.zeros(2), "b": torch.zeros(3), "h.0.attn.bias": torch.zeros(1)}, ignore=("attn.bias",))
    assert weights.take("a", (2,)).shape == (2,)
    weights.take("absent")
    with pytest.raises(WeightsMismatch, match=r"missing absent; unexpected b$"):
        weights.finish()
    with pytest.raises(WeightsMismatch, match=r"b has shape \(3,\), the config gives \(4,\)"):
        Weights({"b": torch.zeros(3)}).take("b", (4,))


def test_a_folder_stores_no_task():
    with pytest.raises(UsageError, match="stores no task: give the task"):
        hookmech.tasks.from_checkpoint(Path(__file__).parent)


def test_a_bad_compute_dtype_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="dtype 'int8'"):
        from_pretrained(_folder(tmp_path, {"model_type": "gpt2"}), dtype="int8")


def test_a_hub_name_offline_is_one_line(tmp_path):
    """Offline (HF_HUB_OFFLINE=1, an empty Hugging Face cache), a hub name cannot be fetched: one
    line says so, from the library and from the command line, and nothing is downloaded."""
    pytest.importorskip("huggingface_hub")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run([sys.executable, "-m", "hookmech.cli.main", "sites", "--ckpt", "state-spaces/mamba-130m-hf"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "state-spaces/mamba-130m-hf" in lines[0] and "HF_HUB_OFFLINE is set" in lines[0]
    assert not (tmp_path / "hf-home" / "hub" / "models--state-spaces--mamba-130m-hf" / "blobs").exists()


def test_a_run_folder_given_as_a_checkpoint_names_its_checkpoint(tmp_path):
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(HookmechError, match="is a hookmech run folder: its checkpoint is .*model.safetensors"):
        hookmech.load(tmp_path)
