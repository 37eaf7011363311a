"""Fidelity on what servers run: CUDA-graph private pools and empty_cache, on snapshots recorded on
an H200."""

import json
from pathlib import Path

import pytest

from sim.replay.fidelity import read_recording, replay_recording, snapshot_to_recording
from traces.pytorch_snapshot import infer_request_pools, parse_snapshot

MiB = 1 << 20
H200 = Path(__file__).parents[2] / "data" / "snapshots_h200"
BASE, OTHER, PRIVATE = 0x7F00_0000_0000, 0x7E00_0000_0000, 0x7D00_0000_0000
CAPTURE = 7  # the capture stream's raw handle


def entry(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 0}


def graph_snapshot():
    """A default-pool segment, then a capture on stream CAPTURE into private pool (0, 1), then eager
    work."""
    entries = [
        entry("segment_alloc", BASE, 20 * MiB),
        entry("alloc", BASE, 4 * MiB),
        entry("free_completed", BASE, 4 * MiB),
        entry("segment_alloc", PRIVATE, 20 * MiB, CAPTURE),
        entry("alloc", PRIVATE, 4 * MiB, CAPTURE),
        entry("free_completed", PRIVATE, 4 * MiB, CAPTURE),
        entry("alloc", PRIVATE, 2 * MiB, CAPTURE),
        entry("alloc", BASE, 4 * MiB),  # eager, default pool: not the private pool's free block
    ]
    segments = [
        {
            "device": 0,
            "address": BASE,
            "total_size": 20 * MiB,
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "blocks": [
                {
                    "address": BASE,
                    "size": 4 * MiB,
                    "requested_size": 4 * MiB,
                    "state": "active_allocated",
                }
            ],
        },
        {
            "device": 0,
            "address": PRIVATE,
            "total_size": 20 * MiB,
            "stream": CAPTURE,
            "segment_type": "large",
            "segment_pool_id": (0, 1),
            "blocks": [
                {
                    "address": PRIVATE,
                    "size": 2 * MiB,
                    "requested_size": 2 * MiB,
                    "state": "active_allocated",
                }
            ],
        },
    ]
    return parse_snapshot(
        {"device_traces": [entries], "segments": segments, "allocator_settings": {}}
    )


def test_requests_get_the_pool_of_the_segment_holding_them():
    snap = graph_snapshot()
    inferred = infer_request_pools(snap)
    assert inferred.pools == [(0, 0), (0, 0), (0, 1), (0, 1), (0, 1), (0, 0)]
    capture_stream = snap.stream_handles[CAPTURE]
    assert inferred.windows == [(2, 4, (0, 1), capture_stream)] and inferred.num_unknown == 0


def test_a_segment_freed_in_the_trace_has_an_unknown_pool():
    snap = parse_snapshot(
        {
            "device_traces": [
                [
                    entry("segment_alloc", BASE, 20 * MiB),
                    entry("alloc", BASE, 100 * 1024),
                    entry("free_completed", BASE, 100 * 1024),
                    entry("segment_free", BASE, 20 * MiB),
                ]
            ],
            "segments": [],
            "allocator_settings": {},
        }
    )
    assert infer_request_pools(snap).num_unknown == 1


def test_a_capture_window_routes_requests_to_the_private_pool():
    result = replay_recording(snapshot_to_recording(graph_snapshot()))
    assert result.first_divergence is None
    assert result.summary()["segment allocations"] == (2, 2)


@pytest.mark.parametrize("name", ["graphs", "compile", "static_empty_cache", "expandable"])
def test_an_h200_snapshot_is_reproduced_in_order(name):
    rec = read_recording(H200 / f"{name}.pickle.gz")
    result = replay_recording(rec)
    torch_counters = json.loads((H200 / f"{name}.json").read_text())
    recorded_peak, emulated_peak = result.summary()["peak reserved bytes"]
    assert recorded_peak == torch_counters["peak_reserved_bytes"]
    assert emulated_peak == recorded_peak
    assert result.first_divergence is None


# ----------------------------------------------------------------- divergence: one index, a cause
def test_a_divergence_names_one_index_for_message_csv_and_trace_and_a_private_pool_cause():
    snap = graph_snapshot()
    result = replay_recording(snapshot_to_recording(snap), "first-fit")
    d = result.first_divergence
    assert d["cause"].startswith("unmodelled private pool")
    rows = result.segment_events[result.segment_events["event"] == d["index"]]
    assert set(rows["entry"]) == {d["entry"]}  # the same trace entry on both sides
    assert (
        f"segment event {d['index']}" in result.format()
        and f"index {d['entry']}" in result.format()
    )


def test_a_recorded_free_the_emulation_does_not_make_is_an_external_release():
    entries = [
        entry("segment_alloc", BASE, 30 * MiB),
        entry("alloc", BASE, 30 * MiB),
        entry("free_completed", BASE, 30 * MiB),
        entry("segment_free", BASE, 30 * MiB),
        entry("segment_alloc", OTHER, 36 * MiB),
        entry("alloc", OTHER, 35 * MiB),
    ]
    # with max_split_size these frees read as the allocator's retry; without a limit it never
    # retries
    snap = parse_snapshot(
        {
            "device_traces": [entries],
            "segments": [],
            "allocator_settings": {"max_split_size": 25 * MiB},
        }
    )
    d = replay_recording(snapshot_to_recording(snap)).first_divergence
    assert d["cause"].startswith("external release") and d["entry"] == 5


def test_frees_completed_late_point_to_record_stream():
    entries = [
        entry("segment_alloc", BASE, 20 * MiB),
        entry("alloc", BASE, 4 * MiB),
        entry("free_requested", BASE, 4 * MiB),
        entry("alloc", BASE + 4 * MiB, 4 * MiB),
        entry("free_completed", BASE, 4 * MiB),
        entry("segment_alloc", OTHER, 20 * MiB),
        entry("alloc", OTHER, 14 * MiB),
    ]
    snap = parse_snapshot({"device_traces": [entries], "segments": [], "allocator_settings": {}})
    assert snap.num_deferred_frees == 1
    result = replay_recording(snapshot_to_recording(snap))  # the 14 MiB fits the freed space here
    assert result.first_divergence["cause"].startswith("record_stream")
