"""The allocator tuning: on by default where glibc is, off on request, and numbers never change."""
from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import ctypes, ctypes.util, json, sys
from hookmech import allocator
print(json.dumps(allocator.keep_freed_memory()))
"""


def _run(env_value: str | None) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != "HOOKMECH_MALLOC_TUNING"}
    if env_value is not None:
        env["HOOKMECH_MALLOC_TUNING"] = env_value
    return subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_tuning_is_on_by_default_on_glibc_and_off_on_request():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert _run(None) == "true"
    assert _run("0") == "false"


def test_training_gives_the_same_weights_with_and_without_tuning(tmp_path):
    """Where memory comes from must not change a number: two runs, one tuned, one not."""
    code = """
import sys, torch, hookmech
from hookmech.config import build_config
from hookmech.training import TrainConfig, train
torch.set_num_threads(1)
task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers="mamba", d_model=16, n_layers=2)
train(task, config, TrainConfig(steps=6, epochs=None, n_train=0, n_dev=8, eval_every=6, batch_size=8), sys.argv[1], progress=False)
"""
    import os

    for name, value in (("tuned", "1"), ("plain", "0")):
        env = {**os.environ, "HOOKMECH_MALLOC_TUNING": value}
        subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], check=True, env=env, capture_output=True)
    from safetensors.torch import load_file

    tuned = load_file(tmp_path / "tuned" / "model.safetensors")
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    assert tuned.keys() == plain.keys() and tuned
    for name in tuned:  # the same computation twice: bit-identical
        assert (tuned[name] == plain[name]).all(), name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
@pytest.mark.parametrize("entry", ["patch", "atp_star_patch"])
def test_patching_tunes_the_allocator(entry):
    """Patching's runs and AtP*'s effects allocate multi-MB temporaries as training does."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    code = f"""
import torch, hookmech
from hookmech import allocator
from hookmech.config import build_config
task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
model = hookmech.HookedLM(build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=16, n_layers=2)).eval()
assert allocator._tuned is None
hookmech.patching.{entry}(model, task.sample(4, seed=0), "L1.block_in", "key")
print(allocator._tuned)
"""
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"
