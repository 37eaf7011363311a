"""traces.source: any path read once, under the size and wait limits, the same bytes for sniffer and
reader."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

from traces.detect import detect_alloc_format, read_alloc_trace
from traces.errors import TraceFormatError
from traces.request_readers import read_request_trace
from traces.source import MAX_TRACE_BYTES_ENV, STREAM_TIMEOUT_ENV, open_source

HEADER = "time_us,op,alloc_id,nbytes,stream,tag\n"
REPO = Path(__file__).resolve().parents[2]


def _alloc_csv(num_allocs: int = 400) -> bytes:
    """Our CSV, well past 4 KiB (what detection used to read from a pipe before the reader did)."""
    rows = [
        f"{2 * i},alloc,{i},{4096 + i},0,kv\n{2 * i + 1},free,{i},{4096 + i},0,\n"
        for i in range(num_allocs)
    ]
    return (HEADER + "".join(rows)).encode()


def _pipe_path(data: bytes) -> str:
    """A pipe another thread writes ``data`` into, named as ``<(...)`` names it: ``/dev/fd/N``."""
    r, w = os.pipe()

    def write():
        with os.fdopen(w, "wb") as f:
            f.write(data)

    threading.Thread(target=write, daemon=True).start()
    return f"/dev/fd/{r}"


def test_a_pipe_is_detected_and_read_whole():
    data = _alloc_csv()
    trace = read_alloc_trace(_pipe_path(data))
    assert len(trace.events) == 800 and trace.events["nbytes"].iloc[-1] == 4096 + 399


def test_detecting_then_reading_the_same_pipe_reads_it_once():
    path = _pipe_path(gzip.compress(_alloc_csv(), mtime=0))
    assert detect_alloc_format(path) == "csv"
    assert len(read_alloc_trace(path).events) == 800  # the second open gets the bytes of the first


def test_a_request_trace_from_a_pipe_is_read(real_azure_path):
    data = real_azure_path.read_bytes()
    assert len(read_request_trace(_pipe_path(data))) == len(read_request_trace(real_azure_path))


def test_a_fifo_is_read(tmp_path):
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    data = _alloc_csv(10)

    def write():
        with open(fifo, "wb") as f:
            f.write(data)

    threading.Thread(target=write, daemon=True).start()
    assert len(read_alloc_trace(fifo).events) == 20


def test_a_fifo_nobody_writes_to_is_an_error_not_a_hang(tmp_path, monkeypatch):
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv(STREAM_TIMEOUT_ENV, "0.2")
    with pytest.raises(
        TraceFormatError, match=rf"t.fifo: no data for 0.2 s .*set {STREAM_TIMEOUT_ENV}"
    ):
        read_alloc_trace(fifo)


def test_process_substitution_through_the_command_line(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_bytes(_alloc_csv())
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" -m poollab traces info <(cat "{trace}")'],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "num_allocs" in proc.stdout and "400" in proc.stdout


def test_a_large_sparse_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "sparse.csv"
    with open(path, "wb") as f:
        f.write(HEADER.encode())
        f.truncate(2 << 30)  # 2 GiB of holes after a valid header
    tracemalloc.start()
    try:
        with pytest.raises(
            TraceFormatError,
            match=rf"sparse.csv: is 2,147,483,648 bytes, more than the limit of "
            rf"1,073,741,824 bytes on a trace; set {MAX_TRACE_BYTES_ENV}",
        ):
            read_alloc_trace(path)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < 1 << 20


def test_the_limit_can_be_raised(tmp_path, monkeypatch):
    path = tmp_path / "t.csv"
    path.write_bytes(_alloc_csv(10))
    monkeypatch.setenv(MAX_TRACE_BYTES_ENV, "100")
    with pytest.raises(TraceFormatError, match="more than the limit of 100 bytes"):
        read_alloc_trace(path)
    monkeypatch.setenv(MAX_TRACE_BYTES_ENV, str(1 << 20))
    assert len(read_alloc_trace(path).events) == 20


@pytest.mark.parametrize("value", ["lots", "-5", "0", "1e9", "9" * 30])
def test_a_bad_limit_is_one_line_naming_the_variable(tmp_path, monkeypatch, value):
    path = tmp_path / "t.csv"
    path.write_bytes(_alloc_csv(1))
    monkeypatch.setenv(MAX_TRACE_BYTES_ENV, value)
    with pytest.raises(
        TraceFormatError, match=rf"{MAX_TRACE_BYTES_ENV}=.* is not a whole number of bytes"
    ):
        read_alloc_trace(path)


def test_a_gzip_bomb_stops_at_the_limit(tmp_path, monkeypatch):
    path = tmp_path / "bomb.csv.gz"
    path.write_bytes(
        gzip.compress(HEADER.encode() + b"\0" * (64 << 20), mtime=0)
    )  # 64 KiB -> 64 MiB
    monkeypatch.setenv(MAX_TRACE_BYTES_ENV, str(8 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(
            TraceFormatError,
            match="bomb.csv.gz: decompresses to more bytes, more than the limit of 8,388,608 bytes",
        ):
            read_alloc_trace(path)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < 24 << 20


def test_gzip_members_and_zero_padding_read_as_gzip_reads_them(tmp_path):
    data = _alloc_csv(50)
    blob = gzip.compress(data[:1000], mtime=0) + gzip.compress(data[1000:], mtime=0) + b"\0" * 16
    path = tmp_path / "t.csv.gz"
    path.write_bytes(blob)
    with gzip.open(path, "rb") as f:
        assert f.read() == data
    src = open_source(path)
    assert (src.data, src.gzipped, src.damage) == (data, True, None)


def test_a_truncated_gzip_keeps_what_decompressed_and_says_why(tmp_path):
    data = _alloc_csv()
    blob = gzip.compress(data, mtime=0)
    path = tmp_path / "t.csv.gz"
    path.write_bytes(blob[: len(blob) // 2])
    src = open_source(path)
    assert src.damage.startswith("truncated") and data.startswith(src.data) and src.data
    assert detect_alloc_format(path) == "csv"  # the sniffer still sees the header
    with pytest.raises(TraceFormatError, match="t.csv.gz: truncated"):
        read_alloc_trace(path)


def test_garbage_after_a_gzip_stream_is_damage(tmp_path):
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(_alloc_csv(3), mtime=0) + b"not gzip")
    with pytest.raises(TraceFormatError, match="t.csv.gz: corrupt gzip stream"):
        read_alloc_trace(path)


def test_a_folder_or_a_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(IsADirectoryError):
        open_source(tmp_path)
    with pytest.raises(FileNotFoundError):
        open_source(tmp_path / "nope.csv")


def test_a_gzip_file_decompresses_into_one_buffer_not_pieces_and_a_copy(tmp_path):
    # the pieces joined at the end held the content twice (208 MB for a 104 MB snapshot)
    content = HEADER.encode() + os.urandom(1 << 10) * (40 << 10)  # 40 MiB
    path = tmp_path / "big.csv.gz"
    path.write_bytes(gzip.compress(content, compresslevel=1, mtime=0))
    tracemalloc.start()
    try:
        src = open_source(path)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert src.data == content
    assert peak_bytes < 1.6 * len(content), peak_bytes / len(content)


def test_a_released_source_reads_its_file_again(tmp_path):
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(_alloc_csv(3), mtime=0))
    src = open_source(path)
    src.release()
    assert (src.data, src.released) == (b"", True)
    assert src.reopened().data == _alloc_csv(3) and src.reopened() is not src


def test_inflate_pieces_are_the_gunzip_and_its_damage(tmp_path):
    from traces.source import ThreadedInflate, inflate_pieces

    data = _alloc_csv(300)
    intact = gzip.compress(data[:5000], mtime=0) + gzip.compress(data[5000:], mtime=0) + b"\0" * 8
    for blob in (intact, intact[: len(intact) // 3], gzip.compress(data, mtime=0) + b"not gzip"):
        path = tmp_path / "t.csv.gz"
        path.write_bytes(blob)
        src = open_source(path)
        pieces = inflate_pieces(blob, 1 << 30, path, piece_bytes=1000)
        got = []
        with pytest.raises(StopIteration) as end:
            while True:
                got.append(next(pieces))
        assert b"".join(got) == src.data and max(map(len, got)) <= 1000
        assert end.value.value == src.damage
        threaded = ThreadedInflate(blob, 1 << 30, path, piece_bytes=1000)
        assert b"".join(threaded) == src.data and threaded.outcome() == src.damage
    threaded = ThreadedInflate(intact, 4000, Path("small.gz"), piece_bytes=1000)
    assert len(b"".join(threaded)) <= 4000
    with pytest.raises(TraceFormatError, match="small.gz: decompresses to more bytes"):
        threaded.outcome()
