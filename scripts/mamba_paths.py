"""How the key's information reaches the query in a Mamba checkpoint: node patches and path
patches (`hookmech.patching.path_patch`) at the key and the three positions after it.

    python scripts/mamba_paths.py [--ckpt fixtures/mamba_ar_cpu.safetensors] [--n 320] [--seed 1]

Prints markdown tables of attributions (denoising, p(answer); docs/results.md keeps the figures).
The positions after the key are roles added to the batch: ``key_1`` (the value), ``key_2`` (the
next pair's key, or the divider after the last pair), ``key_3`` (the next value, or the query).
In a key-corrupted AR document only the key's token differs, so a difference at key_1..key_3 in
layer 0 is carried there by the short convolution (the only operator of a Mamba layer that moves
information to a later position other than the SSM).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

import hookmech
from hookmech.patching import patch, path_patch

OFFSETS = ["key", "key_1", "key_2", "key_3"]


def attribution_row(records: list[dict], sep: str = " | ") -> str:
    return sep.join("–" if r["attribution"] is None else f"{r['attribution']:.3f}" for r in records)


def measure(model, batch, title: str) -> None:
    """Print the table of node and path patches of `batch` (its roles key, key_1..key_3, query)."""
    every = "+".join(OFFSETS)
    (first,) = patch(model, batch, "L1.block_in", "key")
    print(f"\n### {title}: N={len(batch)}, p_clean {first['p_clean']:.3f}, p_corrupt {first['p_corrupt']:.3f}\n")
    rows = [
        ("node L1.block_in", patch(model, batch, "L1.block_in", [*OFFSETS, "query"]), "+ query"),
        ("node L0.mixer.in_x (conv input)", patch(model, batch, "L0.mixer.in_x", OFFSETS), ""),
        ("node L0.mixer.gate (the gate branch)", patch(model, batch, "L0.mixer.gate", OFFSETS), ""),
        ("node L0.mixer.y (SSM read-out)", patch(model, batch, "L0.mixer.y", [*OFFSETS, "query"]), "+ query"),
        (
            "conv L0.mixer.in_x@key -> L0.mixer.conv@P",
            path_patch(
                model, batch, "L0.mixer.in_x@key", [f"L0.mixer.conv@{p}" for p in [*OFFSETS, "query", "whole"]], "conv"
            ),
            "+ query + every tap",
        ),
        (
            "state L0.mixer.ssm_state@P -> @query",
            path_patch(
                model,
                batch,
                [f"L0.mixer.ssm_state@{p}" for p in [*OFFSETS, every, "whole"]],
                "L0.mixer.ssm_state@query",
                "state",
            ),
            "+ key..key+3 + every position",
        ),
        (
            "resid L0.mixer_out@P -> L1.block_in@P",
            [
                path_patch(model, batch, f"L0.mixer_out@{p}", f"L1.block_in@{p}", "resid")[0]
                for p in [*OFFSETS, "query"]
            ],
            "+ query",
        ),
        (
            "resid L0.block_in@key -> L1.block_in@key",
            path_patch(model, batch, "L0.block_in@key", "L1.block_in@key", "resid"),
            "",
        ),
        (
            "conv L1.mixer.in_x@key -> L1.mixer.conv@P",
            path_patch(
                model, batch, "L1.mixer.in_x@key", [f"L1.mixer.conv@{p}" for p in [*OFFSETS, "query", "whole"]], "conv"
            ),
            "+ query + every tap",
        ),
        (
            "state L1.mixer.ssm_state@P -> @query",
            path_patch(
                model,
                batch,
                [f"L1.mixer.ssm_state@{p}" for p in [*OFFSETS, every, "whole"]],
                "L1.mixer.ssm_state@query",
                "state",
            ),
            "+ key..key+3 + every position",
        ),
    ]
    print("| measurement | key | key+1 | key+2 | key+3 | further |\n| --- | --- | --- | --- | --- | --- |")
    for label, records, extra in rows:
        print(f"| {label} | {attribution_row(records[:4])} | {attribution_row(records[4:], ' / ')} {extra} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="fixtures/mamba_ar_cpu.safetensors")
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    model, task = hookmech.load(args.ckpt), hookmech.tasks.from_checkpoint(args.ckpt)
    batch = task.sample(args.n, seed=args.seed)
    key = batch.roles["key"]
    batch = replace(batch, roles={**batch.roles, **{f"key_{k}": key + k for k in (1, 2, 3)}})
    print(f"{args.ckpt}, {args.n} documents, seed {args.seed}; attributions (denoising, p(answer))")

    divider = batch.roles["divider"]
    groups = [
        ("all rows", torch.ones(len(batch), dtype=torch.bool)),
        ("key in an earlier pair (key+2: the next key, key+3: the next value)", key + 3 < divider),
        ("key in the last pair (key+2: the divider, key+3: the query)", key + 3 >= divider),
    ]
    for title, rows in groups:
        if rows.any():
            measure(model, batch.select(rows), title)
    print(f"\n{time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
