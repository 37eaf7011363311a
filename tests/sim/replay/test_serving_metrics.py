import math
from types import SimpleNamespace

import pytest

from sim.serving.scheduler import RequestState
from sim.replay.serving_metrics import SERVING_COLUMNS, request_table, serving_summary


def r(rid, arrival, first, finish, output, status="finished", kind=""):
    return SimpleNamespace(
        request_id=rid,
        arrival_s=arrival,
        prompt_tokens=100,
        output_tokens=output,
        num_generated=output if status == "finished" else 0,
        first_token_s=first,
        finish_s=finish,
        num_preemptions=0,
        num_swaps=0,
        prefix_hit_tokens=0,
        status=RequestState(status),
        reject_reason=kind and f"{kind} (details)",
        reject_kind=kind,
    )


def _by_rows(reqs):
    """The request table as the frame of row tuples made it (pandas inferring each column)."""
    import pandas as pd

    from sim.replay.serving_metrics import RECORDED_COLUMNS, request_frame

    rows = [
        tuple(x.status.value if c == "status" else getattr(x, c) for c in RECORDED_COLUMNS)
        for x in reqs
    ]
    return request_frame(pd.DataFrame(rows, columns=RECORDED_COLUMNS))


def test_ttft_tpot_e2e_definitions():
    t = request_table([r(0, 1.0, 1.5, 3.5, 5)])
    row = t.iloc[0]
    assert row.ttft_s == pytest.approx(0.5)
    assert row.e2e_s == pytest.approx(2.5)
    assert row.tpot_s == pytest.approx((2.5 - 0.5) / (5 - 1))


def test_tpot_of_a_one_token_output_is_undefined():
    assert math.isnan(request_table([r(0, 0.0, 1.0, 1.0, 1)]).iloc[0].tpot_s)


def test_summary_counts_and_percentiles_over_finished_requests_only():
    rows = [r(i, 0.0, 0.1 * (i + 1), 1.0 + i, 11) for i in range(10)]
    rows.append(r(10, 0.0, math.nan, math.nan, 11, status="rejected"))
    s = serving_summary(request_table(rows), duration_s=20.0, num_preemptions=3, kv_token_util=0.5)
    assert list(s) == SERVING_COLUMNS
    assert (s["n_requests"], s["n_finished"], s["n_rejected"], s["n_preempted"]) == (11, 10, 1, 3)
    assert s["ttft_p50_s"] == pytest.approx(0.55)
    assert s["throughput_tok_s"] == s["output_tok_s"] == pytest.approx(10 * 11 / 20.0)
    assert s["input_tok_s"] == pytest.approx(10 * 100 / 20.0)  # prompts of finished requests only


def test_rejections_are_counted_by_kind_most_first():
    rows = [r(0, 0.0, 0.1, 1.0, 2)]
    rows += [
        r(i, 0.0, math.nan, math.nan, 2, "rejected", "prompt>=max_model_len") for i in (1, 2, 3)
    ]
    rows += [r(4, 0.0, math.nan, math.nan, 2, "rejected", "kv>budget")]
    s = serving_summary(request_table(rows), duration_s=1.0, num_preemptions=0, kv_token_util=0.5)
    assert s["rejected_by"] == "prompt>=max_model_len: 3, kv>budget: 1"
    assert (
        serving_summary(
            request_table(rows[:1]), duration_s=1.0, num_preemptions=0, kv_token_util=0.5
        )["rejected_by"]
        == ""
    )


def test_goodput_counts_requests_meeting_every_slo():
    rows = [
        r(0, 0.0, 0.1, 1.1, 11),  # ttft 0.1, tpot 0.1
        r(1, 0.0, 0.5, 1.5, 11),  # ttft 0.5 misses
        r(2, 0.0, 0.1, 3.1, 11),
    ]  # tpot 0.3 misses
    table = request_table(rows)
    s = serving_summary(
        table, duration_s=10.0, num_preemptions=0, kv_token_util=1.0, slo_ttft_s=0.2, slo_tpot_s=0.2
    )
    assert s["goodput_rps"] == pytest.approx(0.1) and s["slo_attainment"] == pytest.approx(1 / 3)
    s = serving_summary(
        table, duration_s=10.0, num_preemptions=0, kv_token_util=1.0, slo_ttft_s=0.2
    )
    assert s["goodput_rps"] == pytest.approx(0.2)  # only the TTFT SLO set: request 2 meets it


def test_without_an_slo_goodput_is_not_the_completion_rate_but_nan():
    table = request_table([r(0, 0.0, 0.1, 1.1, 11)])
    s = serving_summary(table, duration_s=10.0, num_preemptions=0, kv_token_util=1.0)
    assert math.isnan(s["goodput_rps"]) and math.isnan(s["slo_attainment"])


def test_rejected_requests_miss_the_slo_in_attainment():
    rows = [r(0, 0.0, 0.1, 1.1, 11), r(1, 0.0, math.nan, math.nan, 11, "rejected", "kv>budget")]
    s = serving_summary(
        request_table(rows),
        duration_s=1.0,
        num_preemptions=0,
        kv_token_util=1.0,
        slo_ttft_s=1.0,
        slo_tpot_s=1.0,
    )
    assert s["slo_attainment"] == pytest.approx(0.5) and s["goodput_rps"] == pytest.approx(1.0)


def test_pressure_share_is_the_blocked_steps_share_of_busy_time():
    table = request_table([r(0, 0.0, 0.1, 1.1, 11)])
    s = serving_summary(
        table,
        duration_s=10.0,
        num_preemptions=0,
        kv_token_util=0.9,
        kv_token_util_pressure=0.6,
        kv_pressure_s=2.0,
        busy_s=8.0,
    )
    assert (s["kv_token_util_pressure"], s["kv_pressure_share"]) == (0.6, 0.25)


def test_a_one_token_output_cannot_miss_the_tpot_slo():
    table = request_table([r(0, 0.0, 0.1, 0.1, 1)])
    s = serving_summary(
        table, duration_s=1.0, num_preemptions=0, kv_token_util=1.0, slo_tpot_s=0.01
    )
    assert s["goodput_rps"] == 1.0


def test_no_finished_requests_gives_nan_percentiles():
    table = request_table([r(0, 0.0, math.nan, math.nan, 3, status="rejected")])
    s = serving_summary(table, duration_s=1.0, num_preemptions=0, kv_token_util=float("nan"))
    assert math.isnan(s["ttft_p99_s"]) and s["n_finished"] == 0 and s["throughput_tok_s"] == 0.0


def test_request_table_by_columns_is_the_table_by_rows():
    """``request_table`` builds its frame column by column: the same dtypes and values, floats
    exactly, as the frame of row tuples it replaced (NaN times of requests never served, the
    three states, rejection texts, an empty run)."""
    import pandas as pd

    nan = math.nan
    reqs = [
        r(0, 0.1, 0.35, 1.7, 12),
        r(1, 0.2, nan, nan, 3, status="rejected", kind="kv>budget"),
        r(2, 0.30000000000000004, 0.9, nan, 7, status="running"),
        r(3, 1e-9, 0.5, 0.5, 1),
    ]
    for reqs_ in (reqs, []):
        pd.testing.assert_frame_equal(request_table(iter(reqs_)), _by_rows(reqs_), check_exact=True)
    assert request_table(reqs)["request_id"].dtype == "int64"


@pytest.mark.parametrize(
    ("column", "value"), [("prompt_tokens", 100.5), ("num_generated", None), ("request_id", "7")]
)
def test_a_request_table_refuses_an_int_column_holding_no_int(column, value):
    """The int columns are typed arrays: a float is not truncated nor a string parsed (as
    ``np.fromiter`` would), the column is named."""
    bad = r(1, 0.0, 0.1, 1.0, 2)
    setattr(bad, column, value)
    with pytest.raises(TypeError, match=f"request's {column} is not an int"):
        request_table([r(0, 0.0, 0.1, 1.0, 2), bad])


def test_a_request_table_takes_ints_and_none_as_times():
    """A time column is float64 whatever numbers it holds: ints and None among floats become
    their floats and NaN, as pandas made of the list, and a column of ints alone is float64
    too (its declared dtype, where pandas inferred int64)."""
    import pandas as pd

    reqs = [r(0, 1, 2, 3.0, 5), r(1, 0.5, None, 4, 5)]
    pd.testing.assert_frame_equal(request_table(reqs), _by_rows(reqs), check_exact=True)
    only_ints = request_table([r(0, 1, 2, 3, 5)])
    assert only_ints[["arrival_s", "first_token_s", "finish_s"]].dtypes.eq("float64").all()
    assert only_ints["ttft_s"].iloc[0] == 1.0
