"""`--memory MIB`: the memory budget of the commands that read an activation cache in row chunks
(`hookmech.chunk_budget`)."""

from __future__ import annotations

import click

from hookmech.chunk_budget import MEMORY_MIB

memory_option = click.option(
    "--memory",
    type=float,
    default=MEMORY_MIB,
    show_default=True,
    help="MiB of cache rows held at once: the cache is read in row chunks that fit (peak memory does not grow "
    "with the cache's rows)",
)
