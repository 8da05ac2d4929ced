"""Checkpoints: bit-exact round trip, task spec in metadata, bad files refused without unpickling."""
from __future__ import annotations

import pickle

import pytest
import torch

import hookmech
from hookmech.errors import HookmechError


def test_round_trip_is_bit_exact(tmp_path, ar_model, ar_task):
    path = hookmech.save(ar_model, tmp_path / "m.safetensors", task_spec=ar_task.spec)
    loaded = hookmech.load(path)
    assert loaded.cfg == ar_model.cfg
    for (name, a), (_, b) in zip(ar_model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    tokens = ar_task.sample(3, seed=0).tokens
    assert torch.equal(ar_model(tokens), loaded(tokens))
    assert hookmech.tasks.from_checkpoint(path).spec == ar_task.spec


def test_untied_model_round_trip(tmp_path, ar_task):
    from helpers import make_model

    model = make_model(ar_task, tie_embeddings=False)
    loaded = hookmech.load(hookmech.save(model, tmp_path / "m.safetensors"))
    assert torch.equal(loaded.unembed.weight, model.unembed.weight)


def test_a_checkpoint_whose_header_length_starts_like_a_pickle_loads(tmp_path, ar_model, ar_task):
    """The 8-byte header length of a safetensors file can begin with 0x80 (pickle's PROTO) or
    with "PK": such a checkpoint is still a safetensors file and must load."""
    for padding in range(256):  # metadata padding moves the header length through every low byte
        path = hookmech.save(ar_model, tmp_path / "m.safetensors", task_spec={**ar_task.spec, "pad": "x" * padding})
        if path.read_bytes()[:1] == b"\x80":
            break
    else:
        pytest.fail("no padding gave a header length starting with 0x80")
    loaded = hookmech.load(path)
    assert all(torch.equal(a, b) for a, b in zip(ar_model.state_dict().values(), loaded.state_dict().values(),
                                                 strict=True))


class _Boom:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/hookmech_pickle_was_executed",))


def test_pickle_file_is_refused_and_never_executed(tmp_path):
    import os

    marker = "/tmp/hookmech_pickle_was_executed"
    if os.path.exists(marker):
        os.remove(marker)
    path = tmp_path / "evil.safetensors"
    path.write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(HookmechError, match="pickle"):
        hookmech.load(path)
    torch_path = tmp_path / "evil2.safetensors"
    torch.save({"x": _Boom()}, torch_path)
    with pytest.raises(HookmechError, match="pickle"):
        hookmech.load(torch_path)
    assert not os.path.exists(marker)


def test_pt_state_dict_goes_through_weights_only(tmp_path, ar_model):
    import os

    marker = "/tmp/hookmech_pickle_was_executed"
    evil = tmp_path / "evil.pt"
    torch.save({"x": _Boom()}, evil)
    with pytest.raises(HookmechError):
        hookmech.load(evil, config=ar_model.cfg)
    assert not os.path.exists(marker)
    good = tmp_path / "good.pt"
    torch.save(ar_model.state_dict(), good)
    (tmp_path / "cfg.json").write_text(ar_model.cfg.to_json())
    loaded = hookmech.load(good, config=tmp_path / "cfg.json")
    assert torch.equal(loaded.embed.weight, ar_model.embed.weight)
    with pytest.raises(HookmechError, match="config"):
        hookmech.load(good)


@pytest.mark.parametrize("content", [b"", b"junk" * 10, b"\xff" * 100])
def test_junk_files_are_refused(tmp_path, content):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(content)
    with pytest.raises(HookmechError):
        hookmech.load(path)


def test_truncated_checkpoint_is_refused(tmp_path, ar_model):
    path = hookmech.save(ar_model, tmp_path / "m.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(HookmechError):
        hookmech.load(path)


def test_safetensors_without_hookmech_metadata_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(HookmechError, match="hookmech"):
        hookmech.load(path)


def test_failed_save_leaves_the_previous_file(tmp_path, ar_model, monkeypatch):
    path = hookmech.save(ar_model, tmp_path / "m.safetensors")
    before = path.read_bytes()
    import hookmech.checkpoint as checkpoint

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(OSError):
        hookmech.save(ar_model, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
