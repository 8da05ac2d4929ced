"""Time the paper's patching sweep done with pyvene against hookmech's plain loop and engine.

The sweep (as in bench/patch_engine.py, 2-layer case): every block-level site (``all``) x the
positions key, value, query, divider x `--n` AR examples (vocab 64, 4 pairs, seed 1) on a
random-init 2-layer model of d_model 64, per mixer. Same process, same model, same batch:

* plain:  `hookmech.oracles.plain_loop_patch` (one full corrupt forward per cell, the clean
  activations cached once);
* pyvene: Stanford's pyvene, used as its users do: one `IntervenableModel` per site (a
  `VanillaIntervention` on the site's HookPoint output, ``unit="pos"``), one call per (site,
  position) with base = corrupt tokens and source = clean tokens, each row's position given in
  ``unit_locations={"sources->base": (source positions, base positions)}``; all rows in one call.
  pyvene reruns the source (clean) forward on every call, so a cell costs it two forwards;
* engine: `hookmech.patching.patch` (computing its clean and corrupt runs itself).

Each cell's p_patched (mean p(answer) at the query) from pyvene is checked against the plain
loop's; the table prints the largest |Δp| over all cells (pyvene vs plain, engine vs plain) and,
for scale, the largest effect |p_patched - p_corrupt| of the plain loop (random-init models have
small effects, so an exact match, |Δp| = 0, is the telling result rather than |Δp| <= 1e-5).

pyvene is not a dependency of hookmech. Install it into a side directory, leaving the
project venv's packages untouched (its own dependencies - torch, transformers, numpy, ... - are
already there with the dev install, so --no-deps is enough for pyvene 0.1.8), then put that
directory on PYTHONPATH (from the activated project venv):

    pip install --no-deps --target /tmp/pyvene_pkgs pyvene==0.1.8
    PYTHONPATH=/tmp/pyvene_pkgs python bench/pyvene_sweep.py [--mixers attention,mamba] [--n 320] [--threads 1]

Without pyvene importable the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import time
from importlib.metadata import version

import torch
from torch import nn

import hookmech
from hookmech.cache import answer_probs
from hookmech.config import build_config
from hookmech.patching import parse_sites, patch
from hookmech.oracles import plain_loop_patch
from hookmech.sites import row_positions

ROLES = ["key", "value", "query", "divider"]


def import_pyvene():
    """Return the pyvene module, or None when it is not importable (its import banner about
    the optional nnsight backend is swallowed)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import pyvene
    except ImportError:
        return None
    return pyvene


class PyveneAdapter(nn.Module):
    """A HookedLM as pyvene 0.1.8 expects a model: with ``.config`` and ``.device``, called
    with keyword inputs (``model(**base)``), returning logits ``[batch, pos, d_vocab]``."""

    def __init__(self, lm: hookmech.HookedLM):
        super().__init__()
        self.lm = lm
        self.config = lm.cfg  # only read by pyvene for registered model types

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(tokens)


def intervenable(pv, adapter: PyveneAdapter, hook: str):
    """Return an IntervenableModel swapping one position of the output of the HookPoint `hook`
    (pyvene's string access: module path + ``.output``)."""
    config = pv.IntervenableConfig(representations=[pv.RepresentationConfig(
        component=f"lm.{hook}.output", unit="pos", max_number_of_units=1,
        intervention=pv.VanillaIntervention())])
    model = pv.IntervenableModel(config, adapter)
    model.disable_model_gradients()
    return model


@torch.no_grad()
def pyvene_sweep(pv, model: hookmech.HookedLM, batch, positions: list[str]) -> dict[tuple[str, str], float]:
    """Return ``{(hook, pos label): mean p(answer) at the query}``, denoising every block-level
    site at every position with pyvene (one call per cell, all rows at once)."""
    adapter = PyveneAdapter(model)
    rows = torch.arange(len(batch))
    base, source = {"tokens": batch.corrupt_tokens}, {"tokens": batch.tokens}
    results = {}
    for site in parse_sites(["all"], model):
        pv_model = intervenable(pv, adapter, site.hook)
        for label in positions:
            where = [[int(p)] for p in row_positions(label, batch.roles, batch.lengths)]  # [N][1]
            _, logits = pv_model(base, [source], unit_locations={"sources->base": ([where], [where])})
            p = answer_probs(logits[rows, batch.query_pos], batch.answers)
            results[site.hook, label] = p.double().mean().item()
    return results


def timed(run) -> tuple[float, object]:
    """Return (seconds, result) of calling `run`."""
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def bench_mixer(pv, mixer: str, task, batch, args) -> str:
    """Run the three sweeps on a fresh 2-layer model with `mixer`; return the table row."""
    torch.manual_seed(0)
    model = hookmech.HookedLM(build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers=mixer,
                                           d_model=args.d_model, n_layers=2)).eval()
    patch(model, batch.select(slice(0, 8)), ["L0.block_in"], ["key"])  # warm-up
    plain_s, reference = timed(lambda: plain_loop_patch(model, batch, ["all"], ROLES))
    pyvene_s, pyvene_p = timed(lambda: pyvene_sweep(pv, model, batch, ROLES))
    engine_s, records = timed(lambda: patch(model, batch, ["all"], ROLES, max_batch=args.max_batch))
    assert set(pyvene_p) == set(reference), "pyvene and the plain loop swept different cells"
    worst_pyvene = max(abs(p - reference[cell]["p_patched"]) for cell, p in pyvene_p.items())
    worst_engine = max(abs(r["p_patched"] - reference[r["hook"], r["pos"]]["p_patched"]) for r in records)
    effect = max(abs(cell["p_patched"] - cell["p_corrupt"]) for cell in reference.values())
    return (f"{mixer:<10} {len(reference):>5} {plain_s:>8.2f} {pyvene_s:>9.2f} {engine_s:>8.2f} "
            f"{plain_s / pyvene_s:>12.2f} {pyvene_s / engine_s:>15.1f} {worst_pyvene:>14.1e} {worst_engine:>14.1e} "
            f"{effect:>10.1e}")


def main() -> None:
    """Parse flags, build the batch, print one table row per mixer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", default="attention,mamba")
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=256, help="the engine's max_batch")
    args = parser.parse_args()
    pv = import_pyvene()
    if pv is None:
        print("pyvene not installed; see the docstring for the side install")
        return
    torch.set_num_threads(args.threads)
    task = hookmech.tasks.make("ar", vocab_size=64, num_kv_pairs=4)
    batch = task.sample(args.n, seed=1)
    print(f"pyvene {version('pyvene')}, {args.n} examples, 2 layers, positions {'/'.join(ROLES)}")
    print(f"{'mixer':<10} {'cells':>5} {'plain s':>8} {'pyvene s':>9} {'engine s':>8} "
          f"{'plain/pyvene':>12} {'pyvene/engine':>15} {'max|dp| pyvene':>14} {'max|dp| engine':>14} "
          f"{'max effect':>10}")
    for mixer in args.mixers.split(","):
        print(bench_mixer(pv, mixer.strip(), task, batch, args), flush=True)


if __name__ == "__main__":
    main()
