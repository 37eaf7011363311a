import gzip
import pickle
from array import array

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.errors import TraceFormatError
from traces.events import PRE_TRACE_TAG, validate_events
from traces.pytorch_snapshot import read_pytorch_snapshot

A, B, C = 0x7F0000000000, 0x7F0000100000, 0x7F0000200000


def _segment(address, total_size, blocks, stream=0, device=0, segment_type="large"):
    return {
        "device": device,
        "address": address,
        "total_size": total_size,
        "allocated_size": 0,
        "active_size": 0,
        "requested_size": 0,
        "stream": stream,
        "segment_type": segment_type,
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def _block(address, size, state, requested_size=None):
    return {
        "address": address,
        "size": size,
        "requested_size": size if requested_size is None else requested_size,
        "state": state,
        "frames": [],
    }


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
    path = write_snapshot(
        [
            snap_entry("alloc", A, 100, 1000),
            snap_entry("free_requested", A, 100, 1005),
            snap_entry("free_completed", A, 100, 1010),
        ]
    )
    assert _rows(read_pytorch_snapshot(path)) == [
        (0, "alloc", 0, 100, 0, ""),
        (10, "free", 0, 100, 0, ""),
    ]


def test_reused_address_gets_a_new_id(write_snapshot, snap_entry):
    path = write_snapshot(
        [
            snap_entry("alloc", A, 100, 0),
            snap_entry("free_completed", A, 100, 1),
            snap_entry("alloc", A, 200, 2),
            snap_entry("free_completed", A, 200, 3),
        ]
    )
    ev = read_pytorch_snapshot(path).events
    assert list(ev["alloc_id"]) == [0, 0, 1, 1]
    assert list(ev["nbytes"]) == [100, 100, 200, 200]


def test_free_requested_is_the_fallback_without_completions(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 100, 0), snap_entry("free_requested", A, 100, 7)])
    trace = read_pytorch_snapshot(path)
    assert list(trace.events["op"]) == ["alloc", "free"]
    assert trace.meta["free_action"] == "free_requested"


def test_free_requested_alone_does_not_free_when_completions_exist(write_snapshot, snap_entry):
    path = write_snapshot(
        [
            snap_entry("alloc", A, 100, 0),
            snap_entry("alloc", B, 50, 1),
            snap_entry("free_requested", A, 100, 2),
            snap_entry("free_requested", B, 50, 3),
            snap_entry("free_completed", B, 50, 4),
        ]
    )
    ev = read_pytorch_snapshot(path).events
    assert list(zip(ev["op"], ev["alloc_id"])) == [("alloc", 0), ("alloc", 1), ("free", 1)]


def test_free_of_never_seen_address_synthesises_pre_trace_alloc(write_snapshot, snap_entry):
    path = write_snapshot(
        [snap_entry("alloc", A, 100, 50), snap_entry("free_completed", B, 4096, 60)]
    )
    trace = read_pytorch_snapshot(path)
    assert _rows(trace) == [
        (0, "alloc", 0, 4096, 0, PRE_TRACE_TAG),
        (0, "alloc", 1, 100, 0, ""),
        (10, "free", 0, 4096, 0, ""),
    ]
    assert trace.meta["num_pre_trace_freed"] == 1


def test_active_block_never_seen_becomes_live_pre_trace_alloc(write_snapshot, snap_entry):
    segments = [
        _segment(
            C,
            1 << 21,
            [
                _block(C, 1 << 20, "active_allocated", requested_size=1000),
                _block(C + (1 << 20), 1 << 20, "inactive"),
            ],
        )
    ]
    trace = read_pytorch_snapshot(write_snapshot([snap_entry("alloc", A, 100, 5)], segments))
    assert _rows(trace)[0] == (0, "alloc", 0, 1000, 0, PRE_TRACE_TAG)
    assert trace.meta["num_pre_trace_live"] == 1


def test_active_block_allocated_in_trace_is_not_duplicated(write_snapshot, snap_entry):
    segments = [_segment(A, 1 << 21, [_block(A, 1 << 21, "active_allocated", requested_size=100)])]
    trace = read_pytorch_snapshot(write_snapshot([snap_entry("alloc", A, 100, 5)], segments))
    assert len(trace) == 1
    assert trace.meta["num_pre_trace_live"] == 0


def test_blocks_without_address_tile_their_segment(write_snapshot, snap_entry):
    blocks = [
        {"size": 1 << 20, "requested_size": 0, "state": "inactive"},
        {"size": 1 << 20, "requested_size": 777, "state": "active_allocated"},
    ]
    segments = [_segment(C, 1 << 21, blocks)]
    # the second block sits at C + 1 MiB, an address the trace allocates: no pre-trace alloc
    trace = read_pytorch_snapshot(
        write_snapshot([snap_entry("alloc", C + (1 << 20), 777, 0)], segments)
    )
    assert len(trace) == 1


def test_stream_handles_become_small_ints_in_order(write_snapshot, snap_entry):
    path = write_snapshot(
        [
            snap_entry("alloc", A, 10, 0, stream=0xBEEF),
            snap_entry("alloc", B, 10, 1, stream=0),
            snap_entry("alloc", C, 10, 2, stream=0xCAFE),
        ]
    )
    trace = read_pytorch_snapshot(path)
    assert list(trace.events["stream"]) == [1, 0, 2]
    assert trace.meta["stream_handles"] == {0: 0, 0xBEEF: 1, 0xCAFE: 2}


def test_time_is_relative_to_first_entry_of_any_kind(write_snapshot, snap_entry):
    path = write_snapshot(
        [snap_entry("segment_alloc", C, 1 << 21, 1_000), snap_entry("alloc", C, 10, 1_250)]
    )
    trace = read_pytorch_snapshot(path)
    assert list(trace.events["time_us"]) == [250]
    assert list(trace.meta["segment_events"]["time_us"]) == [0]


def test_segment_and_oom_events_go_to_meta(write_snapshot, snap_entry):
    entries = [
        snap_entry("segment_alloc", C, 1 << 21, 0),
        snap_entry("alloc", C, 10, 1),
        snap_entry("oom", 0, 1 << 40, 2),
        snap_entry("segment_free", C + (1 << 22), 1 << 21, 3),
        snap_entry("snapshot", 0, 0, 4),
    ]
    segments = [
        _segment(
            C,
            1 << 21,
            [_block(C, 512, "active_allocated", 10), _block(C + 512, (1 << 21) - 512, "inactive")],
        )
    ]
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
    path = write_snapshot(
        [], device_traces=[[snap_entry("alloc", A, 10, 0)], [snap_entry("alloc", B, 20, 0)]]
    )
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
    path = write_snapshot(
        [
            snap_entry("alloc", A, 10, 0),
            snap_entry("free_completed", B, 30, 1),
            snap_entry("free_completed", A, 10, 2),
        ]
    )
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
    path = write_snapshot(
        [
            snap_entry("alloc", A, 10, 0),
            snap_entry("alloc", B, 10, 1),
            snap_entry("alloc", C, -4, 2),
        ]
    )
    with pytest.raises(TraceFormatError, match="size -4") as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 2


def test_alloc_over_a_live_address_is_an_error(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0), snap_entry("alloc", A, 10, 1)])
    with pytest.raises(TraceFormatError, match="still live") as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 1


def test_free_at_a_non_integer_address_names_its_index(write_snapshot, snap_entry):
    path = write_snapshot(
        [snap_entry("alloc", A, 10, 0), snap_entry("free_completed", "nowhere", 10, 1)]
    )
    with pytest.raises(TraceFormatError, match="address 'nowhere': must be an integer") as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 1


def test_non_integer_time_names_its_index(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0), snap_entry("alloc", B, 10, "soon")])
    with pytest.raises(TraceFormatError, match="time_us 'soon'") as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 1


def test_negative_time_names_its_index(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, -5), snap_entry("alloc", B, 10, 3)])
    with pytest.raises(TraceFormatError, match="time_us -5 must be >= 0") as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 0


def test_a_time_going_back_is_raised_to_the_one_before_and_counted(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 100), snap_entry("alloc", B, 10, 90)])
    trace = read_pytorch_snapshot(path)
    assert list(trace.events["time_us"]) == [0, 0] and trace.meta["num_time_clamped"] == 1


def test_entry_that_is_not_a_dict_is_an_error(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("alloc", A, 10, 0), "garbage"])
    with pytest.raises(TraceFormatError) as err:
        read_pytorch_snapshot(path)
    assert err.value.line == 1


# --- hostile and impossible snapshots (issue 29): each one line naming the list and index -----

MiB = 1 << 20
FAR = 0x7F0010000000  # far from A, B and C


@pytest.mark.parametrize("addr", [2**63, 2**64 + 5, -16])
def test_alloc_address_outside_int64_names_its_index(write_snapshot, snap_entry, addr):
    path = write_snapshot([snap_entry("alloc", A, 10, 0), snap_entry("alloc", addr, 10, 1)])
    with pytest.raises(TraceFormatError, match=r"index 1\): alloc at address .*< 2\*\*63"):
        read_pytorch_snapshot(path)


def test_free_of_never_seen_address_at_2_63_names_its_index(write_snapshot, snap_entry):
    path = write_snapshot([snap_entry("free_completed", 2**63, 10, 0)])
    with pytest.raises(TraceFormatError, match=r"index 0\): free_completed at address"):
        read_pytorch_snapshot(path)


def test_segment_event_at_a_text_address_names_its_index(write_snapshot, snap_entry):
    path = write_snapshot(
        [snap_entry("alloc", A, 10, 0), snap_entry("segment_alloc", "0x7f00", 2 * MiB, 1)]
    )
    with pytest.raises(
        TraceFormatError, match=r"index 1\): malformed trace entry .*address '0x7f00'"
    ):
        read_pytorch_snapshot(path)


def test_segment_event_address_at_2_63_names_its_index(write_snapshot, snap_entry):
    path = write_snapshot(
        [snap_entry("segment_alloc", 2**63, 2 * MiB, 0), snap_entry("alloc", A, 10, 1)]
    )
    with pytest.raises(TraceFormatError, match=r"index 0\).*address 9223372036854775808"):
        read_pytorch_snapshot(path)


def test_segment_address_at_2_63_names_the_segment(write_snapshot):
    path = write_snapshot([], [_segment(2**63, 2 * MiB, [])])
    with pytest.raises(TraceFormatError, match=r"segments index 0\).*address"):
        read_pytorch_snapshot(path)


def test_device_trace_that_is_an_int_names_it(write_snapshot, snap_entry):
    path = write_snapshot([], device_traces=[[snap_entry("alloc", A, 10, 0)], 7])
    with pytest.raises(
        TraceFormatError, match=r"device_traces index 1\): is 7, not a list of trace entries"
    ):
        read_pytorch_snapshot(path)


@pytest.mark.parametrize(
    "devices",
    [("0", 1), ([0], 0), (0.0, 0), (True, 0), (-1, 0)],
    ids=["mixed-str-int", "unhashable", "float", "bool", "negative"],
)
def test_segment_device_that_is_no_device_index_names_the_segment(
    write_snapshot, snap_entry, devices
):
    segs = [
        _segment(A, 2 * MiB, [], device=devices[0]),
        _segment(C, 2 * MiB, [], device=devices[1]),
    ]
    path = write_snapshot([snap_entry("alloc", A, 10, 0)], segs)
    with pytest.raises(
        TraceFormatError, match=r"segments index 0\): device .* is not a device index"
    ):
        read_pytorch_snapshot(path, device=0)
    with pytest.raises(TraceFormatError, match=r"segments index 0\): device"):
        read_pytorch_snapshot(path)


def test_stream_that_is_no_handle_names_its_index(write_snapshot, snap_entry):
    path = write_snapshot(
        [snap_entry("alloc", A, 10, 0), snap_entry("alloc", B, 10, 1, stream="s1")]
    )
    with pytest.raises(TraceFormatError, match=r"index 1\).*stream 's1' is not a stream handle"):
        read_pytorch_snapshot(path)


@pytest.mark.parametrize("where", ["event", "segment"])
def test_expandable_map_of_2_55_bytes_is_refused_at_once(write_snapshot, snap_entry, where):
    # one map of 2**55 bytes is 2**34 pages: a page set took 18 s and then ran out of memory
    huge = 2**55
    seg = {
        **_segment(A, huge if where == "segment" else 2 * MiB, [_block(A, 2 * MiB, "inactive")]),
        "is_expandable": True,
    }
    if where == "segment":
        seg["blocks"] = [_block(A, huge, "inactive")]
    path = write_snapshot(
        [
            snap_entry("segment_map", A, huge if where == "event" else 2 * MiB, 0),
            snap_entry("alloc", A, 10, 1),
        ],
        [seg],
    )
    unit = "device_traces\\[0\\] index 0" if where == "event" else "segments index 0"
    with pytest.raises(
        TraceFormatError, match=rf"{unit}\).*size 36,028,797,018,963,968 is more than a GPU's whole"
    ):
        read_pytorch_snapshot(path)


def test_many_large_maps_are_ranges_not_pages(write_snapshot, snap_entry):
    # 64 maps of 2**48 bytes each (2**23 pages apiece): kept as ranges, read at once
    entries = [snap_entry("segment_map", A + k * 2**48, 2**48, k) for k in range(64)]
    seg = {**_segment(A, 2 * MiB, [_block(A, 2 * MiB, "inactive")]), "is_expandable": True}
    from traces.pytorch_snapshot import read_snapshot

    snap = read_snapshot(write_snapshot(entries + [snap_entry("alloc", A, 10, 99)], [seg]))
    assert [(s.address, s.total_bytes) for s in snap.segments_at_start] == []
    assert len(snap.segment_events) == 64


def test_page_ranges_equal_a_set_of_pages():
    """``_PageRanges`` against the page set it replaces, on random aligned maps and unmaps."""
    import random

    from traces.pytorch_snapshot import _PageRanges

    page = 2 * MiB
    rng = random.Random(29)
    for _ in range(200):
        ranges, pages = _PageRanges(page), set()
        for _ in range(rng.randrange(1, 12)):
            addr, nbytes = rng.randrange(0, 40) * page, rng.randrange(0, 9 * page)
            if rng.random() < 0.6:
                ranges.add(addr, nbytes)
                pages.update(range(addr, addr + nbytes, page))
            else:
                ranges.remove(addr, nbytes)
                pages.difference_update(range(addr, addr + nbytes, page))
        expected, start, prev = [], None, 0
        for p in sorted(pages):
            if start is None or p != prev + page:
                if start is not None:
                    expected.append((start, prev + page - start))
                start = p
            prev = p
        if start is not None:
            expected.append((start, prev + page - start))
        assert ranges.runs() == expected


def _key(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()  # SHORT_BINUNICODE


def _deep_pickle(depth: int, *, in_metadata: bool) -> bytes:
    """A snapshot pickle holding a list nested ``depth`` deep (pickle.dumps itself recurses, so by
    opcode): as the one trace entry, or as that entry's ``user_metadata``."""
    nested = b"]" * depth + b"a" * (
        depth - 1
    )  # EMPTY_LIST each level, APPEND each into the one outside
    if in_metadata:
        entry = (
            b"}"
            + _key("action")
            + _key("alloc")
            + b"s"
            + _key("addr")
            + b"J\x00\x00\x01\x00s"
            + _key("size")
            + b"K\x0as"
            + _key("stream")
            + b"K\x00s"
            + _key("time_us")
            + b"K\x00s"
            + _key("user_metadata")
            + nested
            + b"s"
        )
    else:
        entry = nested
    return b"\x80\x04}" + _key("segments") + b"]s" + _key("device_traces") + b"]]" + entry + b"aas."


@pytest.mark.parametrize("in_metadata", [False, True], ids=["entry", "user-metadata"])
def test_deeply_nested_pickle_is_one_line(tmp_path, in_metadata):
    path = tmp_path / "deep.pickle"
    path.write_bytes(_deep_pickle(100_000, in_metadata=in_metadata))
    with pytest.raises(TraceFormatError, match="deep.pickle") as err:
        read_pytorch_snapshot(path)
    assert len(str(err.value)) < 300


def test_block_larger_than_its_segment_names_the_segment(write_snapshot, snap_entry):
    seg = _segment(A, 2 * MiB, [_block(A, 4 * MiB, "active_allocated")])
    path = write_snapshot([snap_entry("alloc", C, 10, 0)], [seg])
    with pytest.raises(
        TraceFormatError, match=r"segments index 0\).*block 0 .* does not lie inside the segment"
    ):
        read_pytorch_snapshot(path)


def test_block_past_the_end_of_its_segment_names_the_segment(write_snapshot, snap_entry):
    seg = _segment(
        A, 2 * MiB, [_block(A, MiB, "inactive"), _block(A + MiB, 2 * MiB, "active_allocated")]
    )
    path = write_snapshot([snap_entry("alloc", C, 10, 0)], [seg])
    with pytest.raises(TraceFormatError, match=r"segments index 0\).*block 1"):
        read_pytorch_snapshot(path)


def test_allocated_size_above_total_size_names_the_segment(write_snapshot, snap_entry):
    seg = {**_segment(A, 2 * MiB, [_block(A, 2 * MiB, "inactive")]), "allocated_size": 3 * MiB}
    path = write_snapshot([snap_entry("alloc", C, 10, 0)], [seg])
    with pytest.raises(TraceFormatError, match=r"segments index 0\).*allocated_size"):
        read_pytorch_snapshot(path)


def test_overlapping_segments_name_both(write_snapshot, snap_entry):
    segs = [
        _segment(A, 4 * MiB, [_block(A, 4 * MiB, "inactive")]),
        _segment(FAR, 2 * MiB, [_block(FAR, 2 * MiB, "inactive")]),
        _segment(A + 2 * MiB, 2 * MiB, [_block(A + 2 * MiB, 2 * MiB, "inactive")]),
    ]
    path = write_snapshot([snap_entry("alloc", FAR + 4 * MiB, 10, 0)], segs)
    with pytest.raises(
        TraceFormatError,
        match=r"segments index 2\): segment at 0x7f0000200000 overlaps segments index 0",
    ):
        read_pytorch_snapshot(path)


def test_segments_of_other_devices_may_share_addresses(write_snapshot, snap_entry):
    segs = [
        _segment(A, 2 * MiB, [_block(A, 2 * MiB, "inactive")], device=0),
        _segment(A, 2 * MiB, [_block(A, 2 * MiB, "inactive")], device=1),
    ]
    trace = read_pytorch_snapshot(write_snapshot([snap_entry("alloc", C, 10, 0)], segs))
    assert len(trace.meta["segments"]) == 1


@pytest.mark.parametrize(
    "requested", [-5, "10", 10.5, 3 * MiB], ids=["negative", "text", "fractional", "above-size"]
)
def test_impossible_requested_size_names_the_segment(write_snapshot, snap_entry, requested):
    seg = _segment(A, 2 * MiB, [_block(A, 2 * MiB, "active_allocated", requested_size=requested)])
    path = write_snapshot([snap_entry("alloc", C, 10, 0)], [seg])
    with pytest.raises(TraceFormatError, match=r"segments index 0\).*block 0 requested_size"):
        read_pytorch_snapshot(path)


def test_stale_requested_size_of_an_inactive_block_is_no_error(write_snapshot, snap_entry):
    # recorded snapshots (expandable.pickle.gz) keep a freed block's last request, larger than what
    # is left
    seg = _segment(
        A,
        2 * MiB,
        [
            _block(A, MiB, "inactive", requested_size=3 * MiB),
            _block(A + MiB, MiB, "active_allocated", requested_size=MiB - 8),
        ],
    )
    trace = read_pytorch_snapshot(write_snapshot([snap_entry("alloc", C, 10, 0)], [seg]))
    assert trace.meta["num_pre_trace_live"] == 1


def _empty_cache_points_by_request(snap) -> list[int]:
    """``empty_cache_points`` as it was first written: a walk over every request (the reference)."""
    from traces.pytorch_snapshot import empty_cache_frees, snapshot_max_split_size_bytes

    req, ev = snap.requests, snap.segment_events
    max_split = snapshot_max_split_size_bytes(snap.allocator_settings)
    points, j = [], 0
    for k, entry in enumerate(list(req.entry) + [float("inf")]):
        start = j
        while j < len(ev) and ev.entry[j] < entry:
            j += 1
        if j > start and empty_cache_frees(ev.action[start:j], ev.nbytes[start:j], max_split):
            points.append(k)
    return points


@settings(max_examples=300, deadline=None)
@given(
    kinds=st.lists(
        st.sampled_from(["req", "segment_free", "segment_alloc", "oom", "segment_unmap"]),
        max_size=40,
    ),
    sizes=st.lists(st.sampled_from([2 << 20, 20 << 20, 64 << 20]), min_size=40, max_size=40),
    max_split=st.sampled_from([None, 32 << 20]),
)
def test_empty_cache_points_walk_the_events_as_the_requests_did(kinds, sizes, max_split):
    from types import SimpleNamespace

    from traces.pytorch_snapshot import SegmentEvents, empty_cache_points

    events = [(i, k, sizes[i]) for i, k in enumerate(kinds) if k != "req"]
    n = len(events)
    snap = SimpleNamespace(
        requests=SimpleNamespace(entry=array("q", [i for i, k in enumerate(kinds) if k == "req"])),
        segment_events=SegmentEvents(
            [e[0] for e in events],
            [0] * n,
            [e[1] for e in events],
            [0] * n,
            [e[2] for e in events],
            [0] * n,
        ),
        allocator_settings={} if max_split is None else {"max_split_size": max_split},
    )
    assert empty_cache_points(snap) == _empty_cache_points_by_request(snap)


def test_tags_of_allocs_frees_and_pre_trace_rows(write_snapshot, snap_entry):
    path = write_snapshot(
        [
            snap_entry("free_completed", B, 30, 0),  # allocated before recording: "pre-trace"
            snap_entry("alloc", A, 10, 1, user_metadata="kv"),
            snap_entry("alloc", A + 0x100, 10, 2, user_metadata="pre-trace"),
            snap_entry("alloc", A + 0x200, 10, 3, user_metadata="weights"),
            snap_entry("free_completed", A, 10, 4, user_metadata="ignored on a free"),
            snap_entry("alloc", A, 10, 5, user_metadata="kv"),
        ]
    )
    ev = read_pytorch_snapshot(path).events
    assert list(ev["tag"]) == ["pre-trace", "", "kv", "pre-trace", "weights", "", "kv"]
    assert list(ev["op"]) == ["alloc", "free", "alloc", "alloc", "alloc", "free", "alloc"]
    assert ev["tag"].dtype == ev["op"].dtype == pd.Series(["x"], dtype=object).astype(str).dtype
