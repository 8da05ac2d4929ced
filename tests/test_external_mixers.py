"""Mixers from outside the package (hookmech.mixers.external): named ``path/to/file.py:Class``,
``module:Class`` or by an entry point of group ``hookmech.mixers``; recorded by canonical name (one
name, one model_hash, one sweep run id for two spellings of one class); each bad name refused in one
line; checkpoints of the registered mixers unchanged; sweeps, their spawned workers included.

The end-to-end run of docs/your_mixer.md's mixer (train, cache, patch against the plain loop) is
tests/test_your_mixer.py; the command line's refusals are tests/cli/test_errors_external_mixers.py."""
from __future__ import annotations

import json
import multiprocessing
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import ENGINE_TOL, REPO, unit_variance

import hookmech
from hookmech.checkpoint import read_metadata
from hookmech.config import ModelConfig, build_config
from hookmech.errors import HookmechError, UsageError
from hookmech.identity import model_hash
from hookmech.mixers import REGISTRY, SPECS, Heads, canonical_name, spec_of
from hookmech.oracles import path_patch_reference
from hookmech.patching import path_patch
from hookmech.sweep import build_run, expand, parse_sweep
from hookmech.sweep.worker import execute_run

#: a core-only mixer (forward and two inside hooks), and things that are not mixers
MIXER_SOURCE = '''
import torch
from torch import nn

from hookmech.hooks import AxisHookPoint
from hookmech.mixers import Heads, Mixer, MixerSpec


class RunningMean(Mixer):
    """out_proj(scale * the running mean of v(x))."""

    output_projections = ("out_proj",)

    def __init__(self, d_model: int, scale: float = 1.0):
        super().__init__()
        self.v = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.scale = scale
        self.hook_v = AxisHookPoint("batch pos d_model")
        self.hook_mean = AxisHookPoint("batch pos d_model")

    def forward(self, x):
        v = self.hook_v(self.v(x))
        count = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[:, None]
        return self.out_proj(self.hook_mean(self.scale * v.cumsum(1) / count))


class HeadedMean(RunningMean):
    """RunningMean with a head count its module's spec declares."""

    def __init__(self, d_model: int, n_heads: int = 1):
        super().__init__(d_model)
        self.n_heads = n_heads


HEADED_SPEC = MixerSpec(name="headed", mixer=HeadedMean, heads=Heads(count="n_heads"), meanings={})
NOT_A_MIXER = 3
'''


#: a plug-in deriving from a registered mixer, stating one block field of its own
SUBCLASSES = '''
from hookmech.mixers.mamba import Mamba


class DerivedMamba(Mamba):
    causal_tolerance = None
'''


def _write(folder: Path, name: str = "m.py", text: str = MIXER_SOURCE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def _config(mixer: str, **options) -> ModelConfig:
    return build_config(d_vocab=12, n_ctx=8, mixers=mixer, d_model=16, n_layers=2, **options)


def _hash_of(config: ModelConfig) -> str:
    torch.manual_seed(0)
    return model_hash(hookmech.HookedLM(config))


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package on sys.path, unique to the test: ``<name>/__init__.py`` re-exporting RunningMean
    from ``<name>/layers.py``; returns its name."""
    name = "ext_" + re.sub(r"\W", "_", tmp_path.name)
    _write(tmp_path / "site" / name, "layers.py")
    _write(tmp_path / "site" / name, "__init__.py", "from .layers import RunningMean\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return name


# -- canonical names ------------------------------------------------------------------------------
def test_two_spellings_of_one_file_are_one_name_one_config_and_one_model_hash(tmp_path, monkeypatch):
    path = _write(tmp_path / "a")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    expected = f"{path.resolve()}:RunningMean"  # the documented canonical form, computed apart
    spellings = ["a/m.py:RunningMean", "./a/m.py:RunningMean", f"{path}:RunningMean", "link/m.py:RunningMean",
                 "a/../a/m.py:RunningMean", " a/m.py : RunningMean "]
    configs = [_config(spelling) for spelling in spellings]
    assert {config.mixers for config in configs} == {(expected, expected)}
    assert len({config.to_json() for config in configs}) == 1
    # a ModelConfig built directly (not through build_config) records the canonical name too
    direct = ModelConfig(**{**configs[0].__dict__, "mixers": ("link/m.py:RunningMean", "./a/m.py:RunningMean")})
    assert direct.to_json() == configs[0].to_json()
    assert len({_hash_of(config) for config in [*configs, direct]}) == 1
    assert canonical_name("link/m.py:RunningMean") == expected


def test_a_module_mixer_is_named_by_the_module_that_defines_it(package):
    assert _config(f"{package}:RunningMean").mixers[0] == f"{package}.layers:RunningMean"
    assert _config(f"{package}.layers:RunningMean").to_json() == _config(f"{package}:RunningMean").to_json()
    assert spec_of(f"{package}:RunningMean").mixer is sys.modules[f"{package}.layers"].RunningMean


def test_a_registered_class_named_by_import_is_the_registered_mixer():
    config = _config("hookmech.mixers.attention:Attention")
    assert config.mixers == ("attention", "attention")
    assert config.to_json() == _config("attention").to_json()


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_registered_name_is_its_own_canonical_name(name):
    assert canonical_name(name) == name and spec_of(name) is SPECS[name]


@pytest.mark.parametrize("fixture", sorted((REPO / "fixtures").glob("*.safetensors")), ids=lambda path: path.name)
def test_old_checkpoints_keep_their_config_json_and_model_hash(fixture):
    """The config JSON a checkpoint stores is what its config writes back (so model_hash, over that
    JSON and the weights, is unchanged; test_identity pins the fixtures' hashes)."""
    from safetensors import safe_open

    with safe_open(str(fixture), framework="pt") as handle:
        stored = handle.metadata()["hookmech_config"]
    assert ModelConfig.from_json(stored).to_json() == stored
    assert read_metadata(fixture)["model_hash"] == model_hash(hookmech.load(fixture))


def test_a_module_level_spec_gives_the_mixer_its_heads(tmp_path):
    path = _write(tmp_path)
    spec = spec_of(f"{path}:HeadedMean")
    assert spec.name == f"{path.resolve()}:HeadedMean"  # the spec's own name replaced by the canonical
    assert spec.heads == Heads(count="n_heads")
    config = _config(f"{path}:HeadedMean", n_heads=4)  # --n-heads reaches the option the spec names
    assert config.mixer_kwargs[0] == {"n_heads": 4} and config.head_shape(0) == (4, 4)
    assert _config(f"{path}:RunningMean").head_shape(0) == (1, 16)  # no spec: no heads


def test_a_plug_ins_class_attributes_state_its_specs_block_and_a_subclass_keeps_its_bases(tmp_path):
    """docs/your_mixer.md: a plug-in states its block as class attributes (RunningMean's
    output_projections), with or without a spec (HeadedMean inherits it); a plug-in deriving from a
    registered mixer keeps that mixer's block (its spec's), unless it states otherwise."""
    path = _write(tmp_path, text=MIXER_SOURCE + SUBCLASSES)
    for name in ("RunningMean", "HeadedMean"):
        assert spec_of(f"{path}:{name}").output_projections == ("out_proj",), name
    model = hookmech.HookedLM(_config(f"{path}:RunningMean"))
    assert model.blocks[1].output_projection_weights() == ["mixer.out_proj.weight", "mlp.fc2.weight"]
    derived = spec_of(f"{path}:DerivedMamba")
    assert (derived.block_norm, derived.block_mlp, derived.reference_init) == ("rmsnorm", False, "mamba")
    assert derived.tl_mixer_out == ("ssm_out",) and derived.heads is None and derived.causal_tolerance is None
    config = _config(f"{path}:DerivedMamba", init="zoology")
    assert config.norms == ("rmsnorm", "rmsnorm") and config.mlp == (False, False) and config.init == "mamba"


def test_options_of_a_mixer_of_your_own_are_checked_by_name_and_type(tmp_path):
    path = _write(tmp_path)
    config = _config(f"{path}:RunningMean", layer_options=[{"scale": 2.0}, {}])
    assert config.mixer_kwargs == ({"scale": 2.0}, {})
    with pytest.raises(UsageError, match="takes no option 'scal' \\(did you mean: scale"):
        _config(f"{path}:RunningMean", layer_options=[{"scal": 2.0}, {}])
    with pytest.raises(UsageError, match="option scale=\"big\""):
        _config(f"{path}:RunningMean", layer_options=[{"scale": "big"}, {}])


def test_a_file_mixer_runs_resid_path_patching_and_its_routes_inside_are_refused_by_name(tmp_path, ar_task):
    """The core alone: a `resid` path against the two-pass reference (ENGINE_TOL); a route inside the
    mixer needs `PathRoutes`, which it does not declare: one line naming it."""
    path = _write(tmp_path)
    torch.manual_seed(0)
    config = build_config(d_vocab=ar_task.d_vocab, n_ctx=ar_task.n_ctx, mixers=f"{path}:RunningMean", d_model=16)
    model = unit_variance(hookmech.HookedLM(config)).eval()
    batch = ar_task.sample(6, seed=5)
    (record,) = path_patch(model, batch, "L0.block_out@key", "L1.block_in@key", "resid")
    (reference,) = path_patch_reference(model, batch, "L0.block_out@key", "L1.block_in@key", "resid").values()
    assert abs(record["p_patched"] - reference["p_patched"]) <= ENGINE_TOL
    assert abs(record["p_patched"] - record["p_corrupt"]) > 2 * ENGINE_TOL  # the path matters
    with pytest.raises(UsageError, match="mixer RunningMean does not implement PathRoutes, which a head path"):
        path_patch(model, batch, "L0.mixer.v@key", "L1.mixer.v@query", "head")


# -- refusals: one line each ----------------------------------------------------------------------
REFUSALS = [
    ("missing file", "nosuch.py:A", "mixer 'nosuch.py:A': no such file {tmp}/nosuch.py"),
    ("missing module", "ext_nosuch_module:A", "no module named 'ext_nosuch_module' (install its package"),
    ("missing class", "m.py:RunningMea", "file {real}/m.py has no 'RunningMea' (did you mean: RunningMean"),
    ("not a class", "m.py:NOT_A_MIXER", "is an object of type int, not a subclass of hookmech.mixers.Mixer"),
    ("a class not a Mixer", "torch.nn:Linear", "is class torch.nn.modules.linear.Linear, not a subclass of"),
    ("the base class", "m.py:Mixer", "is the base class Mixer itself"),
    ("raises on import", "broken.py:A", "importing {real}/broken.py raised RuntimeError: broken on purpose"),
    ("syntax error", "syntax.py:A", "importing {real}/syntax.py raised SyntaxError"),
    ("a missing dependency", "needs.py:A", "importing {real}/needs.py raised ModuleNotFoundError: No module named"),
    ("no class part", "m.py:", "mixer 'm.py:': expected module.path:Class or path/to/file.py:Class"),
    ("no module part", ":A", "mixer ':A': expected module.path:Class"),
    ("unknown plain name", "atention", "unknown mixer 'atention' (did you mean: attention"),
]


@pytest.fixture
def bad_files(tmp_path, monkeypatch):
    _write(tmp_path)
    _write(tmp_path, "broken.py", "raise RuntimeError('broken on purpose')\n")
    _write(tmp_path, "syntax.py", "def (:\n")
    _write(tmp_path, "needs.py", "import ext_dependency_not_installed\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("name", "message"), [row[1:] for row in REFUSALS], ids=[row[0] for row in REFUSALS])
def test_a_name_that_does_not_resolve_to_a_mixer_is_refused_in_one_line(bad_files, name, message):
    expected = message.format(tmp=bad_files, real=bad_files.resolve())
    for attempt in (lambda: _config(name), lambda: spec_of(name)):
        with pytest.raises(UsageError) as error:
            attempt()
        assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_checkpoint_whose_mixer_file_is_gone_is_refused_in_one_line(tmp_path):
    path = _write(tmp_path / "src")
    model = hookmech.HookedLM(_config(f"{path}:RunningMean"))
    saved = hookmech.save(model, tmp_path / "m.safetensors")
    assert read_metadata(saved)["config"].mixers[0] == f"{path.resolve()}:RunningMean"
    assert model_hash(hookmech.load(saved, allow_mixers=[str(path)])) == model_hash(model)
    path.rename(tmp_path / "elsewhere.py")
    with pytest.raises(HookmechError) as error:
        hookmech.load(saved, allow_mixers=[str(path)])
    assert str(error.value) == (f"{saved}: model config: mixer '{path.resolve()}:RunningMean': "
                                f"no such file {path.resolve()}")


# -- entry points: a distribution on sys.path, as pip installs one ---------------------------------
def _distribution(site: Path, name: str, entry_points: str) -> None:
    """Write the metadata of an installed distribution `name` registering `entry_points` (the
    lines of its [hookmech.mixers] group) into `site`, a folder on sys.path."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[hookmech.mixers]\n{entry_points}\n")


def test_an_entry_point_names_the_mixer_and_the_config_records_its_value(package, tmp_path):
    _distribution(tmp_path / "site", "ext_mixers", f"running_mean = {package}:RunningMean")
    config = _config("running_mean")
    assert config.mixers == (f"{package}.layers:RunningMean",) * 2
    assert config.to_json() == _config(f"{package}.layers:RunningMean").to_json()
    # listed among the known names where a name is unknown
    with pytest.raises(UsageError, match="running_mean"):
        _config("zzzzzz")


def test_a_registered_name_is_never_shadowed_by_an_entry_point(package, tmp_path):
    _distribution(tmp_path / "site", "ext_shadow", f"attention = {package}:RunningMean")
    assert _config("attention").mixers == ("attention", "attention")
    assert spec_of("attention").mixer is REGISTRY["attention"]


def test_entry_points_registered_twice_or_naming_no_mixer_are_refused(package, tmp_path):
    _distribution(tmp_path / "site", "ext_one", f"twice = {package}.layers:RunningMean")
    _distribution(tmp_path / "site", "ext_two", "twice = torch.nn:Linear\nlinear = torch.nn:Linear\n"
                                                "module_only = torch.nn")
    with pytest.raises(UsageError, match=f"installed packages register it twice .*\\({package}.layers:RunningMean, "
                                         "torch.nn:Linear\\)"):
        _config("twice")
    with pytest.raises(UsageError, match="mixer 'torch.nn:Linear' is class torch.nn.modules.linear.Linear"):
        _config("linear")
    with pytest.raises(UsageError, match="mixer 'module_only': its entry point names 'torch.nn', not a module:Class"):
        _config("module_only")


def test_an_entry_points_extras_are_not_part_of_its_name(package, tmp_path):
    _distribution(tmp_path / "site", "ext_extras", f"with_extras = {package}.layers:RunningMean [fast]")
    assert _config("with_extras").mixers[0] == f"{package}.layers:RunningMean"


# -- sweeps -----------------------------------------------------------------------------------------
SWEEP = """
[task]
name = "ar"
vocab_size = 16
num_kv_pairs = 3
[train]
steps = 4
n_train = 0
n_dev = 8
batch_size = 8
eval_every = 2
[model]
d_model = 8
[mixer_options."{options_name}"]
scale = 0.5
[grid]
mixer = [{mixers}]
seed = [0]
"""


def _sweep(mixers: list[str], options_name: str):
    return parse_sweep(SWEEP.format(mixers=", ".join(json.dumps(m) for m in mixers), options_name=options_name))


def test_a_sweep_records_the_canonical_name_and_two_spellings_share_a_run_id(tmp_path, monkeypatch):
    path = _write(tmp_path)
    monkeypatch.chdir(tmp_path)
    canonical = f"{path.resolve()}:RunningMean"
    first = expand(_sweep(["m.py:RunningMean", "attention"], options_name="./m.py:RunningMean"))
    second = expand(_sweep([f"{path}:RunningMean"], options_name="m.py:RunningMean"))
    assert first[0].run_id == second[0].run_id and first[0].run_id.startswith("RunningMean_s0_")
    assert first[0].point["mixer"] == first[0].model["mixer"] == canonical
    assert first[1].point["mixer"] == "attention" and first[1].run_id == expand(_sweep(["attention"], "x"))[0].run_id
    # the [mixer_options."<file>:Class"] table reaches that mixer's layers, under any spelling
    _, config, _ = build_run(first[0].as_dict())
    assert config.mixers == (canonical, canonical) and config.mixer_kwargs == ({"scale": 0.5}, {"scale": 0.5})


def test_two_spellings_of_one_mixer_in_one_grid_are_refused_as_one_run(tmp_path, monkeypatch):
    path = _write(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HookmechError, match=f"share the run id RunningMean_s0_\\w+ \\(two spellings of one mixer are one "
                                            f"mixer: {re.escape(str(path.resolve()))}:RunningMean"):
        expand(_sweep(["m.py:RunningMean", "./m.py:RunningMean"], options_name="x"))


def test_a_spawned_sweep_worker_imports_the_mixer_by_its_canonical_name(tmp_path, monkeypatch):
    """A worker is a fresh interpreter (spawn) in another folder: the relative spelling the sweep
    used would not resolve there, the canonical name does. Its row equals the same run's here
    (the same computation twice: exactly)."""
    path = _write(tmp_path / "src")
    monkeypatch.chdir(tmp_path / "src")
    run = expand(_sweep(["m.py:RunningMean"], options_name="m.py:RunningMean"))[0].as_dict()
    monkeypatch.chdir(tmp_path)
    here = execute_run(run, str(tmp_path / "here"), threads=1)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        spawned = pool.submit(execute_run, run, str(tmp_path / "spawned"), 1).result()
    assert spawned["status"] == here["status"] == "finished"
    assert {k: v for k, v in spawned.items() if k != "seconds"} == {k: v for k, v in here.items() if k != "seconds"}
    recorded = read_metadata(tmp_path / "spawned" / run["run_id"] / "model.safetensors")["config"].mixers
    assert recorded == (f"{path.resolve()}:RunningMean",) * 2
    assert (tmp_path / "spawned" / run["run_id"] / "model.safetensors").read_bytes() == \
        (tmp_path / "here" / run["run_id"] / "model.safetensors").read_bytes()


@pytest.mark.parametrize("declared", ["block_hook_aliases = {'attn.hook_z': 'mixer.hook_y'}", "def hook_aliases(self): return {}"])
def test_a_plug_in_declaring_aliases_the_old_way_is_refused_in_one_line(tmp_path, declared):
    """TransformerLens's names now come from a MixerSpec (tl_attention, tl_mixer_out): a plug-in
    stating them as the class once did would lose them without a word, so it is refused."""
    source = MIXER_SOURCE + f"\n\nclass OldAliases(RunningMean):\n    {declared}\n"
    path = _write(tmp_path, text=source)
    with pytest.raises(UsageError, match="no longer reads: state TransformerLens's names in its MixerSpec"):
        spec_of(f"{path}:OldAliases")
