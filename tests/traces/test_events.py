import numpy as np
import pandas as pd
import pytest

from traces.errors import TraceFormatError
from traces.events import coded_str_column, make_events, validate_events


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


def test_coded_str_column_is_the_column_make_events_makes_of_the_strings():
    values = ["alloc", "free", "", "kv", "free"]  # a repeat decodes alike
    codes = np.array([0, 1, 4, 2, 3, 0, 3], np.int8)
    strings = [values[c] for c in codes]
    made = make_events(range(7), strings, range(7), [1] * 7, tag=strings)
    coded = coded_str_column(codes, values)
    assert coded.dtype == made["op"].dtype
    assert list(coded) == strings
    from_codes = make_events(range(7), coded, range(7), [1] * 7, tag=coded)
    pd.testing.assert_frame_equal(from_codes, made)
    assert len(coded_str_column(np.zeros(0, np.int32), ["x"])) == 0


def test_make_events_takes_a_string_column_by_position_and_fills_missing_tags():
    ops = pd.Series(["free", "alloc"], index=[5, 3]).astype(str)  # its index means nothing here
    tags = pd.Series(["kv", None], index=[9, 8]).astype(str)
    ev = make_events([0, 1], ops, [1, 1], [8, 8], tag=tags)
    assert list(ev["op"]) == ["free", "alloc"] and list(ev["tag"]) == ["kv", ""]
    assert ev.index.equals(pd.RangeIndex(2))


def test_coded_str_column_without_arrow_strings_takes_the_objects(monkeypatch):
    import traces.events as events

    monkeypatch.setattr(events, "_str_dtype", lambda: pd.StringDtype("python", na_value=np.nan))
    assert list(coded_str_column(np.array([1, 0, 1]), ["a", "b"])) == ["b", "a", "b"]
