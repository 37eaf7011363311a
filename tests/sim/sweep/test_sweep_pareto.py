"""Pareto fronts: nothing on a front is dominated, everything off it is."""

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.sweep import format_fronts, pareto_front, pareto_mask, pareto_table


def dominates(a, b) -> bool:
    return a[0] <= b[0] and a[1] <= b[1] and (a[0] < b[0] or a[1] < b[1])


# Few distinct values, so ties and duplicates are common.
coords = st.one_of(st.integers(0, 6).map(float), st.floats(-1e6, 1e6, allow_nan=False))
points = st.lists(st.tuples(coords, coords), max_size=40)


@given(points)
def test_no_point_on_the_front_is_dominated(pts):
    mask = pareto_mask([p[0] for p in pts], [p[1] for p in pts])
    for i in np.flatnonzero(mask):
        assert not any(dominates(q, pts[i]) for q in pts)


@given(points)
def test_every_point_off_the_front_is_dominated_by_one_on_it(pts):
    mask = pareto_mask([p[0] for p in pts], [p[1] for p in pts])
    front = [pts[i] for i in np.flatnonzero(mask)]
    for i in np.flatnonzero(~mask):
        assert any(dominates(q, pts[i]) for q in front)


@given(
    st.lists(
        st.tuples(
            st.one_of(coords, st.just(float("nan"))), st.one_of(coords, st.just(float("nan")))
        ),
        max_size=30,
    )
)
def test_a_point_with_a_missing_value_is_never_on_the_front_nor_dominates(pts):
    x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    mask = pareto_mask(x, y)
    missing = np.isnan(x) | np.isnan(y)
    assert not mask[missing].any()
    assert np.array_equal(mask[~missing], pareto_mask(x[~missing], y[~missing]))


def test_equal_points_are_on_the_front_together():
    assert pareto_mask([1, 1, 2, 0.5], [3, 3, 1, 4]).tolist() == [True, True, True, True]
    assert pareto_mask([1, 1, 1], [3, 2, 2]).tolist() == [False, True, True]


def results():
    return pd.DataFrame(
        {
            "trace": ["a", "a", "a", "b", "b", "a"],
            "policy": ["p1", "p2", "p3", "p1", "p2", "p4"],
            "overhead": [0.10, 0.05, 0.20, 0.30, 0.40, 0.01],
            "alloc_p99_us": [2.0, 5.0, 1.0, 9.0, 1.0, np.nan],
            "status": ["ok", "ok", "ok", "ok", "ok", "failed"],
        }
    )


def test_front_is_computed_within_each_group():
    front = pareto_front(results(), "overhead", "alloc_p99_us", by=["trace"])
    assert list(zip(front["trace"], front["policy"])) == [
        ("a", "p2"),
        ("a", "p1"),
        ("a", "p3"),
        ("b", "p1"),
        ("b", "p2"),
    ]


def test_front_without_groups_spans_every_row():
    front = pareto_front(results(), "overhead", "alloc_p99_us")
    assert list(zip(front["trace"], front["policy"])) == [("a", "p2"), ("a", "p1"), ("a", "p3")]


def test_cells_that_did_not_finish_are_left_out():
    df = results()
    df.loc[5, "alloc_p99_us"] = 0.5  # p4 would dominate everything in trace a...
    assert "p4" not in set(
        pareto_front(df, "overhead", "alloc_p99_us", by=["trace"])["policy"]
    )  # ...but failed


def test_missing_column_names_itself():
    with pytest.raises(KeyError, match="no column 'ttft_p99_s'"):
        pareto_front(results(), "overhead", "ttft_p99_s")


def test_pareto_table_is_tidy_and_prints():
    df = results().assign(
        failure_rate=[0.0, 0.0, 0.1, 0.0, 0.0, np.nan],
        cell_capacity_bytes=[None] * 6,
        cell_key=list("uvwxyz"),
    )
    table = pareto_table(df, "overhead", ["alloc_p99_us", "failure_rate"], by=["trace"])
    assert list(table.columns[:5]) == ["trace", "x_metric", "x", "y_metric", "y"]
    failures = table[table["y_metric"] == "failure_rate"]
    assert list(zip(failures["trace"], failures["policy"])) == [("a", "p2"), ("b", "p1")]
    text = format_fronts(table)
    assert "pareto front (trace=a): overhead vs alloc_p99_us" in text and "overhead_%" in text


def test_fronts_carry_the_range_columns_of_cells_checked_against_a_fits_range():
    """A sweep's point priced past a fitted calibration's range shows it in the terminal's table
    (its shares in percent, how far as a ratio); a sweep checked nowhere shows no such column."""
    df = results().assign(
        priced_past_range_frac=[0.0, 0.685, 0.25, None, None, None],
        extrapolation_ratio=[0.9, 5.7, 1.3, None, None, None],
        priced_below_range_frac=[0.0, 0.0, 0.5, None, None, None],
    )
    table = pareto_table(df, "overhead", ["alloc_p99_us"], by=["trace"])
    assert list(table.columns[-3:]) == [
        "priced_past_range_frac",
        "extrapolation_ratio",
        "priced_below_range_frac",
    ]
    text = format_fronts(table)
    header, *rows = text.split("\n\n")[0].splitlines()[1:]
    assert header.split() == [
        "policy",
        "overhead_%",
        "alloc_p99_us",
        "priced_past_range_frac_%",
        "extrapolation_ratio",
        "priced_below_range_frac_%",
    ]
    p2 = next(r.split() for r in rows if r.split()[0] == "p2")
    assert p2[3:] == ["68.5", "5.7", "0"]
    plain = pareto_table(results(), "overhead", ["alloc_p99_us"], by=["trace"])
    assert "range" not in format_fronts(plain)
    unchecked = results().assign(priced_past_range_frac=None, extrapolation_ratio=None)
    assert "range" not in format_fronts(pareto_table(unchecked, "overhead", ["alloc_p99_us"]))
