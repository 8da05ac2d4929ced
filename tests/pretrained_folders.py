"""Small Hugging Face model folders made in the tests (nothing is downloaded): a model built with
transformers' own config class, its weights redrawn, saved with ``save_pretrained`` beside a small
word-level tokenizer made with `tokenizers`. The tests that use them skip without transformers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

#: the tokenizer's words: specials first, then content words (ids in this order)
WORDS = ["<pad>", "<bos>", "<unk>", *(f"w{i}" for i in range(45))]


def word_tokenizer():
    """A word-level `tokenizers.Tokenizer` over `WORDS` (whitespace-split), as a
    transformers ``PreTrainedTokenizerFast``."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    core = tokenizers.Tokenizer(WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", unk_token="<unk>")


def redraw(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Redraw every parameter of `model` (in place; returns it): matrices N(0, 1/fan-in), vectors
    (biases, norm weights) 1 + N(0, 0.2) for norm weights and N(0, 0.2) otherwise. transformers'
    init (N(0, 0.02), norms at 1 and 0) leaves attention near uniform and the norms the identity,
    so that a norm or a bias mapped to the wrong place would not show within 1e-5."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if param.dim() >= 2:
                param.copy_(noise * param.shape[-1] ** -0.5)
            elif "norm" in name or "ln" in name.split(".")[-2]:
                param.copy_(1 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            else:
                param.copy_(0.2 * noise)
    return model


def save(model, folder: Path, **save_options) -> Path:
    """Save `model` and the word tokenizer into `folder` (``save_pretrained``, without its progress
    bar on stderr, which the command-line tests read); return the folder."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    model.save_pretrained(folder, **save_options)
    word_tokenizer().save_pretrained(folder)
    return folder


def gpt2(folder: Path | None = None, seed: int = 0, **options):
    """A random GPT-2 (2 layers, d_model 32, 4 heads, the words' vocabulary): the
    ``GPT2LMHeadModel`` in eval mode, saved into `folder` when given. `options` override the
    ``GPT2Config``'s."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        **{"vocab_size": len(WORDS), "n_positions": 40, "n_embd": 32, "n_layer": 2, "n_head": 4,
           "bos_token_id": 1, "eos_token_id": 1, **options}
    )
    torch.manual_seed(seed)
    model = redraw(transformers.GPT2LMHeadModel(config), seed).eval()
    if folder is not None:
        save(model, folder)
    return model


def pythia(folder: Path | None = None, seed: int = 0, **options):
    """A random GPT-NeoX in Pythia's structure (rotary on a quarter of each head, parallel
    residual, untied head; 2 layers, d_model 32, 4 heads of 8 channels): the
    ``GPTNeoXForCausalLM`` in eval mode, saved into `folder` when given. `options` override the
    ``GPTNeoXConfig``'s (``use_parallel_residual=False``, ``rotary_pct=0.5`` ...)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        **{"vocab_size": len(WORDS), "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "max_position_embeddings": 40, "rotary_pct": 0.25, "rotary_emb_base": 10000,
           "use_parallel_residual": True, "bos_token_id": 1, "eos_token_id": 1, **options}
    )
    torch.manual_seed(seed)
    model = redraw(transformers.GPTNeoXForCausalLM(config), seed).eval()
    if folder is not None:
        save(model, folder)
    return model


#: the families' structures the tests run: name -> (maker, its options)
FAMILY_CASES = {
    "gpt2": (gpt2, {}),
    "pythia": (pythia, {}),
    "pythia-sequential": (pythia, {"use_parallel_residual": False, "rotary_pct": 0.5}),
}


def folder_of(case: str, root: Path, seed: int = 0) -> Path:
    """Save family case `case` (`FAMILY_CASES`) into ``root/case`` and return the folder."""
    make, options = FAMILY_CASES[case]
    folder = root / case
    make(folder, seed, **options)
    return folder
