"""RMM ``logging_resource_adaptor`` CSV logs as an AllocTrace.

The log has the header ``Thread,Time,Action,Pointer,Size,Stream``; ``Time`` is the time of day
``HH:MM:SS.ffffff`` (seconds since the epoch, >= 0, are accepted too), ``Action`` is ``allocate``,
``free`` or ``allocate failure``, ``Pointer`` and ``Stream`` are hex (with or without ``0x``).
Unlike a PyTorch snapshot a log is complete from its first line, so a free of a pointer that is
not live is an error (``lenient=True`` drops such frees instead). ``allocate failure`` rows are
counted in ``meta["num_failed_allocations"]`` and skipped. Pointers are addresses: an allocation
that overlaps a live one is an error. A free on another stream than its allocation's is
counted in ``meta["num_cross_stream_frees"]`` and put on the allocation's stream (RMM allows it;
the event table keeps a block on its stream until it is free). Times that go back by threads
racing to log (up to ``MAX_CLOCK_JITTER_US``) are raised to the latest earlier one and counted
in ``meta["num_time_clamped"]``; further back is an error. Everything is vectorised: a free is
matched to the latest allocation of the same pointer by a stable sort on the pointer.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from traces.errors import TraceFormatError, shown
from traces.events import AllocTrace, make_events
from traces.source import TraceSource, open_source, trace_name

__all__ = ["RMM_FORMAT", "RMM_HEADER", "read_rmm_log"]

RMM_FORMAT = "rmm-log"
RMM_HEADER = ["Thread", "Time", "Action", "Pointer", "Size", "Stream"]

_ALLOC_ACTIONS = frozenset({"allocate"})
_FREE_ACTIONS = frozenset({"free", "deallocate"})  # "deallocate": the wording of RMM's user guide
_FAIL_ACTION = "allocate failure"
_NULL_POINTERS = {"(nil)": "0", "nullptr": "0", "null": "0", "0x0": "0"}
_DAY_US = 86_400_000_000
_INT64_LIMIT = (
    2.0**63
)  # sizes and times are int64 from here on: anything at or past this does not fit
_LINE_RE = re.compile(r"line (\d+)")
#: How far back a row's time may lie behind an earlier row's: threads log in a race, not in order.
MAX_CLOCK_JITTER_US = 1_000_000


def read_rmm_log(path: str | Path | TraceSource, *, lenient: bool = False) -> AllocTrace:
    """Read an RMM logging-adaptor CSV.

    Args:
        path: the log (plain or gzipped; a file, any stream, or its ``TraceSource``).
        lenient: drop frees of pointers that are not live (and let a pointer be allocated
            again without a free) instead of raising TraceFormatError.
    """
    src = open_source(path)
    path = src.path
    cols, line = _read_columns(src)
    action = pc.utf8_trim_whitespace(cols["Action"])
    is_fail = _bools(pc.equal(action, _FAIL_ACTION))
    is_alloc = _bools(pc.is_in(action, value_set=pa.array(sorted(_ALLOC_ACTIONS))))
    is_free = _bools(pc.is_in(action, value_set=pa.array(sorted(_FREE_ACTIONS))))
    bad = np.flatnonzero(~(is_fail | is_alloc | is_free))
    if bad.size:
        k = bad[0]
        raise TraceFormatError(
            path,
            int(line[k]),
            f"Action {shown(action[int(k)].as_py())} is not 'allocate', "
            "'free' or 'allocate failure'",
        )
    size = _parse_sizes(cols["Size"], line, path)
    time_us, num_time_clamped = _parse_times(cols["Time"], line, path)
    stream_raw = _parse_hex(cols["Stream"], line, path, "Stream")

    # failures and zero-byte allocations (nothing to place) are not events
    zero = is_alloc & (size == 0)
    keep = (is_alloc | is_free) & ~zero
    num_failed = int(is_fail.sum())
    pointer = _parse_hex(cols["Pointer"].filter(pa.array(keep)), line[keep], path, "Pointer")
    line, is_alloc, size, time_us, stream_raw = (
        line[keep],
        is_alloc[keep],
        size[keep],
        time_us[keep],
        stream_raw[keep],
    )
    ids, alloc_row, keep_free = _match_frees(pointer, is_alloc, size == 0, line, path, lenient)
    if not keep_free.all():
        line, is_alloc, size, time_us, stream_raw, pointer, ids, alloc_row = (
            a[keep_free]
            for a in (line, is_alloc, size, time_us, stream_raw, pointer, ids, alloc_row)
        )
        alloc_row = _rows_after_drop(alloc_row, keep_free)
    alloc_size = size[alloc_row]
    num_size_mismatch = int(np.count_nonzero(alloc_size != size))
    _check_no_overlap(pointer, is_alloc, alloc_size, alloc_row, line, path)
    # a block belongs to the stream it was allocated on until it is free (the event table's rule)
    num_cross_stream = int(np.count_nonzero(stream_raw[alloc_row] != stream_raw))
    stream_raw = stream_raw[alloc_row]
    stream, handles = _streams_in_order(stream_raw)
    t0 = int(time_us[0]) if time_us.size else 0
    events = make_events(time_us - t0, np.where(is_alloc, "alloc", "free"), ids, alloc_size, stream)
    meta = {
        "num_failed_allocations": num_failed,
        "num_zero_size_skipped": int(zero.sum()),
        "num_unmatched_frees_dropped": int(
            (~keep_free).sum()
        ),  # incl. frees of zero-byte allocations
        "num_free_size_mismatches": num_size_mismatch,
        "num_time_clamped": num_time_clamped,
        "num_cross_stream_frees": num_cross_stream,
        "stream_handles": {int(h): i for i, h in enumerate(handles)},
    }
    return AllocTrace(
        events,
        name=trace_name(path, (".csv", ".log")),
        source=str(path),
        format=RMM_FORMAT,
        meta=meta,
    )


def _read_columns(src: TraceSource) -> tuple[dict[str, pa.Array], np.ndarray]:
    """Every column as an Arrow string array, and the file line of each row.

    Fast path: Arrow's CSV reader. On any irregularity (a blank line, a ragged row) pandas
    reads the file again, keeping blank lines so that row numbers map to file lines.
    """
    opts = dict(
        parse_options=pacsv.ParseOptions(ignore_empty_lines=False),
        convert_options=pacsv.ConvertOptions(
            column_types={c: pa.string() for c in RMM_HEADER},
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
        ),
    )
    src.require_intact()
    try:
        table = pacsv.read_csv(pa.BufferReader(src.data), **opts)
    except (pa.ArrowException, OSError, ValueError, EOFError):
        table = None
    if table is not None and [c.strip() for c in table.column_names] == RMM_HEADER:
        cols = {name: table.column(i).combine_chunks() for i, name in enumerate(RMM_HEADER)}
        line = np.arange(table.num_rows) + 2  # one header line; a blank line is a row of ""
        blank = np.ones(table.num_rows, bool)
        for col in cols.values():
            blank &= _bools(pc.equal(col, ""))
        if blank.any():
            mask = pa.array(~blank)
            cols, line = {name: col.filter(mask) for name, col in cols.items()}, line[~blank]
        return cols, line
    df = _read_csv_strings(src)
    line = df.index.to_numpy() + 2  # one header line; blank lines are kept as rows of ""
    blank = (df == "").all(axis=1).to_numpy()
    df, line = df[~blank], line[~blank]
    return {
        name: pa.array(df[name].to_numpy(dtype=object), type=pa.string()) for name in RMM_HEADER
    }, line


def _bools(arr: pa.Array) -> np.ndarray:
    return arr.to_numpy(zero_copy_only=False).astype(bool)


def _read_csv_strings(src: TraceSource) -> pd.DataFrame:
    path = src.path
    try:
        df = pd.read_csv(
            src.stream(),
            dtype=str,
            keep_default_na=False,
            na_filter=False,
            skip_blank_lines=False,
            skipinitialspace=True,
        )
    except pd.errors.EmptyDataError:
        raise TraceFormatError(path, None, "empty file") from None
    except pd.errors.ParserError as exc:
        m = _LINE_RE.search(str(exc))
        raise TraceFormatError(
            path, int(m.group(1)) if m else None, f"malformed CSV row ({exc})"
        ) from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(path, None, f"not a readable text file ({exc})") from None
    header = [c.strip() for c in df.columns]
    if header != RMM_HEADER:
        raise TraceFormatError(
            path, 1, f"header {','.join(header)!r} is not {','.join(RMM_HEADER)!r}"
        )
    df.columns = header
    return df


def _parse_sizes(col: pa.Array, line: np.ndarray, path: Path) -> np.ndarray:
    text = pc.utf8_trim_whitespace(col)
    try:
        size = pc.cast(text, pa.int64()).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid:
        num = pd.to_numeric(
            pd.Series(text.to_numpy(zero_copy_only=False)), errors="coerce"
        ).to_numpy(np.float64)
        size = np.where(np.isnan(num) | (num != np.floor(num)) | (num >= _INT64_LIMIT), -1, num)
    bad = np.flatnonzero(size < 0)
    if bad.size:
        k = int(bad[0])
        raise TraceFormatError(
            path, int(line[k]), f"Size {shown(col[k].as_py())} is not a byte count"
        )
    return size.astype(np.int64)


def _parse_times(col: pa.Array, line: np.ndarray, path: Path) -> tuple[np.ndarray, int]:
    """Microseconds, non-decreasing: time of day with midnight wraps undone; and how many rows were
    clamped.

    Threads race to log, so a time up to ``MAX_CLOCK_JITTER_US`` before an earlier row's is
    raised to it (and counted); a jump back further than that (and short of half a day, which is
    midnight) is an error naming the line.
    """
    t = _clock_fixed_width_us(col)
    if t is None:
        text = pd.Series(pc.utf8_trim_whitespace(col).to_numpy(zero_copy_only=False), dtype=object)
        if len(text) and ":" not in text.iloc[0]:  # seconds since the epoch
            secs = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64)
            bad = np.flatnonzero(
                ~((secs >= 0) & (secs < _INT64_LIMIT / 1e6))
            )  # NaN, inf, before 1970, or microseconds past int64
            t = np.round(secs * 1e6)
        else:
            td = pd.to_timedelta(text, errors="coerce")
            bad = np.flatnonzero((td.isna() | (td < pd.Timedelta(0))).to_numpy())  # -00:00:01
            t = td.to_numpy(dtype="timedelta64[us]").astype(np.float64) if not bad.size else None
        if bad.size:
            k = int(bad[0])
            raise TraceFormatError(
                path,
                int(line[k]),
                f"Time {shown(text.iloc[k])} is not HH:MM:SS.ffffff"
                + (" or seconds since the epoch (>= 0)" if ":" not in text.iloc[0] else ""),
            )
        t = t.astype(np.int64)
    # a jump back of more than half a day is midnight; smaller ones are threads racing to log
    wraps = np.concatenate([[0], np.cumsum(np.diff(t) < -_DAY_US // 2)])
    t = t + wraps * _DAY_US
    if not t.size:
        return t, 0
    latest = np.maximum.accumulate(t)
    back = np.flatnonzero(latest - t > MAX_CLOCK_JITTER_US)
    if back.size:
        k = int(back[0])
        before = int(np.flatnonzero(t[:k] == latest[k])[0])
        raise TraceFormatError(
            path,
            int(line[k]),
            f"Time goes back {(latest[k] - t[k]) / 1e6:,.6f} s from line {int(line[before])}'s "
            f"(more than the {MAX_CLOCK_JITTER_US / 1e6:g} s of threads racing to log)",
        )
    return latest, int(np.count_nonzero(latest != t))


def _clock_fixed_width_us(col: pa.Array) -> np.ndarray | None:
    """``HH:MM:SS.ffffff`` read straight from the Arrow buffer; None unless every row has that
    shape."""
    n = len(col)
    if n == 0 or col.null_count or not pa.types.is_string(col.type):
        return None
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int32)[col.offset : col.offset + n + 1]
    if offsets[-1] - offsets[0] != 15 * n or not np.all(np.diff(offsets) == 15):
        return None
    data = np.frombuffer(col.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]].reshape(n, 15)
    if not ((data[:, [2, 5]] == ord(":")).all() and (data[:, 8] == ord(".")).all()):
        return None
    digits = data[:, [0, 1, 3, 4, 6, 7, 9, 10, 11, 12, 13, 14]].astype(np.int64) - ord("0")
    if ((digits < 0) | (digits > 9)).any():
        return None
    h, m, s = (
        digits[:, 0] * 10 + digits[:, 1],
        digits[:, 2] * 10 + digits[:, 3],
        digits[:, 4] * 10 + digits[:, 5],
    )
    if (h > 23).any() or (m > 59).any() or (s > 60).any():
        return None
    frac = digits[:, 6:] @ np.array([100_000, 10_000, 1_000, 100, 10, 1], dtype=np.int64)
    return ((h * 60 + m) * 60 + s) * 1_000_000 + frac


def _parse_hex(col: pa.Array, line: np.ndarray, path: Path, what: str) -> np.ndarray:
    """Hex strings (``0x7f..``, ``7f..``, ``(nil)``) as uint64; each distinct string is parsed
    once."""
    encoded = pc.dictionary_encode(pc.utf8_trim_whitespace(col))
    values = encoded.dictionary.to_pylist()
    parsed = np.zeros(len(values), np.uint64)
    bad = []
    for i, text in enumerate(values):
        try:
            v = int(_NULL_POINTERS.get(text, text), 16)
            if not 0 <= v < 2**64:
                raise ValueError
            parsed[i] = v
        except ValueError:
            bad.append(i)
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    if bad:
        k = int(np.flatnonzero(np.isin(codes, bad))[0])
        raise TraceFormatError(
            path, int(line[k]), f"{what} {shown(values[codes[k]])} is not a hex address"
        )
    return parsed[codes]


def _check_no_overlap(
    pointer: np.ndarray,
    is_alloc: np.ndarray,
    alloc_size: np.ndarray,
    alloc_row: np.ndarray,
    line: np.ndarray,
    path: Path,
) -> None:
    """TraceFormatError at the first allocation whose bytes overlap a live allocation's.

    The rows are matched already (every free closes a live allocation, a pointer is not live
    twice). Only allocations whose bytes overlap those of another pointer at any time can
    collide; for them, one pass in time order over the live ones kept sorted by pointer: a new
    one need only be checked against its two neighbours, as the live ones never overlap.
    """
    rows = np.flatnonzero(is_alloc)
    if not rows.size:
        return
    start, size = pointer[rows], alloc_size[rows].astype(np.uint64)
    past = np.flatnonzero(start > np.uint64(2**64 - 1) - size)
    if past.size:
        k = int(rows[past[0]])
        raise TraceFormatError(
            path,
            int(line[k]),
            f"allocate at {int(pointer[k]):#x} of {int(alloc_size[k]):,} bytes runs past the end "
            "of the address space",
        )
    end = start + size
    order = np.argsort(start, kind="stable")
    s_start, s_end = start[order], end[order]
    first = np.concatenate(
        [[True], s_start[1:] != s_start[:-1]]
    )  # first allocation of each pointer
    group = np.cumsum(first) - 1
    group_end = np.maximum.reduceat(s_end, np.flatnonzero(first))
    # uint64 throughout (pointers may pass 2**63; mixing in int64 would make floats of them)
    before_end = np.concatenate([np.zeros(1, np.uint64), np.maximum.accumulate(group_end)[:-1]])
    next_start = np.concatenate(
        [s_start[first][1:], np.full(1, np.iinfo(np.uint64).max, np.uint64)]
    )
    shared = np.empty(rows.size, bool)
    shared[order] = (before_end[group] > s_start) | (next_start[group] < s_end)
    if not shared.any():
        return
    ordinal = np.cumsum(is_alloc) - 1  # the allocation number of an alloc row
    check = np.flatnonzero(shared[ordinal[alloc_row]])
    starts: list[int] = []  # pointers of the live allocations, sorted
    live: dict[int, tuple[int, int]] = {}  # pointer -> (end, row)
    ptrs, allocs, sizes = (
        pointer[check].tolist(),
        is_alloc[check].tolist(),
        alloc_size[check].tolist(),
    )
    for j, p in enumerate(ptrs):
        k = int(check[j])
        if not allocs[j]:
            if live.pop(p, None) is not None:
                del starts[bisect_left(starts, p)]
            continue
        end = p + sizes[j]
        i = bisect_left(starts, p)
        if p in live:  # lenient: allocated again without a free; the old one is gone
            del starts[i]
            del live[p]
        other = (
            starts[i - 1]
            if i and live[starts[i - 1]][0] > p
            else (starts[i] if i < len(starts) and starts[i] < end else None)
        )
        if other is not None:
            other_end, row = live[other]
            raise TraceFormatError(
                path,
                int(line[k]),
                f"allocate at {p:#x} of {sizes[j]:,} bytes overlaps "
                f"the live allocation [{other:#x}, {other_end:#x}) of line {int(line[row])}",
            )
        starts.insert(i, p)
        live[p] = (end, k)


def _match_frees(
    pointer: np.ndarray,
    is_alloc: np.ndarray,
    is_empty: np.ndarray,
    line: np.ndarray,
    path: Path,
    lenient: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pair each free with the latest earlier allocation of the same pointer.

    An unmatched free of 0 bytes belongs to a skipped zero-byte allocation and is dropped.
    Returns ``(ids, alloc_row, keep)``: the allocation id of every row (allocations numbered in
    order), the row of the allocation each row belongs to, and which rows survive (False only for
    dropped frees).
    """
    n = pointer.size
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.ones(0, bool)
    rows = np.arange(n)
    order = np.argsort(pointer, kind="stable")  # stable: rows of one pointer stay in file order
    sp, sa = pointer[order], is_alloc[order]
    same_prev = np.concatenate([[False], sp[1:] == sp[:-1]])
    prev_alloc = same_prev & np.concatenate([[False], sa[:-1]])
    unmatched = ~sa & ~prev_alloc  # a free whose pointer is not live
    realloc = sa & prev_alloc  # an allocation of a pointer still live
    empty_unmatched = unmatched & is_empty[order]
    if not lenient:
        unmatched = unmatched & ~empty_unmatched
        problems = []
        if unmatched.any():
            k = order[unmatched].min()
            problems.append(
                (
                    k,
                    f"free of pointer {int(pointer[k]):#x}, "
                    "which is not live (no allocation since its last free)",
                )
            )
        if realloc.any():
            k = order[realloc].min()
            problems.append(
                (k, f"allocate returned pointer {int(pointer[k]):#x}, which is still live")
            )
        if problems:
            k, reason = min(problems)
            raise TraceFormatError(path, int(line[k]), reason)
    alloc_row = rows.copy()
    free_sorted = np.flatnonzero(~sa & prev_alloc)
    alloc_row[order[free_sorted]] = order[free_sorted - 1]
    keep = np.ones(n, bool)
    keep[order[unmatched | empty_unmatched]] = False
    alloc_ordinal = np.cumsum(is_alloc) - 1
    ids = alloc_ordinal[alloc_row]
    return ids, alloc_row, keep


def _rows_after_drop(alloc_row: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Row indices into the full table, renumbered for the table with ``~keep`` rows removed."""
    new_index = np.cumsum(keep) - 1
    return new_index[alloc_row]


def _streams_in_order(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stream handles to small ints in order of appearance; handle 0 (the default stream) is 0."""
    handles = pd.unique(raw)
    handles = np.concatenate([[0], handles[handles != 0]]).astype(np.uint64)
    codes = pd.Series(np.arange(handles.size), index=handles)
    return codes.reindex(raw).to_numpy(np.int64), handles
