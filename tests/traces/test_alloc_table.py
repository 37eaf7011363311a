import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.alloc_table import read_table_csv, read_table_parquet, write_alloc_trace
from traces.errors import TraceFormatError
from traces.events import EVENT_COLUMNS, AllocTrace, make_events
from traces.synth_alloc import generate_alloc_trace

HEADER = ",".join(EVENT_COLUMNS) + "\n"
GOOD = ["0,alloc,0,100,0,kv", "5,alloc,1,50,1,", "9,free,0,100,0,", "12,free,1,50,1,"]


def _csv(tmp_path, rows, name="t.csv"):
    path = tmp_path / name
    path.write_text(HEADER + "".join(r + "\n" for r in rows))
    return path


def _error(fn, path):
    with pytest.raises(TraceFormatError) as err:
        fn(path)
    return err.value


@pytest.fixture(scope="module")
def small_synth():
    return generate_alloc_trace(
        num_layers=2,
        hidden_size=256,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=1000,
        num_requests=4,
        prompt_tokens=(8, 40),
        output_tokens=(2, 6),
        max_batch=2,
        seed=3,
    )


@pytest.mark.parametrize("suffix", [".csv", ".csv.gz", ".parquet"])
def test_round_trip_keeps_every_event(tmp_path, small_synth, suffix):
    path = write_alloc_trace(small_synth, tmp_path / f"trace{suffix}")
    back = read_table_parquet(path) if suffix == ".parquet" else read_table_csv(path)
    pd.testing.assert_frame_equal(back.events, small_synth.events)


def test_round_trip_of_real_slice(tmp_path):
    from traces.bundled import bundled_path
    from traces.pytorch_snapshot import read_pytorch_snapshot

    trace = read_pytorch_snapshot(bundled_path("llama1b_generate_slice.pickle.gz"))
    back = read_table_parquet(write_alloc_trace(trace, tmp_path / "slice.parquet"))
    pd.testing.assert_frame_equal(back.events, trace.events)


def test_name_is_the_file_stem(tmp_path):
    assert read_table_csv(_csv(tmp_path, GOOD, name="run7.csv")).name == "run7"


def test_tags_survive_and_empty_tags_stay_empty(tmp_path):
    assert list(read_table_csv(_csv(tmp_path, GOOD)).events["tag"]) == ["kv", "", "", ""]


def test_unknown_suffix_is_refused(tmp_path, small_synth):
    with pytest.raises(ValueError, match="trace.txt"):
        write_alloc_trace(small_synth, tmp_path / "trace.txt")


def test_bad_op_names_its_line(tmp_path):
    err = _error(read_table_csv, _csv(tmp_path, GOOD[:2] + ["9,release,0,100,0,"] + GOOD[3:]))
    assert (err.line, "op 'release'" in err.reason) == (4, True)


def test_negative_size_names_its_line(tmp_path):
    err = _error(read_table_csv, _csv(tmp_path, ["0,alloc,0,100,0,", "1,alloc,1,-5,0,"]))
    assert err.line == 3 and "-5" in err.reason


def test_a_whole_number_past_int64_is_named_out_of_range_and_a_fraction_not_an_integer(tmp_path):
    err = _error(
        read_table_csv, _csv(tmp_path, ["0,alloc,0,100,0,", "1,alloc,1,99999999999999999999,0,"])
    )
    assert err.line == 3 and err.reason.endswith("is out of the int64 range")
    err = _error(read_table_csv, _csv(tmp_path, ["0,alloc,0,100,0,", "1,alloc,1,2.5,0,"]))
    assert err.line == 3 and err.reason.endswith("is not an integer")
    err = _error(read_table_csv, _csv(tmp_path, ["nan,alloc,0,100,0,"]))
    assert err.line == 2 and err.reason.endswith("is not an integer")


def test_free_before_alloc_names_its_line(tmp_path):
    err = _error(
        read_table_csv, _csv(tmp_path, ["0,alloc,0,100,0,", "1,free,1,50,0,", "2,alloc,1,50,0,"])
    )
    assert err.line == 3 and "not live" in err.reason


def test_double_free_names_the_second_free(tmp_path):
    err = _error(read_table_csv, _csv(tmp_path, GOOD + ["13,free,0,100,0,"]))
    assert err.line == 6 and "double free" in err.reason


def test_time_going_back_names_its_line(tmp_path):
    err = _error(read_table_csv, _csv(tmp_path, ["5,alloc,0,100,0,", "4,free,0,100,0,"]))
    assert err.line == 3


@pytest.mark.parametrize(
    "rows, line",
    [
        (["-10,alloc,0,100,0,", "-5,free,0,100,0,"], 2),  # never going back, but before the start
        (["0,alloc,0,100,0,", "-5,free,0,100,0,"], 3),
    ],
)
def test_negative_time_names_its_line(tmp_path, rows, line):
    err = _error(read_table_csv, _csv(tmp_path, rows))
    assert err.line == line and "time_us -" in err.reason and "must be >= 0" in err.reason


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1.5"])
def test_a_time_that_is_no_whole_number_names_its_line(tmp_path, value):
    err = _error(read_table_csv, _csv(tmp_path, ["0,alloc,0,100,0,", f"{value},free,0,100,0,"]))
    assert err.line == 3 and "time_us" in err.reason


def test_parquet_negative_time_names_its_record(tmp_path):
    df = make_events([0, 1], ["alloc", "free"], [0, 0], [1, 1])
    df["time_us"] = [-3, 1]
    err = _error(read_table_parquet, _parquet(tmp_path, df))
    assert err.line == 1 and "(record 1)" in str(err) and "time_us -3 must be >= 0" in str(err)


def test_non_integer_cell_names_its_line(tmp_path):
    err = _error(read_table_csv, _csv(tmp_path, GOOD[:3] + ["12,free,1,fifty,1,"]))
    assert err.line == 5 and "nbytes 'fifty'" in err.reason


def test_blank_line_in_the_middle_names_its_line(tmp_path):
    err = _error(read_table_csv, _csv(tmp_path, GOOD[:2] + [""] + GOOD[2:]))
    assert err.line == 4


def test_trailing_blank_lines_are_fine(tmp_path):
    assert len(read_table_csv(_csv(tmp_path, GOOD + ["", ""]))) == 4


def test_missing_column_is_a_header_error(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("time_us,op,alloc_id,nbytes,tag\n0,alloc,0,1,\n")
    err = _error(read_table_csv, path)
    assert err.line == 1 and "stream" in err.reason


def test_row_with_extra_fields_names_its_line(tmp_path):
    err = _error(read_table_csv, _csv(tmp_path, GOOD[:1] + ["5,alloc,1,50,1,,x,y"]))
    assert err.line == 3


def _parquet(tmp_path, df):
    path = tmp_path / "t.parquet"
    df.to_parquet(path, index=False)
    return path


def test_parquet_bad_op_names_its_record(tmp_path):
    df = make_events([0, 1, 2], ["alloc", "alloc", "grab"], [0, 1, 2], [1, 2, 3])
    err = _error(read_table_parquet, _parquet(tmp_path, df))
    assert err.line == 3 and "(record 3)" in str(err)


def test_parquet_missing_column_is_an_error(tmp_path):
    df = make_events([0], ["alloc"], [0], [1]).drop(columns=["stream"])
    assert "stream" in _error(read_table_parquet, _parquet(tmp_path, df)).reason


def test_parquet_null_size_names_its_record(tmp_path):
    df = make_events([0, 1], ["alloc", "alloc"], [0, 1], [1, 2])
    df["nbytes"] = pd.array([1, None], dtype="Int64")
    assert _error(read_table_parquet, _parquet(tmp_path, df)).line == 2


def test_parquet_dictionary_encoded_strings_are_read(tmp_path):
    df = make_events([0, 1], ["alloc", "free"], [0, 0], [8, 8])
    table = pa.Table.from_pandas(df, preserve_index=False)
    table = table.set_column(1, "op", table.column("op").dictionary_encode())
    path = tmp_path / "dict.parquet"
    pq.write_table(table, path)
    assert list(read_table_parquet(path).events["op"]) == ["alloc", "free"]


def test_truncated_parquet_is_an_error(tmp_path, small_synth):
    path = write_alloc_trace(small_synth, tmp_path / "t.parquet")
    path.write_bytes(path.read_bytes()[:200])
    assert "Parquet" in _error(read_table_parquet, path).reason


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 1 << 40), st.integers(0, 3), st.sampled_from(["", "kv", "a,b", "x y"])
        ),
        min_size=1,
        max_size=30,
    )
)
def test_csv_round_trip_of_arbitrary_allocations(tmp_path_factory, allocs):
    n = len(allocs)
    ops = ["alloc"] * n + ["free"] * (n // 2)
    ids = list(range(n)) + list(range(n // 2))
    sizes = [a[0] for a in allocs] + [allocs[i][0] for i in range(n // 2)]
    streams = [a[1] for a in allocs] + [allocs[i][1] for i in range(n // 2)]
    tags = [a[2] for a in allocs] + [""] * (n // 2)
    trace = AllocTrace(make_events(range(len(ops)), ops, ids, sizes, streams, tags), name="h")
    path = write_alloc_trace(trace, tmp_path_factory.mktemp("rt") / "h.csv")
    pd.testing.assert_frame_equal(read_table_csv(path).events, trace.events)


def test_huge_and_sparse_ids_are_renumbered_in_allocation_order(tmp_path):
    path = tmp_path / "ids.csv"
    path.write_text(
        "time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,9000000000000000000,4096,0,\n"
        "1,alloc,7,512,0,\n2,free,9000000000000000000,4096,0,\n3,free,7,512,0,\n"
    )
    events = read_table_csv(path).events
    assert events["alloc_id"].tolist() == [0, 1, 0, 1]
    assert events["nbytes"].tolist() == [4096, 512, 4096, 512]


# --- numbers that do not fit, columns of the wrong kind, frees elsewhere (issue 29) -----------


@pytest.mark.parametrize("column", ["nbytes", "time_us", "alloc_id", "stream"])
def test_a_5000_digit_integer_names_its_line_and_column(tmp_path, column):
    rows = dict(time_us="0", alloc_id="0", nbytes="4096", stream="0")
    rows[column] = "9" * 5000  # past Python's 4,300-digit limit on int(): a ValueError of its own
    path = _csv(
        tmp_path,
        [
            "0,alloc,0,4096,0,",
            f"{rows['time_us']},alloc,{rows['alloc_id']},{rows['nbytes']},{rows['stream']},",
        ],
    )
    err = _error(read_table_csv, path)
    assert (err.line, err.reason.split()[0]) == (3, column)
    assert "5,000 characters" in err.reason and len(str(err)) < 300


def _pq(tmp_path, **override):
    cols = {
        "time_us": pa.array([0, 5], pa.int64()),
        "op": pa.array(["alloc", "free"]),
        "alloc_id": pa.array([0, 0], pa.int64()),
        "nbytes": pa.array([4096, 4096], pa.int64()),
        "stream": pa.array([0, 0], pa.int64()),
        "tag": pa.array(["", ""]),
    }
    cols.update(override)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table(cols), path)
    return path


@pytest.mark.parametrize(
    "column,array,kind",
    [
        ("nbytes", pa.array([True, True]), "bool"),
        ("time_us", pa.array([0, 5], pa.timestamp("us")), "timestamp"),
        ("time_us", pa.array([0, 5], pa.duration("us")), "duration"),
        ("alloc_id", pa.array(["0", "0"]), "string"),
    ],
    ids=["bool-nbytes", "timestamp-time", "duration-time", "text-ids"],
)
def test_parquet_column_of_the_wrong_kind_is_refused(tmp_path, column, array, kind):
    err = _error(read_table_parquet, _pq(tmp_path, **{column: array}))
    assert (
        err.reason.startswith(f"column {column} has type {kind}")
        and "expected integers" in err.reason
    )


def test_parquet_whole_floats_are_still_read(tmp_path):
    trace = read_table_parquet(_pq(tmp_path, nbytes=pa.array([4096.0, 4096.0])))
    assert list(trace.events["nbytes"]) == [4096, 4096]


def test_free_on_another_stream_than_its_allocation_names_its_line(tmp_path):
    err = _error(read_table_csv, _csv(tmp_path, ["0,alloc,0,100,0,", "5,free,0,100,1,"]))
    assert (err.line, err.reason) == (
        3,
        "free of allocation 0 on stream 1, but it was allocated on stream 0",
    )


def test_free_on_another_stream_in_parquet_names_its_record(tmp_path):
    err = _error(read_table_parquet, _pq(tmp_path, stream=pa.array([2, 0], pa.int64())))
    assert err.line == 2 and "allocated on stream 2" in err.reason
