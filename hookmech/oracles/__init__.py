"""Oracles: the plain references the engines are tested and timed against, written the way a
TransformerLens user would (full forwards with `run_with_hooks`, loops over rows and positions,
recurrences one position at a time). They ship with the package so that tests, benches and users
can check the engines on their own models; no module of the library imports them
(tests/test_patching_package.py checks it).

    plain_loop.py      `plain_loop_patch`: node patching, one full forward per (site, position)
    path_patching.py   `path_patch_reference`: path patching in two passes (record, then patch)
    state_loops.py     `STATE_LOOPS`: each mixer's `state` route, one position at a time
    mixer_cases.py     `EXAMPLES`, `BENCH_HOOKS`: the option sets tests build each mixer with,
                       the inside hooks the benches patch
"""

from __future__ import annotations

from .path_patching import path_patch_reference
from .plain_loop import plain_loop_patch, plain_metric

__all__ = ["path_patch_reference", "plain_loop_patch", "plain_metric"]
