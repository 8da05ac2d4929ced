"""`hookmech view` on large inputs: page size and load time in headless Chromium.

Pages measured (all in one run, the same browser):

- baseline: the page of the bundled attention fixture (AR, 11-token rows, `--n` examples);
- sweep: a synthetic sweep folder of `--sweep-runs` runs (6 architectures × 5 d_model × 7 lr ×
  seeds, the paper's AR grid), each with a 250-line metrics.jsonl that carries attributions
  every second line (`--mech-every`), no model files; once with the default selection (the best
  run of each series) and once with every run's dynamics (`--run` all);
- atr: a random-init 2-layer attention model (d_model 64) on ATR's long setting (max_rhs_len 10:
  rows up to 918 tokens over 100,032 documents), patched on the `--n` longest rows of
  `--atr-docs` documents (every block-level site × role), effective attention of as many rows
  as fit in 8 MiB;
- plotly (when the package is installed): an empty page with plotly's bundled script inline,
  the cost a plotly page would start from.

Load time: navigation start to the page's script having drawn everything (`hookmechReadyMs`,
which also bounds the load event), best of `--reps` loads; printed with the ratio to the
baseline page measured in the same run.

    python bench/view_pages.py [--n 320] [--sweep-runs 210] [--atr-docs 100032] [--reps 3] [--threads 1] [--keep DIR]
    python bench/view_pages.py --measure-only --keep DIR     # load the pages of an earlier run again
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import hookmech
from hookmech.config import build_config
from hookmech.sweep import write_results
from hookmech.view import checkpoint_page_data, sweep_page_data, write_page
from hookmech.view.browser import headless_chromium

ARCHS = ("attention", "based", "mamba", "h3", "hyena", "baseconv")
D_MODELS = (64, 128, 256, 512, 1024)
LRS = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2)


def synthetic_sweep(folder: Path, n_runs: int, seed: int = 0) -> list[str]:
    """Write a sweep folder of `n_runs` runs (grid order, seeds repeat the grid): results.csv,
    sweep.json and a metrics.jsonl per run (250 evaluations, attributions every second one).
    Returns the run ids."""
    rng = np.random.default_rng(seed)
    rows, grid = [], [(a, d, lr) for a in ARCHS for d in D_MODELS for lr in LRS]
    for index in range(n_runs):
        arch, d_model, lr = grid[index % len(grid)]
        run_seed = index // len(grid)
        acc = float(
            np.clip(0.2 + 0.15 * np.log2(d_model / 64) - 0.4 * abs(np.log10(lr / 1e-3)) + rng.normal(0, 0.05), 0, 1)
        )
        value = (
            float(np.clip(acc + rng.normal(0, 0.05), -0.1, 1.05))
            if arch == "attention"
            else float(rng.uniform(-0.1, 0.6))
        )
        query = float(rng.uniform(-0.05, 1 - max(value, 0)))
        run_id = f"{arch}_d{d_model}_lr{lr}_s{run_seed}"
        rows.append(
            {
                "run_id": run_id,
                "arch": arch,
                "d_model": d_model,
                "lr": lr,
                "seed": run_seed,
                "status": "finished",
                "dev_acc": acc,
                "dev_p_answer": acc * 0.9,
                "steps": 50016,
                "seconds": 1000.0,
                "mech_n": 320,
                "mech_p_clean": 0.9,
                "mech_p_corrupt": 0.05,
                "mech_passes": acc > 0.1,
                "attr:L1.block_in@key": float(rng.uniform(-0.05, 0.3)),
                "attr:L1.block_in@value": value,
                "attr:L1.block_in@query": query,
            }
        )
        run = folder / run_id
        run.mkdir(parents=True)
        lines = []
        for step in range(200, 50017, 200):
            progress = step / 50016
            line = {
                "step": step,
                "loss": float(7 * (1 - progress) ** 3 + 0.01),
                "lr": lr,
                "dev_acc": acc * progress,
                "dev_p_answer": acc * progress * 0.9,
                "seconds": step / 50.0,
            }
            if step % 400 == 0:
                line.update(
                    {
                        f"attr:L1.block_in@{pos}": float(v * progress)
                        for pos, v in (("key", 0.1), ("value", value), ("query", query))
                    }
                )
            lines.append(json.dumps(line))
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    write_results(rows, folder / "results.csv")
    grid_spec = {"arch": list(ARCHS), "d_model": list(D_MODELS), "lr": list(LRS), "seed": [0]}
    (folder / "sweep.json").write_text(json.dumps({"name": f"synthetic-{n_runs}", "grid": grid_spec}))
    return [row["run_id"] for row in rows]


def atr_page(folder: Path, n: int, docs: int) -> tuple[Path, str]:
    """Write the page of a random-init attention model on the `n` longest of `docs` ATR rows."""
    task = hookmech.tasks.make("atr", max_rhs_len=10)
    start = time.perf_counter()
    batch = task.sample(docs, seed=0)
    longest = torch.argsort(batch.lengths, descending=True, stable=True)[:n]
    batch = batch.select(longest).trimmed()
    sampled = time.perf_counter() - start
    torch.manual_seed(0)
    model = hookmech.HookedLM(build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, d_model=64, n_layers=2)).eval()
    start = time.perf_counter()
    data = checkpoint_page_data(
        model, task, batch, about={"source": f"random-init attention, {n} longest of {docs} ATR rows"}
    )
    collected = time.perf_counter() - start
    path = write_page(data, folder / "atr.html", "ATR, 918-token rows")
    lengths = batch.lengths
    note = (
        f"rows {int(lengths.min())}..{int(lengths.max())} tokens (padded {batch.tokens.shape[1]}), "
        f"maps of {len(data['maps']['examples'])} rows; sampling {sampled:.1f} s, page data {collected:.1f} s"
    )
    return path, note


def open_driver():
    """Return headless Chromium (`hookmech.view.browser`)."""
    return headless_chromium()


def load_seconds(driver, path: Path, reps: int) -> float:
    """Best of `reps` loads: navigation start to the page drawn (`hookmechReadyMs`) or to the load
    event, whichever is later, in seconds."""
    from selenium.webdriver.support.ui import WebDriverWait

    best = float("inf")
    for _ in range(reps):
        driver.get("about:blank")
        driver.get(path.as_uri())
        WebDriverWait(driver, 60).until(
            lambda d: d.execute_script(
                "const nav = performance.getEntriesByType('navigation')[0];"
                "return document.readyState === 'complete' && window.hookmechReadyMs > 0 && nav.loadEventEnd > 0;"
            )
        )
        ms = driver.execute_script(
            "const nav = performance.getEntriesByType('navigation')[0];"
            "return Math.max(window.hookmechReadyMs, nav.loadEventEnd);"
        )
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        if errors:
            raise SystemExit(f"{path}: console errors {errors}")
        best = min(best, ms / 1000)
    return best


def measure(pages: list[tuple[str, Path, str]], reps: int) -> None:
    """Print size and load time of each page, and the ratio to the first page's load time."""
    driver = open_driver()
    try:
        base = None
        print(f"{'page':48s} {'size MiB':>9s} {'load s':>7s} {'x baseline':>10s}  notes")
        for label, path, note in pages:
            seconds = load_seconds(driver, path, reps)
            base = base or seconds
            print(f"{label:48s} {path.stat().st_size / 2**20:9.2f} {seconds:7.3f} {seconds / base:10.1f}  {note}")
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--sweep-runs", type=int, default=210)
    parser.add_argument("--atr-docs", type=int, default=100_032)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-atr", action="store_true")
    parser.add_argument("--keep", type=Path, default=None, help="write the pages here instead of a temporary folder")
    parser.add_argument("--measure-only", action="store_true", help="load the pages an earlier --keep run left there")
    args = parser.parse_args()
    if args.measure_only:
        if args.keep is None:
            parser.error("--measure-only needs --keep DIR")
        names = ["fixture", "sweep", "sweep_all", "atr", "plotly"]
        measure(
            [(name, args.keep / f"{name}.html", "") for name in names if (args.keep / f"{name}.html").exists()],
            args.reps,
        )
        return
    torch.set_num_threads(args.threads)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="view-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    pages: list[tuple[str, Path, str]] = []

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "attention_ar_cpu.safetensors"
    model, task = hookmech.load(fixture), hookmech.tasks.from_checkpoint(fixture)
    start = time.perf_counter()
    data = checkpoint_page_data(model, task, task.sample(args.n, seed=0))
    pages.append(
        (
            "baseline: attention fixture",
            write_page(data, folder / "fixture.html", "fixture"),
            f"{args.n} rows of 11 tokens; page data {time.perf_counter() - start:.1f} s",
        )
    )

    runs_dir = folder / "sweep"
    if runs_dir.exists():
        shutil.rmtree(runs_dir)
    run_ids = synthetic_sweep(runs_dir, args.sweep_runs)
    start = time.perf_counter()
    data = sweep_page_data(runs_dir, heatmaps=False)
    pages.append(
        (
            f"sweep, {args.sweep_runs} runs",
            write_page(data, folder / "sweep.html", "sweep"),
            f"{len(data['selected'])} runs' dynamics; page data {time.perf_counter() - start:.1f} s",
        )
    )
    data = sweep_page_data(runs_dir, runs=run_ids, heatmaps=False)
    pages.append(
        (
            f"sweep, {args.sweep_runs} runs, every run's dynamics",
            write_page(data, folder / "sweep_all.html", "sweep"),
            f"{len(run_ids)} runs' dynamics",
        )
    )
    if not args.skip_atr:
        path, note = atr_page(folder, args.n, args.atr_docs)
        pages.append((f"ATR, {args.n} longest rows", path, note))
    try:
        import plotly.offline

        empty = folder / "plotly.html"
        empty.write_text(
            "<!DOCTYPE html><html><head><meta charset='utf-8'></head><body><div id='p'></div><script>"
            + plotly.offline.get_plotlyjs()
            + "</script><script>Plotly.newPlot('p',[{z:[[1,2],[3,4]],type:'heatmap'}]);"
            "window.hookmechReadyMs=performance.now();</script></body></html>"
        )
        pages.append(("plotly's script alone (one 2x2 heatmap)", empty, "for comparison"))
    except ImportError:
        pass

    measure(pages, args.reps)
    if args.keep is None:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
