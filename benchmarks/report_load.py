"""Load time of report pages in headless Chromium: navigation start to ``window.poollab.ready``
(every timeline drawn and the segment view at its first moment), median of ``--repeat`` loads.

Usage: python benchmarks/report_load.py PAGE.html [PAGE.html ...] [--repeat 3] [--zoom 0.001]
``--zoom F`` also times ``window.poollab.setRange`` to the middle fraction F of the first trace's
time range (the zoom levels it decodes and the redraw), and counts the points then drawn per
line: how much detail a zoom finds.
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


def load_times(pages: list[Path], repeat: int = 3, zoom: float | None = None) -> dict[Path, tuple]:
    """Per page: (median load seconds, every load's seconds, page errors, zoom) in headless
    Chromium; zoom: None, or (median seconds of the zoom's redraw, points per line drawn)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    out = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        for path in pages:
            times, zoom_s, points = [], [], 0
            errors: list[str] = []
            for _ in range(repeat):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.on("pageerror", lambda e: errors.append(str(e)))
                t0 = time.perf_counter()
                page.goto(path.resolve().as_uri(), timeout=120_000)
                page.wait_for_function(
                    "(window.poollab && window.poollab.ready) || window.benchReady === true || "
                    "(!window.poollab && window.benchReady === undefined)",
                    timeout=120_000,
                )
                times.append(time.perf_counter() - t0)
                if zoom is not None and page.evaluate("!!window.poollab"):
                    took, points = page.evaluate(_ZOOM_JS, zoom)
                    zoom_s.append(took)
                page.close()
            out[path] = (
                statistics.median(times),
                times,
                errors,
                (statistics.median(zoom_s), points) if zoom_s else None,
            )
        browser.close()
    return out


#: Zoom to the middle ``fraction`` of trace 0's range; [seconds to redraw, points of the first line
#: inside the range].
_ZOOM_JS = """async (fraction) => {
  const [a, b] = [window.poollab.range(0)[0], window.poollab.range(0)[1]];
  const [full0, full1] = [Math.min(a, b), Math.max(a, b)];
  const mid = (full0 + full1) / 2, half = (full1 - full0) * fraction / 2;
  const t0 = performance.now();
  await window.poollab.setRange(0, mid - half, mid + half);
  const took = (performance.now() - t0) / 1000;
  const line = document.getElementById("tl-0").data[0];
  return [took, line.x.filter((x) => x >= mid - half && x <= mid + half).length];
}"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pages", nargs="+", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--zoom",
        type=float,
        default=None,
        help="also time a zoom to this middle fraction of the run",
    )
    args = ap.parse_args()
    for path, (median, times, errors, zoom) in load_times(
        args.pages, args.repeat, args.zoom
    ).items():
        size = path.stat().st_size / 2**20
        zoomed = (
            f"; zoom to {args.zoom:g} of the run: {zoom[0]:.3f} s, {zoom[1]} points per line"
            if zoom
            else ""
        )
        print(
            f"{path}: {size:.2f} MiB, load {median:.2f} s (median of {len(times)}; "
            f"{', '.join(f'{t:.2f}' for t in times)}){zoomed}"
            f"{' ERRORS ' + str(errors) if errors else ''}"
        )


if __name__ == "__main__":
    main()
