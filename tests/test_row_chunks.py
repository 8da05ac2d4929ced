"""Row-chunk planning (`hookmech.row_chunks`) and a cache's row windows (`CacheFile.window`):
slices that cover every row once, sized from the budget; a window reads what the file holds at
its rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hookmech.cache import CacheFile, write_cache
from hookmech.errors import HookmechError, UsageError
from hookmech.row_chunks import MIB, bytes_per_row, memory_bytes, plan_row_chunks, rows_per_chunk, shard_rows


@pytest.mark.parametrize(("n_rows", "per_row", "memory"), [(10, 3, 9), (3300, 1, 3200), (7, 100, 1), (5, 1, 10**9)])
def test_chunks_cover_every_row_once_within_the_budget(n_rows, per_row, memory):
    slices = plan_row_chunks(n_rows, per_row, memory)
    rows = [row for piece in slices for row in range(piece.start, piece.stop)]
    assert rows == list(range(n_rows))  # the invariant: each row once, in order
    fit = max(1, memory // per_row)  # by hand: rows in the budget, at least one
    assert all(piece.stop - piece.start <= fit for piece in slices)
    assert len(slices) == -(-n_rows // fit)  # no more chunks than needed
    sizes = [piece.stop - piece.start for piece in slices]
    assert max(sizes) - min(sizes) <= 1  # as even as the count allows


def test_chunks_of_a_range_and_shards():
    assert plan_row_chunks(100, 10, 250, rows=slice(40, 90)) == [slice(40, 65), slice(65, 90)]
    assert shard_rows(10, 3) == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert shard_rows(2, 5) == [slice(0, 1), slice(1, 2)]  # never an empty shard
    assert rows_per_chunk(4, 3) == 1 and bytes_per_row([(2, 3), ()]) == 28
    assert memory_bytes(1.5) == int(1.5 * MIB)
    for bad in (0, -1, float("nan"), True):
        with pytest.raises(UsageError, match="--memory"):
            memory_bytes(bad)


def test_a_window_reads_the_rows_of_the_file(tmp_path, ar_model, ar_task):
    batch = ar_task.sample(13, seed=2)
    hook = "blocks.1.hook_resid_pre"
    path = write_cache(ar_model, batch, tmp_path / "c.h5", [hook])
    with CacheFile(path) as cache:
        whole = cache.read(hook, "clean", slice(None))
        window = cache.window(slice(4, 11))
        assert window.n == 7 and window.n_pos == cache.n_pos
        torch.testing.assert_close(window.read(hook, "clean", slice(None)), whole[4:11], rtol=0, atol=0)
        torch.testing.assert_close(window.read(hook, "corrupt", slice(2, 3)), cache.read(hook, "corrupt", slice(6, 7)),
                                   rtol=0, atol=0)
        assert torch.equal(window.batch().tokens, batch.tokens[4:11])
        assert torch.equal(window.p_answer("clean"), cache.p_answer("clean")[4:11])
        torch.testing.assert_close(window.at("L1.block_in", "key"), cache.at("L1.block_in", "key")[4:11], rtol=0, atol=0)
        inner = window.window(slice(1, 3))  # a window of a window: file rows 5..6
        assert torch.equal(inner.batch().answers, batch.answers[5:7])
        window.close()  # leaves the file open
        assert cache.read(hook, "clean", slice(0, 1)).shape[0] == 1
        with pytest.raises(HookmechError, match="consecutive rows"):
            cache.window(slice(3, 3))
        # the mean read in chunks is the mean of the array (float64 sums in another order)
        assert cache.mean_p_answer("clean", memory=8) == pytest.approx(
            float(np.asarray(cache.p_answer("clean"), dtype=np.float64).mean()), abs=1e-12)
