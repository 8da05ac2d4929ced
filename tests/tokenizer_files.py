"""Tokenizers made in the tests with the `tokenizers` library, written to a folder as a Hugging
Face folder holds them (nothing is downloaded). Callers skip without `tokenizers`
(``pytest.importorskip("tokenizers")``)."""
from __future__ import annotations

import json
from pathlib import Path

#: lowercase words of 3+ letters (nl-ar's single-token words), then a few the tasks must skip
WORDS = (
    "apple bread chair dance eagle fence grape house igloo jelly kite lemon mango night ocean piano queen river "
    "stone table uncle violin water xenon yacht zebra cat dog sun tree milk lamp shoe door book car bird fish "
    "frog gold hill iron jam key leaf moon nest owl pear ring salt tent vase wolf"
).split()
#: word-level specials (ids 0, 1, 2) and other entries that are not nl-ar words
WORD_LEVEL_SPECIALS = ("[PAD]", "[UNK]", "<bos>")
WORD_LEVEL_OTHERS = (",", ":", ";", ".", "is", "the", "of", "an", "Paris", "ROME")


def word_level_tokenizer(folder: Path) -> Path:
    """Write a word-level tokenizer (whitespace and punctuation split) to `folder`: ids 0-2 the
    specials, then `WORD_LEVEL_OTHERS`, then `WORDS`; tokenizer_config.json declares ``<bos>``
    and the pad ``[PAD]``. Returns the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    entries = [*WORD_LEVEL_SPECIALS, *WORD_LEVEL_OTHERS, *WORDS]
    tokenizer = Tokenizer(models.WordLevel({token: i for i, token in enumerate(entries)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(WORD_LEVEL_SPECIALS))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "pad_token": "[PAD]"}))
    return folder


def bpe_tokenizer(folder: Path, vocab_size: int = 500):
    """Write a byte-level BPE (GPT-2's kind) trained on sentences of `WORDS` to `folder` as
    tokenizer.json, with special_tokens_map.json declaring ``<|endoftext|>`` as BOS and EOS.
    Returns (folder, the `tokenizers.Tokenizer`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) + ", the end. Paris is in France; Rome is in Italy." for i in range(len(WORDS))]
    tokenizer.train_from_iterator(corpus * 3, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})
    )
    return folder, tokenizer


def saved_random_model(path: Path, d_vocab: int, n_ctx: int = 128, seed: int = 0) -> Path:
    """Save a random 2-layer attention model of `d_vocab` ids (no task stored) to `path`; return it."""
    import torch

    import hookmech
    from hookmech.config import build_config

    torch.manual_seed(seed)
    model = hookmech.HookedLM(build_config(d_vocab=d_vocab, n_ctx=n_ctx, d_model=32, n_layers=2)).eval()
    hookmech.save(model, path)
    return path
