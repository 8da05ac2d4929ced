"""Screenshots of `hookmech view` pages for docs/guide.md ("Looking at results"), in headless
Chromium (Debian's chromium and chromium-driver; selenium from the dev extra, kept offline).

    python scripts/make_view_screenshots.py [--out docs/img]

Writes view-heatmap.png (the attention fixture's heatmap with a cell's drill-down),
view-attention.png (its effective attention and induction scores) and view-sweep.png (the
mechanism figures of bench/view_pages.py's synthetic 210-run sweep), each one page section,
reduced to 128 colours so that the files stay small.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from view_pages import open_driver, synthetic_sweep  # noqa: E402

from hookmech.cli.main import main as hookmech  # noqa: E402


def run(argv: list[str]) -> None:
    try:
        hookmech(argv)
    except SystemExit as done:
        if done.code:
            raise


def section_png(driver, page: Path, heading: str, out: Path, click: str | None = None) -> None:
    """Save the page section whose heading starts with `heading` (after clicking the CSS selector `click`)."""
    from PIL import Image
    from selenium.webdriver.common.by import By

    driver.get(page.as_uri())
    if click:
        driver.find_element(By.CSS_SELECTOR, click).click()
    section = next(
        s
        for s in driver.find_elements(By.CSS_SELECTOR, "section")
        if s.find_element(By.TAG_NAME, "h2").text.startswith(heading)
    )
    driver.execute_script("arguments[0].scrollIntoView()", section)
    image = Image.open(io.BytesIO(section.screenshot_as_png)).convert("RGB")
    image.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB, {image.width}x{image.height})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fixture = REPO / "fixtures" / "attention_ar_cpu.safetensors"
        run(
            [
                "view",
                "--ckpt",
                str(fixture),
                "--n",
                "320",
                "--seed",
                "0",
                "--threads",
                "1",
                "-o",
                str(tmp / "ckpt.html"),
            ]
        )
        synthetic_sweep(tmp / "sweep", 210)
        run(["view", str(tmp / "sweep"), "--no-heatmaps", "-o", str(tmp / "sweep.html")])
        driver = open_driver()
        try:
            driver.set_window_size(1280, 1000)
            section_png(
                driver,
                tmp / "ckpt.html",
                "Attribution",
                args.out / "view-heatmap.png",
                click='rect.cell[data-site="L1.block_in"][data-pos="value"]',
            )
            section_png(driver, tmp / "ckpt.html", "Effective attention", args.out / "view-attention.png")
            section_png(driver, tmp / "sweep.html", "Mechanisms", args.out / "view-sweep.png")
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
