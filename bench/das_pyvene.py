"""DAS with hookmech (from the activation cache, resumed forwards) against pyvene 0.1.8.

Same process, same model, site, position, K, data, initial basis and optimiser:

* model, site: the bundled CPU attention fixture at ``L1.block_in`` @ ``value`` (by default);
  rows: a cache of ``--n`` AR documents (seed 1) written first, split into train and dev by
  document as `hookmech.das.train` splits them;
* hookmech: `hookmech.das.train` (its whole call: reading the cache, training, and scoring the
  learned basis, the random control and the full interchange on the dev rows);
* pyvene: an `IntervenableModel` with a `LowRankRotatedSpaceIntervention` (the same
  `torch.nn.utils.parametrizations.orthogonal` ``[d, K]`` weight, x + (R_s − R_b) Rᵀ) on the
  site's HookPoint output, ``unit="pos"``, base = corrupt tokens and source = clean tokens with
  each row's position in ``unit_locations``, as its DAS tutorials train it: each step runs the
  source forward and the base forward on every position; then one scoring pass on the dev rows;
* both start from the same basis (the initial basis and the parametrisation's random
  completion drawn from the same seeds), take the same minibatches in the same order (hookmech's
  own data order, replayed for pyvene as token rows) and Adam at the same constant learning rate.

Printed per K: seconds of each, the ratio, IIA of each on the dev rows with two standard errors
of their difference (sqrt(p1(1−p1)/n + p2(1−p2)/n)), and the smallest cosine of the principal
angles between the two learned subspaces (1: the same subspace).

pyvene is not a dependency of hookmech. Install it into a side directory (see
bench/pyvene_sweep.py) and put that on PYTHONPATH:

    pip install --no-deps --target /tmp/pyvene_pkgs pyvene==0.1.8
    PYTHONPATH=/tmp/pyvene_pkgs python bench/das_pyvene.py [--dims 1,4,16] [--steps 200] [--n 1000] [--threads 1]

Without pyvene importable the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
from pyvene_sweep import PyveneAdapter, import_pyvene  # the same adapter as the patching comparison
from torch.nn import functional as F

import hookmech
from hookmech.cache import answer_probs, write_cache
from hookmech.das.basis import derived_seed, random_basis
from hookmech.das.data import DasData
from hookmech.sites import resolve_sites, site_to_hook

INITIAL, COMPLETION = 0, 1  # hookmech.das.search's random streams of a seed


def pyvene_das(pv, model, data: DasData, batch, hook: str, k: int, args) -> tuple[float, float, torch.Tensor]:
    """Train and score a rank-`k` basis with pyvene; return (seconds, dev IIA, basis ``[d, k]``)."""
    start = time.perf_counter()
    intervention = pv.LowRankRotatedSpaceIntervention(embed_dim=data.d, low_rank_dimension=k)
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # hookmech's initial basis and completion
        torch.manual_seed(derived_seed(args.seed, k, COMPLETION))
        intervention.rotate_layer.weight = random_basis(data.d, k, derived_seed(args.seed, k, INITIAL))
    config = pv.IntervenableConfig(
        representations=[pv.RepresentationConfig(component=f"lm.{hook}.output", unit="pos", intervention=intervention)]
    )
    pv_model = pv.IntervenableModel(config, PyveneAdapter(model))
    pv_model.disable_model_gradients()
    optimizer = torch.optim.Adam(intervention.parameters(), lr=args.lr)
    batches = data.train_batches(args.batch_size, args.seed)  # hookmech's order of training rows
    for _ in range(args.steps):
        chunk, index = next(batches)
        logits = run_pyvene(pv_model, batch, chunk.rows[index], data)
        loss = F.cross_entropy(logits, batch.answers[chunk.rows[index]])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        dev = torch.nonzero(data.dev).flatten()
        logits = run_pyvene(pv_model, batch, dev, data)
        iia = (logits.argmax(-1) == batch.answers[dev]).double().mean().item()
        answer_probs(logits, batch.answers[dev])  # the scoring pass hookmech also makes
    return time.perf_counter() - start, iia, intervention.rotate_layer.weight.detach().clone()


def run_pyvene(pv_model, batch, rows: torch.Tensor, data: DasData) -> torch.Tensor:
    """Return the query logits ``[len(rows), d_vocab]`` of the corrupt rows `rows` intervened with pyvene."""
    where = [[int(p)] for p in data.positions[rows]]
    _, out = pv_model(
        {"tokens": batch.corrupt_tokens[rows]},
        [{"tokens": batch.tokens[rows]}],
        unit_locations={"sources->base": ([where], [where])},
    )
    return out[torch.arange(len(rows)), batch.query_pos[rows]]


def smallest_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The smallest cosine of the principal angles between the spans of orthonormal `a`, `b` ``[d, k]``."""
    return torch.linalg.svdvals(a.double().T @ b.double()).min().item()


def main() -> None:
    """Parse flags, write the cache, print one row per K."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="fixtures/attention_ar_cpu.safetensors")
    parser.add_argument("--site", default="L1.block_in")
    parser.add_argument("--pos", default="value")
    parser.add_argument("--dims", default="1,4,16")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    pv = import_pyvene()
    if pv is None:
        print("pyvene not installed; see the docstring for the side install")
        return
    torch.set_num_threads(args.threads)
    model, task = hookmech.load(args.ckpt).eval(), hookmech.tasks.from_checkpoint(args.ckpt)
    hook = site_to_hook(args.site)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cache.h5"
        hooks = resolve_sites(["all"], model.hook_dict)
        write_cache(model, task.sample(args.n, seed=1), path, [*hooks, *([hook] if hook not in hooks else [])])
        with hookmech.cache.open(path) as cache:
            batch = cache.batch()
            for parameter in model.parameters():
                parameter.requires_grad_(False)
            data = DasData(model, cache, hook, args.pos, seed=args.seed)
            print(
                f"pyvene {version('pyvene')}, {args.ckpt} {args.site}@{args.pos} (d {data.d}), {args.n} rows "
                f"({data.n_train} train / {data.n_dev} dev), {args.steps} steps of {args.batch_size}, "
                f"Adam lr {args.lr}, {torch.get_num_threads()} thread(s)"
            )
            print(
                f"{'K':>3} {'hookmech s':>10} {'pyvene s':>9} {'pyvene/hookmech':>15} "
                f"{'IIA hookmech':>12} {'IIA pyvene':>10} {'2 SE':>6} {'within':>6} {'min cos':>8}"
            )
            for k in (int(k) for k in args.dims.split(",")):
                began = time.perf_counter()
                result = hookmech.das.train(
                    model, cache, args.site, args.pos, [k], steps=args.steps, lr=args.lr,
                    batch_size=args.batch_size, seed=args.seed,
                )  # fmt: skip
                ours_s = time.perf_counter() - began
                (record,) = result.records
                pyvene_s, pyvene_iia, pyvene_basis = pyvene_das(pv, model, data, batch, hook, k, args)
                n, ours = record["n_dev"], record["iia"]
                two_se = 2 * math.sqrt((ours * (1 - ours) + pyvene_iia * (1 - pyvene_iia)) / n)
                within = abs(ours - pyvene_iia) <= two_se
                cosine = smallest_cosine(result.bases[f"dim{k}"], pyvene_basis)
                print(
                    f"{k:>3} {ours_s:>10.2f} {pyvene_s:>9.2f} {pyvene_s / ours_s:>15.2f} {ours:>12.3f} "
                    f"{pyvene_iia:>10.3f} {two_se:>6.3f} {'yes' if within else 'NO':>6} {cosine:>8.4f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
