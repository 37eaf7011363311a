"""The streamed snapshot read (``traces.snapshot_stream``): the same parse as the whole-file read,
in less memory."""

from __future__ import annotations

import gzip
import pickle
import tracemalloc

import pandas as pd
import pytest

import traces.pytorch_snapshot as pytorch_snapshot
import traces.snapshot_stream as snapshot_stream
from traces import read_alloc_trace
from traces.errors import TraceFormatError
from traces.pytorch_snapshot import (
    load_snapshot_dict,
    parse_snapshot,
    read_pytorch_snapshot,
    read_snapshot,
)
from traces.snapshot_stream import StreamedEntries, find_device_list, load_streaming
from traces.source import open_source

MiB = 1 << 20


def _entries(
    num_steps: int, snap_entry, *, completions: bool = True, stream: int = 0
) -> list[dict]:
    """``num_steps`` alloc / free_requested / free_completed triples over a few addresses, with
    tags."""
    out = []
    for k in range(num_steps):
        addr = 0x7F0000000000 + (k % 7) * MiB
        out.append(
            snap_entry(
                "alloc",
                addr,
                512 + k % 5,
                10 * k,
                stream=stream,
                user_metadata="kv" if k % 3 else "",
            )
        )
        out.append(snap_entry("free_requested", addr, 512 + k % 5, 10 * k + 3, stream=stream))
        if completions:
            out.append(snap_entry("free_completed", addr, 512 + k % 5, 10 * k + 5, stream=stream))
    return out


def _whole(path, device=None):
    """The whole-file read: every entry unpickled first (the reader before streaming, kept as the
    fallback)."""
    src = open_source(path)
    return parse_snapshot(load_snapshot_dict(src), source=str(src.path), device=device, name="snap")


def _streamed(path, monkeypatch, device=None):
    """``read_snapshot`` that fails should it read the file whole (it must stream)."""

    def whole(src):
        raise AssertionError("read whole")

    with monkeypatch.context() as m:
        m.setattr(pytorch_snapshot, "load_snapshot_dict", whole)
        return read_snapshot(path, device=device)


def _read_whole_counted(path, monkeypatch, device=None):
    """``read_snapshot`` and how many times it fell back to the whole-file read."""
    calls = []
    with monkeypatch.context() as m:
        m.setattr(
            pytorch_snapshot,
            "load_snapshot_dict",
            lambda src: calls.append(1) or load_snapshot_dict(src),
        )
        return read_snapshot(path, device=device), len(calls)


def _same(a, b) -> None:
    for field in (
        "device",
        "free_action",
        "time_origin_us",
        "segments_at_end",
        "segments_at_start",
        "pre_trace",
        "stream_handles",
        "ignored_actions",
        "num_deferred_frees",
        "allocator_settings",
    ):
        assert getattr(a, field) == getattr(b, field), field
    for table in ("requests", "segment_events"):
        x, y = getattr(a, table), getattr(b, table)
        for column in x.__dataclass_fields__:
            assert list(getattr(x, column)) == list(getattr(y, column)), (table, column)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_streamed_read_parses_as_the_whole_file_read(
    write_snapshot, snap_entry, tmp_path, protocol, monkeypatch
):
    entries = _entries(
        1500, snap_entry
    )  # 4,500 entries: several of the unpickler's 1,000-entry batches
    entries.insert(7, snap_entry("segment_alloc", 0x7E0000000000, 2 * MiB, 65))
    snap = {"segments": [], "device_traces": [[], entries], "allocator_settings": {}}
    path = tmp_path / "snap.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps(snap, protocol=protocol), mtime=0))
    assert find_device_list(open_source(path).data, None)[1] == 1  # the first non-empty device
    streamed = _streamed(path, monkeypatch)
    _same(streamed, _whole(path))
    assert (
        streamed.device == 1
        and len(streamed.requests) == 3000
        and streamed.ignored_actions == {"free_requested": 1500}
    )


def test_the_streamed_read_holds_no_list_of_entry_dicts(write_snapshot, snap_entry):
    path = write_snapshot(_entries(10_000, snap_entry))  # 30,000 entries
    peaks = []
    for read in (read_snapshot, _whole):
        tracemalloc.start()
        read(path)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    streamed, whole = peaks
    # whole: ~450 bytes an entry unpickled, then the columns; streamed: an emptied dict (64 bytes)
    # and the columns
    assert streamed < 0.5 * whole, (streamed, whole)


def test_a_trace_without_completions_is_read_again_with_free_requested(
    write_snapshot, snap_entry, monkeypatch
):
    path = write_snapshot(_entries(1200, snap_entry, completions=False))
    snap = _streamed(path, monkeypatch)
    assert snap.free_action == "free_requested" and len(snap.requests) == 2400
    _same(snap, _whole(path))


def test_a_device_after_a_non_empty_one_and_shared_entries_read_whole_alike(
    write_snapshot, snap_entry, monkeypatch
):
    first, second = _entries(400, snap_entry), _entries(1300, snap_entry, stream=0xBEEF)
    path = write_snapshot([], device_traces=[first, second])
    assert find_device_list(open_source(path).data, 1)[1] == 1
    _same(
        _streamed(path, monkeypatch, device=1), _whole(path, device=1)
    )  # the walk passes device 0's entries
    _same(_streamed(path, monkeypatch), _whole(path))
    # one dict object twice, in batches 1,000 entries apart: the streamed read empties the first, so
    # it must hand over to the whole-file read, which sees the second as PyTorch wrote it
    shared, marker = _entries(1300, snap_entry), snap_entry("snapshot", 0, 0, 0)
    shared[10] = shared[2500] = marker
    path = write_snapshot(shared, name="shared.pickle.gz")
    loaded = pickle.loads(gzip.decompress(path.read_bytes()))["device_traces"][0]
    assert loaded[10] is loaded[2500]
    snap, num_whole = _read_whole_counted(path, monkeypatch)
    _same(snap, _whole(path))
    assert snap.ignored_actions["snapshot"] == 2 and num_whole == 1


def test_errors_name_the_entry_in_a_later_batch(write_snapshot, snap_entry):
    entries = _entries(
        1000, snap_entry
    )  # entries 3k + 1 are free_requested: replacing one leaves the rest whole
    entries[2344] = {"action": "alloc", "addr": 5, "size": -3, "stream": 0, "time_us": 1}
    entries[2899] = snap_entry(
        "alloc", 16, 8, "late"
    )  # a bad time after it: the entry's error comes first
    path = write_snapshot(entries)
    with pytest.raises(TraceFormatError, match=r"device_traces\[0\] index 2344\).*size -3"):
        read_snapshot(path)
    entries[2344] = snap_entry("alloc", 8, 8, 1.5)
    path = write_snapshot(entries)
    with pytest.raises(TraceFormatError, match=r"index 2344\).*time_us 1.5 is not an integer"):
        read_pytorch_snapshot(path)


def test_a_hostile_pickle_cannot_name_the_collector(tmp_path):
    """Only the reader's own swapped-in opcode makes a collector; a file naming it is refused as any
    global."""
    path = tmp_path / "evil.pickle"
    path.write_bytes(b"\x80\x04c" + b"traces.snapshot_stream\nStreamedEntries\n)R.")
    with pytest.raises(
        TraceFormatError, match="refusing to load traces.snapshot_stream.StreamedEntries"
    ):
        read_snapshot(path)
    assert StreamedEntries(0, lambda batch, start: None).num_entries == 0


def test_the_streamed_read_lets_the_content_go_and_a_second_read_reads_the_file_again(
    write_snapshot, snap_entry
):
    # the decompressed pickle (104 MB for a 1.5M-entry snapshot) was held under the entries, the
    # memo and the columns until the read ended, and then under the trace's columns
    path = write_snapshot(_entries(3000, snap_entry))
    src = open_source(path)
    first = read_alloc_trace(src)
    assert src.released and src.data == b""
    pd.testing.assert_frame_equal(read_alloc_trace(src.reopened()).events, first.events)
    pd.testing.assert_frame_equal(read_alloc_trace(path).events, first.events)


def test_the_pieces_read_are_let_go(write_snapshot, snap_entry):
    path = write_snapshot(_entries(3000, snap_entry))
    src = open_source(path)
    found = find_device_list(src.data, None)
    seen = []

    def consume(batch, start):  # at each batch: the pieces already read are gone
        seen.append(sum(p is None for p in files[0].pieces))

    files = []

    def unpickler(file):
        files.append(file)
        return pytorch_snapshot._SnapshotUnpickler(file)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(snapshot_stream, "CHUNK_BYTES", 4096)
        load_streaming(src.data, found, unpickler, consume, release=src.release)
    assert src.data == b"" and seen[-1] > seen[0] >= 0 and seen[-1] > 10


def test_a_snapshot_from_a_pipe_reads_as_from_its_file_both_passes(write_snapshot, snap_entry):
    # a pipe's source is the only copy of its bytes: it is kept (not let go), and the second pass
    # of a trace without completions reads it again
    import os
    import threading

    path = write_snapshot(_entries(1500, snap_entry, completions=False))
    r, w = os.pipe()

    def write() -> None:
        with os.fdopen(w, "wb") as f:
            f.write(path.read_bytes())

    threading.Thread(target=write, daemon=True).start()
    try:
        piped = read_alloc_trace(f"/dev/fd/{r}")
    finally:
        os.close(r)
    pd.testing.assert_frame_equal(piped.events, read_alloc_trace(path).events)
    assert len(piped.events) == 3000


def test_extend_empties_each_entry_dict_once_consumed_and_nothing_else():
    from collections import OrderedDict

    from traces.snapshot_stream import StreamedEntries

    seen = []
    streamed = StreamedEntries(
        0,
        lambda batch, start: seen.append(
            (start, [dict(e) if isinstance(e, dict) else e for e in batch])
        ),
    )
    plain = [{"action": "alloc", "addr": k} for k in range(3)]
    streamed.extend(plain)  # all plain dicts: the one C loop
    assert plain == [{}, {}, {}] and seen[0] == (
        0,
        [{"action": "alloc", "addr": k} for k in range(3)],
    )
    ordered, kept = OrderedDict(action="free_completed", addr=1), ["not", "a", "dict"]
    mixed = [{"action": "alloc", "addr": 9}, ordered, kept]
    streamed.extend([mixed[0], ordered])  # an OrderedDict: dict by dict
    assert mixed[0] == {} and ordered == OrderedDict() and len(streamed) == 5
    streamed.extend([{"action": "alloc", "addr": 10}, kept])  # a non-dict stays as it is
    assert kept == ["not", "a", "dict"] and seen[-1][0] == 5
