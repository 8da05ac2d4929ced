"""Loading a file never runs code it names (hookmech.mixers.allow_list): a checkpoint's or cache's
config naming a plug-in mixer imports it only when the user allows it (`allow_mixers=`,
HOOKMECH_ALLOW_MIXERS); metadata reads never import it; a stored relative path is refused.

Each hostile file is forged as an attacker would: the bundled fixture's tensors with a config whose
`mixers` name a module that writes a marker file when imported, so a test sees whether its code
ran. The command line's side is tests/cli/test_plug_in_loading_cli.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import pytest
from helpers import ATTENTION_FIXTURE
from safetensors import safe_open
from safetensors.torch import save_file

import hookmech
from hookmech.cache import CacheFile, write_cache
from hookmech.checkpoint import read_metadata
from hookmech.errors import HookmechError, UsageError

#: the documented environment allow-list (docs/formats.md, "What loading runs")
ENV_VAR = "HOOKMECH_ALLOW_MIXERS"

#: a plug-in mixer whose module leaves a marker beside itself when it is imported (its code ran)
HOSTILE = '''
from pathlib import Path
import torch
from torch import nn
from hookmech.mixers import Mixer

Path(__file__).with_suffix(".ran").write_text("imported")


class S(Mixer):
    """The fixture's attention weights by name (Wqkv, out_proj), mixed causally: a running mean of v."""

    def __init__(self, d_model: int, n_heads: int = 1, window: int | None = None):
        super().__init__()
        self.Wqkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        v = self.Wqkv(x).chunk(3, dim=-1)[2]
        return self.out_proj(v.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None])
'''


def hostile_file(folder: Path, name: str = "evil.py") -> Path:
    """Write the hostile mixer file into `folder`; return its path (its marker: `ran`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(HOSTILE)
    return folder / name


def ran(mixer_file: Path) -> bool:
    """Whether the hostile module at `mixer_file` was imported (its marker exists)."""
    return mixer_file.with_suffix(".ran").exists()


def forge_checkpoint(path: Path, mixer: str) -> Path:
    """Write the attention fixture's tensors and metadata to `path`, its config naming `mixer` in
    every layer (without importing it); return `path`."""
    with safe_open(str(ATTENTION_FIXTURE), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    config = json.loads(metadata["hookmech_config"])
    config["mixers"] = [mixer] * config["n_layers"]
    save_file(tensors, str(path), {**metadata, "hookmech_config": json.dumps(config)})
    return path


def forge_cache(path: Path, mixer: str) -> Path:
    """Write a 4-row cache of the attention fixture to `path` whose model_config names `mixer`."""
    model, task = hookmech.load(ATTENTION_FIXTURE), hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)
    write_cache(model, task.sample(4, seed=0), path, "all", task_spec=task.spec)
    with h5py.File(path, "r+") as h5:
        config = json.loads(h5.attrs["model_config"])
        config["mixers"] = [mixer] * config["n_layers"]
        h5.attrs["model_config"] = json.dumps(config)
    return path


@pytest.fixture(autouse=True)
def _no_allow_list(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_load_refuses_a_plug_in_mixer_not_allowed_and_runs_none_of_its_code(tmp_path):
    evil = hostile_file(tmp_path / "src")
    checkpoint = forge_checkpoint(tmp_path / "m.safetensors", f"{evil}:S")
    with pytest.raises(UsageError) as error:
        hookmech.load(checkpoint)
    assert not ran(evil)
    assert str(error.value) == (
        f"{checkpoint} names the plug-in mixer '{evil}:S', whose code is imported only if you allow it: "
        f"--allow-mixer {evil}:S (or {ENV_VAR}={evil}:S; allow_mixers=[...] in Python)"
    )


@pytest.mark.parametrize("spec", ["{file}:S", "{file}", "src/evil.py:S", "src/evil.py", "./src/../src/evil.py"])
def test_load_imports_a_plug_in_mixer_its_caller_allows(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative SPECs are the caller's own paths, from its folder
    evil = hostile_file(tmp_path / "src")
    checkpoint = forge_checkpoint(tmp_path / "m.safetensors", f"{evil}:S")
    model = hookmech.load(checkpoint, allow_mixers=[spec.format(file=evil)])
    assert ran(evil)
    assert model.cfg.mixers == (f"{evil.resolve()}:S",) * 2


def test_the_environment_allow_list_allows_as_the_keyword_does(tmp_path, monkeypatch):
    evil = hostile_file(tmp_path / "src")
    checkpoint = forge_checkpoint(tmp_path / "m.safetensors", f"{evil}:S")
    monkeypatch.setenv(ENV_VAR, f"other.py:S,{evil}:S")
    hookmech.load(checkpoint)
    assert ran(evil)


@pytest.mark.parametrize("spec", ["{file}:T", "{other}:S", "{other}", "evil:S", "evil"])
def test_a_spec_naming_another_class_file_or_a_module_does_not_allow_the_file(spec, tmp_path):
    evil, other = hostile_file(tmp_path / "src"), hostile_file(tmp_path / "other")
    checkpoint = forge_checkpoint(tmp_path / "m.safetensors", f"{evil}:S")
    with pytest.raises(UsageError, match="names the plug-in mixer"):
        hookmech.load(checkpoint, allow_mixers=[spec.format(file=evil, other=other)])
    assert not ran(evil) and not ran(other)


def test_a_module_mixer_is_imported_only_when_allowed(tmp_path, monkeypatch):
    name = "ext_" + re.sub(r"\W", "_", tmp_path.name)
    module = hostile_file(tmp_path / "site", f"{name}.py")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    checkpoint = forge_checkpoint(tmp_path / "m.safetensors", f"{name}:S")
    with pytest.raises(UsageError, match=f"names the plug-in mixer '{name}:S'"):
        hookmech.load(checkpoint)
    assert not ran(module)
    hookmech.load(checkpoint, allow_mixers=[name])
    assert ran(module)


@pytest.mark.parametrize("stored", ["evil.py:S", "../src/evil.py:S", "src/evil.py:S", "~/evil.py:S"])
def test_a_stored_relative_path_is_refused_even_when_allowed(stored, tmp_path, monkeypatch):
    evil = hostile_file(tmp_path / "src")
    monkeypatch.chdir(evil.parent)  # where a relative name would find the hostile file
    checkpoint = forge_checkpoint(tmp_path / "m.safetensors", stored)
    for read in (read_metadata, lambda path: hookmech.load(path, allow_mixers=[stored, str(evil)])):
        with pytest.raises(HookmechError, match="names a file by a relative path") as error:
            read(checkpoint)
        assert str(checkpoint) in str(error.value)
    assert not ran(evil)


def test_read_metadata_never_imports_a_mixer_even_one_allowed(tmp_path, monkeypatch):
    evil = hostile_file(tmp_path / "src")
    checkpoint = forge_checkpoint(tmp_path / "m.safetensors", f"{evil}:S")
    monkeypatch.setenv(ENV_VAR, str(evil))
    meta = read_metadata(checkpoint)
    assert meta["config"].mixers == (f"{evil}:S",) * 2 and meta["task"]["name"] == "ar"
    assert hookmech.tasks.from_checkpoint(checkpoint).name == "ar"
    assert not ran(evil)


def test_a_cache_whose_config_names_a_plug_in_mixer_is_read_without_importing_it(tmp_path, monkeypatch):
    evil = hostile_file(tmp_path / "src")
    cache_path = forge_cache(tmp_path / "c.h5", f"{evil}:S")
    monkeypatch.setenv(ENV_VAR, str(evil))  # allowed or not: reading a cache imports nothing
    with CacheFile(cache_path) as cache:
        rows = cache.at("L1.block_in", "query")  # what `probe` reads
        summary = cache.summary()
    assert rows.shape == (4, 64) and summary["n"] == 4
    assert not ran(evil)


def test_a_pt_state_dicts_config_file_is_a_stored_config_too(tmp_path):
    import torch

    evil = hostile_file(tmp_path / "src")
    model = hookmech.load(ATTENTION_FIXTURE)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    config = json.loads(model.cfg.to_json())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mixers": [f"{evil}:S"] * 2}))
    with pytest.raises(UsageError, match="names the plug-in mixer"):
        hookmech.load(tmp_path / "m.pt", config=tmp_path / "config.json")
    assert not ran(evil)


def test_allowed_specs_are_the_keyword_and_the_environment_separated_by_commas(monkeypatch):
    from hookmech.mixers.allow_list import allowed_specs, is_allowed

    monkeypatch.setenv(ENV_VAR, " a.py:X , ,pkg.mod ")
    assert allowed_specs(["/b.py"]) == ["/b.py", "a.py:X", "pkg.mod"]
    assert allowed_specs("/c.py") == ["/c.py", "a.py:X", "pkg.mod"]  # one SPEC as a string is one SPEC
    assert is_allowed("pkg.mod:Y", ["pkg.mod"]) and not is_allowed("pkg.mod:Y", ["pkg.mod:Z"])
    assert not is_allowed("pkg.mod.sub:Y", ["pkg.mod"]) and not is_allowed("pkg.mod:Y", ["pkg"])
