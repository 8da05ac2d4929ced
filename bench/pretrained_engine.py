"""Time the exact engine against the plain `run_with_hooks` loop at pretrained size, and against
the downstream-compute bound.

Shapes: Pythia-160m (GPT-NeoX: 12 layers, d_model 768, 12 heads, rotary on a quarter of each
head, parallel residual, vocabulary 50304) and Mamba-130m (24 Mamba-1 layers, d_model 768, no
MLP, tied head, vocabulary 50280), built from their Hugging Face config fields through hookmech's
own mapping (`hookmech.pretrained.gpt_neox.model_config`, `hookmech.pretrained.mamba.model_config`),
random weights (hookmech's init, seed 0). Data: `--n` AR documents (seed 1) of 63 tokens (30
pairs over 8192 content tokens; the models' vocabularies hold those ids). Cells: the named ones,
``L{0,3,6,9}.block_in`` (Pythia) / ``L{0,6,12,18}.block_in`` (Mamba) x key, value, query, and
every ``L*.block_in`` x key, value, query (`--all-sites`).

Same process, same model, same batch, interleaved, best of `--reps`: `hookmech.oracles.plain_loop_patch`
(two unpatched runs, then one full forward per cell) against `hookmech.patching.patch` (the engine,
computing its own clean and corrupt runs). Prints both times, the engine's speed-up, the
downstream-compute bound and the fraction of it the speed-up reaches, and the largest |dp|
between the two.

The downstream-compute bound (`work_units`): the plain loop's work over the least work any exact
engine must do, counted in units of one block at one position (the blocks of a model are alike).
A patch at block l, position p changes nothing before p nor below l, so it must recompute blocks
l .. L-2 at positions p .. q (q: the row's query; causal mixers) and the last block and the LM head
(final norm and unembedding) at q alone; a (cell, row) whose patched activation equals the base
run's needs nothing (its metric is the base run's). The clean and corrupt runs are shared: each
needs blocks 0 .. L-2 everywhere, the last block and the head at q. The plain loop runs every block
and the head at every position, for each unpatched run and each cell. The head's weight per
position, in block units, is measured in the same run (`head_weight`: the final norm and
unembedding over the batch against one block over it): at these vocabularies it is several blocks.

That bound (issue 47's) leaves out work no exact engine can skip: the last block's mixer reads
every position up to q. Attention at q needs the keys and values of positions p .. q - 1, which
the patch changed; Mamba's state at q needs its input branch (in_proj's x half, the convolution,
x_proj, dt_proj) and the scan at p .. q - 1. The "bound'" column adds that part of the last block
at p .. q - 1 (`Shape.window_part`, its cost per position measured as the head's: `window_share`);
the gate, the output projection and the MLP are still counted at q alone.

Both bounds charge work an exact engine skips: a (cell, row) whose patch makes the source run
itself (the runs' inputs to block l differ at the patched position alone, as AR's at block 0's key,
the corrupted token) is read from the source run (`hookmech.patching.exact`). The "source" column is
those cells' share of the least work bound' counts.

    python bench/pretrained_engine.py [--shapes pythia,mamba] [--n 8] [--reps 1] [--threads 1]
        [--all-sites] [--plain-all]

`--all-sites` also measures every ``L*.block_in``; there the plain loop is timed in full only with
`--plain-all` (about 40 and 75 full forwards: minutes), else it is the named cells' plain time scaled
by its forward count (every forward of the plain loop, patched or not, is the same full forward).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from torch.nn import functional as F

import hookmech
from hookmech.mixers.selective_scan import selective_scan
from hookmech.oracles import plain_loop_patch
from hookmech.patching import patch
from hookmech.pretrained import gpt_neox
from hookmech.pretrained import mamba as mamba_family
from hookmech.sites import site_to_hook
from hookmech.tasks.batch import Batch

ROLES = ["key", "value", "query"]


def attention_window_part(block, resid: torch.Tensor) -> torch.Tensor:
    """Return the keys and values of an attention block at every position of `resid`: what its
    output at the query reads of the other positions (the part of `Shape.window_part`)."""
    mixer, d_model = block.mixer, resid.shape[-1]
    weight, bias = mixer.Wqkv.weight[d_model:], None if mixer.Wqkv.bias is None else mixer.Wqkv.bias[d_model:]
    return F.linear(block.ln1(resid), weight, bias)


def mamba_window_part(block, resid: torch.Tensor) -> torch.Tensor:
    """Return a Mamba block's scanned SSM branch at every position of `resid`: in_proj's x half,
    the convolution, x_proj, dt_proj and the scan, what its state at the query reads of the other
    positions (`Shape.window_part`)."""
    mixer = block.mixer
    bias = None if mixer.in_proj.bias is None else mixer.in_proj.bias[: mixer.d_inner]
    in_x = F.linear(block.ln1(resid), mixer.in_proj.weight[: mixer.d_inner], bias)
    u, delta, B, C = mixer._ssm_inputs(in_x)
    return selective_scan(u, delta, mixer._A(), B, C, mixer.D)


@dataclass(frozen=True)
class Shape:
    """A pretrained model's shape: its Hugging Face config fields, its family's mapping, the
    named sites' layers, and the part of its last block an exact engine computes at the
    positions before the query (`window_part(block, resid)`, module docstring)."""

    name: str
    family: object
    hf_config: dict
    named_layers: tuple[int, ...]
    window_part: object


SHAPES = {
    "pythia": Shape(
        "Pythia-160m",
        gpt_neox,
        {
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
            "vocab_size": 50304,
            "rotary_pct": 0.25,
            "max_position_embeddings": 2048,
            "use_parallel_residual": True,
        },
        (0, 3, 6, 9),
        attention_window_part,
    ),
    "mamba": Shape(
        "Mamba-130m",
        mamba_family,
        {"hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50280, "state_size": 16, "expand": 2},
        (0, 6, 12, 18),
        mamba_window_part,
    ),
}


def build(shape: Shape) -> hookmech.HookedLM:
    """Return a random model of `shape` (seed 0), in eval mode."""
    torch.manual_seed(0)
    return hookmech.HookedLM(shape.family.model_config(shape.hf_config)).eval()  # type: ignore[attr-defined]


def timed(run) -> tuple[float, object]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


@torch.no_grad()
def weights_in_blocks(model: hookmech.HookedLM, shape: Shape, batch: Batch, reps: int = 7) -> tuple[float, float]:
    """Return the cost at a position of the LM head (final norm and unembedding) and of the last
    block's window part (`Shape.window_part`), in units of one block's cost at a position:
    best-of-`reps` times of each over the batch's residual at block 0, alternated."""
    # the head's figure still moves between runs of one code (Mamba-130m's head: 4.1 to 5.4 blocks
    # as the best of 3, 3.5 to 4.7 as the best of 7; docs/performance.md), and the bound with it
    resid = model.embed_tokens(batch.tokens)
    block = head = part = float("inf")
    for _ in range(reps):
        block = min(block, timed(lambda: model.blocks[0](resid))[0])
        head = min(head, timed(lambda: model.unembed_resid(model.ln_final(resid)))[0])
        part = min(part, timed(lambda: shape.window_part(model.blocks[-1], resid))[0])  # type: ignore[operator]
    return head / block, part / block


@torch.no_grad()
def changed_positions(model: hookmech.HookedLM, batch: Batch, layers: list[int]) -> dict[int, torch.Tensor]:
    """Return ``{l: [N, T] bool}``: where block l's input differs between the clean and corrupt runs
    (a cell patching there changes its row)."""
    hooks = [site_to_hook(f"L{layer}.block_in") for layer in layers]
    _, clean = model.run_with_cache(batch.tokens, names_filter=hooks, return_cache_object=False)
    _, corrupt = model.run_with_cache(batch.corrupt_tokens, names_filter=hooks, return_cache_object=False)
    return {layer: (clean[hook] != corrupt[hook]).any(-1) for layer, hook in zip(layers, hooks, strict=True)}


def work_units(
    n_layers: int,
    n_pos: int,
    head: float,
    query: list[int],
    cells: list[tuple[int, list[int], list[bool]]],
    window_share: float = 0.0,
) -> tuple[float, float]:
    """Return (plain loop's work, least work of an exact engine) in block-positions (module docstring).

    `query`: each row's query position; `cells`: (layer l, each row's patched position, whether the
    patch changes the row) per cell; `head`: the LM head's cost at a position in block units;
    `window_share`: the cost of the last block's window part at a position, in block units (0: the
    issue's bound; every run also needs it before the query, the unpatched runs already count it)."""
    full_forward = n_layers * n_pos + head * n_pos
    plain = len(query) * full_forward * (2 + len(cells))
    unpatched = sum((n_layers - 1) * n_pos + 1 + head for _ in query)
    needed = 0.0
    for layer, positions, changed in cells:
        for q, p, moves in zip(query, positions, changed, strict=True):
            if moves:
                needed += (n_layers - 1 - layer) * (q - p + 1) + window_share * (q - p) + 1 + head
    return plain, 2 * unpatched + needed


def cells_of(
    batch: Batch, layers: list[int], changed: dict[int, torch.Tensor]
) -> list[tuple[int, list[int], list[bool]]]:
    """Return the cells of `layers` x ROLES in `work_units`' form."""
    rows = torch.arange(len(batch))
    out = []
    for layer in layers:
        for role in ROLES:
            positions = batch.roles[role]
            out.append((layer, positions.tolist(), changed[layer][rows, positions].tolist()))
    return out


def source_run_cells(
    batch: Batch, layers: list[int], changed: dict[int, torch.Tensor]
) -> list[tuple[int, list[int], list[bool]]]:
    """Return `cells_of` with True only where a (cell, row) makes the patched run the source run
    itself: the runs' inputs to block l differ at the patched position alone (AR's key at block
    0). The engine reads those rows from the source run (`exact._makes_source_run`); the bound
    charges them."""
    rows = torch.arange(len(batch))
    out = []
    for layer in layers:
        sole = changed[layer].sum(-1) == 1
        for role in ROLES:
            positions = batch.roles[role]
            out.append((layer, positions.tolist(), (sole & changed[layer][rows, positions]).tolist()))
    return out


def source_share(n_layers, n_pos, head, window_share, query, cells, sources) -> float:
    """Return the share of the least work bound' counts for `cells` that its source-run cells `sources`
    (`source_run_cells`) are charged."""
    _, least = work_units(n_layers, n_pos, head, query, cells, window_share)
    _, unpatched = work_units(n_layers, n_pos, head, query, [], window_share)
    _, with_sources = work_units(n_layers, n_pos, head, query, sources, window_share)
    return (with_sources - unpatched) / least


def measure(model, batch: Batch, sites: list[str], reps: int, plain: bool) -> tuple[float, float, float]:
    """Return (plain loop's best time or NaN, engine's best time, largest |dp|), interleaved."""
    plain_s = engine_s = float("inf")
    worst = float("nan")
    for _ in range(reps):
        reference = None
        if plain:
            seconds, reference = timed(lambda: plain_loop_patch(model, batch, sites, ROLES))
            plain_s = min(plain_s, seconds)
        seconds, records = timed(lambda: patch(model, batch, sites, ROLES))
        engine_s = min(engine_s, seconds)
        if reference is not None:
            worst = max(abs(r["p_patched"] - reference[r["hook"], r["pos"]]["p_patched"]) for r in records)
    return (plain_s if plain else float("nan")), engine_s, worst


def report(
    label: str,
    n_cells: int,
    plain_s: float,
    engine_s: float,
    bounds: tuple[float, float],
    sources: float,
    worst: float,
    scaled: bool,
) -> None:
    """Print one line: the times, the speed-up, each bound (the issue's and bound') and its
    fraction, the source-run cells' share of the least work bound' counts (`source_share`) and the largest |dp|."""
    speedup = plain_s / engine_s
    plain_text = f"{plain_s:>7.1f}{'*' if scaled else ' '}"
    print(
        f"  {label:<22} {n_cells:>5} {plain_text} {engine_s:>8.1f} {speedup:>7.2f} {bounds[0]:>6.2f} "
        f"{speedup / bounds[0]:>8.2f} {bounds[1]:>6.2f} {speedup / bounds[1]:>8.2f} {sources:>7.1%} {worst:>9.1e}",
        flush=True,
    )


def bounds(n_layers, n_pos, head, window_share, query, cells) -> tuple[float, float]:
    """Return the issue's bound and bound' (module docstring) of `cells` (`work_units`' arguments)."""
    plain, least = work_units(n_layers, n_pos, head, query, cells)
    _, least_windowed = work_units(n_layers, n_pos, head, query, cells, window_share)
    return plain / least, plain / least_windowed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="pythia,mamba", help="comma-separated: pythia, mamba")
    parser.add_argument("--n", type=int, default=8, help="AR documents (63 tokens each)")
    parser.add_argument("--reps", type=int, default=1, help="best of this many interleaved repetitions")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--all-sites", action="store_true", help="also every L*.block_in x key, value, query")
    parser.add_argument("--plain-all", action="store_true", help="with --all-sites: time the plain loop in full")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = hookmech.tasks.make("ar", vocab_size=8192, num_kv_pairs=30)
    batch = task.sample(args.n, seed=1)
    n_pos = batch.tokens.shape[1]
    print(f"AR, {args.n} documents of {n_pos} tokens, random weights, {args.threads} thread(s), best of {args.reps}")
    names = ("n", "plain s", "engine s", "speedup", "bound", "of bound", "bound'", "of it", "source", "max |dp|")
    widths = (5, 8, 8, 7, 6, 8, 6, 8, 7, 9)
    columns = " ".join(f"{name:>{width}}" for name, width in zip(names, widths, strict=True))
    print(f"  {'cells':<22} {columns}")
    for key in args.shapes.split(","):
        shape = SHAPES[key]
        model = build(shape)
        n_layers = model.cfg.n_layers
        head, window_share = weights_in_blocks(model, shape, batch)
        print(
            f"{shape.name}: {n_layers} layers, d_model {model.cfg.d_model}, head = {head:.2f} blocks per position, "
            f"the last block's window part = {window_share:.2f}"
        )
        patch(model, batch.select(slice(0, 2)), ["L0.block_in"], ["key"])  # warm-up
        query = batch.query_pos.tolist()
        every = list(range(n_layers))
        changed = changed_positions(model, batch, every)
        named = list(shape.named_layers)
        sites = [f"L{layer}.block_in" for layer in named]
        plain_s, engine_s, worst = measure(model, batch, sites, args.reps, plain=True)
        named_cells = cells_of(batch, named, changed)
        shape_args = (n_layers, n_pos, head, window_share, query)
        report(
            ",".join(f"L{layer}" for layer in named) + ".block_in",
            3 * len(named),
            plain_s,
            engine_s,
            bounds(*shape_args, named_cells),
            source_share(*shape_args, named_cells, source_run_cells(batch, named, changed)),
            worst,
            False,
        )
        if args.all_sites:
            all_cells = cells_of(batch, every, changed)
            all_plain, engine_all, worst_all = measure(model, batch, ["L*.block_in"], args.reps, plain=args.plain_all)
            if not args.plain_all:  # every plain forward is the same full forward: scale by their count
                all_plain = plain_s * (2 + len(all_cells)) / (2 + 3 * len(named))
            report(
                "L*.block_in",
                len(all_cells),
                all_plain,
                engine_all,
                bounds(*shape_args, all_cells),
                source_share(*shape_args, all_cells, source_run_cells(batch, every, changed)),
                worst_all,
                not args.plain_all,
            )
    print("(* the named cells' plain-loop time scaled by its forward count; --plain-all times it)")


if __name__ == "__main__":
    main()
