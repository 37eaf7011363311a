import gzip

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.errors import TraceFormatError
from traces.events import validate_events
from traces.rmm_log import read_rmm_log

HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"


def _log(tmp_path, *rows, name="rmm.csv"):
    path = tmp_path / name
    path.write_text(HEADER + "".join(r + "\n" for r in rows))
    return path


def _error_line(path, **kw):
    with pytest.raises(TraceFormatError) as err:
        read_rmm_log(path, **kw)
    return err.value.line


def test_allocate_and_free_pair_up(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x7f00,256,0x0",
        "1,10:00:00.000250,free,0x7f00,256,0x0",
    )
    ev = read_rmm_log(path).events
    rows = list(zip(ev["time_us"], ev["op"], ev["alloc_id"], ev["nbytes"]))
    assert rows == [(0, "alloc", 0, 256), (250, "free", 0, 256)]


def test_reused_pointer_gets_a_new_id(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x7f00,256,0x0",
        "1,10:00:00.000001,free,0x7f00,256,0x0",
        "1,10:00:00.000002,allocate,0x7f00,512,0x0",
        "1,10:00:00.000003,free,0x7f00,512,0x0",
    )
    ev = read_rmm_log(path).events
    assert list(ev["alloc_id"]) == [0, 0, 1, 1]
    assert list(ev["nbytes"]) == [256, 256, 512, 512]


def test_interleaved_pointers_match_their_own_allocation(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0xa00,1,0",
        "1,10:00:00.000001,allocate,0xb00,2,0",
        "1,10:00:00.000002,free,0xa00,1,0",
        "1,10:00:00.000003,free,0xb00,2,0",
    )
    ev = read_rmm_log(path).events
    assert list(ev["alloc_id"]) == [0, 1, 0, 1]


def test_midnight_wrap_keeps_time_increasing(tmp_path):
    path = _log(tmp_path, "1,23:59:59.999000,allocate,0x10,8,0", "1,00:00:00.001000,free,0x10,8,0")
    assert list(read_rmm_log(path).events["time_us"]) == [0, 2000]


def test_epoch_seconds_are_accepted(tmp_path):
    path = _log(
        tmp_path, "1,1634567890.123456,allocate,0x10,8,0", "1,1634567890.234567,free,0x10,8,0"
    )
    assert list(read_rmm_log(path).events["time_us"]) == [0, 111111]


@pytest.mark.parametrize("time", ["-1634567890.123456", "-0.5", "-00:00:01.000000", "nan", "inf"])
def test_a_time_before_the_epoch_or_no_number_names_its_line(tmp_path, time):
    first = "1,00:00:00.000000" if ":" in time else "1,1.0"
    path = _log(tmp_path, f"{first},allocate,0x10,8,0", f"1,{time},free,0x10,8,0")
    with pytest.raises(TraceFormatError, match=r"rmm.csv:3: Time '.*' is not HH:MM:SS"):
        read_rmm_log(path)


def test_allocate_failure_is_counted_and_skipped(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x10,8,0",
        "1,10:00:00.000001,allocate failure,(nil),1099511627776,0",
        "1,10:00:00.000002,free,0x10,8,0",
    )
    trace = read_rmm_log(path)
    assert len(trace) == 2
    assert trace.meta["num_failed_allocations"] == 1


def test_zero_byte_allocation_and_its_free_are_skipped(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,(nil),0,0",
        "1,10:00:00.000001,allocate,0x10,8,0",
        "1,10:00:00.000002,free,(nil),0,0",
    )
    trace = read_rmm_log(path)
    assert list(trace.events["op"]) == ["alloc"]
    assert trace.meta["num_zero_size_skipped"] == 1


def test_pointers_without_0x_prefix_are_hex(tmp_path):
    path = _log(
        tmp_path, "1,10:00:00.000000,allocate,7f00,8,7f11", "1,10:00:00.000001,free,0x7f00,8,0x7f11"
    )
    trace = read_rmm_log(path)
    assert list(trace.events["alloc_id"]) == [0, 0]
    assert trace.meta["stream_handles"] == {0: 0, 0x7F11: 1}


def test_streams_are_numbered_in_order_with_default_zero(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x10,8,0x55",
        "1,10:00:00.000001,allocate,0x20,8,0x0",
        "1,10:00:00.000002,allocate,0x30,8,0x66",
    )
    assert list(read_rmm_log(path).events["stream"]) == [1, 0, 2]


def test_gzipped_log_is_read(tmp_path):
    path = tmp_path / "rmm.log"
    path.write_bytes(gzip.compress((HEADER + "1,10:00:00.000000,allocate,0x10,8,0\n").encode()))
    assert len(read_rmm_log(path)) == 1


def test_blank_line_keeps_line_numbers(tmp_path):
    path = _log(
        tmp_path, "1,10:00:00.000000,allocate,0x10,8,0", "", "1,10:00:00.000002,free,0x99,8,0"
    )
    assert _error_line(path) == 4


# --- malformed input -------------------------------------------------------------------------


def test_free_of_unknown_pointer_names_its_line(tmp_path):
    path = _log(tmp_path, "1,10:00:00.000000,allocate,0x10,8,0", "1,10:00:00.000001,free,0x20,8,0")
    with pytest.raises(TraceFormatError, match=r"rmm.csv:3: free of pointer 0x20"):
        read_rmm_log(path)


def test_lenient_drops_unmatched_frees(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,free,0x20,8,0",
        "1,10:00:00.000001,allocate,0x10,8,0",
        "1,10:00:00.000002,free,0x10,8,0",
        "1,10:00:00.000003,free,0x10,8,0",
    )
    trace = read_rmm_log(path, lenient=True)
    assert list(trace.events["op"]) == ["alloc", "free"]
    assert trace.meta["num_unmatched_frees_dropped"] == 2
    validate_events(trace.events)


def test_double_free_names_the_second_free(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x10,8,0",
        "1,10:00:00.000001,free,0x10,8,0",
        "1,10:00:00.000002,free,0x10,8,0",
    )
    assert _error_line(path) == 4


def test_allocation_of_a_live_pointer_is_an_error(tmp_path):
    path = _log(
        tmp_path, "1,10:00:00.000000,allocate,0x10,8,0", "1,10:00:00.000001,allocate,0x10,8,0"
    )
    with pytest.raises(TraceFormatError, match="still live"):
        read_rmm_log(path)


def test_earliest_problem_is_reported(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x10,8,0",
        "1,10:00:00.000001,free,0x30,8,0",
        "1,10:00:00.000002,allocate,0x10,8,0",
    )
    assert _error_line(path) == 3


def test_bad_hex_pointer_names_its_line(tmp_path):
    path = _log(
        tmp_path, "1,10:00:00.000000,allocate,0x10,8,0", "1,10:00:00.000001,allocate,0xZZ,8,0"
    )
    with pytest.raises(TraceFormatError, match=r":3: Pointer '0xZZ' is not a hex address"):
        read_rmm_log(path)


def test_bad_hex_stream_names_its_line(tmp_path):
    path = _log(
        tmp_path, "1,10:00:00.000000,allocate,0x10,8,0", "1,10:00:00.000001,allocate,0x20,8,stream7"
    )
    assert _error_line(path) == 3


def test_bad_action_names_its_line(tmp_path):
    path = _log(
        tmp_path, "1,10:00:00.000000,allocate,0x10,8,0", "1,10:00:00.000001,reallocate,0x10,8,0"
    )
    with pytest.raises(TraceFormatError, match=r":3: Action 'reallocate'"):
        read_rmm_log(path)


def test_negative_size_names_its_line(tmp_path):
    path = _log(tmp_path, "1,10:00:00.000000,allocate,0x10,-8,0")
    assert _error_line(path) == 2


def test_bad_time_names_its_line(tmp_path):
    path = _log(tmp_path, "1,10:00:00.000000,allocate,0x10,8,0", "1,noon,allocate,0x20,8,0")
    assert _error_line(path) == 3


def test_wrong_header_is_line_one(tmp_path):
    path = tmp_path / "rmm.csv"
    path.write_text("Thread,When,Action,Pointer,Size,Stream\n1,10:00:00.000000,allocate,0x10,8,0\n")
    assert _error_line(path) == 1


def test_row_with_extra_fields_names_its_line(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x10,8,0",
        "1,10:00:00.000001,allocate,0x20,8,0,extra,extra",
    )
    assert _error_line(path) == 3


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 0x1000)), min_size=1, max_size=60))
def test_reader_recovers_a_random_alloc_free_sequence(tmp_path_factory, ops):
    """Simulate a pool handing out pointers from a small set: the reader must pair frees as the pool
    did."""
    live: dict[int, int] = {}  # pointer -> allocation number
    rows, expected = [], []
    count = 0
    for k, (slot, size) in enumerate(ops):
        ptr = 0x1000 * (slot + 1)
        t = f"10:00:{k // 100:02d}.{k % 100:06d}"
        if ptr in live:
            rows.append(f"1,{t},free,{ptr:#x},{size},0")
            expected.append(("free", live.pop(ptr)))
        else:
            rows.append(f"1,{t},allocate,{ptr:#x},{size},0")
            live[ptr] = count
            expected.append(("alloc", count))
            count += 1
    path = _log(tmp_path_factory.mktemp("rmm"), *rows)
    ev = read_rmm_log(path).events
    assert list(zip(ev["op"], ev["alloc_id"])) == expected
    validate_events(ev)


# --- logs that cannot be real, refused or announced (issue 29) ------------------------------


def test_allocation_inside_a_live_one_names_both_lines(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x1000,4096,0",
        "1,10:00:00.000001,allocate,0x1800,16,0",
    )
    with pytest.raises(
        TraceFormatError,
        match=r"rmm.csv:3: allocate at 0x1800 of 16 bytes overlaps the live "
        r"allocation \[0x1000, 0x2000\) of line 2",
    ):
        read_rmm_log(path)


def test_allocation_covering_a_live_one_is_an_error(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x1800,16,0",
        "1,10:00:00.000001,allocate,0x1000,4096,0",
    )
    assert _error_line(path) == 3


def test_overlapping_ranges_at_different_times_are_fine(tmp_path):
    # a pool splits and merges blocks: the same bytes under other pointers once the first is free
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x1000,4096,0",
        "1,10:00:00.000001,free,0x1000,4096,0",
        "1,10:00:00.000002,allocate,0x1800,16,0",
        "1,10:00:00.000003,allocate,0x1000,2048,0",
    )
    assert list(read_rmm_log(path).events["alloc_id"]) == [0, 0, 1, 2]


def test_adjacent_allocations_are_fine(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x1000,4096,0",
        "1,10:00:00.000001,allocate,0x2000,1,0",
    )
    assert len(read_rmm_log(path).events) == 2


def test_allocation_past_the_address_space_names_its_line(tmp_path):
    path = _log(tmp_path, "1,10:00:00.000000,allocate,0xfffffffffffffff0,4096,0")
    with pytest.raises(TraceFormatError, match=r"rmm.csv:2: .*past the end of the address space"):
        read_rmm_log(path)


def test_time_going_back_beyond_jitter_names_its_line(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:05.000000,allocate,0x10,8,0",
        "1,10:00:06.000000,allocate,0x20,8,0",
        "1,10:00:01.000000,free,0x10,8,0",
    )
    with pytest.raises(
        TraceFormatError, match=r"rmm.csv:4: Time goes back 5.000000 s from line 3's"
    ):
        read_rmm_log(path)


def test_threads_racing_to_log_are_clamped_and_counted(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000500,allocate,0x10,8,0",
        "2,10:00:00.000200,allocate,0x20,8,0",
        "1,10:00:00.000900,free,0x10,8,0",
    )
    trace = read_rmm_log(path)
    assert list(trace.events["time_us"]) == [0, 0, 400]
    assert trace.meta["num_time_clamped"] == 1


def test_free_on_another_stream_is_counted_and_kept_on_the_allocations_stream(tmp_path):
    path = _log(
        tmp_path,
        "1,10:00:00.000000,allocate,0x10,8,0xa",
        "1,10:00:00.000001,free,0x10,8,0xb",
        "1,10:00:00.000002,allocate,0x20,8,0xb",
        "1,10:00:00.000003,free,0x20,8,0xb",
    )
    trace = read_rmm_log(path)
    assert list(trace.events["stream"]) == [1, 1, 2, 2]
    assert trace.meta["num_cross_stream_frees"] == 1
    validate_events(trace.events)


@pytest.mark.parametrize("column", ["Size", "Time", "Stream"])
def test_a_5000_digit_field_is_one_short_line(tmp_path, column):
    fields = dict(Time="10:00:00.000000", Size="8", Stream="0")
    fields[column] = "9" * 5000
    path = _log(tmp_path, f"1,{fields['Time']},allocate,0x10,{fields['Size']},{fields['Stream']}")
    with pytest.raises(TraceFormatError, match=rf"rmm.csv:2: {column} '9+\.\.\.9+' is not") as err:
        read_rmm_log(path)
    assert len(str(err.value)) < 300
