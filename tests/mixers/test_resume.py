"""The resume-from-position protocol (`Mixer.prefix_context` / `Mixer.forward_from`) of every
mixer against its own full forward on the spliced input.

The reference is the mixer's `forward` on a whole sequence whose positions from each row's
start on were replaced: `forward_from` must give the same outputs on the window, knowing the
earlier positions only through the context of the unchanged run.

Tolerances: in float64 the resumed window (another grouping of the same sums: a state carried
over instead of a scan from 0, a shorter FFT) agrees to 1e-9 relative / 1e-10 absolute, float64
round-off; the float32 model's forwards that also record contexts use torch's float32 defaults.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest
import torch

from hookmech.hooks import AxisHookPoint
from hookmech.mixers import REGISTRY, SPECS
from hookmech.mixers.base import Mixer, kept, splice, state_before, take_window
from hookmech.oracles.mixer_cases import examples_of

from helpers import example_configs

# (registry name, options): each mixer's option sets (`hookmech.oracles.mixer_cases.EXAMPLES`): the defaults plus
# every option that changes the resumed path
CONFIGS = example_configs()
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in opts.items()) or 'default'}" for name, opts in CONFIGS]
N_ROWS, N_POS, D_MODEL = 5, 12, 16


def make_mixer(name: str, options: dict) -> Mixer:
    torch.manual_seed(0)
    mixer = REGISTRY[name](d_model=D_MODEL, **options).double().eval()
    # Nudge every parameter off its initial value, so that zero-initialised parts
    # (gates, biases, state matrices) take part in the comparison too.
    with torch.no_grad():
        for param in mixer.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return mixer


def test_every_registered_mixer_is_covered():
    assert {name for name, _ in CONFIGS} == set(REGISTRY) == set(SPECS)


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("width", [1, 4, N_POS])
def test_forward_from_equals_forward_on_the_spliced_input(name, options, width):
    mixer = make_mixer(name, options)
    generator = torch.Generator().manual_seed(width)
    base = torch.randn(N_ROWS, N_POS, D_MODEL, dtype=torch.float64, generator=generator)
    rows = torch.tensor([3, 0, 3, 4, 1, 2])  # a row may appear twice, with different starts
    start = torch.randint(0, N_POS - width + 1, (len(rows),), generator=generator)
    start[0] = 0
    start[1] = N_POS - width
    window = torch.randn(len(rows), width, D_MODEL, dtype=torch.float64, generator=generator)

    with torch.no_grad():
        context = mixer.prefix_context(base)
        resumed = mixer.forward_from(window, context, rows, start)
        expected = take_window(mixer(splice(base, rows, window, start)), start, width)
    assert resumed.shape == (len(rows), width, D_MODEL)
    torch.testing.assert_close(resumed, expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_forward_from_resumes_at_every_start(name, options):
    """Every start, each row once: mixers that keep a state only every few positions (Mamba-2,
    DeltaNet) replay the positions in between, whatever start's place in its block."""
    mixer = make_mixer(name, options)
    base = torch.randn(N_ROWS, N_POS, D_MODEL, dtype=torch.float64)
    start = torch.arange(N_POS - 1)
    rows = start % N_ROWS
    window = torch.randn(len(rows), 2, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        resumed = mixer.forward_from(window, mixer.prefix_context(base), rows, start)
        expected = take_window(mixer(splice(base, rows, window, start)), start, 2)
    torch.testing.assert_close(resumed, expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_keep_returns_the_kept_outputs_only(name, options):
    """`keep` (one window index per row, as for the query in the last layer) gives exactly
    those outputs of the whole window."""
    mixer = make_mixer(name, options)
    base = torch.randn(N_ROWS, N_POS, D_MODEL, dtype=torch.float64)
    rows, start, width = torch.tensor([0, 2, 4, 2]), torch.tensor([0, 3, 7, 1]), 5
    keep = torch.tensor([4, 0, 2, 3])
    window = torch.randn(len(rows), width, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        context = mixer.prefix_context(base)
        whole = mixer.forward_from(window, context, rows, start)
        only = mixer.forward_from(window, context, rows, start, keep)
    torch.testing.assert_close(only, take_window(whole, keep, 1), rtol=1e-9, atol=1e-10)


FIRST_CONFIGS = [(name, dict(examples_of(name)[0])) for name in sorted(SPECS)]


@pytest.mark.parametrize(("name", "options"), FIRST_CONFIGS, ids=[name for name, _ in FIRST_CONFIGS])
def test_context_rows_follow_the_rows_argument(name, options):
    """Rows are looked up in the context: resuming row 2 from its own unchanged input
    reproduces row 2's output, not another row's."""
    mixer = make_mixer(name, options)
    base = torch.randn(4, N_POS, D_MODEL, dtype=torch.float64)
    start = torch.tensor([5])
    with torch.no_grad():
        full = mixer(base)
        resumed = mixer.forward_from(base[2:3, 5:9], mixer.prefix_context(base), torch.tensor([2]), start)
    torch.testing.assert_close(resumed, full[2:3, 5:9], rtol=1e-9, atol=1e-10)


def test_window_helpers_by_hand():
    full = torch.arange(12.0).view(2, 6)
    start = torch.tensor([1, 3])
    assert take_window(full, start, 2).tolist() == [[1, 2], [9, 10]]
    spliced = splice(full, torch.tensor([0, 1]), torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]), start)
    assert spliced.tolist() == [[0, -1, -2, 3, 4, 5], [6, 7, 8, -3, -4, 11]]
    states = torch.arange(12.0).view(2, 6, 1)
    before = state_before(states, torch.tensor([1, 0, 0]), torch.tensor([2, 0, 6]))
    assert before.tolist() == [[7.0], [0.0], [5.0]]


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_overridden_forward_from_projects_only_the_window(name, options):
    """A mixer that implements its own `forward_from` runs its input-dependent linear layers
    on the window only (that is the point of resuming); the default re-runs `forward`. A mixer
    that keeps its state every STATE_STRIDE positions may also project the STATE_STRIDE - 1
    positions it replays (Mamba's x_proj and dt_proj, from the kept in_x, only at the live ones), never
    the run's."""
    mixer = make_mixer(name, options)
    if type(mixer).forward_from is Mixer.forward_from:
        pytest.skip(f"{name} uses the default forward_from (re-runs forward on the spliced input)")
    rows, start, width = torch.tensor([0, 1, 2]), torch.tensor([2, 5, 9]), 3
    seen = []
    handles = [module.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
               for module in mixer.modules() if isinstance(module, torch.nn.Linear)]
    base = torch.randn(N_ROWS, N_POS, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        context = mixer.prefix_context(base)
        seen.clear()
        mixer.forward_from(torch.randn(3, width, D_MODEL, dtype=torch.float64), context, rows, start)
    for handle in handles:
        handle.remove()
    per_row = [shape for shape in seen if len(shape) >= 3 and shape[0] == len(rows)]
    assert per_row, "no linear layer saw the window"
    stride = getattr(type(mixer), "STATE_STRIDE", 1)
    # the STATE_STRIDE - 1 positions before the start, or (Mamba) only the live ones among them:
    # those from the start of the start's block of STATE_STRIDE positions
    replayed = (stride - 1, int((start % stride).max()))
    assert all(shape[1] <= width or shape[1] in replayed for shape in per_row), per_row


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_forward_with_context_is_forward_and_prefix_context(name, options):
    """One pass (where a mixer overrides it) gives what the two calls give separately."""
    mixer = make_mixer(name, options)
    x = torch.randn(3, N_POS, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        out, context = mixer.forward_with_context(x)
        expected_context = mixer.prefix_context(x)
        torch.testing.assert_close(out, mixer(x), rtol=1e-9, atol=1e-10)
    assert context.keys() == expected_context.keys()
    for key in context:
        torch.testing.assert_close(context[key], expected_context[key], rtol=1e-9, atol=1e-10)


def test_a_model_records_every_blocks_context_in_its_forward():
    """`HookedLM.collecting_contexts`: one entry per block and forward, equal to the context made
    from that block's cached mixer input; outside the block nothing is recorded."""
    import hookmech
    from hookmech.config import build_config

    torch.manual_seed(0)
    model = hookmech.HookedLM(build_config(d_vocab=20, n_ctx=12, mixers=["attention", "mamba"], d_model=16,
                                           n_layers=2)).eval()
    tokens = torch.randint(0, 20, (3, 9))
    with torch.no_grad():
        with model.collecting_contexts() as recorded:
            logits, cache = model.run_with_cache(tokens, names_filter=lambda hook: "mixer_" in hook)
        torch.testing.assert_close(logits, model(tokens))
        for layer in range(2):
            assert len(recorded[layer]) == 1
            # and the mixer's output, which a resumed run patched after the mixer reads
            torch.testing.assert_close(recorded[layer][0]["mixer_out"], cache[f"blocks.{layer}.hook_mixer_out"])
            expected = model.layer_context(layer, cache[f"blocks.{layer}.hook_mixer_in"])
            for key, value in expected.items():
                torch.testing.assert_close(recorded[layer][0][key], value)
        model(tokens)
    assert [len(entries) for entries in recorded.values()] == [1, 1]
    assert all(block.contexts is None for block in model.blocks)


@pytest.mark.parametrize(("name", "options"), [c for c in CONFIGS if REGISTRY[c[0]].state_hooks],
                         ids=[i for i, c in zip(IDS, CONFIGS, strict=True) if REGISTRY[c[0]].state_hooks])
def test_state_from_context_is_what_the_state_hook_fires_with(name, options):
    """`Mixer.state_from_context`: a state hook's value at any (row, position), read from the
    context of the run (kept states, replayed where only every few are kept), equals what the hook
    fires with in `forward` there — the engine's unpatched runs read patched states this way."""
    mixer = make_mixer(name, options)
    x = torch.randn(N_ROWS, N_POS, D_MODEL, dtype=torch.float64)
    rows = torch.tensor([0, 4, 2, 2, 1, 3, 0])
    positions = torch.tensor([0, N_POS - 1, 1, 5, 3, 4, 7])  # every place in a block of STATE_STRIDE
    for state in mixer.state_hooks:
        fired = {}
        point = getattr(mixer, f"hook_{state}")
        point.add_hook(lambda act, hook, fired=fired: fired.setdefault("states", act.clone()))
        try:
            with torch.no_grad():
                mixer(x)
                context = mixer.prefix_context(x)
        finally:
            point.remove_hooks()
        with torch.no_grad():
            read = mixer.state_from_context(state, context, rows, positions)
        # another grouping of the same sums (a kept state carried over ≤ 3 positions): float64 round-off
        torch.testing.assert_close(read, fired["states"][rows, positions], rtol=1e-9, atol=1e-10)


STRIDED = [(c, i) for c, i in zip(CONFIGS, IDS, strict=True) if hasattr(REGISTRY[c[0]], "STATE_STRIDE")]


@pytest.mark.parametrize(("name", "options"), [c for c, _ in STRIDED], ids=[i for _, i in STRIDED])
def test_kept_states_resume_at_every_start_of_a_run_several_strides_long(name, options):
    """Mixers that keep their state only every STATE_STRIDE positions (Mamba, Mamba-2, DeltaNet, GLA,
    quadratic Based),
    on a run of 2.5 strides: `forward_from` at every start (each place in a block, blocks 0, 1, 2)
    equals the mixer's forward on the spliced input, and `state_from_context` at every position
    equals what the state hook fires with (reference: the mixer's own full forward)."""
    mixer = make_mixer(name, options)
    stride = type(mixer).STATE_STRIDE
    n_pos = 2 * stride + stride // 2
    generator = torch.Generator().manual_seed(1)
    base = torch.randn(N_ROWS, n_pos, D_MODEL, dtype=torch.float64, generator=generator)
    start = torch.arange(n_pos - 2)
    rows = start % N_ROWS
    window = torch.randn(len(rows), 3, D_MODEL, dtype=torch.float64, generator=generator)
    fired = {}
    points = {state: getattr(mixer, f"hook_{state}") for state in mixer.state_hooks}
    for state, point in points.items():
        point.add_hook(lambda act, hook, state=state: fired.setdefault(state, act.clone()))
    try:
        with torch.no_grad():
            mixer(base)
    finally:
        for point in points.values():
            point.remove_hooks()
    with torch.no_grad():
        context = mixer.prefix_context(base)
        resumed = mixer.forward_from(window, context, rows, start)
        expected = take_window(mixer(splice(base, rows, window, start)), start, 3)
        every_row, every_pos = torch.arange(N_ROWS).repeat_interleave(n_pos), torch.arange(n_pos).repeat(N_ROWS)
        read = {state: mixer.state_from_context(state, context, every_row, every_pos) for state in points}
    # another grouping of the same sums (a kept state carried over < STATE_STRIDE positions): float64 round-off
    torch.testing.assert_close(resumed, expected, rtol=1e-9, atol=1e-10)
    for state in points:
        torch.testing.assert_close(read[state], fired[state][every_row, every_pos], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("with_state_hooks", [False, True])
@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_forward_with_context_fires_the_inside_hooks_in_use(name, options, with_state_hooks):
    """With read-only hooks on the mixer's inside hooks (the engine's unpatched runs), one
    `forward_with_context` fires each of them on the whole run, as `forward` does, and returns
    what `forward` and `prefix_context` return (a hooked state: the two apart)."""
    mixer = make_mixer(name, options)
    x = torch.randn(3, N_POS, D_MODEL, dtype=torch.float64)
    points = {point_name: point for point_name, point in mixer.named_modules() if isinstance(point, AxisHookPoint)
              and point.pos_axis == 1 and (with_state_hooks or point_name[len("hook_"):] not in mixer.state_hooks)}
    fired: dict[str, list[torch.Tensor]] = {point_name: [] for point_name in points}
    for point_name, point in points.items():
        point.add_hook(lambda act, hook, seen=fired[point_name]: seen.append(act.clone()))
    try:
        with torch.no_grad():
            expected_out = mixer(x)
            expected = {point_name: seen[-1] for point_name, seen in fired.items() if seen}
            for seen in fired.values():
                seen.clear()
            out, context = mixer.forward_with_context(x)
            expected_context = mixer.prefix_context(x)
    finally:
        for point in points.values():
            point.remove_hooks()
    torch.testing.assert_close(out, expected_out, rtol=1e-9, atol=1e-10)
    assert context.keys() == expected_context.keys()
    for key in context:
        torch.testing.assert_close(context[key], expected_context[key], rtol=1e-9, atol=1e-10)
    for point_name, value in expected.items():  # every hook forward fires, once, with the same values
        assert len(fired[point_name]) == 1, point_name
        torch.testing.assert_close(fired[point_name][0], value, rtol=1e-9, atol=1e-10)


# -- inside hooks on the window (`Mixer.window_hooks`) of the long-convolution mixers ----------
def has_filter_hooks(name: str, options: dict) -> bool:
    """Whether the mixer has an inside hook without a position axis (a long convolution's filter)."""
    mixer = REGISTRY[name](d_model=D_MODEL, **options)
    return any(isinstance(point, AxisHookPoint) and point.pos_axis is None for point in mixer.modules())


# the long-convolution mixers (h3, hyena, baseconv): those with a filter hook in one of their examples
CONV_MIXERS = {name for name, options in CONFIGS if has_filter_hooks(name, options)}
CONV_CASES = [(ident, config) for ident, config in zip(IDS, CONFIGS, strict=True) if config[0] in CONV_MIXERS]
CONV_CONFIGS = [config for _, config in CONV_CASES]
CONV_IDS = [ident for ident, _ in CONV_CASES]


def inside_hooks(mixer: Mixer, positional: bool) -> dict[str, AxisHookPoint]:
    """The mixer's own hooks with (`positional`) or without a position axis, by name."""
    return {name: point for name, point in mixer.named_modules()
            if isinstance(point, AxisHookPoint) and (point.pos_axis is not None) == positional}


def resume_case(name: str, options: dict, width: int = 4):
    """A mixer, a base run ``[N, T, d]``, and windows of `width` at rows and starts (one at 0, one at the end)."""
    mixer = make_mixer(name, options)
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(N_ROWS, N_POS, D_MODEL, dtype=torch.float64, generator=generator)
    rows, start = torch.tensor([3, 0, 3, 4]), torch.tensor([0, N_POS - width, 5, 2])
    window = torch.randn(len(rows), width, D_MODEL, dtype=torch.float64, generator=generator)
    return mixer, base, rows, start, window


@contextmanager
def hooked(point: AxisHookPoint, hook):
    """`hook` attached to `point` within the `with` block."""
    point.add_hook(hook)
    try:
        yield
    finally:
        point.remove_hooks()


def at_positions(act: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``act[i, positions[i]]`` for every row i (position axis 1): ``[B, ...]``."""
    return act[torch.arange(len(positions)), positions]


KEEP = torch.tensor([3, 3, 2, 1])  # window indices of `resume_case`'s four rows


@pytest.mark.parametrize(("name", "options"), CONV_CONFIGS, ids=CONV_IDS)
@pytest.mark.parametrize("keep", [None, KEEP], ids=["window", "keep"])
def test_window_hooks_fire_on_the_window_with_the_spliced_forwards_values(name, options, keep):
    """Every inside hook with a position axis fires on the window ``[B, W, ...]`` (with `keep`,
    those computed at the kept positions only: ``[B, 1, ...]``) with `forward`'s values there."""
    mixer, base, rows, start, window = resume_case(name, options)
    assert type(mixer).window_hooks
    width = window.shape[1]
    seen: dict[str, dict[str, torch.Tensor]] = {"window": {}, "spliced": {}}
    for hook_name, point in inside_hooks(mixer, positional=True).items():
        point.add_hook(lambda act, hook, hook_name=hook_name: seen[current].__setitem__(hook_name, act.clone()))
    with torch.no_grad():
        context = mixer.prefix_context(base)
        current = "window"
        mixer.forward_from(window, context, rows, start, keep)
        current = "spliced"
        mixer(splice(base, rows, window, start))
    assert seen["window"].keys() == seen["spliced"].keys() == inside_hooks(mixer, positional=True).keys()
    for hook_name, act in seen["window"].items():
        assert act.shape[:2] in ((len(rows), width), (len(rows), 1 if keep is not None else width)), hook_name
        if act.shape[1] == width:
            expected = take_window(seen["spliced"][hook_name], start, width)
        else:
            expected = take_window(seen["spliced"][hook_name], start + keep, 1)
        torch.testing.assert_close(act, expected, rtol=1e-9, atol=1e-10, msg=hook_name)


@pytest.mark.parametrize(("name", "options"), CONV_CONFIGS, ids=CONV_IDS)
@pytest.mark.parametrize("keep", [None, KEEP], ids=["window", "keep"])
def test_an_edit_of_a_window_hook_is_carried_as_in_the_spliced_forward(name, options, keep):
    """A random change added at one window position of each inside hook (a position per row)
    gives the window outputs of `forward` on the spliced input with that change at that position
    (with `keep`, a hook fired at the kept positions only takes it where it is the kept one)."""
    mixer, base, rows, start, window = resume_case(name, options)
    offset = torch.tensor([1, 3, 0, 2])  # window index of each row's edit (with KEEP: before, at, after it)
    with torch.no_grad():
        context = mixer.prefix_context(base)
        spliced = splice(base, rows, window, start)
        unedited = mixer.forward_from(window, context, rows, start, keep)
        for hook_name, point in inside_hooks(mixer, positional=True).items():
            changes = {}

            def edit(act, hook, positions, applies):
                change = changes.setdefault("change", torch.randn_like(at_positions(act, positions)))
                act = act.clone()
                act[torch.arange(len(positions)), positions] += change * applies.view(-1, *[1] * (change.dim() - 1))
                return act

            def resumed_edit(act, hook):
                if act.shape[1] == window.shape[1]:
                    return edit(act, hook, offset, torch.ones(len(offset), dtype=torch.bool))
                return edit(act, hook, torch.zeros_like(offset), offset == keep)  # fired at keep only

            with hooked(point, resumed_edit):
                resumed = mixer.forward_from(window, context, rows, start, keep)
            everywhere = torch.ones(len(offset), dtype=torch.bool)
            with hooked(point, lambda act, hook: edit(act, hook, start + offset, everywhere)):
                expected = kept(take_window(mixer(spliced), start, window.shape[1]), keep)
            torch.testing.assert_close(resumed, expected, rtol=1e-9, atol=1e-10, msg=hook_name)
            assert not torch.allclose(resumed, unedited), f"editing {hook_name} changed nothing"


@pytest.mark.parametrize(("name", "options"), CONV_CONFIGS, ids=CONV_IDS)
def test_resumed_long_convolutions_run_on_the_window_only(name, options, monkeypatch):
    """With no filter hook in use, no convolution on the resumed path spans the whole run: the
    long ones are the base run's plus the convolution of the window's change (by FFT or directly),
    the short ones read the few inputs before the window (`ShortConv.forward_from`), never
    `ShortConv.forward`."""
    import hookmech.mixers.long_conv as long_conv
    from hookmech.mixers.short_conv import ShortConv

    mixer, base, rows, start, window = resume_case(name, options)
    with torch.no_grad():
        context = mixer.prefix_context(base)
    lengths = []
    for function in ("fft_causal_conv", "toeplitz_causal_conv", "causal_conv_at"):
        for module in (long_conv, sys.modules[type(mixer).__module__]):
            if hasattr(module, function):
                original = getattr(module, function)
                monkeypatch.setattr(module, function,
                                    lambda u, *a, original=original: lengths.append(u.shape[1]) or original(u, *a))
    monkeypatch.setattr(ShortConv, "forward", lambda *a: pytest.fail("a short convolution ran on the whole run"))
    with torch.no_grad():
        mixer.forward_from(window, context, rows, start)
        mixer.forward_from(window, context, rows, start, KEEP)
    assert all(length <= window.shape[1] for length in lengths), lengths
    if name != "baseconv" or options.get("kernel_size") == -1:
        assert lengths, "the long convolution did not run"


@pytest.mark.parametrize(("name", "options"), CONV_CONFIGS, ids=CONV_IDS)
def test_resumed_windows_longer_than_the_direct_limit_convolve_by_fft(name, options, monkeypatch):
    """`long_conv.DIRECT_CONV_MAX_POS`: above it, a window's change is convolved by FFT, with
    the same outputs."""
    import hookmech.mixers.long_conv as long_conv

    monkeypatch.setattr(long_conv, "DIRECT_CONV_MAX_POS", 0)
    mixer, base, rows, start, window = resume_case(name, options)
    with torch.no_grad():
        resumed = mixer.forward_from(window, mixer.prefix_context(base), rows, start)
        expected = take_window(mixer(splice(base, rows, window, start)), start, window.shape[1])
    torch.testing.assert_close(resumed, expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(("name", "options"), CONV_CONFIGS, ids=CONV_IDS)
def test_an_edited_filter_is_honoured_on_the_resumed_path(name, options):
    """A hook on a filter (no position axis) fires on the resumed path with the base run's lags,
    and its edit changes the window's outputs as in `forward` on the spliced input."""
    mixer, base, rows, start, window = resume_case(name, options)
    filters = inside_hooks(mixer, positional=False)
    if not filters:
        pytest.skip(f"{name} {options} has no filter hook (a short convolution)")
    with torch.no_grad():
        context = mixer.prefix_context(base)
        spliced = splice(base, rows, window, start)
        unedited = mixer.forward_from(window, context, rows, start)
        for hook_name, point in filters.items():
            seen = []

            def edit(act, hook):
                seen.append(act.clone())
                return act + torch.randn(act.shape, dtype=act.dtype, generator=torch.Generator().manual_seed(3))

            with hooked(point, edit):
                resumed = mixer.forward_from(window, context, rows, start)
                expected = take_window(mixer(spliced), start, window.shape[1])
            torch.testing.assert_close(seen[0], seen[1], rtol=1e-9, atol=1e-10, msg=hook_name)
            torch.testing.assert_close(resumed, expected, rtol=1e-9, atol=1e-10, msg=hook_name)
            assert not torch.allclose(resumed, unedited), f"editing {hook_name} changed nothing"
