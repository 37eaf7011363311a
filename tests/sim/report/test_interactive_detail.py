"""The report's zoom levels (``sim.report.interactive.detail``): chunks decode to what was encoded,
every level keeps each bucket's minimum and maximum, and the page's byte budget holds."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sim.report.bounded_tables import read_run_series
from sim.report.interactive.detail import COLUMNS, decode_chunk, detail_levels, encode_chunk


def _series(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "time_us": np.cumsum(rng.integers(0, 50, n)).astype(np.float64),
        "reserved_bytes": (np.cumsum(rng.integers(-1, 2, n)) + 10_000) * 2.0**21,
        "live_bytes": (np.cumsum(rng.integers(-(2**20), 2**20, n)) + 2**40).astype(np.float64),
        "frag_ext": rng.random(n),
    }


def test_a_chunk_decodes_to_its_columns_bytes_and_times_exactly():
    s = _series(1000)
    kinds = [kind for _, kind in COLUMNS]
    columns = [s["time_us"]] + [
        s[name]
        for name in (
            "reserved_bytes",
            "reserved_bytes",
            "live_bytes",
            "live_bytes",
            "frag_ext",
            "frag_ext",
        )
    ]
    back = decode_chunk(encode_chunk(columns, kinds), kinds, 1000)
    for got, want in zip(back[:5], columns[:5]):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(back[5:], columns[5:]):  # fractions: 17 significant bits
        np.testing.assert_allclose(got, want, rtol=2.0**-16, atol=0)


def test_levels_keep_every_buckets_extremes_down_to_the_rows():
    s = _series(50_000)
    levels = detail_levels(s, overview_points=1000, budget_bytes=10**9)
    assert [lv["buckets"] for lv in levels] == [
        4000,
        16_000,
        50_000,
    ]  # the last: the rows themselves
    kinds = [kind for _, kind in COLUMNS]
    for lv in levels:
        cols = [
            np.concatenate(parts)
            for parts in zip(*(decode_chunk(c["data"], kinds, c["n"]) for c in lv["chunks"]))
        ]
        t, res_min, res_max, live_min, live_max = cols[:5]
        assert len(t) == lv["buckets"] and np.all(np.diff(t) >= 0) and t[0] == s["time_us"][0]
        assert (
            res_max.max() == s["reserved_bytes"].max()
            and res_min.min() == s["reserved_bytes"].min()
        )
        assert live_max.max() == s["live_bytes"].max() and live_min.min() == s["live_bytes"].min()
        # each bucket's extremes are those of its rows: rows from a bucket's time to the next's
        starts = np.searchsorted(s["time_us"], t, side="left")
        k = len(t) // 2
        rows = slice(starts[k], starts[k + 1]) if lv["buckets"] < 50_000 else slice(k, k + 1)
        if lv["buckets"] < 50_000 and t[k] != t[k - 1] and t[k + 1] != t[k]:
            assert (
                live_max[k] == s["live_bytes"][rows].max()
                and live_min[k] == s["live_bytes"][rows].min()
            )
        assert all(c["t0"] <= c["t1"] for c in lv["chunks"])


def test_a_budget_keeps_the_coarse_levels_that_fit_and_none_past_it():
    s = _series(50_000)
    everything = detail_levels(s, overview_points=1000, budget_bytes=10**9)
    sizes = [sum(len(c["data"]) for c in lv["chunks"]) for lv in everything]
    cut = detail_levels(s, overview_points=1000, budget_bytes=sizes[0] + sizes[1] // 2)
    assert [lv["buckets"] for lv in cut] == [4000]
    assert detail_levels(s, overview_points=1000, budget_bytes=10) == []
    assert (
        detail_levels({k: v[:900] for k, v in s.items()}, overview_points=1000, budget_bytes=10**9)
        == []
    )


def test_run_series_are_every_row_of_each_run_in_time_order(tmp_path):
    rows = pd.DataFrame(
        {
            "trace": "t",
            "policy": ["a", "b", "a", "b", "a"],
            "backend": "sim",
            "event": [2, 0, 0, 1, 1],
            "time_us": [30, 5, 10, 6, 20],
            "live_bytes": [3, 7, 1, 8, 2],
            "label": list("vwxyz"),
        }
    )
    rows.to_parquet(tmp_path / "timeseries.parquet")
    got = read_run_series(
        tmp_path / "timeseries.parquet", ["time_us", "live_bytes", "label", "missing"]
    )
    assert list(got) == [("t", "a", "sim"), ("t", "b", "sim")]
    np.testing.assert_array_equal(got[("t", "a", "sim")]["time_us"], [10, 20, 30])
    np.testing.assert_array_equal(got[("t", "a", "sim")]["live_bytes"], [1, 2, 3])
    np.testing.assert_array_equal(got[("t", "b", "sim")]["live_bytes"], [7, 8])
    assert set(got[("t", "a", "sim")]) == {
        "time_us",
        "live_bytes",
    }  # text and absent columns left out


def test_the_page_stays_within_its_budget(tmp_path, monkeypatch):
    from sim.report.html import build_html_report
    from sim.replay.schema import write_results

    n = 60_000
    s = _series(n)
    ts = pd.DataFrame(
        {
            "trace": "t",
            "policy": "p",
            "backend": "sim",
            "event": np.arange(n),
            "time_us": s["time_us"].astype(np.int64),
            "live_bytes": s["live_bytes"].astype(np.int64),
            "allocated_bytes": s["live_bytes"].astype(np.int64),
            "reserved_bytes": s["reserved_bytes"].astype(np.int64),
            "frag_ext": s["frag_ext"],
        }
    )
    summary = pd.DataFrame(
        {"trace": ["t"], "policy": ["p"], "backend": ["sim"], "peak_reserved_bytes": [1]}
    )
    write_results(tmp_path / "run", summary, ts)
    import sim.report.html as html_report

    monkeypatch.setattr(html_report, "PAGE_BUDGET_BYTES", 0)
    bare = len(build_html_report([tmp_path / "run"]).encode())
    assert '"detail":[]' in build_html_report([tmp_path / "run"])
    budget = bare + 1_000_000  # the first level (~0.75 MB) fits, the rows (~1.1 MB more) do not
    monkeypatch.setattr(html_report, "PAGE_BUDGET_BYTES", budget)
    page = build_html_report([tmp_path / "run"])
    assert '"detail":[{' in page
    assert (
        bare < len(page.encode()) <= budget + 10_000
    )  # the chunks' few JSON keys besides their data
    monkeypatch.setattr(html_report, "PAGE_BUDGET_BYTES", 10**9)
    assert (
        len(build_html_report([tmp_path / "run"]).encode()) > budget + 10_000
    )  # all levels: more than that


@pytest.mark.parametrize("n", [0, 1])
def test_no_levels_for_tiny_runs(n):
    assert detail_levels(_series(n), overview_points=10, budget_bytes=10**6) == []
