"""A Hugging Face folder through the whole mechanistic evaluation on the command line: `hookmech
patch --ckpt DIR --task nl-ar --site 'L*.block_in' --pos key,value,query`, on tiny random GPT-2,
Pythia, Mamba and Mamba-2 folders saved with transformers' `save_pretrained` beside a word-level tokenizer.

References: p_clean and p_corrupt are transformers' own softmax at the query, on the tokens the
task drew (an independent forward); and two invariants of an interchange at the embedding: the
clean and corrupt rows differ only at the key, so patching `L0.block_in` at the key restores the
clean run exactly (p_patched = p_clean) and patching it at the value or the query changes nothing
(p_patched = p_corrupt)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ENGINE_TOL, run_cli
from tokenizer_files import WORD_LEVEL_OTHERS, WORD_LEVEL_SPECIALS, WORDS, word_level_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

D_VOCAB = len(WORD_LEVEL_SPECIALS) + len(WORD_LEVEL_OTHERS) + len(WORDS)
N_ROWS = 12


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=D_VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4)
        return transformers.GPT2LMHeadModel(config)
    if family == "pythia":
        config = transformers.GPTNeoXConfig(
            vocab_size=D_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, rotary_pct=0.25, use_parallel_residual=True,
        )
        return transformers.GPTNeoXForCausalLM(config)
    if family == "mamba2":  # several heads in two groups of B/C, Δ clamped
        config = transformers.Mamba2Config(
            vocab_size=D_VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, num_heads=8, head_dim=8,
            n_groups=2, chunk_size=8, time_step_limit=(0.01, 1.0),
        )
        return transformers.Mamba2ForCausalLM(config)
    config = transformers.MambaConfig(vocab_size=D_VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8)
    return transformers.MambaForCausalLM(config)


@pytest.fixture(scope="module", params=["gpt2", "pythia", "mamba", "mamba2"])
def folder(request, tmp_path_factory):
    """(family, folder, the transformers model in eval mode) of a tiny random folder with a tokenizer."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    root = tmp_path_factory.mktemp(request.param)
    model = _model(request.param).eval()
    with torch.no_grad():  # off transformers' init, so that a misplaced weight shows
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(root)
    word_level_tokenizer(root)
    return request.param, root, model


def _query_probability(model, tokens: torch.Tensor, query: torch.Tensor, answers: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(tokens).logits
    rows = torch.arange(len(tokens))
    return logits[rows, query].softmax(-1)[rows, answers].mean().item()


def test_patch_runs_on_a_folder_with_nl_ar(folder, capsys):
    import hookmech

    family, root, hf_model = folder
    code, out, err = run_cli(
        ["patch", "--ckpt", root, "--task", "nl-ar", "--task-opt", "num_kv_pairs=4", "--n", N_ROWS,
         "--site", "L*.block_in", "--pos", "key,value,query", "--json"],
        capsys,
    )
    assert code == 0, err
    records = {(r["site"], r["pos"]): r for r in json.loads(out)}
    assert set(records) == {(f"L{l}.block_in", pos) for l in (0, 1) for pos in ("key", "value", "query")}

    task = hookmech.tasks.for_checkpoint(root, "nl-ar", {"num_kv_pairs": 4})
    batch = task.sample(N_ROWS, seed=hookmech.tasks.EXAMPLES_SEED)
    assert (batch.tokens != batch.corrupt_tokens).sum(1).eq(1).all()  # one token differs: the key
    query = batch.roles["query"]
    p_clean = _query_probability(hf_model, batch.tokens, query, batch.answers)
    p_corrupt = _query_probability(hf_model, batch.corrupt_tokens, query, batch.answers)
    for record in records.values():
        assert record["n"] == N_ROWS
        assert record["p_clean"] == pytest.approx(p_clean, abs=ENGINE_TOL)
        assert record["p_corrupt"] == pytest.approx(p_corrupt, abs=ENGINE_TOL)
    assert records[("L0.block_in", "key")]["p_patched"] == pytest.approx(p_clean, abs=ENGINE_TOL)
    for pos in ("value", "query"):
        assert records[("L0.block_in", pos)]["p_patched"] == pytest.approx(p_corrupt, abs=ENGINE_TOL)
