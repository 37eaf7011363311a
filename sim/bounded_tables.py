"""A result folder's tables read for drawing, in memory bounded by the figures, not by the run.

A replay sampled at every event writes a time series of millions of rows; a figure panel is a
few hundred pixels wide. So the report reads each Parquet table one column at a time and keeps
at most ``max_points`` rows per run (``RUN_KEYS``):

- time series: rows are cut into ``max_points`` consecutive buckets per run; a bucket keeps its
  first ``event``/``time_us`` and the maximum of every other column (peaks survive, so a
  figure never hides a spike the summary reports);
- per-call latency samples: per run and operation, the sorted values at ``max_points`` evenly
  spaced ranks (the same empirical CDF at plotting resolution);
- per-request tables: only the columns the figures use, every k-th row past
  ``10 x max_points`` rows per run.

Only one column of the full table is in memory at a time. Tables the report does not draw are
listed by name and not read. The summary (one row per run) is read whole.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sim.report import _read_table

__all__ = ["RUN_KEYS", "DRAWN_TABLES", "MAX_POINTS_PER_RUN", "read_drawn_table"]

#: Columns that tell one run's rows from another's within a table.
RUN_KEYS = ("trace", "policy", "backend")
#: Default rows kept per run: more than any panel has pixels across.
MAX_POINTS_PER_RUN = 2000
#: Columns a bucket keeps from its first row instead of its maximum.
_FIRST_OF_BUCKET = ("event", "time_us")
#: Per-request columns the figures draw (``sim.plots.serving``).
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
    except Exception as exc:  # noqa: BLE001 (as sim.report._read_table: pyarrow raises many types)
        raise ValueError(f"{path}: cannot read it as a result table ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]})") from None


def _run_codes(path: Path, keys: list[str]) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray]:
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
            local = np.array([ids.setdefault(v, len(ids)) for v in col.dictionary.to_pylist()] + [-1], dtype=np.int64)
            idx = col.indices.to_numpy(zero_copy_only=False)
            idx = np.where(np.isnan(idx), -1, idx).astype(np.int64) if idx.dtype.kind == "f" else idx
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


def _key_values(keys: dict[str, tuple[np.ndarray, np.ndarray]], rows: np.ndarray) -> dict[str, np.ndarray]:
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
    plans = [(rows, _bucket_starts(len(rows), max_points) if len(rows) > max_points else None) for rows in runs]
    firsts = np.concatenate([rows if starts is None else rows[starts] for rows, starts in plans]) if plans \
        else np.zeros(0, dtype=np.int64)
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
        parts = [values[rows] if starts is None else reduce.reduceat(values[rows], starts) for rows, starts in plans]
        out[name] = np.concatenate(parts) if parts else values[:0]
    return pd.DataFrame(out, columns=names)


def _read_latency_samples(path: Path, names: list[str], max_points: int) -> pd.DataFrame:
    keys = [k for k in (*RUN_KEYS, "op") if k in names]
    frame, codes = _run_codes(path, keys)
    values = _column(path, "latency_us") if "latency_us" in names else None
    rows_out, picked = [], []
    for rows in _runs(codes):
        if values is None:
            rows_out.append(rows[:max_points])
            continue
        v = np.sort(values[rows])
        ranks = np.linspace(0, len(v) - 1, min(len(v), max_points)).round().astype(np.int64)
        rows_out.append(np.full(len(ranks), rows[0]))
        picked.append(v[ranks])
    firsts = np.concatenate(rows_out) if rows_out else np.zeros(0, dtype=np.int64)
    out = _key_values(frame, firsts)
    if values is not None:
        out["latency_us"] = np.concatenate(picked) if picked else values[:0]
    return pd.DataFrame(out)


def _read_requests(path: Path, names: list[str], max_points: int) -> pd.DataFrame:
    keys = [k for k in RUN_KEYS if k in names]
    frame, codes = _run_codes(path, keys)
    limit = 10 * max_points
    kept = [rows if len(rows) <= limit else rows[:: -(-len(rows) // limit)] for rows in _runs(codes)]
    rows = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
    out = _key_values(frame, rows)
    for name in (c for c in _REQUEST_COLUMNS if c in names):
        out[name] = _column(path, name)[rows]
    return pd.DataFrame(out)


#: The tables the report draws, and how each is read.
DRAWN_TABLES = {"timeseries": _read_timeseries, "latency_samples": _read_latency_samples,
                "requests": _read_requests}


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
