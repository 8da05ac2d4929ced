"""Library errors name what was given and what is wrong (the CLI's cases are in tests/cli/test_errors.py)."""
from __future__ import annotations

import math

import pytest
import torch

import hookmech
from hookmech.cache import write_cache
from hookmech.errors import HookmechError, UsageError
from hookmech.patching import attribution_patch, parse_sites, patch
from hookmech.sites import position_patches, resolve_sites

from helpers import make_model


def test_a_bare_string_is_one_site_and_one_position(ar_model, ar_task):
    batch = ar_task.sample(6, seed=1)
    one = patch(ar_model, batch, "L1.block_in", "key+value")
    listed = patch(ar_model, batch, ["L1.block_in"], ["key+value"])
    assert [(r["site"], r["pos"], r["p_patched"]) for r in one] == [(r["site"], r["pos"], r["p_patched"]) for r in listed]
    estimated = attribution_patch(ar_model, batch, "L1.block_in", "value")
    assert [(r["site"], r["pos"]) for r in estimated] == [("L1.block_in", "value")]
    assert resolve_sites("L1.block_in", ar_model.hook_dict) == ["blocks.1.hook_resid_pre"]
    assert [p.label for p in position_patches("key", batch.roles, batch.lengths, batch.tokens.shape[1])] == ["key"]
    assert [s.site for s in parse_sites("L0.block_out+L1.mixer_in", ar_model)] == ["L0.block_out+L1.mixer_in"]


@pytest.mark.parametrize("method", ["exact", "atp"])
def test_a_batch_of_another_vocabulary_names_the_token_and_d_vocab(ar_model, method):
    wider = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=3)  # same length, d_vocab 67 > 19
    batch = wider.sample(6, seed=2)
    biggest = int(torch.cat([batch.tokens.flatten(), batch.corrupt_tokens.flatten(), batch.answers]).max())
    assert biggest >= ar_model.cfg.d_vocab
    with pytest.raises(HookmechError, match=rf"token id {biggest} .*d_vocab {ar_model.cfg.d_vocab}"):
        patch(ar_model, batch, ["L1.block_in"], ["value"], method=method)


def test_caching_a_batch_of_another_vocabulary_names_the_token(ar_model, tmp_path):
    batch = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=3).sample(6, seed=2)
    with pytest.raises(HookmechError, match=rf"d_vocab {ar_model.cfg.d_vocab}"):
        write_cache(ar_model, batch, tmp_path / "c.h5", ["blocks.1.hook_resid_pre"])
    assert not (tmp_path / "c.h5").exists()


@pytest.mark.parametrize("method", ["exact", "atp"])
@pytest.mark.parametrize("site", ["L1.block_in", "L1.mixer.z"])
def test_a_cache_of_another_width_names_the_shapes(ar_task, tmp_path, method, site):
    narrow, wide = make_model(ar_task, d_model=16), make_model(ar_task, d_model=32)
    batch = ar_task.sample(6, seed=3)
    hooks = resolve_sites(["L0.block_out", "L1.*", "L1.mixer.z"], narrow.hook_dict)
    write_cache(narrow, batch, tmp_path / "c.h5", hooks)
    if method == "atp" and "mixer." in site:
        site = "L1.mixer_out"
    with pytest.raises(HookmechError, match=r"c\.h5: cached L1\.\S+ has shape \[[\d, ]*16\] per row, this model.s \[[\d, ]*32\]: .*d_model 16 in the cache, 32 here"):
        patch(wide, tmp_path / "c.h5", [site], ["value"], method=method)
    # the model it was made from reads it
    assert patch(narrow, tmp_path / "c.h5", [site], ["value"], method=method)


@pytest.mark.parametrize("threshold", [math.nan, math.inf, -math.inf])
def test_a_threshold_must_be_finite(ar_model, ar_task, threshold):
    batch = ar_task.sample(4, seed=0)
    with pytest.raises(UsageError, match="threshold must be a finite number"):
        patch(ar_model, batch, ["L1.block_in"], ["value"], threshold=threshold)
    with pytest.raises(UsageError, match="threshold must be a finite number"):
        attribution_patch(ar_model, batch, ["L1.block_in"], ["value"], threshold=threshold)


def test_empty_parts_of_joint_sites_and_positions_are_named(ar_model, ar_task):
    batch = ar_task.sample(4, seed=0)
    for spec in ("L0.block_out+", "+L0.block_out", "L0.block_out++L1.block_in"):
        with pytest.raises(UsageError, match=rf"site '{spec.replace('+', '[+]')}' has an empty part"):
            parse_sites([spec], ar_model)
    for spec in ("value+", "+value", " + "):
        with pytest.raises(UsageError, match="has an empty part"):
            position_patches([spec], batch.roles, batch.lengths, batch.tokens.shape[1])


def test_a_mechanism_callback_refuses_a_non_finite_threshold_before_training(ar_task, ar_model):
    from hookmech.mech import mech_callback

    with pytest.raises(UsageError, match="threshold must be a finite number, got nan"):
        mech_callback(ar_task, ar_model.cfg, every=2, eval_every=2, total_steps=4, n=4, threshold=math.nan)
    on_eval = mech_callback(ar_task, ar_model.cfg, sites="L1.block_in", positions="value", every=2, eval_every=2,
                            total_steps=4, n=4)
    assert on_eval(1, ar_model) == {} and on_eval(4, ar_model)


def test_layer_options_of_another_length_than_the_layers_are_refused():
    from hookmech.config import build_config

    with pytest.raises(UsageError, match="got 1 sets of layer options for 2 layers"):
        build_config(d_vocab=8, n_ctx=8, mixers="attention", n_layers=2, layer_options=[{}])


@pytest.mark.parametrize(("kind", "sites", "positions", "value"), [
    ("position", ["L1.block_in"], [3], "3"),
    ("position", ["L1.block_in"], ["value", None], "None"),
    ("site", [1], ["value"], "1"),
])
def test_specs_that_are_not_strings_name_the_value_and_what_is_accepted(ar_model, ar_task, kind, sites, positions,
                                                                         value):
    """An integer position used to raise AttributeError ('int' object has no attribute 'strip')."""
    with pytest.raises(UsageError, match=rf"{kind} {value} is a \w+, not a string: {kind}s are strings"):
        patch(ar_model, ar_task.sample(4, seed=0), sites, positions)


@pytest.mark.parametrize("position", ["9999999999999999999999", "-9999999999999999999999"])
def test_a_position_past_any_int64_is_outside_the_rows(ar_model, ar_task, position):
    """It used to overflow building the positions (OverflowError)."""
    with pytest.raises(UsageError, match=rf"position {position} is outside some rows"):
        patch(ar_model, ar_task.sample(4, seed=0), ["L1.block_in"], [position])
