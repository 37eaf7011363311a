"""Load time of report pages in headless Chromium: navigation start to ``window.poollab.ready``
(every timeline drawn and the segment view at its first moment), median of ``--repeat`` loads.

Usage: python benchmarks/report_load.py PAGE.html [PAGE.html ...] [--repeat 3]
A page without ``window.poollab`` (a plain library page) is timed to its ``load`` event plus
``window.benchReady`` when it sets one.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

from playwright.sync_api import sync_playwright


def load_times(pages: list[Path], repeat: int = 3) -> dict[Path, tuple[float, list[float], list[str]]]:
    """Per page: (median load seconds, every load's seconds, page errors), in headless Chromium."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    out = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        for path in pages:
            times = []
            errors: list[str] = []
            for _ in range(repeat):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.on("pageerror", lambda e: errors.append(str(e)))
                t0 = time.perf_counter()
                page.goto(path.resolve().as_uri(), timeout=120_000)
                page.wait_for_function("(window.poollab && window.poollab.ready) || window.benchReady === true "
                                       "|| (!window.poollab && window.benchReady === undefined)", timeout=120_000)
                times.append(time.perf_counter() - t0)
                page.close()
            out[path] = (statistics.median(times), times, errors)
        browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pages", nargs="+", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for path, (median, times, errors) in load_times(args.pages, args.repeat).items():
        size = path.stat().st_size / 2**20
        print(f"{path}: {size:.2f} MiB, load {median:.2f} s (median of {len(times)}; "
              f"{', '.join(f'{t:.2f}' for t in times)}){' ERRORS ' + str(errors) if errors else ''}")


if __name__ == "__main__":
    main()
