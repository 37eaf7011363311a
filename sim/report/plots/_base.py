"""What every figure shares: Agg figures without pyplot, series labels, colours, byte and time axes.

Figures are built as ``matplotlib.figure.Figure`` objects on an Agg canvas, never through
``pyplot``: no global state, no GUI backend, nothing left open, and a notebook shows the figure a
function returns exactly once. matplotlib is imported on first use only, so importing
``sim.report.plots`` (or anything that imports it) stays cheap.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

#: Columns that tell one series (one run) from another, most significant first.
SERIES_KEYS = ("policy", "backend", "source")

#: Qualitative palette (matplotlib's tab10 then tab20's light half): stable colours by first
#: appearance.
_PALETTE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
]

_BYTE_UNITS = [(2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")]


def new_figure(
    nrows: int = 1,
    ncols: int = 1,
    *,
    panel_w: float = 4.8,
    panel_h: float = 3.0,
    sharex: bool | str = False,
    sharey: bool | str = False,
) -> tuple[Any, np.ndarray]:
    """A figure on an Agg canvas and its axes as a 2-D array (``nrows`` x ``ncols``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(panel_w * ncols, panel_h * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=sharex, sharey=sharey)
    return fig, axes


def grid_shape(num_panels: int, max_cols: int) -> tuple[int, int]:
    ncols = max(1, min(num_panels, max_cols))
    return -(-max(num_panels, 1) // ncols), ncols


def hide_unused(axes: np.ndarray, used: int, xlabel: str | None = None) -> None:
    """Hide the panels past ``used``; the lowest panel left in each column gets the x ticks and
    label."""
    for ax in axes.flat[used:]:
        ax.set_visible(False)
    nrows, ncols = axes.shape
    for col in range(ncols):
        visible = [r for r in range(nrows) if r * ncols + col < used]
        if visible:
            ax = axes[visible[-1], col]
            ax.xaxis.set_tick_params(labelbottom=True)
            if xlabel:
                ax.set_xlabel(xlabel)


def missing_columns(table: pd.DataFrame | None, columns: Iterable[str]) -> list[str]:
    """The ``columns`` that ``table`` lacks (all of them when there is no table)."""
    if table is None:
        return list(columns)
    return [c for c in columns if c not in table.columns]


def require_columns(table: pd.DataFrame | None, columns: Sequence[str], what: str) -> pd.DataFrame:
    """``table`` itself, or ValueError naming the figure and the columns it needs but lacks."""
    if table is None:
        raise ValueError(f"{what} needs a table with columns {list(columns)}; got None")
    missing = missing_columns(table, columns)
    if missing:
        raise ValueError(f"{what} needs columns {missing}; the table has {list(table.columns)}")
    return table


def series_keys(table: pd.DataFrame) -> list[str]:
    """The ``SERIES_KEYS`` needed to tell this table's runs apart (always at least ``policy``)."""
    keys = [k for k in SERIES_KEYS if k in table.columns]
    needed = ["policy"] if "policy" in keys else keys[:1]
    for k in keys:
        if (
            k not in needed
            and table.groupby(needed, sort=False, dropna=False)[k].nunique(dropna=False).max() > 1
        ):
            needed.append(k)
    return needed


def with_series(table: pd.DataFrame, keys: Sequence[str] | None = None) -> pd.DataFrame:
    """A copy of ``table`` with a ``series`` column: ``policy``, plus ``backend``/``source`` if they
    differ."""
    out = table.copy()
    keys = list(keys) if keys is not None else series_keys(table)
    if not keys:
        out["series"] = "all"
        return out
    out["series"] = out[keys[0]].astype(str)
    for k in keys[1:]:
        out["series"] = out["series"] + " · " + out[k].astype(str)
    return out


def series_order(table: pd.DataFrame) -> list[str]:
    """Series names in order of first appearance (the run order)."""
    return list(dict.fromkeys(table["series"].tolist()))


def colour(i: int) -> str:
    """The ``i``-th series colour: the palette, then hues a golden angle apart at three lightness
    levels, so no two of the first 500 series share a colour (tested)."""
    if i < len(_PALETTE):
        return _PALETTE[i]
    import colorsys

    k = i - len(_PALETTE)
    hue = (0.07 + k * 0.381966) % 1.0  # golden angle: each new hue falls in the widest gap left
    lightness = (0.42, 0.30, 0.58)[k % 3]
    r, g, b = colorsys.hls_to_rgb(hue, lightness, 0.75)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def colours(names: Sequence[str]) -> dict[str, str]:
    """A distinct colour per series name, by first appearance (``colour``)."""
    return {name: colour(i) for i, name in enumerate(names)}


def byte_unit(max_bytes: float) -> tuple[float, str]:
    """``(divisor, unit)`` that puts ``max_bytes`` between 1 and 1024 of the unit."""
    if not np.isfinite(max_bytes) or max_bytes <= 0:
        return 1.0, "B"
    for size, unit in _BYTE_UNITS:
        if max_bytes >= size:
            return float(size), unit
    return 1.0, "B"


def time_unit(time_us: pd.Series) -> tuple[float, str]:
    """``(divisor, axis label)`` for microsecond times: seconds, or milliseconds for runs under a
    second."""
    t = time_us.to_numpy(np.float64)
    span_s = (np.nanmax(t) - np.nanmin(t)) / 1e6 if t.size else 0.0
    return (1e3, "time (ms)") if span_s < 1.0 else (1e6, "time (s)")


def ecdf(values: pd.Series | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted finite values and their cumulative share (0..1]."""
    a = np.asarray(values, dtype=np.float64)
    a = np.sort(a[np.isfinite(a)])
    return a, np.arange(1, a.size + 1) / max(a.size, 1)


def note(ax: Any, text: str) -> None:
    """Write ``text`` in the middle of an empty panel."""
    ax.text(
        0.5,
        0.5,
        text,
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize=9,
        color="#555555",
        wrap=True,
    )
    ax.set_xticks([])
    ax.set_yticks([])


def legend_below(fig: Any, axes: np.ndarray, ncol: int = 4) -> None:
    """One legend for the figure (the panels share their series), under the panels."""
    handles, labels = {}, []
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles and not label.startswith("_"):
                handles[label] = h
                labels.append(label)
    if labels:
        fig.legend(
            [handles[label] for label in labels],
            labels,
            loc="outside lower center",
            ncol=min(ncol, len(labels)),
            fontsize=8,
            frameon=False,
        )


#: Columns that are fractions 0..1 (shown in percent).
FRACTION_COLUMNS = frozenset(
    {
        "failure_rate",
        "overhead",
        "frag_ext_mean",
        "frag_ext_max",
        "internal_waste_frac",
        "kv_token_util",
        "prefix_hit_rate",
        "rel_diff",
    }
)


def column_header(col: str) -> str:
    """A column's name as a table shows it: ``*_bytes`` in MiB, fractions in percent."""
    if col.endswith("_bytes"):
        return col[: -len("_bytes")] + " (MiB)"
    return col + " (%)" if col in FRACTION_COLUMNS else col


def format_value(col: str, v: Any) -> str:
    """One table cell: bytes in MiB, fractions in percent, counts with separators, NaN as a dash."""
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "–"
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer, float, np.floating)):
        if col.endswith("_bytes"):
            return f"{v / 2**20:,.1f}"
        if col in FRACTION_COLUMNS:
            return f"{v * 100:,.2f}"
        if isinstance(v, (int, np.integer)) or (
            float(v).is_integer() and col.startswith(("n_", "num_"))
        ):
            return f"{int(v):,}"
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.1f}"
    return str(v)
