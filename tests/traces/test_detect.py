import gzip
import shutil

import pytest

from traces.alloc_table import write_alloc_trace
from traces.bundled import bundled_path
from traces.detect import ALLOC_FORMATS, detect_alloc_format, read_alloc_trace
from traces.errors import TraceFormatError
from traces.events import EVENT_COLUMNS, AllocTrace, make_events

RMM_TEXT = (
    "Thread,Time,Action,Pointer,Size,Stream\n"
    "1,10:00:00.000000,allocate,0x10,8,0\n1,10:00:00.000005,free,0x10,8,0\n"
)
OUR_TEXT = ",".join(EVENT_COLUMNS) + "\n0,alloc,0,8,0,\n5,free,0,8,0,\n"


def _trace():
    return AllocTrace(make_events([0, 5], ["alloc", "free"], [0, 0], [8, 8]), name="t")


def test_snapshot_named_like_a_csv_is_detected(tmp_path):
    path = tmp_path / "looks_like.csv"
    shutil.copy(bundled_path("llama1b_generate_slice.pickle.gz"), path)
    assert detect_alloc_format(path) == "pytorch-snapshot"


def test_rmm_log_named_like_parquet_is_detected(tmp_path):
    path = tmp_path / "log.parquet"
    path.write_text(RMM_TEXT)
    assert detect_alloc_format(path) == "rmm-log"
    assert len(read_alloc_trace(path)) == 2


def test_our_csv_named_like_a_snapshot_is_detected(tmp_path):
    path = tmp_path / "events.pickle.gz"
    path.write_text(OUR_TEXT)
    assert detect_alloc_format(path) == "csv"


def test_parquet_named_like_a_csv_is_detected(tmp_path):
    path = write_alloc_trace(_trace(), tmp_path / "t.parquet").rename(tmp_path / "t.csv")
    assert detect_alloc_format(path) == "parquet"
    assert len(read_alloc_trace(path)) == 2


def test_gzipped_csv_with_no_suffix_is_read(tmp_path):
    path = tmp_path / "events"
    path.write_bytes(gzip.compress(OUR_TEXT.encode()))
    assert detect_alloc_format(path) == "csv"
    assert len(read_alloc_trace(path)) == 2


def test_plain_pickle_is_a_snapshot(tmp_path):
    path = tmp_path / "snap.bin"
    path.write_bytes(gzip.decompress(bundled_path("llama1b_generate_slice.pickle.gz").read_bytes()))
    assert detect_alloc_format(path) == "pytorch-snapshot"


def test_csv_header_with_byte_order_mark_is_detected(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + RMM_TEXT.encode())
    assert detect_alloc_format(path) == "rmm-log"


def test_unknown_text_is_a_format_error_on_line_one(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
    )
    with pytest.raises(TraceFormatError, match="cannot tell the format") as err:
        detect_alloc_format(path)
    assert err.value.line == 1


def test_empty_file_is_a_format_error(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_bytes(b"")
    with pytest.raises(TraceFormatError, match="empty file"):
        read_alloc_trace(path)


def test_truncated_gzip_snapshot_is_a_format_error_not_a_traceback(tmp_path):
    data = bundled_path("llama1b_generate_slice.pickle.gz").read_bytes()
    path = tmp_path / "cut.pickle.gz"
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(TraceFormatError, match="cut.pickle.gz"):
        read_alloc_trace(path)


def test_garbage_gzip_is_a_format_error(tmp_path):
    path = tmp_path / "bad.gz"
    path.write_bytes(b"\x1f\x8b" + b"\x00" * 40)
    with pytest.raises(TraceFormatError):
        read_alloc_trace(path)


def test_explicit_format_skips_detection(tmp_path):
    path = tmp_path / "events.txt"
    path.write_text(OUR_TEXT)
    assert read_alloc_trace(path, format="csv").format == "csv"


def test_explicit_wrong_format_is_a_format_error(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text(OUR_TEXT)
    with pytest.raises(TraceFormatError):
        read_alloc_trace(path, format="rmm-log")


def test_unknown_format_name_lists_the_choices(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text(OUR_TEXT)
    with pytest.raises(TraceFormatError, match="pytorch-snapshot, rmm-log, csv, parquet"):
        read_alloc_trace(path, format="nvtx")


def test_every_format_is_listed():
    assert ALLOC_FORMATS == ("pytorch-snapshot", "rmm-log", "csv", "parquet")


def test_lenient_reaches_the_rmm_reader(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(RMM_TEXT + "1,10:00:00.000009,free,0x99,8,0\n")
    assert len(read_alloc_trace(path, lenient=True)) == 2
