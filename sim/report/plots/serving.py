"""What users of a server feel, and what went wrong: TTFT/TPOT/e2e, queues, failures and
preemptions.

Inputs: a simulation's per-request table (``sim.replay.serving_metrics.REQUEST_TABLE_COLUMNS`` plus
``trace``/``policy``), its time series (``running``, ``waiting``, ``swapped`` beside the pool
columns) and any summary (replay, simulation or GPU: counters missing from a backend are
left out, not drawn as zero).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from sim.report.plots._base import (
    colours,
    ecdf,
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

__all__ = [
    "REQUEST_METRICS",
    "FAILURE_COUNTERS",
    "plot_request_latency",
    "plot_queue_lengths",
    "plot_failures",
]

#: Per-request latency columns and their titles.
REQUEST_METRICS = {
    "ttft_s": "TTFT (time to first token)",
    "tpot_s": "TPOT (time per output token)",
    "e2e_s": "end-to-end latency",
}

#: Summary counters of things that went wrong (or had to be worked around), and their titles.
FAILURE_COUNTERS = {
    "n_failed": "failed allocations",
    "n_preempted": "preemptions",
    "n_rejected": "rejected requests",
    "n_swap_outs": "swap-outs",
    "n_activation_failures": "activation allocation failures",
}


def plot_request_latency(requests: pd.DataFrame, *, title: str | None = None) -> Any:
    """CDFs of TTFT, TPOT and e2e latency over finished requests, one line per run (log x).

    TPOT is undefined for one-token outputs (NaN) and such requests are left out of its panel.
    """
    req = require_columns(requests, ["policy"], "plot_request_latency")
    metrics = [m for m in REQUEST_METRICS if m in req.columns]
    if not metrics:
        raise ValueError(
            f"plot_request_latency needs one of {list(REQUEST_METRICS)}; "
            f"the table has {list(req.columns)}"
        )
    if "status" in req.columns:
        req = req[req["status"] == "finished"]
    r = with_series(req)
    names = series_order(r)
    colour = colours(names)
    fig, axes = new_figure(1, len(metrics), panel_w=4.0, panel_h=3.1, sharey=True)
    for ax, metric in zip(axes[0], metrics):
        drawn = False
        for name in names:
            x, y = ecdf(r.loc[r["series"] == name, metric])
            keep = x > 0
            if keep.any():
                ax.step(x[keep], y[keep], where="post", color=colour[name], lw=1.0, label=name)
                drawn = True
        if drawn:
            ax.set_xscale("log")
            ax.grid(alpha=0.3, which="both")
            ax.set_xlabel(f"{metric.removesuffix('_s')} (s, log)")
        else:
            note(ax, "no finished requests")
        ax.set_title(REQUEST_METRICS[metric], fontsize=9)
    axes[0, 0].set_ylabel("share of finished requests ≤ x")
    legend_below(fig, axes)
    fig.suptitle(title or "Request latency (finished requests)", fontsize=11)
    return fig


def plot_queue_lengths(timeseries: pd.DataFrame, *, title: str | None = None) -> Any:
    """Running and waiting requests over time (and swapped ones, if any were), one line per run."""
    ts = require_columns(timeseries, ["time_us", "policy"], "plot_queue_lengths")
    queues = [q for q in ("running", "waiting", "swapped") if q in ts.columns]
    queues = [q for q in queues if q != "swapped" or (ts[q].fillna(0) > 0).any()]
    if not queues:
        raise ValueError(
            "plot_queue_lengths needs 'running' or 'waiting' columns; "
            f"the table has {list(ts.columns)}"
        )
    t = with_series(ts)
    names = series_order(t)
    colour = colours(names)
    t_div, tlabel = time_unit(t["time_us"])
    fig, axes = new_figure(len(queues), 1, panel_w=8.0, panel_h=2.3, sharex=True)
    for ax, queue in zip(axes[:, 0], queues):
        for name in names:
            run = t[t["series"] == name].sort_values("time_us")
            ax.step(
                run["time_us"].to_numpy(np.float64) / t_div,
                run[queue].to_numpy(np.float64),
                where="post",
                lw=0.9,
                color=colour[name],
                label=name,
            )
        ax.set_ylabel(f"{queue} requests")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(tlabel)
    legend_below(fig, axes)
    fig.suptitle(title or "Queue lengths over time", fontsize=11)
    return fig


def plot_failures(summary: pd.DataFrame, *, title: str | None = None, max_cols: int = 3) -> Any:
    """One bar panel per failure counter the summary has (``FAILURE_COUNTERS``), a bar per run.

    A zero is drawn and labelled (no failure is a result); a counter a backend does not report
    (NaN) is labelled "n/a", and a counter no run reports gets no panel.
    """
    s = with_series(require_columns(summary, ["policy"], "plot_failures"))
    counters = [
        c
        for c in FAILURE_COUNTERS
        if c in s.columns and pd.to_numeric(s[c], errors="coerce").notna().any()
    ]
    if not counters:
        raise ValueError(
            f"plot_failures needs one of {list(FAILURE_COUNTERS)}; the table has {list(s.columns)}"
        )
    names = series_order(s)
    colour = colours(names)
    panel_w = max(3.2, 0.4 * len(s) + 1.2)
    nrows, ncols = grid_shape(len(counters), max(1, min(max_cols, int(15 // panel_w))))
    fig, axes = new_figure(nrows, ncols, panel_w=panel_w, panel_h=2.9)
    x = np.arange(len(s))
    for ax, counter in zip(axes.flat, counters):
        values = pd.to_numeric(s[counter], errors="coerce").to_numpy(np.float64)
        ax.bar(x, np.nan_to_num(values), color=[colour[n] for n in s["series"]])
        for xi, v in zip(x, values):
            ax.text(
                xi,
                np.nan_to_num(v),
                "n/a" if np.isnan(v) else f"{v:,.0f}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_xticks(x, s["series"].tolist(), rotation=35, ha="right", fontsize=7)
        ax.set_title(FAILURE_COUNTERS[counter], fontsize=9)
        finite = values[np.isfinite(values)]
        ax.set_ylim(0, max(float(finite.max()) if finite.size else 0.0, 1.0) * 1.2)
        ax.grid(axis="y", alpha=0.3)
    hide_unused(axes, len(counters))
    fig.suptitle(title or "Failures and preemptions", fontsize=11)
    return fig
