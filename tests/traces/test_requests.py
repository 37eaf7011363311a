import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.errors import TraceFormatError
from traces.requests import REQUEST_COLUMNS, RequestTrace, make_requests, validate_requests


def _trace(times, prompt=None, output=None, sessions=None, hashes=None) -> RequestTrace:
    n = len(times)
    df = make_requests(
        times,
        prompt if prompt is not None else [100] * n,
        output if output is not None else [10] * n,
        sessions,
        hashes,
    )
    return RequestTrace(df, name="t")


def test_make_requests_sorts_rebases_and_numbers():
    df = make_requests(
        [12.0, 10.0, 11.0], [3, 1, 2], [30, 10, 20], ["c", "a", "b"], [(3,), (1,), (2,)]
    )
    assert list(df.columns) == REQUEST_COLUMNS
    assert df["arrival_s"].tolist() == [0.0, 1.0, 2.0]
    assert df["prompt_tokens"].tolist() == [1, 2, 3]
    assert df["session_id"].tolist() == ["a", "b", "c"]
    assert df["hash_ids"].tolist() == [(1,), (2,), (3,)]
    assert df["request_id"].tolist() == [0, 1, 2]
    validate_requests(df)


def test_make_requests_dtypes_and_defaults():
    df = make_requests([0.0, 1.0], [5, 6], [7, 8])
    assert df["request_id"].dtype == np.int64 and df["arrival_s"].dtype == np.float64
    assert df["prompt_tokens"].dtype == np.int64 and df["output_tokens"].dtype == np.int64
    assert df["session_id"].tolist() == ["", ""]
    assert df["hash_ids"].tolist() == [(), ()]


def test_make_requests_keeps_order_of_ties():
    df = make_requests([1.0, 0.0, 1.0], [1, 2, 3], [1, 1, 1])
    assert df["prompt_tokens"].tolist() == [2, 1, 3]


@pytest.mark.parametrize(
    "column, value, reason",
    [
        ("prompt_tokens", 0, "prompt_tokens 0 must be >= 1"),
        ("output_tokens", -2, "output_tokens -2 must be >= 1"),
        ("request_id", 7, "request_id 7 should be 1"),
        ("arrival_s", -1.0, "goes back in time"),
    ],
)
def test_validate_requests_names_row_and_reason(column, value, reason):
    df = make_requests([0.0, 1.0, 2.0], [1, 1, 1], [1, 1, 1])
    df.loc[1, column] = value
    with pytest.raises(TraceFormatError, match=reason) as info:
        validate_requests(df, "f.csv")
    assert info.value.line == 3 and info.value.path == "f.csv"


def test_validate_requests_wants_first_arrival_at_zero():
    df = make_requests([0.0, 1.0], [1, 1], [1, 1])
    df["arrival_s"] += 5.0
    with pytest.raises(TraceFormatError, match="must be 0"):
        validate_requests(df)


def test_validate_requests_names_missing_columns():
    df = make_requests([0.0], [1], [1]).drop(columns=["hash_ids"])
    with pytest.raises(TraceFormatError, match="missing column"):
        validate_requests(df)


def test_scale_rate_compresses_times():
    tr = _trace([0.0, 2.0, 4.0])
    fast = tr.scale_rate(2)
    assert fast.requests["arrival_s"].tolist() == [0.0, 1.0, 2.0]
    assert fast.meta["rate_scale"] == 2.0
    assert tr.requests["arrival_s"].tolist() == [0.0, 2.0, 4.0]  # the original is untouched


@pytest.mark.parametrize("factor", [0, -1, float("nan"), float("inf")])
def test_scale_rate_rejects_bad_factor(factor):
    with pytest.raises(ValueError, match="factor"):
        _trace([0.0, 1.0]).scale_rate(factor)


@pytest.mark.parametrize("factor", [1e-300, 1e-11])
def test_scale_rate_refuses_a_trace_that_would_last_too_long(factor):
    """1e-300 used to give arrivals of inf s (float overflow), which the simulator then choked
    on."""
    with pytest.raises(ValueError, match="later than 1e\\+11 s"):
        _trace([0.0, 2.0]).scale_rate(factor)


def test_window_keeps_half_open_range_rebased():
    tr = _trace([0.0, 1.0, 2.0, 3.0, 4.0], prompt=[1, 2, 3, 4, 5])
    w = tr.window(1.0, 3.0)
    assert w.requests["prompt_tokens"].tolist() == [2, 3]
    assert w.requests["arrival_s"].tolist() == [0.0, 1.0]
    assert w.requests["request_id"].tolist() == [0, 1]
    validate_requests(w.requests)


def test_window_rejects_start_after_end():
    with pytest.raises(ValueError, match="start_s"):
        _trace([0.0, 1.0]).window(2.0, 1.0)


def test_head_takes_first_requests():
    h = _trace([0.0, 1.0, 2.0], prompt=[1, 2, 3]).head(2)
    assert h.requests["prompt_tokens"].tolist() == [1, 2]


def test_repeat_tiles_and_keeps_rate():
    tr = _trace([0.0, 1.0, 2.0])  # mean gap 1 s, so copies start every 3 s
    r = tr.repeat(3)
    assert len(r) == 9
    assert r.requests["arrival_s"].tolist() == [float(x) for x in range(9)]
    assert r.requests["request_id"].tolist() == list(range(9))
    validate_requests(r.requests)


def test_repeat_gives_copies_distinct_ids():
    tr = _trace([0.0, 1.0], sessions=["s", ""], hashes=[(0, 1), (1, 2)])
    r = tr.repeat(2)
    assert r.requests["hash_ids"].tolist() == [(0, 1), (1, 2), (3, 4), (4, 5)]
    assert r.requests["session_id"].tolist() == ["s", "", "s#1", ""]


def test_repeat_not_distinct_replays_same_ids():
    tr = _trace([0.0, 1.0], sessions=["s", ""], hashes=[(0, 1), (1, 2)])
    r = tr.repeat(2, distinct=False)
    assert r.requests["hash_ids"].tolist() == [(0, 1), (1, 2)] * 2
    assert r.requests["session_id"].tolist() == ["s", ""] * 2


def test_repeat_single_request_needs_period():
    tr = _trace([0.0])
    with pytest.raises(ValueError, match="period_s"):
        tr.repeat(2)
    assert tr.repeat(2, period_s=5.0).requests["arrival_s"].tolist() == [0.0, 5.0]


def test_describe_reports_counts_rate_and_reuse():
    tr = _trace(
        [0.0, 1.0, 2.0, 3.0],
        prompt=[10, 20, 30, 40],
        sessions=["a", "a", "b", ""],
        hashes=[(0, 1), (0, 2), (0,), ()],
    )
    d = tr.describe()
    assert d["num_requests"] == 4 and d["duration_s"] == 3.0 and d["rate_rps"] == 1.0
    assert d["interarrival_cv"] == 0.0
    assert d["prompt_tokens_p50"] == 25.0 and d["prompt_tokens_max"] == 40
    assert d["num_sessions"] == 2
    assert d["num_hash_blocks"] == 5 and d["num_unique_hash_blocks"] == 3
    assert d["hash_block_reuse_frac"] == pytest.approx(0.4)


def test_describe_of_empty_trace():
    d = _trace([]).describe()
    assert d["num_requests"] == 0 and np.isnan(d["rate_rps"])


_times = st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=50)


@settings(max_examples=60, deadline=None)
@given(_times)
def test_make_requests_always_validates(times):
    validate_requests(make_requests(times, [1] * len(times), [1] * len(times)))


@settings(max_examples=60, deadline=None)
@given(_times, st.floats(0, 1e6, allow_nan=False))
def test_windows_partition_the_trace(times, cut):
    tr = _trace(times)
    assert len(tr.window(0.0, cut)) + len(tr.window(cut)) == len(tr)


@settings(max_examples=40, deadline=None)
@given(_times, st.integers(1, 4))
def test_repeat_multiplies_length_and_stays_valid(times, k):
    tr = _trace(times)
    r = tr.repeat(k, period_s=tr.duration_s + 1.0)
    assert len(r) == k * len(tr)
    validate_requests(r.requests)
    pd.testing.assert_frame_equal(r.head(len(tr)).requests, tr.requests)
