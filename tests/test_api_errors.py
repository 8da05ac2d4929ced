"""Bad arguments to the library's model API: one `UsageError` naming the value and what is accepted,
never a raw IndexError, RuntimeError, KeyError or AttributeError from torch or TransformerLens.

Rows are (id, tokens, message substring); every row runs through `run_with_cache`,
`run_with_hooks` and `hookmech.attention_maps`. Add a row for every bad argument found.
"""

from __future__ import annotations

import pytest
import torch

import hookmech
from hookmech.errors import UsageError
from helpers import ATTENTION_FIXTURE

D_VOCAB = 67  # the attention fixture's

#: (id, tokens, message substring)
TOKEN_ROWS = [
    ("id-past-the-vocabulary", torch.tensor([[1, D_VOCAB]]), f"token id {D_VOCAB} is outside the vocabulary 0..66"),
    ("negative-id", torch.tensor([[1, -1]]), "token id -1 is outside the vocabulary 0..66"),
    ("huge-id", torch.tensor([[2**40, 1]]), f"token id {2**40} is outside the vocabulary"),
    ("float-tokens", torch.tensor([[1.0, 2.0]]), "integer ids (torch.int64 or torch.int32), got torch.float32"),
    ("bool-tokens", torch.tensor([[True, False]]), "got torch.bool"),
    ("empty-batch", torch.zeros(0, 4, dtype=torch.long), "at least one row and one position, got shape [0, 4]"),
    ("no-positions", torch.zeros(2, 0, dtype=torch.long), "got shape [2, 0]"),
    ("one-dimensional", torch.tensor([1, 2]), "must be [batch, pos]"),
    ("a-list", [[1, 2]], "tokens must be a torch tensor [batch, pos] of token ids, got list"),
]


@pytest.fixture(scope="module")
def model():
    return hookmech.load(ATTENTION_FIXTURE)


def _run_with_cache(model, tokens):
    return model.run_with_cache(tokens)


def _run_with_hooks(model, tokens):
    return model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_mixer_in", lambda act, hook: act)])


def _attention_maps(model, tokens):
    return hookmech.attention_maps(model, tokens)


CALLS = {"run_with_cache": _run_with_cache, "run_with_hooks": _run_with_hooks, "attention_maps": _attention_maps}


#: (call, row id) pairs not run: attention_maps is annotated `tokens: Tensor`, so the suite's run-time
#: type check refuses a list before the function runs (users get the UsageError)
TYPED_OUT = {("attention_maps", "a-list")}


@pytest.mark.parametrize(
    ("call", "tokens", "words"),
    [(call, *row[1:]) for call in sorted(CALLS) for row in TOKEN_ROWS if (call, row[0]) not in TYPED_OUT],
    ids=[f"{call}-{row[0]}" for call in sorted(CALLS) for row in TOKEN_ROWS if (call, row[0]) not in TYPED_OUT],
)
def test_bad_tokens_are_a_usage_error_naming_the_value(model, call, tokens, words):
    with pytest.raises(UsageError) as raised:
        CALLS[call](model, tokens)
    assert words in str(raised.value) and str(raised.value).startswith(f"{call}: "), raised.value


@pytest.mark.parametrize("call", sorted(CALLS))
def test_good_tokens_at_the_edges_of_the_vocabulary_run(model, call):
    """The check refuses nothing valid: ids 0 and d_vocab - 1, int32 as int64."""
    tokens = torch.tensor([[0, D_VOCAB - 1, 5]])
    first, second = CALLS[call](model, tokens), CALLS[call](model, tokens.to(torch.int32))
    if call == "attention_maps":
        assert all(torch.equal(first[layer], second[layer]) for layer in first)
    else:
        output = first[0] if isinstance(first, tuple) else first
        assert output.shape == (1, 3, D_VOCAB)


def test_an_unknown_hook_name_in_run_with_hooks_is_a_usage_error_with_suggestions(model):
    tokens = torch.tensor([[1, 2]])
    with pytest.raises(UsageError, match=r"unknown hook 'blocks.0.hook_mixer_inn' \(did you mean: blocks.0.hook_mixer_in"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_mixer_inn", lambda act, hook: act)])
    with pytest.raises(UsageError, match="unknown hook 'blocks.9.hook_resid_pre'"):
        model.run_with_hooks(tokens, bwd_hooks=[("blocks.9.hook_resid_pre", lambda grad, hook: grad)])
    with pytest.raises(UsageError, match="unknown hook 'blocks.0.mixer'"):  # a module, not a hook
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mixer", lambda act, hook: act)])


def test_hook_aliases_and_filters_still_reach_transformer_lens(model):
    """What TransformerLens accepts still runs: an alias, a name filter, a residual stream input."""
    tokens = torch.tensor([[1, 2, 3]])
    seen = []
    model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_out", lambda act, hook: seen.append(hook.name))])
    model.run_with_hooks(tokens, fwd_hooks=[(lambda name: name.endswith("hook_mixer_in"), lambda act, hook: None)])
    resid = torch.zeros(1, 3, model.cfg.d_model)
    assert model.run_with_hooks(resid, start_at_layer=1).shape == (1, 3, D_VOCAB)
    assert seen == ["blocks.0.hook_mixer_out"]


def test_the_token_check_leaves_the_model_as_it_was(model):
    """A refused call attaches no hook (TransformerLens would reset them only at the end of a run)."""
    with pytest.raises(UsageError):
        model.run_with_hooks(torch.tensor([[D_VOCAB]]), fwd_hooks=[("blocks.0.hook_mixer_in", lambda a, hook: a)])
    assert not any(point.fwd_hooks for point in model.hook_dict.values())


#: library calls with a wrong kind of argument, each refused by one UsageError of hookmech's own. They
#: run in a process of their own: the suite's run-time type check would refuse most of them first
#: (tests/runtime_typecheck.py), and a user's process has none.
LIBRARY_CALLS = {
    "patch-source-none": ("patching.patch(model, None, 'L1.block_in', 'value')",
                          "patch source must be a Batch, a CacheFile or a cache path, got NoneType"),
    "load-none": ("hookmech.load(None)", "a checkpoint is named by a path (str or Path), got NoneType"),
    "forward-id-past-the-vocabulary": ("model(torch.tensor([[1, 67]]))",
                                       "HookedLM: token id 67 is outside the vocabulary 0..66"),
    "forward-negative-id": ("model(torch.tensor([[-1, 1]]))", "HookedLM: token id -1 is outside the vocabulary"),
    "hook-not-callable": ("model.run_with_hooks(batch.tokens, fwd_hooks=[('blocks.0.hook_mixer_in', 3)])",
                          "run_with_hooks: the hook for blocks.0.hook_mixer_in is a int, not a function"),
    "filter-hook-not-callable": ("model.run_with_hooks(batch.tokens, fwd_hooks=[(lambda name: True, None)])",
                                 "run_with_hooks: the hook for a filter is a NoneType, not a function"),
    **{
        f"patch-memory-{label}": (f"patching.patch(model, batch, 'L1.block_in', 'value', memory={value})",
                                  f"memory must be a number of bytes > 0 (or None: all rows at once), got {shown}")
        for label, value, shown in [("negative", "-1", "-1"), ("nan", "float('nan')", "nan"),
                                    ("text", "'1GB'", "'1GB'"), ("zero", "0", "0")]
    },
}

_CALLER = """
import json, sys, torch
import hookmech
from hookmech import patching
model = hookmech.load(hookmech.fixture("attention_ar_cpu"))
batch = hookmech.tasks.from_checkpoint(hookmech.fixture("attention_ar_cpu")).sample(4, seed=0)
for name, call in json.loads(sys.argv[1]).items():
    try:
        eval(call)
        print(json.dumps([name, None, ""]))
    except Exception as error:
        print(json.dumps([name, type(error).__name__, str(error)]))
"""


@pytest.fixture(scope="module")
def library_refusals():
    """{case: (exception type name or None, message)} of LIBRARY_CALLS, run in one plain process."""
    import json
    import subprocess
    import sys

    calls = json.dumps({name: call for name, (call, _) in LIBRARY_CALLS.items()})
    done = subprocess.run([sys.executable, "-c", _CALLER, calls], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return {name: (kind, message) for name, kind, message in map(json.loads, done.stdout.splitlines())}


@pytest.mark.parametrize(("case", "words"), [(name, words) for name, (_, words) in LIBRARY_CALLS.items()],
                         ids=list(LIBRARY_CALLS))
def test_a_library_call_with_a_wrong_argument_is_one_usage_error(case, words, library_refusals):
    kind, message = library_refusals[case]
    assert kind == "UsageError" and words in message, (kind, message)


def test_loading_a_folder_says_what_the_folder_lacks(tmp_path):
    """A folder is read as a Hugging Face model folder (`hookmech.pretrained`), not as a missing file."""
    from hookmech.errors import HookmechError

    # a folder may be a Hugging Face model folder; one without config.json is neither that nor a checkpoint file
    with pytest.raises(HookmechError, match=r"config.json: missing: .* is a folder, and neither a Hugging Face "
                       r"model folder \(config.json and weights\) nor a checkpoint file \(\.safetensors\)$"):
        hookmech.load(tmp_path)
