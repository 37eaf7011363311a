"""Pareto fronts: the configurations no other beats on both memory and a second metric.

Both axes are minimised (memory overhead against latency, failures, preemptions, ...). A point
is dominated when another is no worse on both axes and better on one; equal points do not
dominate each other, so duplicates are on the front together. Rows with a missing (NaN) value
are never on a front.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from sim.serving.fit_range import RANGE_TABLE_COLUMNS

__all__ = ["pareto_mask", "pareto_front", "pareto_table", "format_fronts"]

#: Columns that are fractions, printed in percent.
_FRACTIONS = {
    "overhead",
    "failure_rate",
    "frag_ext_mean",
    "frag_ext_max",
    "internal_waste_frac",
    "kv_token_util",
    "priced_past_range_frac",
    "priced_below_range_frac",
}


def pareto_mask(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> np.ndarray:
    """Boolean mask of the non-dominated points of ``(x, y)``, both minimised; O(n log n)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    assert x.shape == y.shape and x.ndim == 1, (x.shape, y.shape)
    mask = np.zeros(len(x), dtype=bool)
    valid = np.flatnonzero(~(np.isnan(x) | np.isnan(y)))
    # Sorted by x then y, a point is dominated exactly when an earlier one has a smaller y, or
    # the same y at a smaller x (earlier points never have a larger x).
    order = valid[np.lexsort((y[valid], x[valid]))]
    best_y = np.inf
    x_at_best = np.inf  # smallest x among earlier points whose y is best_y
    for i in order.tolist():
        xi, yi = x[i], y[i]
        if yi < best_y:
            mask[i] = True
            best_y, x_at_best = yi, xi
        elif yi == best_y and not x_at_best < xi:
            mask[i] = True  # a duplicate of the point that set best_y
    return mask


def pareto_front(
    df: pd.DataFrame, x: str, y: str, *, by: Sequence[str] | None = None
) -> pd.DataFrame:
    """The rows of ``df`` on the front of columns ``x`` and ``y`` (both minimised).

    Args:
        df: a results table (``results.parquet`` of a sweep, or any summary table).
        x, y: the two columns, e.g. ``"overhead"`` and ``"alloc_p99_us"``.
        by: columns whose groups get a front each (e.g. ``["trace"]``); None: one front.

    Returns:
        The front's rows (every column of ``df``), sorted by the groups then ``x``; a row whose
        ``status`` column says it did not finish is left out.
    """
    for col in [x, y, *(by or [])]:
        if col not in df.columns:
            raise KeyError(
                f"pareto: no column {col!r} in the results; columns: "
                f"{', '.join(map(str, df.columns))}"
            )
    data = df[df["status"] == "ok"] if "status" in df.columns else df
    if not len(data):
        return data.iloc[0:0].copy()
    keep = np.zeros(len(data), dtype=bool)
    xs, ys = data[x].to_numpy(np.float64), data[y].to_numpy(np.float64)
    if by:
        for idx in data.groupby(list(by), dropna=False, sort=False).indices.values():
            keep[idx] = pareto_mask(xs[idx], ys[idx])
    else:
        keep = pareto_mask(xs, ys)
    front = data[keep]
    return front.sort_values([*(by or []), x, y], kind="stable").reset_index(drop=True)


def pareto_table(
    results: pd.DataFrame, x: str, ys: Sequence[str], *, by: Sequence[str] = ("trace",)
) -> pd.DataFrame:
    """Every front of a sweep as one tidy table (``pareto.csv``): one row per point per ``y``.

    Columns: the ``by`` columns, ``x_metric``, ``x``, ``y_metric``, ``y``, then what identifies
    the configuration (``policy``, ``cell_capacity_bytes``, any ``option_*``, ``cell_key``),
    then, when any finished cell was checked against a fitted calibration's range, its range
    columns (``sim.serving.fit_range.RANGE_TABLE_COLUMNS``: a point priced past the fit's range
    is a point the step law extrapolated).
    """
    ident = [c for c in ["policy", "cell_capacity_bytes"] if c in results.columns]
    ident += [c for c in results.columns if str(c).startswith("option_")]
    ident += [c for c in ["cell_key"] if c in results.columns]
    ok = results[results["status"] == "ok"] if "status" in results.columns else results
    ident += [c for c in RANGE_TABLE_COLUMNS if c in ok.columns and ok[c].notna().any()]
    parts = []
    for y in ys:
        front = pareto_front(results, x, y, by=list(by))
        part = front[list(by)].copy()
        part["x_metric"], part["x"], part["y_metric"], part["y"] = (
            x,
            front[x].to_numpy(),
            y,
            front[y].to_numpy(),
        )
        parts.append(pd.concat([part, front[ident]], axis=1))
    if not parts:
        return pd.DataFrame(columns=[*by, "x_metric", "x", "y_metric", "y", *ident])
    return pd.concat(parts, ignore_index=True)


def format_fronts(table: pd.DataFrame, *, by: Sequence[str] = ("trace",)) -> str:
    """The fronts of ``pareto_table`` as text for the terminal, one block per group and metric;
    its range columns (shares in percent, ``extrapolation_ratio`` as it is) after the two axes."""
    if table.empty:
        return "pareto: no finished cells"
    blocks = []
    keys = [*by, "y_metric"]
    # options every cell shares say nothing about the trade-off; those that vary are choices
    options = [
        c
        for c in table.columns
        if str(c).startswith("option_") and table[c].nunique(dropna=False) > 1
    ]
    for group, rows in table.groupby(keys, dropna=False, sort=False):
        labels = [
            f"{k.removeprefix('cell_')}={v}" for k, v in zip(by, group[:-1]) if not pd.isna(v)
        ]
        x_metric, y_metric = rows["x_metric"].iloc[0], group[-1]
        view = pd.DataFrame({"policy": rows["policy"].to_numpy()})
        if "cell_capacity_bytes" in rows:
            view["capacity"] = [_size(v) for v in rows["cell_capacity_bytes"]]
        for col in options:
            view[col[len("option_") :]] = rows[col].to_numpy()
        for metric, col in ((x_metric, "x"), (y_metric, "y")):
            values = rows[col].to_numpy(np.float64)
            if metric in _FRACTIONS:  # as the other commands print them
                view[f"{metric}_%"] = values * 100
            else:
                view[metric] = values
        for col in RANGE_TABLE_COLUMNS:
            if col in rows:
                values = rows[col].to_numpy(np.float64)
                view[f"{col}_%" if col in _FRACTIONS else col] = (
                    values * 100 if col in _FRACTIONS else values
                )
        body = view.to_string(index=False, float_format=lambda v: f"{v:.4g}")
        blocks.append(f"pareto front ({', '.join(labels)}): {x_metric} vs {y_metric}\n{body}")
    return "\n\n".join(blocks)


def _size(value) -> str:
    from policies.units import format_bytes

    if pd.isna(value):
        return "no limit"
    return format_bytes(value)
