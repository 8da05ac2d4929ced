"""Helpers shared by the tests (fixtures are in conftest.py)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import hookmech
from hookmech.config import build_config

REPO = Path(__file__).resolve().parent.parent
#: the bundled trained attention AR checkpoint (also the `trained_attention` fixture)
ATTENTION_FIXTURE = REPO / "fixtures" / "attention_ar_cpu.safetensors"

# The documented numerical contracts (README, docs/guide.md §6). A test comparing two different
# computations of the same numbers uses the contract it checks; only the same computation run
# twice (determinism) compares exactly.
#: the patching engine vs the plain `run_with_hooks` loop (hookmech.oracles.plain_loop), in every p and
#: metric; also any two engine paths (batching, resumed or full runs, kept contexts or not)
ENGINE_TOL = 1e-5
#: patching from an fp32 activation cache vs patching from scratch, in every p
CACHE_TOL = 1e-6
#: patching from a float16 cache vs from a float32 cache of the same rows, in every p_patched and
#: attribution. float16 rounds each stored activation to 2**-11 ≈ 4.9e-4 of itself (the patched
#: clean values and the corrupt residual the engine resumes from), and a patch's p moves by that
#: relative change times its sensitivity to the activation; measured on the bundled CPU fixtures
#: (64 rows, every block-level site, key/value/query): 3.9e-5 in p and 4.0e-5 in attribution for
#: attention, 1.6e-5 and 2.2e-5 for Mamba (p_clean - p_corrupt 0.96 and 0.73). 1e-3 is 25x that,
#: while a value read from the wrong row, position or dtype moves a patch by ~0.1.
FP16_CACHE_TOL = 1e-3
#: one set of float64 terms summed in two orders (a joint AtP estimate against the sum of its
#: per-position terms, a mean against the mean of its rows): the round-off is ~1e-15 per term on
#: any CPU, while a term lost or computed in float32 (~1e-7) fails
FLOAT64_SUM_TOL = 1e-9
#: an analytic float64 gradient vs a central difference at step 1e-6 (relative): truncation
#: O(step²) times the curvature (2e-6 measured at step 1e-5 on the worst mixer, so ~2e-8 here)
#: plus round-off ~1e-16 / step = 1e-10 on any CPU; a missing path of the gradient fails by > 1e-3
FINITE_DIFFERENCE_RTOL = 1e-6


# -- models --------------------------------------------------------------------------------
def make_model(task, seed: int = 0, **overrides) -> hookmech.HookedLM:
    """A random-init model for `task` (eval mode), deterministic in `seed`."""
    torch.manual_seed(seed)
    options = {"d_vocab": task.d_vocab, "n_ctx": task.n_ctx, "d_model": 32, "n_layers": 2, **overrides}
    return hookmech.HookedLM(build_config(**options)).eval()


def unit_variance(model: hookmech.HookedLM, seed: int = 1) -> hookmech.HookedLM:
    """Re-draw every Linear and Embedding weight of `model` with variance 1/fan-in (in place;
    returns it). Under zoology's 0.02 init a patch moves p(answer) of a small random model by
    less than ENGINE_TOL (hyena's not at all), so agreeing to ENGINE_TOL would say nothing;
    with unit-variance weights patches move it by 1e-4 to 1e-1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                weight = module.weight
                weight.copy_(torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * weight.shape[1] ** -0.5)
    return model


# -- the mixers, as their specs describe them (hookmech.mixers.SPECS) -----------------------
def mixers_with_heads() -> list[str]:
    """The registered mixers whose spec states a head axis (`MixerSpec.heads`), by name."""
    from hookmech.mixers import SPECS

    return sorted(name for name, spec in SPECS.items() if spec.heads is not None)


def head_options(name: str, d_model: int = 16) -> dict:
    """Options giving mixer `name` several heads at `d_model`, and a head shape other than its
    defaults' (two heads, or four where its defaults give two), from its spec; {} without heads."""
    from hookmech.mixers import SPECS

    spec = SPECS[name]
    if spec.heads is None:
        return {}
    options = spec.with_heads(2, d_model)
    if spec.head_shape(d_model, options) == spec.head_shape(d_model, {}):
        options = spec.with_heads(4, d_model)
    return options


def state_hooks_of() -> list[tuple[str, str]]:
    """(mixer, state hook without "hook_") of every registered mixer with recurrent-state hooks."""
    from hookmech.mixers import REGISTRY

    return [(name, cls.state_hooks[0]) for name, cls in sorted(REGISTRY.items()) if cls.state_hooks]


def example_configs() -> list[tuple[str, dict]]:
    """(mixer, options) of every mixer's option sets (`hookmech.oracles.mixer_cases.EXAMPLES`), by mixer name."""
    from hookmech.mixers import SPECS
    from hookmech.oracles.mixer_cases import examples_of

    return [(name, dict(options)) for name, spec in sorted(SPECS.items()) for options in examples_of(name)]


# -- the command line and files ------------------------------------------------------------
def run_cli(argv, capsys):
    """Run the `hookmech` CLI in-process (arguments may be paths); return (exit code, stdout, stderr)."""
    from hookmech.cli.main import main

    try:
        main([str(arg) for arg in argv])
        code = 0
    except SystemExit as done:
        code = done.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def fail_cache_write_on_call(monkeypatch, number: int, error: OSError) -> list[int]:
    """Make the cache's chunk writer raise `error` on its `number`-th write (after writing the
    others); return the list of calls so far."""
    from hookmech.cache import _ChunkWriter

    calls, original = [], _ChunkWriter._write

    def write(self, dataset, rows, value):
        calls.append(1)
        if len(calls) == number:
            raise error
        return original(self, dataset, rows, value)

    monkeypatch.setattr(_ChunkWriter, "_write", write)
    return calls


# -- batches and mixers ----------------------------------------------------------------------
def assert_same_rows(a, b):
    """Assert two batches hold the same rows, roles and subclass fields."""
    assert type(a) is type(b)
    for name in ("tokens", "corrupt_tokens", "answers", "lengths", "doc_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.roles.keys() == b.roles.keys()
    for role in a.roles:
        assert torch.equal(a.roles[role], b.roles[role]), role


def assert_causal(mixer, d_model: int, n_pos: int = 10, t: int = 5) -> None:
    """Changing the inputs after position t changes outputs after t and never at or before it
    (float64, exact equality on the prefix)."""
    x = torch.randn(2, n_pos, d_model, dtype=torch.float64)
    changed = x.clone()
    changed[:, t + 1 :] = torch.randn_like(changed[:, t + 1 :])
    out, out_changed = mixer(x), mixer(changed)
    assert torch.equal(out[:, : t + 1], out_changed[:, : t + 1])
    assert not torch.allclose(out[:, t + 1 :], out_changed[:, t + 1 :])


def assert_state_built_only_when_hooked(monkeypatch, module, kernel: str, model, other_hook: str, state_hook: str) -> None:
    """Spy on `module.kernel` (called once per layer with ``return_all_states``): a plain forward
    and a cache of `other_hook` never ask for the per-position states; caching `state_hook`
    (layer 0's) asks in layer 0 only."""
    calls = []
    original = getattr(module, kernel)

    def spy(*args, **kwargs):
        calls.append(kwargs.get("return_all_states", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, kernel, spy)
    tokens = torch.randint(0, 20, (2, 9))
    model(tokens)
    assert calls == [False, False]
    model.run_with_cache(tokens, names_filter=lambda name: name.endswith(other_hook))
    assert calls[2:] == [False, False]
    model.run_with_cache(tokens, names_filter=state_hook)
    assert calls[4:] == [True, False]


# -- recurrent-state edits (every mixer with a state hook) ------------------------------------
def first_edits(edits: dict) -> dict[int, int]:
    """{row: its first edited position} of state edits ``{(row, pos): state}``."""
    first: dict[int, int] = {}
    for row, pos in sorted(edits):
        first.setdefault(row, pos)
    return first


def random_state_edits(rows_at: dict[int, list[int]], n_rows: int, state_shape, seed: int) -> dict:
    """State edits ``{(row, pos): state}`` of float64 normal states at the positions and rows of
    `rows_at` ``{pos: rows}`` (one ``[n_rows, *state_shape]`` draw per position, in order)."""
    generator = torch.Generator().manual_seed(seed)
    states = {pos: torch.randn(n_rows, *state_shape, generator=generator, dtype=torch.double) for pos in rows_at}
    return {(row, pos): states[pos][row] for pos, rows in rows_at.items() for row in rows}


def restarted_reference(forward, x: torch.Tensor, edits: dict) -> torch.Tensor:
    """The output of a recurrence written out position by position, ``forward(x, replace) ->
    (out, ..., states)`` (`replace` maps a position to the states ``[batch, ...]`` that replace
    the recurrence's there), with the states of `edits` ``{(row, pos): state}``: at each edited
    position, in order, the edited rows take their new state and the others keep the one the
    recurrence reached there."""
    replaced = {}
    for pos in sorted({pos for _, pos in edits}):
        running = forward(x, replaced or None)[-1]
        state = running[:, pos].clone()
        for (row, at), value in edits.items():
            if at == pos:
                state[row] = value
        replaced[pos] = state
    return forward(x, replaced)[0]


def assert_state_edit_propagates(model, tokens, state_hook: str, out_hook: str, edits: dict, reference, *,
                                 style: str = "copy", lag: int = 0, rtol: float = 1e-9, atol: float = 1e-11,
                                 prefix_atol: float = 0.0) -> None:
    """An edit of a recurrent-state hook propagates through the recurrence (docs/sites.md:
    "patching propagates"; hookmech/mixers/state_patch.py). `state_hook` is edited at `edits`
    ``{(row, pos): state}`` in a `run_with_hooks` forward: on a copy the hook returns
    (``"copy"``), in place returning None (``"in_place"``, as TransformerLens hooks often do)
    or in place returning the tensor (``"in_place_returned"``). Then

    - `out_hook` equals ``reference(clean_cache, edits)``: the recurrence written out in the
      test, restarted from each edited state (to rtol, atol; the model is float64);
    - in every row, the positions before its first edit (+ `lag`: a state edited at position p
      shows in `out_hook` from p + lag on) are the clean run's (exactly, or to `prefix_atol`
      where the edited run recomputes them), and the rest (if any) are not the clean run's."""
    assert edits and style in ("copy", "in_place", "in_place_returned"), style
    _, clean = model.run_with_cache(tokens)

    def edit(state, hook):
        edited = state.clone() if style == "copy" else state
        for (row, pos), value in edits.items():
            edited[row, pos] = value
        return None if style == "in_place" else edited

    captured = {}
    model.run_with_hooks(tokens, fwd_hooks=[(state_hook, edit),
                                            (out_hook, lambda act, hook: captured.setdefault("out", act.clone()))])
    out, clean_out = captured["out"], clean[out_hook]
    torch.testing.assert_close(out, reference(clean, edits), rtol=rtol, atol=atol)
    first, n_pos = first_edits(edits), tokens.shape[1]
    for row in range(len(tokens)):
        shows = min(first.get(row, n_pos) + lag, n_pos)
        torch.testing.assert_close(out[row, :shows], clean_out[row, :shows], rtol=0, atol=prefix_atol)
        if shows < n_pos:
            assert not torch.allclose(out[row, shows:], clean_out[row, shows:]), (row, shows)


#: the same seeded initialisation on two CPUs (relative, per fingerprint value): the draws and
#: inits go through log, exp and cos (normal_'s Box-Muller, Mamba's dt and A), which torch
#: computes per instruction set (AVX-512, AVX2, scalar); measured here between them: up to 2.4e-5
#: (a normal draw whose uniform is near 1, where log's ulp is amplified); a value drawn in
#: another order, from another generator state, or scaled differently moves by O(1)
INIT_TOL = 1e-3
INIT_FINGERPRINTS = REPO / "tests" / "data" / "init_fingerprints.json"


def init_fingerprint(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Return, per tensor of `state` (name order), [sum |x|, sum x², up to 16 evenly spaced values]
    in float64: what `assert_same_init` compares."""
    out = {}
    for name in sorted(state):
        values = state[name].detach().double().flatten()
        picked = torch.linspace(0, values.numel() - 1, min(16, values.numel())).round().long()
        out[name] = [values.abs().sum().item(), (values * values).sum().item(), *values[picked].tolist()]
    return out


def default_mixer_state(name: str) -> dict[str, torch.Tensor]:
    """The seeded initialisation (torch seed 0) of mixer `name` with its defaults at d_model 16
    (l_max 64 where it takes one): what "NAME" of the fingerprints pins."""
    from hookmech.mixers import REGISTRY, mixer_options

    options = {"l_max": 64} if "l_max" in mixer_options(REGISTRY[name]) else {}
    torch.manual_seed(0)
    return REGISTRY[name](d_model=16, **options).state_dict()


def default_model_state(preset: str) -> dict[str, torch.Tensor]:
    """The seeded initialisation (torch seed 0) of a 2-layer d_model-16 model of model preset
    `preset`: what "model:PRESET" of the fingerprints pins."""
    from hookmech.model_presets import expand_preset

    mixers, options = expand_preset(preset, 2)
    config = build_config(d_vocab=32, n_ctx=24, mixers=mixers, d_model=16, n_layers=2, layer_options=options)
    torch.manual_seed(0)
    return hookmech.HookedLM(config).state_dict()


def assert_same_init(state: dict[str, torch.Tensor], key: str) -> None:
    """Assert that `state` is the initialisation recorded under `key` in tests/data (INIT_TOL)."""
    import json
    import math

    expected = json.loads(INIT_FINGERPRINTS.read_text())[key]
    got = init_fingerprint(state)
    assert sorted(got) == sorted(expected), key
    for name, values in expected.items():
        for a, b in zip(got[name], values, strict=True):
            assert math.isclose(a, b, rel_tol=INIT_TOL, abs_tol=1e-8), f"{key}: {name} {a} != {b}"


#: the smallest sweep file the CLI tests use: two 4-step runs of a d_model-8 attention model
SWEEP_SMALL = """
[task]
name = "ar"
vocab_size = 16
num_kv_pairs = 3
[train]
steps = 4
n_train = 0
n_dev = 8
batch_size = 8
eval_every = 2
[grid]
d_model = [8]
seed = [0, 1]
"""
