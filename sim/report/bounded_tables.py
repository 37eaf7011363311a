"""A result folder's tables read for drawing, in memory bounded by the figures, not by the run.

A replay sampled at every event writes a time series of millions of rows; a figure panel is a
few hundred pixels wide. So the report reads each Parquet table one column at a time and keeps
at most ``max_points`` rows per run (``RUN_KEYS``):

- time series: rows are cut into ``max_points`` consecutive buckets per run; a bucket keeps its
  first ``event``/``time_us`` and the maximum of every other column (peaks survive, so a
  figure never hides a spike the summary reports);
- per-call latency samples: per run and operation, the sorted values at ``max_points`` evenly
  spaced ranks (the same empirical CDF at plotting resolution), read batch by batch into a
  fixed-size histogram once a run has more calls than that (within 0.05 %; ``_LatencySketch``);
- per-request tables: only the columns the figures use, every k-th row past
  ``10 x max_points`` rows per run.

Only one column of the full table is in memory at a time (of the latency samples, one batch). Tables
the report does not draw are listed by name and not read. The summary (one row per run) is read
whole.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sim.replay.schema import _read_table

__all__ = ["RUN_KEYS", "DRAWN_TABLES", "MAX_POINTS_PER_RUN", "read_drawn_table", "read_run_series"]

#: Columns that tell one run's rows from another's within a table.
RUN_KEYS = ("trace", "policy", "backend")
#: Default rows kept per run: more than any panel has pixels across.
MAX_POINTS_PER_RUN = 2000
#: Columns a bucket keeps from its first row instead of its maximum.
_FIRST_OF_BUCKET = ("event", "time_us")
#: Per-request columns the figures draw (``sim.report.plots.serving``).
_REQUEST_COLUMNS = ("status", "ttft_s", "tpot_s", "e2e_s")


#: Rows decoded at a time: Arrow's decoding buffers stay a few MiB whatever the table's length.
_BATCH_ROWS = 1 << 16


def _batches(path: Path, columns: list[str]):
    """The table's ``columns`` in batches of ``_BATCH_ROWS`` rows."""
    import pyarrow.parquet as pq

    try:
        yield from pq.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS, columns=columns)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as exc:  # noqa: BLE001 (as sim.replay.schema._read_table: pyarrow raises many types)
        raise ValueError(
            f"{path}: cannot read it as a result table ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]})"
        ) from None


def _run_codes(
    path: Path, keys: list[str]
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Each key column as (distinct values, per-row index into them), and each row's run number
    (runs numbered in order of first appearance); no per-row strings are ever made."""
    distinct: dict[str, dict] = {k: {} for k in keys}
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    num_rows = 0
    for batch in _batches(path, keys):
        num_rows += batch.num_rows
        for k in keys:
            col = batch.column(k)
            col = col if hasattr(col, "indices") else col.dictionary_encode()
            ids = distinct[k]
            local = np.array(
                [ids.setdefault(v, len(ids)) for v in col.dictionary.to_pylist()] + [-1],
                dtype=np.int64,
            )
            idx = col.indices.to_numpy(zero_copy_only=False)
            idx = (
                np.where(np.isnan(idx), -1, idx).astype(np.int64) if idx.dtype.kind == "f" else idx
            )
            parts[k].append(local[idx])
    values, code = {}, np.zeros(num_rows, dtype=np.int64)
    for k in keys:
        if None not in distinct[k]:
            distinct[k][None] = len(distinct[k])
        dictionary = np.array(list(distinct[k]), dtype=object)
        idx = np.concatenate(parts.pop(k)) if num_rows else np.zeros(0, dtype=np.int64)
        idx[idx < 0] = distinct[k][None]
        values[k] = (dictionary, idx)
        code = code * len(dictionary) + idx
    if not num_rows:
        return values, code
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return values, rank[inverse.reshape(-1)]


def _key_values(
    keys: dict[str, tuple[np.ndarray, np.ndarray]], rows: np.ndarray
) -> dict[str, np.ndarray]:
    """The key columns at ``rows``."""
    return {k: dictionary[idx[rows]] for k, (dictionary, idx) in keys.items()}


def _column(path: Path, name: str) -> np.ndarray:
    """One column as a NumPy array; a numeric column with nulls as float64 with NaN."""
    parts = []
    for batch in _batches(path, [name]):
        col = batch.column(0)
        if col.null_count and _is_numeric(col.type):
            col = col.cast("float64")
        parts.append(col.to_numpy(zero_copy_only=False))
    if not parts:
        return np.zeros(0)
    if len({p.dtype for p in parts}) > 1:  # nulls in some batches only
        parts = [p.astype(np.float64) for p in parts]
    return np.concatenate(parts)


def _is_numeric(arrow_type) -> bool:
    import pyarrow.types as pt

    return pt.is_integer(arrow_type) or pt.is_floating(arrow_type)


def _runs(codes: np.ndarray) -> list[np.ndarray]:
    """Row positions of each run, in order of first appearance."""
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    return np.split(order, bounds) if len(order) else []


def _bucket_starts(n: int, max_points: int) -> np.ndarray:
    """Start offsets of ``max_points`` consecutive buckets covering ``n`` rows."""
    return np.searchsorted((np.arange(n) * max_points) // n, np.arange(max_points))


def _read_timeseries(path: Path, names: list[str], max_points: int) -> pd.DataFrame:
    keys = [k for k in RUN_KEYS if k in names]
    frame, codes = _run_codes(path, keys)
    runs = _runs(codes)
    del codes
    plans = [
        (rows, _bucket_starts(len(rows), max_points) if len(rows) > max_points else None)
        for rows in runs
    ]
    firsts = (
        np.concatenate([rows if starts is None else rows[starts] for rows, starts in plans])
        if plans
        else np.zeros(0, dtype=np.int64)
    )
    out = _key_values(frame, firsts)
    del frame
    for name in names:
        if name in keys:
            continue
        values = _column(path, name)
        if values.dtype.kind not in "iuf" or name in _FIRST_OF_BUCKET:
            out[name] = values[firsts]
            continue
        reduce = np.fmax if values.dtype.kind == "f" else np.maximum
        parts = [
            values[rows] if starts is None else reduce.reduceat(values[rows], starts)
            for rows, starts in plans
        ]
        out[name] = np.concatenate(parts) if parts else values[:0]
    return pd.DataFrame(out, columns=names)


#: Latency histogram bins (``_LatencySketch``): log-spaced from ``_LATENCY_LO_US`` (1 ns) to
#: ``_LATENCY_HI_US`` (100 s), each ``_LATENCY_RATIO`` wide, so a rank read from a bin is within
#: 0.05 % of the true value; ~25,000 counters per run and operation.
_LATENCY_LO_US, _LATENCY_HI_US, _LATENCY_RATIO = 1e-3, 1e8, 1.001
_LATENCY_NUM_BINS = (
    int(np.ceil(np.log(_LATENCY_HI_US / _LATENCY_LO_US) / np.log(_LATENCY_RATIO))) + 2
)  # + under, over


class _LatencySketch:
    """One run and operation's latencies, read batch by batch in memory bounded by ``max_points``.

    The values themselves while there are at most ``max_points`` of them (then the empirical
    CDF is exact, as it always was), and a log-spaced histogram (fixed bins, so its size does not
    grow with the run) with the exact minimum and maximum, from which the values at
    ``max_points`` evenly spaced ranks are read: the CDF at plotting resolution, within 0.05 %.
    """

    __slots__ = ("max_points", "values", "counts", "min", "max", "n")

    def __init__(self, max_points: int):
        self.max_points = max_points
        self.values: list[np.ndarray] | None = []
        self.counts = np.zeros(_LATENCY_NUM_BINS, dtype=np.int64)
        self.min, self.max, self.n = np.inf, -np.inf, 0

    def add(self, v: np.ndarray) -> None:
        v = v[~np.isnan(v)]
        if not len(v):
            return
        self.n += len(v)
        self.min, self.max = min(self.min, float(v.min())), max(self.max, float(v.max()))
        with np.errstate(divide="ignore", invalid="ignore"):
            b = np.floor(np.log(np.maximum(v, 0) / _LATENCY_LO_US) / np.log(_LATENCY_RATIO)) + 1
        b = np.clip(np.nan_to_num(b, nan=0.0, neginf=0.0), 0, _LATENCY_NUM_BINS - 1).astype(
            np.int64
        )
        self.counts += np.bincount(b, minlength=_LATENCY_NUM_BINS)
        if self.values is not None:
            self.values.append(np.asarray(v, dtype=np.float64))
            if self.n > self.max_points:
                self.values = None  # past the exact budget: the histogram alone from here on

    def ranked(self) -> np.ndarray:
        """The values at ``min(n, max_points)`` evenly spaced ranks, ascending."""
        if self.values is not None:
            return np.sort(np.concatenate(self.values)) if self.values else np.zeros(0)
        ranks = np.linspace(0, self.n - 1, self.max_points).round().astype(np.int64)
        bins = np.searchsorted(np.cumsum(self.counts), ranks, side="right")
        mid = _LATENCY_LO_US * _LATENCY_RATIO ** (bins - 0.5)  # a bin's geometric middle
        out = np.clip(mid, self.min, self.max)
        out[0], out[-1] = self.min, self.max  # the extremes are known exactly
        return out


def _read_latency_samples(path: Path, names: list[str], max_points: int) -> pd.DataFrame:
    """Per run and operation, the latencies at ``max_points`` evenly spaced ranks, read batch by
    batch (``_LatencySketch``): memory bounded by the number of runs, not of calls."""
    keys = [k for k in (*RUN_KEYS, "op") if k in names]
    value_col = "latency_us" if "latency_us" in names else None
    sketches: dict[tuple, _LatencySketch] = {}  # in order of first appearance
    for batch in _batches(path, keys + ([value_col] if value_col else [])):
        cols = [
            batch.column(k).dictionary_encode()
            if not hasattr(batch.column(k), "indices")
            else batch.column(k)
            for k in keys
        ]
        dicts = [c.dictionary.to_pylist() + [None] for c in cols]
        idx = [
            np.nan_to_num(
                c.indices.to_numpy(zero_copy_only=False).astype(np.float64), nan=len(d) - 1
            ).astype(np.int64)
            for c, d in zip(cols, dicts)
        ]
        code = np.zeros(batch.num_rows, dtype=np.int64)
        for i, d in zip(idx, dicts):
            code = code * len(d) + i
        distinct, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        values = batch.column(len(keys)).to_numpy(zero_copy_only=False) if value_col else None
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(distinct) + 1))
        for j in np.argsort(first, kind="stable"):
            row = first[j]
            key = tuple(d[i[row]] for d, i in zip(dicts, idx))
            sketch = sketches.get(key)
            if sketch is None:
                sketch = sketches[key] = _LatencySketch(max_points)
            if values is not None:
                sketch.add(values[order[bounds[j] : bounds[j + 1]]].astype(np.float64))
            else:
                sketch.n += int(bounds[j + 1] - bounds[j])
    parts = []
    for key, sketch in sketches.items():
        ranked = sketch.ranked() if value_col else None
        n = len(ranked) if ranked is not None else min(sketch.n, max_points)
        part = {k: np.full(n, v, dtype=object) for k, v in zip(keys, key)}
        if ranked is not None:
            part["latency_us"] = ranked
        parts.append(pd.DataFrame(part))
    return (
        pd.concat(parts, ignore_index=True)
        if parts
        else pd.DataFrame(columns=keys + ([value_col] if value_col else []))
    )


def _read_requests(path: Path, names: list[str], max_points: int) -> pd.DataFrame:
    keys = [k for k in RUN_KEYS if k in names]
    frame, codes = _run_codes(path, keys)
    limit = 10 * max_points
    kept = [
        rows if len(rows) <= limit else rows[:: -(-len(rows) // limit)] for rows in _runs(codes)
    ]
    rows = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
    out = _key_values(frame, rows)
    for name in (c for c in _REQUEST_COLUMNS if c in names):
        out[name] = _column(path, name)[rows]
    return pd.DataFrame(out)


#: The tables the report draws, and how each is read.
DRAWN_TABLES = {
    "timeseries": _read_timeseries,
    "latency_samples": _read_latency_samples,
    "requests": _read_requests,
}


def read_drawn_table(path: str | Path, max_points: int = MAX_POINTS_PER_RUN) -> pd.DataFrame | None:
    """The Parquet table at ``path`` as the report draws it (module docstring), or None when the
    report does not draw a table of that name. Raises ValueError naming a file it cannot read."""
    import pyarrow.parquet as pq

    path = Path(path)
    read = DRAWN_TABLES.get(path.stem)
    if read is None:
        return None
    names = _read_table(path, pq.read_schema).names
    names = [n for n in names if not n.startswith("__index_level_")]
    return read(path, names, max_points)


def read_run_series(
    path: str | Path, columns: list[str], order_by: str = "time_us"
) -> dict[tuple, dict[str, np.ndarray]]:
    """Every row of a time-series table, per run (``RUN_KEYS`` values as a tuple, in order of first
    appearance): the numeric ``columns`` the table has (float64, NaN for nulls), ordered by
    ``order_by``. For the page's zoom detail (``sim.report.interactive.detail``), which needs every
    row; memory is 8 bytes per row and column asked, read one column at a time. Raises ValueError
    naming a file it cannot read."""
    import pyarrow.parquet as pq

    path = Path(path)
    names = _read_table(path, pq.read_schema).names
    keys = [k for k in RUN_KEYS if k in names]
    frame, codes = _run_codes(path, keys)
    runs = _runs(codes)
    del codes
    firsts = [rows[0] for rows in runs]
    labels = [tuple(v[0] for v in _key_values(frame, np.array([r])).values()) for r in firsts]
    out: dict[tuple, dict[str, np.ndarray]] = {label: {} for label in labels}
    orders = None
    if order_by in names:
        order_values = _column(path, order_by)
        orders = [rows[np.argsort(order_values[rows], kind="stable")] for rows in runs]
        del order_values
    for name in columns:
        if name not in names:
            continue
        values = _column(path, name)
        if values.dtype.kind not in "iuf":
            continue
        for label, rows in zip(labels, orders or runs):
            out[label][name] = values[rows].astype(np.float64)
        del values
    return out
