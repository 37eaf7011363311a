"""The report schema every backend writes: replay, the serving simulator and the GPU pool.

``summary.csv`` has one row per (trace, policy, backend) with ``SUMMARY_COLUMNS`` first (in
that order) and backend-specific columns after them; ``timeseries.parquet`` is tidy, one row
per sample, with ``TIMESERIES_COLUMNS``. Every backend builds its row with ``summary_row``
(the one place the derived columns are computed) and the rows become a DataFrame once, at the
end (``summary_frame``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from policies.base import Policy
from policies.device import VMM_STAT_KEYS
from traces.atomic import naming_errors, replacing_folder, written_files

NAN = float("nan")

__all__ = [
    "SUMMARY_COLUMNS",
    "DEVICE_COLUMNS",
    "TIMESERIES_COLUMNS",
    "summary_row",
    "params_text",
    "summary_frame",
    "write_results",
    "read_results",
    "latency_percentiles",
    "format_table",
    "invariant_warnings",
    "DEFAULT_TABLE_COLUMNS",
    "LATENCY_SAMPLE_COLUMNS",
    "latency_samples",
]

#: The columns every backend fills, in order (docs/reference/columns.md is generated from them).
SUMMARY_COLUMNS = [
    "trace",
    "policy",
    "backend",
    "params",
    "capacity_bytes",
    "n_alloc",
    "n_free",
    "n_failed",
    "failure_rate",
    "peak_live_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "overhead",
    "frag_ext_mean",
    "frag_ext_max",
    "internal_waste_frac",
    "n_grow",
    "n_shrink",
    "grown_bytes",
    "shrunk_bytes",
    "alloc_p50_us",
    "alloc_p99_us",
    "free_p50_us",
    "free_p99_us",
    "latency_sampled_frac",
    "wall_s",
]

#: Device columns every row has after ``SUMMARY_COLUMNS`` (``policies.device.VMM_STAT_KEYS``):
#: ``n_map``/``n_unmap`` (cuMemMap/cuMemUnmap calls), ``mapped_bytes`` (mapped in total),
#: ``peak_virtual_bytes`` (address space reserved at peak; a segment device's is its peak
#: reserved) and ``driver_ns_<call>`` per virtual-memory call. Zero for a segment device.
DEVICE_COLUMNS = list(VMM_STAT_KEYS)

TIMESERIES_COLUMNS = [
    "trace",
    "policy",
    "backend",
    "event",
    "time_us",
    "live_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "largest_free_bytes",
    "frag_ext",
    "num_segments",
]


def latency_percentiles(samples_ns: Iterable[float] | np.ndarray, prefix: str) -> dict[str, float]:
    """``{prefix_p50_us, prefix_p99_us}`` from nanosecond samples (NaN when there are none)."""
    a = np.asarray(samples_ns, dtype=np.float64)
    if a.size == 0:
        return {f"{prefix}_p50_us": float("nan"), f"{prefix}_p99_us": float("nan")}
    p50, p99 = np.percentile(a, [50, 99])
    return {f"{prefix}_p50_us": float(p50) / 1e3, f"{prefix}_p99_us": float(p99) / 1e3}


def params_text(params: dict[str, Any]) -> str:
    """The ``params`` column: a policy's knobs but ``capacity_bytes``, ``k=v;...`` (wrapped policies
    by spec)."""
    return ";".join(
        f"{k}={v.spec if isinstance(v, Policy) else v}"
        for k, v in params.items()
        if k != "capacity_bytes"
    )


def summary_row(
    *,
    trace: str,
    policy: str,
    backend: str,
    params: str,
    capacity_bytes: int | None,
    monitor: Any,
    alloc_ns: Any,
    free_ns: Any,
    wall_s: float,
    device_calls: dict[str, int] | None,
    **extra: Any,
) -> dict[str, Any]:
    """One summary row, ``SUMMARY_COLUMNS`` in order and then ``extra``: the one place every
    backend (replay, gpu replay, baselines, simulate) derives its columns.

    Args:
        trace, policy, backend, params, capacity_bytes: the labels (``policy`` is the
            normalised spec, or a baseline's name).
        monitor: the run's ``sim.replay.metrics.PoolMonitor`` (totals and samples).
        alloc_ns, free_ns: per-call latencies in ns.
        wall_s: the run's wall time.
        device_calls: the pool's ``device.call_stats()`` (``DEVICE_COLUMNS``: virtual-memory
            calls, bytes mapped, peak virtual bytes, driver time per call); None where no
            pool device stands behind the run (a baseline allocator): NaN.
        **extra: backend-specific columns, in the order given.

    Derived here: ``failure_rate`` (failed / attempts), ``overhead`` (peak reserved / peak live
    - 1, NaN with nothing live), ``frag_ext_mean``/``_max`` over the samples (NaN when the
    source cannot say), ``internal_waste_frac`` (time-averaged share of allocated bytes lost to
    rounding over the samples; NaN when allocated bytes are unknown), the latency percentiles
    and ``latency_sampled_frac``: the share of allocate and free calls they were taken over
    (1.0: every call timed; a long replay times a random sample,
    ``sim.replay.engine.latency_sample_mask``).
    """
    t = monitor.totals()
    samples = monitor.samples()
    live, allocated, frag = samples[:, 0], samples[:, 1], samples[:, 2]
    total_allocated = allocated.sum()
    if np.isnan(total_allocated):
        waste = NAN
    else:
        waste = float((total_allocated - live.sum()) / total_allocated) if total_allocated else 0.0
    n_attempts, n_failed, peak_live = t["n_alloc"], t["n_failed"], t["peak_live_bytes"]
    n_calls = n_attempts + t["n_free"]
    return {
        "trace": trace,
        "policy": policy,
        "backend": backend,
        "params": params,
        "capacity_bytes": capacity_bytes,
        "n_alloc": n_attempts,
        "n_free": t["n_free"],
        "n_failed": n_failed,
        "failure_rate": n_failed / n_attempts if n_attempts else 0.0,
        "peak_live_bytes": peak_live,
        "peak_allocated_bytes": t["peak_allocated_bytes"],
        "peak_reserved_bytes": t["peak_reserved_bytes"],
        "overhead": t["peak_reserved_bytes"] / peak_live - 1.0 if peak_live else NAN,
        "frag_ext_mean": float(frag.mean()) if frag.size else 0.0,
        "frag_ext_max": float(frag.max()) if frag.size else 0.0,
        "internal_waste_frac": waste,
        "n_grow": t["n_grow"],
        "n_shrink": t["n_shrink"],
        "grown_bytes": t["grown_bytes"],
        "shrunk_bytes": t["shrunk_bytes"],
        **latency_percentiles(alloc_ns, "alloc"),
        **latency_percentiles(free_ns, "free"),
        "latency_sampled_frac": (np.size(alloc_ns) + np.size(free_ns)) / n_calls
        if n_calls
        else NAN,
        "wall_s": wall_s,
        **_device_columns(device_calls, t["peak_reserved_bytes"]),
        **extra,
    }


def _device_columns(calls: dict[str, int] | None, peak_reserved_bytes: int) -> dict[str, Any]:
    if calls is None:
        return dict.fromkeys(DEVICE_COLUMNS, NAN)
    out = {k: calls[k] for k in DEVICE_COLUMNS}
    if not out[
        "peak_virtual_bytes"
    ]:  # a segment device: every reserved byte is its own address range
        out["peak_virtual_bytes"] = peak_reserved_bytes
    return out


#: One row per timed allocate or free call (all of them, or a sample: ``latency_sampled_frac``);
#: ``op`` is "alloc" or "free".
LATENCY_SAMPLE_COLUMNS = ["trace", "policy", "backend", "op", "latency_us"]

_LATENCY_OPS = ("alloc", "free")
_LABEL_COLUMNS = ("trace", "policy", "backend")


def latency_samples(results: Iterable[Any]) -> pd.DataFrame:
    """Per-call latencies of replay runs as one tidy table (``LATENCY_SAMPLE_COLUMNS``), in run
    order and, within a run, its allocations then its frees.

    Compact because it has a row per call of every run (13 policies over a 215k-event trace make
    2.8 M rows): ``latency_us`` is float32 (7 significant digits, finer than any timer's
    resolution) and the labels are categoricals (a one-byte code per row; Parquet keeps them
    dictionary-encoded, and ``read_results`` gets them back as categoricals). 8 bytes a row in
    memory, where plain strings and float64 took 78.

    Args:
        results: objects with a ``summary`` dict (``trace``, ``policy``, ``backend``) and
            ``alloc_ns``/``free_ns`` arrays: ``sim.replay.trace_replay.ReplayResult``,
            ``realgpu.replay.BaselineResult``.
    """
    labels: dict[str, dict[str, int]] = {c: {} for c in _LABEL_COLUMNS}
    codes: dict[str, list[np.ndarray]] = {c: [] for c in (*_LABEL_COLUMNS, "op")}
    latencies: list[np.ndarray] = []
    for r in results:
        for op_code, op in enumerate(_LATENCY_OPS):
            ns = np.asarray(getattr(r, f"{op}_ns"))
            latencies.append((ns / 1e3).astype(np.float32))
            for c in _LABEL_COLUMNS:
                code = labels[c].setdefault(r.summary[c], len(labels[c]))
                codes[c].append(np.full(ns.size, code, dtype=np.int16))
            codes["op"].append(np.full(ns.size, op_code, dtype=np.int16))
    names = {**{c: list(labels[c]) for c in _LABEL_COLUMNS}, "op": list(_LATENCY_OPS)}
    table = {
        c: pd.Categorical.from_codes(
            np.concatenate(codes[c]) if codes[c] else np.zeros(0, np.int16), categories=names[c]
        )
        for c in names
    }
    table["latency_us"] = np.concatenate(latencies) if latencies else np.zeros(0, np.float32)
    return pd.DataFrame(table, columns=LATENCY_SAMPLE_COLUMNS)


def summary_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows to a DataFrame with the schema's columns first; a missing schema column is a bug."""
    df = pd.DataFrame(rows)
    missing = [c for c in SUMMARY_COLUMNS if c not in df.columns]
    assert not missing, f"summary rows lack schema columns {missing}"
    extra = [c for c in df.columns if c not in SUMMARY_COLUMNS]
    return df[SUMMARY_COLUMNS + extra]


def write_results(
    out_dir: str | Path,
    summary: pd.DataFrame,
    timeseries: pd.DataFrame | None = None,
    extra_tables: dict[str, pd.DataFrame] | None = None,
    meta: dict[str, Any] | None = None,
    csv_tables: dict[str, pd.DataFrame] | None = None,
) -> Path:
    """Write ``summary.csv``, ``timeseries.parquet``, any extra tables (Parquet; ``csv_tables`` as
    CSV) and ``run.json``, all or nothing.

    Everything is written into a temporary folder beside ``out_dir`` that then takes its place
    (``traces.atomic.replacing_folder``): a run that fails, or is killed, while writing leaves
    an existing folder exactly as it was, and a run that succeeds leaves no table of an earlier
    run beside its own. What else the folder holds (a sweep's ``cells/``, the user's notes) is
    kept; a file of the user's with the name of one of these tables is refused, not replaced.
    An error without a file name (a full disk) names the table's file.
    """
    with replacing_folder(out_dir, legacy_outputs=_legacy_result_table) as out:
        with naming_errors(Path(out_dir) / "summary.csv"):
            summary.to_csv(out / "summary.csv", index=False)
        if timeseries is not None:
            with naming_errors(Path(out_dir) / "timeseries.parquet"):
                timeseries.to_parquet(out / "timeseries.parquet", index=False)
        for name, table in (extra_tables or {}).items():
            with naming_errors(Path(out_dir) / f"{name}.parquet"):
                table.to_parquet(out / f"{name}.parquet", index=False)
        for name, table in (csv_tables or {}).items():
            with naming_errors(Path(out_dir) / f"{name}.csv"):
                table.to_csv(out / f"{name}.csv", index=False)
        if meta is not None:
            with naming_errors(Path(out_dir) / "run.json"):
                (out / "run.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return Path(out_dir)


#: What a result folder written before poollab listed its files (``.poollab-files.json``) held
#: of its own besides ``*.parquet``: replaced by a new run, when the folder's run.json is poollab's.
_LEGACY_TABLES = ("summary.csv", "run.json", "pareto.csv")


def _legacy_result_table(entry: Path) -> bool:
    """Whether ``entry`` of a result folder without the list of what poollab wrote is an earlier
    run's table (replaced) rather than something the user put there (kept)."""
    if not (entry.is_file() and (entry.suffix == ".parquet" or entry.name in _LEGACY_TABLES)):
        return False
    try:
        meta = json.loads((entry.parent / "run.json").read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "command" in meta


def result_table_paths(out_dir: str | Path) -> list[Path]:
    """The Parquet tables of a result folder: those poollab wrote there (``.poollab-files.json``),
    else (a folder written before that list) every ``*.parquet``; a file the user added is no
    table."""
    out = Path(out_dir)
    written = written_files(out)
    return [p for p in sorted(out.glob("*.parquet")) if written is None or p.name in written]


def read_results(out_dir: str | Path) -> dict[str, pd.DataFrame]:
    """Read back every table of a result folder by name (``summary``, ``timeseries``, ...).

    Raises ValueError naming the file that cannot be read (not CSV/Parquet, not UTF-8).
    """
    out = Path(out_dir)
    tables = {"summary": _read_table(out / "summary.csv", pd.read_csv)}
    for p in result_table_paths(out):
        tables[p.stem] = _read_table(p, pd.read_parquet)
    return tables


def _read_table(path: Path, read) -> pd.DataFrame:
    try:
        return read(path)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except Exception as exc:  # noqa: BLE001 (pandas and pyarrow raise many types for a damaged file)
        raise ValueError(
            f"{path}: cannot read it as a result table ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]})"
        ) from None


#: What the command line prints by default.
DEFAULT_TABLE_COLUMNS = [
    "policy",
    "n_failed",
    "peak_live_bytes",
    "peak_reserved_bytes",
    "overhead",
    "frag_ext_mean",
    "internal_waste_frac",
    "n_grow",
    "alloc_p50_us",
    "alloc_p99_us",
    "free_p50_us",
]


def format_table(summary: pd.DataFrame, columns: list[str] | None = None) -> str:
    """The comparison table the command line prints: sizes in MiB, fractions in percent."""
    cols = columns or DEFAULT_TABLE_COLUMNS
    view = summary[[c for c in cols if c in summary.columns]].copy()
    rename = {}
    for c in view.columns:
        if c.endswith("_bytes"):
            view[c] = view[c] / 2**20
            rename[c] = c[: -len("_bytes")] + "_MiB"
        elif c in (
            "overhead",
            "frag_ext_mean",
            "frag_ext_max",
            "internal_waste_frac",
            "failure_rate",
            "kv_token_util",
            "gap_to_bound",
            "gap_to_planner",
            "prefix_hit_rate",
            "prefix_first_hit_rate",
            "kv_token_util_pressure",
            "slo_attainment",
            "kv_pressure_share",
            "priced_past_range_frac",
            "priced_below_range_frac",
        ):
            view[c] = view[c] * 100
            rename[c] = c + "_%"
    view = view.rename(columns=rename)
    table = view.to_string(index=False, float_format=lambda v: f"{v:,.2f}")
    return "\n".join([table, *invariant_warnings(summary)])


def invariant_warnings(summary: pd.DataFrame) -> list[str]:
    """One ``warning:`` line per row whose figures cannot all be true, so that no table prints
    such a row as if it were healthy: more bytes live at peak than the pool ever reserved (a
    pool hands out memory it does not hold: a bug in the policy or in its device)."""
    if not {"peak_live_bytes", "peak_reserved_bytes"} <= set(summary.columns):
        return []
    bad = summary[summary["peak_live_bytes"] > summary["peak_reserved_bytes"]]
    return [
        f"warning: {r.policy} ({r.backend}): "
        f"peak live {r.peak_live_bytes / 2**20:,.2f} MiB is above peak reserved "
        f"{r.peak_reserved_bytes / 2**20:,.2f} MiB: the pool handed out memory it did not hold; "
        "do not trust this row"
        for r in bad.itertuples()
    ]
