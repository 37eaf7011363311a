"""Plotly against Bokeh and Vega-Lite (Altair) for the report's timelines: page size and load time.

Each library draws the same thing, offline (its JavaScript inlined): the report's timelines of a
result folder (reserved, live and external fragmentation over time, one line per run, three
panels on one shared, zoomable time axis, hover for values), from the very series the report
embeds (``sim.report.interactive.page.trace_data``: ``DETAIL_POINTS`` rows per run, bucket maxima).
Each page sets ``window.benchReady`` once the library has drawn (polled in the page), and
``report_load.load_times`` times navigation start to that flag in headless Chromium.

Bokeh, Altair and vl-convert are NOT poollab dependencies: install them where you run this
(``pip install bokeh altair vl-convert-python``).

Usage: python benchmarks/report_libraries.py RESULT_FOLDER [--out DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_load import load_times  # noqa: E402

from sim.report.html import load_result_folder  # noqa: E402
from sim.report.interactive.page import DETAIL_POINTS, trace_data  # noqa: E402

METRICS = (
    ("reserved", "reserved (MiB)", 2**20),
    ("live", "live (MiB)", 2**20),
    ("frag", "ext. fragmentation", 1),
)

#: Polled in each page: true once the library's drawing is in the document.
_READY = """<script>(function poll(){{if({cond}){{requestAnimationFrame(()=>{{window.benchReady=true;}});}}
else setTimeout(poll,5);}})();window.benchReady=false;</script>"""  # noqa: E501
_DRAWN = {
    "plotly": "document.querySelector('.js-plotly-plot .main-svg .scatterlayer .trace')",
    # Bokeh 3 draws into canvases inside its elements' shadow roots, once the document is embedded
    "bokeh": "window.Bokeh && Bokeh.documents && Bokeh.documents.length > 0 && "
    "document.querySelector('.bk-Column, .bk-GridPlot, .bk-Figure')",
    "vega-lite": "document.querySelector('.vega-embed canvas, .vega-embed svg.marks')",
}


def _series(folder: Path) -> list[dict]:
    """The runs of the folder's first trace, as the report embeds them."""
    f = load_result_folder(folder, max_points=DETAIL_POINTS)
    ts = f.tables["timeseries"].assign(source=f.label)
    trace = str(ts["trace"].iat[0])
    return trace_data(trace, ts[ts["trace"].astype(str) == trace], None)["runs"]


def _with_ready(html: str, library: str) -> str:
    at = html.rindex("</body>")  # the last one: inlined libraries may hold the string in their code
    return html[:at] + _READY.format(cond=_DRAWN[library]) + html[at:]


def plotly_page(runs: list[dict], out: Path) -> Path:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        subplot_titles=[m[1] for m in METRICS],
    )
    for r, run in enumerate(runs):
        for row, (key, name, scale) in enumerate(METRICS, start=1):
            y = np.asarray(run[key], dtype=float) / scale
            fig.add_trace(
                go.Scatter(
                    x=run["t"],
                    y=y,
                    name=run["label"],
                    legendgroup=run["label"],
                    showlegend=row == 1,
                    mode="lines",
                ),
                row=row,
                col=1,
            )
    fig.update_layout(height=620, hovermode="x unified")
    fig.write_html(out, include_plotlyjs=True, full_html=True)
    out.write_text(_with_ready(out.read_text(encoding="utf-8"), "plotly"), encoding="utf-8")
    return out


def bokeh_page(runs: list[dict], out: Path) -> Path:
    from bokeh.embed import file_html
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.palettes import Category10_10
    from bokeh.plotting import figure
    from bokeh.resources import INLINE

    figs = []
    for key, name, scale in METRICS:
        shared = {"x_range": figs[0].x_range} if figs else {}
        fig = figure(
            height=200,
            sizing_mode="stretch_width",
            title=name,
            tools="xpan,xwheel_zoom,box_zoom,reset",
            **shared,
        )
        for r, run in enumerate(runs):
            src = ColumnDataSource(
                {"t": run["t"], "y": [np.nan if v is None else v / scale for v in run[key]]}
            )
            fig.line("t", "y", source=src, legend_label=run["label"], color=Category10_10[r % 10])
        fig.add_tools(HoverTool(tooltips=[("t", "@t{0.000}"), (name, "@y{0,0.00}")], mode="vline"))
        figs.append(fig)
    html = file_html(column(*figs, sizing_mode="stretch_width"), INLINE, "timelines")
    out.write_text(_with_ready(html, "bokeh"), encoding="utf-8")
    return out


def vega_lite_page(runs: list[dict], out: Path) -> Path:
    import altair as alt

    alt.data_transformers.disable_max_rows()
    rows = pd.concat(
        [
            pd.DataFrame(
                {
                    "t": run["t"],
                    "run": run["label"],
                    **{key: np.asarray(run[key], dtype=float) / scale for key, _, scale in METRICS},
                }
            )
            for run in runs
        ],
        ignore_index=True,
    )
    zoom = alt.selection_interval(bind="scales", encodings=["x"])
    base = alt.Chart(rows).mark_line().encode(x=alt.X("t:Q", title="time (s)"), color="run:N")
    # field names without dots: Vega-Lite reads "a.b" as a nested field
    panels = [
        base.encode(
            y=alt.Y(f"{key}:Q", title=name), tooltip=["run:N", "t:Q", f"{key}:Q"]
        ).properties(width=1200, height=180)
        for key, name, _ in METRICS
    ]
    chart = alt.vconcat(panels[0].add_params(zoom), *panels[1:]).resolve_scale(x="shared")
    chart.save(str(out), inline=True)  # vega, vega-lite and vega-embed inlined (from vl-convert)
    out.write_text(_with_ready(out.read_text(encoding="utf-8"), "vega-lite"), encoding="utf-8")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, default=Path("/tmp/report_libraries"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = _series(args.folder)
    points = sum(len(r["t"]) for r in runs)
    pages = {
        lib: make(runs, args.out / f"{lib}.html")
        for lib, make in (
            ("plotly", plotly_page),
            ("bokeh", bokeh_page),
            ("vega-lite", vega_lite_page),
        )
    }
    timed = load_times(list(pages.values()), args.repeat)
    print(f"{args.folder}: {len(runs)} runs, {points:,} points per metric ({len(METRICS)} metrics)")
    rows = []
    for lib, path in pages.items():
        median, times, errors = timed[path]
        rows.append(
            {
                "library": lib,
                "page_mib": round(path.stat().st_size / 2**20, 2),
                "load_s": round(median, 2),
                "loads_s": [round(t, 2) for t in times],
                "errors": errors,
            }
        )
        print(json.dumps(rows[-1]))


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
