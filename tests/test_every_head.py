"""Every-head sites (``L1.mixer.q[*]``) on every mixer with a head axis: the number of heads
comes from the hook's declared axis sizes, as the mixer's spec states them (`MixerSpec.heads`),
whatever the mixer calls its option."""
from __future__ import annotations

import pytest

from hookmech.mixers import REGISTRY, SPECS
from hookmech.patching import n_heads_of, patch
from hookmech.oracles import plain_loop_patch

from helpers import ENGINE_TOL, make_model, mixers_with_heads

KEYS = ("p_clean", "p_corrupt", "p_patched", "metric_clean", "metric_corrupt", "metric_patched")


def head_hooks(model, layer: int) -> list[str]:
    """The hooks of block `layer`'s mixer that have a head axis and a position axis."""
    return [name for name, point in model.hook_dict.items()
            if name.startswith(f"blocks.{layer}.mixer.") and "head" in getattr(point, "axes", "").split()
            and getattr(point, "pos_axis", 1) is not None]


def two_head_model(task, mixer: str):
    """A d_model-16 model of `mixer` with two heads: the options its spec says give them (the
    head count through ``n_heads`` where the mixer takes one, as ``--n-heads`` gives it)."""
    options = SPECS[mixer].with_heads(2, 16) if SPECS[mixer].heads is not None else {}
    count = SPECS[mixer].head_count_option()
    options = {key: value for key, value in options.items() if key != count}
    return make_model(task, mixers=mixer, d_model=16, n_heads=2, layer_options=[options] * 2)


MIXERS_WITH_HEADS = mixers_with_heads()


def test_the_mixers_with_a_head_axis_are_those_whose_spec_states_heads():
    from hookmech.tasks import make

    task = make("ar", vocab_size=16, num_kv_pairs=3)
    assert {name for name in REGISTRY if head_hooks(two_head_model(task, name), 1)} == set(MIXERS_WITH_HEADS)


@pytest.mark.parametrize("mixer", MIXERS_WITH_HEADS)
def test_declared_head_counts_are_the_activations(ar_task, mixer):
    model = two_head_model(ar_task, mixer)
    batch = ar_task.sample(2, seed=1)
    hooks = [name for name, point in model.hook_dict.items() if "head" in getattr(point, "axes", "").split()]
    _, cache = model.run_with_cache(batch.tokens, return_cache_object=False)
    cached = [hook for hook in hooks if hook in cache]
    assert cached, hooks
    for hook in cached:
        axes = model.hook_dict[hook].axes.split()
        assert n_heads_of(model, hook) == cache[hook].shape[axes.index("head")] == 2, hook


@pytest.mark.parametrize("mixer", MIXERS_WITH_HEADS)
def test_every_head_site_equals_each_head_and_the_plain_loop(ar_task, mixer):
    model = two_head_model(ar_task, mixer)
    batch = ar_task.sample(4, seed=3)
    hooks = head_hooks(model, 1)
    assert hooks
    every = patch(model, batch, [f"{hook}[*]" for hook in hooks], ["key+value"], max_batch=3)
    assert [r["hook"] for r in every] == [f"{hook}[{head}]" for hook in hooks for head in (0, 1)]
    single = patch(model, batch, [f"{r['hook']}" for r in every], ["key+value"], max_batch=3)
    reference = plain_loop_patch(model, batch, [f"{hook}[*]" for hook in hooks], ["key+value"])
    assert len(single) == len(every) == len(reference)
    for record, alone in zip(every, single, strict=True):
        expected = reference[record["hook"], record["pos"]]
        for key in KEYS:
            # every head in one call vs each head alone: two engine batchings (ENGINE_TOL)
            assert record[key] == pytest.approx(alone[key], abs=ENGINE_TOL), (record["site"], key)
            assert abs(record[key] - expected[key]) <= ENGINE_TOL, (record["site"], key, record[key], expected[key])
