"""Read request traces in the formats people publish, detected from content; write our own.

=========  ============================================================  =====================
format     what identifies it (header line, first JSON object, magic)     times
=========  ============================================================  =====================
azure      CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (2023, 2024)   date-times
burstgpt   CSV ``Timestamp,...,Request tokens,Response tokens,...``       seconds
mooncake   JSON lines ``{"timestamp", "input_length", "output_length",   milliseconds
           "hash_ids"}`` (hash ids name 512-token prompt blocks)
vidur      CSV ``arrived_at,num_prefill_tokens,num_decode_tokens``        seconds
csv        ours: ``arrival_s,prompt_tokens,output_tokens[,session_id,     seconds
           hash_ids]`` (hash ids space-separated)
parquet    ours, same columns (``PAR1`` magic); keeps ``meta``            seconds
=========  ============================================================  =====================

Rows may come in any time order (they are sorted; errors still name the original line). A
request with 0 prompt or 0 output tokens in a published trace (BurstGPT logs failed requests
that way) is dropped and counted in ``meta["num_dropped_zero_output"]`` /
``meta["num_dropped_zero_prompt"]``; in our own formats it is an error. Anything else that is
wrong (a missing column or value, a non-number, a negative, bad JSON) raises
``TraceFormatError(path, line, reason)`` naming the first bad line. Gzipped text files are read
as they are.

Every value is checked before use, against the limits of the request table
(``traces.requests.MAX_TOKENS``, ``MAX_TIME_S``; generators hold the same ones): a count or time
too long for a float (400 digits) is out of range, a boolean is not a number, a span of
date-times longer than ``MAX_TIME_S`` is refused, hash ids are lists of int64, and JSON may
nest at most ``MAX_JSON_DEPTH`` levels (checked before parsing). Values in messages are cut short.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from traces.alloc_table import output_format
from traces.atomic import replacing_file
from traces.errors import TraceFormatError
from traces.formats import HEAD_BYTES, REQUEST
from traces.requests import (
    MAX_TIME_S,
    MAX_TOKENS,
    REQUEST_COLUMNS,
    RequestTrace,
    make_requests,
    validate_requests,
)
from traces.source import TraceSource, open_source

__all__ = ["REQUEST_FORMATS", "read_request_trace", "write_request_trace", "detect_request_format"]

#: Block size of Mooncake hash ids, and the default for a trace that does not say.
DEFAULT_HASH_BLOCK_TOKENS = 512
_PARQUET_META_KEY = b"poollab.request_trace"
# pandas 3 parses floats exactly by default; pandas 2 needs asking (and 3 warns if asked)
_EXACT_FLOATS = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}


@dataclass(frozen=True)
class _CsvLayout:
    format: str
    time_col: str
    prompt_col: str
    output_col: str
    time_is_datetime: bool = False
    session_col: str | None = None
    hash_col: str | None = None
    ours: bool = False  # our own format: zero tokens are an error, not a dropped failure


_CSV_LAYOUTS = (
    _CsvLayout("azure", "TIMESTAMP", "ContextTokens", "GeneratedTokens", time_is_datetime=True),
    _CsvLayout(
        "burstgpt", "Timestamp", "Request tokens", "Response tokens", session_col="Session ID"
    ),
    _CsvLayout("vidur", "arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    _CsvLayout(
        "csv",
        "arrival_s",
        "prompt_tokens",
        "output_tokens",
        session_col="session_id",
        hash_col="hash_ids",
        ours=True,
    ),
)
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
#: Deepest JSON nesting a Mooncake line may have (a published line is 2 deep: an object holding a
#: list). Python's json recurses once per level and fails near 1,000, so depth is checked first.
MAX_JSON_DEPTH = 32
_INT64_LIMIT = 2**63
#: A whole number of this many digits is past float64 (1.8e308): pandas refuses the whole column
#: ("int too large to convert to float") or gives NaN; such a cell reads as +-_FLOAT_MAX instead,
#: so the range checks name it as too large.
_LONG_INT_RE = r"\s*[+-]?\d{309,}\s*"
_FLOAT_MAX = float(np.finfo(np.float64).max)
_SECONDS_PER_YEAR = 365.25 * 86400
#: The built-in formats (``traces.formats.REQUEST.names()`` lists third-party ones too).
REQUEST_FORMATS = tuple(lay.format for lay in _CSV_LAYOUTS) + ("mooncake", "parquet")


def read_request_trace(
    path: str | Path | TraceSource, *, format: str | None = None, name: str | None = None
) -> RequestTrace:
    """Read a request trace, detecting the format from the content unless ``format`` is given.

    Args:
        path: the file (plain or gzipped text, or Parquet), or its ``TraceSource``.
        format: a registered format's name (``traces.formats.REQUEST``) to skip detection.
        name: name for reports; the file stem by default.

    Raises:
        TraceFormatError: unknown format, or the first malformed line and why.
    """
    if format is not None:
        REQUEST.get(format, path)  # an unknown name first, before the file is opened
    src = open_source(path)  # read once: detection and the reader see the same bytes (a pipe too)
    return REQUEST.read(src, format=format, name=name or _trace_name(src.path))


def detect_request_format(path: str | Path | TraceSource) -> str:
    """The format name of a request-trace file, from its content (the suffix is not looked at)."""
    return REQUEST.detect(path)


def _trace_name(path: object) -> str:
    return Path(Path(str(path)).name.removesuffix(".gz")).stem


def _sniff(src: TraceSource) -> tuple[list[str], str]:
    """``(header columns, first non-blank line)`` of a text file."""
    text = src.head(HEAD_BYTES).decode("utf-8", errors="replace").lstrip("\ufeff")
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    return [c.strip() for c in next(csv.reader([first]), [])], first


def _is_parquet(src: TraceSource) -> bool:
    return not src.gzipped and src.head(4) == b"PAR1"


def _has_request_columns(src: TraceSource) -> bool:
    import pyarrow.parquet as pq

    return set(pq.read_schema(src.stream()).names) >= {
        "arrival_s",
        "prompt_tokens",
        "output_tokens",
    }


def _register_builtins() -> None:
    """The built-in formats, in the order their sniffers are asked (their contents exclude each
    other; a CSV header is matched to the first layout whose columns it has)."""
    for lay in _CSV_LAYOUTS:
        REQUEST.register(
            lay.format,
            replace=True,
            sniff=lambda src, lay=lay: (
                not _is_parquet(src)
                and {lay.time_col, lay.prompt_col, lay.output_col} <= set(_sniff(src)[0])
            ),
            read=lambda src, name=None, lay=lay, **_: _read_csv(
                src, name or _trace_name(src.path), lay, _sniff(src)[0]
            ),
            describe=f"columns of {lay.format}: {lay.time_col},{lay.prompt_col},{lay.output_col}",
        )
    REQUEST.register(
        "mooncake",
        replace=True,
        sniff=lambda src: not _is_parquet(src) and _sniff(src)[1].lstrip().startswith("{"),
        read=lambda src, name=None, **_: _read_mooncake(src, name or _trace_name(src.path)),
        describe="Mooncake JSON lines",
    )
    REQUEST.register(
        "parquet",
        replace=True,
        sniff=_is_parquet,
        confirm=_has_request_columns,
        read=lambda src, name=None, **_: _read_parquet(src, name or _trace_name(src.path)),
        describe="Parquet",
    )


# ---------------------------------------------------------------------------------------------
# CSV formats


def _row_to_line(src: TraceSource, rows: list[int]) -> dict[int, int]:
    """File line of each data row: pandas skips blank lines, so count only non-blank ones."""
    wanted, found = set(rows), {}
    with io.TextIOWrapper(src.stream(), encoding="utf-8", errors="replace") as f:
        row = -1  # the header is the first non-blank line
        for lineno, line in enumerate(f, 1):
            if line.strip():
                if row in wanted:
                    found[row] = lineno
                    if len(found) == len(wanted):
                        break
                row += 1
    return found


class _Problems:
    """The first bad row of each check; the smallest row wins, as the file is read top-down."""

    def __init__(self) -> None:
        self.first: list[tuple[int, str]] = []

    def add(self, mask: np.ndarray, reason: Callable[[int], str]) -> None:
        bad = np.flatnonzero(mask)
        if bad.size:
            self.first.append((int(bad[0]), reason(int(bad[0]))))

    def raise_first(self, path: Path, to_line: Callable[[int], int], unit: str = "line") -> None:
        if self.first:
            row, reason = min(self.first)
            raise TraceFormatError(path, to_line(row), reason, unit=unit)


def _show(value: Any, limit: int = 40) -> str:
    """A value for an error message: strings quoted; a long one (a 400-digit number) cut short."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        head = repr(text[: limit // 2]) if isinstance(value, str) else text[: limit // 2]
        return f"{head}... ({len(text):,} characters)"
    return repr(value) if isinstance(value, str) else text


def _floats(col: pd.Series) -> np.ndarray:
    """A non-integer column as float64: NaN where a cell is no number, +-_FLOAT_MAX where it is a
    whole number too long for a float (pandas fails on the column or gives NaN there)."""
    try:
        v = pd.to_numeric(col, errors="coerce").to_numpy(np.float64)
    except (
        OverflowError,
        ValueError,
    ):  # "int too large to convert to float": one cell fails the column
        v = None
    if v is not None and (pd.api.types.is_float_dtype(col.dtype) or not np.isnan(v).any()):
        return v
    text = col.astype(object).where(col.notna(), "").astype(str)
    long_int = text.str.fullmatch(_LONG_INT_RE).to_numpy(bool)
    if v is None:
        v = pd.to_numeric(col.where(~long_int), errors="coerce").to_numpy(np.float64)
    negative = text.str.lstrip().str.startswith("-").to_numpy(bool)
    v = v.copy()  # pandas may hand out a read-only view
    v[long_int] = np.where(negative[long_int], -_FLOAT_MAX, _FLOAT_MAX)
    return v


def _is_bool(col: pd.Series) -> np.ndarray:
    """Cells that are booleans: a bool column (CSV "True"/"False", Parquet bool), or bools among
    objects."""
    if pd.api.types.is_bool_dtype(col.dtype):
        return np.ones(len(col), dtype=bool)
    if col.dtype == object:
        return np.fromiter(
            (type(x) is bool or isinstance(x, np.bool_) for x in col), dtype=bool, count=len(col)
        )
    return np.zeros(len(col), dtype=bool)


def _numbers(col: pd.Series, label: str, problems: _Problems, *, integer: bool) -> np.ndarray:
    """A column as float64, logging missing, non-numeric (booleans and date-times too), non-finite,
    negative, fractional and out-of-range values."""
    if pd.api.types.is_integer_dtype(col.dtype):
        v = col.to_numpy(np.float64)
    elif pd.api.types.is_datetime64_any_dtype(col.dtype) or pd.api.types.is_timedelta64_dtype(
        col.dtype
    ):
        problems.add(
            np.ones(len(col), dtype=bool),
            lambda i: f"{label} {_show(col.iloc[i])} is a {col.dtype} value, not a number",
        )
        return np.zeros(len(col))
    else:
        boolean = _is_bool(col)
        problems.add(boolean, lambda i: f"{label} {_show(col.iloc[i])} is a boolean, not a number")
        v = _floats(col.astype(object).where(~boolean) if boolean.any() else col)
        missing = col.isna().to_numpy()
        problems.add(missing, lambda i: f"missing value in column {label!r}")
        problems.add(
            np.isnan(v) & ~missing & ~boolean,
            lambda i: f"{label} {_show(col.iloc[i])} is not a number",
        )
    problems.add(np.isinf(v), lambda i: f"{label} {_show(col.iloc[i])} is not a finite number")
    problems.add(v < 0, lambda i: f"{label} {_show(col.iloc[i])} must not be negative")
    if integer:
        problems.add(
            np.isfinite(v) & (v != np.floor(v)),
            lambda i: f"{label} {_show(col.iloc[i])} is not a whole number of tokens",
        )
        problems.add(
            np.isfinite(v) & (v > MAX_TOKENS),
            lambda i: f"{label} {_show(col.iloc[i])} is more than {MAX_TOKENS:,} tokens",
        )
    else:
        problems.add(
            np.isfinite(v) & (v > MAX_TIME_S),
            lambda i: f"{label} {_show(col.iloc[i])} is later than {MAX_TIME_S:g} s",
        )
    return v


def _datetimes_s(col: pd.Series, label: str, problems: _Problems) -> tuple[np.ndarray, str]:
    """Date-time strings (7 fractional digits, or an offset, as Azure writes them) to seconds since
    the earliest; a span longer than ``MAX_TIME_S`` (a year-9999 date in a 2023 trace) is an
    error."""
    ts = pd.to_datetime(col, format="ISO8601", utc=True, errors="coerce")
    bad = ts.isna().to_numpy()
    problems.add(bad, lambda i: _not_a_datetime(label, col.iloc[i]))
    if bad.all():
        return np.full(len(col), np.nan), ""
    start = ts.min()
    t = (ts - start).dt.total_seconds().to_numpy(np.float64)
    problems.add(
        t > MAX_TIME_S,
        lambda i: (
            f"{label} {_show(col.iloc[i])} is {t[i] / _SECONDS_PER_YEAR:,.0f} years after "
            f"the first request ({start.isoformat()}); a trace spans at most {MAX_TIME_S:g} s"
        ),
    )
    return t, start.isoformat()


def _not_a_datetime(label: str, value: Any) -> str:
    """Why pandas read no date-time: none there, or one it cannot hold at the column's precision."""
    try:
        datetime.fromisoformat(str(value).strip())
    except ValueError:
        return f"{label} {_show(value)} is not a date-time (like 2023-11-16 18:17:03.9799600)"
    lo, hi = pd.Timestamp.min.date(), pd.Timestamp.max.date()
    return (
        f"{label} {_show(value)} lies outside {lo} to {hi}, "
        "the dates a trace of 100 ns (7-digit) times can hold"
    )


def _parse_hash_ids(col: pd.Series, problems: _Problems) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    bad = np.zeros(len(col), dtype=bool)
    for i, text in enumerate(col.fillna("").astype(str)):
        try:
            out.append(_hash_ids(int(x) for x in text.split()))
        except ValueError:
            bad[i] = True
            out.append(())
    problems.add(
        bad,
        lambda i: f"hash_ids {_show(col.iloc[i])} is not a space-separated list of 64-bit integers",
    )
    return out


def _hash_ids(ids) -> tuple[int, ...]:
    """Ints as a tuple; ValueError unless each is an int that fits int64 (they are stored as
    int64)."""
    out = tuple(ids)
    if not all(type(i) is int and -_INT64_LIMIT <= i < _INT64_LIMIT for i in out):
        raise ValueError("hash ids are 64-bit integers")
    return out


def _read_csv(src: TraceSource, name: str, layout: _CsvLayout, header: list[str]) -> RequestTrace:
    path = src.path
    missing = [
        c for c in (layout.time_col, layout.prompt_col, layout.output_col) if c not in header
    ]
    if missing:
        raise TraceFormatError(
            path,
            1,
            f"missing column(s) {', '.join(map(repr, missing))} for format {layout.format!r}",
        )
    optional = [c for c in (layout.session_col, layout.hash_col) if c and c in header]
    text_cols = optional + ([layout.time_col] if layout.time_is_datetime else [])
    try:
        # all columns, not usecols: with usecols pandas lets a row with extra fields pass
        # only an empty field is missing: a session id may well be "NA" or "null"
        src.require_intact()
        df = pd.read_csv(
            src.stream(),
            dtype={c: str for c in text_cols},
            keep_default_na=False,
            na_values={c: [""] for c in header},
            encoding="utf-8-sig",
            **_EXACT_FLOATS,
        )
    except pd.errors.ParserError as exc:  # "... Expected 3 fields in line 6, saw 4"
        m = re.search(r"line (\d+)", str(exc))
        raise TraceFormatError(
            path, int(m.group(1)) if m else None, f"cannot parse CSV: {str(exc).split(': ')[-1]}"
        ) from None
    except (TraceFormatError, UnicodeDecodeError) as exc:
        raise TraceFormatError(
            path, None, f"cannot read CSV: {getattr(exc, 'reason', exc)}"
        ) from None
    df.columns = [str(c).strip() for c in df.columns]  # detection strips header names too
    problems = _Problems()
    meta: dict[str, Any] = {"num_rows_read": len(df)}
    if layout.time_is_datetime:
        t, meta["start_time"] = _datetimes_s(df[layout.time_col], layout.time_col, problems)
    else:
        t = _numbers(df[layout.time_col], layout.time_col, problems, integer=False)
    prompt = _numbers(df[layout.prompt_col], layout.prompt_col, problems, integer=True)
    output = _numbers(df[layout.output_col], layout.output_col, problems, integer=True)
    sessions = (
        df[layout.session_col].fillna("").astype(str).to_numpy(object)
        if layout.session_col in optional
        else None
    )
    hashes = _parse_hash_ids(df[layout.hash_col], problems) if layout.hash_col in optional else None
    if layout.ours:
        problems.add(prompt == 0, lambda i: f"{layout.prompt_col} 0 must be >= 1")
        problems.add(output == 0, lambda i: f"{layout.output_col} 0 must be >= 1")
    if problems.first:
        rows = [row for row, _ in problems.first]
        lines = _row_to_line(src, rows)
        problems.raise_first(path, lambda row: lines.get(row, row + 2))
    trace = _finish(path, name, layout.format, t, prompt, output, sessions, hashes, meta)
    if layout.ours:
        trace.meta.setdefault("hash_block_tokens", DEFAULT_HASH_BLOCK_TOKENS)
    return trace


def _finish(
    path: Path,
    name: str,
    fmt: str,
    t: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    sessions: np.ndarray | None,
    hashes: list | None,
    meta: dict[str, Any],
) -> RequestTrace:
    """Drop zero-token requests (counted), sort by arrival, rebase, validate."""
    zero_out, zero_prompt = output == 0, (prompt == 0) & (output != 0)
    keep = ~(zero_out | zero_prompt)
    meta.update(
        num_dropped_zero_output=int(zero_out.sum()),
        num_dropped_zero_prompt=int(zero_prompt.sum()),
        was_sorted=bool(np.all(np.diff(t) >= 0)),
    )
    if not keep.all():
        t, prompt, output = t[keep], prompt[keep], output[keep]
        sessions = None if sessions is None else sessions[keep]
        hashes = None if hashes is None else [h for h, k in zip(hashes, keep) if k]
    df = make_requests(t, prompt.astype(np.int64), output.astype(np.int64), sessions, hashes)
    validate_requests(df, str(path))
    return RequestTrace(df, name=name, source=str(path), format=fmt, meta=meta)


# ---------------------------------------------------------------------------------------------
# Mooncake JSON lines


def _read_mooncake(src: TraceSource, name: str) -> RequestTrace:
    path = src.path
    t, prompt, output, hashes = [], [], [], []
    lineno = 0
    for lineno, raw in enumerate(src.stream(), 1):
        if src.damage is not None and not raw.endswith(b"\n"):
            break  # the line the damaged gzip stream cut
        _mooncake_line(path, lineno, raw, t, prompt, output, hashes)
    else:
        lineno += 1
    if (
        src.damage is not None
    ):  # every whole line that decompressed was good: the damage is where they end
        raise TraceFormatError(path, lineno, src.damage)
    meta = {"num_rows_read": len(t), "hash_block_tokens": DEFAULT_HASH_BLOCK_TOKENS}
    return _finish(
        path,
        name,
        "mooncake",
        np.asarray(t, np.float64),
        np.asarray(prompt, np.int64),
        np.asarray(output, np.int64),
        None,
        hashes,
        meta,
    )


def _mooncake_line(
    path: Path, lineno: int, raw: bytes, t: list, prompt: list, output: list, hashes: list
) -> None:
    """Check one JSON line and append its request to the columns (a blank line adds nothing)."""
    try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            path, lineno, f"not UTF-8 text (byte {exc.start} of the line)"
        ) from None
    if not line.strip():
        return
    # str.count is C-fast: only a line with many brackets is scanned for its depth
    if line.count("[") + line.count("{") > MAX_JSON_DEPTH and _json_depth(line) > MAX_JSON_DEPTH:
        raise TraceFormatError(
            path,
            lineno,
            f"JSON nested {_json_depth(line):,} levels deep; "
            f"a Mooncake line may nest at most {MAX_JSON_DEPTH} (it is an object holding a list)",
        )
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, lineno, f"bad JSON: {exc.msg} at column {exc.colno}") from None
    except (
        ValueError
    ):  # the one other: an integer longer than Python converts (sys.get_int_max_str_digits)
        raise TraceFormatError(
            path, lineno, f"a number of more than {sys.get_int_max_str_digits():,} digits"
        ) from None
    if not isinstance(obj, dict):
        raise TraceFormatError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    for key in _MOONCAKE_KEYS:
        value = obj.get(key)
        if key not in obj:
            raise TraceFormatError(
                path,
                lineno,
                f"missing key {key!r} (Mooncake lines have {', '.join(_MOONCAKE_KEYS)}, hash_ids)",
            )
        # ints are compared as ints (exact): a 400-digit one has no float, and would overflow
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))
        ):
            raise TraceFormatError(path, lineno, f"{key} {_show(value)} is not a number")
        if value < 0:
            raise TraceFormatError(path, lineno, f"{key} {_show(value)} must not be negative")
        if key == "timestamp":
            if value > MAX_TIME_S * 1000.0:  # Mooncake timestamps are milliseconds
                raise TraceFormatError(
                    path, lineno, f"timestamp {_show(value)} ms is later than {MAX_TIME_S:g} s"
                )
        elif value > MAX_TOKENS:
            raise TraceFormatError(
                path, lineno, f"{key} {_show(value)} is more than {MAX_TOKENS:,} tokens"
            )
        elif value != int(value):
            raise TraceFormatError(path, lineno, f"{key} {value!r} is not a whole number of tokens")
    try:
        raw_ids = obj.get("hash_ids", [])
        ids = _hash_ids(raw_ids if isinstance(raw_ids, list) else None)
    except (TypeError, ValueError):
        raise TraceFormatError(
            path,
            lineno,
            f"hash_ids {_show(obj.get('hash_ids'), 80)} is not a list of 64-bit integers",
        ) from None
    t.append(obj["timestamp"] / 1000.0)
    prompt.append(int(obj["input_length"]))
    output.append(int(obj["output_length"]))
    hashes.append(ids)


_JSON_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET_RE = re.compile(r"[\[\]{}]")


def _json_depth(text: str) -> int:
    """How deep ``[`` and ``{`` nest in a JSON text, brackets inside strings not counted."""
    depth = deepest = 0
    for ch in _JSON_BRACKET_RE.findall(_JSON_STRING_RE.sub("", text)):
        depth += 1 if ch in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


# ---------------------------------------------------------------------------------------------
# Parquet (ours) and the writer


def _read_parquet(src: TraceSource, name: str) -> RequestTrace:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = src.path
    try:
        table = pq.read_table(pa.BufferReader(src.data))
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise TraceFormatError(path, None, f"cannot read Parquet: {exc}") from None
    stored = _stored_meta(path, (table.schema.metadata or {}).get(_PARQUET_META_KEY, b"{}"))
    df = table.to_pandas()
    layout = _CSV_LAYOUTS[-1]
    missing = [
        c for c in (layout.time_col, layout.prompt_col, layout.output_col) if c not in df.columns
    ]
    if missing:
        raise TraceFormatError(
            path,
            None,
            f"missing column(s) {', '.join(map(repr, missing))}; "
            f"expected {', '.join(REQUEST_COLUMNS)}",
        )
    problems = _Problems()
    t = _numbers(df["arrival_s"], "arrival_s", problems, integer=False)
    prompt = _numbers(df["prompt_tokens"], "prompt_tokens", problems, integer=True)
    output = _numbers(df["output_tokens"], "output_tokens", problems, integer=True)
    problems.add(prompt == 0, lambda i: "prompt_tokens 0 must be >= 1")
    problems.add(output == 0, lambda i: "output_tokens 0 must be >= 1")
    problems.raise_first(path, lambda row: row + 1, unit="row")
    sessions = (
        df["session_id"].fillna("").astype(str).to_numpy(object) if "session_id" in df else None
    )
    hashes = None
    if "hash_ids" in df:
        hashes = []
        for row, h in enumerate(df["hash_ids"]):
            # a list<int64> column reads as int arrays; a string "123" or floats are not hash ids
            try:
                if h is not None and not isinstance(h, (list, np.ndarray)):
                    raise TypeError
                hashes.append(
                    () if h is None else _hash_ids(h.tolist() if isinstance(h, np.ndarray) else h)
                )
            except (TypeError, ValueError):
                shown = h.tolist() if isinstance(h, np.ndarray) else h
                raise TraceFormatError(
                    path,
                    row + 1,
                    f"hash_ids {_show(shown, 80)} is not a list of 64-bit integers",
                    unit="row",
                ) from None
    meta = {**stored.get("meta", {}), "num_rows_read": len(df)}
    meta.setdefault("hash_block_tokens", DEFAULT_HASH_BLOCK_TOKENS)
    return _finish(path, name, "parquet", t, prompt, output, sessions, hashes, meta)


def _stored_meta(path: Path, raw: bytes) -> dict[str, Any]:
    """The name, format and meta our writer stores in the Parquet schema, checked like any JSON read
    here."""
    text = raw.decode("utf-8", errors="replace")
    try:
        if (
            text.count("[") + text.count("{") > MAX_JSON_DEPTH
            and _json_depth(text) > MAX_JSON_DEPTH
        ):
            raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
        stored = json.loads(text)
        if not isinstance(stored, dict) or not isinstance(stored.get("meta", {}), dict):
            raise ValueError("not a JSON object with a 'meta' object")
    except ValueError as exc:  # JSONDecodeError and the digit limit are ValueErrors too
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise TraceFormatError(
            path, None, f"damaged {_PARQUET_META_KEY.decode()} metadata: {reason}"
        ) from None
    return stored


def write_request_trace(
    trace: RequestTrace, path: str | Path, *, format: str | None = None
) -> Path:
    """Write our CSV (hash ids space-separated) or Parquet (also keeps name and meta), all or
    nothing.

    The format follows ``format`` or the suffix (``traces.alloc_table.output_format``: ``.csv``,
    ``.csv.gz``, ``.parquet``, ``.pq``; ValueError for any other).
    """
    path = Path(path)
    fmt = format or output_format(path)
    if fmt not in ("csv", "parquet"):
        raise ValueError(f"cannot write request traces as {fmt!r}; use 'csv' or 'parquet'")
    df = trace.requests[REQUEST_COLUMNS]
    if fmt == "csv":
        out = df.assign(hash_ids=[" ".join(map(str, h)) for h in df["hash_ids"]])
        with replacing_file(path) as tmp:
            out.to_csv(
                tmp, index=False, compression="gzip" if path.name.lower().endswith(".gz") else None
            )
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "request_id": pa.array(df["request_id"].to_numpy(np.int64)),
            "arrival_s": pa.array(df["arrival_s"].to_numpy(np.float64)),
            "prompt_tokens": pa.array(df["prompt_tokens"].to_numpy(np.int64)),
            "output_tokens": pa.array(df["output_tokens"].to_numpy(np.int64)),
            "session_id": pa.array([str(s) for s in df["session_id"]], pa.string()),
            "hash_ids": pa.array([list(h) for h in df["hash_ids"]], pa.list_(pa.int64())),
        }
    )
    stored = json.dumps(
        {"name": trace.name, "format": trace.format, "meta": trace.meta}, default=str
    )
    table = table.replace_schema_metadata(
        {**(table.schema.metadata or {}), _PARQUET_META_KEY: stored.encode()}
    )
    with replacing_file(path) as tmp:
        pq.write_table(table, tmp)
    return path


_register_builtins()
