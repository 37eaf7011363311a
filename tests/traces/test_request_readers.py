import gzip
import json
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.errors import TraceFormatError
from traces.request_readers import detect_request_format, read_request_trace, write_request_trace
from traces.requests import RequestTrace, make_requests, validate_requests

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces"
AZURE_CODE = DATA / "AzureLLMInferenceTrace_code.csv"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


AZURE_2023 = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.4799600,110,27
"""
AZURE_2024 = """TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-10 00:00:00.009930+00:00,374,44
2024-05-10 00:00:01+00:00,396,109
2024-05-10 00:00:02.509930+00:00,879,20
"""
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
118,ChatGPT,0,0,0,API log
140,ChatGPT,1360,215,1575,Conversation log
"""
MOONCAKE = (
    "\n".join(
        json.dumps(o)
        for o in [
            {
                "timestamp": 0,
                "input_length": 6955,
                "output_length": 52,
                "hash_ids": list(range(14)),
            },
            {
                "timestamp": 27482,
                "input_length": 6472,
                "output_length": 26,
                "hash_ids": list(range(12)) + [46, 47],
            },
            {"timestamp": 30535, "input_length": 600, "output_length": 31, "hash_ids": [48, 49]},
        ]
    )
    + "\n"
)
VIDUR = """arrived_at,num_prefill_tokens,num_decode_tokens
0.0,4808,10
0.052,3180,8
0.098189,110,27
"""


@pytest.mark.skipif(not AZURE_CODE.exists(), reason="shared Azure trace not present")
def test_real_azure_code_trace():
    tr = read_request_trace(AZURE_CODE)
    assert tr.format == "azure" and tr.name == "AzureLLMInferenceTrace_code"
    assert len(tr) == 8819  # field notes: 8,819 requests in 57 min
    assert tr.requests["prompt_tokens"].median() == 1469
    assert tr.requests["output_tokens"].median() == 13
    assert 56 * 60 < tr.duration_s < 58 * 60
    validate_requests(tr.requests)


def test_azure_2023_seven_digit_timestamps(tmp_path):
    tr = read_request_trace(_write(tmp_path, "a.csv", AZURE_2023))
    assert tr.format == "azure"
    assert tr.requests["arrival_s"].tolist() == pytest.approx([0.0, 0.052, 1.5])
    assert tr.meta["start_time"].startswith("2023-11-16T18:17:03.97996")


def test_azure_2024_offsets_and_missing_fraction(tmp_path):
    tr = read_request_trace(_write(tmp_path, "a24.csv", AZURE_2024))
    assert tr.requests["arrival_s"].tolist() == pytest.approx([0.0, 0.99007, 2.5])
    assert tr.requests["output_tokens"].tolist() == [44, 109, 20]


def test_burstgpt_drops_failed_requests_and_counts_them(tmp_path):
    tr = read_request_trace(_write(tmp_path, "b.csv", BURSTGPT))
    assert tr.format == "burstgpt"
    assert tr.requests["prompt_tokens"].tolist() == [472, 417, 1360]
    assert tr.requests["arrival_s"].tolist() == [0.0, 113.0, 135.0]
    assert tr.meta["num_dropped_zero_output"] == 2 and tr.meta["num_rows_read"] == 5


def test_burstgpt_session_column_when_present(tmp_path):
    text = (
        "Timestamp,Session ID,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "0,s1,ChatGPT,10,5,15,Conversation log\n1,,ChatGPT,11,6,17,API log\n"
    )
    tr = read_request_trace(_write(tmp_path, "b.csv", text))
    assert tr.requests["session_id"].tolist() == ["s1", ""]


def test_mooncake_ms_timestamps_and_hash_ids(tmp_path):
    tr = read_request_trace(_write(tmp_path, "m.jsonl", MOONCAKE))
    assert tr.format == "mooncake"
    assert tr.requests["arrival_s"].tolist() == [0.0, 27.482, 30.535]
    assert tr.requests["prompt_tokens"].tolist() == [6955, 6472, 600]
    assert tr.requests["hash_ids"].iloc[1][-2:] == (46, 47)
    assert tr.meta["hash_block_tokens"] == 512
    assert tr.describe()["num_unique_hash_blocks"] == 18  # 0..13, 46, 47, 48, 49


def test_vidur_splitwise_csv(tmp_path):
    tr = read_request_trace(_write(tmp_path, "v.csv", VIDUR))
    assert tr.format == "vidur"
    assert tr.requests["arrival_s"].tolist() == [0.0, 0.052, 0.098189]
    assert tr.requests["output_tokens"].tolist() == [10, 8, 27]


def _sample_trace() -> RequestTrace:
    df = make_requests(
        [0.0, 0.1 + 0.2, 7.25],
        [5, 600, 1025],
        [1, 2, 3],
        ["s, 1", "", "s, 1"],
        [(1, 2), (), (1, 2, 9)],
    )
    return RequestTrace(df, name="x", format="synth", meta={"seed": 3, "hash_block_tokens": 16})


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_our_formats_round_trip_exactly(tmp_path, suffix):
    tr = _sample_trace()
    back = read_request_trace(write_request_trace(tr, tmp_path / f"t{suffix}"))
    assert back.format == suffix[1:]
    pd.testing.assert_frame_equal(back.requests, tr.requests)


def test_session_ids_that_look_like_missing_values_survive(tmp_path):
    df = make_requests([0.0, 1.0, 2.0], [1, 1, 1], [1, 1, 1], ["NA", "null", ""])
    back = read_request_trace(write_request_trace(RequestTrace(df, name="x"), tmp_path / "s.csv"))
    assert back.requests["session_id"].tolist() == ["NA", "null", ""]


def test_parquet_keeps_meta(tmp_path):
    back = read_request_trace(write_request_trace(_sample_trace(), tmp_path / "t.parquet"))
    assert back.meta["seed"] == 3 and back.meta["hash_block_tokens"] == 16


@pytest.mark.parametrize(
    "text, fmt",
    [(MOONCAKE, "mooncake"), (AZURE_2023, "azure"), (VIDUR, "vidur"), (BURSTGPT, "burstgpt")],
)
def test_detection_ignores_misleading_suffix(tmp_path, text, fmt):
    assert detect_request_format(_write(tmp_path, "trace.parquet", text)) == fmt


def test_detects_parquet_named_csv(tmp_path):
    p = write_request_trace(_sample_trace(), tmp_path / "t.parquet")
    renamed = p.rename(tmp_path / "t.csv")
    assert read_request_trace(renamed).format == "parquet"


def test_reads_gzipped_text(tmp_path):
    p = tmp_path / "v.csv.gz"
    p.write_bytes(gzip.compress(VIDUR.encode()))
    tr = read_request_trace(p)
    assert tr.format == "vidur" and len(tr) == 3 and tr.name == "v"


def test_unsorted_rows_are_sorted(tmp_path):
    text = "arrived_at,num_prefill_tokens,num_decode_tokens\n5.0,1,1\n2.0,2,2\n7.0,3,3\n"
    tr = read_request_trace(_write(tmp_path, "v.csv", text))
    assert tr.requests["prompt_tokens"].tolist() == [2, 1, 3]
    assert tr.requests["arrival_s"].tolist() == [0.0, 3.0, 5.0]
    assert tr.meta["was_sorted"] is False


def _error(path: Path, **kw) -> TraceFormatError:
    with pytest.raises(TraceFormatError) as info:
        read_request_trace(path, **kw)
    return info.value


def test_non_numeric_tokens_name_the_line(tmp_path):
    text = VIDUR + "0.2,abc,5\n0.3,-4,5\n"
    err = _error(_write(tmp_path, "v.csv", text))
    assert err.line == 5 and "'abc' is not a number" in err.reason


def test_first_bad_line_wins_across_columns(tmp_path):
    text = "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n1,2,x\n2,-3,1\n"
    err = _error(_write(tmp_path, "v.csv", text))
    assert err.line == 3 and "num_decode_tokens" in err.reason


def test_error_line_is_the_original_line_of_unsorted_rows(tmp_path):
    text = "arrived_at,num_prefill_tokens,num_decode_tokens\n9,1,1\n1,2,2\n5,-3,1\n"
    err = _error(_write(tmp_path, "v.csv", text))
    assert err.line == 4 and "must not be negative" in err.reason


def test_blank_lines_do_not_shift_line_numbers(tmp_path):
    text = "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n\n\n1,2.5,1\n"
    err = _error(_write(tmp_path, "v.csv", text))
    assert err.line == 5 and "whole number" in err.reason


def test_missing_value_names_the_line(tmp_path):
    err = _error(_write(tmp_path, "v.csv", VIDUR + "0.3,12\n"))
    assert err.line == 5 and "missing value" in err.reason


def test_too_many_fields_names_the_line(tmp_path):
    err = _error(_write(tmp_path, "v.csv", VIDUR + "0.3,12,1,9\n"))
    assert err.line == 5


def test_bad_azure_timestamp_names_the_line(tmp_path):
    err = _error(_write(tmp_path, "a.csv", AZURE_2023 + "yesterday,1,1\n"))
    assert err.line == 5 and "not a date-time" in err.reason


def test_unknown_header_is_an_error_on_line_1(tmp_path):
    err = _error(_write(tmp_path, "x.csv", "time,in,out\n0,1,1\n"))
    assert err.line == 1 and "unrecognised" in err.reason


def test_forced_format_reports_missing_columns(tmp_path):
    err = _error(_write(tmp_path, "x.csv", VIDUR), format="azure")
    assert err.line == 1 and "TIMESTAMP" in err.reason


def test_empty_file_is_an_error(tmp_path):
    assert "empty" in _error(_write(tmp_path, "x.csv", "\n\n")).reason


def test_bad_json_names_the_line(tmp_path):
    lines = MOONCAKE.splitlines()
    text = "\n".join(lines[:2] + ['{"timestamp": 1, "input_length": 3,'] + lines[2:]) + "\n"
    err = _error(_write(tmp_path, "m.jsonl", text))
    assert err.line == 3 and "bad JSON" in err.reason


def test_mooncake_missing_key_names_the_line(tmp_path):
    text = MOONCAKE + json.dumps({"timestamp": 40000, "input_length": 5}) + "\n"
    err = _error(_write(tmp_path, "m.jsonl", text))
    assert err.line == 4 and "output_length" in err.reason


def test_mooncake_negative_length_is_an_error(tmp_path):
    text = (
        json.dumps({"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}) + "\n"
    )
    err = _error(_write(tmp_path, "m.jsonl", text))
    assert err.line == 1 and "negative" in err.reason


def test_our_csv_rejects_zero_tokens(tmp_path):
    text = "arrival_s,prompt_tokens,output_tokens\n0,1,1\n1,0,1\n"
    err = _error(_write(tmp_path, "o.csv", text))
    assert err.line == 3 and ">= 1" in err.reason


def test_our_csv_rejects_bad_hash_ids(tmp_path):
    text = "arrival_s,prompt_tokens,output_tokens,hash_ids\n0,1,1,1 2\n1,5,1,3 x\n"
    err = _error(_write(tmp_path, "o.csv", text))
    assert err.line == 3 and "hash_ids" in err.reason


def test_parquet_errors_name_the_row(tmp_path):
    p = tmp_path / "bad.parquet"
    pd.DataFrame(
        {"arrival_s": [0.0, 1.0], "prompt_tokens": [1, -1], "output_tokens": [1, 1]}
    ).to_parquet(p)
    err = _error(p)
    assert err.line == 2 and "(row 2)" in str(err)


def test_error_message_has_file_line_and_reason(tmp_path):
    p = _write(tmp_path, "v.csv", VIDUR + "0.2,abc,5\n")
    with pytest.raises(
        TraceFormatError, match=r"v\.csv:5: num_prefill_tokens 'abc' is not a number"
    ):
        read_request_trace(p)


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_request_trace(tmp_path / "nope.csv")


_requests = st.lists(
    st.tuples(
        st.floats(0, 1e7, allow_nan=False),
        st.integers(1, 10**6),
        st.integers(1, 10**5),
        st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=8),
        st.lists(st.integers(0, 2**62), max_size=4),
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=40, deadline=None)
@given(_requests, st.sampled_from(["csv", "parquet"]))
def test_any_trace_round_trips(rows, fmt):
    t, prompt, output, sessions, hashes = zip(*rows)
    tr = RequestTrace(make_requests(t, prompt, output, sessions, hashes), name="h")
    with tempfile.TemporaryDirectory() as d:
        back = read_request_trace(write_request_trace(tr, Path(d) / f"h.{fmt}"))
    pd.testing.assert_frame_equal(back.requests, tr.requests)


# -- hostile numbers and shapes (issue 29): one line naming file, line and field; never a traceback

_HUGE = "9" * 400  # past float64: pandas fails the whole column, float() on the int overflows
_HUGER = "9" * 5000  # past Python's int-string digit limit


@pytest.mark.parametrize(
    "digits, where",
    [
        (_HUGE, "arrival_s"),
        (_HUGE, "prompt_tokens"),
        (_HUGER, "output_tokens"),
        ("-" + _HUGE, "prompt_tokens"),
    ],
    ids=["time-400-digits", "prompt-400-digits", "output-5000-digits", "prompt-minus-400-digits"],
)
def test_csv_numbers_too_long_for_a_float_are_out_of_range(tmp_path, digits, where):
    row = {"arrival_s": "1", "prompt_tokens": "3", "output_tokens": "4", where: digits}
    text = "arrival_s,prompt_tokens,output_tokens\n0,1,1\n" + ",".join(row.values()) + "\n"
    err = _error(_write(tmp_path, "o.csv", text))
    assert err.line == 3 and err.reason.startswith(where)
    assert (
        "negative"
        if digits.startswith("-")
        else "more than"
        if where != "arrival_s"
        else "later than"
    ) in err.reason
    assert (
        "characters)" in err.reason and len(err.reason) < 120
    )  # the value is cut short, not repeated whole


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("input_length", _HUGE, "more than"),
        ("timestamp", _HUGE, "later than"),
        ("output_length", _HUGER, "digits"),
        ("input_length", "true", "not a number"),
    ],
    ids=["input-400-digits", "timestamp-400-digits", "output-5000-digits", "input-true"],
)
def test_mooncake_numbers_too_long_or_boolean(tmp_path, field, value, why):
    line = {"timestamp": "0", "input_length": "3", "output_length": "5", field: value}
    text = MOONCAKE + "{" + ", ".join(f'"{k}": {v}' for k, v in line.items()) + "}\n"
    err = _error(_write(tmp_path, "m.jsonl", text))
    assert err.line == 4 and why in err.reason and len(err.reason) < 120


def test_boolean_token_columns_are_not_numbers(tmp_path):
    err = _error(
        _write(tmp_path, "o.csv", "arrival_s,prompt_tokens,output_tokens\n0,True,1\n1,False,1\n")
    )
    assert err.line == 2 and "prompt_tokens True is a boolean" in err.reason
    p = tmp_path / "b.parquet"
    pd.DataFrame(
        {"arrival_s": [0.0, 1.0], "prompt_tokens": [4, 5], "output_tokens": [True, True]}
    ).to_parquet(p)
    err = _error(p)
    assert err.line == 1 and "output_tokens True is a boolean" in err.reason


def test_parquet_time_column_of_date_times_is_not_seconds(tmp_path):
    p = tmp_path / "t.parquet"
    pd.DataFrame(
        {
            "arrival_s": pd.to_datetime(["2023-01-01", "2023-01-02"]),
            "prompt_tokens": [4, 5],
            "output_tokens": [1, 1],
        }
    ).to_parquet(p)
    assert "not a number" in _error(p).reason


@pytest.mark.parametrize("hash_ids", [["123", "4"], [[1.0, 2.5], [3.0]], [[True], [False]]])
def test_parquet_hash_ids_must_be_lists_of_ints(tmp_path, hash_ids):
    """A string "123" used to read as (1, 2, 3) and floats were truncated."""
    p = tmp_path / "h.parquet"
    pd.DataFrame(
        {
            "arrival_s": [0.0, 1.0],
            "prompt_tokens": [4, 5],
            "output_tokens": [1, 1],
            "hash_ids": hash_ids,
        }
    ).to_parquet(p)
    err = _error(p)
    assert err.line == 1 and "hash_ids" in err.reason and "64-bit integers" in err.reason


def test_mooncake_hash_ids_as_a_string_is_named_as_one(tmp_path):
    text = (
        json.dumps({"timestamp": 0, "input_length": 3, "output_length": 5, "hash_ids": "123"})
        + "\n"
    )
    assert "hash_ids '123' is not a list" in _error(_write(tmp_path, "m.jsonl", text)).reason


def test_azure_date_years_away_is_refused(tmp_path):
    """Six fractional digits read at microsecond precision, so a year-9999 date parses: an
    8,000-year trace."""
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.979960,3,5\n"
        "9999-11-16 18:17:03.979960,3,5\n"
    )
    err = _error(_write(tmp_path, "a.csv", text))
    assert err.line == 3 and "7,976 years after the first request" in err.reason


def test_azure_date_beyond_nanosecond_range_is_named_as_such(tmp_path):
    err = _error(_write(tmp_path, "a.csv", AZURE_2023 + "9999-11-16 18:17:03.9799600,3,5\n"))
    assert err.line == 5 and "lies outside 1677-09-21 to 2262-04-11" in err.reason


def test_mooncake_deeply_nested_json_is_refused_before_parsing(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    text = (
        MOONCAKE
        + '{"timestamp": 9, "input_length": 3, "output_length": 5, "extra": '
        + deep
        + "}\n"
    )
    err = _error(_write(tmp_path, "m.jsonl", text))
    assert err.line == 4 and "nested 100,001 levels deep" in err.reason


def test_mooncake_brackets_inside_strings_do_not_count_as_nesting(tmp_path):
    text = (
        json.dumps({"timestamp": 0, "input_length": 3, "output_length": 5, "note": "[{" * 50})
        + "\n"
    )
    assert len(read_request_trace(_write(tmp_path, "m.jsonl", text))) == 1


def test_validate_requests_holds_the_limits_readers_apply():
    from traces.requests import MAX_TOKENS

    df = make_requests([0.0, 1.0], [3, MAX_TOKENS + 1], [1, 1])
    with pytest.raises(
        TraceFormatError, match="prompt_tokens 2147483648 is more than 2,147,483,647 tokens"
    ):
        validate_requests(df)
    with pytest.raises(TraceFormatError, match="later than 1e\\+11 s"):
        validate_requests(make_requests([0.0, 2e11], [3, 3], [1, 1]))


@pytest.mark.parametrize(
    "stored",
    [b"[" * 50_000 + b"]" * 50_000, b'{"meta": ', b'{"meta": [1]}'],
    ids=["deep", "broken", "meta-not-object"],
)
def test_parquet_with_damaged_stored_meta_names_the_file(tmp_path, stored):
    import pyarrow.parquet as pq

    p = write_request_trace(_sample_trace(), tmp_path / "t.parquet")
    table = pq.read_table(p)
    pq.write_table(
        table.replace_schema_metadata({**table.schema.metadata, b"poollab.request_trace": stored}),
        p,
    )
    err = _error(p)
    assert err.path == str(p) and "damaged poollab.request_trace metadata" in err.reason
