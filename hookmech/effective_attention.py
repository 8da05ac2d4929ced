"""Effective attention: each layer's sequence mixing as a matrix over positions, exactly.

Every mixer of hookmech mixes positions by an operator that is linear in some value once the
input has fixed its data-dependent parts (queries, keys, gates, decays). `attention_maps` writes
that operator as M ``[batch, head_or_channel, query_pos, key_pos]``, so that a hook inside the
mixer is M applied to the values over positions: the attention pattern for attention, the
unrolled recurrence for Mamba, Mamba-2, DeltaNet (key removal included) and RWKV, the
normalised kernel for Based, the gated Toeplitz operator for the convolutions. Each mixer's
`effective_attention` docstring says which hook, which values, and what else the hook adds;
this module knows no architecture (docs/guide.md, "Effective attention", lists them all).

`induction_scores` reads induction off M on the task's own documents: the weight the query puts
on the value of its pair, and the value on its key (`TASK_SCORES`). Olsson et al. (2022)'s
prefix-matching score on a random sequence repeated twice, which is out of distribution for a
model trained on a task, is its option ``random_repeat=True``.

The module is named for the operator, not for `attention_maps`: a submodule named like the
function the package exports lazily would replace it as ``hookmech.attention_maps`` once imported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import HookmechError, UsageError
from .hook_names import block_hook
from .mixers.capabilities import EffectiveAttentionMap, require
from .tasks.batch import Batch
from .validate import check_tokens

SUMMARIES = ("mean", None)
#: the largest per-channel result `attention_maps(summary=None)` returns, in elements
#: (batch · channels · pos²): 256 MiB of float32
MAX_CHANNEL_ELEMENTS = 64 * 2**20
#: `induction_scores` on task documents: score name -> (the role that attends, the role attended);
#: "value->key" reads the later of the pair's two positions on the earlier (`task_induction_scores`)
TASK_SCORES = {"query->value": ("query", "value"), "value->key": ("value", "key")}
#: the score of ``induction_scores(random_repeat=True)``
RANDOM_REPEAT_SCORE = "prefix_matching"
#: rows of task documents whose maps `induction_scores` holds at once: this many query × key
#: entries per head or channel mean (16M: 64 MiB of float32 per head)
MAX_ROW_ELEMENTS = 2**24


def attention_maps(model, tokens: Tensor, *, summary: str | None = "mean") -> dict[int, Tensor]:
    """Return ``{layer: M}`` for `tokens` ``[batch, pos]``: each M a float32 tensor
    ``[batch, head_or_channel, query_pos, key_pos]``, the layer's `EffectiveAttentionMap.effective_attention`
    of its input (``blocks.{layer}.hook_mixer_in`` of a run on `tokens`).

    Axis 1 is the mixer's `attention_axis`. Heads are always kept. Per-channel operators
    (Mamba, Hyena, BaseConv: one M per channel) are averaged over channels with
    ``summary="mean"`` (axis 1 of size 1) or returned whole with ``summary=None``, which is
    refused above `MAX_CHANNEL_ELEMENTS` elements per layer. Mixers compute M one row at a
    time in that case, so the mean costs one row's per-channel M in memory, not the batch's.
    Hooks attached to the model fire during the run that records the mixer inputs; M itself
    is computed as the mixers run with no hook inside them in use. A mixer without the
    capability (`hookmech.mixers.EffectiveAttentionMap`) is refused, naming it, before anything runs.
    """
    if summary not in SUMMARIES:
        raise UsageError(f"attention_maps: summary must be 'mean' or None, got {summary!r}")
    check_tokens(tokens, model.cfg, "attention_maps")
    mixers = [
        require(block.mixer, EffectiveAttentionMap, f"attention_maps (layer {layer})")
        for layer, block in enumerate(model.blocks)
    ]
    names = [block_hook(layer, "mixer_in") for layer in range(len(model.blocks))]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=names, return_cache_object=False)
        return {
            layer: _layer_map(layer, mixer, cache[name], summary)
            for layer, (mixer, name) in enumerate(zip(mixers, names, strict=True))
        }


def _layer_map(layer: int, mixer: EffectiveAttentionMap, x: Tensor, summary: str | None) -> Tensor:
    """Return one layer's M ``[batch, head_or_channel, pos, pos]`` of its mixer input `x`."""
    if mixer.attention_axis != "channel":
        return mixer.effective_attention(x)
    maps: list[Tensor] = []
    for row in x.split(1):
        M = mixer.effective_attention(row)
        if summary is None and not maps:
            _check_size(layer, len(x), M.shape[1], x.shape[1])
        maps.append(M.mean(dim=1, keepdim=True) if summary == "mean" else M)
    return torch.cat(maps)


def _check_size(layer: int, batch: int, channels: int, n_pos: int) -> None:
    """Raise a HookmechError when a layer's per-channel maps would exceed `MAX_CHANNEL_ELEMENTS`."""
    size = batch * channels * n_pos**2
    if size > MAX_CHANNEL_ELEMENTS:
        raise HookmechError(
            f"attention_maps(summary=None): layer {layer} has one map per channel, "
            f"{batch} rows × {channels} channels × {n_pos}² positions = {size:,} elements, "
            f"over the limit of {MAX_CHANNEL_ELEMENTS:,}; pass fewer rows or shorter sequences, "
            "or summary='mean' for the channel mean"
        )


def repeated_tokens(d_vocab: int, seq_len: int, batch: int, seed: int = 0) -> Tensor:
    """Return ``[batch, 2 * seq_len]`` long: per row, `seq_len` distinct tokens drawn uniformly
    from ``range(d_vocab)``, then the same again; deterministic in `seed`. Distinct tokens
    make the previous occurrence of every token in the second half the one seq_len back."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.stack([torch.randperm(d_vocab, generator=generator)[:seq_len] for _ in range(batch)])
    return first.repeat(1, 2)


def prefix_matching(maps: Tensor, seq_len: int) -> Tensor:
    """Return ``[head_or_channel]``: the mean weight that M ``[batch, head_or_channel, 2 seq_len,
    2 seq_len]`` of a sequence repeated twice puts from each query t of the second half on
    key t - seq_len + 1, the token after t's previous occurrence (mean over t and rows)."""
    # the diagonal at offset 1 - seq_len runs from (seq_len - 1, 0); its first entry is a first-half query
    stripe = maps.diagonal(offset=1 - seq_len, dim1=-2, dim2=-1)[..., 1:]  # [batch, h, seq_len]
    return stripe.mean(dim=(0, -1))


def induction_scores(
    model,
    batch: Batch | int | None = None,
    *,
    random_repeat: bool = False,
    seq_len: int | None = None,
    rows: int = 16,
    seed: int = 0,
) -> dict[int, dict[str, Tensor]]:
    """Return ``{layer: {score: values}}``, each `values` one float per head ``[head]``, or ``[1]``
    for the channel mean of per-channel mixers (`attention_maps` with summary "mean", which can
    be negative). (A number for `batch`, its meaning before it took documents, is refused
    with a message saying how to get the random-repeat score.)

    On the task's own documents, `batch` (``task.sample(n, seed)``, a cache's ``batch()``): the
    scores of `TASK_SCORES`, `task_induction_scores`. This is what induction means for a model
    trained on the task: "query->value" is the weight the query puts on the value of its pair (an
    induction head's step in AR: the token after the earlier occurrence of the query's key),
    "value->key" the weight the value puts on its key (the previous-token step that stores the key
    at the value). `uniform_task_scores` gives what uniform causal attention would score.

    With ``random_repeat=True`` (and no batch) instead: Olsson et al. (2022)'s prefix matching,
    ``{"prefix_matching": values}``, on `rows` random sequences of `seq_len` distinct tokens of the
    model's vocabulary repeated twice (`repeated_tokens`, deterministic in `seed`): the mean weight
    M puts from each token of the second half on the token after its previous occurrence. An ideal
    induction head scores 1; a uniform causal pattern (1 / (t + 1) on every key) scores
    (1/L) Σ_{t=L..2L-1} 1/(t + 1) with L = seq_len, which defaults to the longest that fits:
    min(n_ctx // 2, d_vocab) (tokens in a half are distinct). Such sequences are out of the
    distribution of a model trained on a task: its score need not say what it does on the task's
    documents (the CPU attention fixture's layer 1: 0.056, below the uniform 0.129).
    """
    if isinstance(batch, int):
        raise UsageError(
            f"induction_scores: batch is the task's documents (a Batch), got the number {batch}; for the score on "
            f"random repeated tokens give random_repeat=True, rows={batch}"
        )
    if random_repeat:
        if batch is not None:
            raise UsageError("induction_scores: give a batch of the task's documents or random_repeat=True, not both")
        return _random_repeat_scores(model, seq_len, rows, seed)
    if batch is None:
        raise UsageError(
            "induction_scores: give a batch of the task's documents (task.sample(n, seed)), or random_repeat=True "
            "for Olsson et al.'s score on random repeated tokens"
        )
    if seq_len is not None:
        raise UsageError("induction_scores: seq_len is an option of random_repeat=True (the batch has its own rows)")
    return task_induction_scores(model, batch)


def task_induction_scores(model, batch: Batch) -> dict[int, dict[str, Tensor]]:
    """Return ``{layer: {"query->value": [head], "value->key": [head]}}`` on the rows of `batch`,
    which must carry the roles query, value and key (AR, MQAR, ATR):

    - query->value: the mean over rows of M[row, head, query, value], the weight the query's
      position puts on the position of the value of its pair (the answer);
    - value->key: the mean over rows of M[row, head, later, earlier] of the pair's two positions,
      key and value: the value on its key wherever the key comes first (AR, MQAR, right-headed
      ATR), the key on its value where the value does (AR with query_by="value", left-headed ATR),
      since a position sees only earlier ones.

    M is `attention_maps`'s (channel mean of per-channel mixers), computed on as many rows at a
    time as hold `MAX_ROW_ELEMENTS` query × key entries.
    """
    missing = [role for role in ("query", "value", "key") if role not in batch.roles]
    if missing:
        raise UsageError(
            f"induction_scores: the batch has no role {missing[0]!r} (its roles: {', '.join(batch.roles) or 'none'}); "
            "give documents of a recall task (AR, MQAR, ATR)"
        )
    batch = batch.trimmed()
    attending, attended = _task_positions(batch)
    n_pos = batch.tokens.shape[1]
    chunk = max(1, MAX_ROW_ELEMENTS // (n_pos * n_pos))
    device = next(model.parameters()).device
    sums: dict[int, dict[str, Tensor]] = {}
    for start in range(0, len(batch), chunk):
        rows = slice(start, start + chunk)
        maps = attention_maps(model, batch.tokens[rows].to(device))
        index = torch.arange(len(batch.tokens[rows]), device=device)
        for layer, M in maps.items():
            per_layer = sums.setdefault(layer, {})
            for name in TASK_SCORES:
                at, on = attending[name][rows].to(device), attended[name][rows].to(device)
                picked = M[index, :, at, on].double().sum(dim=0)  # [head]
                per_layer[name] = per_layer[name] + picked if name in per_layer else picked
    return {
        layer: {name: (total / len(batch)).float().cpu() for name, total in scores.items()}
        for layer, scores in sums.items()
    }


def _task_positions(batch: Batch) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Return ({score: [N] attending positions}, {score: [N] attended positions}) of `TASK_SCORES`."""
    query, value, key = batch.roles["query"], batch.roles["value"], batch.roles["key"]
    attending = {"query->value": query, "value->key": torch.maximum(value, key)}
    attended = {"query->value": value, "value->key": torch.minimum(value, key)}
    return attending, attended


def uniform_task_scores(batch: Batch) -> dict[str, float]:
    """Return ``{score: value}``: what uniform causal attention (1 / (t + 1) on each key of query
    position t) scores on the rows of `batch` for each of `TASK_SCORES`, the mean over rows of
    1 / (attending position + 1). A mixer that sees fewer keys (attention in a window of w
    tokens) is uniform at 1 / min(t + 1, w) instead."""
    attending, _ = _task_positions(batch)
    return {name: float((1.0 / (positions.double() + 1)).mean()) for name, positions in attending.items()}


def _random_repeat_scores(model, seq_len: int | None, rows: int, seed: int) -> dict[int, dict[str, Tensor]]:
    """`induction_scores(random_repeat=True)`: prefix matching on random repeated tokens."""
    d_vocab, n_ctx = model.cfg.d_vocab, model.cfg.n_ctx
    if seq_len is None:
        seq_len = min(n_ctx // 2, d_vocab)
    if not 2 <= seq_len <= d_vocab or 2 * seq_len > n_ctx:
        raise UsageError(
            f"induction_scores: seq_len must be >= 2, at most d_vocab ({d_vocab}: the tokens of a half are "
            f"distinct) and at most n_ctx / 2 ({n_ctx // 2}: the sequence is repeated), got {seq_len}"
        )
    if rows < 1:
        raise UsageError(f"induction_scores: rows must be >= 1, got {rows}")
    device = next(model.parameters()).device
    tokens = repeated_tokens(d_vocab, seq_len, rows, seed).to(device)
    return {
        layer: {RANDOM_REPEAT_SCORE: prefix_matching(maps, seq_len)}
        for layer, maps in attention_maps(model, tokens).items()
    }
