"""Inputs refused at the edge (issue 27): diverged training keeps only finite checkpoints and says
what it kept, a resume state with NaN is refused, model configs are checked field by field and
by size before anything is allocated, sweep files against their schema, devices and safetensors
headers by what they are. The CLI's cases are in tests/cli/test_errors_training.py."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from safetensors import safe_open

import hookmech
from hookmech.config import ModelConfig, build_config
from hookmech.errors import HookmechError, UsageError
from hookmech.sweep import parse_sweep
from hookmech.training import TrainConfig, train

from helpers import ATTENTION_FIXTURE


def small_setup(**train_options):
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=16, n_layers=2, tie_embeddings=False)
    options = {"lr": 3e-3, "epochs": None, "steps": 30, "n_train": 0, "n_dev": 32, "batch_size": 8,
               "eval_every": 7, "ckpt_every": 10, **train_options}
    return task, model_config, TrainConfig(**options)


def _diverge_at(monkeypatch, step: int) -> None:
    """Make optimizer step `step` (0-based) push NaN into the weights: its loss is finite, its
    gradient NaN (``where``'s gradient through the branch it did not take), as when a run
    diverges between two checkpoints."""
    import hookmech.training as training

    real_loss, calls = training.answer_loss, []

    def loss(model, batch, groups=1):
        value = real_loss(model, batch, groups)
        calls.append(1)
        if len(calls) == step + 1:
            return torch.where(torch.tensor(True), value, torch.sqrt(value - 1e9))
        return value

    monkeypatch.setattr(training, "answer_loss", loss)


def _all_finite(path) -> bool:
    with safe_open(str(path), framework="pt") as handle:
        return all(torch.isfinite(handle.get_tensor(name)).all() for name in handle.keys())


# -- diverged runs ---------------------------------------------------------------------------
def test_weights_that_diverge_before_a_checkpoint_keep_the_previous_one(tmp_path, monkeypatch):
    """Step 19 turns the weights NaN; the checkpoint due at step 20 would hold them."""
    task, model_config, config = small_setup()
    _diverge_at(monkeypatch, 19)
    out = tmp_path / "run"
    with pytest.raises(HookmechError) as raised:
        train(task, model_config, config, out, progress=False)
    message = str(raised.value)
    assert "non-finite" in message and "step 20" in message, message
    assert f"kept the checkpoint of step 10 in {out / 'model.safetensors'}" in message, message
    assert "last good checkpoint" not in message
    assert _all_finite(out / "model.safetensors") and _all_finite(out / "resume.safetensors")
    kept = hookmech.checkpoint.read_metadata(out / "model.safetensors")["summary"]
    assert kept["steps"] == 10
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "nan" and summary["checkpoint_step"] == 10


def test_a_run_that_diverges_before_its_first_checkpoint_says_none_was_kept(tmp_path, monkeypatch):
    task, model_config, config = small_setup()
    _diverge_at(monkeypatch, 3)
    out = tmp_path / "run"
    with pytest.raises(HookmechError) as raised:
        train(task, model_config, config, out, progress=False)
    message = str(raised.value)
    assert "at step 4" in message and "no checkpoint was kept (the first was due at step 10)" in message, message
    assert not (out / "model.safetensors").exists() and not (out / "resume.safetensors").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "nan" and summary["checkpoint_step"] is None


def test_weights_that_diverge_at_the_last_step_are_not_saved_as_finished(tmp_path, monkeypatch):
    task, model_config, config = small_setup()
    _diverge_at(monkeypatch, 29)
    out = tmp_path / "run"
    with pytest.raises(HookmechError, match="kept the checkpoint of step 20"):
        train(task, model_config, config, out, progress=False)
    assert json.loads((out / "summary.json").read_text())["status"] == "nan"
    assert _all_finite(out / "model.safetensors")


def _poison(path, prefix: str) -> str:
    """Put a NaN into the first tensor of the safetensors file `path` whose name starts with
    `prefix`; return its name."""
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    name = next(name for name in tensors if name.startswith(prefix))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("inf")
    save_file(tensors, str(path), metadata=metadata)
    return name


@pytest.mark.parametrize("prefix", ["model.", "optim."])
def test_a_resume_state_with_non_finite_values_is_refused(tmp_path, prefix):
    task, model_config, config = small_setup()

    def stop_at_15(step):
        if step == 15:
            raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(task, model_config, config, out, progress=False, on_step=stop_at_15)
    name = _poison(out / "resume.safetensors", prefix)
    with pytest.raises(HookmechError, match=f"resume.safetensors: the resume state holds non-finite values .* in {name}"):
        train(task, model_config, config, out, progress=False)
    assert not (out / "summary.json").exists()


def test_a_resume_state_with_a_nan_loss_sum_is_refused(tmp_path):
    from safetensors.torch import save_file

    task, model_config, config = small_setup()
    out = tmp_path / "run"
    train(task, model_config, config, out, progress=False)
    (out / "summary.json").unlink()
    with safe_open(str(out / "resume.safetensors"), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    extra = json.loads(metadata["resume"])
    extra["loss_sum"] = float("nan")
    save_file(tensors, str(out / "resume.safetensors"), metadata={"resume": json.dumps(extra)})
    with pytest.raises(HookmechError, match="resume.safetensors: .*loss_sum"):
        train(task, model_config, config, out, progress=False)


# -- check_finite_parameters: a diverged checkpoint still loads, and can be checked -------------
def test_a_checkpoint_with_nan_weights_loads_and_check_finite_names_the_parameter(tmp_path, ar_model):
    from hookmech.validate import check_finite_parameters as check_finite

    with torch.no_grad():
        ar_model.blocks[1].mixer.Wqkv.weight[3, 2] = float("nan")
        ar_model.blocks[1].mixer.Wqkv.weight[0, 0] = float("inf")
    path = hookmech.save(ar_model, tmp_path / "m.safetensors")
    loaded = hookmech.load(path)  # a diverged run's file may be inspected
    with pytest.raises(HookmechError, match=r"blocks\.1\.mixer\.Wqkv\.weight holds inf at \[0, 0\]"):
        check_finite(loaded)
    with pytest.raises(HookmechError, match=rf"^{tmp_path}/m\.safetensors: weight blocks\.1\.mixer\.Wqkv\.weight"):
        check_finite(loaded, source=str(path))
    check_finite(hookmech.load(ATTENTION_FIXTURE))  # finite: returns None


# -- model configs ---------------------------------------------------------------------------
def _config_json(**changes) -> str:
    config = json.loads(hookmech.load(ATTENTION_FIXTURE).cfg.to_json())
    config.update(changes)
    return json.dumps(config)


@pytest.mark.parametrize(("changes", "message"), [
    ({"mixers": ["nosuch", "attention"]}, "unknown mixer 'nosuch'"),
    ({"d_model": 64.0}, "d_model = 64.0: expected an integer >= 1"),
    ({"d_model": True}, "d_model = true: expected an integer >= 1"),
    ({"n_layers": "2"}, 'n_layers = "2": expected an integer >= 1'),
    ({"mixer_kwargs": [{"n_heads": 1, "window": "abc"}, {"n_heads": 1}]}, "option window=\"abc\" should be"),
    ({"mlp": [True, "yes"]}, 'mlp = [true, "yes"]: expected true or false for each layer'),
    ({"tie_embeddings": 1}, "tie_embeddings = 1: expected true or false"),
    ({"mixers": "attention"}, 'mixers = "attention": expected a list of 2 entries'),
])
def test_a_bad_model_config_names_the_field(changes, message):
    with pytest.raises(UsageError) as raised:
        ModelConfig.from_json(_config_json(**changes))
    assert message in str(raised.value)


@pytest.mark.parametrize(("changes", "field"), [({"d_model": 200_000}, "d_model 200000"),
                                                 ({"n_ctx": 10**12}, "n_ctx 1000000000000")])
def test_a_model_too_big_for_memory_is_refused_by_arithmetic(changes, field):
    from hookmech.sizes import check_fits

    config = ModelConfig.from_json(_config_json(**changes))
    with pytest.raises(UsageError) as raised:
        check_fits(config)
    message = str(raised.value)
    assert field in message and "parameters" in message and "memory" in message, message


def test_check_fits_counts_what_the_model_holds(monkeypatch):
    """The arithmetic: parameters x bytes x copies against the memory here (set small)."""
    import hookmech.sizes
    from hookmech.sizes import check_fits

    config = hookmech.load(ATTENTION_FIXTURE).cfg
    n_bytes = sum(t.numel() * t.element_size() for t in hookmech.load(ATTENTION_FIXTURE).state_dict().values())
    monkeypatch.setattr(hookmech.sizes, "memory_bytes", lambda device: 4 * n_bytes)
    check_fits(config, copies=4)
    with pytest.raises(UsageError, match="memory"):
        check_fits(config, copies=5)


def test_loading_a_checkpoint_too_big_names_the_file(tmp_path):
    from hookmech.checkpoint import write_safetensors

    with safe_open(str(ATTENTION_FIXTURE), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    path = tmp_path / "m.safetensors"
    write_safetensors(tensors, path, {**metadata, "hookmech_config": _config_json(d_model=200_000)})
    with pytest.raises(HookmechError, match=rf"^{path}: model config .*d_model 200000"):
        hookmech.load(path)


# -- trainer options -------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "message"), [
    ({"seed": 2**64}, f"seed must be an integer in 0..{2**64 - 1}, got {2**64}"),
    ({"seed": -1}, f"seed must be an integer in 0..{2**64 - 1}, got -1"),
    ({"steps": True}, "steps must be an integer >= 1, got True"),
    ({"lr": float("inf")}, "lr must be a number > 0, got inf"),
])
def test_trainer_options_out_of_range_are_refused(options, message):
    with pytest.raises(UsageError) as raised:
        TrainConfig(**{"epochs": None, "steps": 10, "n_train": 0, **options})
    assert message in str(raised.value)


@pytest.mark.parametrize(("name", "value"), [("seed", 1.5), ("steps", 2.5), ("lr", "0.1"), ("batch_size", 8.0),
                                              ("warmup_frac", float("nan")), ("n_train", -1)])
def test_trainer_fields_refuse_the_wrong_type(name, value):
    """What TrainConfig checks (the test suite's type checker refuses a float seed before
    TrainConfig sees it; without it, TrainConfig does, with this message)."""
    from hookmech.training import TRAIN_FIELDS

    with pytest.raises(UsageError, match=f"^{name} must be "):
        TRAIN_FIELDS[name].check(name, value)


def test_the_largest_seed_trains(tmp_path):
    task, model_config, config = small_setup(seed=2**64 - 1, steps=2, eval_every=2)
    assert train(task, model_config, config, tmp_path / "run", progress=False)["status"] == "finished"


# -- sweep files -------------------------------------------------------------------------------
SWEEP = """
[task]
name = "ar"
vocab_size = 16
num_kv_pairs = 3
[train]
steps = 4
n_train = 0
[grid]
seed = [0, 1]
"""


@pytest.mark.parametrize(("old", "new", "message"), [
    ("[grid]", '[model]\nd_model = "abc"\n[grid]', '[model] d_model = "abc": expected an integer >= 1'),
    ("steps = 4", 'steps = "20"', '[train] steps = "20": expected an integer >= 1'),
    ("seed = [0, 1]", 'lr = ["x", "y"]', '[grid] lr = ["x", "y"]: "x" is not a number > 0'),
    ("seed = [0, 1]", "seed = [0, 1.5]", "[grid] seed = [0, 1.5]: 1.5 is not an integer in 0.."),
    ("[grid]", "[model]\nn_layers = 2.5\n[grid]", "[model] n_layers = 2.5: expected an integer >= 1"),
    ("[grid]", "[model]\nd_model = true\n[grid]", "[model] d_model = true: expected an integer >= 1"),
    ("seed = [0, 1]", 'arch = ["attention", 5]', '[grid] arch = ["attention", 5]: 5 is not a model preset name'),
    ("seed = [0, 1]", 'mixer = ["attention", ""]', '[grid] mixer = ["attention", ""]: "" is not a mixer name'),
    ("[grid]", '[model]\npos_emb = "sinusoidal"\n[grid]', '[model] pos_emb = "sinusoidal": expected one of'),
    ("[grid]", "[model]\nmlp = 1\n[grid]", "[model] mlp = 1: expected true or false"),
    ("steps = 4", "steps = 4\nlr = inf", "[train] lr = inf: expected a number > 0"),
    ("steps = 4", "steps = 4\nwarmup_frac = -0.5", "[train] warmup_frac = -0.5: expected a number in [0, 1]"),
])
def test_sweep_files_are_checked_against_their_schema(old, new, message):
    with pytest.raises(UsageError) as raised:
        parse_sweep(SWEEP.replace(old, new), name="s", source="dir/s.toml")
    assert str(raised.value).startswith("dir/s.toml: "), raised.value
    assert message in str(raised.value)


def test_every_preset_passes_the_schema():
    from hookmech.sweep import PRESETS, load_preset

    for name in PRESETS:
        load_preset(name)


# -- devices and safetensors headers -----------------------------------------------------------
def test_loading_onto_a_device_that_is_not_here_names_it():
    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(UsageError, match=f"device {device!r}"):
        hookmech.load(ATTENTION_FIXTURE, device=device)
    with pytest.raises(UsageError, match="device 'gpu'"):
        hookmech.load(ATTENTION_FIXTURE, device="gpu")


def test_training_on_a_device_that_is_not_here_names_it(tmp_path):
    task, model_config, config = small_setup()
    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(UsageError, match=f"device {device!r}"):
        train(task, model_config, config, tmp_path / "run", device=device, progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("first_byte", [0x80, 0x00])
def test_a_header_length_with_its_top_bit_set_is_not_called_a_pickle(tmp_path, first_byte):
    data = bytearray(ATTENTION_FIXTURE.read_bytes())
    data[0] = first_byte
    data[7] |= 0x80
    path = tmp_path / "m.safetensors"
    path.write_bytes(bytes(data))
    length = int.from_bytes(data[:8], "little")
    with pytest.raises(HookmechError) as raised:
        hookmech.load(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: not a valid safetensors file (header length {length} bytes"), message
    assert "pickle" not in message


# -- a full disk under a folder lock -----------------------------------------------------------
def test_a_lock_that_cannot_be_written_names_its_path_and_is_removed(tmp_path, monkeypatch):
    import hookmech.locking
    from hookmech.locking import folder_lock

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(hookmech.locking.os, "pwrite", full)
    folder = tmp_path / "runs"
    with pytest.raises(HookmechError, match=f"^no space left on device writing {folder / '.lock'}$"):
        with folder_lock(folder, "runs folder"):
            pytest.fail("the block ran without the lock")
    assert not folder.exists()
    monkeypatch.undo()
    with folder_lock(folder, "runs folder"):  # nothing left behind holds it
        assert (folder / ".lock").read_text().strip() == str(os.getpid())
