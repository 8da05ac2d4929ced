"""docs/pretrained.md's commands for Mamba-130m and Pythia-160m run as written.

The page's command block (marked ``<!-- pretrained-commands -->``) is read from the page, and each
``hookmech ...`` line runs on the command line in a temporary folder, on a tiny random folder of
the same family and depth (24 Mamba-1 layers; 12 GPT-NeoX layers with rotary_pct 0.25 and parallel
residual), saved with transformers' `save_pretrained` beside a word-level tokenizer, in place of the
downloaded one: the folder names are replaced, ``--n 320`` by ``--n 12`` and DAS's 200 steps by 10
(the time, not the command, changes: 200 steps took 23 s of the test's 30 s of CPU). Each must
exit 0 and leave what the page says it writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from helpers import REPO, run_cli
from tokenizer_files import WORD_LEVEL_OTHERS, WORD_LEVEL_SPECIALS, WORDS, word_level_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

MARKER = "<!-- pretrained-commands -->"
D_VOCAB = len(WORD_LEVEL_SPECIALS) + len(WORD_LEVEL_OTHERS) + len(WORDS)


def documented_commands() -> list[list[str]]:
    """The argument lists of the ``hookmech`` lines of the fenced block after `MARKER`."""
    page = (REPO / "docs" / "pretrained.md").read_text()
    block = page[page.index(MARKER) :].split("```", 2)[1]
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("hookmech ")]


def _tiny_folder(family: str, folder: Path) -> Path:
    torch.manual_seed(0)
    if family == "mamba-130m":
        config = transformers.MambaConfig(vocab_size=D_VOCAB, hidden_size=16, num_hidden_layers=24, state_size=4)
        model = transformers.MambaForCausalLM(config)
    else:
        config = transformers.GPTNeoXConfig(
            vocab_size=D_VOCAB, hidden_size=32, num_hidden_layers=12, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False,
        )
        model = transformers.GPTNeoXForCausalLM(config)
    from transformers.utils import logging

    logging.disable_progress_bar()
    model.eval().save_pretrained(folder)
    return word_level_tokenizer(folder)


def test_the_page_documents_every_command_for_both_models():
    commands = documented_commands()
    for folder in ("mamba-130m", "pythia-160m"):
        ran = [argv[0] for argv in commands if folder in argv]
        assert ran == ["sites", "cache", "patch", "das", "view"], f"{folder}: {ran}"


@pytest.mark.parametrize("family", ["mamba-130m", "pythia-160m"])
def test_the_documented_commands_run_on_a_tiny_folder_of_each_family(family, tmp_path, monkeypatch, capsys):
    folder = _tiny_folder(family, tmp_path / "weights")
    monkeypatch.chdir(tmp_path)
    for argv in documented_commands():
        if family not in argv:
            continue
        argv = [str(folder) if arg == family else arg for arg in argv]
        argv = [re.sub(r"^320$", "12", arg) for arg in argv] + (["--steps", "10"] if argv[0] == "das" else [])
        code, out, err = run_cli(argv, capsys)
        assert code == 0, f"hookmech {shlex.join(argv)}: {err}"
        if "-o" in argv:
            assert (tmp_path / argv[argv.index("-o") + 1]).exists()
