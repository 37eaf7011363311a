"""The one snapshot parser: what replay's trace reader and fidelity both read from a snapshot."""

import pytest

from sim.replay.fidelity import ALLOC, EMPTY_CACHE, FREE, read_recording
from traces.errors import TraceFormatError
from traces.pytorch_snapshot import PreTraceAllocation, read_pytorch_snapshot, read_snapshot

MiB = 1 << 20
A, B, C = (
    0x7F0000000000,
    0x7F0001400000,
    0x7F0001600000,
)  # B just past A (20 MiB): segments never overlap


def _segment(address, total_size, blocks, stream=0, segment_type="large"):
    return {
        "device": 0,
        "address": address,
        "total_size": total_size,
        "allocated_size": 0,
        "stream": stream,
        "segment_type": segment_type,
        "is_expandable": False,
        "blocks": blocks,
    }


def _block(address, size, state, requested_size):
    return {"address": address, "size": size, "requested_size": requested_size, "state": state}


@pytest.fixture
def snapshot_file(write_snapshot, snap_entry):
    """Segment A (20 MiB) held a block before recording; B (2 MiB) is reserved in the trace; C is
    freed by the trace without having been reserved in it."""
    entries = [
        snap_entry(
            "free_completed", A + MiB, 3000, 100, stream=0xBEEF
        ),  # allocated before recording
        snap_entry("segment_alloc", B, 2 * MiB, 110, stream=0xBEEF),
        snap_entry("alloc", B, 700, 120, stream=0xBEEF, user_metadata="kv"),
        snap_entry("snapshot", 0, 0, 125),
        snap_entry("segment_free", C, 20 * MiB, 130),
        snap_entry("free_completed", B, 0, 140, stream=0xBEEF),
    ]
    segments = [
        _segment(
            A,
            20 * MiB,
            [_block(A, MiB, "active_allocated", MiB - 8), _block(A + MiB, 19 * MiB, "inactive", 0)],
        ),
        _segment(
            B, 2 * MiB, [_block(B, 2 * MiB, "inactive", 0)], stream=0xBEEF, segment_type="small"
        ),
    ]
    return write_snapshot(entries, segments)


def test_the_parsed_snapshot_holds_requests_decisions_and_the_starting_state(snapshot_file):
    snap = read_snapshot(snapshot_file)
    assert snap.name == "snap" and snap.device == 0 and snap.free_action == "free_completed"
    assert snap.stream_handles == {0: 0, 0xBEEF: 1}
    req = snap.requests
    assert list(
        zip(req.entry, req.is_alloc, req.address, req.nbytes, req.stream, req.alloc_id, req.tag)
    ) == [
        (0, False, A + MiB, 3000, 1, 0, ""),
        (2, True, B, 700, 1, 1, "kv"),
        (5, False, B, 700, 1, 1, ""),
    ]
    ev = snap.segment_events
    assert list(zip(ev.entry, ev.action, ev.address, ev.nbytes)) == [
        (1, "segment_alloc", B, 2 * MiB),
        (4, "segment_free", C, 20 * MiB),
    ]
    assert [s.address for s in snap.segments_at_end] == [A, B]
    # B was reserved in the trace; C was held at the start (a free without a reservation)
    assert [(s.address, s.total_bytes, s.is_small) for s in snap.segments_at_start] == [
        (A, 20 * MiB, False),
        (C, 20 * MiB, False),
    ]
    assert snap.pre_trace == (
        PreTraceAllocation(A + MiB, 3000, 1, None, 0),
        PreTraceAllocation(A, MiB - 8, 0, MiB, None),
    )
    assert snap.ignored_actions == {"snapshot": 1}


def test_replay_and_fidelity_read_the_same_parse(snapshot_file):
    trace, rec = read_pytorch_snapshot(snapshot_file), read_recording(snapshot_file)
    ev = trace.events
    assert list(ev["nbytes"][ev["tag"] == "pre-trace"]) == [3000, MiB - 8]
    assert rec.ops == [
        FREE,
        ALLOC,
        EMPTY_CACHE,
        FREE,
    ]  # a segment_free no reservation follows: empty_cache()
    assert rec.sizes == [3000, 700, 0, 700] and rec.entries == [0, 2, 4, 5]
    assert [(s.address, s.block_addrs) for s in rec.seed_segments] == [(A, [A, A + MiB]), (C, [])]
    assert trace.meta["allocator_settings"] == rec.settings


def test_fidelity_names_the_file_and_record_of_a_malformed_entry(write_snapshot, snap_entry):
    bad = snap_entry("alloc", B, 10, 1)
    del bad["size"]
    path = write_snapshot([snap_entry("alloc", A, 10, 0), bad])
    for read in (read_recording, read_pytorch_snapshot):
        with pytest.raises(
            TraceFormatError, match=r"snap.pickle.gz \(device_traces\[0\] index 1\).*'size'"
        ):
            read(path)


def test_times_are_needed_by_the_trace_reader_only(write_snapshot, snap_entry):
    untimed = snap_entry("alloc", B, 10, 0)
    del untimed["time_us"]
    path = write_snapshot([snap_entry("alloc", A, 10, 0), untimed])
    assert read_recording(path).sizes == [10, 10]
    with pytest.raises(TraceFormatError, match=r"index 1\).*lacks key 'time_us'"):
        read_pytorch_snapshot(path)


def test_allocator_settings_that_are_no_dict_are_an_error(write_snapshot):
    path = write_snapshot([], allocator_settings=[1, 2])
    with pytest.raises(TraceFormatError, match="'allocator_settings' must be a dict"):
        read_snapshot(path)


def _mixed_entries(snap_entry) -> list[dict]:
    """Requests of every kind the parser keeps, spread so that batches of a few entries cut
    through them: three frees of blocks allocated before recording, two allocations with no
    time, deferred frees, a segment event and tags."""
    entries = []
    for k in range(28):
        addr = A + k * 4096
        if k in (1, 12, 25):
            entries.append(snap_entry("free_completed", A + MiB + k * 4096, 512 + k, 100 + k))
        elif k in (4, 17):
            e = snap_entry("alloc", addr, 256 + k, 0, user_metadata=f"t{k % 3}")
            del e["time_us"]
            entries.append(e)
        elif k == 9:
            entries.append(snap_entry("segment_alloc", B, 2 * MiB, 100 + k))
        elif k % 3 == 2 and entries and entries[-1]["action"] == "alloc":
            prev = entries[-1]["addr"]
            entries.append(snap_entry("free_requested", prev, 0, 100 + k))
            entries.append(snap_entry("free_completed", prev, 0, 100 + k))
        else:
            entries.append(snap_entry("alloc", addr, 256 + k, 100 + k, user_metadata=f"t{k % 3}"))
    return entries


@pytest.mark.parametrize("batch_entries", [1, 2, 3, 5, 8])
def test_a_parse_in_batches_gives_the_columns_of_one_pass(snap_entry, batch_entries):
    """A streamed read feeds the parser a batch at a time (``traces.snapshot_stream``); each batch
    is parsed into lists and moved into the columns at its end, so a request's index within the
    trace must count the batches before it (the untimed requests, the pre-trace frees)."""
    from traces.pytorch_snapshot import _EntryParser

    entries = _mixed_entries(snap_entry)

    def parsed(size):
        parser = _EntryParser({0: 0}, "f.pickle", "device_traces[0] index", "free_completed")
        for start in range(0, len(entries), size):
            parser.feed(entries[start : start + size], start)
        return parser.finish()

    whole = parsed(len(entries))
    assert parsed(batch_entries) == whole
    requests, _, pre_freed, _, _, ignored, _ = whole
    untimed = [k for k, t in enumerate(requests.time_us) if t is None]
    assert [requests.entry[k] for k in untimed] == [
        i for i, e in enumerate(entries) if "time_us" not in e
    ]
    assert [requests.entry[p.freed_at] for p in pre_freed] == [
        i for i, e in enumerate(entries) if e["addr"] >= A + MiB and e["action"] == "free_completed"
    ]
    assert len(pre_freed) == 3
    assert [requests.address[p.freed_at] for p in pre_freed] == [p.address for p in pre_freed]
    assert list(requests.entry) == sorted(requests.entry)
    assert len(requests.entry) == len(requests.tag) == len(entries) - ignored["free_requested"] - 1


@pytest.mark.parametrize("batch_entries", [1, 4, 64])
def test_a_bad_time_in_a_later_batch_names_its_entry(snap_entry, batch_entries):
    from traces.pytorch_snapshot import _EntryParser

    entries = _mixed_entries(snap_entry)
    late = max(i for i, e in enumerate(entries) if e["action"] == "alloc" and "time_us" in e)
    entries[late]["time_us"] = "soon"
    parser = _EntryParser({0: 0}, "f.pickle", "device_traces[0] index", "free_completed")
    for start in range(0, len(entries), batch_entries):
        parser.feed(entries[start : start + batch_entries], start)
    with pytest.raises(
        TraceFormatError, match=rf"f.pickle.*\b{late}\b.*time_us 'soon' is not an integer"
    ):
        parser.finish()
