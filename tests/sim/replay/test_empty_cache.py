"""Recorded ``empty_cache()`` calls: an event kind of the allocation trace, replayed as such."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import policies

MiB = 1 << 20
from sim.replay.bounds import bounds
from sim.replay.trace_replay import replay
from traces.alloc_table import read_table_csv, read_table_parquet, write_alloc_trace
from traces.errors import TraceFormatError
from traces.events import EMPTY_CACHE_OP, AllocTrace, make_events, validate_events
from traces.info import describe_alloc_trace
from traces.pytorch_snapshot import read_pytorch_snapshot

SNAPSHOTS = Path(__file__).resolve().parents[2] / "data" / "snapshots_h200"


def _trace(with_call: bool = True) -> AllocTrace:
    """Two 8 MiB blocks allocated and freed, (an empty_cache call,) then one small block."""
    ops = (
        ["alloc", "alloc", "free", "free"]
        + ([EMPTY_CACHE_OP] if with_call else [])
        + ["alloc", "free"]
    )
    ids = [0, 1, 0, 1] + ([-1] if with_call else []) + [2, 2]
    sizes = [8 * MiB, 8 * MiB, 8 * MiB, 8 * MiB] + ([0] if with_call else []) + [4096, 4096]
    events = make_events(np.arange(len(ops)), ops, ids, sizes)
    validate_events(events)
    return AllocTrace(events, name="ec")


def test_torch_caching_releases_cached_segments_at_the_call():
    res = replay(_trace(), "torch-caching")
    ts = res.timeseries
    assert res.summary["n_empty_cache"] == 1
    assert res.summary["n_alloc"] == 3 and res.summary["n_free"] == 3
    assert len(res.alloc_ns) == 3 and len(res.free_ns) == 3  # the call is no latency sample
    # sampled after every event here (a tiny trace): reserved bytes drop to 0 at the call (row 4)
    reserved = dict(zip(ts["event"], ts["reserved_bytes"]))
    assert reserved[3] >= 16 * MiB
    assert reserved[4] == 0
    # without the call the segments stay cached to the end
    kept = replay(_trace(with_call=False), "torch-caching")
    assert kept.summary["n_empty_cache"] == 0
    assert kept.timeseries["reserved_bytes"].iloc[-1] >= 16 * MiB


@pytest.mark.parametrize("spec", policies.available())
def test_every_policy_honours_the_call(spec):
    res = replay(_trace(), spec, capacity_bytes=1 << 30)
    assert res.summary["n_empty_cache"] == 1
    assert res.summary["n_failed"] == 0


def test_requests_leave_the_call_out():
    trace = _trace()
    _, is_alloc, ids, _, _ = trace.arrays()
    assert is_alloc.tolist() == [True, True, False, False, True, False] and ids.tolist() == [
        0,
        1,
        0,
        1,
        2,
        2,
    ]
    assert (
        bounds(trace)["lower_bound_bytes"] == bounds(_trace(with_call=False))["lower_bound_bytes"]
    )
    info = describe_alloc_trace(trace)
    assert (info["num_allocs"], info["num_frees"], info["num_empty_cache"]) == (3, 3, 1)
    assert info["peak_live_bytes"] == 16 * MiB and info["final_live_bytes"] == 0


@pytest.mark.parametrize(
    "suffix, read", [(".csv", read_table_csv), (".parquet", read_table_parquet)]
)
def test_table_round_trip(tmp_path, suffix, read):
    path = tmp_path / f"ec{suffix}"
    write_alloc_trace(_trace(), path)
    back = read(path)
    assert back.events["op"].tolist() == _trace().events["op"].tolist()
    assert back.events["alloc_id"].tolist() == [0, 1, 0, 1, -1, 2, 2]
    assert back.events["nbytes"].tolist() == _trace().events["nbytes"].tolist()


def test_unknown_op_is_rejected_with_its_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,0,8,0,\n1,trim,-1,0,0,\n")
    with pytest.raises(TraceFormatError, match=r"bad.csv:3: op 'trim'"):
        read_table_csv(path)


def test_static_empty_cache_snapshot_has_the_call():
    trace = read_pytorch_snapshot(SNAPSHOTS / "static_empty_cache.pickle.gz")
    calls = trace.is_empty_cache()
    assert calls.sum() >= 1
    assert (trace.events["time_us"].diff().dropna() >= 0).all()
    validate_events(trace.events)
    res = replay(trace, "torch-caching")
    assert res.summary["n_empty_cache"] == int(calls.sum())
    # the fidelity replay reads the same calls (one rule: traces.pytorch_snapshot.empty_cache_frees)
    from sim.replay import engine
    from sim.replay.fidelity import read_recording

    rec = read_recording(SNAPSHOTS / "static_empty_cache.pickle.gz")
    assert rec.ops.count(engine.FLUSH) == int(calls.sum())


def test_wrapper_forwards_private_pools():
    pool = policies.create("elastic:base=[torch-caching]", capacity_bytes=1 << 30)
    assert pool.has_private_pools
    pool.begin_allocate_to_pool(7, 0)
    a = pool.allocate(MiB, stream=0)
    pool.end_allocate_to_pool(7)
    assert a is not None
    pool.free(a)
    pool.release_pool(7)
    assert pool.reserved_bytes == pool.base_policy.reserved_bytes
    plain = policies.create("elastic:base=[best-fit]", capacity_bytes=1 << 30)
    assert not plain.has_private_pools
