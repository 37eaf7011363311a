"""The compaction table a replay records: every pass counted once, at a monitor sample point."""

from __future__ import annotations

from sim.replay.trace_replay import replay
from traces.detect import read_alloc_trace

SNAPSHOT = "traces/data/llama1b_generate_slice.pickle.gz"


def test_compaction_rows_add_up_to_the_policys_own_passes():
    trace = read_alloc_trace(SNAPSHOT)
    result = replay(trace, "compacting", sample_every=97)
    passes = result.policy.compactions
    table = result.compactions
    assert len(passes) > 0 and len(table) > 0
    assert table["num_compactions"].sum() == len(passes)
    assert table["num_moves"].sum() == sum(p.num_moves for p in passes)
    assert table["moved_bytes"].sum() == sum(p.moved_bytes for p in passes)
    assert table["released_bytes"].sum() == sum(p.released_bytes for p in passes)
    # stamped at sample points (every 97th event, or the last), in time order
    last = len(trace) - 1
    assert all(e % 97 == 0 or e == last for e in table["event"])
    assert table["time_us"].is_monotonic_increasing
    assert set(table[["trace", "policy", "backend"]].itertuples(index=False)) == {
        (trace.name, "compacting", "sim")
    }


def test_a_pool_that_cannot_compact_records_no_table():
    result = replay(read_alloc_trace(SNAPSHOT), "best-fit")
    assert result.compactions is None


def test_a_serving_run_samples_its_compactions_and_the_page_marks_each_growth():
    import numpy as np

    from sim.report.interactive.page import trace_data
    from sim.serving.simulate import simulate
    from traces.requests import RequestTrace, make_requests

    rng = np.random.default_rng(0)
    n = 150
    requests = RequestTrace(
        make_requests(
            np.cumsum(rng.exponential(1 / 200.0, n)),
            rng.integers(50, 400, n),
            rng.integers(20, 200, n),
        ),
        name="t",
    )
    spec = "compacting:base=[best-fit:segment_bytes=8MiB],idle_only=true,threshold=0.3"
    res = simulate(
        requests,
        spec,
        model="Llama-3.2-1B",
        gpu="H200",
        kv_capacity_bytes=3000 * 32768,
        compact_between_steps=True,
    )
    ts = res.timeseries
    counts = ts["num_compactions"].to_numpy()
    assert (
        counts[-1] > 0
        and (np.diff(counts) >= 0).all()
        and counts[-1] <= res.summary["n_compactions"]
    )
    markers = trace_data("t", ts.assign(source="s"), None)["compactions"]
    assert sum(m["num_compactions"] for m in markers) == counts[-1]
    assert sum(m["moved_bytes"] for m in markers) == ts["compaction_moved_bytes"].iloc[-1]
    grew = ts["time_us"][np.diff(counts, prepend=0) > 0] / 1e6
    assert [m["t"] for m in markers] == grew.round(6).tolist()
