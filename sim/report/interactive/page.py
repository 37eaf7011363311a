"""The interactive parts of the report page: timelines, the segment view, sortable tables.

One page, offline: Plotly's own ``plotly.min.js`` (from the ``plotly`` package) and
``report.js`` are inlined in ``<script>`` tags, the data in one ``application/json`` script.
Plotly was chosen over Bokeh and Vega-Lite for this page (sizes and load times measured in
``benchmarks/RESULTS.md``): it is the one that ships a single offline bundle in its Python wheel,
with zoom, pan, unified hover and click events built in.

What is embedded per trace (``trace_data``):

- per run, the time series at ``DETAIL_POINTS`` rows (``sim.report.bounded_tables``: bucket maxima,
  so no peak is lost): the overview; and, for a run with more rows than that, its zoom levels
  (``sim.report.interactive.detail``: min and max per bucket, finer and finer down to the rows
  themselves as the page's byte budget allows, in gzip-compressed time chunks). The page draws
  min/max per pixel bucket of the shown time range (``bucketMinMax`` in ``report.js``) from the
  coarsest level with at least a bucket per pixel there, decoding only the chunks of that range;
- per run with a recorded layout (``layout.parquet``, ``sim.replay.layout``), its layouts,
  and the layouts taken at refusals (the failure markers: click one to see the request and
  the free blocks at that moment);
- markers: the first failure, preemption bursts (steps where running requests fell while
  none finished: the scheduler preempted) and compactions (``compactions.parquet``,
  ``sim.replay.compaction_log``: the sample at which a compacting pool's passes were seen).
"""

from __future__ import annotations

import html
import re
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "DETAIL_POINTS",
    "PAGE_BUDGET_BYTES",
    "attach_detail",
    "trace_data",
    "RECORDED_TABLES",
    "read_recorded_tables",
    "timeline_html",
    "segments_html",
    "scripts_html",
]

#: Time-series rows embedded per run: the detail the page re-buckets when zoomed.
DETAIL_POINTS = 10_000
#: Bytes a page may grow to with zoom levels (``sim.report.interactive.detail``): what the page is
#: without them is measured, and the rest is shared evenly by its runs; 1 MB short of the 20 MB a
#: page must stay under, however long the runs.
PAGE_BUDGET_BYTES = 19_000_000
#: Segment lanes drawn per run and moment (the first, by address); the totals cover all of them.
MAX_LANES = 160
#: Free holes embedded per run and moment (the largest of those in the drawn lanes: a smaller
#: one is under a pixel wide); the totals cover all of them.
MAX_HOLES = 2_000


@lru_cache(maxsize=1)
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _report_js() -> str:
    return (Path(__file__).with_name("report.js")).read_text(encoding="utf-8")


def _script(text: str, **attrs: str) -> str:
    """An inline script; ``</script`` is escaped (``<\\/script``, the same string in JS and JSON) so
    nothing inside closes the tag."""
    attr = "".join(f' {k}="{html.escape(v)}"' for k, v in attrs.items())
    body = re.sub(r"</(script)", r"<\\/\1", text, flags=re.IGNORECASE)
    return f"<script{attr}>{body}</script>"


#: Small tables a replay records besides its time series, embedded whole: the segment layouts
#: (``sim.replay.layout``: a few hundred per run) and the compaction passes
#: (``sim.replay.compaction_log``: one row per sample interval with passes).
RECORDED_TABLES = ("layout", "compactions")


def read_recorded_tables(folder: Path) -> dict[str, pd.DataFrame]:
    """The ``RECORDED_TABLES`` a result folder has, by name."""
    paths = {name: Path(folder) / f"{name}.parquet" for name in RECORDED_TABLES}
    return {name: pd.read_parquet(path) for name, path in paths.items() if path.is_file()}


def _read_detail(folder: Path, budget_bytes_per_run: int) -> dict[tuple, list]:
    """Zoom levels (``sim.report.interactive.detail``) of every run in the folder's
    ``timeseries.parquet`` with more than ``DETAIL_POINTS`` rows, by (trace, policy, backend); {}
    without that table."""
    from sim.report.bounded_tables import read_run_series
    from sim.report.interactive.detail import METRICS, detail_levels

    path = Path(folder) / "timeseries.parquet"
    if not path.is_file():
        return {}
    out = {}
    for key, series in read_run_series(path, ["time_us", *METRICS]).items():
        levels = detail_levels(
            series, overview_points=DETAIL_POINTS, budget_bytes=budget_bytes_per_run
        )
        if levels:
            out[tuple(str(k) for k in key)] = levels
    return out


def attach_detail(
    datas: list[dict[str, Any]], folders: list[tuple[Path, str]], budget_bytes: int
) -> None:
    """Give each run of ``datas`` (``trace_data``'s) its zoom levels from the result folders
    (path, label), ``budget_bytes`` shared evenly by the runs; drops the ``run_keys`` it matched
    by."""
    runs = {
        (d["trace"], *key): run for d in datas for key, run in zip(d.pop("run_keys"), d["runs"])
    }
    per_run = max(0, budget_bytes) // max(1, len(runs))
    for path, label in folders if per_run else []:
        for (trace, policy, backend), levels in _read_detail(path, per_run).items():
            run = runs.get((trace, label, policy, backend))
            if run is not None:
                run["detail"] = levels


def _run_label(row: Any, many_sources: bool) -> str:
    label = f"{row['policy']}" + (
        f" · {row['backend']}" if row["backend"] not in ("sim", "snapshot") else ""
    )
    return label + (f" ({row['source']})" if many_sources else "")


def _rounded(values: np.ndarray, digits: int = 6) -> list:
    return [None if v != v else v for v in np.round(values.astype(float), digits).tolist()]


def _samples(part: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for sample, rows in part.groupby("sample", sort=True):
        kinds = rows["kind"].to_numpy()
        ext = rows[["offset_bytes", "length_bytes"]].to_numpy(np.int64)
        request = ext[kinds == "request", 1]
        segs, free = ext[kinds == "segment"], ext[kinds == "free"]
        segs = segs[np.argsort(segs[:, 0], kind="stable")]
        totals = [
            len(segs),
            int(segs[:, 1].sum()),
            int(free[:, 1].sum()),
            int(free[:, 1].max(initial=0)),
            len(free),
        ]
        drawn = segs[:MAX_LANES]
        if len(drawn) < len(segs):
            free = free[free[:, 0] < drawn[-1].sum()]
        if len(free) > MAX_HOLES:
            free = free[np.sort(np.argsort(-free[:, 1], kind="stable")[:MAX_HOLES])]
        out.append(
            {
                "event": int(rows["event"].iat[0]),
                "t": float(rows["time_us"].iat[0]) / 1e6,
                "segs": drawn.tolist(),
                "free": free.tolist(),
                "sum": totals,
                "request": int(request[0]) if len(request) else None,
            }
        )
    return out


def _preemption_times(ts: pd.DataFrame) -> list[float]:
    """Steps where running requests fell while no request finished (the scheduler preempted)."""
    if not {"running", "finished"} <= set(ts.columns):
        return []
    rows = ts[ts["running"].notna()].sort_values("time_us")
    fell = (rows["running"].diff() < 0) & (rows["finished"].diff() <= 0)
    return sorted(set(np.round(rows.loc[fell, "time_us"].to_numpy(float) / 1e6, 6).tolist()))


def _compaction_markers(
    compactions: pd.DataFrame | None, many_sources: bool
) -> list[dict[str, Any]]:
    """One marker per recorded row (``sim.replay.compaction_log``): its time and what the passes
    did."""
    if compactions is None:
        return []
    out = [
        {
            "t": round(row["time_us"] / 1e6, 6),
            "run": _run_label(row, many_sources),
            "event": int(row["event"]),
            "num_compactions": int(row["num_compactions"]),
            "num_moves": int(row["num_moves"]),
            "moved_bytes": int(row["moved_bytes"]),
            "released_bytes": int(row["released_bytes"]),
        }
        for _, row in compactions.iterrows()
    ]
    return out


def _sampled_compactions(ts: pd.DataFrame, label: str) -> list[dict[str, Any]]:
    """Markers where a serving run's cumulative ``num_compactions`` grew (``sim.serving.server``'s
    samples)."""
    if "num_compactions" not in ts.columns:
        return []
    rows = ts[ts["num_compactions"].notna()].sort_values("time_us")
    counts = rows["num_compactions"].to_numpy(np.int64)
    moved = rows["compaction_moved_bytes"].to_numpy(np.int64)
    grew = np.flatnonzero(np.diff(counts, prepend=0) > 0)
    return [
        {
            "t": round(float(rows["time_us"].iat[k]) / 1e6, 6),
            "run": label,
            "step": int(rows["event"].iat[k]),
            "num_compactions": int(counts[k] - (counts[k - 1] if k else 0)),
            "num_moves": None,
            "moved_bytes": int(moved[k] - (moved[k - 1] if k else 0)),
            "released_bytes": None,
        }
        for k in grew
    ]


def trace_data(
    trace: str,
    timeseries: pd.DataFrame | None,
    layout: pd.DataFrame | None,
    compactions: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """What the page embeds for one trace (see the module docstring); tables carry ``source``.
    Runs' zoom levels are empty until ``attach_detail`` (which also drops ``run_keys``)."""
    runs, run_keys, layouts, failures, preempt, sampled_compactions = [], [], [], [], [], []
    many = (timeseries is not None and timeseries["source"].nunique() > 1) or (
        layout is not None and layout["source"].nunique() > 1
    )
    t_all: list[float] = []
    if timeseries is not None:
        for key, part in timeseries.groupby(["source", "policy", "backend"], sort=False):
            part = part.sort_values("time_us")
            t = part["time_us"].to_numpy(float) / 1e6
            t_all += [t.min(), t.max()]
            get = lambda c: _rounded(part[c].to_numpy()) if c in part else [None] * len(part)  # noqa: E731
            runs.append(
                {
                    "label": _run_label(part.iloc[0], many),
                    "t": _rounded(t),
                    "reserved": get("reserved_bytes"),
                    "live": get("live_bytes"),
                    "frag": get("frag_ext"),
                    "detail": [],
                }
            )
            run_keys.append([str(k) for k in key])
            preempt += _preemption_times(part)
            sampled_compactions += _sampled_compactions(part, runs[-1]["label"])
    max_seg = 1
    if layout is not None:
        for _, part in layout.groupby(["source", "policy", "backend"], sort=False):
            label = _run_label(part.iloc[0], many)
            samples = _samples(part)
            recorded = bool(part["backend"].iat[0] == "snapshot")
            layouts.append(
                {
                    "label": label,
                    "recorded": recorded,
                    # older recorded layouts have segments only (no gaps between live blocks)
                    "blocks": not recorded or bool((part["kind"] == "free").any()),
                    "samples": [s for s in samples if s["request"] is None],
                }
            )
            for s in samples:
                if s["request"] is not None:
                    failures.append(
                        {
                            "run": label,
                            "t": s["t"],
                            "event": s["event"],
                            "request_bytes": s["request"],
                            "largest_free_bytes": s["sum"][3],
                            "layout": s,
                        }
                    )
            segs = part.loc[part["kind"] == "segment", "length_bytes"]
            max_seg = max(max_seg, int(segs.max()) if len(segs) else 1)
            t_all += [part["time_us"].min() / 1e6, part["time_us"].max() / 1e6]
    failures.sort(key=lambda f: f["t"])
    t_min, t_max = (min(t_all), max(t_all)) if t_all else (0.0, 1.0)
    return {
        "trace": trace,
        "max_lanes": MAX_LANES,
        "runs": runs,
        "run_keys": run_keys,
        "layouts": layouts,
        "failures": failures,
        "first_failure": failures[0]["t"] if failures else None,
        "preemptions": sorted(set(preempt)),
        "compactions": sorted(
            _compaction_markers(compactions, many) + sampled_compactions, key=lambda m: m["t"]
        ),
        "max_segment_bytes": max_seg,
        "t_min": t_min,
        "t_max": max(t_max, t_min + 1e-6),
    }


def timeline_html(i: int, data: dict[str, Any]) -> str:
    """The time-range filter and the timeline of trace ``i``."""
    legend = (
        "Drag to zoom (double-click: all), hover for every run's values at that time, "
        "click to move the segment view there. Red dashed line: first failure; red crosses: "
        "refused requests (click one); orange dotted: preemption bursts; "
        "green triangles: compactions (hover: moves and bytes moved)."
    )
    return (
        '<div class="range">time range (s): '
        f'<input id="from-{i}" size="10"> '
        f'to <input id="to-{i}" size="10"> <button id="apply-{i}">apply</button> <button '
        f'id="reset-{i}">whole run</button></div><div id="tl-{i}" class="timeline"></div><p '
        f'class="note">{html.escape(legend)}</p><div id="fail-{i}"></div>'
    )


def segments_html(i: int, data: dict[str, Any]) -> str:
    """The segment view of trace ``i``: a slider over the recorded moments and a lane per
    segment."""
    if not data["layouts"]:
        return (
            '<p class="note">no segment layouts recorded for this trace '
            "(`poollab replay TRACE --record-layout` records them)</p>"
        )
    lanes = "".join(
        f'<div class="segrun"><h4>{html.escape(run["label"])}</h4><p class="note" '
        f'id="seginfo-{i}-{r}"></p><canvas id="segcanvas-{i}-{r}" class="segcanvas"></canvas></div>'
        for r, run in enumerate(data["layouts"])
    )
    n = len(data["layouts"][0]["samples"])
    fail = f' <button id="firstfail-{i}">first failure</button>' if data["failures"] else ""
    return (
        f'<div class="segctl"><button id="play-{i}">▶ play</button> <input type="range" '
        f'id="slider-{i}" min="0" max="{max(0, n - 1)}" value="0" step="1"> <span '
        f'id="segtime-{i}"></span>{fail}</div><p class="note">One lane per segment, '
        "widths to the same scale (the largest segment fills a lane); blue: live blocks, white: "
        "free holes, outlined red: the largest free hole "
        "(or, at a failure, the holes as large as the request). Slate grey: "
        "PyTorch's recorded segments and the live blocks in them "
        "(from the snapshot: each block at its recorded address, of the size asked, so "
        "a white gap also holds PyTorch's rounding). "
        f'The time-range filter above limits the slider.</p><div class="segruns">{lanes}</div>'
    )


def scripts_html(datas: list[dict[str, Any]]) -> str:
    """Plotly, the data and ``report.js``, inline (closes the page body)."""
    payload = json.dumps(datas, separators=(",", ":"), allow_nan=False)
    return (
        _script(_plotly_js())
        + _script(payload, type="application/json", id="poollab-data")
        + _script(_report_js())
    )


#: Styles of the interactive parts (appended to the page's own).
CSS = """
.timeline{width:100%;min-height:620px}.range{margin:.4rem 0}.range input{font:inherit}
.segruns{display:flex;flex-wrap:wrap;gap:1rem}.segrun{flex:1 1 380px;min-width:320px}.segrun h4{margin:.2rem 0}
.segcanvas{width:100%;border-left:1px solid #ccc}.segctl input[type=range]{width:50%;vertical-align:middle}
p.failure{background:#fdecea;border-left:4px solid #d62728;padding:.4rem .6rem}
th[data-sort=asc]::after{content:" ▲"}th[data-sort=desc]::after{content:" ▼"}
"""  # noqa: E501
