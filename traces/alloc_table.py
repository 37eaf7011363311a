"""Our own event-table files: CSV (header = ``EVENT_COLUMNS``) and Parquet, reader and writer.

The columns and invariants are those of ``traces.events``. Errors name the file line (CSV: the
header is line 1) or the 1-based record number (Parquet). Allocation ids are renumbered
0..k-1 in allocation order on reading. Only the event table is written:
``AllocTrace.meta`` (segment tables and the like) does not travel through these files.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from traces.atomic import replacing_file
from traces.errors import TraceFormatError, shown
from traces.events import (
    ALLOC_OP,
    EMPTY_CACHE_OP,
    EVENT_COLUMNS,
    AllocTrace,
    make_events,
    validate_events,
)
from traces.source import TraceSource, open_source, trace_name

__all__ = [
    "CSV_FORMAT",
    "PARQUET_FORMAT",
    "read_table_csv",
    "read_table_parquet",
    "write_alloc_trace",
    "output_format",
]

CSV_FORMAT = "csv"
PARQUET_FORMAT = "parquet"
_INT_COLUMNS = ("time_us", "alloc_id", "nbytes", "stream")
_CSV_SUFFIXES = (".csv", ".csv.gz")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_LINE_RE = re.compile(r"line (\d+)")
_STRING_DTYPE = make_events([], [], [], []).dtypes["op"]
#: Longest cell an integer column may hold: int64 has 19 digits; "1.0e+18" and padding fit well
#: within.
_MAX_NUMBER_CHARS = 64


def output_format(path: str | Path) -> str:
    """``"csv"`` or ``"parquet"``, from the suffix of a table file to write; ValueError for any
    other.

    One rule for every table writer (allocation and request traces), so a command can check
    ``--out`` before doing any work.
    """
    name = Path(path).name.lower()
    if name.endswith(_CSV_SUFFIXES):
        return CSV_FORMAT
    if name.endswith(_PARQUET_SUFFIXES):
        return PARQUET_FORMAT
    raise ValueError(
        f"cannot tell the output format from {Path(path).name!r}: "
        f"use one of {', '.join(_CSV_SUFFIXES + _PARQUET_SUFFIXES)}"
    )


def write_alloc_trace(trace: AllocTrace | pd.DataFrame, path: str | Path) -> Path:
    """Write the event table as CSV (``.csv``, ``.csv.gz``) or Parquet (``.parquet``, ``.pq``), all
    or nothing."""
    path = Path(path)
    events = trace.events if isinstance(trace, AllocTrace) else trace
    events = events[EVENT_COLUMNS]
    fmt = output_format(path)
    with replacing_file(path) as tmp:
        if fmt == CSV_FORMAT:
            events.to_csv(
                tmp, index=False, compression="gzip" if path.name.lower().endswith(".gz") else None
            )
        else:
            events.to_parquet(tmp, index=False)
    return path


def read_table_csv(path: str | Path | TraceSource) -> AllocTrace:
    """Read our CSV (a file, any stream, or its ``TraceSource``); every row is checked (types, then
    ``validate_events``)."""
    src = open_source(path)
    path = src.path
    try:
        src.require_intact()
        # fast path: typed parse; any bad cell sends us to the slow path that finds its line
        with (
            warnings.catch_warnings()
        ):  # a cell past int64 ("1e30") warns before it raises; the slow path names it
            warnings.simplefilter("ignore", RuntimeWarning)
            df = pd.read_csv(
                src.stream(),
                dtype={c: np.int64 for c in _INT_COLUMNS} | {"op": str, "tag": str},
                keep_default_na=False,
                na_filter=False,
                skip_blank_lines=False,
            )
    except TraceFormatError as exc:
        _raise_csv_error(path, exc)
    except (ValueError, TypeError, OverflowError) as exc:
        if isinstance(exc, (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError)):
            _raise_csv_error(path, exc)
        df = _read_csv_slow(src)
    _check_header(path, list(df.columns))
    df = df[EVENT_COLUMNS]
    validate_events(df, str(path), line_offset=2)
    return AllocTrace(
        _canonical(df),
        name=trace_name(path, (".csv", ".parquet", ".pq")),
        source=str(path),
        format=CSV_FORMAT,
    )


def read_table_parquet(path: str | Path | TraceSource) -> AllocTrace:
    """Read our Parquet file (any stream, or its ``TraceSource``); errors name the 1-based record
    (row) number.

    The integer columns must be stored as integers (whole floats are accepted too): a boolean
    ``nbytes`` or a timestamp ``time_us`` is refused, not read as 1-byte allocations or nanoseconds.
    """
    src = open_source(path)
    path = src.path
    try:
        src.require_intact()
        table = pq.read_table(pa.BufferReader(src.data))
    except TraceFormatError as exc:
        raise TraceFormatError(path, None, f"not a readable Parquet file ({exc.reason})") from None
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(path, None, f"not a readable Parquet file ({exc})") from None
    missing = [c for c in EVENT_COLUMNS if c not in table.column_names]
    if missing:
        raise TraceFormatError(
            path,
            None,
            f"missing column(s) {', '.join(missing)}; expected {', '.join(EVENT_COLUMNS)}",
        )
    table = table.select(EVENT_COLUMNS)
    for col in ("op", "tag"):
        table = _as_string_column(table, col, path)
    for col in _INT_COLUMNS:
        _check_number_column(table, col, path)
    df = table.to_pandas()
    for col in _INT_COLUMNS:
        df[col] = _as_int(df[col], path, col, record_offset=1, unit="record")
    validate_events(df, str(path), line_offset=1, unit="record")
    return AllocTrace(
        _canonical(df),
        name=trace_name(path, (".csv", ".parquet", ".pq")),
        source=str(path),
        format=PARQUET_FORMAT,
    )


def _check_number_column(table: pa.Table, col: str, path: Path) -> None:
    """TraceFormatError unless ``col`` holds numbers: a bool, timestamp, duration or text column is
    no byte count."""
    arr_type = table.schema.field(col).type
    if pa.types.is_dictionary(arr_type):
        arr_type = arr_type.value_type
    if not (
        pa.types.is_integer(arr_type)
        or pa.types.is_floating(arr_type)
        or pa.types.is_null(arr_type)
    ):
        raise TraceFormatError(path, None, f"column {col} has type {arr_type}, expected integers")


def _as_string_column(table: pa.Table, col: str, path: Path) -> pa.Table:
    """``col`` as plain strings (dictionary-encoded is fine); a null ``op`` is an error, a null tag
    is ""."""
    arr = table.column(col)
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    if not (
        pa.types.is_string(arr.type)
        or pa.types.is_large_string(arr.type)
        or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(arr.type))
    ):
        raise TraceFormatError(path, None, f"column {col} has type {arr.type}, expected strings")
    if arr.null_count:
        if col == "op":
            k = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
            raise TraceFormatError(path, k + 1, "op is missing", unit="record")
        arr = arr.fill_null("")
    return table.set_column(table.column_names.index(col), col, arr)


def _read_csv_slow(src: TraceSource) -> pd.DataFrame:
    """Everything as text, then the first cell that is not an integer, with its line."""
    path = src.path
    try:
        df = pd.read_csv(
            src.stream(), dtype=str, keep_default_na=False, na_filter=False, skip_blank_lines=False
        )
    except (ValueError, UnicodeDecodeError) as exc:
        _raise_csv_error(path, exc)
    _check_header(path, list(df.columns))
    blank = (df == "").all(axis=1).to_numpy()
    if blank.any() and blank[-1]:  # blank lines at the end of the file are no rows
        df = df.iloc[: len(df) - int(np.argmin(blank[::-1]) if not blank.all() else len(df))]
    bad_rows = []
    for col in _INT_COLUMNS:
        try:
            df[col] = _as_int(df[col], path, col, record_offset=2, unit="line")
        except TraceFormatError as err:
            bad_rows.append(err)
    if bad_rows:
        raise min(bad_rows, key=lambda e: e.line)
    return df


def _as_int(col: pd.Series, path: Path, name: str, *, record_offset: int, unit: str) -> np.ndarray:
    if pd.api.types.is_integer_dtype(col.dtype) and not col.isna().any():
        return col.to_numpy(np.int64)
    if col.dtype == object or pd.api.types.is_string_dtype(col.dtype):
        # a cell of more digits than Python converts (4,300) is no int64 either; checked before
        # pandas sees it
        long = col.astype(str).str.len().to_numpy() > _MAX_NUMBER_CHARS
        if long.any():
            k = int(np.flatnonzero(long)[0])
            raise TraceFormatError(
                path,
                k + record_offset,
                f"{name} {shown(str(col.iloc[k]), 24)} "
                f"({len(str(col.iloc[k])):,} characters) is not an integer",
                unit=unit,
            )
    num = pd.to_numeric(col, errors="coerce").to_numpy(dtype=np.float64)
    bad = np.isnan(num) | (num != np.floor(num)) | (np.abs(num) >= 2.0**63)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        value = col.iloc[k]
        what = (
            "empty"
            if (isinstance(value, str) and not value) or pd.isna(value)
            else shown(value, 40)
        )
        # a whole number past int64 is an integer: say what is wrong with it
        problem = (
            "is out of the int64 range"
            if np.isfinite(num[k]) and num[k] == np.floor(num[k])
            else "is not an integer"
        )
        raise TraceFormatError(path, k + record_offset, f"{name} {what} {problem}", unit=unit)
    return pd.to_numeric(col).to_numpy(np.int64)


def _check_header(path: Path, columns: list[str]) -> None:
    missing = [c for c in EVENT_COLUMNS if c not in columns]
    if missing:
        raise TraceFormatError(
            path,
            1,
            f"header {shown(','.join(map(str, columns)))} lacks {', '.join(missing)} "
            f"(expected {','.join(EVENT_COLUMNS)})",
        )


def _raise_csv_error(path: Path, exc: Exception):
    if isinstance(exc, TraceFormatError):  # the source's: a damaged gzip stream
        raise TraceFormatError(path, None, exc.reason) from None
    if isinstance(exc, pd.errors.EmptyDataError):
        raise TraceFormatError(path, None, "empty file") from None
    if isinstance(exc, UnicodeDecodeError):
        raise TraceFormatError(path, None, f"not a text file ({exc})") from None
    m = _LINE_RE.search(str(exc))
    raise TraceFormatError(
        path, int(m.group(1)) if m else None, f"malformed CSV row ({exc})"
    ) from None


def _canonical(df: pd.DataFrame) -> pd.DataFrame:
    """Canonical dtypes (those of ``make_events``), a fresh 0..n-1 index, and allocation ids
    0..k-1 in allocation order, as every other reader numbers them (ids index per-allocation
    tables downstream: an id of 9e18 must not ask for an array that long). Validated tables only."""
    out = {c: df[c].to_numpy(np.int64) for c in _INT_COLUMNS}
    ids = out["alloc_id"]
    alloc_ids = ids[(df["op"] == ALLOC_OP).to_numpy(dtype=bool)]
    if not np.array_equal(alloc_ids, np.arange(alloc_ids.size)):
        out["alloc_id"] = ids = pd.Index(alloc_ids).get_indexer(ids).astype(np.int64)
    calls = (df["op"] == EMPTY_CACHE_OP).to_numpy(dtype=bool)
    if (
        calls.any()
    ):  # an empty_cache row names no allocation: its id and size are written as -1 and 0
        out["alloc_id"] = np.where(calls, -1, ids)
        out["nbytes"] = np.where(calls, 0, out["nbytes"])
    for c in ("op", "tag"):
        col = df[c].reset_index(drop=True)
        # already the default string dtype (Arrow-backed strings convert slowly through object)
        out[c] = col if col.dtype == _STRING_DTYPE else col.astype(object).astype(str)
    return pd.DataFrame(out)[EVENT_COLUMNS]
