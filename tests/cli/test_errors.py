"""Bad input on the command line: one row per case, each one line on stderr with a non-zero exit.

Every row is (argv, expected exit code, a substring of the one-line message). `{tmp}` in an
argument is the test's temporary folder (`{tmpname}` its name), `{ckpt}` the bundled attention fixture. Add a row for every bad input found, so the list
only grows. Rows are grouped by what they protect; setups that need files made first live in
`SETUPS` (a function that prepares `{tmp}` before the command runs).
"""
from __future__ import annotations

import errno
from pathlib import Path

import pytest
from helpers import ATTENTION_FIXTURE as FIXTURE
from helpers import SWEEP_SMALL, fail_cache_write_on_call, run_cli

TRAIN_SMALL = ["train", "--task", "ar", "--task-opt", "vocab_size=16", "--task-opt", "num_kv_pairs=3",
               "--n-train", "0", "--steps", "4", "--d-model", "16", "--n-dev", "8", "--eval-every", "4"]


def _nothing(tmp: Path) -> None:
    """No setup."""


def _write_cache(tmp: Path) -> Path:
    """A small cache of the bundled fixture (8 rows, L1.block_in), its model_sha256 the fixture's."""
    from hookmech.cache import write_cache
    from hookmech.checkpoint import load
    from hookmech.fileio import sha256_of
    from hookmech.tasks import from_checkpoint

    task = from_checkpoint(FIXTURE)
    return write_cache(load(FIXTURE), task.sample(8, seed=0), tmp / "c.h5", ["blocks.1.hook_resid_pre"],
                       model_sha256=sha256_of(FIXTURE), task_spec=task.spec)


def _edit_cache(edit):
    """A setup writing the small cache, then changing it with `edit(h5)`."""
    def setup(tmp: Path) -> None:
        import h5py

        with h5py.File(_write_cache(tmp), "r+") as h5:
            edit(h5)
    return setup


def _short_answers(h5) -> None:
    answers = h5["answers"][()]
    del h5["answers"]
    h5["answers"] = answers[:3]


def _dataset(tmp: Path) -> None:
    from hookmech.datasets import save_dataset
    from hookmech.tasks import from_checkpoint

    task = from_checkpoint(FIXTURE)
    save_dataset(task.sample(8, seed=0), task, tmp / "d.h5", seed=0)


def _file(tmp: Path) -> None:
    (tmp / "f").write_text("a file, not a folder\n")


def _corrupt_run_json(tmp: Path) -> None:
    (tmp / "r").mkdir()
    (tmp / "r" / "run.json").write_text('{"model_config": {')
    (tmp / "r" / "metrics.jsonl").write_text("")  # a started run: its run.json is read


def _sweep_empty_grid(tmp: Path) -> None:
    (tmp / "s.toml").write_text('[task]\nname = "ar"\n[train]\nsteps = 2\n[grid]\n')


#: setups by name: each prepares files under the test's temporary folder
SETUPS = {
    "none": _nothing,
    "cache": _write_cache,
    "cache_v2": _edit_cache(lambda h5: h5.attrs.modify("format_version", 2)),
    "cache_no_p_answer": _edit_cache(lambda h5: h5.__delitem__("p_answer/clean")),
    "cache_short_answers": _edit_cache(_short_answers),
    "dataset": _dataset,
    "file": _file,
    "corrupt_run_json": _corrupt_run_json,
    "sweep_empty_grid": _sweep_empty_grid,
}

# -- run, sweep and report folders -----------------------------------------------------------
#: processes started by setups (holding folder locks); stopped after each test
_HOLDERS: list = []



@pytest.fixture(autouse=True)
def _stop_lock_holders():
    yield
    from lock_holder import stop_lock_holder

    while _HOLDERS:
        stop_lock_holder(_HOLDERS.pop())


def _hold_lock(folder: Path) -> None:
    from lock_holder import start_lock_holder

    _HOLDERS.append(start_lock_holder(folder))


def _sweep_file(tmp: Path, mech: str | None = None) -> None:
    (tmp / "s.toml").write_text(SWEEP_SMALL + (f"[mech]\n{mech}\n" if mech is not None else ""))


def _runs_with_results(tmp: Path) -> None:
    from hookmech.sweep import write_results

    (tmp / "runs").mkdir()
    (tmp / "runs" / "notes").mkdir()
    (tmp / "runs" / "notes" / "a.txt").write_text("not a report\n")
    write_results([{"run_id": "a", "d_model": 8, "seed": 0, "status": "finished", "dev_acc": 1.0, "dev_p_answer": 0.9,
                    "steps": 4, "seconds": 1.0}], tmp / "runs" / "results.csv")


SETUPS.update({
    "locked-run": lambda tmp: _hold_lock(tmp / "r"),
    "locked-runs": lambda tmp: (_sweep_file(tmp), _hold_lock(tmp / "runs")),
    "sweep-mech-site": lambda tmp: _sweep_file(tmp, 'sites = ["L9.block_in"]'),
    "sweep-mech-position": lambda tmp: _sweep_file(tmp, 'positions = ["value", "nosuchrole"]'),
    "sweep-mech-every": lambda tmp: _sweep_file(tmp, "every = 3"),
    "sweep-mech-n": lambda tmp: _sweep_file(tmp, 'n = "many"'),
    "runs-with-results": _runs_with_results,
})


def _checkpoint_copy(tmp: Path) -> None:
    """{tmp}/m.safetensors: a copy of the attention fixture (an input a command could overwrite)."""
    (tmp / "m.safetensors").write_bytes(FIXTURE.read_bytes())


def _dataset_files(tmp: Path) -> None:
    """{tmp}/d.h5 and {tmp}/run/model.safetensors: dataset files of the small AR task."""
    from hookmech import tasks
    from hookmech.datasets import save_dataset

    task = tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    save_dataset(task.sample(8, seed=0), task, tmp / "d.h5")
    save_dataset(task.sample(8, seed=0), task, tmp / "run" / "model.safetensors")


def _runs_and_sweep_file(tmp: Path) -> None:
    """{tmp}/runs (a runs folder with results.csv) and {tmp}/s.toml, {tmp}/runs/sweep.json (sweep files)."""
    (tmp / "runs").mkdir()
    (tmp / "runs" / "results.csv").write_text("run_id,status\n")
    (tmp / "s.toml").write_text('name = "s"\n')
    (tmp / "runs" / "sweep.json").write_text('name = "s"\n')  # a sweep file where sweep writes its own


def _cache_of_mamba(tmp: Path) -> None:
    """{tmp}/mamba.h5: a small cache of the Mamba fixture (another model than {ckpt}'s)."""
    import hookmech
    from hookmech.cache import write_cache

    path = FIXTURE.parent / "mamba_ar_cpu.safetensors"
    model, task = hookmech.load(path), hookmech.tasks.from_checkpoint(path)
    write_cache(model, task.sample(4, seed=0), tmp / "mamba.h5", ["blocks.1.hook_resid_pre"], task_spec=task.spec)


SETUPS.update({"checkpoint copy": _checkpoint_copy, "dataset files": _dataset_files,
               "runs and sweep file": _runs_and_sweep_file, "cache of mamba": _cache_of_mamba})

#: (id, setup, argv, exit code, message substring)
ROWS_USAGE = [
    ("unknown-mixer", "none", [*TRAIN_SMALL, "--mixer", "nosuch", "-o", "{tmp}/r"], 2, "unknown mixer 'nosuch'"),
    ("unknown-site", "none", ["patch", "--ckpt", "{ckpt}", "--site", "L9.block_in", "--pos", "value"], 2,
     "L9.block_in"),
]

#: files: an output that is one of the command's inputs, a cache of another model
ROWS_FILES = [
    ("cache-out-is-ckpt", "checkpoint copy", ["cache", "--ckpt", "{tmp}/m.safetensors", "--n", "4", "-o", "{tmp}/m.safetensors"],
     2, "which is the input --ckpt"),
    ("cache-out-is-ckpt-other-spelling", "checkpoint copy",
     ["cache", "--ckpt", "{tmp}/m.safetensors", "--n", "4", "-o", "{tmp}/../{tmpname}/./m.safetensors"], 2, "which is the input --ckpt"),
    ("patch-per-example-is-ckpt", "checkpoint copy",
     ["patch", "--ckpt", "{tmp}/m.safetensors", "--site", "L1.block_in", "--pos", "value", "--n", "4",
      "--per-example", "{tmp}/m.safetensors"], 2, "--per-example would write"),
    ("patch-per-example-is-data", "dataset files",
     ["patch", "--ckpt", "{ckpt}", "--site", "L1.block_in", "--pos", "value", "--data", "{tmp}/d.h5",
      "--per-example", "{tmp}/d.h5"], 2, "which is the input --data"),
    ("train-out-is-data", "dataset files", ["train", "--data", "{tmp}/d.h5", "--steps", "2", "-o", "{tmp}/d.h5"], 2,
     "is a file"),
    ("train-writes-over-data", "dataset files", ["train", "--data", "{tmp}/run/model.safetensors", "--steps", "2", "-o", "{tmp}/run"],
     2, "which is the input --data"),
    ("report-out-is-runs", "runs and sweep file", ["report", "{tmp}/runs", "-o", "{tmp}/runs"], 2, "which is the input RUNS_DIR"),
    ("report-out-is-results", "runs and sweep file", ["report", "{tmp}/runs", "-o", "{tmp}/runs/results.csv"], 2,
     "is a file"),
    ("sweep-out-is-sweep-file", "runs and sweep file", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/s.toml"], 2,
     "is a file"),
    ("sweep-file-is-runs-sweep-json", "runs and sweep file", ["sweep", "{tmp}/runs/sweep.json", "-o", "{tmp}/runs"], 2,
     "which is the input SWEEP_FILE"),
    ("patch-cache-of-another-model", "cache of mamba",
     ["patch", "--ckpt", "{ckpt}", "--cache", "{tmp}/mamba.h5", "--site", "L1.block_in", "--pos", "value"], 1,
     "was made from another model than"),
]


PATCH = ["patch", "--ckpt", "{ckpt}", "--n", "4"]

#: messages that say what was typed, or what is missing, and where
ROWS_MESSAGES = [
    ("joint-site-with-an-empty-part", "none", [*PATCH, "--site", "L0.block_out+", "--pos", "value"], 2,
     "site 'L0.block_out+' has an empty part"),
    ("joint-position-with-an-empty-part", "none", [*PATCH, "--site", "L0.block_out", "--pos", "value+"], 2,
     "position 'value+' has an empty part"),
    ("all-inside-a-joint-position", "none", [*PATCH, "--site", "L0.block_out", "--pos", "key+all"], 2,
     "'all' cannot be part of the joint position 'key+all'"),
    ("probe-at-all-positions", "cache", ["probe", "{tmp}/c.h5", "--site", "L1.block_in", "--pos", "all"], 2,
     "a probe reads one position per row, not 'all'"),
    ("cache-of-another-format-version", "cache_v2", ["inspect", "{tmp}/c.h5"], 1,
     "cache format version 2 is not supported (expected 1)"),
    ("dataset-file-given-as-cache", "dataset", [*PATCH[:3], "--site", "L0.block_out", "--pos", "value",
                                                "--cache", "{tmp}/d.h5"], 1,
     "a hookmech dataset file, not an activation cache"),
    ("cache-without-p-answer", "cache_no_p_answer", ["inspect", "{tmp}/c.h5"], 1, "no p_answer/clean"),
    ("cache-with-short-answers", "cache_short_answers", [*PATCH[:3], "--site", "L1.block_in", "--pos", "value",
                                                         "--cache", "{tmp}/c.h5"], 1,
     "answers has 3 rows, the cache 8"),
    ("corrupt-run-json", "corrupt_run_json", [*TRAIN_SMALL, "-o", "{tmp}/r"], 1, "run.json: not valid JSON"),
    ("output-under-a-file", "file", ["data", "ar", "--n", "4", "-o", "{tmp}/f/d.h5"], 1,
     "/f is a file, not a folder"),
    ("run-folder-under-a-file", "file", [*TRAIN_SMALL, "-o", "{tmp}/f/r"], 1, "/f is a file, not a folder"),
    ("threshold-nan", "none", [*PATCH, "--site", "L0.block_out", "--pos", "value", "--threshold", "nan"], 2,
     "threshold must be a finite number, got nan"),
    ("threshold-inf-atp", "none", [*PATCH, "--site", "L0.block_out", "--pos", "value", "--method", "atp",
                                   "--threshold", "inf"], 2, "threshold must be a finite number, got inf"),
    ("atp-star-with-another-metric", "none", [*PATCH, "--site", "L0.block_out", "--pos", "value",
                                              "--method", "atp-star", "--metric", "kl"], 2,
     "method 'atp-star' estimates interchange denoising of p_answer only"),
    ("atp-star-with-a-joint-site", "none", [*PATCH, "--site", "L0.block_out+L1.mixer_in", "--pos", "value",
                                            "--method", "atp-star"], 2, "method 'atp-star' takes plain sites"),
    ("atp-star-with-an-ablation", "none", [*PATCH, "--site", "L0.block_out", "--pos", "value",
                                           "--method", "atp-star", "--ablate", "zero"], 2,
     "method 'atp-star' estimates interchange denoising of p_answer only"),
    ("no-graddrop-with-plain-atp", "none", [*PATCH, "--site", "L0.block_out", "--pos", "value",
                                            "--method", "atp", "--no-graddrop"], 2,
     "--no-graddrop is an option of --method atp-star"),
    ("verify-top-with-the-exact-method", "none", [*PATCH, "--site", "L0.block_out", "--pos", "value",
                                                  "--verify-top", "2"], 2,
     "--verify-top K needs --method atp or atp-star and K >= 0"),
    ("sweep-with-an-empty-grid", "sweep_empty_grid", ["sweep", "{tmp}/s.toml", "--dry-run"], 2, "[grid] is empty"),
]

#: path patching (patch --sender/--receiver/--via): a path the model lacks, or flags that do not go together
ROWS_PATHS = [
    ("path-kind-the-mixer-lacks", "none", [*PATCH, "--sender", "L0.mixer.q@key", "--receiver", "L0.mixer.q@query",
                                            "--via", "state"], 2,
     "path kind 'state' does not exist for mixer 'attention' (layer 0): it has no state hooks"),
    ("path-without-via", "none", [*PATCH, "--sender", "L0.block_out@key", "--receiver", "L1.block_in@key"], 2,
     "a path patch needs --sender SITE@POS, --receiver SITE@POS and --via; missing --via"),
    ("path-and-site", "none", [*PATCH, "--site", "L1.block_in", "--sender", "L0.block_out@key", "--receiver",
                               "L1.block_in@key", "--via", "resid"], 2, "give one or the other"),
    ("path-endpoint-without-position", "none", [*PATCH, "--sender", "L0.block_out", "--receiver", "L1.block_in@key",
                                                 "--via", "resid"], 2, "sender 'L0.block_out' must be SITE@POS"),
    ("path-with-atp", "none", [*PATCH, "--sender", "L0.block_out@key", "--receiver", "L1.block_in@key", "--via",
                               "resid", "--method", "atp"], 2, "a path patch is exact denoising"),
    ("path-unknown-via", "none", [*PATCH, "--sender", "L0.block_out@key", "--receiver", "L1.block_in@key", "--via",
                                  "sideways"], 2, "'sideways' is not one of"),
    ("path-resid-to-another-position", "none", [*PATCH, "--sender", "L0.block_out@key", "--receiver",
                                                 "L1.block_in@value", "--via", "resid"], 2,
     "a resid path carries a position's value to the same position only"),
    ("path-receiver-before-sender", "none", [*PATCH, "--sender", "L1.mixer.z@key", "--receiver", "L0.mixer.q@query",
                                              "--via", "head"], 2, "must be in a later layer than the sender"),
    ("patch-without-site-or-path", "none", [*PATCH, "--pos", "value"], 2, "missing --site"),
]

#: run folders, sweeps and reports: refused before anything is trained or drawn
ROWS_RUNS = [
    ("train-into-a-locked-run-folder", "locked-run", [*TRAIN_SMALL, "-o", "{tmp}/r"], 1, "/r is in use by process"),
    ("sweep-into-a-locked-runs-folder", "locked-runs", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 1,
     "/runs is in use by process"),
    ("sweep-mech-unknown-site", "sweep-mech-site", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2, "L9.block_in"),
    ("sweep-dry-run-mech-unknown-site", "sweep-mech-site", ["sweep", "{tmp}/s.toml", "--dry-run"], 2, "L9.block_in"),
    ("sweep-mech-unknown-position", "sweep-mech-position", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     "unknown position 'nosuchrole'"),
    ("sweep-mech-every-off-the-evaluations", "sweep-mech-every", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     "[mech] every 3 must be a multiple of eval_every 2"),
    ("sweep-mech-n-not-a-number", "sweep-mech-n", ["sweep", "{tmp}/s.toml", "-o", "{tmp}/runs"], 2,
     "[mech] n must be an integer >= 1"),
    ("report-unknown-run", "runs-with-results", ["report", "{tmp}/runs", "--run", "nosuchrun", "-o", "{tmp}/R"], 2,
     "unknown run 'nosuchrun'"),
    ("report-into-a-folder-that-is-not-a-report", "runs-with-results",
     ["report", "{tmp}/runs", "--no-heatmaps", "-o", "{tmp}/runs/notes"], 2, "is not a report folder (it holds a.txt)"),
]

VIEW = ["view", "--ckpt", "{ckpt}", "--n", "4"]

#: hookmech view: what to show, options of the other kind of page, outputs, examples
ROWS_VIEW = [
    ("view-neither-runs-nor-ckpt", "none", ["view", "-o", "{tmp}/p.html"], 2,
     "give a sweep folder RUNS_DIR, a patch --json file or --ckpt CKPT"),
    ("view-both-runs-and-ckpt", "runs-with-results", ["view", "{tmp}/runs", "--ckpt", "{ckpt}", "-o", "{tmp}/p.html"],
     2, "give a sweep folder RUNS_DIR, a patch --json file or --ckpt CKPT"),
    ("view-runs-missing", "none", ["view", "{tmp}/nosuch", "-o", "{tmp}/p.html"], 2, "does not exist"),
    ("view-runs-without-results", "none", ["view", "{tmp}", "-o", "{tmp}/p.html"], 1, "results.csv does not exist"),
    ("view-cache-with-runs", "runs-with-results", ["view", "{tmp}/runs", "--cache", "{tmp}/c.h5", "-o", "{tmp}/p.html"],
     2, "--cache belongs to checkpoint (--ckpt) pages; drop it"),
    ("view-run-with-ckpt", "none", [*VIEW, "--run", "a", "-o", "{tmp}/p.html"], 2,
     "--run belongs to sweep-folder (RUNS_DIR) pages; drop it"),
    ("view-unknown-run", "runs-with-results", ["view", "{tmp}/runs", "--run", "nosuchrun", "-o", "{tmp}/p.html"], 2,
     "unknown run 'nosuchrun'"),
    ("view-unknown-site", "none", [*VIEW, "--site", "L9.block_in", "-o", "{tmp}/p.html"], 2, "L9.block_in"),
    ("view-unknown-position", "none", [*VIEW, "--pos", "nosuchrole", "-o", "{tmp}/p.html"], 2,
     "unknown position 'nosuchrole'"),
    ("view-n-zero", "none", ["view", "--ckpt", "{ckpt}", "--n", "0", "-o", "{tmp}/p.html"], 2, "--n must be >= 1, got 0"),
    ("view-maps-zero", "none", [*VIEW, "--maps", "0", "-o", "{tmp}/p.html"], 2, "--maps must be >= 1"),
    ("view-cache-and-n", "cache", ["view", "--ckpt", "{ckpt}", "--cache", "{tmp}/c.h5", "--n", "4", "-o", "{tmp}/p.html"],
     2, "--cache gives the examples; drop --n and --seed"),
    ("view-cache-of-another-model", "cache of mamba",
     ["view", "--ckpt", "{ckpt}", "--cache", "{tmp}/mamba.h5", "-o", "{tmp}/p.html"], 1, "was made from another model than"),
    ("view-out-is-ckpt", "checkpoint copy", ["view", "--ckpt", "{tmp}/m.safetensors", "--n", "4", "-o", "{tmp}/m.safetensors"],
     2, "which is the input --ckpt"),
    ("view-out-is-results", "runs-with-results", ["view", "{tmp}/runs", "-o", "{tmp}/runs/results.csv"], 2,
     "which is the input RUNS_DIR"),
    ("view-out-is-a-folder", "none", [*VIEW, "-o", "{tmp}"], 2, "is a folder; give the page's file name"),
]

DAS = ["das", "--ckpt", "{ckpt}", "--cache", "{tmp}/c.h5", "--site", "L1.block_in", "--pos", "value", "--steps", "2"]

#: distributed alignment search: refused before anything is trained
ROWS_DAS = [
    ("das-without-dim-or-boundless", "cache", [*DAS, "-o", "{tmp}/d"], 2, "give the subspace dimensions to learn"),
    ("das-dim-and-boundless", "cache", [*DAS, "--dim", "1", "--boundless", "-o", "{tmp}/d"], 2, "not both"),
    ("das-dim-not-an-integer", "cache", [*DAS, "--dim", "1,two", "-o", "{tmp}/d"], 2,
     "--dim takes integers (subspace dimensions), got 'two'"),
    ("das-dim-wider-than-the-site", "cache", [*DAS, "--dim", "65", "-o", "{tmp}/d"], 2,
     "L1.block_in is 64-dimensional at a position, so 1 <= K <= 64"),
    ("das-dim-zero", "cache", [*DAS, "--dim", "0", "-o", "{tmp}/d"], 2, "an integer >= 1, got 0"),
    ("das-at-all-positions", "cache", [*DAS[:-4], "--pos", "all", "--dim", "1", "-o", "{tmp}/d"], 2,
     "one position per row, not 'all'"),
    ("das-unknown-position", "cache", [*DAS[:-4], "--pos", "nosuchrole", "--dim", "1", "-o", "{tmp}/d"], 2,
     "unknown position 'nosuchrole'"),
    ("das-site-pattern", "cache", [*DAS[:5], "--site", "L*.block_in", "--pos", "value", "--dim", "1", "-o", "{tmp}/d"],
     2, "names 2 sites; DAS learns a subspace of one site at a time"),
    ("das-site-not-cached", "cache",
     [*DAS[:5], "--site", "L0.block_in", "--pos", "value", "--dim", "1", "-o", "{tmp}/d"], 2,
     "no clean activations for site 'L0.block_in'"),
    ("das-zero-steps", "cache", [*DAS[:-1], "0", "--dim", "1", "-o", "{tmp}/d"], 2, "steps must be >= 1, got 0"),
    ("das-negative-lr", "cache", [*DAS, "--dim", "1", "--lr", "-1", "-o", "{tmp}/d"], 2,
     "learning rate must be a positive number, got -1.0"),
    ("das-out-is-a-file", "cache", [*DAS, "--dim", "1", "-o", "{tmp}/c.h5"], 2, "is a file; das writes a folder"),
    ("das-cache-of-another-model", "cache of mamba",
     [*DAS[:4], "{tmp}/mamba.h5", *DAS[5:], "--dim", "1", "-o", "{tmp}/d"], 1, "was made from another model than"),
]

ALL_ROWS = ROWS_USAGE + ROWS_MESSAGES + ROWS_PATHS + ROWS_RUNS + ROWS_FILES + ROWS_VIEW + ROWS_DAS


def _expand(argv: list[str], tmp: Path) -> list[str]:
    return [arg.replace("{tmp}", str(tmp)).replace("{tmpname}", tmp.name).replace("{ckpt}", str(FIXTURE)) for arg in argv]


@pytest.mark.parametrize(("setup", "argv", "code", "message"), [row[1:] for row in ALL_ROWS],
                         ids=[row[0] for row in ALL_ROWS])
def test_bad_input_is_one_line_and_an_exit_code(setup, argv, code, message, tmp_path, capsys):
    SETUPS[setup](tmp_path)
    got_code, _, err = run_cli(_expand(argv, tmp_path), capsys)
    lines = err.strip().splitlines()
    assert got_code == code, err
    assert len(lines) == 1, err
    assert lines[0].startswith("hookmech: error: "), err
    assert message in lines[0], err
    assert "Traceback" not in err and "unexpected" not in err, err


def test_every_row_has_a_unique_id():
    ids = [row[0] for row in ALL_ROWS]
    assert ids and len(ids) == len(set(ids))


@pytest.mark.parametrize(("error", "words"), [
    (PermissionError(13, "Permission denied", "/ro/d.h5"), "/ro/d.h5: Permission denied"),
    (FileNotFoundError(2, "No such file or directory", "/gone/d.h5"), "/gone/d.h5: No such file or directory"),
    (IsADirectoryError(21, "Is a directory", "/out/d.h5"), "/out/d.h5: Is a directory"),
    (NotADirectoryError(20, "Not a directory", "/file/d.h5"), "/file/d.h5: Not a directory"),
    (FileExistsError(17, "File exists", "/out"), "/out: File exists"),
    (OSError(28, "No space left on device", "/full/d.h5"), "/full/d.h5: No space left on device"),
    (OSError(28, "No space left on device"), "No space left on device"),
    (OSError(30, "Read-only file system", "/ro/d.h5"), "/ro/d.h5: Read-only file system"),
], ids=["permission", "not-found", "is-a-directory", "not-a-directory", "exists", "no-space", "no-space-no-name",
        "read-only"])
def test_os_errors_the_user_can_fix_are_one_plain_line(error, words, monkeypatch, capsys):
    """Writing an output the system refuses (root runs these tests, so the refusal is simulated)."""
    import hookmech.datasets

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(hookmech.datasets, "save_dataset", refuse)
    code, _, err = run_cli(["data", "ar", "--n", "4", "-o", "/ro/d.h5"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0] == f"hookmech: error: {words}", err


def test_other_os_errors_are_still_unexpected(monkeypatch, capsys):
    import hookmech.datasets

    def fail(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(hookmech.datasets, "save_dataset", fail)
    code, _, err = run_cli(["data", "ar", "--n", "4", "-o", "/x/d.h5"], capsys)
    assert code == 1 and "unexpected" in err and len(err.strip().splitlines()) == 1, err


def test_full_disk_in_the_cache_command_is_one_line(tmp_path, monkeypatch, capsys):
    fail_cache_write_on_call(monkeypatch, 5, OSError(errno.ENOSPC, "No space left on device"))
    out = tmp_path / "c.h5"
    code, _, err = run_cli(["cache", "--ckpt", str(FIXTURE), "--n", "40", "-o", str(out)], capsys)
    assert code == 1
    assert err.strip().splitlines() == [f"hookmech: error: no space left on device writing {out}"]
    assert list(tmp_path.iterdir()) == []


def test_running_out_of_memory_is_one_line_naming_what_to_reduce(monkeypatch, capsys):
    """A size the user asked for that does not fit (e.g. --n-dev 100000000) is their input, not a bug."""
    import hookmech.datasets

    def fail(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(hookmech.datasets, "save_dataset", fail)
    code, _, err = run_cli(["data", "ar", "--n", "4", "-o", "/x/d.h5"], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "out of memory" in err and "--n-dev" in err and "unexpected" not in err, err
