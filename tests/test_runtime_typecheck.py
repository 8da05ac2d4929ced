"""The suite runs hookmech type- and shape-checked (tests/conftest.py, tests/runtime_typecheck.py):
a tensor of the wrong shape at a public boundary fails at the call, with a message that names
the parameter, its shape and the expected one. These tests fail if the checks are off."""
from __future__ import annotations

import pytest
import torch
from jaxtyping import TypeCheckError

import hookmech
from hookmech.mixers import REGISTRY
from hookmech.tasks.batch import Batch


def test_tokens_of_the_wrong_rank_name_the_parameter_and_the_shape(ar_model):
    tokens = torch.randint(0, 16, (5,))  # [pos], not [batch, pos]
    with pytest.raises(TypeCheckError) as raised:
        ar_model(tokens)
    message = str(raised.value)
    assert "hookmech.model.HookedLM.forward" in message
    assert "parameter 'input'" in message
    assert "i64[5](torch)" in message  # what it got
    assert "Int[Tensor, 'batch pos']" in message  # what it takes
    ar_model(tokens[None])  # [1, pos] passes


def test_float_tokens_are_refused(ar_model):
    with pytest.raises(TypeCheckError, match="parameter 'input'"):
        ar_model(torch.zeros(2, 5))  # neither int tokens nor a [batch, pos, d_model] residual


def test_a_dimension_is_one_size_across_the_parameters(ar_model):
    tokens = torch.randint(0, 16, (3, 7))
    with pytest.raises(TypeCheckError) as raised:
        ar_model(tokens, positions=torch.tensor([1, 2]))  # [2] positions for 3 rows
    message = str(raised.value)
    assert "parameter 'positions'" in message and "batch=3" in message
    assert ar_model(tokens, positions=torch.tensor([1, 2, 6])).shape == (3, ar_model.cfg.d_vocab)


def test_batch_rows_must_agree():
    tokens = torch.zeros(4, 6, dtype=torch.long)
    rows = torch.zeros(4, dtype=torch.long)
    with pytest.raises(TypeCheckError) as raised:
        Batch(tokens, tokens, answers=torch.zeros(3, dtype=torch.long), lengths=rows, doc_index=rows, roles={"query": rows})
    assert "parameter 'answers'" in str(raised.value) and "i64[3](torch)" in str(raised.value)
    with pytest.raises(TypeCheckError, match="parameter 'roles'"):
        Batch(tokens, tokens, rows, rows, rows, roles={"query": rows, "key": rows[:2]})  # every role is checked


def test_return_values_are_checked(ar_model):
    """A hook that drops a residual channel makes the block return [batch, pos, d_model - 1]
    for an input of d_model: the block's return value is refused."""
    tokens = torch.randint(0, 16, (2, 7))
    with pytest.raises(TypeCheckError) as raised:
        ar_model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x[..., :-1])])
    message = str(raised.value)
    assert "return value of hookmech.model.Block.forward" in message and "d_model=32" in message


def test_mixer_boundaries_are_checked():
    mixer = REGISTRY["attention"](d_model=8)
    with pytest.raises(TypeCheckError, match="hookmech.mixers.attention.Attention.forward"):
        mixer(torch.zeros(2, 8))  # [batch, d_model]: no position axis
    context = mixer.prefix_context(torch.zeros(3, 6, 8))
    window, start = torch.zeros(2, 2, 8), torch.tensor([1, 2])
    with pytest.raises(TypeCheckError, match="parameter 'rows'"):
        mixer.forward_from(window, context, torch.tensor([0, 1, 2]), start)  # 3 rows for a window of 2


def test_hookmech_was_imported_through_the_hook():
    assert hookmech.model.HookedLM.forward.__wrapped__ is not None  # jaxtyped's wrapper
