"""One patch job over a Ray cluster (``hookmech patch --engine ray``): its row chunks, shared out.

The driver plans the cache's row chunks exactly as the local engine does (`dispatch.patch_chunks`,
`paths.path_chunks`, from the same ``--memory``), hands each of `workers` Ray tasks a run of
consecutive chunks, and adds up, in row order, the records each returns for its run (its
chunks' records added up, `chunked.RecordSums`): every chunk is computed as the local engine
computes it and only the grouping of the float64 sums differs, so the records equal the local
engine's to float64 round-off (1e-12 in the means; at the same ``--threads``).
A cache that fits in fewer chunks than there are workers is cut into one chunk per worker
(the records then agree with the local engine's to the engine's batching tolerance).

Each task loads the model from the checkpoint and opens the cache itself, at the same path on
its machine (shared storage, or a copy), and streams its own rows: what crosses the network is
the request and the records. A mean ablation first gathers the per-chunk sums of its means the
same way. Exact patching (with zero and mean ablations), AtP, AtP* (with GradDrop) and path
patching shard this way; a resample ablation over several chunks is refused as locally.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..cache import CacheFile
from ..checkpoint import load
from ..errors import HookmechError, UsageError
from ..mixers.allow_list import allowed_specs
from ..ray_session import check_ray_address, ray_session
from ..row_chunks import shard_rows
from .chunked import RecordSums, RowsSink, add_sums, clean_sums, means_of
from .dispatch import ablated_hooks, patch, patch_chunks
from .options import PatchOptions
from .paths import EndpointSpecs, path_chunks, path_patch
from .protocol import PatchableModel
from .targets import SiteSpecs, parse_sites


def run_shard(
    ckpt: str,
    cache_path: str,
    chunks: Sequence[tuple[int, int]],
    kind: str,
    request: dict[str, Any],
    threads: int,
    device: str = "cpu",
    clean_means: dict[str, Tensor] | None = None,
    allow_mixers: Sequence[str] = (),
) -> dict[str, Any]:
    """A worker's part: load the model of `ckpt` (allowing the plug-in mixers the driver allows,
    `allow_mixers`), open the cache at `cache_path`, and for each row
    chunk ``(start, stop)`` of `chunks` (consecutive) make its records (`kind` "patch": `patch`
    with `request` as keywords, partial; "path": `path_patch`) or its mean-ablation sums ("sums":
    `chunked.clean_sums` of ``request["hooks"]``). Returns ``{"chunks": [...], "rows": n,
    "load_s": s, "patch_s": s}``: "chunks" holds one sums dict per chunk, or one list of records
    for all of them (added up, partial); then the seconds loading the model, and patching."""
    started = time.perf_counter()
    torch.set_num_threads(threads)
    model = load(ckpt, device=device, allow_mixers=allow_mixers)
    loaded = time.perf_counter()
    results: list[Any] = []
    # the driver checked the cache against the model (`CacheFile.check_model`) before sharing it out
    with CacheFile(cache_path, verify=False) as cache:
        for start, stop in chunks:
            window = cache.window(slice(start, stop))
            if kind == "patch":
                results.append(patch(model, window, memory=None, partial=True, clean_means=clean_means, **request))
            elif kind == "path":
                results.append(path_patch(model, window, memory=None, **request))
            elif kind == "sums":
                results.append(clean_sums(model, window, request["hooks"], request["max_batch"]))
            else:
                raise HookmechError(f"unknown shard kind {kind!r} (patch, path, sums)")
    if kind != "sums":
        # one set of records for the whole shard (its chunks' added up, in row order): what
        # crosses the network is one record per cell and worker, not per cell and chunk
        sums = RecordSums(request.get("threshold", 0.01), partial=True)
        for (start, stop), records in zip(chunks, results, strict=True):
            sums.add(records, slice(start, stop))
        results = [sums.result()]
    return {
        "chunks": results,
        "rows": sum(stop - start for start, stop in chunks),
        "load_s": loaded - started,
        "patch_s": time.perf_counter() - loaded,
    }


class RayPatchEngine:
    """Patches of one checkpoint's cache, run as Ray tasks (module docstring). Use as a context
    manager: it starts a local Ray of `workers` x `threads` CPUs, or connects to the cluster at
    `address`, and shuts a local one down at the end. `workers` None: as many as the cluster's
    CPUs hold tasks of `threads` CPUs. Every shard's timing is appended to `timings`."""

    def __init__(
        self,
        ckpt: str | Path,
        cache_path: str | Path,
        *,
        workers: int | None = None,
        address: str | None = None,
        threads: int = 1,
        device: str = "cpu",
    ):
        if workers is not None and workers < 1:
            raise UsageError(f"--workers must be >= 1, got {workers}")
        self.ckpt, self.cache_path = str(Path(ckpt).resolve()), str(Path(cache_path).resolve())
        self.workers, self.address, self.threads, self.device = workers, address, max(1, threads), device
        self.timings: list[dict[str, Any]] = []
        #: the plug-in mixers this process allows, for the workers (a cluster's may not share its environment)
        self.allow_mixers = allowed_specs()
        self._stack = contextlib.ExitStack()
        self._ray: Any = None

    def __enter__(self) -> RayPatchEngine:
        check_ray_address(self.address)
        local_workers = self.workers or max(1, (os.cpu_count() or 1) // self.threads)
        self._ray = self._stack.enter_context(ray_session(local_workers, self.threads, self.address))
        if self.workers is None:
            cpus = int(self._ray.cluster_resources().get("CPU", 1))
            self.workers = max(1, cpus // self.threads)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def patch(
        self,
        model: PatchableModel,
        cache: CacheFile,
        sites: SiteSpecs,
        positions: list[str],
        *,
        memory: int,
        rows_sink: RowsSink | None = None,
        progress: Callable[[float], None] | None = None,
        **options: Any,
    ) -> list[dict[str, Any]]:
        """Return `hookmech.patching.patch`'s records of `sites` x `positions` on `cache` (this
        engine's cache, open; `model` its checkpoint's), with `options` as patch's keywords.
        `progress(share)` is called as each worker finishes, with its share of the rows (they
        add up to 1)."""
        checked = PatchOptions(
            **{k: v for k, v in options.items() if k in PatchOptions.__dataclass_fields__ and k != "graddrop"}
        )
        patch_sites = parse_sites(sites, model)  # once here; the workers take the parsed sites
        slices = self._slices(patch_chunks(model, cache, patch_sites, positions, checked, memory), cache.n)
        means = None
        if checked.ablate == "mean":
            request = {"hooks": ablated_hooks(model, patch_sites), "max_batch": checked.max_batch}
            sums: dict[str, tuple[Tensor, Tensor]] = {}
            for _, chunk_sums in self._chunks("sums", slices, request):
                sums = add_sums(sums, chunk_sums)
            means = means_of(sums)
        request = {"sites": patch_sites, "positions": positions, **options}
        return self._sum(self._chunks("patch", slices, request, means, progress), checked, rows_sink)

    def path_patch(
        self,
        model: PatchableModel,
        cache: CacheFile,
        sender: EndpointSpecs,
        receiver: EndpointSpecs,
        via: str,
        *,
        memory: int,
        rows_sink: RowsSink | None = None,
        progress: Callable[[float], None] | None = None,
        **options: Any,
    ) -> list[dict[str, Any]]:
        """Return `hookmech.patching.path_patch`'s records on `cache`, as `patch` does."""
        slices = self._slices(path_chunks(model, cache, memory), cache.n)  # type: ignore[arg-type]
        request = {"sender": sender, "receiver": receiver, "via": via, **options}
        checked = PatchOptions(threshold=options.get("threshold", 0.01))
        return self._sum(self._chunks("path", slices, request, None, progress), checked, rows_sink)

    def _slices(self, slices: list[slice], n_rows: int) -> list[slice]:
        """The local engine's chunks, or, when there are fewer than workers, one per worker."""
        assert self.workers is not None  # set on entering
        return slices if len(slices) >= self.workers else shard_rows(n_rows, self.workers)

    def _chunks(
        self,
        kind: str,
        slices: list[slice],
        request: dict[str, Any],
        means: dict[str, Tensor] | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> Iterator[tuple[slice, Any]]:
        """Yield ``(rows, result)`` of `run_shard` in row order, the chunks shared out in runs of
        consecutive ones, one run per worker: per chunk for "sums", per worker's run of chunks
        for records; `progress` gets each run's share of the work."""
        assert self.workers is not None and self._ray is not None
        ray = self._ray
        remote = ray.remote(num_cpus=self.threads, max_retries=0)(run_shard)
        runs = [slices[part] for part in shard_rows(len(slices), self.workers)]
        pending = {
            remote.remote(
                self.ckpt,
                self.cache_path,
                [(s.start, s.stop) for s in run],
                kind,
                request,
                self.threads,
                self.device,
                means,
                self.allow_mixers,
            ): index
            for index, run in enumerate(runs)
        }
        done: dict[int, dict[str, Any]] = {}
        total = slices[-1].stop - slices[0].start
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            index = pending.pop(ready[0])
            try:
                done[index] = ray.get(ready[0])
            except Exception as error:
                cause = getattr(error, "cause", None) or error
                if isinstance(cause, HookmechError):
                    raise cause from None
                first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
                raise HookmechError(f"--engine ray: a worker failed ({type(cause).__name__}: {first})") from None
            self.timings.append({"kind": kind, **{k: v for k, v in done[index].items() if k != "chunks"}})
            if progress is not None:
                progress(done[index]["rows"] / total)  # the share of the job's rows now done
        for index, run in enumerate(runs):
            # "sums": one result per chunk; records: one per shard (`run_shard`)
            pieces = run if kind == "sums" else [slice(run[0].start, run[-1].stop)]
            yield from zip(pieces, done[index]["chunks"], strict=True)

    @staticmethod
    def _sum(
        shard_records: Iterator[tuple[slice, list[dict[str, Any]]]],
        options: PatchOptions,
        rows_sink: RowsSink | None,
    ) -> list[dict[str, Any]]:
        sums = RecordSums(options.threshold, rows_sink)
        for rows, records in shard_records:
            sums.add(records, rows)
        return sums.result()
