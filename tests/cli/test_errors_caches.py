"""Bad caches, checkpoints and options of `cache`, `patch`, `probe`, `das` and `inspect`: one row
per case, each one line on stderr with a non-zero exit and no "unexpected" (the pattern of
tests/cli/test_errors.py: (id, setup, argv, exit code, a substring of the message)).

`{tmp}` in an argument is the test's temporary folder, `{ckpt}` the bundled attention fixture.
Setups write a small honest cache of the fixture ({tmp}/c.h5) and then damage it, or write
checkpoints of the fixture's config with broken weights.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import ATTENTION_FIXTURE as FIXTURE, run_cli

HOOK = "blocks.1.hook_resid_pre"


def _fixture():
    import hookmech

    return hookmech.load(FIXTURE), hookmech.tasks.from_checkpoint(FIXTURE)


def _write_cache(tmp: Path, model=None, rows: int = 8) -> Path:
    """{tmp}/c.h5: a cache of `model` (default: the fixture) on 8 rows of the fixture's task, L1.block_in."""
    from hookmech.cache import write_cache

    fixture, task = _fixture()
    return write_cache(model or fixture, task.sample(rows, seed=0), tmp / "c.h5", [HOOK], task_spec=task.spec)


def _edited(edit):
    """A setup writing {tmp}/c.h5, then changing it with `edit(h5)`."""
    def setup(tmp: Path) -> None:
        import h5py

        with h5py.File(_write_cache(tmp), "r+") as h5:
            edit(h5)
    return setup


def _replace(name: str, change):
    """An edit rewriting dataset `name` as `change(its values)`."""
    def edit(h5) -> None:
        values = change(h5[name][()])
        del h5[name]
        h5[name] = values
    return edit


def _roles_as_a_dataset(h5) -> None:
    del h5["roles"]
    h5["roles"] = np.zeros(8, np.int32)


def _zero_rows(h5) -> None:
    for name in list(_datasets(h5)):
        values = h5[name][()]
        del h5[name]
        h5[name] = values[:0]


def _datasets(h5):
    import h5py

    found = []
    h5.visititems(lambda name, item: found.append(name) if isinstance(item, h5py.Dataset) else None)
    return found


def _checkpoint(tmp: Path, name: str, change) -> None:
    """{tmp}/NAME.safetensors: the fixture with `change(model)` applied to its weights."""
    from hookmech.checkpoint import save

    model, task = _fixture()
    with torch.no_grad():
        change(model)
    save(model, tmp / f"{name}.safetensors", task_spec=task.spec)


def _nan_checkpoint(tmp: Path) -> None:
    """{tmp}/nan.safetensors (one NaN weight) and {tmp}/c.h5, an honest cache of the fixture."""
    _checkpoint(tmp, "nan", lambda model: model.blocks[1].mlp.fc1.weight.__setitem__((0, 0), float("nan")))
    _write_cache(tmp)


def _huge_embedding(tmp: Path) -> None:
    """{tmp}/big.safetensors: finite weights whose residual stream overflows float16."""
    _checkpoint(tmp, "big", lambda model: model.embed.weight.mul_(1e8))


def _other_model_with_this_hash(tmp: Path) -> None:
    """{tmp}/c.h5: a cache of the fixture's config with other weights, its model_hash edited to the fixture's."""
    import h5py

    from hookmech.identity import model_hash

    fixture, _ = _fixture()
    other = copy.deepcopy(fixture)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    with h5py.File(_write_cache(tmp, other), "r+") as h5:
        h5.attrs["model_hash"] = model_hash(fixture)


SETUPS = {
    "none": lambda tmp: None,
    "cache": _write_cache,
    "role -1": _edited(_replace("roles/value", lambda roles: np.full_like(roles, -1))),
    "role T": _edited(lambda h5: _replace("roles/value", lambda roles: np.full_like(roles, h5["tokens/clean"].shape[1]))(h5)),
    "int32 activations": _edited(_replace(f"acts/clean/{HOOK}", lambda acts: acts.astype(np.int32))),
    "nan activations": _edited(_replace(f"acts/clean/{HOOK}", lambda acts: np.full_like(acts, np.nan))),
    "inf p_answer": _edited(_replace("p_answer/clean", lambda p: np.where(np.arange(len(p)) == 2, np.inf, p))),
    "edited p_answer": _edited(_replace("p_answer/clean", lambda p: (0.8 * p).astype(np.float32))),
    "format_version abc": _edited(lambda h5: h5.attrs.__setitem__("format_version", "abc")),
    "roles as a dataset": _edited(_roles_as_a_dataset),
    "no model_config": _edited(lambda h5: h5.attrs.__delitem__("model_config")),
    "task not JSON": _edited(lambda h5: h5.attrs.__setitem__("task", "{not json")),
    "zero rows": _edited(_zero_rows),
    "nan checkpoint": _nan_checkpoint,
    "huge embedding": _huge_embedding,
    "other model, this hash": _other_model_with_this_hash,
}

PATCH = ["patch", "--ckpt", "{ckpt}", "--site", "L1.block_in", "--pos", "value"]
PATCH_CACHE = [*PATCH, "--cache", "{tmp}/c.h5"]
PROBE = ["probe", "{tmp}/c.h5", "--site", "L1.block_in", "--pos", "value"]
DAS = ["das", "--ckpt", "{ckpt}", "--cache", "{tmp}/c.h5", "--site", "L1.block_in", "--pos", "value", "--dim", "1",
       "--steps", "2", "-o", "{tmp}/d"]

#: silent wrong answers: a cache, a checkpoint or an option whose numbers would be used as they are
ROWS_SILENT = [
    ("patch-role-minus-one", "role -1", PATCH_CACHE, 1, "holds -1, outside the row (length 11: positions 0..10)"),
    ("patch-role-past-the-row", "role T", PATCH_CACHE, 1, "holds 11, outside the row (length 11: positions 0..10)"),
    ("probe-role-minus-one", "role -1", PROBE, 1, "roles/value row 0 holds -1"),
    ("patch-int32-activations", "int32 activations", PATCH_CACHE, 1,
     f"acts/clean/{HOOK} is int32; the format stores activations as float32 or float16"),
    ("patch-nan-activations", "nan activations", PATCH_CACHE, 1, f"acts/clean/{HOOK} holds nan at row"),
    ("probe-nan-activations", "nan activations", PROBE, 1, f"acts/clean/{HOOK} holds nan at row 0"),
    ("das-nan-activations", "nan activations", DAS, 1, f"acts/clean/{HOOK} holds nan at row"),
    ("patch-inf-p-answer", "inf p_answer", PATCH_CACHE, 1, "p_answer/clean row 2 holds inf"),
    ("inspect-inf-p-answer", "inf p_answer", ["inspect", "{tmp}/c.h5"], 1, "p_answer/clean row 2 holds inf"),
    ("cache-nan-checkpoint", "nan checkpoint", ["cache", "--ckpt", "{tmp}/nan.safetensors", "--n", "4",
                                                "-o", "{tmp}/n.h5"], 1, "blocks.1.mlp.fc1.weight holds nan"),
    ("patch-nan-checkpoint", "nan checkpoint", ["patch", "--ckpt", "{tmp}/nan.safetensors", "--site", "L1.block_in",
                                                "--pos", "value", "--n", "4"], 1, "blocks.1.mlp.fc1.weight holds nan"),
    ("das-nan-checkpoint", "nan checkpoint", [*DAS[:2], "{tmp}/nan.safetensors", *DAS[3:]], 1,
     "blocks.1.mlp.fc1.weight holds nan"),
    ("cache-float16-overflow", "huge embedding", ["cache", "--ckpt", "{tmp}/big.safetensors", "--n", "4", "--dtype",
                                                  "float16", "-o", "{tmp}/b.h5"], 1,
     "L0.block_in (blocks.0.hook_resid_pre) of the clean run holds inf at row 0"),
    ("probe-negative-weight-decay", "cache", [*PROBE, "--weight-decay", "-1"], 2,
     "weight decay must be a finite number >= 0, got -1.0"),
    ("probe-nan-weight-decay", "cache", [*PROBE, "--weight-decay", "nan"], 2,
     "weight decay must be a finite number >= 0, got nan"),
    ("patch-cache-of-another-model-with-this-hash", "other model, this hash", PATCH_CACHE, 1,
     "recomputed with this model"),
    ("das-cache-of-another-model-with-this-hash", "other model, this hash", DAS, 1, "recomputed with this model"),
    ("patch-edited-p-answer", "edited p_answer", PATCH_CACHE, 1, "p_answer/clean row"),
]

#: caches and options that reached a Python exception shown as "unexpected"
ROWS_UNEXPECTED = [
    ("inspect-format-version-abc", "format_version abc", ["inspect", "{tmp}/c.h5"], 1,
     "c.h5: format_version is 'abc', expected the integer 1"),
    ("patch-format-version-abc", "format_version abc", PATCH_CACHE, 1, "format_version is 'abc'"),
    ("inspect-roles-as-a-dataset", "roles as a dataset", ["inspect", "{tmp}/c.h5"], 1,
     "c.h5: roles is a dataset, expected a group of [N] datasets (one per role)"),
    ("patch-roles-as-a-dataset", "roles as a dataset", PATCH_CACHE, 1, "roles is a dataset, expected a group"),
    ("inspect-no-model-config", "no model_config", ["inspect", "{tmp}/c.h5"], 1,
     "c.h5: no model_config attribute, expected the model's config as a JSON object"),
    ("patch-no-model-config", "no model_config", PATCH_CACHE, 1, "no model_config attribute"),
    ("inspect-task-not-json", "task not JSON", ["inspect", "{tmp}/c.h5"], 1,
     "c.h5: the task attribute is not JSON"),
    ("probe-task-not-json", "task not JSON", PROBE, 1, "the task attribute is not JSON"),
    ("inspect-zero-rows", "zero rows", ["inspect", "{tmp}/c.h5"], 1, "c.h5: the cache holds no rows"),
    ("patch-zero-rows", "zero rows", PATCH_CACHE, 1, "the cache holds no rows"),
    ("patch-position-past-int64", "none", [*PATCH[:-1], "9999999999999999999999", "--n", "4"], 2,
     "position 9999999999999999999999 is outside some rows"),
    ("probe-empty-site", "cache", ["probe", "{tmp}/c.h5", "--site", "", "--pos", "value"], 2,
     "c.h5: empty site name (cached: L1.block_in)"),
    ("das-negative-seed", "cache", [*DAS, "--seed", "-1"], 2, "seed must be an integer in 0..18446744073709551615, got -1"),
    ("das-seed-past-64-bits", "cache", [*DAS, "--seed", str(2**64)], 2,
     f"seed must be an integer in 0..18446744073709551615, got {2**64}"),
    ("probe-negative-seed", "cache", [*PROBE, "--seed", "-1"], 2, "seed must be an integer in 0..18446744073709551615, got -1"),
    ("patch-negative-ablate-seed", "none", [*PATCH, "--n", "4", "--ablate", "resample", "--ablate-seed", "-1"], 2,
     "ablate_seed must be an integer in 0..18446744073709551615, got -1"),
]

#: zero or negative counts are usage errors
ROWS_COUNTS = [
    ("patch-max-batch-zero", "none", [*PATCH, "--n", "4", "--max-batch", "0"], 2, "max_batch must be >= 1, got 0"),
    ("patch-threads-negative", "none", [*PATCH, "--n", "4", "--threads", "-2"], 2, "--threads must be >= 1, got -2"),
    ("patch-n-zero", "none", [*PATCH, "--n", "0"], 2, "--n must be >= 1, got 0"),
    ("patch-context-memory-negative", "none", [*PATCH, "--n", "4", "--context-memory", "-1"], 2,
     "--context-memory must be >= 0 MiB"),
    ("cache-threads-zero", "none", ["cache", "--ckpt", "{ckpt}", "--n", "4", "--threads", "0", "-o", "{tmp}/c.h5"], 2,
     "--threads must be >= 1, got 0"),
    ("cache-n-negative", "none", ["cache", "--ckpt", "{ckpt}", "--n", "-4", "-o", "{tmp}/c.h5"], 2,
     "--n must be >= 1, got -4"),
    ("probe-threads-zero", "cache", [*PROBE, "--threads", "0"], 2, "--threads must be >= 1, got 0"),
    ("das-threads-zero", "cache", [*DAS, "--threads", "0"], 2, "--threads must be >= 1, got 0"),
    ("das-batch-size-zero", "cache", [*DAS, "--batch-size", "0"], 2, "batch size must be >= 1, got 0"),
    ("das-steps-negative", "cache", [*DAS[:-4], "--steps", "-3", "-o", "{tmp}/d"], 2, "steps must be >= 1, got -3"),
]

ALL_ROWS = ROWS_SILENT + ROWS_UNEXPECTED + ROWS_COUNTS


def _expand(argv: list[str], tmp: Path) -> list[str]:
    return [arg.replace("{tmp}", str(tmp)).replace("{ckpt}", str(FIXTURE)) for arg in argv]


@pytest.mark.parametrize(("setup", "argv", "code", "message"), [row[1:] for row in ALL_ROWS],
                         ids=[row[0] for row in ALL_ROWS])
def test_bad_input_is_one_line_and_an_exit_code(setup, argv, code, message, tmp_path, capsys):
    SETUPS[setup](tmp_path)
    before = sorted(tmp_path.iterdir())
    got_code, _, err = run_cli(_expand(argv, tmp_path), capsys)
    lines = err.strip().splitlines()
    assert got_code == code, err
    assert len(lines) == 1, err
    assert lines[0].startswith("hookmech: error: "), err
    assert message in lines[0], err
    assert "Traceback" not in err and "unexpected" not in err, err
    assert sorted(tmp_path.iterdir()) == before  # nothing written (no cache of non-finite numbers, no das folder)


def test_every_row_has_a_unique_id():
    ids = [row[0] for row in ALL_ROWS]
    assert ids and len(ids) == len(set(ids))


def test_the_cache_check_can_be_skipped(tmp_path, capsys):
    """--no-verify-cache trusts the file (the model_hash still has to match): the edited cache is read."""
    _other_model_with_this_hash(tmp_path)
    code, out, err = run_cli(_expand([*PATCH_CACHE, "--no-verify-cache", "--json"], tmp_path), capsys)
    assert code == 0, err
    assert '"attribution"' in out
