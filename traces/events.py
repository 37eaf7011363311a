"""The allocation-event table every allocation-trace reader produces.

One row per event, in time order:

=========  =======  ==============================================================
column     dtype    meaning
=========  =======  ==============================================================
time_us    int64    microseconds since the trace's first event
op         str      ``"alloc"``, ``"free"`` or ``"empty_cache"``
alloc_id   int64    names the allocation; an ``alloc`` and its ``free`` share it
nbytes     int64    bytes asked for (on ``free`` rows: the same size, for reference)
stream     int64    the stream the request was made on (0 when unknown)
tag        str      optional label (``"pre-trace"``, ``"kv"``, ``"weights"``, ...), "" if none
=========  =======  ==============================================================

Invariants (``validate_events`` checks them): every ``free`` follows the ``alloc`` with the
same id, on the same stream; each id is allocated at most once and freed at most once;
allocations never freed are simply live at the end. ``time_us`` is a whole number >= 0 (NaN,
infinity and a fraction are no time) that never goes back from one row to the next: the rows
are the events in the order they happened, so a time that goes back is an error naming its
line, not something to sort (sorting would reorder a free before its alloc).

An ``empty_cache`` row is the program calling ``torch.cuda.empty_cache()`` at that point (every
policy honours it through ``Policy.empty_cache``); it is no request, so its ``alloc_id`` and
``nbytes`` mean nothing (written as -1 and 0) and readers of requests (``AllocTrace.arrays``)
leave it out. Files from before this kind simply have none.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from traces.errors import TraceFormatError, shown

__all__ = [
    "EVENT_COLUMNS",
    "PRE_TRACE_TAG",
    "ALLOC_OP",
    "FREE_OP",
    "EMPTY_CACHE_OP",
    "EVENT_OPS",
    "AllocTrace",
    "make_events",
    "coded_str_column",
    "validate_events",
]

EVENT_COLUMNS = ["time_us", "op", "alloc_id", "nbytes", "stream", "tag"]
#: Tag of allocations made before recording began (synthesised by the snapshot reader).
PRE_TRACE_TAG = "pre-trace"
#: The ``op`` values: a request (alloc, free) or an explicit ``empty_cache()`` call.
ALLOC_OP, FREE_OP, EMPTY_CACHE_OP = "alloc", "free", "empty_cache"
EVENT_OPS = (ALLOC_OP, FREE_OP, EMPTY_CACHE_OP)


@dataclass
class AllocTrace:
    """An allocation trace: the event table plus where it came from.

    Attributes:
        events: the table described in the module docstring.
        name: short name for reports (file stem by default).
        source: the file it was read from ("" when generated).
        format: the reader that produced it ("pytorch-snapshot", "rmm-log", "csv", ...).
        meta: reader-specific facts (e.g. the allocator's own segment events of a snapshot).
    """

    events: pd.DataFrame
    name: str
    source: str = ""
    format: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.events)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(time_us, is_alloc, alloc_id, nbytes, stream)`` of the requests as numpy arrays (the
        ``empty_cache`` rows left out: they are no request), for lifetimes and request loops."""
        ev = self.events
        calls = self.is_empty_cache()
        if calls.any():
            ev = ev[~calls]
        return (
            ev["time_us"].to_numpy(np.int64),
            (ev["op"] == ALLOC_OP).to_numpy(),
            ev["alloc_id"].to_numpy(np.int64),
            ev["nbytes"].to_numpy(np.int64),
            ev["stream"].to_numpy(np.int64),
        )

    def is_empty_cache(self) -> np.ndarray:
        """Per row: whether it is an ``empty_cache`` call."""
        return (self.events["op"] == EMPTY_CACHE_OP).to_numpy(dtype=bool, na_value=False)


def make_events(time_us, op, alloc_id, nbytes, stream=None, tag=None) -> pd.DataFrame:
    """Build an event table with the canonical columns and dtypes.

    ``op`` and ``tag`` may be any sequence of strings, or a Series of the table's string dtype
    (``coded_str_column``'s): its values are taken as they are, its index ignored.
    """
    n = len(op)
    df = pd.DataFrame(
        {
            "time_us": np.asarray(time_us, dtype=np.int64),
            "op": op.array if _is_str_column(op) else _str_column(np.asarray(op, dtype=object)),
            "alloc_id": np.asarray(alloc_id, dtype=np.int64),
            "nbytes": np.asarray(nbytes, dtype=np.int64),
            "stream": np.zeros(n, np.int64)
            if stream is None
            else np.asarray(stream, dtype=np.int64),
            "tag": tag.fillna("").array
            if _is_str_column(tag)
            else _str_column(
                pd.Series(
                    [""] * n if tag is None else np.asarray(tag, dtype=object), dtype=object
                ).fillna("")
            ),
        }
    )
    return df


def _str_column(values) -> pd.Series:
    # astype(str): the default string dtype of the installed pandas, also when the table is empty
    return pd.Series(values, dtype=object).astype(str)


@functools.cache
def _str_dtype():
    """The string dtype ``astype(str)`` gives an event table's text columns in this pandas."""
    return _str_column([]).dtype


@functools.cache
def _arrow_str_type():
    """The Arrow type of that dtype's storage (``large_string`` in pandas 3), when Arrow."""
    return _str_column([]).array._pa_array.type


def _is_str_column(values) -> bool:
    return isinstance(values, pd.Series) and values.dtype == _str_dtype()


def coded_str_column(codes: np.ndarray, values: list[str]) -> pd.Series:
    """The text column ``make_events`` makes of ``[values[c] for c in codes]``, built without a
    Python object a row where pandas keeps strings in Arrow (a dictionary-encoded array decoded
    in C: 0.02 s for 1.5 M rows against 0.15 s converting the objects, the table's op column).

    Args:
        codes: one index into ``values`` a row (any integer dtype; every one in range).
        values: the few distinct strings.
    """
    dtype = _str_dtype()
    codes = np.asarray(codes)
    if getattr(dtype, "storage", None) != "pyarrow":
        return _str_column(np.asarray(values, dtype=object)[codes])
    import pyarrow as pa  # the storage above: installed

    text = pa.DictionaryArray.from_arrays(
        pa.array(codes.astype(np.int32, copy=False)), pa.array(values, _arrow_str_type())
    ).cast(_arrow_str_type())
    return pd.Series(pd.arrays.ArrowStringArray(pa.chunked_array([text]), dtype=dtype))


def validate_events(
    df: pd.DataFrame, source: str = "<events>", *, line_offset: int = 2, unit: str = "line"
) -> None:
    """Raise TraceFormatError at the earliest row that breaks the table's invariants.

    Args:
        df: an event table.
        source: the file (or other origin) named in the error.
        line_offset: maps a row index to a file line (2 for a CSV with one header line, 1 for
            1-based record numbers).
        unit: what the number counts ("line" for text, "record" for Parquet rows).
    """
    missing = [c for c in EVENT_COLUMNS if c not in df.columns]
    if missing:
        raise TraceFormatError(
            source,
            None,
            f"missing column(s) {', '.join(missing)}; expected {', '.join(EVENT_COLUMNS)}",
        )
    problems: list[
        tuple[int, str]
    ] = []  # (row, reason): each check's first offender; the earliest wins
    op = df["op"]
    is_alloc = (op == ALLOC_OP).to_numpy(dtype=bool, na_value=False)
    is_free = (op == FREE_OP).to_numpy(dtype=bool, na_value=False)
    is_request = is_alloc | is_free  # an empty_cache row's id and size are ignored
    bad = np.flatnonzero(~is_request & ~(op == EMPTY_CACHE_OP).to_numpy(dtype=bool, na_value=False))
    if bad.size:
        i = int(bad[0])
        problems.append(
            (i, f"op {shown(op.iloc[i], 40)} is not one of {', '.join(map(repr, EVENT_OPS))}")
        )
    nbytes = df["nbytes"].to_numpy()
    bad = np.flatnonzero(is_request & ((nbytes < 0) | (is_alloc & (nbytes == 0))))
    if bad.size:
        i = int(bad[0])
        problems.append((i, f"size {int(nbytes[i])} must be > 0"))
    ids = df["alloc_id"].to_numpy()
    bad = np.flatnonzero(
        is_request & (ids < 0)
    )  # ids index per-allocation tables downstream (bounds, replay)
    if bad.size:
        i = int(bad[0])
        problems.append((i, f"alloc_id {int(ids[i])} must be >= 0"))
    t = df["time_us"].to_numpy()
    bad = np.flatnonzero(t < 0)  # before the trace's start: no clock gives it
    if bad.size:
        i = int(bad[0])
        problems.append((i, f"time_us {int(t[i])} must be >= 0 (microseconds from the start)"))
    bad = np.flatnonzero(np.diff(t) < 0)
    if bad.size:
        i = int(bad[0]) + 1
        problems.append((i, f"time_us {int(t[i])} goes back in time (previous {int(t[i - 1])})"))
    # each id: at most one alloc, at most one free, free after alloc
    rows = np.arange(len(ids))
    alloc_ids, free_ids = ids[is_alloc], ids[is_free]
    for found in (
        _first_dup(alloc_ids, rows[is_alloc], "allocated twice"),
        _first_dup(free_ids, rows[is_free], "freed twice (double free)"),
    ):
        if found is not None:
            problems.append(found)
    # first alloc row of each id (drop_duplicates keeps the first): a free must come after it
    first_alloc = pd.Series(rows[is_alloc], index=alloc_ids)
    first_alloc = first_alloc[~first_alloc.index.duplicated()]
    freed_rows = rows[is_free]
    alloc_row = first_alloc.reindex(free_ids).to_numpy(dtype=np.float64)
    bad = np.flatnonzero(np.isnan(alloc_row) | (alloc_row > freed_rows))
    if bad.size:
        i = int(freed_rows[bad[0]])
        problems.append((i, f"free of allocation {int(ids[i])}, which is not live at that point"))
    # a block is freed on the stream it was allocated on: a free elsewhere is a corrupt row, not a
    # request
    stream = df["stream"].to_numpy()
    matched = ~np.isnan(alloc_row)
    if matched.any():
        alloc_stream = stream[alloc_row[matched].astype(np.int64)]
        bad = np.flatnonzero(alloc_stream != stream[freed_rows[matched]])
        if bad.size:
            i = int(freed_rows[matched][bad[0]])
            problems.append(
                (
                    i,
                    f"free of allocation {int(ids[i])} on stream {int(stream[i])}, "
                    f"but it was allocated on stream {int(alloc_stream[bad[0]])}",
                )
            )
    if problems:
        i, reason = min(problems, key=lambda p: p[0])
        raise TraceFormatError(source, i + line_offset, reason, unit=unit)


def _first_dup(ids: np.ndarray, rows: np.ndarray, what: str) -> tuple[int, str] | None:
    """The earliest row whose id already occurred earlier among ``ids``, or None."""
    if ids.size == 0:
        return None
    order = np.argsort(ids, kind="stable")  # stable: within one id, rows stay in file order
    s = ids[order]
    dup = np.flatnonzero(s[1:] == s[:-1]) + 1
    if dup.size == 0:
        return None
    k = dup[np.argmin(rows[order[dup]])]
    return int(rows[order[k]]), f"allocation {int(s[k])} {what}"
