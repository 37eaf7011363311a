"""``traces.read_ahead``: a snapshot parsed in a child interpreter is the trace the plain read
makes, other threads alive or not; anything else (another format, a malformed file, a replaced
format) is read here, errors and all."""

from __future__ import annotations

import os
import threading
import warnings

import pandas as pd
import pytest

import traces
from traces import read_ahead
from traces.errors import TraceFormatError
from traces.formats import ALLOC
from traces.pytorch_snapshot import SNAPSHOT_FORMAT


@pytest.fixture(autouse=True)
def _any_size(monkeypatch):
    """Read tiny test files ahead too (the real threshold keeps small files in-process)."""
    monkeypatch.setattr(read_ahead, "MIN_READ_AHEAD_BYTES", 0)


def _entries(snap_entry, num_blocks=50):
    out = []
    for k in range(num_blocks):
        out.append(snap_entry("alloc", 0x1000 * (k + 1), 512 + k, 10 * k, user_metadata="kv"))
        if k % 3:
            out.append(snap_entry("free_requested", 0x1000 * (k + 1), 512 + k, 10 * k + 1))
            out.append(snap_entry("free_completed", 0x1000 * (k + 1), 512 + k, 10 * k + 5))
    out.append(snap_entry("free_completed", 0x900000, 4096, 999))  # allocated before recording
    out.append(snap_entry("segment_free", 0xA00000, 2 << 20, 1000))
    return out


def assert_same_trace(a, b):
    pd.testing.assert_frame_equal(a.events, b.events)
    assert (a.name, a.source, a.format) == (b.name, b.source, b.format)
    assert a.meta.keys() == b.meta.keys()
    for key, value in a.meta.items():
        other = b.meta[key]
        if isinstance(value, pd.DataFrame):
            pd.testing.assert_frame_equal(value, other)
        elif hasattr(value, "shape"):
            assert (value == other).all(), key
        else:
            assert value == other, key


@pytest.mark.parametrize("gz", [True, False])
def test_a_snapshot_read_in_a_child_is_the_plain_read(write_snapshot, snap_entry, gz):
    path = write_snapshot(_entries(snap_entry), gz=gz, name="s.pickle.gz" if gz else "s.pickle")
    with read_ahead.start_read(path) as reading:
        assert reading.started
        trace = reading.result()
    assert reading.ran_in_child and reading.child_cpu_s is not None
    assert not reading.started  # the child is reaped
    assert_same_trace(trace, traces.read_alloc_trace(path))


def test_the_device_and_the_format_are_passed_on(write_snapshot, snap_entry):
    entries = _entries(snap_entry)
    path = write_snapshot((), device_traces=[entries[:10], entries])
    with read_ahead.start_read(path, format=SNAPSHOT_FORMAT, device=1) as reading:
        trace = reading.result()
    assert reading.ran_in_child
    assert_same_trace(trace, traces.read_alloc_trace(path, device=1))


def test_a_malformed_snapshot_raises_the_plain_reads_error(write_snapshot, snap_entry):
    entries = _entries(snap_entry)
    del entries[7]["addr"]
    path = write_snapshot(entries)
    with pytest.raises(TraceFormatError) as plain:
        traces.read_alloc_trace(path)
    with read_ahead.start_read(path) as reading:
        assert reading.started
        with pytest.raises(TraceFormatError) as ahead:
            reading.result()
    assert not reading.ran_in_child
    assert str(ahead.value) == str(plain.value)
    assert "device_traces[0] index 7" in str(ahead.value)


def test_another_format_or_a_small_file_is_read_here(tmp_path, monkeypatch):
    path = tmp_path / "t.csv"
    path.write_text("time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,0,16,0,\n1,free,0,16,0,\n")
    with read_ahead.start_read(path) as reading:
        assert not reading.started  # no pickle inside: no child
        trace = reading.result()
    assert_same_trace(trace, traces.read_alloc_trace(path))
    assert not read_ahead.start_read(path, format="rmm-log").started
    monkeypatch.setattr(read_ahead, "MIN_READ_AHEAD_BYTES", 1 << 20)
    assert not read_ahead.start_read(path).started
    with pytest.raises(FileNotFoundError):
        read_ahead.start_read(tmp_path / "missing.pickle").result()


def test_a_fifo_is_not_opened_ahead(tmp_path):
    fifo = tmp_path / "snap.fifo"
    os.mkfifo(fifo)
    assert not read_ahead.start_read(fifo).started  # returns at once: nobody writes to it


def test_a_replaced_snapshot_format_is_read_by_its_replacement(write_snapshot, snap_entry):
    path = write_snapshot(_entries(snap_entry))
    builtin = ALLOC.get(SNAPSHOT_FORMAT)
    marker = traces.read_alloc_trace(path)
    marker.name = "replaced"
    try:
        ALLOC.register(
            SNAPSHOT_FORMAT,
            sniff=builtin.sniff,
            read=lambda src, **_: marker,
            describe=builtin.describe,
            replace=True,
        )
        with read_ahead.start_read(path) as reading:
            assert reading.result() is marker
        assert not reading.ran_in_child
    finally:
        ALLOC.register(
            SNAPSHOT_FORMAT,
            **{k: getattr(builtin, k) for k in ("sniff", "read", "describe", "confirm")},
            replace=True,
        )


def test_close_stops_a_child_whose_result_is_not_taken(write_snapshot, snap_entry):
    path = write_snapshot(_entries(snap_entry))
    reading = read_ahead.start_read(path)
    proc = reading._proc
    assert proc is not None
    reading.close()
    reading.close()
    assert proc.returncode is not None and not reading.started  # stopped and reaped
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)  # no zombie left


def test_a_read_ahead_with_other_threads_alive(write_snapshot, snap_entry):
    """The child is a fresh interpreter, not a fork: a thread holding a lock (as CI's test
    process, a notebook or a pool have) neither stops the read ahead nor reaches the child, and
    no fork-with-threads DeprecationWarning (Python 3.12) is raised."""
    path = write_snapshot(_entries(snap_entry))
    held, stop = threading.Lock(), threading.Event()

    def hold_a_lock():
        with held:
            stop.wait(60)

    thread = threading.Thread(target=hold_a_lock, daemon=True)
    thread.start()
    try:
        assert threading.active_count() > 1 and held.locked()
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            with read_ahead.start_read(path) as reading:
                assert reading.started
                trace = reading.result()
    finally:
        stop.set()
        thread.join()
    assert reading.ran_in_child
    assert_same_trace(trace, traces.read_alloc_trace(path))


def test_the_child_reads_a_relative_path_and_a_missing_child_falls_back(
    write_snapshot, snap_entry, monkeypatch
):
    path = write_snapshot(_entries(snap_entry))
    monkeypatch.chdir(path.parent)
    with read_ahead.start_read(path.name) as reading:
        trace = reading.result()
    assert reading.ran_in_child
    assert_same_trace(trace, traces.read_alloc_trace(path.name))
    monkeypatch.setattr(read_ahead.sys, "executable", str(path.parent / "no-such-python"))
    with read_ahead.start_read(path.name) as reading:
        assert not reading.started  # the interpreter could not be started: read here
        assert_same_trace(reading.result(), trace)


def test_the_replay_command_reads_ahead_and_gets_the_same_summary(
    write_snapshot, snap_entry, tmp_path, monkeypatch
):
    from click.testing import CliRunner

    from poollab.cli import cli

    path = write_snapshot(_entries(snap_entry))
    started = []
    real = read_ahead.ReadAhead.result

    def result(self):
        started.append(self.started)
        return real(self)

    monkeypatch.setattr(read_ahead.ReadAhead, "result", result)
    outs = []
    for name in ("ahead", "here"):
        out = tmp_path / name
        got = CliRunner().invoke(
            cli, ["replay", str(path), "-p", "best-fit", "--workers", "1", "--out", str(out)]
        )
        assert got.exit_code == 0, got.output
        outs.append(pd.read_csv(out / "summary.csv"))
        monkeypatch.setattr(read_ahead, "MIN_READ_AHEAD_BYTES", 1 << 40)
    assert started == [True, False]
    measured = [c for c in outs[0] if c.endswith(("_ns", "_s", "_us")) or "latency" in c]
    pd.testing.assert_frame_equal(outs[0].drop(columns=measured), outs[1].drop(columns=measured))


@pytest.fixture
def small_pieces(monkeypatch):
    """The overlapped read in pieces of 512 bytes: a test snapshot spans many."""
    from traces import pytorch_snapshot

    monkeypatch.setattr(pytorch_snapshot, "CHUNK_BYTES", 512)


@pytest.mark.parametrize("device", [None, 1])
def test_the_overlapped_read_is_the_plain_read(write_snapshot, snap_entry, small_pieces, device):
    import pickle

    from traces.pytorch_snapshot import read_snapshot, read_snapshot_overlapped

    entries = _entries(snap_entry, num_blocks=400)
    path = write_snapshot((), device_traces=[entries[:10], entries])
    got = read_snapshot_overlapped(path, device=device)
    assert got is not None
    assert pickle.dumps(got) == pickle.dumps(read_snapshot(path, device=device))


def test_the_overlapped_read_gives_up_where_the_plain_read_may_differ(
    write_snapshot, snap_entry, small_pieces, tmp_path
):
    """None, raising nothing: a plain pickle, a truncated or corrupt gzip stream, a device list
    past the first piece; a trace that needs a second pass (no free_completed) is read whole for
    it."""
    import gzip
    import pickle

    from traces.pytorch_snapshot import read_snapshot, read_snapshot_overlapped

    entries = _entries(snap_entry, num_blocks=400)
    assert read_snapshot_overlapped(write_snapshot(entries, gz=False, name="p.pickle")) is None
    blob = write_snapshot(entries).read_bytes()
    for name, damaged in (
        ("cut.pickle.gz", blob[: len(blob) - 40]),
        ("tail.pickle.gz", blob + b"not gzip"),
    ):
        (tmp_path / name).write_bytes(damaged)
        assert read_snapshot_overlapped(tmp_path / name) is None
    requested = [e for e in entries if e["action"] != "free_completed"]
    no_completed = write_snapshot(requested, name="r.pickle.gz")
    got = read_snapshot_overlapped(no_completed)
    assert got is not None and got.free_action == "free_requested"
    assert pickle.dumps(got) == pickle.dumps(read_snapshot(no_completed))
    big_segments = [
        {"address": k << 21, "total_size": 2 << 20, "stream": 0, "blocks": []} for k in range(400)
    ]
    late = write_snapshot(entries, segments=big_segments, name="late.pickle.gz")
    assert gzip.decompress(late.read_bytes()).find(b"device_traces") > 512
    assert read_snapshot_overlapped(late) is None
    # and the child, reading each of them, gives the plain read's trace or error
    for path in (no_completed, late):
        with read_ahead.start_read(path) as reading:
            trace = reading.result()
        assert reading.ran_in_child
        assert_same_trace(trace, traces.read_alloc_trace(path))


def test_the_overlapped_read_raises_the_plain_reads_error(write_snapshot, snap_entry, small_pieces):
    from traces.pytorch_snapshot import read_snapshot, read_snapshot_overlapped

    entries = _entries(snap_entry, num_blocks=400)
    del entries[300]["addr"]
    path = write_snapshot(entries)
    with pytest.raises(TraceFormatError) as plain:
        read_snapshot(path)
    with pytest.raises(TraceFormatError) as overlapped:
        read_snapshot_overlapped(path)
    assert str(overlapped.value) == str(plain.value) and "index 300" in str(plain.value)


def _sent(snap, cut_bytes: int = 0) -> bytes:
    """What the child's ``_send`` writes for ``snap``, less its last ``cut_bytes``."""
    r, w = os.pipe()
    with os.fdopen(w, "wb") as pipe:
        read_ahead._send(pipe, snap, (1.0, 2.0, 3.0))
    with os.fdopen(r, "rb") as pipe:
        data = pipe.read()
    return data[: len(data) - cut_bytes]


def _received(data: bytes):
    import io
    import pickle

    pipe = io.BufferedReader(io.BytesIO(data))
    got = pickle.load(pipe)
    return got, read_ahead._with_raw_columns(got[0], got[4], pipe)


def test_the_request_columns_go_through_the_pipe_raw(write_snapshot, snap_entry):
    from traces.pytorch_snapshot import read_snapshot
    from traces.source import open_source

    snap = read_snapshot(open_source(write_snapshot(_entries(snap_entry))))
    got, back = _received(_sent(snap))
    assert got[1:4] == (1.0, 2.0, 3.0)
    assert {name for name, _, _ in got[4]} == {
        "entry",
        "time_us",
        "is_alloc",
        "address",
        "nbytes",
        "stream",
        "alloc_id",
    }  # every array column; the tags, a list, in the pickle
    for name in ("entry", "time_us", "is_alloc", "address", "nbytes", "stream", "alloc_id"):
        sent, came = getattr(snap.requests, name), getattr(back.requests, name)
        assert came.dtype.itemsize == sent.itemsize and came.tolist() == sent.tolist(), name
    assert back.requests.tag == snap.requests.tag
    assert back.segment_events == snap.segment_events and back.pre_trace == snap.pre_trace
    with pytest.raises(EOFError, match="alloc_id"):  # a child dead before its last byte
        _received(_sent(snap, cut_bytes=1))
    nothing, _ = _received(_sent(None))
    assert nothing[0] is None and nothing[4] == ()
