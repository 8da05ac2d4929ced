"""Mechanistic evaluation during training: the on_eval callback and `train --mech-every`."""
from __future__ import annotations

import json

import pytest
import torch

import hookmech
from hookmech.config import build_config
from hookmech.errors import UsageError
from hookmech.mech import attribution_columns, mech_batch, mech_callback
from hookmech.patching import patch
from hookmech.training import TrainConfig, train


def setup():
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model_config = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=16, n_layers=2, tie_embeddings=False)
    config = TrainConfig(lr=3e-3, epochs=None, steps=12, n_train=0, n_dev=16, batch_size=8, eval_every=3,
                         ckpt_every=6)
    return task, model_config, config


def callback(task, model_config, config, every):
    return mech_callback(task, model_config, sites=["L1.block_in"], positions=["value", "query"], every=every,
                         eval_every=config.eval_every, total_steps=config.total_steps(), n=16, seed=0)


def test_callback_measures_on_multiples_of_every_and_the_last_step(ar_model):
    task, model_config, config = setup()
    on_eval = callback(task, model_config, config, every=6)
    model = hookmech.HookedLM(model_config)
    assert on_eval(3, model) == {} and on_eval(9, model) == {}
    measured = on_eval(6, model)
    assert set(measured) == {"attr:L1.block_in@value", "attr:L1.block_in@query", "mech_n", "mech_p_clean",
                             "mech_p_corrupt", "mech_passes"}
    assert set(on_eval(12, model)) == set(measured)  # the last step, not a multiple of 6*2


def test_callback_numbers_are_the_engines_on_the_fixed_batch():
    task, model_config, config = setup()
    model = hookmech.HookedLM(model_config).eval()
    measured = callback(task, model_config, config, every=3)(3, model)
    records = patch(model, mech_batch(task, 0, 16), ["L1.block_in"], ["value", "query"])
    assert len(records) == 2
    for record in records:  # the callback calls patch on this batch with the defaults: the same computation, exact
        assert measured[f"attr:L1.block_in@{record['pos']}"] == record["attribution"]
    assert measured["mech_p_clean"] == records[0]["p_clean"]
    assert measured["mech_passes"] == (records[0]["p_clean"] - records[0]["p_corrupt"] > 0.01)


def test_attribution_columns_by_hand():
    records = [{"site": "L1.block_in", "pos": "value", "attribution": 0.75, "n": 4, "p_clean": 0.9,
                "p_corrupt": 0.1, "passes_filter": True},
               {"site": "L0.mixer_out", "pos": "query", "attribution": None, "n": 4, "p_clean": 0.9,
                "p_corrupt": 0.1, "passes_filter": True}]
    assert attribution_columns(records) == {"mech_n": 4, "mech_p_clean": 0.9, "mech_p_corrupt": 0.1,
                                            "mech_passes": True, "attr:L1.block_in@value": 0.75,
                                            "attr:L0.mixer_out@query": None}


def test_training_with_the_callback_logs_attributions_and_learns_the_same_weights(tmp_path):
    task, model_config, config = setup()
    train(task, model_config, config, tmp_path / "plain", progress=False)
    train(task, model_config, config, tmp_path / "mech", progress=False,
          on_eval=callback(task, model_config, config, every=6))
    lines = [json.loads(line) for line in (tmp_path / "mech" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "attr:L1.block_in@value" in line] == [6, 12]
    assert [line["step"] for line in lines] == [3, 6, 9, 12]
    plain = hookmech.load(tmp_path / "plain" / "model.safetensors").state_dict()
    mech = hookmech.load(tmp_path / "mech" / "model.safetensors").state_dict()
    assert plain and plain.keys() == mech.keys()
    assert all(torch.equal(plain[name], mech[name]) for name in plain)


def test_bad_mech_options_fail_before_training():
    task, model_config, config = setup()
    with pytest.raises(UsageError, match="multiple of --eval-every"):
        callback(task, model_config, config, every=4)
    with pytest.raises(UsageError, match="site"):
        mech_callback(task, model_config, sites=["L7.block_in"], positions=["value"], every=3, eval_every=3,
                      total_steps=12)
    with pytest.raises(UsageError):
        mech_callback(task, model_config, sites=["L1.block_in"], positions=["nowhere"], every=3, eval_every=3,
                      total_steps=12)
