"""The interactive report in headless Chromium: loads with no console errors, the time range
moves, and the segment view at a given time reads back the replay's own numbers.

Skips when Playwright or a Chromium binary is missing (CI installs Debian's chromium first)."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest

from sim.report.html import write_html_report
from sim.replay.trace_replay import replay_tables
from sim.replay.schema import write_results
from traces.detect import read_alloc_trace

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)"
)

SNAPSHOT = "traces/data/llama1b_generate_slice.pickle.gz"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A replay of the bundled snapshot slice with layouts recorded, a tight capacity so that
    one policy refuses requests, and its interactive report."""
    out = tmp_path_factory.mktemp("interactive")
    trace = read_alloc_trace(SNAPSHOT)
    tables = replay_tables(
        trace, ["best-fit", "torch-caching"], record_layout=True, with_bounds=False
    )
    write_results(
        out / "run", tables.summary, tables.timeseries, extra_tables={"layout": tables.layout}
    )
    cap = int(tables.summary["peak_live_bytes"].max() * 1.02)
    tight = replay_tables(
        trace, ["size-class"], capacity_bytes=cap, record_layout=True, with_bounds=False
    )
    write_results(
        out / "tight", tight.summary, tight.timeseries, extra_tables={"layout": tight.layout}
    )
    compacting = replay_tables(trace, ["compacting"], with_bounds=False)
    write_results(
        out / "compact",
        compacting.summary,
        compacting.timeseries,
        extra_tables={"compactions": compacting.compactions},
    )
    page = write_html_report([out / "run", out / "tight", out / "compact"], out / "report.html")
    return page, tables, tight, compacting


@pytest.fixture(scope="module")
def browser_page(report):
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on(
            "request",
            lambda r: (
                None
                if r.url.startswith(("file:", "data:", "blob:"))
                else errors.append(f"fetched {r.url}")
            ),
        )
        page.goto(report[0].resolve().as_uri())
        page.wait_for_function("window.poollab && window.poollab.ready", timeout=30_000)
        yield page, errors
        browser.close()


def test_loads_with_no_console_errors(browser_page):
    page, errors = browser_page
    assert errors == []
    assert page.locator("#tl-0 .main-svg").count() >= 1  # Plotly drew the timeline


def test_time_range_filter_moves_the_axis_and_the_slider(browser_page, report):
    page, errors = browser_page
    t0, t1 = page.evaluate("window.poollab.range(0)")
    mid0, mid1 = t0 + (t1 - t0) * 0.25, t0 + (t1 - t0) * 0.5
    page.fill("#from-0", str(mid0))
    page.fill("#to-0", str(mid1))
    page.click("#apply-0")
    page.wait_for_timeout(300)
    got = page.evaluate("window.poollab.range(0)")
    assert got == pytest.approx([mid0, mid1], rel=1e-4)
    axis = page.evaluate("document.getElementById('tl-0').layout.xaxis.range")
    assert axis == pytest.approx([mid0, mid1], rel=1e-4)
    lo, hi = page.evaluate(
        "[+document.getElementById('slider-0').min, +document.getElementById('slider-0').max]"
    )
    assert 0 < lo <= hi  # the slider only offers moments inside the range
    page.click("#reset-0")
    assert errors == []


def test_segment_view_reads_back_the_replays_numbers(browser_page, report):
    page, _ = browser_page
    _, tables, _, _ = report
    layout = tables.layout
    best = layout[(layout["policy"] == "best-fit") & ~layout["at_failure"]]
    samples = best.drop_duplicates("sample")
    chosen = samples.iloc[len(samples) // 2]
    runs = page.evaluate(f"window.poollab.showTime(0, {chosen['time_us'] / 1e6})")
    ts = tables.timeseries
    for policy in ("best-fit", "torch-caching"):
        row = ts[(ts["policy"] == policy) & (ts["event"] == chosen["event"])].iloc[0]
        got = runs[f"{policy} (run)"]
        assert got["event"] == chosen["event"]
        assert got["reserved_bytes"] == row["reserved_bytes"]
        assert got["num_segments"] == row["num_segments"]
        assert got["largest_free_bytes"] == row["largest_free_bytes"]
        assert got["free_bytes"] == row["reserved_bytes"] - row["allocated_bytes"]
    recorded = runs["pytorch (recorded) (run)"]
    assert recorded["num_segments"] > 0 and recorded["reserved_bytes"] > 0


def test_pytorchs_live_blocks_at_a_moment_are_the_snapshots_live_bytes(browser_page, report):
    """PyTorch's lanes hold its live blocks: their bytes at a chosen moment are the bytes the
    parser's events leave live after that event (and the replay's live bytes there)."""
    page, errors = browser_page
    _, tables, _, _ = report
    events = read_alloc_trace(SNAPSHOT).events
    signed = (
        events["nbytes"]
        .where(events["op"] == "alloc", -events["nbytes"])
        .where(events["op"] != "empty_cache", 0)
    )
    live_after = signed.cumsum()
    recorded = tables.layout[tables.layout["policy"] == "pytorch (recorded)"].drop_duplicates(
        "sample"
    )
    checked = 0
    for k in (len(recorded) // 3, 2 * len(recorded) // 3, len(recorded) - 1):
        chosen = recorded.iloc[k]
        got = page.evaluate(f"window.poollab.showTime(0, {chosen['time_us'] / 1e6})")[
            "pytorch (recorded) (run)"
        ]
        assert got["event"] == chosen["event"]
        assert got["live_bytes"] == live_after.iloc[chosen["event"]] > 0
        ts = tables.timeseries
        assert (
            got["live_bytes"]
            == ts[(ts["policy"] == "best-fit") & (ts["event"] == chosen["event"])][
                "live_bytes"
            ].iloc[0]
        )
        assert 0 < got["free_bytes"] < got["reserved_bytes"] and got["num_free_blocks"] > 0
        checked += 1
    assert checked == 3
    text = page.inner_text("#seginfo-0-2")
    assert "live blocks" in text and "blocks not recorded" not in text
    assert errors == []


def test_clicking_a_failure_shows_the_request_and_the_free_blocks(browser_page, report):
    page, errors = browser_page
    _, _, tight, _ = report
    assert tight.summary["n_failed"].iloc[0] > 0
    first = tight.layout[tight.layout["kind"] == "request"].iloc[0]
    page.evaluate("window.poollab.showFailure(0, 0)")
    text = page.inner_text("#fail-0")
    asked = f"{first['length_bytes'] / 2**20:,.2f}".rstrip("0").rstrip(".")
    assert f"a request of {asked} MiB was refused" in text and "largest free" in text
    lay = tight.layout[tight.layout["policy"] == "size-class"]
    holes = lay[(lay["sample"] == first["sample"]) & (lay["kind"] == "free")]
    largest = int(holes["length_bytes"].max()) if len(holes) else 0
    state = page.evaluate("window.poollab.segmentState(0)")
    assert state["size-class (tight)"]["largest_free_bytes"] == largest < first["length_bytes"]
    assert errors == []


def test_tables_sort_on_a_header_click(browser_page):
    page, _ = browser_page
    table = page.locator("#summary table.tbl").first
    header = table.locator("thead th", has_text="peak_reserved").first
    col = header.evaluate("th => th.cellIndex")
    header.click()
    values = table.locator("tbody tr").evaluate_all(
        f"rows => rows.map(r => parseFloat(r.cells[{col}].textContent.replace(/,/g, '')))"
    )
    assert values == sorted(values) and len(values) >= 2


def test_compactions_are_marked_at_the_recorded_times(browser_page, report):
    page, errors = browser_page
    compactions = report[3].compactions
    assert len(compactions) > 0  # the bundled slice makes best-fit fragment enough to compact
    marker = page.evaluate(
        "document.getElementById('tl-0').data.find(t => t.name === 'compaction')"
    )
    want = sorted((compactions["time_us"] / 1e6).round(6).tolist())
    assert marker["x"] == pytest.approx(want, abs=1e-9)
    moved = compactions.sort_values("time_us", kind="stable")["moved_bytes"]
    first = f"{moved.iloc[0] / 2**20:,.2f}".rstrip("0").rstrip(".")
    assert f"{first} MiB moved" in marker["text"][0]
    assert errors == []


@pytest.fixture(scope="module")
def zoom_report(tmp_path_factory):
    """A synthetic replay sampled at every event (~91,000 rows: nine times the overview's
    ``DETAIL_POINTS``) and its report; returns the page and the result's time-series parquet."""
    from traces.synth_alloc import generate_alloc_trace

    out = tmp_path_factory.mktemp("zoom")
    tables = replay_tables(
        generate_alloc_trace(num_requests=2, max_batch=2, seed=1),
        ["best-fit"],
        sample_every=1,
        with_bounds=False,
    )
    write_results(out / "run", tables.summary, tables.timeseries)
    return write_html_report([out / "run"], out / "report.html"), out / "run" / "timeseries.parquet"


def _drawn_in_range(
    page, x0: float, x1: float
) -> tuple[dict, dict[str, list[tuple[float, float]]]]:
    """Zoom trace 0 to [x0, x1]; the level drawn and the (time, bytes) points of each byte panel
    there."""
    levels, lines = page.evaluate(
        f"window.poollab.setRange(0, {x0}, {x1}).then(() => [window.poollab.levels(0), "
        "document.getElementById('tl-0').data.filter(d => d.yaxis === 'y' || d.yaxis === "
        "'y2').map(d => [d.yaxis, d.x, d.y])])"
    )
    panel = {"y": "reserved_bytes", "y2": "live_bytes"}
    return next(iter(levels.values())), {
        panel[axis]: [(x, y * 2**20) for x, y in zip(xs, ys) if x0 <= x <= x1]
        for axis, xs, ys in lines
    }


def test_zooming_in_draws_the_replays_own_rows_finer_than_the_overview(zoom_report, browser_page):
    """Zoomed into a narrow range, the page draws the result's rows themselves (decoded from the
    embedded zoom levels), not the overview's buckets: the peak and the trough drawn there are the
    true ones from the parquet, with many times the overview's points; a wider zoom draws a
    coarser level that still keeps the range's peak."""
    from sim.report.bounded_tables import read_drawn_table
    from sim.report.interactive.page import DETAIL_POINTS

    page_path, parquet = zoom_report
    ts = pd.read_parquet(parquet).sort_values("time_us", kind="stable").reset_index(drop=True)
    t_s = ts["time_us"].to_numpy() / 1e6
    assert len(ts) > 8 * DETAIL_POINTS
    overview_t_s = read_drawn_table(parquet, DETAIL_POINTS)["time_us"].to_numpy() / 1e6
    middle = ts["live_bytes"].to_numpy()[len(ts) // 4 : 3 * len(ts) // 4]
    peak = len(ts) // 4 + int(
        middle.argmax()
    )  # the highest live bytes in the middle half: ranges around it
    # a second page of the module's browser: Playwright's sync API runs once per process
    page = browser_page[0].context.browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(page_path.resolve().as_uri())
        page.wait_for_function("window.poollab && window.poollab.ready", timeout=30_000)
        assert (
            page.evaluate("Object.values(window.poollab.levels(0))[0].level") == 0
        )  # min and max: troughs too
        for half_rows, want_level in ((150, None), (1_500, 0)):
            x0, x1 = t_s[peak - half_rows], t_s[peak + half_rows]
            inside = ts[(t_s >= x0) & (t_s <= x1)]
            level, drawn = _drawn_in_range(page, x0, x1)
            num_overview = int(((overview_t_s >= x0) & (overview_t_s <= x1)).sum())
            assert len(drawn["live_bytes"]) >= 3 * num_overview > 0
            for column in ("reserved_bytes", "live_bytes"):
                assert max(y for _, y in drawn[column]) == inside[column].max()
            if want_level is None:  # the rows themselves: every extreme, and each point a row
                assert level["buckets"] == len(ts)
                rows = set(zip(inside["time_us"] / 1e6, inside["live_bytes"].astype(float)))
                assert set(drawn["live_bytes"]) <= rows
                for column in ("reserved_bytes", "live_bytes"):
                    assert min(y for _, y in drawn[column]) == inside[column].min()
            else:
                assert level["level"] == want_level and level["buckets"] < len(ts)
    finally:
        page.close()
    assert errors == []
