"""The compaction table a replay records: every pass counted once, at a monitor sample point."""

from __future__ import annotations

from sim.replay import replay
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
    assert set(table[["trace", "policy", "backend"]].itertuples(index=False)) == {(trace.name, "compacting", "sim")}


def test_a_pool_that_cannot_compact_records_no_table():
    result = replay(read_alloc_trace(SNAPSHOT), "best-fit")
    assert result.compactions is None
