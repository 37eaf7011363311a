import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.events import AllocTrace, make_events
from traces.info import describe_alloc_trace, live_bytes


def _trace(rows):
    t, op, ids, sizes, streams, tags = zip(*rows)
    return AllocTrace(make_events(t, op, ids, sizes, streams, tags), name="t", format="csv")


ROWS = [
    (0, "alloc", 0, 100, 0, "pre-trace"),
    (0, "alloc", 1, 300, 0, "kv"),
    (5, "free", 0, 100, 0, ""),
    (6, "alloc", 2, 50, 1, ""),
    (9, "free", 2, 50, 1, ""),
]


def test_counts():
    info = describe_alloc_trace(_trace(ROWS))
    assert (
        info["num_events"],
        info["num_allocs"],
        info["num_frees"],
        info["num_never_freed"],
        info["num_pre_trace_allocs"],
    ) == (5, 3, 2, 1, 1)


def test_peak_live_bytes_and_when():
    info = describe_alloc_trace(_trace(ROWS))
    assert (info["peak_live_bytes"], info["peak_live_time_us"], info["final_live_bytes"]) == (
        400,
        0,
        300,
    )


def test_free_subtracts_its_allocation_size_not_its_own():
    rows = [(0, "alloc", 0, 100, 0, ""), (1, "free", 0, 1, 0, ""), (2, "alloc", 1, 10, 0, "")]
    assert list(live_bytes(_trace(rows))) == [100, 0, 10]


def test_sizes_streams_and_tags():
    info = describe_alloc_trace(_trace(ROWS))
    sizes = (
        info["size_min_bytes"],
        info["size_p50_bytes"],
        info["size_max_bytes"],
        info["num_distinct_sizes"],
    )
    assert sizes == (50, 100, 300, 3)
    assert info["streams"] == {0: 2, 1: 1}
    assert info["tags"] == {"(untagged)": 1, "kv": 1, "pre-trace": 1}
    assert info["tag_bytes"] == {"(untagged)": 50, "kv": 300, "pre-trace": 100}
    assert info["duration_us"] == 9


def test_result_is_json_ready():
    json.dumps(describe_alloc_trace(_trace(ROWS)))


def test_empty_trace():
    info = describe_alloc_trace(AllocTrace(make_events([], [], [], []), name="empty"))
    assert (info["num_events"], info["peak_live_bytes"], info["size_max_bytes"]) == (0, 0, 0)


def test_real_snapshot_peak(real_snapshot):
    info = describe_alloc_trace(real_snapshot)
    # requested bytes: just under PyTorch's own peak of allocated (rounded) bytes, 2,081,692,672
    assert info["peak_live_bytes"] == 2_079_592_664
    assert info["num_pre_trace_allocs"] == 149


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 1000)), max_size=80))
def test_live_bytes_matches_a_loop(steps):
    rows, live, expected, next_id = [], {}, [], 0
    for free_one, size in steps:
        if free_one and live:
            aid = min(live)
            rows.append((len(rows), "free", aid, live.pop(aid), 0, ""))
        else:
            rows.append((len(rows), "alloc", next_id, size, 0, ""))
            live[next_id] = size
            next_id += 1
        expected.append(sum(live.values()))
    if not rows:
        return
    assert np.array_equal(live_bytes(_trace(rows)), expected)


def test_sums_past_int64_are_exact_not_wrapped():
    from traces.events import AllocTrace, make_events
    from traces.info import describe_alloc_trace

    big = 2**62
    ev = make_events(
        [0, 1, 2, 3],
        ["alloc", "alloc", "alloc", "free"],
        [0, 1, 2, 0],
        [big, big, big, big],
        tag=["kv", "kv", "w", ""],
    )
    info = describe_alloc_trace(AllocTrace(ev, name="big"))
    assert info["total_alloc_bytes"] == 3 * big
    assert info["peak_live_bytes"] == 3 * big
    assert info["final_live_bytes"] == 2 * big
    assert info["tag_bytes"] == {"kv": 2 * big, "w": big}
    assert info["size_mean_bytes"] == float(big)


def test_what_a_reader_adjusted_is_described(tmp_path):
    from traces.rmm_log import read_rmm_log

    path = tmp_path / "rmm.csv"
    path.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000500,allocate,0x10,8,0xa\n"
        "2,10:00:00.000200,free,0x10,8,0xb\n"
    )
    info = describe_alloc_trace(read_rmm_log(path))
    assert (info["num_time_clamped"], info["num_cross_stream_frees"]) == (1, 1)
    assert info["num_failed_allocations"] == 0
