"""Figures of the report tables: each function takes tables, returns a matplotlib ``Figure``.

One call per figure, the same in a notebook and in the HTML report (``sim.report.html``)::

    from sim.replay.schema import read_results
    from sim.report import plots
    t = read_results("poollab-out/replay")
    plots.plot_memory_over_time(t["timeseries"])

Figures are drawn on an Agg canvas without ``pyplot`` (``sim.report.plots._base``); matplotlib is
imported on the first figure, not on import. A function given a table that lacks a column it
needs raises ValueError naming the column; optional columns are drawn when present.
"""

from sim.report.plots._base import (
    SERIES_KEYS,
    column_header,
    format_value,
    missing_columns,
    with_series,
)
from sim.report.plots.compare import (
    COMPARED_MEASURES,
    differences_view,
    plot_sim_vs_gpu,
    plot_sim_vs_gpu_over_time,
    sim_gpu_differences,
    sim_gpu_pairs,
)
from sim.report.plots.latency import LATENCY_SAMPLE_COLUMNS, latency_samples, plot_alloc_latency
from sim.report.plots.memory import (
    plot_fragmentation_over_time,
    plot_memory_over_time,
    plot_peak_memory,
)
from sim.report.plots.pareto import pareto_axes, plot_pareto
from sim.report.plots.serving import (
    FAILURE_COUNTERS,
    REQUEST_METRICS,
    plot_failures,
    plot_queue_lengths,
    plot_request_latency,
)

__all__ = [
    "plot_memory_over_time",
    "plot_fragmentation_over_time",
    "plot_peak_memory",
    "plot_alloc_latency",
    "latency_samples",
    "plot_request_latency",
    "plot_queue_lengths",
    "plot_failures",
    "plot_sim_vs_gpu",
    "plot_sim_vs_gpu_over_time",
    "plot_pareto",
    "pareto_axes",
    "sim_gpu_pairs",
    "sim_gpu_differences",
    "differences_view",
    "missing_columns",
    "with_series",
    "column_header",
    "format_value",
    "figure_png",
    "SERIES_KEYS",
    "LATENCY_SAMPLE_COLUMNS",
    "REQUEST_METRICS",
    "FAILURE_COUNTERS",
    "COMPARED_MEASURES",
]


def figure_png(fig, *, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (for embedding; the figure is not closed: it holds no global
    state)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
