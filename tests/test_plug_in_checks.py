"""The check a plug-in mixer passes when a process first builds it (hookmech.mixers.plug_in_check):
a mixer that reads later positions is refused naming the first position that leaked; a leak under
`MixerSpec.causal_tolerance`, a class attribute here (float rounding) passes, and a mixer may widen or skip the check; the check
changes neither the model's weights nor the caller's random state. A nondeterministic mixer that
skips it is told apart from a cache of another model. Through `train`/`evaluate`:
tests/cli/test_errors_plug_in_mixers.py."""
from __future__ import annotations

import pytest
import torch

import hookmech
from hookmech.cache import CacheFile, write_cache
from hookmech.config import build_config
from hookmech.errors import HookmechError, UsageError

MIXERS = '''
import torch
from torch import nn
from hookmech.mixers import Mixer


class Ahead(Mixer):
    """out_proj(x_t + leak * x_{t+2}): reads two positions ahead unless leak is 0."""

    leak = 1.0

    def __init__(self, d_model: int):
        super().__init__()
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        ahead = torch.cat([x[:, 2:], torch.zeros_like(x[:, :2])], dim=1)
        return self.out_proj(x + self.leak * ahead)


class Rounding(Ahead):
    leak = 1e-9  # far under causal_tolerance x the output: float rounding


class Slight(Ahead):
    leak = 1e-3


class SlightTolerated(Slight):
    causal_tolerance = 1e-2


class Unchecked(Ahead):
    causal_tolerance = None


class Noisy(Ahead):
    """Causal, but draws noise in eval mode; skips the check."""

    causal_tolerance = None
    leak = 0.0

    def forward(self, x):
        return super().forward(x) + 1e-3 * torch.rand_like(x)
'''
N_CTX = 8  # the check runs all 8 positions; it changes the input from position 4 on, then from 7 on


@pytest.fixture
def mixers(tmp_path):
    (tmp_path / "mixers.py").write_text(MIXERS)
    return lambda name: f"{tmp_path / 'mixers.py'}:{name}"


def _model(mixer: str) -> hookmech.HookedLM:
    return hookmech.HookedLM(build_config(d_vocab=10, n_ctx=N_CTX, mixers=mixer, d_model=8, n_layers=2))


def test_a_mixer_reading_later_positions_is_refused_naming_the_first_position_that_leaked(mixers):
    with pytest.raises(UsageError) as error:
        _model(mixers("Ahead"))
    # input changed from position 4 on: positions 2 and 3 read it two positions ahead, 2 first
    assert "is not causal: changing its input from position 4 on changed its output at position 2 by" in str(error.value)


@pytest.mark.parametrize(("name", "passes"), [("Rounding", True), ("Slight", False), ("SlightTolerated", True),
                                              ("Unchecked", True)])
def test_causal_tolerance_takes_float_rounding_and_a_mixer_may_widen_or_skip_it(name, passes, mixers):
    if passes:
        _model(mixers(name))
    else:
        with pytest.raises(UsageError, match=r"causal_tolerance 1e-05 x its largest output"):
            _model(mixers(name))


def test_the_check_changes_neither_the_weights_nor_the_callers_random_state(mixers, monkeypatch):
    from hookmech.mixers import plug_in_check

    torch.manual_seed(3)
    checked = _model(mixers("Rounding"))
    after_checked = torch.rand(3)
    monkeypatch.setattr(plug_in_check, "check_plug_in", lambda *args: None)  # the same build, unchecked
    plug_in_check._CHECKED.clear()
    torch.manual_seed(3)
    unchecked = _model(mixers("Rounding"))
    assert torch.equal(torch.rand(3), after_checked)
    for (name, a), (_, b) in zip(checked.state_dict().items(), unchecked.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_nondeterministic_model_is_not_blamed_on_its_cache(mixers, tmp_path, ar_task):
    model = hookmech.HookedLM(build_config(d_vocab=ar_task.d_vocab, n_ctx=ar_task.n_ctx, mixers=mixers("Noisy"),
                                           d_model=8, n_layers=2)).eval()
    write_cache(model, ar_task.sample(8, seed=0), tmp_path / "c.h5", "all")
    with CacheFile(tmp_path / "c.h5") as cache, pytest.raises(HookmechError) as error:
        cache.check_model(model)
    message = str(error.value)
    assert "two runs of the same clean rows give p(answer)" in message and "another model" not in message
    with CacheFile(tmp_path / "c.h5", verify=False) as cache:
        cache.check_model(model)  # the way out the message names
