"""Lower bound and offline planner (sim/replay/bounds.py): valid plans, never below the bound, fast
enough."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.replay.bounds import (
    bounds,
    check_plan,
    lifetimes,
    lower_bound_bytes,
    plan_best_fit_in_order,
    plan_greedy_by_size,
)
from traces import bundled_path, read_alloc_trace
from traces.events import AllocTrace, make_events

KiB = 1 << 10


def trace_of(ops):
    """``ops``: ("a", id, nbytes) or ("f", id); times are the event index."""
    sizes = {}
    rows = []
    for k, op in enumerate(ops):
        if op[0] == "a":
            sizes[op[1]] = op[2]
            rows.append((k, "alloc", op[1], op[2]))
        else:
            rows.append((k, "free", op[1], sizes[op[1]]))
    t, o, i, n = zip(*rows) if rows else ((), (), (), ())
    return AllocTrace(make_events(t, o, i, n), name="t")


def test_the_lower_bound_is_the_peak_of_live_bytes():
    tr = trace_of([("a", 0, 100), ("a", 1, 300), ("f", 0), ("a", 2, 50), ("f", 1)])
    assert lower_bound_bytes(tr) == 400


def test_lifetimes_run_from_alloc_to_free_event():
    tr = trace_of([("a", 0, 100), ("a", 1, 300), ("f", 0)])
    assert lifetimes(tr) == ([0, 1], [2, 3], [100, 300])


def test_greedy_by_size_reuses_the_space_of_allocations_already_dead():
    # three equal allocations, each overlapping only its neighbours: two slots suffice
    starts, ends, sizes = [0, 1, 2], [2, 3, 4], [4096] * 3
    peak, offsets = plan_greedy_by_size(starts, ends, sizes)
    assert peak == 8192 and offsets[0] == offsets[2]


def test_allocations_live_throughout_form_a_band_at_the_bottom():
    starts, ends, sizes = [0, 1, 2, 5], [10, 10, 4, 8], [1024, 2048, 4096, 4096]
    peak, offsets = plan_greedy_by_size(starts, ends, sizes)
    assert sorted(offsets[:2]) == [0, 2048] and min(offsets[2:]) == 3072 and peak == 3072 + 4096


def test_the_largest_allocation_is_placed_first_at_the_bottom():
    starts, ends, sizes = [0, 1, 3, 5], [2, 5, 6, 8], [KiB, 8 * KiB, KiB, KiB]
    peak, offsets = plan_greedy_by_size(starts, ends, sizes)
    assert offsets[1] == 0 and peak == 9 * KiB
    assert offsets[3] == 0  # the last one reuses the big one's space once it is dead


def test_check_plan_catches_an_overlap():
    with pytest.raises(AssertionError, match="overlaps"):
        check_plan([0, 1], [3, 4], [100, 100], [0, 50])


_ops = st.lists(
    st.tuples(st.integers(1, 64 * KiB), st.integers(0, 40), st.integers(1, 40)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops)
def test_plans_are_valid_and_never_below_the_bound(ops):
    starts = [s for _, s, _ in ops]
    ends = [s + d for _, s, d in ops]
    sizes = [-(-n // 512) * 512 for n, _, _ in ops]
    live_peak = max(
        sum(z for z, s, e in zip(sizes, starts, ends) if s <= t < e) for t in range(max(ends))
    )
    for planner in (plan_greedy_by_size, plan_best_fit_in_order):
        peak, offsets = planner(starts, ends, sizes)
        assert check_plan(starts, ends, sizes, offsets) == peak
        assert live_peak <= peak <= sum(sizes)


def test_bounds_of_the_bundled_slice():
    b = bounds(read_alloc_trace(bundled_path("llama1b_generate_slice.pickle.gz")))
    assert b["lower_bound_bytes"] == 2_079_592_664 and b["planner"] == "greedy-by-size"
    assert (
        b["aligned_lower_bound_bytes"] <= b["planner_peak_bytes"] <= 1.01 * b["lower_bound_bytes"]
    )
    assert b["num_allocations"] == 12_234


def test_the_in_order_planner_is_selectable():
    tr = trace_of([("a", 0, 4096), ("a", 1, 4096), ("f", 0), ("a", 2, 2048)])
    b = bounds(tr, planner="best-fit-in-order")
    assert (b["planner"], b["planner_peak_bytes"], b["lower_bound_bytes"]) == (
        "best-fit-in-order",
        8192,
        8192,
    )


def test_an_empty_trace_has_zero_bounds():
    b = bounds(trace_of([]))
    assert (b["lower_bound_bytes"], b["planner_peak_bytes"]) == (0, 0)


@pytest.mark.parametrize("kw", [{"planner": "magic"}, {"alignment_bytes": 0}])
def test_bad_options_are_refused(kw):
    with pytest.raises(ValueError):
        bounds(trace_of([("a", 0, 1)]), **kw)


def test_auto_falls_back_to_best_fit_in_order_when_greedy_would_take_too_long(monkeypatch):
    import sim.replay.bounds

    tr = trace_of(
        [("a", 0, 4096), ("a", 1, 4096), ("a", 2, 4096), ("f", 0), ("f", 1), ("f", 2), ("a", 3, 1)]
    )
    assert bounds(tr)["planner"] == "greedy-by-size"
    monkeypatch.setattr(sim.replay.bounds, "GREEDY_WORK_LIMIT", 1)
    assert bounds(tr)["planner"] == "best-fit-in-order"


def test_greedy_work_counts_allocations_live_at_each_start():
    from sim.replay.bounds import greedy_work

    # [0, 10) overlaps all others and is left out; then 1 + 2 + 1 live at the three starts
    assert greedy_work([0, 1, 2, 6], [10, 5, 3, 8]) == 4


def test_best_fit_in_order_holds_no_tuple_an_event():
    # the events were a sorted list of (time, is_start, index) tuples: 116 bytes an event at the
    # peak (a million-event replay's bounds worker peaked 100 MB above the others for it)
    import random
    import tracemalloc

    rng = random.Random(3)
    n = 50_000
    starts = list(range(0, 2 * n, 2))
    ends = [s + rng.randrange(1, 400) for s in starts]
    sizes = [512 * rng.randrange(1, 64) for _ in range(n)]
    tracemalloc.start()
    try:
        plan_best_fit_in_order(starts, ends, sizes)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < 64 * 2 * n, peak_bytes / (2 * n)


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30), st.integers(1, 9)), max_size=60))
@settings(max_examples=60, deadline=None)
def test_best_fit_in_order_takes_events_as_sorted_tuples_order_them(lives):
    # ties in time: an end before a start, then by index, as sorted((time, is_start, i)) put them
    from sim.replay.bounds import _time_order

    starts = [s for s, _, _ in lives]
    ends = [s + d for s, d, _ in lives]
    sizes = [512 * k for _, _, k in lives]
    events = sorted(
        [(s, 1, i) for i, s in enumerate(starts)] + [(e, 0, i) for i, e in enumerate(ends)]
    )
    assert list(_time_order(starts, ends)) == [(bool(f), i) for _, f, i in events]
    assert plan_best_fit_in_order(starts, ends, sizes)[0] >= max(
        [sum(z for s, e, z in zip(starts, ends, sizes) if s <= t < e) for t in range(80)],
        default=0,
    )
