"""Path patching (`hookmech.patching.path_patch`): every route against the two-pass reference of
hookmech/oracles/path_patching.py for every mixer where the route exists, the invariants that tie a path to
node patching or to the clean run, and the errors for paths a model does not have."""

from __future__ import annotations

import pytest
import torch
from helpers import CACHE_TOL, ENGINE_TOL, head_options, make_model, unit_variance

from hookmech.errors import UsageError
from hookmech.mixers import REGISTRY, SPECS, PathRoutes
from hookmech.patching import patch, path_patch
from hookmech.oracles.state_loops import STATE_LOOPS
from hookmech.oracles import path_patch_reference

KEYS = ("p_clean", "p_corrupt", "p_patched", "metric_clean", "metric_corrupt", "metric_patched")


def model_of(task, mixers, options=None, n_layers=2, **overrides):
    """A unit-variance random model (d_model 16) of `mixers` with the same `options` in every layer
    (or one dict per layer)."""
    per_layer = options if isinstance(options, list) else [dict(options or {}) for _ in range(n_layers)]
    return unit_variance(
        make_model(task, mixers=mixers, d_model=16, n_layers=n_layers, layer_options=per_layer, **overrides)
    )


#: (id, mixers, options, sender, receiver, via); AR with 3 pairs: BOS k v k v k v DIV q (9 tokens)
CASES = [
    # the residual stream is the backbone's: every mixer (BaseConv's layer 0 long, or the key never reaches the query)
    *[
        (
            f"resid-{name}",
            name,
            [{"kernel_size": -1}, {}] if name == "baseconv" else {},
            "L0.mixer_out@whole",
            "L1.block_in@whole",
            "resid",
        )
        for name in sorted(REGISTRY)
    ],
    ("resid-skipping-a-block", "mamba", {}, "L0.block_in@key", "L1.block_in@key+value", "resid"),
    (
        "resid-sublayer-to-a-later-block",
        "attention",
        {"n_heads": 2},
        "L0.mixer_out@key+value",
        "L2.block_in@whole",
        "resid",
    ),
    ("head-attention", "attention", {"n_heads": 2}, "L0.mixer.z[1]@key", "L1.mixer.k[0]@whole", "head"),
    (
        "head-attention-q-conv",
        "attention",
        {"n_heads": 2, "qkv_conv": "q"},
        "L0.mixer.z[0]@divider",
        "L1.mixer.q@query",
        "head",
    ),
    (
        "head-attention-to-h3",
        ["attention", "h3"],
        [{"n_heads": 2}, {}],
        "L0.mixer.z[0]@key",
        "L1.mixer.v@whole",
        "head",
    ),
    (
        "head-based",
        "based",
        {"num_heads": 2, "num_key_value_heads": 2, "feature_dim": 4},
        "L0.mixer.y[0]@key",
        "L1.mixer.v[1]@whole",
        "head",
    ),
    ("head-deltanet", "deltanet", {"num_heads": 2}, "L0.mixer.y[1]@key", "L1.mixer.k@whole", "head"),
    ("head-rwkv", "rwkv", {"head_size": 8}, "L0.mixer.output[0]@key", "L1.mixer.k@whole", "head"),
    ("head-mamba2", "mamba2", {"headdim": 8}, "L0.mixer.y[2]@key", "L1.mixer.conv_act[0]@whole", "head"),
    ("state-mamba", "mamba", {}, "L0.mixer.ssm_state@key", "L0.mixer.ssm_state@query", "state"),
    ("state-mamba-layer-1", "mamba", {}, "L1.mixer.ssm_state@key+value", "L1.mixer.ssm_state@whole", "state"),
    ("state-mamba2", "mamba2", {"chunk_size": 4}, "L1.mixer.ssm_state@key+value", "L1.mixer.ssm_state@whole", "state"),
    (
        "state-deltanet",
        "deltanet",
        {"num_heads": 2, "chunk_size": 4},
        "L1.mixer.state@key+value",
        "L1.mixer.state@whole",
        "state",
    ),
    ("state-rwkv", "rwkv", {"chunk_size": 4}, "L0.mixer.state@key", "L0.mixer.state@whole", "state"),
    ("state-based", "based", {"feature_dim": 4}, "L0.mixer.kv_state@key", "L0.mixer.k_state@whole", "state"),
    (
        "state-based-linear",
        "based",
        {"train_view": "linear", "chunk_size": 4, "feature_dim": 4},
        "L1.mixer.kv_state@key+value",
        "L1.mixer.kv_state@query",
        "state",
    ),
    ("conv-mamba", "mamba", {}, "L0.mixer.in_x@key", "L0.mixer.conv@value", "conv"),
    ("conv-mamba-layer-1", "mamba", {"d_conv": 3}, "L1.mixer.conv@key+value", "L1.mixer.conv@whole", "conv"),
    ("conv-mamba2", "mamba2", {}, "L0.mixer.in_x@key", "L0.mixer.conv@value", "conv"),
    ("conv-baseconv", "baseconv", {"kernel_size": 3}, "L0.mixer.conv@key", "L0.mixer.conv@value", "conv"),
    ("conv-attention", "attention", {"n_heads": 2, "qkv_conv": "kv"}, "L0.mixer.k@key", "L0.mixer.k@value", "conv"),
    (
        "conv-attention-one-head",
        "attention",
        {"n_heads": 2, "qkv_conv": "v"},
        "L1.mixer.v@key",
        "L1.mixer.v[1]@whole",
        "conv",
    ),
    ("conv-deltanet", "deltanet", {}, "L0.mixer.k@key", "L0.mixer.k@value", "conv"),
    ("conv-hyena", "hyena", {}, "L0.mixer.short_conv@key", "L0.mixer.short_conv@value", "conv"),
]


def declared_routes(name: str) -> dict[str, bool]:
    """Which routes mixer `name` declares: resid always, the others where it has `PathRoutes`."""
    cls = REGISTRY[name]
    if not issubclass(cls, PathRoutes):
        return {"resid": True, "head": False, "state": False, "conv": False}
    return {
        "resid": True,
        "head": bool(cls.head_outputs and cls.head_inputs),
        "state": bool(cls.state_readout),
        "conv": bool(cls(d_model=16).conv_hooks()),
    }


def generated_case(name: str, via: str) -> tuple:
    """A case of route `via` for mixer `name` built from what it declares (a mixer added later than
    the cases above): heads from its spec, its first head output, head input, state hook, conv hook."""
    cls = REGISTRY[name]
    if via == "head":  # the sender at every position: a head input such as q is read at its own position only
        return (f"head-{name}", name, head_options(name), f"L0.mixer.{cls.head_outputs[0]}[0]@whole",
                f"L1.mixer.{cls.head_inputs[0]}@whole", "head")
    if via == "state":
        state = cls.state_hooks[0]
        return (f"state-{name}", name, {}, f"L1.mixer.{state}@key+value", f"L1.mixer.{state}@whole", "state")
    receiver = next(iter(cls(d_model=16).conv_hooks()))
    return (f"conv-{name}", name, {}, f"L0.mixer.{receiver}@key", f"L0.mixer.{receiver}@value", "conv")


def covered_routes(cases) -> set[tuple[str, str]]:
    """(route, mixer) pairs the `cases` test."""
    return {(case[5], name) for case in cases for name in ([case[1]] if isinstance(case[1], str) else case[1])}


# every route a registered mixer declares that the cases above do not test (a mixer's spec is all it needs)
CASES += [
    generated_case(name, via)
    for name in sorted(REGISTRY)
    for via, declared in declared_routes(name).items()
    if declared and (via, name) not in covered_routes(CASES)
]


@pytest.mark.parametrize(
    ("mixers", "options", "sender", "receiver", "via"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_path_patch_equals_the_two_pass_reference(ar_task, mixers, options, sender, receiver, via):
    n_layers = 3 if receiver.startswith("L2") else 2
    model = model_of(ar_task, mixers, options, n_layers=n_layers)
    batch = ar_task.sample(6, seed=2)
    records = path_patch(model, batch, sender, receiver, via, max_batch=5)
    reference = path_patch_reference(model, batch, sender, receiver, via)
    assert len(records) == len(reference) > 0
    for record in records:
        expected = reference[record["sender"], record["receiver"]]
        for key in KEYS:  # contract: engine vs plain reference, ENGINE_TOL
            assert abs(record[key] - expected[key]) <= ENGINE_TOL, (record["sender"], record["receiver"], key)
    # the path carries something here, so a path the engine failed to apply would show
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in records) > 2 * ENGINE_TOL


def test_every_path_kind_has_a_case_for_every_mixer_that_has_it(ar_task):
    """The cases above cover, per route, every registered mixer that declares it."""
    covered = covered_routes(CASES)
    for name in REGISTRY:
        for via, exists in declared_routes(name).items():
            assert not exists or (via, name) in covered, (via, name)


def test_every_mixer_with_a_state_route_has_its_reference_loop():
    """The two-pass reference of a `state` route is the mixer's loop in hookmech.oracles.state_loops."""
    for name in SPECS:
        if declared_routes(name)["state"]:
            assert name in STATE_LOOPS, name


def test_path_patch_takes_a_metric_and_writes_rows(ar_task):
    model = model_of(ar_task, "mamba")
    batch = ar_task.sample(6, seed=2)
    records = path_patch(
        model, batch, "L0.mixer.ssm_state@key", "L0.mixer.ssm_state@query", "state", metric="kl", per_example=True
    )
    reference = path_patch_reference(
        model, batch, "L0.mixer.ssm_state@key", "L0.mixer.ssm_state@query", "state", metric="kl"
    )
    (record,) = records
    expected = reference[record["sender"], record["receiver"]]
    assert abs(record["metric_patched"] - expected["metric_patched"]) <= ENGINE_TOL
    assert (record["site"], record["hook"], record["pos"]) == ("L0.mixer.ssm_state", "blocks.0.mixer.hook_y", "query")
    assert len(record["p_patched_rows"]) == len(record["metric_patched_rows"]) == 6


def test_a_head_pattern_gives_one_record_per_head(ar_task):
    model = model_of(ar_task, "attention", {"n_heads": 2})
    batch = ar_task.sample(4, seed=2)
    records = path_patch(model, batch, "L0.mixer.z[*]@key", "L1.mixer.q@query", "head")
    assert [r["sender"] for r in records] == ["L0.mixer.z[0]@key", "L0.mixer.z[1]@key"]
    assert {r["via"] for r in records} == {"head"}


# -- invariants: a path that is a node patch, or that restores the clean run --------------------------
@pytest.mark.parametrize("mixer", ["attention", "mamba", "rwkv", "hyena"])
def test_resid_from_a_block_output_to_the_next_block_input_is_the_node_patch(ar_task, mixer):
    """No layer between: the receiver's new value is the corrupt one plus (clean − corrupt), the clean one."""
    model = model_of(ar_task, mixer)
    batch = ar_task.sample(6, seed=4)
    (path,) = path_patch(model, batch, "L0.block_out@key", "L1.block_in@key", "resid")
    (node,) = patch(model, batch, "L1.block_in", "key")
    assert abs(path["p_patched"] - node["p_patched"]) <= ENGINE_TOL  # two computations of one patch
    assert abs(path["p_patched"] - path["p_corrupt"]) > 2 * ENGINE_TOL


def test_resid_changes_add_up_over_a_blocks_residual_and_its_mixer(ar_task):
    """A Mamba block has no MLP: block_out = block_in + mixer_out, so the changes their resid paths
    make to the next block's input add up (the route is linear in the sender's change)."""
    model = model_of(ar_task, "mamba").double()
    batch = ar_task.sample(5, seed=4)
    _, clean = model.run_with_cache(batch.tokens)
    _, corrupt = model.run_with_cache(batch.corrupt_tokens)

    def acts(hook, which):
        return (clean if which == "clean" else corrupt)[hook]

    senders = batch.roles["key"][:, None] == torch.arange(batch.tokens.shape[1])
    changes = {
        site: model.path_change(model.path_ends("resid", site, "blocks.1.hook_resid_pre"), acts, senders)
        for site in ("blocks.0.hook_resid_pre", "blocks.0.hook_mixer_out", "blocks.0.hook_resid_post")
    }
    total = changes["blocks.0.hook_resid_pre"] + changes["blocks.0.hook_mixer_out"]
    torch.testing.assert_close(total, changes["blocks.0.hook_resid_post"], rtol=1e-12, atol=1e-12)
    assert changes["blocks.0.hook_mixer_out"].abs().max() > 0


def test_a_resid_path_reaches_its_own_position_only(ar_task):
    model = model_of(ar_task, "attention")
    batch = ar_task.sample(6, seed=4)
    (at_key,) = path_patch(model, batch, "L0.block_in@key", "L1.block_in@key", "resid")
    assert abs(at_key["p_patched"] - at_key["p_corrupt"]) > 2 * ENGINE_TOL
    # a pair whose positions never meet has no record (tests/test_rough_edges.py: left out with a note)
    with pytest.raises(UsageError, match="carries a position's value to the same position only"):
        path_patch(model, batch, "L0.block_in@key", "L1.block_in@query", "resid")


def test_a_head_path_in_one_head_attention_without_mlps_is_the_node_patch_of_the_receiver(ar_task):
    """With one head and no MLP, the head's change is the whole change of the next block's input;
    at the value position (the same token in both documents) that input becomes the clean one, so
    the receiver k there is the clean k, and nowhere else does it change."""
    model = model_of(ar_task, "attention", {"n_heads": 1}, mlp=False)
    batch = ar_task.sample(6, seed=5)
    (path,) = path_patch(model, batch, "L0.mixer.z[0]@value", "L1.mixer.k@whole", "head")
    (node,) = patch(model, batch, "L1.mixer.k", "value")
    assert abs(path["p_patched"] - node["p_patched"]) <= ENGINE_TOL
    assert abs(path["p_patched"] - path["p_corrupt"]) > 2 * ENGINE_TOL


@pytest.mark.parametrize("mixer", ["mamba", "mamba2"])
def test_a_conv_path_through_every_tap_is_the_node_patch_of_the_convolutions_input(ar_task, mixer):
    """in_x feeds the convolution only: receiving at every position takes every tap."""
    model = model_of(ar_task, mixer)
    batch = ar_task.sample(6, seed=6)
    (path,) = path_patch(model, batch, "L0.mixer.in_x@key", "L0.mixer.conv@whole", "conv")
    (node,) = patch(model, batch, "L0.mixer.in_x", "key")
    assert abs(path["p_patched"] - node["p_patched"]) <= ENGINE_TOL
    assert abs(path["p_patched"] - path["p_corrupt"]) > 2 * ENGINE_TOL


def test_a_conv_path_reaches_its_kernels_taps_only(ar_task):
    """A kernel of 3 reaches 0, 1, 2 positions on; the query is at least 3 after every key."""
    model = model_of(ar_task, "attention", {"qkv_conv": "k", "conv_size": 3})
    batch = ar_task.sample(6, seed=6)
    assert bool(((batch.query_pos - batch.roles["key"]) >= 3).all())
    records = path_patch(
        model, batch, "L1.mixer.k@key", ["L1.mixer.k@0", "L1.mixer.k@query", "L1.mixer.k@whole"], "conv"
    )
    before, query, every = records
    assert before["p_patched"] == before["p_corrupt"] and query["p_patched"] == query["p_corrupt"]
    assert abs(every["p_patched"] - every["p_corrupt"]) > 2 * ENGINE_TOL


def test_based_state_path_from_every_position_is_the_node_patch_of_both_states_at_the_query(ar_task):
    """Based's transition is the identity, so every write clean gives the clean state (S, z); read at
    the query (the last position), that is patching both state hooks there."""
    model = model_of(ar_task, "based", {"feature_dim": 4})
    batch = ar_task.sample(6, seed=7)
    assert bool((batch.query_pos == batch.lengths - 1).all())
    (path,) = path_patch(model, batch, "L1.mixer.kv_state@whole", "L1.mixer.kv_state@query", "state")
    (node,) = patch(model, batch, "L1.mixer.kv_state+L1.mixer.k_state", "query")
    assert abs(path["p_patched"] - node["p_patched"]) <= ENGINE_TOL
    assert abs(path["p_patched"] - path["p_corrupt"]) > 2 * ENGINE_TOL


# -- the mixers' state paths themselves (float64) -------------------------------------------------
STATE_MIXERS = {
    "mamba": {"d_conv": 0},
    "mamba2": {"d_conv": 0, "chunk_size": 3, "headdim": 8},
    "deltanet": {"conv_size": 0, "num_heads": 2, "chunk_size": 3},
    "based": {"num_heads": 2, "num_key_value_heads": 2, "feature_dim": 4},
    "rwkv": {"head_size": 8, "chunk_size": 3},
}
N_ROWS, N_POS, D_MODEL = 3, 8, 16


def state_mixer(name):
    torch.manual_seed(0)
    mixer = REGISTRY[name](d_model=D_MODEL, **STATE_MIXERS[name]).double().eval()
    with torch.no_grad():  # off the initial values, so that zero-initialised parts take part
        for param in mixer.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return mixer


def read_out(mixer, x):
    """The mixer's `state_readout` hook on input `x`."""
    captured = {}
    point = getattr(mixer, f"hook_{mixer.state_readout}")
    point.add_hook(lambda activation, hook: captured.setdefault("value", activation))
    try:
        mixer(x)
    finally:
        point.remove_hooks()
    return captured["value"]


def position_mask(*positions):
    mask = torch.zeros(N_ROWS, N_POS, dtype=torch.bool)
    mask[:, list(positions)] = True
    return mask


@pytest.mark.parametrize("name", ["mamba", "mamba2", "deltanet", "based"])
def test_state_path_from_the_one_differing_position_restores_the_clean_read_out(name):
    """Two inputs that differ at position 0 only, without a convolution: the transitions after 0 are
    shared, so position 0's clean write carried by the corrupt transitions is the clean state at
    every later position, and so is what they read. (Not RWKV: its token shift makes position 1's
    transition differ too.)"""
    mixer = state_mixer(name)
    generator = torch.Generator().manual_seed(1)
    clean = torch.randn(N_ROWS, N_POS, D_MODEL, generator=generator, dtype=torch.double)
    corrupt = clean.clone()
    corrupt[:, 0] = torch.randn(N_ROWS, D_MODEL, generator=generator, dtype=torch.double)
    with torch.no_grad():
        change = mixer.state_path(clean, corrupt, position_mask(0))
        restored = read_out(mixer, corrupt) + change
        clean_read = read_out(mixer, clean)
    torch.testing.assert_close(restored[:, 1:], clean_read[:, 1:], rtol=1e-9, atol=1e-10)
    assert not torch.allclose(read_out(mixer, corrupt)[:, 1:], clean_read[:, 1:])


@pytest.mark.parametrize("name", ["mamba", "mamba2", "deltanet", "rwkv"])
def test_state_path_changes_add_up_over_the_senders(name):
    """The state's change is linear in the writes (the read-out is linear in the state but for Based's normaliser)."""
    mixer = state_mixer(name)
    generator = torch.Generator().manual_seed(2)
    clean, corrupt = (torch.randn(N_ROWS, N_POS, D_MODEL, generator=generator, dtype=torch.double) for _ in range(2))
    with torch.no_grad():
        both = mixer.state_path(clean, corrupt, position_mask(1, 4))
        apart = mixer.state_path(clean, corrupt, position_mask(1)) + mixer.state_path(clean, corrupt, position_mask(4))
    torch.testing.assert_close(both, apart, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(STATE_MIXERS))
def test_state_path_changes_nothing_before_its_sender(name):
    """Exactly zero before the sender (and at it, for RWKV, whose position t reads the state before its write)."""
    mixer = state_mixer(name)
    generator = torch.Generator().manual_seed(3)
    clean, corrupt = (torch.randn(N_ROWS, N_POS, D_MODEL, generator=generator, dtype=torch.double) for _ in range(2))
    with torch.no_grad():
        change = mixer.state_path(clean, corrupt, position_mask(3))
    first = 4 if name == "rwkv" else 3
    assert bool((change[:, :first] == 0).all())
    assert bool((change[:, first:] != 0).any(dim=-1).all())


# -- paths a model does not have -----------------------------------------------------------------
ERRORS = [
    (
        "attention",
        {},
        "L0.mixer.q@key",
        "L0.mixer.q@query",
        "state",
        "path kind 'state' does not exist for mixer 'attention' (layer 0)",
    ),
    ("mamba", {}, "L0.mixer.y@key", "L1.mixer.B@query", "head", "path kind 'head' does not exist for mixer 'mamba'"),
    ("rwkv", {}, "L0.mixer.k@key", "L0.mixer.k@value", "conv", "path kind 'conv' does not exist for mixer 'rwkv'"),
    (
        "attention",
        {},
        "L0.mixer.k@key",
        "L0.mixer.k@value",
        "conv",
        "path kind 'conv' does not exist for mixer 'attention' (layer 0)",
    ),
    (
        "baseconv",
        {"kernel_size": -1},
        "L0.mixer.conv@key",
        "L0.mixer.conv@value",
        "conv",
        "path kind 'conv' does not exist for mixer 'baseconv'",
    ),
    ("attention", {}, "L0.mixer.q@key", "L1.block_in@key", "resid", "a resid path starts at a residual-stream site"),
    ("attention", {}, "L0.block_out@key", "L1.mixer_in@key", "resid", "a resid path ends at a block's input"),
    ("attention", {}, "L1.block_in@key", "L0.block_in@key", "resid", "must be in a later layer than the sender"),
    ("attention", {}, "L0.mixer.q@key", "L1.mixer.k@key", "head", "L0.mixer.q is not one of the head outputs"),
    ("attention", {}, "L0.mixer.z@key", "L1.mixer.z@key", "head", "L1.mixer.z is not one of the head inputs"),
    ("attention", {}, "L1.mixer.z@key", "L1.mixer.k@key", "head", "must be in a later layer"),
    ("mamba", {}, "L0.mixer.ssm_state@key", "L1.mixer.ssm_state@query", "state", "stays inside one layer's mixer"),
    ("mamba", {}, "L0.mixer.y@key", "L0.mixer.conv@value", "conv", "name it L0.mixer.in_x or L0.mixer.conv"),
    ("mamba", {}, "L0.block_out@key", "L0.mixer.conv@value", "conv", "runs between hooks inside mixers"),
    ("mamba", {}, "L0.mixer.ssm_state@key", "L0.mixer.ssm_state@query", "sideways", "unknown path kind 'sideways'"),
    ("mamba", {}, "L0.mixer.ssm_state", "L0.mixer.ssm_state@query", "state", "sender 'L0.mixer.ssm_state' must be"),
    ("mamba", {}, "L0.block_out+L0.block_in@key", "L1.block_in@key", "resid", "not the joint site"),
    ("mamba2", {}, "L0.mixer.ssm_state[0]@key", "L0.mixer.ssm_state@query", "state", "not one head of it"),
    ("mamba", {}, "L0.mixer.ssm_state@nosuch", "L0.mixer.ssm_state@query", "state", "unknown position 'nosuch'"),
]


@pytest.mark.parametrize(
    ("mixers", "options", "sender", "receiver", "via", "message"),
    ERRORS,
    ids=[f"{row[4]}-{row[-1][:30]}" for row in ERRORS],
)
def test_a_path_the_model_does_not_have_is_a_usage_error_naming_it(
    ar_task, mixers, options, sender, receiver, via, message
):
    model = make_model(ar_task, mixers=mixers, d_model=16, layer_options=[dict(options), dict(options)])
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        path_patch(model, ar_task.sample(3, seed=0), sender, receiver, via)


def test_path_patch_from_a_cache_equals_path_patch_from_scratch(ar_task, tmp_path):
    from hookmech.cache import write_cache

    model = model_of(ar_task, "mamba")
    batch = ar_task.sample(6, seed=8)
    path = write_cache(
        model,
        batch,
        tmp_path / "c.h5",
        ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", "blocks.0.hook_mixer_in"],
        task_spec=ar_task.spec,
    )
    for sender, receiver, via in (
        ("L0.block_in@key", "L1.block_in@key", "resid"),
        ("L0.mixer.in_x@key", "L0.mixer.conv@whole", "conv"),
    ):
        (cached,) = path_patch(model, path, sender, receiver, via)
        (scratch,) = path_patch(model, batch, sender, receiver, via)
        assert abs(cached["p_patched"] - scratch["p_patched"]) <= CACHE_TOL  # contract: fp32 cache vs scratch
