"""Per-call latency samples: compact in memory and on disk, read back as written, plots
unchanged."""

import numpy as np
import pandas as pd
import pytest

from sim.report import plots
from sim.replay.trace_replay import replay, replay_tables
from sim.replay.schema import (
    LATENCY_SAMPLE_COLUMNS,
    latency_samples,
    read_results,
    summary_frame,
    write_results,
)
from traces import generate_alloc_trace


@pytest.fixture(scope="module")
def trace():
    return generate_alloc_trace(
        num_requests=6, seed=3, prompt_tokens=(32, 128), output_tokens=(8, 32)
    )


@pytest.fixture(scope="module")
def runs(trace):
    return [replay(trace, spec) for spec in ("first-fit", "paged", "size-class")]


def test_rows_follow_runs_then_allocations_then_frees(runs):
    s = latency_samples(runs)
    assert list(s.columns) == LATENCY_SAMPLE_COLUMNS
    expected = np.concatenate([np.concatenate([r.alloc_ns, r.free_ns]) for r in runs]) / 1e3
    assert np.array_equal(s["latency_us"].to_numpy(), expected.astype(np.float32))
    assert s["policy"].tolist() == [
        r.summary["policy"] for r in runs for _ in range(r.alloc_ns.size + r.free_ns.size)
    ]
    first = runs[0]
    assert s["op"].tolist()[: first.alloc_ns.size + 1] == ["alloc"] * first.alloc_ns.size + ["free"]


def test_eight_bytes_a_row_in_memory(runs):
    s = latency_samples(runs)
    assert s["latency_us"].dtype == np.float32
    assert all(
        isinstance(s[c].dtype, pd.CategoricalDtype) for c in ("trace", "policy", "backend", "op")
    )
    assert s.memory_usage(deep=True, index=False).sum() <= 8 * len(s) + 4096  # + the category names


def test_written_and_read_back_unchanged(runs, tmp_path):
    s = latency_samples(runs)
    write_results(
        tmp_path / "out",
        summary_frame([r.summary for r in runs]),
        extra_tables={"latency_samples": s},
    )
    back = read_results(tmp_path / "out")["latency_samples"]
    pd.testing.assert_frame_equal(back, s)


def test_no_runs_give_an_empty_table_of_the_schema():
    s = latency_samples([])
    assert list(s.columns) == LATENCY_SAMPLE_COLUMNS and len(s) == 0


def test_the_latency_plot_reads_the_compact_table(trace):
    tables = replay_tables(trace, ["first-fit", "best-fit"], with_bounds=False)
    fig = plots.plot_alloc_latency(samples=tables.latency_samples)
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["first-fit", "best-fit"]
