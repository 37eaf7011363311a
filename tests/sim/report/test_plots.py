"""Figures of the report tables: what each draws, what it needs, and that importing stays light."""

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from sim.report import plots
from sim.replay.trace_replay import replay, replay_many
from sim.serving.simulate import simulate_many
from traces import generate_alloc_trace
from traces.requests import RequestTrace, make_requests

BPT = 32768  # Llama-3.2-1B: KV bytes per token


@pytest.fixture(scope="module")
def alloc_trace():
    return generate_alloc_trace(
        num_requests=6, seed=1, prompt_tokens=(32, 128), output_tokens=(8, 32)
    )


@pytest.fixture(scope="module")
def replayed(alloc_trace):
    return replay_many(alloc_trace, ["first-fit", "paged"])


@pytest.fixture(scope="module")
def simulated():
    rng = np.random.default_rng(0)
    n = 40
    trace = RequestTrace(
        make_requests(
            np.cumsum(rng.exponential(1 / 50, n)),
            rng.integers(50, 400, n),
            rng.integers(20, 200, n),
        ),
        name="synth",
    )
    return simulate_many(
        trace, ["best-fit", "paged"], model="Llama-3.2-1B", gpu="H200", kv_capacity_bytes=3000 * BPT
    )


def visible_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def test_importing_plots_does_not_import_matplotlib():
    code = (
        "import sys, sim.report.plots, sim.report.html; assert 'matplotlib' not in sys.modules, "
        "'imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_memory_over_time_has_one_panel_per_policy_titled_by_it(replayed):
    _, ts = replayed
    fig = plots.plot_memory_over_time(ts)
    assert [ax.get_title() for ax in visible_axes(fig)] == ["first-fit", "paged"]


def test_memory_over_time_draws_a_reference_on_every_panel(replayed):
    _, ts = replayed
    ref = pd.DataFrame(
        {"time_us": [0, int(ts["time_us"].max())], "reserved_bytes": [1 << 20, 2 << 20]}
    )
    fig = plots.plot_memory_over_time(ts, reference=ref, reference_label="recorded")
    for ax in visible_axes(fig):
        assert "recorded" in [line.get_label() for line in ax.get_lines()]


def test_memory_over_time_zoom_starts_below_the_live_floor(replayed):
    _, ts = replayed
    ts = pd.concat(
        [
            ts,
            ts.assign(
                time_us=ts["time_us"] + 10**6,
                live_bytes=ts["live_bytes"] + (1 << 30),
                reserved_bytes=ts["reserved_bytes"] + (1 << 30),
            ),
        ],
        ignore_index=True,
    )
    bottom, top = plots.plot_memory_over_time(ts, zoom=True).axes[0].get_ylim()
    later = ts[ts["time_us"] > ts["time_us"].min()]
    assert (
        0 < bottom * 2**30 <= later["live_bytes"].min()
        and top * 2**30 >= ts["reserved_bytes"].max()
    )
    assert plots.plot_memory_over_time(ts).axes[0].get_ylim()[0] <= 0


def test_memory_over_time_names_a_missing_column(replayed):
    _, ts = replayed
    with pytest.raises(ValueError, match="reserved_bytes"):
        plots.plot_memory_over_time(ts.drop(columns=["reserved_bytes"]))


def test_series_add_backend_only_where_policies_repeat(replayed):
    summary, _ = replayed
    assert plots.with_series(summary)["series"].tolist() == ["first-fit", "paged"]
    both = pd.concat([summary, summary.assign(backend="gpu")], ignore_index=True)
    assert plots.with_series(both)["series"].tolist() == [
        "first-fit · sim",
        "paged · sim",
        "first-fit · gpu",
        "paged · gpu",
    ]


def test_series_add_the_source_when_backend_does_not_tell_runs_apart(replayed):
    summary, _ = replayed
    two = pd.concat([summary.assign(source="a"), summary.assign(source="b")], ignore_index=True)
    assert plots.with_series(two)["series"].tolist() == [
        "first-fit · a",
        "paged · a",
        "first-fit · b",
        "paged · b",
    ]


def test_fragmentation_skips_runs_that_cannot_measure_it(replayed):
    _, ts = replayed
    blind = ts[ts["policy"] == "paged"].assign(policy="cuda-malloc", frag_ext=np.nan)
    fig = plots.plot_fragmentation_over_time(pd.concat([ts, blind], ignore_index=True))
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["first-fit", "paged"]
    assert "cuda-malloc" in ax.get_title()


def test_peak_memory_writes_overhead_and_difference_from_reference(replayed):
    summary, _ = replayed
    ref = float(summary["peak_reserved_bytes"].iloc[0])
    fig = plots.plot_peak_memory(summary, reference_bytes=ref, reference_label="PyTorch")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any("+0.0% vs PyTorch" in t for t in texts)
    overhead = summary["overhead"].iloc[0]
    assert any(f"{overhead:+.1%} over live" in t for t in texts)


def test_alloc_latency_from_summary_marks_p50_and_p99(replayed):
    summary, _ = replayed
    fig = plots.plot_alloc_latency(summary)
    alloc_ax = fig.axes[0]
    xs = sorted(x for line in alloc_ax.get_lines() for x in line.get_xdata())
    assert summary["alloc_p50_us"].min() in xs and summary["alloc_p99_us"].max() in xs


def test_latency_samples_has_one_row_per_call(alloc_trace):
    result = replay(alloc_trace, "best-fit")
    samples = plots.latency_samples([result])
    assert list(samples.columns) == plots.LATENCY_SAMPLE_COLUMNS
    assert (samples["op"] == "alloc").sum() == len(result.alloc_ns)
    assert (samples["op"] == "free").sum() == len(result.free_ns)
    assert np.allclose(samples.loc[samples["op"] == "alloc", "latency_us"], result.alloc_ns / 1e3)


def test_alloc_latency_from_samples_is_a_cdf_per_run(alloc_trace):
    samples = plots.latency_samples([replay(alloc_trace, s) for s in ("first-fit", "size-class")])
    fig = plots.plot_alloc_latency(samples=samples)
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["first-fit", "size-class"]
    for line in lines:
        y = np.asarray(line.get_ydata())
        assert y[-1] == pytest.approx(1.0) and np.all(np.diff(y) >= 0)


def test_alloc_latency_without_any_table_is_an_error():
    with pytest.raises(ValueError, match="summary"):
        plots.plot_alloc_latency(None, None)


def test_request_latency_counts_finished_requests_only(simulated):
    _, _, requests = simulated
    requests = requests.copy()
    requests.loc[requests.index[:3], "status"] = "rejected"
    fig = plots.plot_request_latency(requests)
    assert [ax.get_title() for ax in fig.axes[:3]] == list(plots.REQUEST_METRICS.values())
    finished = requests[(requests["status"] == "finished") & (requests["policy"] == "best-fit")]
    ttft_line = fig.axes[0].get_lines()[0]
    assert len(ttft_line.get_xdata()) == int((finished["ttft_s"] > 0).sum())


def test_queue_lengths_shows_swapped_only_when_something_was_swapped(simulated):
    _, ts, _ = simulated
    assert len(plots.plot_queue_lengths(ts).axes) == 2
    swapped = ts.assign(swapped=np.where(ts.index % 7 == 0, 1, 0))
    assert [ax.get_ylabel() for ax in plots.plot_queue_lengths(swapped).axes] == [
        "running requests",
        "waiting requests",
        "swapped requests",
    ]


def test_queue_lengths_needs_queue_columns(replayed):
    _, ts = replayed
    with pytest.raises(ValueError, match="running"):
        plots.plot_queue_lengths(ts)


def test_failures_draws_each_counter_the_runs_report(simulated):
    summary, _, _ = simulated
    fig = plots.plot_failures(summary)
    titles = [ax.get_title() for ax in visible_axes(fig)]
    assert titles[:3] == ["failed allocations", "preemptions", "rejected requests"]
    bars = visible_axes(fig)[1].patches
    assert [b.get_height() for b in bars] == summary["n_preempted"].tolist()


def test_failures_leaves_out_counters_no_run_reports(replayed):
    summary, _ = replayed
    fig = plots.plot_failures(summary.assign(n_preempted=np.nan))
    assert [ax.get_title() for ax in visible_axes(fig)] == ["failed allocations"]


def gpu_pair_summary(alloc_trace, policies=("first-fit", "paged")):
    """The same trace and policies replayed as backend sim and backend gpu (same loop, so pool
    measures agree)."""
    rows = []
    for spec in policies:
        rows.append(replay(alloc_trace, spec).summary)
        rows.append({**replay(alloc_trace, spec, backend="gpu").summary, "kind": "policy"})
    return pd.DataFrame(rows)


def test_sim_gpu_pairs_match_trace_and_policy(alloc_trace):
    pairs = plots.sim_gpu_pairs(gpu_pair_summary(alloc_trace))
    assert pairs["policy"].tolist() == ["first-fit", "paged"]
    assert (pairs["backend_sim"] == "sim").all() and (pairs["backend_gpu"] == "gpu").all()


def test_sim_gpu_pairs_prefer_the_same_source():
    s = pd.DataFrame(
        {
            "trace": "t",
            "policy": "p",
            "backend": ["sim", "sim", "gpu"],
            "source": ["a", "b", "b"],
            "peak_reserved_bytes": [1, 2, 3],
        }
    )
    pairs = plots.sim_gpu_pairs(s)
    assert pairs[["source_sim", "peak_reserved_bytes_sim"]].values.tolist() == [["b", 2]]


def test_sim_gpu_pairs_empty_without_gpu_runs(replayed):
    summary, _ = replayed
    assert plots.sim_gpu_pairs(summary).empty


def test_sim_gpu_differences_agree_on_pool_measures(alloc_trace):
    diffs = plots.sim_gpu_differences(gpu_pair_summary(alloc_trace))
    pool = diffs[
        diffs["measure"].isin(
            ["n_failed", "peak_live_bytes", "peak_reserved_bytes", "frag_ext_mean"]
        )
    ]
    assert len(pool) == 8 and (pool["diff"] == 0).all()
    lat = diffs[diffs["measure"] == "alloc_p50_us"].iloc[0]
    assert lat["rel_diff"] == pytest.approx((lat["gpu"] - lat["sim"]) / lat["sim"])


def test_sim_gpu_differences_skip_measures_missing_on_one_side():
    s = pd.DataFrame(
        {
            "trace": "t",
            "policy": "torch-caching",
            "backend": ["sim", "gpu"],
            "kind": ["policy", "baseline"],
            "frag_ext_mean": [0.5, np.nan],
            "peak_reserved_bytes": [100, 120],
        }
    )
    diffs = plots.sim_gpu_differences(s)
    assert diffs[["measure", "kind", "diff"]].values.tolist() == [
        ["peak_reserved_bytes", "baseline", 20.0]
    ]


def test_differences_view_reads_sim_then_gpu_in_display_units():
    s = pd.DataFrame(
        {
            "trace": "t",
            "policy": "p",
            "backend": ["sim", "gpu"],
            "peak_reserved_bytes": [2**20, 2**21],
            "overhead": [0.05, 0.05],
            "alloc_p50_us": [0.0, 1.5],
        }
    )
    view = plots.differences_view(plots.sim_gpu_differences(s))
    assert view.loc["peak_reserved (MiB)", "p"] == "1.0 → 2.0 (+100.0%)"
    assert view.loc["overhead (%)", "p"] == "5.00 → 5.00 (=)"
    assert view.loc["alloc_p50_us", "p"] == "0 → 1.5 (+1.5)"


def test_pairs_repeated_in_two_sources_stay_apart(alloc_trace):
    s = gpu_pair_summary(alloc_trace, ("paged",))
    two = pd.concat([s.assign(source="a"), s.assign(source="b")], ignore_index=True)
    assert list(plots.differences_view(plots.sim_gpu_differences(two)).columns) == [
        "paged · a",
        "paged · b",
    ]
    fig = plots.plot_sim_vs_gpu(two)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["paged · a", "paged · b"]


def test_sim_vs_gpu_figures_have_a_panel_per_pair(alloc_trace):
    summary = gpu_pair_summary(alloc_trace)
    fig = plots.plot_sim_vs_gpu(summary)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["first-fit", "paged"]
    ts = pd.concat([replay(alloc_trace, "paged", backend=b).timeseries for b in ("sim", "gpu")])
    over_time = plots.plot_sim_vs_gpu_over_time(ts)
    assert [ax.get_title() for ax in visible_axes(over_time)] == ["paged"]


def test_figure_png_is_a_png(replayed):
    summary, _ = replayed
    assert plots.figure_png(plots.plot_peak_memory(summary), dpi=40).startswith(
        b"\x89PNG\r\n\x1a\n"
    )


def test_pareto_plot_marks_the_non_dominated_runs():
    import pandas as pd

    from sim.report import plots

    summary = pd.DataFrame(
        {
            "trace": ["t"] * 4,
            "policy": ["a", "b", "c", "d"],
            "backend": ["sim"] * 4,
            "overhead": [0.1, 0.2, 0.3, 0.05],
            "alloc_p99_us": [5.0, 2.0, 6.0, 9.0],
            "failure_rate": [0.0, 0.0, 0.1, 0.2],
        }
    )
    assert plots.pareto_axes(summary) == ["alloc_p99_us", "failure_rate"]
    fig = plots.plot_pareto(summary)
    front = fig.axes[0].lines[0]  # the joined front of the first panel
    assert sorted(front.get_xdata()) == [5.0, 10.0, 20.0]  # d, a, b in percent; c is dominated by a


def test_series_colours_do_not_repeat_past_the_palette():
    from sim.report.plots._base import colours

    names = [f"run {i}" for i in range(500)]
    assert len(set(colours(names).values())) == 500
    assert colours(names[:3]) == {
        n: c for n, c in list(colours(names).items())[:3]
    }  # stable by appearance
