"""Sweep presets: the papers' grids as TOML text (`hookmech sweep --preset NAME`;
`hookmech sweep --show-preset NAME` prints one to copy and edit).

- ``ar-paper``: paper 000 §5.1 at its code's configuration (below) — AR (vocab 8192, 16 pairs as
  in the paper's code), six architectures × d_model {16…256} × 7 learning rates in [3e-5, 3e-2]
  (210 runs), 16 epochs.
- ``ar-paper-d64``: paper 000's own code at its AR configuration (tinylang
  ``experiments/configs/ar_32``, ``ar_32_nope``, ``ar_32_more_lr``): the six architectures at
  d_model 64, learned position embeddings for attention only, zoology's weight init per block
  type (``init = "zoology"``: mamba-ssm's for Mamba), ``bias = false`` in every mixer (zoology's
  meaning, see docs/mixers.md), ``l_max = 1024`` (its n_positions) in the convolutional mixers,
  16 epochs of 3126 steps. `lr` is a list to narrow (``--show-preset``, edit, run the file).
- ``ar-paper-d64-pe``: the same with learned position embeddings in every architecture and
  hookmech's N(0, 0.02) init for Mamba: appendix D.1's "configuration mistake", and what
  ``ar-paper-d64`` was before 2026-12-02 (the records in ``results/ar-paper-d64*``).
- ``ar-paper-d64-pilot``: the same models for 5000 steps (same warm-up and cosine schedule,
  over those 5000 steps) at lr {3e-4, 1e-3, 3e-3}, evaluated at the end: the learning-rate pilot.
- ``ar-cpu``: the same question at CPU scale (≈30 min on 2 cores): AR vocab 64, 4 pairs,
  fresh documents, 4000 steps; the six architectures × d_model {32, 64}
  × lr {1e-3, 3e-3}. Attention gets the CPU calibration of docs/guide.md (layer 0 limited to
  a window of 2 tokens); every model has an untied head.
- ``atr-paper``: paper 000 §5.2 — ATR, L_max {5, 10} × |Σ| {20, 8192}, 32 epochs,
  lr in [3e-5, 3e-3].
- ``atr-paper-d64``: paper 000 §5.2's easiest ATR setting (L_max 5, |Σ| 20) as its code ran it
  (tinylang ``pcfg_easy`` / ``pcfg_easy_nope``): the ``ar-paper-d64`` models (learned positions
  for attention only) on ATR, 32 epochs; attention, Based and Mamba.
- ``mamba-dconv``: paper 000 §5.4 — Mamba on AR with d_conv {0, 1, 2, 3, 4}.
- ``mqar-lr``: paper 003 fig. 1 — MQAR (sequence 64, 4 pairs), attention/Hyena/Mamba on a
  fine learning-rate grid, 3 seeds (42, 123, 777), batch 512, 50 epochs. (Paper 003 used
  weight decay 0.1; our trainer follows paper 000 and has none.)

Every preset measures ``L1.block_in`` at key, value and query at the end of each run (paper
000 fig. 3b/3c: value = induction, query = direct retrieval in layer 0, key = in layer 1).
"""

from __future__ import annotations

from ..errors import unknown
from .spec import Sweep, parse_sweep

#: paper 000's six architectures as model presets (`hookmech.model_presets`): "based" alternates BaseConv
#: and Based layers, "baseconv" a short and an implicit long convolution (appendix B)
_PAPER_ARCHS = '["attention", "based", "mamba", "h3", "hyena", "baseconv"]'
_D_MODELS = "[16, 32, 64, 128, 256]"
_MECH = """
[mech]
sites = ["L1.block_in"]
positions = ["key", "value", "query"]
n = 320
seed = 0
"""

#: paper 000's code at its AR configuration (tinylang ``experiments/configs/ar_32``, model
#: ``Zoology``: n_embd 64, n_head 1, n_layer 2, n_positions 1024, bias false): what [task],
#: [model] and [mixer_options] of the ``ar-paper-d64*`` presets share; {pos_emb} is theirs
_AR_PAPER_CODE_TEMPLATE = """
[task]
name = "ar"
vocab_size = 8192
num_kv_pairs = 16

[model]
d_model = 64
n_layers = 2
n_heads = 1
tie_embeddings = true
{pos_emb}# bias=False to every mixer, meaning what zoology's (and mamba-ssm's) `bias` means in each:
# attention's q/k/v projection, Hyena's filter bias D, Mamba's in/out projections; BaseConv,
# H3 and Based ignore it there and here (docs/mixers.md)
bias = false

# n_positions 1024 is the l_max of the convolutional mixers (it shapes their filters: the
# implicit filter's time axis and decay, H3's d_state); ours defaults to the document length.
# Short convolutions start as nn.Conv1d (zoology's init leaves them alone); Hyena's filter
# input z is trained (zoology makes it a parameter, tinylang's AdamW trains all at one lr)
[mixer_options.hyena]
l_max = 1024
conv_bias_init = "torch"
train_filter_z = true

[mixer_options.baseconv]
l_max = 1024
conv_bias_init = "torch"

[mixer_options.h3]
l_max = 1024
"""

#: what the paper's table ran (tinylang experiments/README.md: "NoPE for non-attention only"):
#: attention from ``ar_32`` (learned positions), every other architecture from ``ar_32_nope`` and
#: ``ar_32_more_lr`` (``pos_emb: false``); the weights drawn as zoology's ``_init_weights`` draws
#: them for each block type (mamba-ssm's scheme for Mamba, N(0, 0.02) otherwise)
_AR_PAPER_CODE = _AR_PAPER_CODE_TEMPLATE.replace(
    "{pos_emb}",
    """# no pos_emb: each architecture's own default, learned for attention and none for the SSMs
# (tinylang: ar_32 for attention, ar_32_nope / ar_32_more_lr for the others)
init = "zoology"
""",
)
#: appendix D.1's "configuration mistake": learned position embeddings in every architecture and
#: hookmech's N(0, 0.02) init for Mamba too (what ``ar-paper-d64`` ran before 2026-12-02)
_AR_PAPER_CODE_PE = _AR_PAPER_CODE_TEMPLATE.replace(
    "{pos_emb}",
    """# learned absolute position embeddings for every architecture (appendix D.1's set)
pos_emb = "learned"
""",
)

#: the same models on paper 000 §5.2's easiest ATR setting (tinylang ``experiments/configs/
#: pcfg_easy`` for attention, ``pcfg_easy_nope`` for the others: the model block of ``ar_32`` /
#: ``ar_32_nope`` unchanged, the PCFG language, 32 epochs of 3126 steps; the task's defaults are
#: that setting, L_max 5 and |Σ| 20)
_ATR_PAPER_CODE = _AR_PAPER_CODE.replace(
    """[task]
name = "ar"
vocab_size = 8192
num_kv_pairs = 16
""",
    """[task]
name = "atr"
""",
)

PRESETS: dict[str, str] = {
    "ar-paper": f"""\
name = "ar-paper"
{_AR_PAPER_CODE}
[train]
epochs = 16
n_train = 100032

[grid]
arch = {_PAPER_ARCHS}
d_model = {_D_MODELS}
lr = [3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
seed = [0]
{_MECH}""",
    "ar-paper-d64": f"""\
name = "ar-paper-d64"
{_AR_PAPER_CODE}
[train]
# tinylang: cosine schedule, warm-up 10 %, batch 32, 16 epochs x 3126 steps
epochs = 16
n_train = 100032

[grid]
arch = {_PAPER_ARCHS}
# narrow to each architecture's best rate(s) and run one file per architecture: --show-preset,
# edit, run the file (docs/results.md lists the rates the paper's sweep found best)
lr = [1e-3, 3e-3, 1e-2]
seed = [0]
{_MECH}""",
    "ar-paper-d64-pe": f"""\
name = "ar-paper-d64-pe"
{_AR_PAPER_CODE_PE}
[train]
epochs = 16
n_train = 100032

[grid]
arch = {_PAPER_ARCHS}
lr = [3e-4, 1e-3, 3e-3]
seed = [0]
{_MECH}""",
    "ar-paper-d64-pilot": f"""\
name = "ar-paper-d64-pilot"
{_AR_PAPER_CODE}
[train]
n_train = 100032
eval_every = 5000

[grid]
arch = {_PAPER_ARCHS}
lr = [3e-4, 1e-3, 3e-3]
seed = [0]
# 5000 steps, warm-up 10 % and cosine decay over those 5000 steps; evaluated at the end.
# A grid key, so that run ids differ from ar-paper-d64's (a finished run is never redone)
steps = [5000]
{_MECH}""",
    "ar-cpu": f"""\
name = "ar-cpu"

[task]
name = "ar"
vocab_size = 64
num_kv_pairs = 4

[train]
steps = 4000
n_train = 0
warmup_frac = 0.5
eval_every = 500
ckpt_every = 1000

[model]
tie_embeddings = false

[mixer_options.attention]
# CPU calibration (docs/guide.md): full attention in layer 0 stays at chance for tens of
# thousands of steps on CPU; a window of 2 (current + previous token) learns in a few thousand
L0.window = 2

[grid]
arch = {_PAPER_ARCHS}
d_model = [32, 64]
lr = [1e-3, 3e-3]
seed = [0]
{_MECH}every = 1000
""",
    "atr-paper": f"""\
name = "atr-paper"

[task]
name = "atr"

[train]
epochs = 32
n_train = 100032

[grid]
"task.max_rhs_len" = [5, 10]
"task.num_terminals" = [20, 8192]
arch = {_PAPER_ARCHS}
d_model = {_D_MODELS}
lr = [3e-5, 1e-4, 3e-4, 1e-3, 3e-3]
seed = [0]
{_MECH}""",
    "atr-paper-d64": f"""\
name = "atr-paper-d64"
{_ATR_PAPER_CODE}
[train]
# tinylang pcfg_easy(_nope): cosine schedule, warm-up 10 %, batch 32, 32 epochs x 3126 steps
epochs = 32
n_train = 100032

[grid]
arch = ["attention", "based", "mamba"]
# paper 000 fig. 4's range is 3e-5 ... 3e-3: narrow to one rate per file
lr = [1e-3]
seed = [0]
{_MECH}""",
    "mamba-dconv": f"""\
name = "mamba-dconv"

[task]
name = "ar"
vocab_size = 8192
num_kv_pairs = 16

[train]
epochs = 16
n_train = 100032

[model]
arch = "mamba"

[grid]
d_conv = [0, 1, 2, 3, 4]
d_model = {_D_MODELS}
lr = [3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
seed = [0]
{_MECH}""",
    "mqar-lr": f"""\
name = "mqar-lr"

[task]
name = "mqar"
vocab_size = 8192
seq_len = 64
num_kv_pairs = 4

[train]
epochs = 50
n_train = 100000
batch_size = 512

[grid]
mixer = ["attention", "hyena", "mamba"]
d_model = [64, 128, 256]
lr = [1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2]
seed = [42, 123, 777]
{_MECH}""",
}


def preset_text(name: str) -> str:
    """Return the TOML text of preset `name` (unknown names are UsageErrors with suggestions)."""
    if name not in PRESETS:
        raise unknown("preset", name, PRESETS)
    return PRESETS[name]


def load_preset(name: str) -> Sweep:
    """Return preset `name` as a parsed `Sweep`."""
    return parse_sweep(preset_text(name), name=name)
