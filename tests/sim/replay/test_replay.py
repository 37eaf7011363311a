import numpy as np
import pytest

from policies.device import VirtualDevice
import policies
from sim.replay.costs import CostedDevice, CostModel
from sim.replay.trace_replay import replay, replay_many
from sim.replay.schema import SUMMARY_COLUMNS, summary_frame
from traces.events import AllocTrace, make_events

MiB = 1 << 20


def _trace(ops):
    """ops: list of (op, id, nbytes)."""
    return AllocTrace(
        make_events(
            range(len(ops)), [o for o, _, _ in ops], [i for _, i, _ in ops], [n for _, _, n in ops]
        ),
        name="t",
    )


def test_summary_row_has_every_schema_column():
    r = replay(_trace([("alloc", 1, 1000), ("free", 1, 1000)]), "first-fit")
    assert set(SUMMARY_COLUMNS) <= set(r.summary)
    summary_frame([r.summary])  # asserts column order and presence


def test_failed_allocation_is_counted_and_its_free_skipped():
    ops = [
        ("alloc", 1, 3 * MiB),
        ("alloc", 2, 3 * MiB),
        ("free", 2, 3 * MiB),
        ("free", 1, 3 * MiB),
        ("alloc", 3, MiB),
        ("free", 3, MiB),
    ]
    r = replay(_trace(ops), "first-fit:segment_bytes=4MiB", capacity_bytes=4 * MiB)
    s = r.summary
    assert (s["n_alloc"], s["n_failed"], s["n_free"]) == (3, 1, 2)
    assert s["failure_rate"] == pytest.approx(1 / 3)
    assert s["peak_live_bytes"] == 3 * MiB
    assert s["peak_reserved_bytes"] <= 4 * MiB


def test_driver_time_lands_on_the_call_that_grew():
    costs = CostModel.load()
    policy = policies.create("first-fit:segment_bytes=8MiB", device=CostedDevice(costs))
    ops = [("alloc", 1, 1000), ("alloc", 2, 1000), ("free", 1, 1000), ("free", 2, 1000)]
    r = replay(_trace(ops), policy)
    assert r.alloc_ns[0] >= costs.malloc_ns(8 * MiB)
    assert r.alloc_ns[1] < costs.malloc_ns(8 * MiB)  # served from the cached segment


def test_overhead_is_peak_reserved_over_peak_live():
    ops = [("alloc", 1, MiB), ("free", 1, MiB)]
    r = replay(_trace(ops), "first-fit:segment_bytes=4MiB")
    assert r.summary["overhead"] == pytest.approx(4 * MiB / MiB - 1)


def test_bookkeeping_is_deterministic_across_runs():
    rng = np.random.default_rng(0)
    ops, live, next_id = [], [], 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            i = live.pop(int(rng.integers(len(live))))
            ops.append(("free", i[0], i[1]))
        else:
            size = int(rng.integers(1, 4 * MiB))
            ops.append(("alloc", next_id, size))
            live.append((next_id, size))
            next_id += 1
    trace = _trace(ops)
    keys = [
        "peak_live_bytes",
        "peak_reserved_bytes",
        "n_failed",
        "frag_ext_mean",
        "frag_ext_max",
        "internal_waste_frac",
        "n_grow",
    ]
    a = replay(trace, "best-fit", capacity_bytes=256 * MiB, sample_every=7).summary
    b = replay(
        trace,
        policies.create("best-fit", capacity_bytes=256 * MiB, device=VirtualDevice()),
        sample_every=7,
    ).summary
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_hooks_see_each_allocation():
    seen, freed = [], []
    ops = [("alloc", 1, 100), ("alloc", 2, 200), ("free", 1, 100), ("free", 2, 200)]
    replay(_trace(ops), "first-fit", on_alloc=seen.append, on_free=freed.append)
    assert [a.nbytes for a in seen] == [100, 200]
    assert [a.nbytes for a in freed] == [100, 200]


def test_free_of_an_allocation_that_is_not_live_is_an_error():
    events = make_events([0, 1], ["alloc", "free"], [1, 2], [100, 100])
    with pytest.raises(ValueError, match="frees allocation 2"):
        replay(AllocTrace(events, name="bad"), "first-fit")


def test_replay_many_gives_one_row_per_policy_and_a_tidy_timeseries():
    ops = [("alloc", 1, 1000), ("alloc", 2, 5000), ("free", 1, 1000), ("free", 2, 5000)]
    summary, ts = replay_many(_trace(ops), ["first-fit", "best-fit"])
    assert list(summary["policy"]) == ["first-fit", "best-fit"]
    assert set(ts["policy"]) == {"first-fit", "best-fit"}
    assert {"event", "time_us", "reserved_bytes", "frag_ext"} <= set(ts.columns)


def test_rows_show_the_gap_to_the_lower_bound_and_the_planner():
    ops = [
        ("alloc", 1, MiB),
        ("alloc", 2, MiB),
        ("free", 1, MiB),
        ("alloc", 3, 2 * MiB),
        ("free", 2, MiB),
        ("free", 3, 2 * MiB),
    ]
    summary, _ = replay_many(_trace(ops), ["first-fit:segment_bytes=4MiB"])
    row = summary.iloc[0]
    assert row["lower_bound_bytes"] == 3 * MiB
    assert row["planner_peak_bytes"] >= row["lower_bound_bytes"]
    assert row["gap_to_bound"] == pytest.approx(row["peak_reserved_bytes"] / (3 * MiB) - 1)
    assert row["gap_to_planner"] == pytest.approx(
        row["peak_reserved_bytes"] / row["planner_peak_bytes"] - 1
    )


def test_the_planner_time_is_a_column_beside_the_planner():
    ops = [("alloc", 1, MiB), ("alloc", 2, MiB), ("free", 1, MiB), ("free", 2, MiB)]
    summary, _ = replay_many(_trace(ops), ["first-fit", "paged"])
    cols = summary.columns.tolist()
    assert cols.index("planner_s") == cols.index("planner") + 1
    assert (summary["planner_s"] > 0).all() and summary[
        "planner_s"
    ].nunique() == 1  # one reference per trace
