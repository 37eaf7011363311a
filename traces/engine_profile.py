"""What a real serving engine logs: its step profile and its per-request table.

Two tables, one schema each, shared by whatever writes them (``poollab gpu serve``, a user's own
engine, a vLLM or SGLang log converted by hand) and whatever reads them (the step-time
calibration, the measured-against-predicted comparison):

* **step profile**: one row per engine step (schedule, forward, sample, bookkeeping; not time
  spent idle waiting for requests). Required columns, in ``STEP_COLUMNS``:

  ==========================  ==========================================================
  ``duration_s``              the step's wall time, seconds (> 0)
  ``num_prefill_seqs``        sequences in prefill this step (chunks included)
  ``num_prefill_tokens``      their query tokens
  ``prefill_context_tokens``  KV tokens their attention reads (cached plus new)
  ``num_decode_seqs``         sequences decoding one token
  ``decode_context_tokens``   KV tokens their attention reads
  ==========================  ==========================================================

  optional: ``start_s`` (seconds from the first arrival), ``tp`` (tensor-parallel degree),
  ``cpu_s`` (CPU seconds the engine's loop thread spent in the step, >= 0: beside ``duration_s``
  it tells a step the thread computed from one it waited through; the fit does not read it).

* **served requests**: one row per request, ``SERVED_REQUEST_COLUMNS``: ``arrival_s``,
  ``prompt_tokens``, ``output_tokens``, ``first_token_s``, ``finish_s`` (seconds from the first
  arrival; what any load generator logs); optional ``request``. A request that never got a first
  token or never finished has an empty cell (NaN) there.

Logging a step profile from an engine (one row per pass of its loop; time the pass, count its
batch):

* ``poollab gpu serve`` writes both tables for transformers' continuous batching (it wraps the
  manager's loop body and its scheduler's ``schedule_batch``).
* vLLM (v1): wrap ``EngineCore.step`` (``vllm/v1/engine/core.py``) with a monotonic clock; the
  ``SchedulerOutput`` its ``scheduler.schedule()`` returned gives, per request,
  ``num_scheduled_tokens[req_id]`` and ``num_computed_tokens`` (``scheduled_new_reqs`` and
  ``scheduled_cached_reqs``): a request with 1 token scheduled past its prompt is decoding
  (context ``num_computed_tokens + 1``), any other is prefilling (``num_prefill_tokens`` += its
  tokens, ``prefill_context_tokens`` += computed + scheduled).
* SGLang: wrap ``Scheduler.run_batch`` (``python/sglang/srt/managers/scheduler.py``); the
  ``ScheduleBatch`` says its ``forward_mode`` (extend, decode or mixed) and per sequence its
  ``extend_lens`` (new tokens), ``prefix_lens`` (cached) and ``seq_lens`` (all).
* Your own engine: the same six counts per step; write them with ``write_step_profile`` or as
  a CSV with the header ``STEP_COLUMNS``. Leave idle time out of ``duration_s``.

Both read from CSV or Parquet (told from the content; gzipped, a pipe or a FIFO too) and are written
as CSV (``.csv``, ``.csv.gz``) or Parquet (``.parquet``, ``.pq``). Every cell is
checked before use (a number, finite, within range, integral where a count) and the first bad
one raises ``TraceFormatError`` naming file, line (CSV) or row (Parquet) and column.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from traces.alloc_table import CSV_FORMAT, PARQUET_FORMAT, output_format
from traces.atomic import replacing_file
from traces.errors import TraceFormatError
from traces.source import open_source

__all__ = [
    "STEP_COLUMNS",
    "STEP_OPTIONAL_COLUMNS",
    "SERVED_REQUEST_COLUMNS",
    "read_step_profile",
    "write_step_profile",
    "read_served_requests",
    "write_served_requests",
]

#: Required step-profile columns (counts are integers, ``duration_s`` seconds).
STEP_COLUMNS = (
    "duration_s",
    "num_prefill_seqs",
    "num_prefill_tokens",
    "prefill_context_tokens",
    "num_decode_seqs",
    "decode_context_tokens",
)
#: Step-profile columns kept when present.
STEP_OPTIONAL_COLUMNS = ("start_s", "tp", "cpu_s")
#: Required served-request columns; times may be NaN (never reached).
SERVED_REQUEST_COLUMNS = (
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "first_token_s",
    "finish_s",
)
_SERVED_OPTIONAL_COLUMNS = ("request",)

#: Largest count a cell may hold: tokens of one step stay far below it; more is corruption.
_MAX_COUNT = 2**40
#: Longest time in seconds (a step, an arrival): a year; more is a unit mistake.
_MAX_SECONDS = 365 * 86400.0
_STEP_INT_COLUMNS = STEP_COLUMNS[1:] + ("tp",)
_SERVED_INT_COLUMNS = ("prompt_tokens", "output_tokens", "request")
_NULLABLE_TIMES = ("first_token_s", "finish_s")


def read_step_profile(path: str | Path) -> pd.DataFrame:
    """The step profile at ``path``, checked; columns ``STEP_COLUMNS`` then the optional ones
    present."""
    path = Path(path)
    df = _read_table(path, STEP_COLUMNS, STEP_OPTIONAL_COLUMNS)
    _check_columns(path, df, int_columns=_STEP_INT_COLUMNS, nullable=())
    _check(path, df, df["duration_s"] <= 0, "duration_s", "must be > 0 (a step takes time)")
    for seqs, tokens in (
        ("num_prefill_seqs", "num_prefill_tokens"),
        ("num_decode_seqs", "decode_context_tokens"),
    ):
        _check(
            path,
            df,
            (df[seqs] > 0) & (df[tokens] < df[seqs]),
            tokens,
            f"is below {seqs} (every sequence has at least one token)",
        )
    _check(
        path,
        df,
        df["prefill_context_tokens"] < df["num_prefill_tokens"],
        "prefill_context_tokens",
        "is below num_prefill_tokens (attention reads at least the new tokens)",
    )
    _check(
        path,
        df,
        (df["num_prefill_seqs"] == 0) & (df["num_prefill_tokens"] > 0),
        "num_prefill_tokens",
        "is > 0 with num_prefill_seqs 0",
    )
    if "tp" in df:
        _check(path, df, df["tp"] < 1, "tp", "must be >= 1")
    if df.empty:
        raise TraceFormatError(path, None, "the step profile has no steps")
    return df


def write_step_profile(steps: pd.DataFrame, path: str | Path) -> Path:
    """Write ``steps`` (the required columns, and the optional ones it has) as CSV or Parquet, all
    or nothing."""
    return _write_table(steps, path, STEP_COLUMNS, STEP_OPTIONAL_COLUMNS)


def read_served_requests(path: str | Path) -> pd.DataFrame:
    """The served-request table at ``path``, checked (first token and finish, where given, not
    before arrival)."""
    path = Path(path)
    df = _read_table(path, SERVED_REQUEST_COLUMNS, _SERVED_OPTIONAL_COLUMNS)
    _check_columns(path, df, int_columns=_SERVED_INT_COLUMNS, nullable=_NULLABLE_TIMES)
    _check(path, df, df["first_token_s"] < df["arrival_s"], "first_token_s", "is before arrival_s")
    _check(path, df, df["finish_s"] < df["first_token_s"], "finish_s", "is before first_token_s")
    _check(path, df, df["output_tokens"] < 1, "output_tokens", "must be >= 1")
    if df.empty:
        raise TraceFormatError(path, None, "the request table has no requests")
    return df


def write_served_requests(requests: pd.DataFrame, path: str | Path) -> Path:
    """Write a served-request table as CSV or Parquet, all or nothing."""
    return _write_table(requests, path, SERVED_REQUEST_COLUMNS, _SERVED_OPTIONAL_COLUMNS)


def _write_table(
    df: pd.DataFrame, path: str | Path, required: tuple[str, ...], optional: tuple[str, ...]
) -> Path:
    path = Path(path)
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ValueError(f"cannot write {path}: missing columns {', '.join(missing)}")
    fmt = output_format(path)
    df = df[[*required, *(c for c in optional if c in df.columns)]]
    with replacing_file(path) as tmp:
        if fmt == PARQUET_FORMAT:
            df.to_parquet(tmp, index=False)
        else:
            df.to_csv(
                tmp, index=False, compression="gzip" if path.name.lower().endswith(".gz") else None
            )
    return path


def _read_table(path: Path, required: tuple[str, ...], optional: tuple[str, ...]) -> pd.DataFrame:
    # any file, pipe or FIFO, read once under the trace size limit (gzip undone); the format is told
    # from the content, as every reader tells it: Parquet's magic, else CSV
    try:
        src = open_source(path)
    except OSError as exc:  # missing, a folder, no permission
        raise TraceFormatError(path, None, (exc.strerror or str(exc)).lower()) from None
    path = src.path
    src.require_intact()
    fmt = PARQUET_FORMAT if src.head(4) == b"PAR1" else CSV_FORMAT
    try:
        if fmt == PARQUET_FORMAT:
            df = pd.read_parquet(src.stream())
        else:
            # every cell as text: the checks below name the first bad one with its line
            df = pd.read_csv(src.stream(), dtype=str, keep_default_na=False, na_filter=False)
    except pd.errors.EmptyDataError:
        raise TraceFormatError(path, 1, "empty file: expected a header line") from None
    except (pd.errors.ParserError, UnicodeDecodeError, OSError, ValueError) as exc:
        raise TraceFormatError(
            path, None, f"cannot read the table: {str(exc).strip().splitlines()[0]}"
        ) from None
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise TraceFormatError(
            path,
            1 if fmt != PARQUET_FORMAT else None,
            f"missing column(s) {', '.join(missing)}; expected {', '.join(required)}",
        )
    df = df[[*required, *(c for c in optional if c in df.columns)]].reset_index(drop=True)
    df.attrs["poollab_is_csv"] = fmt != PARQUET_FORMAT
    return df


def _where(path: Path, df: pd.DataFrame, row: int) -> tuple[int, str]:
    """(line or row number, unit) of 0-based ``row``: CSV lines count the header as line 1."""
    return (row + 2, "line") if df.attrs.get("poollab_is_csv") else (row + 1, "row")


def _check(path: Path, df: pd.DataFrame, bad: pd.Series, column: str, reason: str) -> None:
    hits = np.flatnonzero(np.asarray(bad, dtype=bool))
    if hits.size:
        line, unit = _where(path, df, int(hits[0]))
        raise TraceFormatError(
            path, line, f"{column} {df[column].iloc[hits[0]].item()!r} {reason}", unit=unit
        )


def _check_columns(
    path: Path, df: pd.DataFrame, *, int_columns: tuple[str, ...], nullable: tuple[str, ...]
) -> None:
    """Turn every column into float64 or int64 in place, naming the first cell that is not a fit
    number."""
    for column in list(df.columns):
        values = df[column].tolist()
        out = np.empty(len(values), dtype=np.float64)
        is_int = column in int_columns
        for i, cell in enumerate(values):
            out[i] = _number(path, df, i, column, cell, is_int=is_int, nullable=column in nullable)
        df[column] = out.astype(np.int64) if is_int else out


def _number(
    path: Path,
    df: pd.DataFrame,
    row: int,
    column: str,
    cell: object,
    *,
    is_int: bool,
    nullable: bool,
) -> float:
    def fail(reason: str) -> None:
        line, unit = _where(path, df, row)
        raise TraceFormatError(path, line, f"{column} {cell!r}: {reason}", unit=unit)

    if isinstance(cell, (bool, np.bool_)):
        fail("expected a number, not a boolean")
    if cell is None or (isinstance(cell, str) and cell.strip() == ""):
        if nullable:
            return math.nan
        fail("missing value")
    if isinstance(cell, str):
        text = cell.strip()
        if (
            len(text) > 40
        ):  # no fit number is this long; float() of 5,000 digits is slow and int() refuses
            fail("not a number of sensible size")
        try:
            value = float(text)
        except ValueError:
            fail("not a number")
    elif isinstance(cell, (int, float, np.integer, np.floating)):
        value = float(cell)
    else:
        fail(f"expected a number, not {type(cell).__name__}")
    if math.isnan(value):
        if nullable:
            return math.nan
        fail("not a number (NaN)")
    if not math.isfinite(value):
        fail("must be finite")
    if value < 0:
        fail("must be >= 0")
    if is_int:
        if value != int(value):
            fail("must be a whole number")
        if value > _MAX_COUNT:
            fail(f"above {_MAX_COUNT:,} (a corrupt count)")
    elif value > _MAX_SECONDS:
        fail(f"above {_MAX_SECONDS:,.0f} s (a unit mistake?)")
    return value
