"""Shared test fixtures: small random models and tasks (fast), and the bundled trained fixture."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hookmech

from helpers import make_model

# One torch thread: the tests run many tiny forwards, where threads only contend (on a loaded
# 2-core machine the suite ran 10x slower with torch's default).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
ATTENTION_FIXTURE = REPO / "fixtures" / "attention_ar.safetensors"


@pytest.fixture(autouse=True)
def _deterministic_threads():
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
    if not ATTENTION_FIXTURE.exists():
        pytest.skip("fixture checkpoint missing")
    return ATTENTION_FIXTURE, hookmech.load(ATTENTION_FIXTURE), hookmech.tasks.from_checkpoint(ATTENTION_FIXTURE)
