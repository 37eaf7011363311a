"""Pareto fronts as pictures: memory overhead against latency or failures, the front marked."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd

from sim.report.plots._base import (
    FRACTION_COLUMNS,
    column_header,
    new_figure,
    note,
    require_columns,
    with_series,
)
from sim.sweep.pareto import pareto_mask

__all__ = ["plot_pareto", "pareto_axes"]

#: Second axes worth a front, in order of preference; those the table has (and that vary) are drawn.
PARETO_Y = ("alloc_p99_us", "failure_rate", "ttft_p99_s", "n_preempted")


def pareto_axes(summary: pd.DataFrame, x: str = "overhead") -> list[str]:
    """The ``PARETO_Y`` columns present in ``summary`` with more than one distinct value."""
    return [
        y
        for y in PARETO_Y
        if y in summary.columns and y != x and summary[y].nunique(dropna=True) > 1
    ]


def plot_pareto(
    summary: pd.DataFrame,
    *,
    x: str = "overhead",
    ys: Sequence[str] | None = None,
    title: str | None = None,
) -> Any:
    """One panel per second axis: every run as a point, the non-dominated runs joined and named.

    Both axes are minimised (``sim.sweep.pareto.pareto_mask``); fractions are drawn in percent.

    Args:
        summary: report rows (one trace) with ``policy``, ``x`` and the ``ys`` columns.
        x: the memory axis, ``overhead`` (peak reserved / peak live - 1) by default.
        ys: second axes; by default every ``PARETO_Y`` column that varies.
    """
    s = with_series(require_columns(summary, ["policy", x], "plot_pareto"))
    ys = list(ys) if ys is not None else pareto_axes(s, x)
    fig, axes = new_figure(1, max(len(ys), 1), panel_w=5.2, panel_h=3.6)
    if not ys:
        note(axes[0, 0], "no second axis varies across these runs")
        return fig
    x_scale = 100.0 if x in FRACTION_COLUMNS else 1.0
    for ax, y in zip(axes[0], ys):
        xs = s[x].to_numpy(np.float64) * x_scale
        y_scale = 100.0 if y in FRACTION_COLUMNS else 1.0
        yv = s[y].to_numpy(np.float64) * y_scale
        front = pareto_mask(xs, yv)
        ax.scatter(xs[~front], yv[~front], s=18, color="#9ecae1", label="dominated")
        order = np.argsort(xs[front], kind="stable")
        fx, fy = xs[front][order], yv[front][order]
        ax.plot(fx, fy, "-o", color="#d62728", ms=5, lw=1.2, label="Pareto front")
        for name, px, py in zip(s["series"].to_numpy()[front][order], fx, fy):
            ax.annotate(str(name), (px, py), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.set_xlabel(column_header(x))
        ax.set_ylabel(column_header(y))
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, loc="best")
    fig.suptitle(
        title or f"Pareto fronts: {column_header(x)} against latency and failures", fontsize=11
    )
    return fig
