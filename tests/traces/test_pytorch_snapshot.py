import gzip
import pickle

import numpy as np
import pytest

from traces.errors import TraceFormatError
from traces.events import PRE_TRACE_TAG, validate_events
from traces.pytorch_snapshot import read_pytorch_snapshot

A, B, C = 0x7F0000000000, 0x7F0000100000, 0x7F0000200000


def _segment(address, total_size, blocks, stream=0, device=0, segment_type="large"):
    return {"device": device, "address": address, "total_size": total_size, "allocated_size": 0,
            "active_size": 0, "requested_size": 0, "stream": stream, "segment_type": segment_type,
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}


def _block(address, size, state, requested_size=None):
    return {"address": address, "size": size, "requested_size": size if requested_size is None else requested_size,
            "state": state, "frames": []}


def _rows(trace):
    ev = trace.events
    return list(zip(ev["time_us"], ev["op"], ev["alloc_id"], ev["nbytes"], ev["stream"], ev["tag"]))


# --- the real recording ---------------------------------------------------------------------

def test_real_snapshot_counts(real_snapshot):
    ev = real_snapshot.events
    trace_allocs = ((ev["op"] == "alloc") & (ev["tag"] != PRE_TRACE_TAG)).sum()
    assert (trace_allocs, (ev["op"] == "free").sum()) == (107_798, 107_796)


def test_real_snapshot_weights_are_pre_trace_allocations(real_snapshot):
    assert real_snapshot.meta["num_pre_trace_live"] == 149
    assert real_snapshot.meta["num_pre_trace_freed"] == 0


def test_real_snapshot_is_a_valid_event_table(real_snapshot):
    validate_events(real_snapshot.events, "real")
    assert real_snapshot.events["time_us"].iloc[0] == 0


def test_real_snapshot_peak_reserved_matches_pytorch_counter(real_snapshot):
    # /work/shared/data/README.md: PyTorch's own peak reserved for this run
    assert real_snapshot.meta["recorded_peak_reserved_bytes"] == 2_214_592_512


def test_real_snapshot_keeps_segment_events_and_table(real_snapshot):
    seg_events, segments = real_snapshot.meta["segment_events"], real_snapshot.meta["segments"]
    assert (seg_events["action"] == "segment_alloc").sum() == 34
    assert list(seg_events.columns) == ["time_us", "action", "addr", "size", "stream"]
    assert len(segments) == 101
    assert {"address", "total_size", "stream", "segment_type"} <= set(segments.columns)
    assert real_snapshot.meta["allocator_settings"]["expandable_segments"] is False


# --- how entries become events --------------------------------------------------------------

def test_alloc_and_free_completed_pair_up(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 100, 1000), snap_entry("free_requested", A, 100, 1005),
                           snap_entry("free_completed", A, 100, 1010)])
    assert _rows(read_pytorch_snapshot(path)) == [(0, "alloc", 0, 100, 0, ""), (10, "free", 0, 100, 0, "")]


def test_reused_address_gets_a_new_id(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 100, 0), snap_entry("free_completed", A, 100, 1),
                           snap_entry("alloc", A, 200, 2), snap_entry("free_completed", A, 200, 3)])
    ev = read_pytorch_snapshot(path).events
    assert list(ev["alloc_id"]) == [0, 0, 1, 1]
    assert list(ev["nbytes"]) == [100, 100, 200, 200]


def test_free_requested_is_the_fallback_without_completions(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 100, 0), snap_entry("free_requested", A, 100, 7)])
    trace = read_pytorch_snapshot(path)
    assert list(trace.events["op"]) == ["alloc", "free"]
    assert trace.meta["free_action"] == "free_requested"


def test_free_requested_alone_does_not_free_when_completions_exist(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 100, 0), snap_entry("alloc", B, 50, 1),
                           snap_entry("free_requested", A, 100, 2), snap_entry("free_requested", B, 50, 3),
                           snap_entry("free_completed", B, 50, 4)])
    ev = read_pytorch_snapshot(path).events
    assert list(zip(ev["op"], ev["alloc_id"])) == [("alloc", 0), ("alloc", 1), ("free", 1)]


def test_free_of_never_seen_address_synthesises_pre_trace_alloc(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 100, 50), snap_entry("free_completed", B, 4096, 60)])
    trace = read_pytorch_snapshot(path)
    assert _rows(trace) == [(0, "alloc", 0, 4096, 0, PRE_TRACE_TAG), (0, "alloc", 1, 100, 0, ""),
                            (10, "free", 0, 4096, 0, "")]
    assert trace.meta["num_pre_trace_freed"] == 1


def test_active_block_never_seen_becomes_live_pre_trace_alloc(write_snapshot, snap_entry):
    segments = [_segment(C, 1 << 21, [_block(C, 1 << 20, "active_allocated", requested_size=1000),
                                      _block(C + (1 << 20), 1 << 20, "inactive")])]
    trace = read_pytorch_snapshot(write_snapshot([snap_entry("alloc", A, 100, 5)], segments))
    assert _rows(trace)[0] == (0, "alloc", 0, 1000, 0, PRE_TRACE_TAG)
    assert trace.meta["num_pre_trace_live"] == 1


def test_active_block_allocated_in_trace_is_not_duplicated(write_snapshot, snap_entry):
    segments = [_segment(A, 1 << 21, [_block(A, 1 << 21, "active_allocated", requested_size=100)])]
    trace = read_pytorch_snapshot(write_snapshot([snap_entry("alloc", A, 100, 5)], segments))
    assert len(trace) == 1
    assert trace.meta["num_pre_trace_live"] == 0


def test_blocks_without_address_tile_their_segment(write_snapshot, snap_entry):
    blocks = [{"size": 1 << 20, "requested_size": 0, "state": "inactive"},
              {"size": 1 << 20, "requested_size": 777, "state": "active_allocated"}]
    segments = [_segment(C, 1 << 21, blocks)]
    # the second block sits at C + 1 MiB, an address the trace allocates: no pre-trace alloc
    trace = read_pytorch_snapshot(write_snapshot([snap_entry("alloc", C + (1 << 20), 777, 0)], segments))
    assert len(trace) == 1


def test_stream_handles_become_small_ints_in_order(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0, stream=0xBEEF), snap_entry("alloc", B, 10, 1, stream=0),
                           snap_entry("alloc", C, 10, 2, stream=0xCAFE)])
    trace = read_pytorch_snapshot(path)
    assert list(trace.events["stream"]) == [1, 0, 2]
    assert trace.meta["stream_handles"] == {0: 0, 0xBEEF: 1, 0xCAFE: 2}


def test_time_is_relative_to_first_entry_of_any_kind(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("segment_alloc", C, 1 << 21, 1_000), snap_entry("alloc", C, 10, 1_250)])
    trace = read_pytorch_snapshot(path)
    assert list(trace.events["time_us"]) == [250]
    assert list(trace.meta["segment_events"]["time_us"]) == [0]


def test_segment_and_oom_events_go_to_meta(write_snapshot, snap_entry):
    entries = [snap_entry("segment_alloc", C, 1 << 21, 0), snap_entry("alloc", C, 10, 1),
               snap_entry("oom", 0, 1 << 40, 2), snap_entry("segment_free", C + (1 << 22), 1 << 21, 3),
               snap_entry("snapshot", 0, 0, 4)]
    segments = [_segment(C, 1 << 21, [_block(C, 512, "active_allocated", 10),
                                      _block(C + 512, (1 << 21) - 512, "inactive")])]
    trace = read_pytorch_snapshot(write_snapshot(entries, segments))
    assert list(trace.meta["segment_events"]["action"]) == ["segment_alloc", "oom", "segment_free"]
    assert trace.meta["num_oom"] == 1
    assert trace.meta["ignored_actions"] == {"snapshot": 1}
    # reserved: start 2 MiB (end 2 MiB, +2 MiB alloc, -2 MiB free), peak 4 MiB after the alloc
    assert trace.meta["recorded_peak_reserved_bytes"] == 1 << 22


def test_device_defaults_to_the_one_with_entries(write_snapshot, snap_entry):
    path = write_snapshot([], device_traces=[[], [snap_entry("alloc", A, 10, 0)]])
    trace = read_pytorch_snapshot(path)
    assert trace.meta["device"] == 1 and len(trace) == 1


def test_explicit_device_is_read(write_snapshot, snap_entry):
    path = write_snapshot([], device_traces=[[snap_entry("alloc", A, 10, 0)], [snap_entry("alloc", B, 20, 0)]])
    assert list(read_pytorch_snapshot(path, device=1).events["nbytes"]) == [20]


def test_unknown_device_is_an_error(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0)])
    with pytest.raises(TraceFormatError, match="device 3"):
        read_pytorch_snapshot(path, device=3)


def test_segments_of_other_devices_are_ignored(write_snapshot, snap_entry):
    segments = [_segment(C, 1 << 21, [_block(C, 1 << 21, "active_allocated")], device=1)]
    trace = read_pytorch_snapshot(write_snapshot([snap_entry("alloc", A, 10, 0)], segments))
    assert trace.meta["num_pre_trace_live"] == 0 and len(trace.meta["segments"]) == 0


def test_plain_pickle_is_read(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0)], name="snap.pickle", gz=False)
    assert len(read_pytorch_snapshot(path)) == 1


def test_user_metadata_becomes_the_tag(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0, user_metadata="kv")])
    assert list(read_pytorch_snapshot(path).events["tag"]) == ["kv"]


def test_ids_follow_allocation_order(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0), snap_entry("free_completed", B, 30, 1),
                           snap_entry("free_completed", A, 10, 2)])
    ev = read_pytorch_snapshot(path).events
    allocs = ev[ev["op"] == "alloc"]["alloc_id"].to_numpy()
    assert np.array_equal(allocs, np.arange(len(allocs)))


# --- malformed input --------------------------------------------------------------------------

def test_truncated_gzip_is_a_format_error(write_snapshot, snap_entry, tmp_path):
    full = write_snapshot([snap_entry("alloc", A + 512 * i, 10, i) for i in range(2000)])
    cut = tmp_path / "cut.pickle.gz"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(TraceFormatError, match="cut.pickle.gz") as err:
        read_pytorch_snapshot(cut)
    assert "gzipped pickle" in err.value.reason


def test_pickle_naming_a_global_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("should never run",))
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"device_traces": [Evil()]}))
    with pytest.raises(TraceFormatError, match="refusing to load builtins.print"):
        read_pytorch_snapshot(path)


def test_pickle_of_something_else_is_a_format_error(tmp_path):
    path = tmp_path / "list.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps([1, 2, 3])))
    with pytest.raises(TraceFormatError, match="not a PyTorch memory snapshot"):
        read_pytorch_snapshot(path)


def test_entry_without_key_names_its_index(write_snapshot, snap_entry):
    bad = snap_entry("alloc", B, 10, 1)
    del bad["addr"]
    path = write_snapshot([snap_entry("alloc", A, 10, 0), bad])
    with pytest.raises(TraceFormatError, match=r"device_traces\[0\] index 1\).*'addr'") as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 1


def test_alloc_of_non_positive_size_names_its_index(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0), snap_entry("alloc", B, 10, 1), snap_entry("alloc", C, -4, 2)])
    with pytest.raises(TraceFormatError, match="size -4") as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 2


def test_alloc_over_a_live_address_is_an_error(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0), snap_entry("alloc", A, 10, 1)])
    with pytest.raises(TraceFormatError, match="still live") as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 1


def test_free_at_a_non_integer_address_names_its_index(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0), snap_entry("free_completed", "nowhere", 10, 1)])
    with pytest.raises(TraceFormatError, match="address 'nowhere': must be an integer") as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 1


def test_non_integer_time_names_its_index(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0), snap_entry("alloc", B, 10, "soon")])
    with pytest.raises(TraceFormatError, match="time_us 'soon'") as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 1


def test_entry_that_is_not_a_dict_is_an_error(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0), "garbage"])
    with pytest.raises(TraceFormatError) as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 1
