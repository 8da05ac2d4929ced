"""The engine's fast paths at pretrained size: each equal, bit for bit, to the path it replaces; and
bench/pretrained_engine.py's downstream-compute bound counted by hand."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import hookmech
from hookmech.mixers import mamba as mamba_module
from hookmech.mixers import selective_scan as scan_module
from hookmech.mixers.attention import Attention
from hookmech.mixers.mamba import Mamba
from hookmech.mixers.selective_scan import selective_scan, strided_selective_scan
from hookmech.oracles import plain_loop_patch
from hookmech.patching import forwards, patch
from hookmech.patching.forwards import gathers_head, waste_floor, width_chunks

from helpers import ENGINE_TOL, make_model, unit_variance
from pretrained_folders import folder_of

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("pretrained_engine", REPO / "bench" / "pretrained_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("pretrained_engine", module)
    spec.loader.exec_module(module)
    return module


def test_the_bound_counts_block_positions_by_hand():
    """Two rows of 5 positions (queries 4 and 3), 3 blocks, a head of 2 blocks a position; one cell
    at block 1, positions 2 and 1, the second row unchanged. Plain loop: 2 rows x (3 x 5 + 2 x 5)
    per forward x (2 unpatched + 1 cell) = 150. Least: each unpatched run 2 x (2 x 5 + 1 + 2) = 26
    (blocks 0..1 everywhere, the last block and the head at the query), both runs 52; the cell's
    first row: block 1 at positions 2..4 (3), the last block and the head at the query (1 + 2) = 6;
    its second row nothing. 58 in all."""
    plain, least = _bench().work_units(3, 5, 2.0, [4, 3], [(1, [2, 1], [True, False])])
    assert (plain, least) == (150.0, 58.0)
    # bound': the last block's window part (0.5 blocks a position) at positions 2..3 of the first row
    _, least_windowed = _bench().work_units(3, 5, 2.0, [4, 3], [(1, [2, 1], [True, False])], window_share=0.5)
    assert least_windowed == 59.0


def test_the_bench_counts_the_source_run_cells_by_hand():
    """AR's runs enter block 0 differing at the key alone and block 1 from the key on: only
    (block 0, key) cells make the source run. Two rows (keys 1 and 2, queries 4 and 3), 3 blocks,
    a head of 2: row 0's cell is blocks 0..1 at 1..4 (4 positions x 2 blocks) and the last block
    and the head at the query (3): 11; row 1's 2 x 2 + 3 = 7. Least work of the six cells: 52 (the
    unpatched runs) + those 18 + block 1's key (4 + 3, 2 + 3), value (3 + 3, 1 + 3) and query cells
    (1 + 3 each; block 0's value and query change nothing) = 100."""
    bench = _bench()
    batch = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=2).sample(2, seed=0)
    batch.roles = {"key": torch.tensor([1, 2]), "value": torch.tensor([2, 3]), "query": torch.tensor([4, 3])}
    changed = {0: torch.tensor([[0, 1, 0, 0, 0], [0, 0, 1, 0, 0]]).bool(),
               1: torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]]).bool()}
    sources = bench.source_run_cells(batch, [0, 1], changed)
    assert [moves for _, _, moves in sources] == [[True, True]] + [[False, False]] * 5
    cells = bench.cells_of(batch, [0, 1], changed)
    share = bench.source_share(3, 5, 2.0, 0.0, [4, 3], cells, sources)
    # whole block counts (the head's 2.0 included): the same number on any CPU, to float64 rounding
    assert share == pytest.approx(18 / 100, rel=1e-9)


@pytest.mark.parametrize("mixer", ["attention", "mamba"])
def test_the_bench_times_the_last_blocks_window_part_the_block_computes(mixer):
    # bound' rests on the part being the block's own computation: attention's keys and values
    # (hook_k, hook_v), Mamba's SSM branch before the gate (hook_y)
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    model = make_model(task, mixers=[mixer] * 2, d_model=16, n_heads=2)
    tokens = task.sample(3, seed=0).tokens
    inner = ["hook_k", "hook_v"] if mixer == "attention" else ["hook_y"]
    _, cache = model.run_with_cache(tokens)
    resid = cache["blocks.1.hook_resid_pre"]
    part = getattr(_bench(), f"{mixer}_window_part")(model.blocks[1], resid)
    expected = torch.cat([cache[f"blocks.1.mixer.{name}"].flatten(2) for name in inner], dim=-1)
    assert torch.allclose(part, expected, rtol=0, atol=ENGINE_TOL)


def _scan_inputs(batch: int, n_pos: int, d_inner: int, d_state: int):
    """Return (the generator, float32 (u, Δ, A, B, C) of a selective scan drawn from it at seed 0)."""
    generator = torch.Generator().manual_seed(0)
    u = torch.randn(batch, n_pos, d_inner, generator=generator)
    delta = torch.rand(batch, n_pos, d_inner, generator=generator)
    A = -torch.rand(d_inner, d_state, generator=generator) * 3
    B, C = (torch.randn(batch, n_pos, d_state, generator=generator) for _ in range(2))
    return generator, (u, delta, A, B, C)


@pytest.mark.parametrize("with_h0", [False, True])
def test_a_scan_by_blocks_of_rows_gives_the_same_bytes(monkeypatch, with_h0):
    """`selective_scan` without autograd scans a block of rows at a time once a position's states of
    every row exceed ROW_BLOCK_BYTES: the same bytes as the one-block scan (and the reference's values)."""
    batch, n_pos, d_inner, d_state = 7, 21, 12, 4
    generator, (u, delta, A, B, C) = _scan_inputs(batch, n_pos, d_inner, d_state)
    h0 = torch.randn(batch, d_inner, d_state, generator=generator) if with_h0 else None
    with torch.no_grad():
        whole = selective_scan(u, delta, A, B, C, h0=h0)
        monkeypatch.setattr(scan_module, "ROW_BLOCK_BYTES", 2 * d_inner * d_state * 4)  # blocks of 2 rows
        assert len(scan_module._row_blocks(u, A)) == 4
        blocked = selective_scan(u, delta, A, B, C, h0=h0)
    assert torch.equal(blocked, whole)
    reference, _ = scan_module.selective_scan_ref(u, delta, A, B, C, h0=h0)
    torch.testing.assert_close(blocked, reference, rtol=1e-5, atol=1e-6)


def test_the_strided_scan_by_blocks_of_rows_gives_the_same_bytes(monkeypatch):
    """`strided_selective_scan` (a base run's contexts) takes blocks of rows as `selective_scan`:
    its output and kept states are the bytes of the one-block scan."""
    batch, n_pos, d_inner, d_state = 7, 37, 12, 4
    _, (u, delta, A, B, C) = _scan_inputs(batch, n_pos, d_inner, d_state)
    whole = strided_selective_scan(u, delta, A, B, C, 16)
    monkeypatch.setattr(scan_module, "ROW_BLOCK_BYTES", 2 * d_inner * d_state * 4)  # blocks of 2 rows
    assert len(scan_module._row_blocks(u, A)) == 4
    blocked = strided_selective_scan(u, delta, A, B, C, 16)
    assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1], whole[1])
    assert blocked[1].shape == (batch, n_pos // 16, d_inner, d_state) and blocked[1].is_contiguous()


def _full_replay(mixer: Mamba, kept_state, conv, live):
    """Mamba's replay before it was trimmed: every replayed position, the dead ones as no-ops."""
    u, delta, B, _ = mixer._ssm_inputs(conv, convolved=True)
    delta = delta * live[..., None]
    decay = torch.exp(delta[..., None] * mixer._A())
    drive = (delta * u)[..., None] * B[:, :, None, :]
    h = kept_state.clone()
    for t in range(conv.shape[1]):
        h.mul_(decay[:, t]).add_(drive[:, t])
    return h


def test_mambas_replay_computes_only_its_live_positions_with_the_same_bytes():
    """A resumed Mamba replays the state from the last kept one over the live positions only (they
    end each row's replay): the bytes of the replay over every position, dead ones as no-ops, for
    rows with 0, some and every replayed position live, and for none live at all."""
    torch.manual_seed(0)
    mixer = Mamba(d_model=8, d_state=4).eval()
    stride = mixer.STATE_STRIDE
    generator = torch.Generator().manual_seed(1)
    conv = torch.randn(3, stride - 1, mixer.d_inner, generator=generator)
    kept_state = torch.randn(3, mixer.d_inner, mixer.d_state, generator=generator)
    n_live = torch.tensor([0, 5, stride - 1])
    live = torch.arange(stride - 1)[None, :] >= (stride - 1 - n_live)[:, None]
    with torch.no_grad():
        assert torch.equal(mixer._replayed_state(kept_state, conv, live), _full_replay(mixer, kept_state, conv, live))
        dead = torch.zeros_like(live)
        assert torch.equal(mixer._replayed_state(kept_state, conv, dead), kept_state)


def test_mambas_replay_by_blocks_of_rows_gives_the_same_bytes(monkeypatch):
    """The replay runs a block of rows at a time once a row's state exceeds ROW_BLOCK_BYTES (one row
    a block here): the bytes of the replay of every row at once."""
    torch.manual_seed(0)
    mixer = Mamba(d_model=8, d_state=4).eval()
    stride = mixer.STATE_STRIDE
    generator = torch.Generator().manual_seed(2)
    conv = torch.randn(4, stride - 1, mixer.d_inner, generator=generator)
    kept_state = torch.randn(4, mixer.d_inner, mixer.d_state, generator=generator)
    live = torch.arange(stride - 1)[None, :] >= torch.tensor([0, 3, 9, 14])[:, None]
    with torch.no_grad():
        whole = mixer._replayed_state(kept_state, conv, live)
        monkeypatch.setattr(mamba_module, "ROW_BLOCK_BYTES", mixer.d_inner * mixer.d_state * 4)
        blocked = mixer._replayed_state(kept_state, conv, live)
    assert torch.equal(blocked, whole)
    assert torch.equal(whole, _full_replay(mixer, kept_state, conv, live))



def test_mambas_resumed_rows_that_replay_alike_replay_once(monkeypatch):
    """Rows of a resumed chunk with the same run row and start (several patches of one row, or
    several sites' pairs joined) replay the same positions: one of each is gathered, projected and
    replayed (`Mamba.forward_from`), and the window's output is that of a replay of every row, for
    starts before, at and after a kept state."""
    torch.manual_seed(0)
    mixer = Mamba(d_model=8, d_state=4).eval()
    generator = torch.Generator().manual_seed(3)
    run_x = torch.randn(3, 40, 8, generator=generator)
    rows, start = torch.tensor([0, 2, 0, 1, 2, 0]), torch.tensor([17, 5, 17, 32, 5, 30])
    windows = start[:, None] + torch.arange(4)
    x = run_x[rows[:, None], windows]  # the run's own input there: the output is the run's
    replayed_rows: list[int] = []
    with torch.no_grad():
        context = mixer.prefix_context(run_x)
        each_its_own = lambda labels: (torch.arange(len(labels)), torch.arange(len(labels)))  # noqa: E731
        monkeypatch.setattr(mamba_module, "_groups", each_its_own)
        every_row = mixer.forward_from(x, context, rows, start)
        monkeypatch.undo()
        monkeypatch.setattr(mamba_module, "_groups", _spied(mamba_module._groups, replayed_rows))
        once_each = mixer.forward_from(x, context, rows, start)
        run_output = mixer(run_x)[rows[:, None], windows]
    assert replayed_rows == [4]  # (0, 17), (2, 5), (1, 32), (0, 30)
    torch.testing.assert_close(once_each, every_row, rtol=0, atol=ENGINE_TOL)
    torch.testing.assert_close(once_each, run_output, rtol=0, atol=ENGINE_TOL)


def _spied(groups, sizes: list[int]):
    def spy(labels):
        spread, one = groups(labels)
        sizes.append(len(one))
        return spread, one

    return spy

def test_attentions_base_run_projects_once_for_its_output_and_its_context(monkeypatch):
    """`Attention.fused_forward_with_context`: one qkv projection gives the forward's output and the
    context, the bytes of the two calls apart; with an inside hook in use, the two run apart."""
    torch.manual_seed(0)
    mixer = Attention(d_model=16, n_heads=2, rotary_pct=0.5).eval()
    x = torch.randn(3, 9, 16)
    calls = []
    mixer.Wqkv.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    with torch.no_grad():
        out, context = mixer.forward_with_context(x)
        assert len(calls) == 1
        apart = mixer.prefix_context(x)
        assert torch.equal(out, mixer(x)) and context.keys() == apart.keys()
        assert all(torch.equal(context[name], apart[name]) for name in apart)
        assert mixer.fused_forward_with_context(x, hooked=True) is None


def _rotate_half(x: torch.Tensor, positions: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """GPT-NeoX's rotary embedding as transformers writes it (``rotate_half``, concatenations)."""
    if dim == 0:
        return x
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[..., None, :]
    turning, passing = x[..., :dim], x[..., dim:]
    rotated_half = torch.cat((-turning[..., dim // 2 :], turning[..., : dim // 2]), dim=-1)
    return torch.cat((turning * angles.cos() + rotated_half * angles.sin(), passing), dim=-1)


def _resumed_per_chunk(mixer: Attention, x, run_x, rows, start, keep):
    """The resumed attention as the engine computed it before its context kept rotated keys: the
    run's projections gathered for the chunk's rows, their keys rotated for every position at this
    chunk, and the window spliced in."""
    batch, width, _ = x.shape
    n_pos = run_x.shape[1]

    def heads(t):
        return t.reshape(*t.shape[:2], mixer.n_heads, mixer.d_head)

    window = start[:, None] + torch.arange(width)
    q, k, v = (heads(t) for t in mixer.Wqkv(x).chunk(3, dim=-1))
    q, k = (_rotate_half(t, window, mixer.rotary_dim, mixer.rotary_base) for t in (q, k))
    _, run_k, run_v = (heads(t.index_select(0, rows)) for t in mixer.Wqkv(run_x).chunk(3, dim=-1))
    run_k = _rotate_half(run_k, torch.arange(n_pos), mixer.rotary_dim, mixer.rotary_base)
    run_k[torch.arange(batch)[:, None], window], run_v[torch.arange(batch)[:, None], window] = k, v
    queries = window
    if keep is not None:
        q, queries = q[torch.arange(batch), keep][:, None], (start + keep)[:, None]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, run_k) / math.sqrt(mixer.d_head)
    allowed = torch.arange(n_pos) <= queries[..., None]
    pattern = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(dim=-1)
    z = torch.einsum("bhqk,bkhd->bqhd", pattern, run_v)
    return mixer.out_proj(z.reshape(batch, queries.shape[1], -1))


@pytest.mark.parametrize("rotary_pct", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("n_heads", [1, 4])
def test_attention_resumed_from_its_laid_out_context_gives_the_per_chunk_bytes(rotary_pct, kept, n_heads):
    """`Attention.forward_from` reads the run's keys rotated once (`prefix_context`, and the base
    run's `fused_forward_with_context`), keys and values each contiguous: the same bytes as rotating
    the chunk's context keys at every chunk and multiplying with einsums (the path it replaces),
    on windows at different starts (0 among them), with every query or one kept per row, one head
    (the einsums then multiply views, not copies) or four."""
    torch.manual_seed(0)
    mixer = Attention(d_model=64, n_heads=n_heads, rotary_pct=rotary_pct).eval()  # the fixture's width
    generator = torch.Generator().manual_seed(1)
    run_x = torch.randn(6, 11, 64, generator=generator)
    rows, width = torch.randint(0, 6, (48,), generator=generator), 4
    start = torch.randint(0, 11 - width + 1, (48,), generator=generator)
    start[0] = 0
    x = torch.randn(len(rows), width, 64, generator=generator)
    keep = torch.randint(0, width, (48,), generator=generator) if kept else None
    with torch.no_grad():
        reference = _resumed_per_chunk(mixer, x, run_x, rows, start, keep)
        for context in (mixer.prefix_context(run_x), mixer.forward_with_context(run_x)[1]):
            assert torch.equal(mixer.forward_from(x, context, rows, start, keep), reference)


@pytest.mark.parametrize("case", ["pythia", "pythia-sequential"])
def test_the_engine_gives_the_plain_loops_numbers_on_a_gpt_neox_folder(tmp_path, case):
    """A random GPT-NeoX folder (rotary on a quarter of each head and parallel residual; or on half,
    sequential), loaded by `from_pretrained`: the engine's records at every block input and at the
    rotated keys and the values equal the plain `run_with_hooks` loop's to ENGINE_TOL."""
    pytest.importorskip("transformers")
    model = unit_variance(hookmech.from_pretrained(folder_of(case, tmp_path)))
    batch = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3).sample(12, seed=3)
    sites, positions = ["L*.block_in", "L1.mixer.rot_k", "L0.mixer.v"], ["key", "value", "query"]
    records = patch(model, batch, sites, positions)
    reference = plain_loop_patch(model, batch, sites, positions)
    assert len(records) == len(reference) == 4 * 3
    for record in records:
        assert abs(record["p_patched"] - reference[record["hook"], record["pos"]]["p_patched"]) <= ENGINE_TOL
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in records) > 2 * ENGINE_TOL  # patches move p


def test_the_waste_floor_shrinks_with_d_model_squared_past_128(monkeypatch):
    """`waste_floor`: WASTE_FLOOR up to d_model 128, then WASTE_FLOOR x (128 / d_model)²; at 768 a
    key's windows of 6 to 60 positions no longer share one chunk."""
    assert [waste_floor(d) for d in (32, 64, 128, 256, 768)] == [512, 512, 512, 128, 14]
    widths = [6, 8, 20, 40, 42, 58, 58, 60]
    assert [(c.start, c.stop) for c in width_chunks(widths, 256)] == [(0, 8)]
    assert [(c.start, c.stop) for c in width_chunks(widths, 256, waste_floor(768))] == [(0, 2), (2, 3), (3, 5), (5, 8)]
    monkeypatch.setattr(forwards, "WASTE_FLOOR", 0)
    assert waste_floor(768) == 0


def test_a_large_head_is_gathered_and_a_small_one_is_not():
    """`gathers_head`: Pythia-160m's head (50304 x 768 float32, 154 MB) unembeds several chunks at
    once; the CPU fixtures' (67 x 64) keeps one product per chunk."""
    assert gathers_head(50304, torch.zeros(1, 768))
    assert not gathers_head(67, torch.zeros(1, 64))
    assert not gathers_head(50304, torch.zeros(1, 768, dtype=torch.float16)[..., :20])


@pytest.mark.parametrize("mixer", ["attention", "mamba"])
def test_a_gathered_head_gives_the_plain_loops_numbers(ar_task, monkeypatch, mixer):
    """With the head gathered (HEAD_GATHER_BYTES 0), resumed chunks (one per window width here) are
    unembedded in groups of at most 8 rows (fewer products than with one per chunk, never more rows
    than `max_batch`): the records equal the plain loop's and the per-chunk head's to ENGINE_TOL (two
    engine paths), for p(answer) and for a metric read from the logits (logit_diff)."""
    model = unit_variance(make_model(ar_task, mixers=mixer, d_model=16))
    batch = ar_task.sample(9, seed=21)
    sites, positions = ["L0.block_in", "L1.mixer_in", "L1.block_out"], ["key", "value", "query"]
    products: list[int] = []
    resumed: list[bool] = []
    unembed, resume = model.unembed_resid, model.resume
    monkeypatch.setattr(forwards, "WASTE_FLOOR", 0)  # a chunk per window width: many small chunks
    monkeypatch.setattr(forwards, "WIDTH_GROWTH", 1.0)
    monkeypatch.setattr(model, "unembed_resid", lambda resid: products.append(len(resid)) or unembed(resid))
    monkeypatch.setattr(model, "resume", lambda *a, **k: resumed.append(k.get("unembed", True)) or resume(*a, **k))
    per_chunk = patch(model, batch, sites, positions, max_batch=8, metric="logit_diff")
    per_chunk_products, products[:] = len(products), []
    assert resumed and all(resumed)  # the fixtures' head: one product per chunk
    resumed.clear()
    monkeypatch.setattr(forwards, "HEAD_GATHER_BYTES", 0)
    gathered = patch(model, batch, sites, positions, max_batch=8, metric="logit_diff")
    assert resumed and not any(resumed)  # every chunk left its head to the groups
    assert len(products) < per_chunk_products and max(products) <= 8
    reference = plain_loop_patch(model, batch, sites, positions, metric="logit_diff")
    for record, chunked in zip(gathered, per_chunk, strict=True):
        for key in ("p_patched", "metric_patched"):
            assert abs(record[key] - reference[record["hook"], record["pos"]][key]) <= ENGINE_TOL
            assert abs(record[key] - chunked[key]) <= ENGINE_TOL  # two engine paths: the contract
    assert max(abs(r["p_patched"] - r["p_corrupt"]) for r in gathered) > 2 * ENGINE_TOL  # patches move p


def test_a_chunk_of_joined_sites_computes_at_most_its_positions_cap():
    """`width_chunks`' `max_positions` (`JOINED_POSITIONS` for sites resumed together): no chunk of
    several pairs computes more positions (pairs x widest window) than the cap; a pair wider than
    the cap is a chunk alone; without the cap the same widths make fewer, larger chunks."""
    widths = [1] * 200 + [6] * 40 + [42] * 30 + [60] * 50 + [1500]
    chunks = list(width_chunks(widths, 256, 14, 1024))
    assert [i for chunk in chunks for i in range(chunk.start, chunk.stop)] == list(range(len(widths)))
    for chunk in chunks:
        assert chunk.stop - chunk.start == 1 or (chunk.stop - chunk.start) * widths[chunk.stop - 1] <= 1024
    assert (chunks[-1].start, chunks[-1].stop) == (len(widths) - 1, len(widths))
    assert len(list(width_chunks(widths, 256, 14))) < len(chunks)
