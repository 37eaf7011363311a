import pytest

from traces.errors import TraceFormatError
from traces.events import make_events, validate_events


def _line(ops, ids, sizes, times=None, **kw):
    df = make_events(times if times is not None else range(len(ops)), ops, ids, sizes)
    with pytest.raises(TraceFormatError) as err:
        validate_events(df, "t.csv", **kw)
    return err.value


def test_earliest_problem_wins_across_checks():
    # row 1 frees an unknown id, row 3 has a bad op: row 1 (line 3) is reported
    err = _line(["alloc", "free", "alloc", "oops"], [0, 7, 1, 2], [1, 1, 1, 1])
    assert err.line == 3 and "not live" in err.reason


def test_duplicate_reports_its_first_repeat_in_file_order():
    # id 5 repeats at row 3, id 1 at row 4: row 3 (line 5) is the first repeat
    err = _line(["alloc", "alloc", "alloc", "alloc", "alloc"], [5, 1, 9, 5, 1], [1, 1, 1, 1, 1])
    assert err.line == 5 and "allocation 5 allocated twice" in err.reason


def test_negative_size_on_a_free_row_is_an_error():
    assert _line(["alloc", "free"], [0, 0], [4, -4]).line == 3


def test_record_unit_shows_in_the_message():
    err = _line(["alloc", "bad"], [0, 1], [1, 1], line_offset=1, unit="record")
    assert "t.csv (record 2)" in str(err)


def test_valid_table_passes():
    validate_events(make_events([0, 1, 1], ["alloc", "alloc", "free"], [3, 4, 3], [8, 9, 8]))
