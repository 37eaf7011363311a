"""The simulator against the device: the same trace and policy run with backend ``sim`` and ``gpu``.

``sim_gpu_pairs`` finds such pairs in a summary and ``sim_gpu_differences`` lists, per pair, each
shared measure in both runs with the difference. ``sim.replay.trace_replay`` and ``realgpu.replay``
sample the same events with the same monitor, so pool measures (peaks, failures, fragmentation)
should agree exactly; latency and wall time are where the model meets the hardware. A GPU baseline
allocator (``kind`` = "baseline") named like a policy (``torch-caching``) pairs with that policy's
emulation: then every measure is a real difference.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from sim.report.plots._base import (
    byte_unit,
    column_header,
    format_value,
    grid_shape,
    hide_unused,
    legend_below,
    new_figure,
    note,
    require_columns,
    time_unit,
)

__all__ = [
    "COMPARED_MEASURES",
    "sim_gpu_pairs",
    "sim_gpu_differences",
    "differences_view",
    "plot_sim_vs_gpu",
    "plot_sim_vs_gpu_over_time",
]

#: Measures compared between a simulated and a GPU run, in the order listed.
COMPARED_MEASURES = [
    "n_failed",
    "peak_live_bytes",
    "peak_reserved_bytes",
    "overhead",
    "frag_ext_mean",
    "frag_ext_max",
    "internal_waste_frac",
    "n_grow",
    "n_shrink",
    "alloc_p50_us",
    "alloc_p99_us",
    "free_p50_us",
    "free_p99_us",
    "wall_s",
]

_SIM_COLOUR, _GPU_COLOUR = "#6baed6", "#e6550d"


def sim_gpu_pairs(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (trace, policy) run in both backends: the sim row's columns and the GPU row's.

    Columns are ``trace``, ``policy`` and every other summary column twice, suffixed ``_sim``
    and ``_gpu``. When a pair appears in several sources (``source`` column) the runs of one
    source are paired with each other; a GPU run from a source with no sim run of its own is
    paired with the only sim run there is, if there is only one.
    """
    s = require_columns(summary, ["trace", "policy", "backend"], "sim_gpu_pairs")
    sims, gpus = s[s["backend"] == "sim"], s[s["backend"] == "gpu"]
    rows = []
    for (trace, policy), gpu_runs in gpus.groupby(["trace", "policy"], sort=False):
        sim_runs = sims[(sims["trace"] == trace) & (sims["policy"] == policy)]
        for _, g in gpu_runs.iterrows():
            same = (
                sim_runs[sim_runs["source"] == g["source"]] if "source" in s.columns else sim_runs
            )
            match = same if len(same) else (sim_runs if len(sim_runs) == 1 else sim_runs.iloc[0:0])
            if len(match):
                rows.append((match.iloc[-1], g))
    cols = [c for c in s.columns if c not in ("trace", "policy")]
    out = [
        {
            "trace": g["trace"],
            "policy": g["policy"],
            **{f"{c}_sim": m[c] for c in cols},
            **{f"{c}_gpu": g[c] for c in cols},
        }
        for m, g in rows
    ]
    return pd.DataFrame(
        out, columns=["trace", "policy"] + [f"{c}_{b}" for b in ("sim", "gpu") for c in cols]
    )


def sim_gpu_differences(summary: pd.DataFrame) -> pd.DataFrame:
    """Tidy comparison: ``trace, policy, kind, measure, sim, gpu, diff, rel_diff`` per pair and
    measure.

    ``diff`` is gpu - sim and ``rel_diff`` is diff / |sim| (NaN when sim is 0 or missing).
    ``kind`` is the GPU run's kind ("policy" or "baseline") when the summary says; ``source``
    the GPU run's source when the summary has that column (else None). A measure missing on
    either side is left out for that pair.
    """
    pairs = sim_gpu_pairs(summary)
    rows = []
    for _, p in pairs.iterrows():
        kind, source = p.get("kind_gpu", "policy"), p.get("source_gpu")
        for m in COMPARED_MEASURES:
            if f"{m}_sim" not in p or f"{m}_gpu" not in p:
                continue
            a, b = (
                pd.to_numeric(p[f"{m}_sim"], errors="coerce"),
                pd.to_numeric(p[f"{m}_gpu"], errors="coerce"),
            )
            if pd.isna(a) or pd.isna(b):
                continue
            a, b = float(a), float(b)
            rows.append(
                {
                    "trace": p["trace"],
                    "policy": p["policy"],
                    "source": source,
                    "kind": kind if isinstance(kind, str) else "policy",
                    "measure": m,
                    "sim": a,
                    "gpu": b,
                    "diff": b - a,
                    "rel_diff": (b - a) / abs(a) if a else float("nan"),
                }
            )
    return pd.DataFrame(
        rows,
        columns=["trace", "policy", "source", "kind", "measure", "sim", "gpu", "diff", "rel_diff"],
    )


def _pair_labels(traces: list, policies: list, sources: list) -> list[str]:
    """``policy``, with the trace when there are several and the source when a pair repeats."""
    multi_trace = len(set(traces)) > 1
    keys = list(zip(traces, policies))
    return [
        (f"{p} · {t}" if multi_trace else str(p))
        + (f" · {s}" if keys.count((t, p)) > 1 and s else "")
        for t, p, s in zip(traces, policies, sources)
    ]


def differences_view(diffs: pd.DataFrame) -> pd.DataFrame:
    """``sim_gpu_differences`` for reading: a row per measure, a column per pair, cells ``sim → gpu
    (change)``.

    Sizes are in MiB and fractions in percent (the row names say so); the change is relative,
    ``=`` when the two are equal, or absolute when the simulated value is 0.
    """
    groups = list(diffs.groupby(["trace", "policy", "source", "kind"], sort=False, dropna=False))
    labels = _pair_labels(
        [k[0] for k, _ in groups],
        [k[1] for k, _ in groups],
        [None if pd.isna(k[2]) else k[2] for k, _ in groups],
    )
    columns: dict[str, dict[str, str]] = {}
    for ((_, _, _, kind), part), name in zip(groups, labels):
        name += " (gpu baseline)" if kind == "baseline" else ""
        cells = {}
        for r in part.itertuples(index=False):
            change = (
                "="
                if r.diff == 0
                else f"{r.rel_diff:+.1%}"
                if np.isfinite(r.rel_diff)
                else f"{r.diff:+,.3g}"
            )
            cells[column_header(r.measure)] = (
                f"{format_value(r.measure, r.sim)} → {format_value(r.measure, r.gpu)} ({change})"
            )
        columns[name] = cells
    return pd.DataFrame(columns).fillna("–").rename_axis("measure (sim → gpu)")


def plot_sim_vs_gpu(summary: pd.DataFrame, *, title: str | None = None) -> Any:
    """Side by side per paired policy: peak memory (with the device's own reading) and call latency.

    Left: peak live and peak reserved in the simulator and on the GPU, and the growth of the
    device's used memory that NVML saw (``nvml_peak_used_bytes - nvml_base_used_bytes``) when
    the GPU row has it. Right: alloc and free p50/p99 in both (log scale).
    """
    pairs = sim_gpu_pairs(summary)
    fig, axes = new_figure(1, 2, panel_w=5.2, panel_h=0.9 * max(len(pairs), 2) + 1.4)
    if pairs.empty:
        for ax in axes[0]:
            note(ax, "no trace and policy ran with both backend sim and backend gpu")
        return fig
    sources = pairs["source_gpu"].tolist() if "source_gpu" in pairs else [None] * len(pairs)
    labels = _pair_labels(pairs["trace"].tolist(), pairs["policy"].tolist(), sources)
    y = np.arange(len(pairs))
    _memory_panel(axes[0, 0], pairs, y)
    _latency_panel(axes[0, 1], pairs, y)
    for ax in axes[0]:
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
    legend_below(fig, axes, ncol=3)
    fig.suptitle(title or "Simulator vs GPU, same trace and policy", fontsize=11)
    return fig


def _col(pairs: pd.DataFrame, name: str) -> np.ndarray:
    if name not in pairs:
        return np.full(len(pairs), np.nan)
    return pd.to_numeric(pairs[name], errors="coerce").to_numpy(np.float64)


def _memory_panel(ax: Any, pairs: pd.DataFrame, y: np.ndarray) -> None:
    bars = [
        ("reserved, sim", _SIM_COLOUR, _col(pairs, "peak_reserved_bytes_sim")),
        ("reserved, gpu", _GPU_COLOUR, _col(pairs, "peak_reserved_bytes_gpu")),
    ]
    nvml = _col(pairs, "nvml_peak_used_bytes_gpu") - _col(pairs, "nvml_base_used_bytes_gpu")
    if np.isfinite(nvml).any():
        bars.append(("device use above its start (NVML), gpu", "#756bb1", nvml))
    live = _col(pairs, "peak_live_bytes_sim")
    top = np.nanmax(np.concatenate([v for *_, v in bars] + [live]))
    div, unit = byte_unit(top)
    h = 0.8 / len(bars)
    for i, (label, colour, v) in enumerate(bars):
        ax.barh(
            y - 0.4 + h * (i + 0.5), np.nan_to_num(v) / div, height=h, color=colour, label=label
        )
    ax.scatter(live / div, y, marker="|", s=300, color="black", zorder=3, label="peak live")
    ax.set_xlabel(f"peak memory ({unit})")
    ax.grid(axis="x", alpha=0.3)


def _latency_panel(ax: Any, pairs: pd.DataFrame, y: np.ndarray) -> None:
    ops = [("alloc", "o"), ("free", "s")]
    for j, (backend, colour) in enumerate((("sim", _SIM_COLOUR), ("gpu", _GPU_COLOUR))):
        for op, marker in ops:
            lo, hi = _col(pairs, f"{op}_p50_us_{backend}"), _col(pairs, f"{op}_p99_us_{backend}")
            off = (-0.25 if backend == "sim" else 0.05) + (0.0 if op == "alloc" else 0.15)
            for yi, a, b in zip(y + off, lo, hi):
                if np.isfinite(a) and np.isfinite(b):
                    ax.plot([a, b], [yi, yi], color=colour, lw=1.5, alpha=0.7)
            ax.plot(
                lo,
                y + off,
                marker,
                color=colour,
                ms=5,
                ls="none",
                label=f"{op} p50 → p99, {backend}",
            )
    ax.set_xscale("log")
    ax.set_xlabel("latency per call (µs, log)")
    ax.grid(alpha=0.3, which="both", axis="x")


def plot_sim_vs_gpu_over_time(
    timeseries: pd.DataFrame, *, max_cols: int = 3, title: str | None = None
) -> Any:
    """Reserved and live bytes over time per (trace, policy) that ran in both backends, overlaid.

    The two runs sample the same event indices, so any gap between the lines is a real
    difference in what the pool held.
    """
    ts = require_columns(
        timeseries,
        ["trace", "policy", "backend", "time_us", "live_bytes", "reserved_bytes"],
        "plot_sim_vs_gpu_over_time",
    )
    by = ["trace", "policy"] + (["source"] if "source" in ts.columns else [])
    both = ts.groupby(by, sort=False)["backend"].agg(lambda b: {"sim", "gpu"} <= set(b))
    keys = [k for k, ok in both.items() if ok]
    nrows, ncols = grid_shape(len(keys), max_cols)
    fig, axes = new_figure(nrows, ncols, panel_w=4.2, panel_h=2.7)
    if not keys:
        note(axes[0, 0], "no trace and policy ran with both backend sim and backend gpu")
        return fig
    div, unit = byte_unit(float(ts["reserved_bytes"].max()))
    t_div, tlabel = time_unit(ts["time_us"])
    labels = _pair_labels(
        [k[0] for k in keys], [k[1] for k in keys], [k[2] if len(k) > 2 else None for k in keys]
    )
    for ax, key, label in zip(axes.flat, keys, labels):
        run = ts[(ts[by] == pd.Series(key, index=by)).all(axis=1)]
        for backend, colour, ls in (("sim", _SIM_COLOUR, "-"), ("gpu", _GPU_COLOUR, "--")):
            r = run[run["backend"] == backend].sort_values("time_us")
            t = r["time_us"].to_numpy(np.float64) / t_div
            ax.step(
                t,
                r["reserved_bytes"].to_numpy(np.float64) / div,
                where="post",
                color=colour,
                ls=ls,
                lw=1.1,
                label=f"reserved, {backend}",
            )
            ax.step(
                t,
                r["live_bytes"].to_numpy(np.float64) / div,
                where="post",
                color=colour,
                ls=ls,
                lw=0.7,
                alpha=0.6,
                label=f"live, {backend}",
            )
        ax.set_title(label, fontsize=9)
        ax.set_xlabel(tlabel)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    hide_unused(axes, len(keys))
    legend_below(fig, axes)
    fig.suptitle(title or "Simulator vs GPU over time", fontsize=11)
    return fig
