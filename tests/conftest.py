"""Shared test fixtures: small random models and tasks (fast), the bundled trained fixture, and
processes holding folder locks. Shared helpers (tolerances, assertions) are in helpers.py.

Where a test lives: tests/mixers/ one file per mixer, tests/tasks/ one per task, tests/cli/ every
test whose subject is the command line (what a command prints, writes or exits with, and the
options it passes on to the library). A test that runs a command only as the way in to a library
behaviour it checks (a folder lock, a report folder written whole, a sweep checked before it
trains, an HDF5 file closed after a failed write) stays with that behaviour's tests. The other
files are one per library module or topic."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from runtime_typecheck import install_import_hook

# Every function of hookmech is type- and shape-checked at each call in the tests (users pay
# nothing: only the suite installs this). jaxtyping's import hook instruments a module as it is
# imported, so it must come before anything imports hookmech: this conftest is the first
# to (pytest loads it before collecting any test module; no plugin of ours imports hookmech).
# tests/runtime_typecheck.py says what is checked, and why not with "typeguard.typechecked".
if "hookmech" in sys.modules:
    raise pytest.UsageError("hookmech was imported before tests/conftest.py installed the type-checking import hook")
install_import_hook("hookmech")

# after the import hook (both import hookmech)
from helpers import ATTENTION_FIXTURE, make_model
from lock_holder import start_lock_holder, stop_lock_holder

import hookmech

# One torch thread by default: the tests run many tiny forwards, where threads only contend (on a
# loaded 2-core machine the suite ran 10x slower with torch's default). HOOKMECH_TEST_THREADS=N
# runs the suite with N threads: no result may depend on it (reductions may change order, which
# the tolerances of helpers.py cover).
_threads = os.environ.get("HOOKMECH_TEST_THREADS", "1")
if not _threads.isdigit() or int(_threads) < 1:
    raise pytest.UsageError(f"HOOKMECH_TEST_THREADS must be an integer >= 1, got {_threads!r}")
TEST_THREADS = int(_threads)
torch.set_num_threads(TEST_THREADS)


def pytest_report_header(config):
    return f"torch threads: {TEST_THREADS} (HOOKMECH_TEST_THREADS)"


@pytest.fixture(autouse=True)
def _deterministic_threads():
    if torch.get_num_threads() != TEST_THREADS:  # a test that pins threads (a sweep, --threads 1) left it behind
        torch.set_num_threads(TEST_THREADS)
    torch.manual_seed(0)
    yield


@pytest.fixture
def ar_task():
    return hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)


@pytest.fixture
def ar_model(ar_task):
    return make_model(ar_task)


@pytest.fixture(scope="session")
def trained_attention():
    """The bundled trained attention AR checkpoint: (path, model, task)."""
    assert ATTENTION_FIXTURE.exists(), f"the bundled fixture {ATTENTION_FIXTURE} is missing"
    return ATTENTION_FIXTURE, hookmech.load(ATTENTION_FIXTURE), hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)


@pytest.fixture
def holder():
    """Start processes holding folder locks; stop them after the test."""
    started = []

    def start(folder):
        started.append(start_lock_holder(folder))
        return started[-1]

    yield start
    for process in started:
        stop_lock_holder(process)
