"""Pool memory: reserved vs live over time, external fragmentation over time, peaks per policy.

Inputs are the report's tables (``sim.replay.schema``): a time series with ``TIMESERIES_COLUMNS``
(replay, simulation or GPU) and a summary with ``SUMMARY_COLUMNS``. Runs are told apart by
``policy``, then ``backend`` and ``source`` where those differ
(``sim.report.plots._base.series_keys``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from sim.report.plots._base import (
    byte_unit,
    colours,
    grid_shape,
    hide_unused,
    legend_below,
    new_figure,
    note,
    require_columns,
    series_order,
    time_unit,
    with_series,
)

__all__ = ["plot_memory_over_time", "plot_fragmentation_over_time", "plot_peak_memory"]


def plot_memory_over_time(
    timeseries: pd.DataFrame,
    *,
    reference: float | pd.DataFrame | None = None,
    reference_label: str = "reference",
    zoom: bool = False,
    max_cols: int = 3,
    title: str | None = None,
) -> Any:
    """Reserved vs live bytes over time, one panel per run (policy, backend, source).

    Args:
        timeseries: rows with ``time_us``, ``live_bytes``, ``reserved_bytes`` and ``policy``
            (``allocated_bytes`` is drawn too when present: live plus rounding; and a
            simulation's ``kv_token_bytes``: the bytes of KV cache holding tokens).
        reference: drawn on every panel: a number of bytes (a horizontal line, e.g. the peak
            PyTorch reserved) or a frame with ``time_us`` and ``reserved_bytes`` (a step line,
            e.g. PyTorch's own reserved bytes rebuilt from its segment events).
        reference_label: the legend entry of ``reference``.
        zoom: start the y-axis just below the fewest live bytes after the first instant (when a
            trace's pre-existing allocations, e.g. the weights, are put in place) instead of at
            zero, so that a large constant floor does not hide the differences.
        max_cols: panels per row.
        title: the figure's title.

    Returns:
        A matplotlib ``Figure``; the panels share both axes so runs compare at a glance.
    """
    ts = with_series(
        require_columns(
            timeseries,
            ["time_us", "live_bytes", "reserved_bytes", "policy"],
            "plot_memory_over_time",
        )
    )
    names = series_order(ts)
    nrows, ncols = grid_shape(len(names), max_cols)
    fig, axes = new_figure(nrows, ncols, panel_w=4.2, panel_h=2.7, sharex=True, sharey=True)
    ref_max = 0.0
    if isinstance(reference, pd.DataFrame):
        require_columns(
            reference, ["time_us", "reserved_bytes"], "plot_memory_over_time(reference=)"
        )
        ref_max = float(reference["reserved_bytes"].max()) if len(reference) else 0.0
    elif reference is not None:
        ref_max = float(reference)
    top = max(
        float(np.nanmax(ts["reserved_bytes"].to_numpy(np.float64))) if len(ts) else 0.0, ref_max
    )
    div, unit = byte_unit(top)
    t_div, tlabel = time_unit(ts["time_us"])
    if not names:
        note(axes[0, 0], "no samples")
    for ax, name in zip(axes.flat, names):
        run = ts[ts["series"] == name].sort_values("time_us")
        t = run["time_us"].to_numpy(np.float64) / t_div
        reserved = run["reserved_bytes"].to_numpy(np.float64) / div
        ax.fill_between(t, 0, reserved, step="post", color="#c6dbef", label="reserved")
        ax.step(t, reserved, where="post", color="#2171b5", lw=1.0)
        if "allocated_bytes" in run and not run["allocated_bytes"].isna().all():
            ax.step(
                t,
                run["allocated_bytes"].to_numpy(np.float64) / div,
                where="post",
                color="#fd8d3c",
                lw=0.8,
                ls="--",
                label="allocated (live + rounding)",
            )
        ax.step(
            t,
            run["live_bytes"].to_numpy(np.float64) / div,
            where="post",
            color="#d62728",
            lw=1.0,
            label="live",
        )
        if (
            "kv_token_bytes" in run and not run["kv_token_bytes"].isna().all()
        ):  # simulations: KV actually in use
            ax.step(
                t,
                run["kv_token_bytes"].to_numpy(np.float64) / div,
                where="post",
                color="#31a354",
                lw=0.7,
                label="KV tokens held",
            )
        _draw_reference(ax, reference, div, t_div, reference_label)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    later = ts[ts["time_us"] > ts["time_us"].min()] if len(ts) else ts
    if zoom and len(later):
        floor = float(np.nanmin(later["live_bytes"].to_numpy(np.float64))) * 0.95
        axes[0, 0].set_ylim(floor / div, top / div * 1.03)  # the panels share their y-axis
    for ax in axes[:, 0]:
        ax.set_ylabel(unit)
    hide_unused(axes, max(len(names), 1), tlabel)
    legend_below(fig, axes)
    fig.suptitle(title or "Reserved vs live bytes over time", fontsize=11)
    return fig


def _draw_reference(
    ax: Any, reference: float | pd.DataFrame | None, div: float, t_div: float, label: str
) -> None:
    if reference is None:
        return
    if isinstance(reference, pd.DataFrame):
        ref = reference.sort_values("time_us")
        ax.step(
            ref["time_us"].to_numpy(np.float64) / t_div,
            ref["reserved_bytes"].to_numpy(np.float64) / div,
            where="post",
            color="black",
            lw=0.9,
            ls=":",
            label=label,
        )
    else:
        ax.axhline(float(reference) / div, color="black", lw=0.9, ls=":", label=label)


def plot_fragmentation_over_time(timeseries: pd.DataFrame, *, title: str | None = None) -> Any:
    """External fragmentation (``1 - largest_free / free``) over time, one line per run.

    Runs whose ``frag_ext`` is all NaN (baselines that cannot see their free ranges) are listed
    as such rather than drawn.
    """
    ts = with_series(
        require_columns(
            timeseries, ["time_us", "frag_ext", "policy"], "plot_fragmentation_over_time"
        )
    )
    names = series_order(ts)
    colour = colours(names)
    fig, axes = new_figure(1, 1, panel_w=8.0, panel_h=3.4)
    ax = axes[0, 0]
    t_div, tlabel = time_unit(ts["time_us"])
    unknown = []
    for name in names:
        run = ts[ts["series"] == name].sort_values("time_us")
        if run["frag_ext"].isna().all():
            unknown.append(name)
            continue
        ax.step(
            run["time_us"].to_numpy(np.float64) / t_div,
            run["frag_ext"].to_numpy(np.float64) * 100,
            where="post",
            lw=1.0,
            color=colour[name],
            label=name,
        )
    if len(unknown) == len(names):
        note(ax, "no fragmentation samples")
    else:
        ax.set_ylim(-2, 102)
        ax.set_xlabel(tlabel)
        ax.set_ylabel("external fragmentation (%)")
        ax.grid(alpha=0.3)
        legend_below(fig, axes)
    if unknown and len(unknown) < len(names):
        ax.set_title(f"not measured: {', '.join(unknown)}", fontsize=8, color="#555555")
    fig.suptitle(title or "External fragmentation over time (1 - largest free / free)", fontsize=11)
    return fig


def plot_peak_memory(
    summary: pd.DataFrame,
    *,
    reference_bytes: float | None = None,
    reference_label: str = "reference",
    title: str | None = None,
) -> Any:
    """Peak live and peak reserved bytes per run, the overhead (reserved / live - 1) written beside.

    Args:
        summary: rows with ``policy``, ``peak_live_bytes`` and ``peak_reserved_bytes``.
        reference_bytes: a vertical line, e.g. what PyTorch itself reserved at peak
            (``trace.meta["recorded_peak_reserved_bytes"]``); each bar's text then also gives
            the run's difference from it.
        reference_label: the legend entry of the line.
    """
    s = with_series(
        require_columns(
            summary, ["policy", "peak_live_bytes", "peak_reserved_bytes"], "plot_peak_memory"
        )
    )
    names = series_order(s)
    fig, axes = new_figure(1, 1, panel_w=8.0, panel_h=0.45 * max(len(names), 2) + 1.2)
    ax = axes[0, 0]
    if not names:
        note(ax, "no runs")
        return fig
    live = s["peak_live_bytes"].to_numpy(np.float64)
    reserved = s["peak_reserved_bytes"].to_numpy(np.float64)
    top = np.nanmax(np.concatenate([reserved, live, [reference_bytes or 0.0]]))
    div, unit = byte_unit(top)
    y = np.arange(len(s))
    ax.barh(y + 0.2, reserved / div, height=0.4, color="#6baed6", label="peak reserved")
    ax.barh(y - 0.2, live / div, height=0.4, color="#d62728", alpha=0.8, label="peak live")
    for yi, r, lv in zip(y, reserved, live):
        text = f" {r / lv - 1:+.1%} over live" if lv > 0 and np.isfinite(r) else ""
        if reference_bytes and np.isfinite(r):
            text += f", {r / reference_bytes - 1:+.1%} vs {reference_label}"
        ax.text(r / div if np.isfinite(r) else 0, yi + 0.2, text, va="center", fontsize=8)
    if reference_bytes:
        ax.axvline(reference_bytes / div, color="black", ls=":", lw=1.0, label=reference_label)
    ax.set_yticks(y, s["series"].tolist(), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_xlim(0, top / div * 1.45)
    ax.grid(axis="x", alpha=0.3)
    legend_below(fig, axes)
    fig.suptitle(title or "Peak memory per run", fontsize=11)
    return fig
