"""One self-contained HTML page from any mix of replay, simulation and GPU result folders.

The page embeds its figures as base64 PNGs and its style inline: no network, it opens offline
and can be mailed. By default it is interactive (``sim.report.interactive.page``): Plotly and the
page's script are inlined, the memory timeline zooms, pans and filters by time range, the
segment view shows each pool's segments at any recorded moment, tables sort by a click;
``interactive=False`` writes the static page (no scripts at all). Sections (each an ``<section
id=...>``, present even when it has nothing to show, with a line saying why): ``overview``,
``summary``, ``memory``, ``segments``, ``fragmentation``, ``failures``, ``latency``, ``serving``,
``sim-vs-gpu``. Tables from all folders are concatenated with a ``source`` column (the folder's
label) and shown per trace.
"""

from __future__ import annotations

import base64
import datetime as _dt
import errno
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from sim.report import plots
from sim.report.plots import column_header, format_value
from policies.units import format_bytes
from sim.report.bounded_tables import MAX_POINTS_PER_RUN, read_drawn_table
from sim.report.interactive.page import (
    CSS as INTERACTIVE_CSS,
    DETAIL_POINTS,
    PAGE_BUDGET_BYTES,
    attach_detail,
    read_recorded_tables,
    scripts_html,
    segments_html,
    timeline_html,
    trace_data,
)
from sim.replay.schema import _read_table, result_table_paths
from traces.atomic import replacing_file

__all__ = [
    "SECTIONS",
    "register_section",
    "ResultFolder",
    "load_result_folder",
    "combine_tables",
    "folder_settings",
    "run_settings",
    "build_html_report",
    "write_html_report",
]

#: Section ids and headings, in page order.
SECTIONS = {
    "overview": "Result folders",
    "summary": "Summary",
    "memory": "Reserved vs live memory",
    "segments": "Segment layout over time",
    "fragmentation": "External fragmentation",
    "failures": "Failures and preemptions",
    "latency": "Allocation latency",
    "serving": "Serving: request latency and queues",
    "pareto": "Pareto fronts",
    "sim-vs-gpu": "Simulator vs GPU",
}

#: Sections added by ``register_section``, after the built-in ones: id to (heading, figure).
_EXTRA_SECTIONS: dict[str, tuple[str, Callable[[dict[str, pd.DataFrame], str], Any]]] = {}


def register_section(
    sid: str, heading: str, figure: Callable[[dict[str, pd.DataFrame], str], Any]
) -> None:
    """Add a section to every report page: ``figure(tables, trace)`` draws one trace's figure (a
    matplotlib ``Figure``, e.g. a function of ``sim.report.plots``) from the combined tables
    (``summary``, ``timeseries``, ``requests``, ...: each cut to that trace); a ``ValueError`` it
    raises (a table lacks a column) becomes a note on the page, as for the built-in plots."""
    if sid in SECTIONS or sid in _EXTRA_SECTIONS:
        raise ValueError(f"report section {sid!r} exists already")
    _EXTRA_SECTIONS[sid] = (heading, figure)


def _sections() -> dict[str, str]:
    """Section ids and headings in page order: the built-in ones, then the registered ones."""
    return {**SECTIONS, **{sid: heading for sid, (heading, _) in _EXTRA_SECTIONS.items()}}


#: Summary columns shown in the main table (the full table sits below it, folded).
KEY_COLUMNS = [
    "source",
    "settings",
    "policy",
    "backend",
    "kind",
    "n_failed",
    "failure_rate",
    "peak_live_bytes",
    "peak_reserved_bytes",
    "overhead",
    "frag_ext_mean",
    "internal_waste_frac",
    "n_grow",
    "n_shrink",
    "alloc_p50_us",
    "alloc_p99_us",
    "free_p50_us",
    "free_p99_us",
    "nvml_peak_used_bytes",
    "n_finished",
    "n_rejected",
    "n_preempted",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "e2e_p99_s",
    "throughput_tok_s",
    "goodput_rps",
    "kv_token_util",
]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem auto;max-width:1200px;
padding:0 1rem;color:#222;line-height:1.4}
h1{font-size:1.6rem}h2{border-bottom:2px solid #ddd;padding-bottom:.2rem;margin-top:2.4rem}h3{font-size:1.05rem}
nav a{margin-right:1rem}table.tbl{border-collapse:collapse;font-size:.8rem;margin:.5rem 0 1rem}
.tbl th,.tbl td{border:1px solid #ddd;padding:.2rem .45rem;text-align:left;white-space:nowrap}
.tbl th{background:#f3f3f3}.tbl .num{text-align:right;font-variant-numeric:tabular-nums}
.scroll{overflow-x:auto}figure{margin:.5rem 0 1.5rem}img{max-width:100%;height:auto}
figcaption,.note{color:#555;font-size:.85rem}code{background:#f3f3f3;padding:0 .2rem}
details{margin:.3rem 0 1rem}summary{cursor:pointer;color:#333}
"""  # noqa: E501


@dataclass
class ResultFolder:
    """The tables of one result folder (``sim.replay.schema.write_results``) and its ``run.json``.

    ``tables`` holds the summary and the tables the report draws, as ``sim.report.bounded_tables``
    reads them (downsampled); ``table_names`` every table the folder has.
    """

    path: Path
    label: str
    meta: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    table_names: list[str] = field(default_factory=list)


def load_result_folder(
    path: str | Path, label: str | None = None, *, max_points: int = MAX_POINTS_PER_RUN
) -> ResultFolder:
    """Read a result folder, at most ``max_points`` drawn rows per run
    (``sim.report.bounded_tables``).

    FileNotFoundError when it is missing or has no ``summary.csv``; ValueError when its summary
    lacks ``trace``, ``policy`` or ``backend`` or a table cannot be read.
    """
    p = Path(path)
    if not (p / "summary.csv").is_file():
        reason = (
            "no such folder" if not p.exists() else "not a poollab result folder (no summary.csv)"
        )
        raise FileNotFoundError(errno.ENOENT, reason, str(p))
    # read_csv gives a block per column (pandas 3): consolidated here, or a column added later
    # warns ("highly fragmented") once a summary passes 100 columns, as a simulate's does
    tables = {"summary": _read_table(p / "summary.csv", pd.read_csv).copy()}
    names = ["summary"]
    for table_path in result_table_paths(p):
        names.append(table_path.stem)
        table = read_drawn_table(table_path, max_points)
        if table is not None:
            tables[table_path.stem] = table
    missing = [c for c in ("trace", "policy", "backend") if c not in tables["summary"].columns]
    if missing:
        raise ValueError(f"{p / 'summary.csv'}: lacks the report columns {missing}")
    meta_path = p / "run.json"
    try:
        meta = json.loads(meta_path.read_bytes()) if meta_path.is_file() else {}
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ValueError(f"{meta_path}: not a readable run.json ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(
            f"{meta_path}: not a poollab run.json (a JSON object of the run's settings), "
            f"but {_json_kind(meta)}"
        )
    return ResultFolder(path=p, label=label or p.name, meta=meta, tables=tables, table_names=names)


def _json_kind(value: Any) -> str:
    """What a JSON document is, in words: ``a list``, ``null``."""
    if value is None:
        return "null"
    return {
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }.get(type(value), type(value).__name__)


def combine_tables(folders: Iterable[ResultFolder]) -> dict[str, pd.DataFrame]:
    """Each table name across folders, concatenated, with a ``source`` column (the folder's
    label)."""
    parts: dict[str, list[pd.DataFrame]] = {}
    for f in folders:
        for name, table in f.tables.items():
            parts.setdefault(name, []).append(table.assign(source=f.label))
    return {name: pd.concat(ts, ignore_index=True) for name, ts in parts.items()}


def _unique_labels(paths: list[Path]) -> list[str]:
    names = [p.name or str(p) for p in paths]
    labels = [
        "/".join(p.resolve().parts[-2:]) if names.count(name) > 1 else name
        for p, name in zip(paths, names)
    ]
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            labels[i] = f"{label} ({seen[label]})"
    return labels


# --- pieces of the page ---


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _img(fig: Any, caption: str, dpi: int) -> str:
    data = base64.b64encode(plots.figure_png(fig, dpi=dpi)).decode("ascii")
    return (
        f'<figure><img alt="{_esc(caption)}" '
        f'src="data:image/png;base64,{data}"><figcaption>{_esc(caption)}</figcaption></figure>'
    )


def _note(text: str) -> str:
    return f'<p class="note">{_esc(text)}</p>'


def _figure(make: Callable[[], Any], caption: str, dpi: int) -> str:
    """The figure, or a note saying why it could not be drawn (a table lacks what it needs)."""
    try:
        fig = make()
    except ValueError as exc:
        return _note(f"{caption}: not drawn ({exc})")
    return _img(fig, caption, dpi)


def _table(headers: list[str], rows: list[list[str]], numeric: list[bool]) -> str:
    """An escaped HTML table; numeric columns are right-aligned."""
    head = "".join(
        f"<th{' class=num' if n else ''}>{_esc(h)}</th>" for h, n in zip(headers, numeric)
    )
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=num' if n else ''}>{_esc(v)}</td>" for v, n in zip(row, numeric))
        + "</tr>"
        for row in rows
    )
    return (
        '<div class="scroll"><table '
        f'class="tbl"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
    )


def _html_table(df: pd.DataFrame) -> str:
    """A table with sizes in MiB and fractions in percent (headers say so), NaN as a dash."""
    cols = list(df.columns)
    rows = [
        [format_value(c, v) for c, v in zip(cols, values)]
        for values in df.itertuples(index=False, name=None)
    ]
    numeric = [
        pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]) for c in cols
    ]
    return _table([column_header(c) for c in cols], rows, numeric)


def _key_view(summary: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c in KEY_COLUMNS if c in summary.columns and not summary[c].isna().all()]
    if "source" in cols and summary["source"].nunique() <= 1:
        cols.remove("source")
    if "settings" in cols and not summary["settings"].astype(bool).any():
        cols.remove("settings")
    return summary[cols]


def _source_first(table: pd.DataFrame) -> pd.DataFrame:
    """The detail view: the folder each row came from as its first column."""
    first = [c for c in ("source", "settings") if c in table.columns]
    return table[first + [c for c in table.columns if c not in first]]


def _by_trace(table: pd.DataFrame | None, trace: str) -> pd.DataFrame | None:
    if table is None or "trace" not in table.columns:
        return None
    part = table[table["trace"] == trace]
    return part if len(part) else None


# --- sections ---

#: ``run.json`` keys that say what ran rather than how (they have columns of their own).
_NOT_SETTINGS = frozenset({"command", "trace", "policies", "baselines"})
#: What the settings column shows for a folder with no other folder of its command to differ from.
_BASIC_SETTINGS = ("model", "gpu", "rate_scale", "capacity_bytes", "kv_capacity_bytes", "device")
#: Summary columns that are a run's settings: shown where runs of one policy differ in them.
_ROW_SETTINGS = (
    "params",
    "capacity_bytes",
    "kv_budget_bytes",
    "kv_strategy",
    "pool_layout",
    "preemption",
    "prefix_caching",
    "model",
    "gpu",
)


def _setting_text(key: str, value: Any) -> str:
    if key.endswith("_bytes") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{key}={format_bytes(int(value))}"
    return f"{key}={value}"


def folder_settings(folders: list[ResultFolder]) -> dict[str, dict[str, Any]]:
    """Per folder label, the ``run.json`` settings in which it differs from another folder of
    the same command (a lone folder of its command: ``_BASIC_SETTINGS``); unset ones left out."""
    by_command: dict[str, list[ResultFolder]] = {}
    for f in folders:
        by_command.setdefault(str(f.meta.get("command")), []).append(f)
    out = {}
    for group in by_command.values():
        metas = [{k: v for k, v in f.meta.items() if k not in _NOT_SETTINGS} for f in group]
        if len(group) == 1:
            keys = [k for k in _BASIC_SETTINGS if k in metas[0]]
        else:
            keys = [
                k
                for k in dict.fromkeys(k for m in metas for k in m)
                if len({json.dumps(m.get(k), sort_keys=True, default=str) for m in metas}) > 1
            ]
        for f, m in zip(group, metas):
            out[f.label] = {k: m[k] for k in keys if m.get(k) is not None}
    return out


def run_settings(summary: pd.DataFrame, by_folder: dict[str, dict[str, Any]]) -> pd.Series:
    """Each run's settings that tell it from the other runs: its folder's (``folder_settings``,
    by ``source``) and the summary's ``_ROW_SETTINGS`` in which two runs of the same trace,
    policy and backend differ, shown for every run of that trace (two runs at different KV
    budgets never look alike)."""
    cols = [c for c in _ROW_SETTINGS if c in summary.columns]
    keys = [k for k in ("policy", "backend") if k in summary.columns]
    varying: list[set[str]] = [set() for _ in range(len(summary))]
    if "trace" in summary.columns and keys and cols:
        for _, trace_rows in summary.groupby("trace", sort=False, dropna=False):
            differ = {
                c
                for _, part in trace_rows.groupby(keys, sort=False, dropna=False)
                for c in cols
                if part[c].astype(str).nunique() > 1
            }
            for i in trace_rows.index:
                varying[summary.index.get_loc(i)] = differ
    texts = []
    for (idx, row), differ in zip(summary.iterrows(), varying):
        items = dict(by_folder.get(row.get("source"), {}))
        items.update({c: row[c] for c in cols if c in differ})
        texts.append(", ".join(_setting_text(k, v) for k, v in items.items()))
    return pd.Series(texts, index=summary.index, dtype=object)


def _overview(folders: list[ResultFolder], settings: dict[str, dict[str, Any]]) -> str:
    rows = []
    for f in folders:
        s = f.tables["summary"]
        rows.append(
            {
                "folder": f.label,
                "path": str(f.path),
                "command": f.meta.get("command", "?"),
                "traces": ", ".join(map(str, s["trace"].unique())),
                "backends": ", ".join(map(str, s["backend"].unique())),
                "runs": len(s),
                "tables": ", ".join(sorted(f.table_names)),
                "settings": ", ".join(_setting_text(k, v) for k, v in settings[f.label].items()),
            }
        )
    return _html_table(pd.DataFrame(rows))


def _summary_section(summary: pd.DataFrame, trace: str) -> str:
    part = summary[summary["trace"] == trace]
    return (
        _html_table(_key_view(part))
        + "<details><summary>every column</summary>"
        + _html_table(_source_first(part.dropna(axis=1, how="all")))
        + "</details>"
    )


def _memory_section(
    t: dict[str, pd.DataFrame], trace: str, dpi: int, timeline: str | None = None
) -> str:
    """Peak memory, then the interactive ``timeline`` when given, else the static figure over
    time."""
    out = [
        _figure(
            lambda: plots.plot_peak_memory(_by_trace(t["summary"], trace)),
            "Peak live and reserved bytes",
            dpi,
        )
    ]
    ts = _by_trace(t.get("timeseries"), trace)
    if ts is None:
        out.append(_note("no time series for this trace"))
    elif timeline is not None:
        out.append(timeline)
    else:
        out.append(
            _figure(
                lambda: plots.plot_memory_over_time(ts),
                "Reserved (blue) vs live (red) bytes over time",
                dpi,
            )
        )
    return "".join(out)


def _fragmentation_section(t: dict[str, pd.DataFrame], trace: str, dpi: int) -> str:
    ts = _by_trace(t.get("timeseries"), trace)
    if ts is None:
        return _note("no time series for this trace")
    return _figure(
        lambda: plots.plot_fragmentation_over_time(ts), "External fragmentation over time", dpi
    )


def _latency_section(t: dict[str, pd.DataFrame], trace: str, dpi: int) -> str:
    samples = _by_trace(t.get("latency_samples"), trace)
    caption = (
        "Per-call latency (CDF)"
        if samples is not None
        else "Latency per run: p50 and p99 from the summary"
    )
    return _figure(
        lambda: plots.plot_alloc_latency(_by_trace(t["summary"], trace), samples), caption, dpi
    )


def _serving_section(t: dict[str, pd.DataFrame], trace: str, dpi: int) -> str:
    out = []
    requests = _by_trace(t.get("requests"), trace)
    if requests is not None:
        out.append(
            _figure(
                lambda: plots.plot_request_latency(requests),
                "TTFT, TPOT and e2e latency (CDF)",
                dpi,
            )
        )
    ts = _queue_series(t, trace)
    if ts is not None:
        out.append(_figure(lambda: plots.plot_queue_lengths(ts), "Queue lengths", dpi))
    return "".join(out)


def _queue_series(t: dict[str, pd.DataFrame], trace: str) -> pd.DataFrame | None:
    """The trace's time-series rows that have queue lengths (simulations), if any."""
    ts = _by_trace(t.get("timeseries"), trace)
    if ts is None or "running" not in ts.columns:
        return None
    ts = ts[ts["running"].notna()]
    return ts if len(ts) else None


def _pareto_section(summary: pd.DataFrame, trace: str, dpi: int) -> str:
    """Memory overhead against latency and failures, for a trace run under three or more
    configurations."""
    part = _by_trace(summary, trace)
    if part is None or len(part) < 3 or "overhead" not in part.columns:
        return _note("fewer than three runs of this trace: no front to draw")
    if not plots.pareto_axes(part):
        return _note("latency and failures do not vary across these runs")
    return _figure(
        lambda: plots.plot_pareto(part),
        "Runs no other run beats on both axes (both minimised), joined in red; "
        "a sweep (`poollab sweep`) fills these in",
        dpi,
    )


def _differences_table(diffs: pd.DataFrame) -> str:
    view = plots.differences_view(diffs).reset_index()
    return _table(list(view.columns), view.values.tolist(), [False] + [True] * (view.shape[1] - 1))


def _sim_vs_gpu_section(t: dict[str, pd.DataFrame], dpi: int) -> str:
    diffs = plots.sim_gpu_differences(t["summary"])
    if diffs.empty:
        return _note(
            "no trace and policy ran with both backend sim and backend gpu "
            "(e.g. `poollab gpu replay TRACE --sim` makes such pairs)"
        )
    out = [
        _differences_table(diffs),
        _figure(lambda: plots.plot_sim_vs_gpu(t["summary"]), "Peak memory and latency", dpi),
    ]
    ts = t.get("timeseries")
    if ts is not None:
        out.append(
            _figure(lambda: plots.plot_sim_vs_gpu_over_time(ts), "Reserved and live over time", dpi)
        )
    return "".join(out)


def build_html_report(
    dirs: Iterable[str | Path],
    *,
    title: str | None = None,
    dpi: int = 90,
    progress: bool = False,
    max_points: int = MAX_POINTS_PER_RUN,
    interactive: bool = True,
) -> str:
    """The report page for the result folders ``dirs`` (see the module docstring).

    ``interactive`` embeds the timelines and the segment view (``sim.report.interactive.page``; time
    series read at ``DETAIL_POINTS`` rows per run, at least ``max_points``, plus the zoom levels
    of longer runs in what is left of ``PAGE_BUDGET_BYTES``: ``sim.report.interactive.detail``);
    False: static PNGs only.

    ``progress`` shows a bar on stderr (when it is a terminal) that advances per folder read and
    per section drawn;
    ``max_points`` bounds the rows drawn per run (``sim.report.bounded_tables``).
    """
    paths = [Path(d) for d in dirs]
    if not paths:
        raise ValueError("build_html_report needs at least one result folder")
    from tqdm.auto import tqdm

    with tqdm(
        total=len(paths) + len(_sections()),
        desc="report",
        unit="step",
        leave=False,
        disable=None if progress else True,
    ) as bar:  # None: only on a terminal
        folders = []
        for p, label in zip(paths, _unique_labels(paths)):
            bar.set_postfix_str(label)
            folder = load_result_folder(
                p, label, max_points=max(max_points, DETAIL_POINTS) if interactive else max_points
            )
            if interactive:
                folder.tables.update(read_recorded_tables(p))
            folders.append(folder)
            bar.update()
        t = combine_tables(folders)
        t = {
            name: table.assign(trace=table["trace"].astype(str)) if "trace" in table else table
            for name, table in t.items()
        }
        settings = folder_settings(folders)
        t["summary"] = t["summary"].assign(settings=run_settings(t["summary"], settings))
        traces = list(dict.fromkeys(t["summary"]["trace"]))
        datas = (
            [
                trace_data(
                    tr,
                    _by_trace(t.get("timeseries"), tr),
                    _by_trace(t.get("layout"), tr),
                    _by_trace(t.get("compactions"), tr),
                )
                for tr in traces
            ]
            if interactive
            else []
        )
        timeline = {tr: timeline_html(i, d) for i, (tr, d) in enumerate(zip(traces, datas))}
        served = [
            tr
            for tr in traces
            if _by_trace(t.get("requests"), tr) is not None or _queue_series(t, tr) is not None
        ]

        def per_trace(render: Callable[[str], str], traces_: list[str], empty: str) -> str:
            if not traces_:
                return _note(empty)
            return "".join(f"<h3>{_esc(tr)}</h3>{render(tr)}" for tr in traces_)

        render = {
            "overview": lambda: _overview(folders, settings),
            "summary": lambda: per_trace(
                lambda tr: _summary_section(t["summary"], tr), traces, "no runs"
            ),
            "memory": lambda: per_trace(
                lambda tr: _memory_section(t, tr, dpi, timeline.get(tr)), traces, "no runs"
            ),
            "segments": lambda: (
                per_trace(
                    lambda tr: segments_html(traces.index(tr), datas[traces.index(tr)]),
                    traces,
                    "no runs",
                )
                if interactive
                else _note(
                    "the segment view is in the interactive report "
                    "(`poollab report` without --static)"
                )
            ),
            "fragmentation": lambda: per_trace(
                lambda tr: _fragmentation_section(t, tr, dpi), traces, "no runs"
            ),
            "failures": lambda: per_trace(
                lambda tr: _figure(
                    lambda: plots.plot_failures(_by_trace(t["summary"], tr)),
                    "Failure and preemption counters",
                    dpi,
                ),
                traces,
                "no runs",
            ),
            "latency": lambda: per_trace(
                lambda tr: _latency_section(t, tr, dpi), traces, "no runs"
            ),
            "serving": lambda: per_trace(
                lambda tr: _serving_section(t, tr, dpi),
                served,
                "no simulation folders (`poollab simulate` writes requests and queue lengths)",
            ),
            "pareto": lambda: per_trace(
                lambda tr: _pareto_section(t["summary"], tr, dpi), traces, "no runs"
            ),
            "sim-vs-gpu": lambda: _sim_vs_gpu_section(t, dpi),
        }
        for sid, (heading, figure) in _EXTRA_SECTIONS.items():
            render[sid] = lambda heading=heading, figure=figure: per_trace(
                lambda tr: _figure(
                    lambda: figure({n: _by_trace(x, tr) for n, x in t.items()}, tr), heading, dpi
                ),
                traces,
                "no runs",
            )
        sections_shown = _sections()
        body = {}
        for sid in sections_shown:
            bar.set_postfix_str(sid)
            body[sid] = render[sid]()
            bar.update()
    title = title or "poollab report"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nav = "".join(f'<a href="#{sid}">{_esc(name)}</a>' for sid, name in sections_shown.items())
    sections = "".join(
        f'<section id="{sid}"><h2>{_esc(heading)}</h2>{body[sid]}</section>'
        for sid, heading in sections_shown.items()
    )
    units = (
        "Sizes in MiB, fractions in percent; overhead = peak reserved / peak live − 1; "
        "external fragmentation = 1 − largest free / free; "
        "latencies in µs (allocation) or s (requests)."
    )
    if interactive:  # zoom levels in what the page has left of its budget (measured without them)
        bare = _page(title, stamp, len(folders), units, nav, sections, scripts_html(datas))
        attach_detail(
            datas,
            [(f.path, f.label) for f in folders],
            PAGE_BUDGET_BYTES - len(bare.encode("utf-8")),
        )
    return _page(
        title,
        stamp,
        len(folders),
        units,
        nav,
        sections,
        scripts_html(datas) if interactive else "",
        INTERACTIVE_CSS if interactive else "",
    )


def _page(
    title: str,
    stamp: str,
    num_folders: int,
    units: str,
    nav: str,
    sections: str,
    scripts: str,
    css: str = INTERACTIVE_CSS,
) -> str:
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_esc(title)}</title><style>{_CSS}{css}</style></head><body>"
        f'<h1>{_esc(title)}</h1><p class="note">Made {stamp} from {num_folders} result folder(s). '
        f"{_esc(units)}</p><nav>{nav}</nav>{sections}{scripts}</body></html>\n"
    )


def write_html_report(
    dirs: Iterable[str | Path],
    out_path: str | Path,
    *,
    title: str | None = None,
    progress: bool = False,
    interactive: bool = True,
) -> Path:
    """Write ``build_html_report(dirs)`` to ``out_path`` (its folder is created); returns the
    path."""
    page = build_html_report(dirs, title=title, progress=progress, interactive=interactive)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing_file(out) as tmp:  # all or nothing: a full disk leaves the old report
        tmp.write_text(page, encoding="utf-8")
    return out
