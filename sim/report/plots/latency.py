"""Allocation latency: distributions of per-call samples, or the summary's p50 and p99.

A results folder always has the summary's ``alloc_p50_us``/``alloc_p99_us``/``free_p50_us``/
``free_p99_us``. Per-call samples are optional: a tidy table (``LATENCY_SAMPLE_COLUMNS``, one row
per call) that ``latency_samples`` builds from replay results and a folder may hold as
``latency_samples.parquet`` (``sim.replay.schema.write_results(..., extra_tables={"latency_samples":
t})``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from sim.replay.schema import LATENCY_SAMPLE_COLUMNS, latency_samples  # noqa: F401  (re-exported)
from sim.report.plots._base import (
    colours,
    ecdf,
    legend_below,
    new_figure,
    note,
    require_columns,
    series_order,
    with_series,
)

__all__ = ["LATENCY_SAMPLE_COLUMNS", "latency_samples", "plot_alloc_latency"]

_OPS = ("alloc", "free")


def plot_alloc_latency(
    summary: pd.DataFrame | None = None,
    samples: pd.DataFrame | None = None,
    *,
    title: str | None = None,
) -> Any:
    """Allocate and free latency per run: one panel per operation, log-scaled microseconds.

    With ``samples`` (``LATENCY_SAMPLE_COLUMNS``): the empirical distribution (CDF) of every
    call. Without: the summary's p50 and p99 as a range per run.

    Returns:
        A matplotlib ``Figure``. Raises ValueError when neither table has what it needs.
    """
    if samples is not None and len(samples):
        return _from_samples(
            require_columns(
                samples, ["policy", "op", "latency_us"], "plot_alloc_latency(samples=)"
            ),
            title,
        )
    if summary is None:
        raise ValueError(
            "plot_alloc_latency needs a summary (alloc_p50_us, ...) or per-call samples"
        )
    return _from_summary(
        require_columns(summary, ["policy", "alloc_p50_us", "alloc_p99_us"], "plot_alloc_latency"),
        title,
    )


def _from_samples(samples: pd.DataFrame, title: str | None) -> Any:
    s = with_series(samples)
    names = series_order(s)
    colour = colours(names)
    fig, axes = new_figure(1, 2, panel_w=4.6, panel_h=3.2, sharey=True)
    for ax, op in zip(axes[0], _OPS):
        part = s[s["op"] == op]
        drawn = False
        for name in names:
            x, y = ecdf(part.loc[part["series"] == name, "latency_us"])
            x = x[x > 0] if x.size else x
            if x.size:
                ax.step(x, y[-x.size :], where="post", color=colour[name], lw=1.0, label=name)
                drawn = True
        if drawn:
            ax.set_xscale("log")
            ax.set_xlabel(f"{op} latency (µs, log)")
            ax.grid(alpha=0.3, which="both")
        else:
            note(ax, f"no {op} samples")
        ax.set_title(op, fontsize=9)
    axes[0, 0].set_ylabel("share of calls ≤ x")
    legend_below(fig, axes)
    fig.suptitle(title or "Allocation latency per call (CDF)", fontsize=11)
    return fig


def _from_summary(summary: pd.DataFrame, title: str | None) -> Any:
    s = with_series(summary)
    names = series_order(s)
    colour = colours(names)
    fig, axes = new_figure(1, 2, panel_w=4.6, panel_h=0.4 * max(len(names), 2) + 1.3, sharey=True)
    y = np.arange(len(s))
    for ax, op in zip(axes[0], _OPS):
        lo_col, hi_col = f"{op}_p50_us", f"{op}_p99_us"
        if lo_col not in s or hi_col not in s or s[[lo_col, hi_col]].isna().all().all():
            note(ax, f"no {op} latency in the summary")
            continue
        lo, hi = s[lo_col].to_numpy(np.float64), s[hi_col].to_numpy(np.float64)
        for yi, name, a, b in zip(y, s["series"], lo, hi):
            if not (np.isfinite(a) and np.isfinite(b)):
                continue
            ax.plot([a, b], [yi, yi], color=colour[name], lw=2, alpha=0.6)
            ax.plot([a], [yi], "o", color=colour[name], ms=5, label="_")
            ax.plot([b], [yi], "|", color=colour[name], ms=10, mew=2)
            ax.text(b, yi, f"  {a:.2f} / {b:.2f}", va="center", fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel(f"{op} latency (µs, log): p50 ● to p99 |")
        ax.grid(alpha=0.3, which="both", axis="x")
        lo_x, hi_x = (
            np.nanmin(lo[lo > 0]) if (lo > 0).any() else 0.1,
            np.nanmax(hi) if np.isfinite(hi).any() else 1,
        )
        ax.set_xlim(lo_x / 2, hi_x * 6)
        ax.set_title(op, fontsize=9)
    axes[0, 0].set_yticks(y, s["series"].tolist(), fontsize=8)
    axes[0, 0].invert_yaxis()
    fig.suptitle(title or "Allocation latency per run (summary p50 and p99)", fontsize=11)
    return fig
