"""The engine's fast paths at pretrained size: each equal, bit for bit, to the path it replaces; and
bench/pretrained_engine.py's downstream-compute bound counted by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hookmech.mixers import selective_scan as scan_module
from hookmech.mixers.mamba import Mamba
from hookmech.mixers.selective_scan import selective_scan
from hookmech.patching import forwards
from hookmech.patching.forwards import waste_floor, width_chunks

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


@pytest.mark.parametrize("with_h0", [False, True])
def test_a_scan_by_blocks_of_rows_gives_the_same_bytes(monkeypatch, with_h0):
    """`selective_scan` without autograd scans a block of rows at a time once a position's states of
    every row exceed ROW_BLOCK_BYTES: the same bytes as the one-block scan (and the reference's values)."""
    generator = torch.Generator().manual_seed(0)
    batch, n_pos, d_inner, d_state = 7, 21, 12, 4
    u = torch.randn(batch, n_pos, d_inner, generator=generator)
    delta = torch.rand(batch, n_pos, d_inner, generator=generator)
    A = -torch.rand(d_inner, d_state, generator=generator) * 3
    B, C = (torch.randn(batch, n_pos, d_state, generator=generator) for _ in range(2))
    h0 = torch.randn(batch, d_inner, d_state, generator=generator) if with_h0 else None
    with torch.no_grad():
        whole = selective_scan(u, delta, A, B, C, h0=h0)
        monkeypatch.setattr(scan_module, "ROW_BLOCK_BYTES", 2 * d_inner * d_state * 4)  # blocks of 2 rows
        assert len(scan_module._row_blocks(u, A)) == 4
        blocked = selective_scan(u, delta, A, B, C, h0=h0)
    assert torch.equal(blocked, whole)
    reference, _ = scan_module.selective_scan_ref(u, delta, A, B, C, h0=h0)
    torch.testing.assert_close(blocked, reference, rtol=1e-5, atol=1e-6)


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


def test_the_waste_floor_shrinks_with_d_model_squared_past_128(monkeypatch):
    """`waste_floor`: WASTE_FLOOR up to d_model 128, then WASTE_FLOOR x (128 / d_model)²; at 768 a
    key's windows of 6 to 60 positions no longer share one chunk."""
    assert [waste_floor(d) for d in (32, 64, 128, 256, 768)] == [512, 512, 512, 128, 14]
    widths = [6, 8, 20, 40, 42, 58, 58, 60]
    assert [(c.start, c.stop) for c in width_chunks(widths, 256)] == [(0, 8)]
    assert [(c.start, c.stop) for c in width_chunks(widths, 256, waste_floor(768))] == [(0, 2), (2, 3), (3, 5), (5, 8)]
    monkeypatch.setattr(forwards, "WASTE_FLOOR", 0)
    assert waste_floor(768) == 0
