"""Small transformers Mamba and Mamba-2 models saved as Hugging Face folders, made in the tests
(nothing is downloaded), for the parity tests of `hookmech.pretrained.mamba` and `.mamba2`.

Each model is built with transformers' own config class and its every parameter is then moved
off its initial value (norm weights off 1, biases off 0, D off 1, ...), so that a tensor loaded
into the wrong place, or not at all, changes the numbers."""
from __future__ import annotations

from pathlib import Path

import torch

#: issue 47's parity contract: hookmech's logits and residuals equal transformers' (float32, eval
#: mode) within 1e-5; measured 1e-6 on these models (the same sums in other orders: a chunked SSD
#: against transformers' padded one, a scan against a loop)
PARITY_TOL = 1e-5


def nudge(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Add N(0, 0.1²) to every parameter of `model` (in place; returns it)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def save_folder(model, folder: Path) -> Path:
    """Write `model` (a transformers model) to `folder` with `save_pretrained`, and beside it a
    word-level tokenizer of its vocabulary made with `tokenizers` (``tokenizer.json``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def mamba_folder(folder: Path, seed: int = 0, **options):
    """Return ``(folder, model)``: a random 3-layer transformers `MambaForCausalLM` (d_model 32,
    d_state 8, its other fields transformers' defaults, or `options`) saved in `folder`."""
    from transformers import MambaConfig, MambaForCausalLM

    fields = {"vocab_size": 40, "hidden_size": 32, "state_size": 8, "num_hidden_layers": 3, **options}
    torch.manual_seed(seed)
    model = nudge(MambaForCausalLM(MambaConfig(**fields)), seed).eval()
    return save_folder(model, folder), model


def mamba2_folder(folder: Path, seed: int = 0, **options):
    """Return ``(folder, model)``: a random 3-layer transformers `Mamba2ForCausalLM` with 8 heads of
    8 channels in 2 groups (d_model 32, d_state 8, chunks of 8 positions), or `options`, saved in `folder`."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    fields = {
        "vocab_size": 40,
        "hidden_size": 32,
        "state_size": 8,
        "num_hidden_layers": 3,
        "num_heads": 8,
        "head_dim": 8,
        "n_groups": 2,
        "chunk_size": 8,
        **options,
    }
    torch.manual_seed(seed)
    model = nudge(Mamba2ForCausalLM(Mamba2Config(**fields)), seed).eval()
    return save_folder(model, folder), model


def load(folder: Path, **options):
    """hookmech's model of the Hugging Face `folder` (`hookmech.from_pretrained`: eval mode,
    float32 unless `options` say otherwise)."""
    from hookmech.pretrained import from_pretrained

    return from_pretrained(folder, **options)


def transformers_run(model, tokens: torch.Tensor):
    """Return transformers' ``(logits, hidden_states)`` of `tokens` ``[batch, pos]`` (no gradient)."""
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True)
    return out.logits, out.hidden_states
