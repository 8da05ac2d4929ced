"""A Batch subclass's fields are rows like the base fields: `select` and `to` carry them in the
same step, and a dataset file missing one is refused by name."""
from __future__ import annotations

import h5py
import pytest
import torch

import hookmech
from hookmech.datasets import load_dataset, save_dataset
from hookmech.errors import HookmechError


@pytest.fixture
def atr():
    task = hookmech.tasks.make("atr")
    return task, task.sample(6, seed=0)


def test_select_picks_the_rows_of_every_field(atr):
    _, batch = atr
    index = torch.tensor([4, 0, 2])
    part = batch.select(index)
    assert type(part) is type(batch)
    for name in ("tokens", "corrupt_tokens", "answers", "lengths", "doc_index", "parent_pos"):
        assert torch.equal(getattr(part, name), getattr(batch, name)[index]), name
    assert all(torch.equal(part.roles[role], batch.roles[role][index]) for role in batch.roles)
    assert torch.equal(batch.to("cpu").parent_pos, batch.parent_pos)


def test_a_dataset_without_a_field_of_its_rows_is_refused(atr, tmp_path):
    task, batch = atr
    path = save_dataset(batch, task, tmp_path / "atr.h5")
    assert torch.equal(load_dataset(path)[1].parent_pos, batch.parent_pos)
    with h5py.File(path, "a") as h5:
        del h5["fields/parent_pos"]
    with pytest.raises(HookmechError, match=r"no fields \['parent_pos'\] of its TreeBatch rows"):
        load_dataset(path)
