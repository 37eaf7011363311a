"""The HTML report's structure: every section, images embedded, nothing fetched from anywhere."""

import base64
import re
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest

from sim.report import plots
from sim.report.html import SECTIONS, build_html_report, load_result_folder, write_html_report
from sim.replay.trace_replay import replay
from sim.replay.schema import write_results
from sim.serving.simulate import simulate_many
from traces import generate_alloc_trace
from traces.requests import RequestTrace, make_requests


class Page(HTMLParser):
    """Tags with their attributes, section ids in order, and the text of each section."""

    def __init__(self, text):
        super().__init__()
        self.tags, self.sections, self.text = [], [], {}
        self._section = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "section":
            self._section = attrs.get("id")
            self.sections.append(self._section)
            self.text[self._section] = ""

    def handle_data(self, data):
        if self._section is not None:
            self.text[self._section] += data

    def images(self, section=None):
        return [a for t, a in self.tags if t == "img"]


def section_html(page: str, sid: str) -> str:
    return re.search(rf'<section id="{sid}">(.*?)</section>', page, re.S).group(1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    trace = generate_alloc_trace(
        num_requests=6, seed=1, prompt_tokens=(32, 128), output_tokens=(8, 32)
    )
    runs = [replay(trace, spec) for spec in ("first-fit", "paged")]
    write_results(
        root / "replay",
        pd.DataFrame([r.summary for r in runs]),
        pd.concat([r.timeseries for r in runs]),
        meta={"command": "replay"},
    )
    gpu_runs = [replay(trace, "paged", backend=b) for b in ("sim", "gpu")]
    write_results(
        root / "gpu",
        pd.DataFrame([r.summary for r in gpu_runs]),
        pd.concat([r.timeseries for r in gpu_runs]),
        extra_tables={"latency_samples": plots.latency_samples(gpu_runs)},
        meta={"command": "gpu replay"},
    )
    rng = np.random.default_rng(0)
    n = 30
    requests = RequestTrace(
        make_requests(
            np.cumsum(rng.exponential(1 / 50, n)),
            rng.integers(50, 400, n),
            rng.integers(20, 200, n),
        ),
        name="synth_requests",
    )
    summary, ts, table = simulate_many(
        requests, ["best-fit", "paged"], model="Llama-3.2-1B", gpu="H200"
    )
    write_results(
        root / "simulate",
        summary,
        ts,
        extra_tables={"requests": table},
        meta={"command": "simulate", "model": "Llama-3.2-1B", "gpu": "H200"},
    )
    only_summary = root / "only_summary"
    write_results(only_summary, pd.DataFrame([runs[0].summary]))
    return root


@pytest.fixture(scope="module")
def full_page(folders):
    return build_html_report(
        [folders / "replay", folders / "simulate", folders / "gpu"], title="all <three>"
    )


def test_every_section_is_there_in_order(full_page):
    assert Page(full_page).sections == list(SECTIONS)


def test_images_are_embedded_pngs(full_page):
    images = Page(full_page).images()
    assert len(images) >= 10
    for img in images:
        assert img["src"].startswith("data:image/png;base64,")
        assert base64.b64decode(img["src"].split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
        assert img.get("alt")


def test_scripts_are_inline_only(full_page):
    """The interactive page: Plotly and its script inlined, no tag that loads from elsewhere
    (the browser test checks that no request leaves the file)."""
    page = Page(full_page)
    scripts = [attrs for t, attrs in page.tags if t == "script"]
    assert len(scripts) == 3 and not [a for a in scripts if a.get("src")]
    assert not [t for t, _ in page.tags if t in ("link", "iframe", "object", "embed")]


def test_static_page_fetches_nothing_from_elsewhere(folders):
    full_page = build_html_report(
        [folders / "replay", folders / "simulate", folders / "gpu"], interactive=False
    )
    page = Page(full_page)
    assert "the segment view is in the interactive report" in page.text["segments"]
    assert not [t for t, _ in page.tags if t in ("script", "link", "iframe", "object", "embed")]
    for tag, attrs in page.tags:
        for name in ("src", "href"):
            value = attrs.get(name) or ""
            assert value.startswith(("data:", "#")) or not value, (tag, value)
    assert "url(" not in full_page and "@import" not in full_page


def test_title_is_escaped(full_page):
    assert "<title>all &lt;three&gt;</title>" in full_page


def test_summary_has_a_table_per_trace_with_every_run(full_page):
    summary = section_html(full_page, "summary")
    for trace in ("synth_requests",):
        assert f"<h3>{trace}</h3>" in summary
    text = Page(full_page).text["summary"]
    for policy in ("first-fit", "paged", "best-fit"):
        assert policy in text
    assert "peak_reserved (MiB)" in text and "overhead (%)" in text


def test_serving_section_shows_simulations(full_page):
    serving = section_html(full_page, "serving")
    assert "<h3>synth_requests</h3>" in serving
    assert serving.count("<img") == 2  # request latency and queue lengths


def test_sim_vs_gpu_section_compares_the_pair(full_page):
    part = section_html(full_page, "sim-vs-gpu")
    assert "measure (sim → gpu)" in part and "peak_reserved (MiB)" in part
    assert part.count("<img") == 2


def test_latency_uses_per_call_samples_when_a_folder_has_them(full_page):
    part = section_html(full_page, "latency")
    assert "Per-call latency (CDF)" in part
    assert "p50 and p99 from the summary" in part  # the other traces have no samples


def test_replay_only_report_says_what_is_missing(folders):
    page = build_html_report([folders / "replay"], dpi=30)
    assert "no simulation folders" in Page(page).text["serving"]
    assert (
        "no trace and policy ran with both backend sim and backend gpu"
        in Page(page).text["sim-vs-gpu"]
    )


def test_summary_only_folder_still_reports(folders):
    page = build_html_report([folders / "only_summary"], dpi=30)
    assert "no time series for this trace" in Page(page).text["memory"]
    assert Page(page).images()  # peak memory, failures, latency from the summary


def test_folders_of_the_same_name_get_distinct_labels(folders, tmp_path):
    import shutil

    copy = tmp_path / "elsewhere" / "only_summary"
    shutil.copytree(folders / "only_summary", copy)
    text = Page(build_html_report([folders / "only_summary", copy], dpi=30)).text["summary"]
    assert "elsewhere/only_summary" in text and f"{folders.name}/only_summary" in text


def test_missing_folder_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_result_folder(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no summary.csv"):
        load_result_folder(tmp_path)


def test_summary_without_report_columns_is_a_value_error(tmp_path):
    (tmp_path / "summary.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="backend"):
        load_result_folder(tmp_path)


def test_a_wide_summary_takes_columns_without_a_fragmentation_warning(tmp_path):
    # a simulate's summary has more than 100 columns, and read_csv gives a block per column: the
    # report's added columns warned "highly fragmented" in `poollab demo` until it was consolidated
    import warnings

    names = ["trace", "policy", "backend"] + [f"c{i}" for i in range(120)]
    pd.DataFrame([["t", "p", "sim"] + list(range(120))], columns=names).to_csv(
        tmp_path / "summary.csv", index=False
    )
    summary = load_result_folder(tmp_path).tables["summary"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", pd.errors.PerformanceWarning)
        for i in range(3):
            summary[f"added{i}"] = i


def test_write_html_report_writes_the_page(folders, tmp_path):
    out = write_html_report([folders / "only_summary"], tmp_path / "sub" / "r.html")
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def _cells(table_html: str) -> list[list[str]]:
    return [
        re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row)
        for row in re.findall(r"<tr>(.*?)</tr>", table_html)
    ]


def test_two_simulations_at_different_kv_budgets_do_not_look_alike(tmp_path):
    rng = np.random.default_rng(0)
    n = 20
    requests = RequestTrace(
        make_requests(
            np.cumsum(rng.exponential(1 / 50, n)),
            rng.integers(50, 400, n),
            rng.integers(20, 200, n),
        ),
        name="synth_requests",
    )
    for name, capacity in (("small", 1 << 30), ("large", 2 << 30)):
        summary, ts, table = simulate_many(
            requests, ["paged"], model="Llama-3.2-1B", gpu="H200", kv_capacity_bytes=capacity
        )
        write_results(
            tmp_path / name,
            summary,
            ts,
            extra_tables={"requests": table},
            meta={"command": "simulate", "model": "Llama-3.2-1B", "kv_capacity_bytes": capacity},
        )
    page = build_html_report([tmp_path / "small", tmp_path / "large"], dpi=20)
    overview = {row[0]: row[-1] for row in _cells(section_html(page, "overview"))[1:]}
    assert overview == {"small": "kv_capacity_bytes=1.0 GiB", "large": "kv_capacity_bytes=2.0 GiB"}
    key_table = section_html(page, "summary").split("<details>")[0]
    rows = _cells(key_table)
    assert rows[0][:3] == ["source", "settings", "policy"]
    settings = [r[1] for r in rows[1:]]
    assert len(set(settings)) == 2 and all("kv_budget_bytes" in s for s in settings)


def test_every_column_table_starts_with_the_source(folders):
    page = build_html_report([folders / "replay", folders / "gpu"], dpi=20)
    detail = section_html(page, "summary").split("<details>")[1]
    assert _cells(detail)[0][0] == "source"


def test_a_registered_plot_becomes_a_section_after_the_built_in_ones(folders, monkeypatch):
    """ARCHITECTURE.md's "where to add a plot", done as a user would: a function from the combined
    tables of one trace to a Figure, registered once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sim.report import html as report_html

    monkeypatch.setattr(report_html, "_EXTRA_SECTIONS", {})
    seen = []

    def peak_reserved(tables, trace):
        summary = tables["summary"]
        seen.append((trace, sorted(summary["policy"])))
        fig, ax = plt.subplots()
        ax.bar(summary["policy"], summary["peak_reserved_bytes"])
        return fig

    def needs_a_column(tables, trace):
        raise ValueError("no column 'toy_bytes'")

    report_html.register_section("toy-peak", "Toy: peak reserved per policy", peak_reserved)
    report_html.register_section("toy-missing", "Toy: a column the tables lack", needs_a_column)
    with pytest.raises(ValueError, match="exists already"):
        report_html.register_section("summary", "again", peak_reserved)
    page = build_html_report([folders / "replay"], interactive=False)
    assert Page(page).sections == list(SECTIONS) + ["toy-peak", "toy-missing"]
    toy = page.split('<section id="toy-peak">')[1].split("</section>")[0]
    assert "Toy: peak reserved per policy" in toy and "data:image/png;base64," in toy
    missing = page.split('<section id="toy-missing">')[1].split("</section>")[0]
    assert (
        "not drawn (no column &#x27;toy_bytes&#x27;)" in missing
        or "not drawn (no column 'toy_bytes')" in missing
    )
    assert seen and all(policies for _, policies in seen)
