"""Running sweeps: resume, failures, schedulers giving the same table, the files written."""

import json
import multiprocessing
import os
import textwrap

import pandas as pd
import pytest

from sim.replay.schema import SUMMARY_COLUMNS
from sim.sweep import STATUS_COLUMNS, SweepError, load_sweep, make_executor, run_sweep
from sim.sweep import cells as cells_module
from sim.sweep.runner import ProcessExecutor
from traces import generate_alloc_trace, write_alloc_trace

#: Columns that are measured times, different on every run.
TIMED = {"wall_s", "elapsed_s", "alloc_p50_us", "alloc_p99_us", "free_p50_us", "free_p99_us"}
BAD_TRACE = "time_us,op,alloc_id,nbytes,stream,tag\n0,free,99,4096,0,\n"


def write_sweep(folder, body, *, bad=False):
    for seed in (1, 2):
        write_alloc_trace(
            generate_alloc_trace(num_layers=2, num_requests=4, seed=seed), folder / f"t{seed}.csv"
        )
    if bad:
        (folder / "bad.csv").write_text(BAD_TRACE)
    path = folder / "sweep.yaml"
    path.write_text(textwrap.dedent(body))
    return load_sweep(path)


@pytest.fixture
def spec(tmp_path):
    """8 cells: 2 traces x 2 size-class settings x 2 capacities."""
    return write_sweep(
        tmp_path,
        """
        traces: [t1.csv, t2.csv]
        policies: [{policy: size-class, params: {classes_per_doubling: [2, 8]}}]
        capacities: [null, 900MB]
    """,
    )


@pytest.fixture
def spec_with_bad_trace(tmp_path):
    """6 cells, the 2 of bad.csv fail when read."""
    return write_sweep(
        tmp_path,
        """
        traces: [t1.csv, bad.csv, t2.csv]
        policies: [first-fit, paged]
    """,
        bad=True,
    )


@pytest.fixture
def count_runs(monkeypatch):
    """Keys of the cells run in this process (serial scheduler)."""
    ran = []
    real = cells_module.run_cell

    def counting(cell):
        ran.append(cell.key)
        return real(cell)

    monkeypatch.setattr(cells_module, "run_cell", counting)
    return ran


def stable(df: pd.DataFrame) -> pd.DataFrame:
    return df[[c for c in df.columns if c not in TIMED]]


def test_every_cell_runs_once_and_lands_in_one_table(spec, tmp_path, count_runs):
    out = run_sweep(spec, tmp_path / "out", scheduler="serial")
    assert sorted(count_runs) == sorted(c.key for c in spec.cells)
    assert (out.num_cells, out.num_run, out.num_cached, out.num_failed) == (8, 8, 0, 0)
    assert list(out.results.columns[: len(SUMMARY_COLUMNS) + 3]) == SUMMARY_COLUMNS + STATUS_COLUMNS
    assert list(out.results["cell_key"]) == [c.key for c in spec.cells]
    assert set(out.results["param_classes_per_doubling"]) == {2, 8}
    assert (out.results["status"] == "ok").all()


def test_a_rerun_skips_finished_cells(spec, tmp_path, count_runs):
    first = run_sweep(spec, tmp_path / "out", scheduler="serial")
    count_runs.clear()
    again = run_sweep(spec, tmp_path / "out", scheduler="serial")
    assert count_runs == []
    assert (again.num_run, again.num_cached) == (0, 8)
    assert stable(again.results).equals(stable(first.results))


def test_a_grown_sweep_runs_only_its_new_cells(spec, tmp_path, count_runs):
    run_sweep(spec, tmp_path / "out", scheduler="serial")
    count_runs.clear()
    bigger = write_sweep(
        tmp_path,
        """
        traces: [t1.csv, t2.csv]
        policies: [{policy: size-class, params: {classes_per_doubling: [2, 4, 8]}}]
        capacities: [null, 900MB]
    """,
    )
    out = run_sweep(bigger, tmp_path / "out", scheduler="serial")
    assert len(count_runs) == 4 and (out.num_run, out.num_cached) == (4, 8)


def test_a_failed_cell_is_recorded_and_the_others_finish(spec_with_bad_trace, tmp_path):
    out = run_sweep(spec_with_bad_trace, tmp_path / "out", scheduler="serial")
    failed = out.results[out.results["status"] == "failed"]
    assert list(failed["trace"]) == ["bad", "bad"] and out.num_failed == 2
    assert failed["error"].str.startswith("TraceFormatError").all()
    assert (out.results.loc[out.results["trace"] != "bad", "status"] == "ok").all()
    assert out.results.loc[out.results["trace"] != "bad", "peak_live_bytes"].gt(0).all()


def test_failed_cells_are_skipped_unless_retried(spec_with_bad_trace, tmp_path, count_runs):
    run_sweep(spec_with_bad_trace, tmp_path / "out", scheduler="serial")
    count_runs.clear()
    run_sweep(spec_with_bad_trace, tmp_path / "out", scheduler="serial")
    assert count_runs == []
    out = run_sweep(spec_with_bad_trace, tmp_path / "out", scheduler="serial", retry_failed=True)
    bad_keys = {c.key for c in spec_with_bad_trace.cells if c.trace_name == "bad"}
    assert set(count_runs) == bad_keys and out.num_run == 2


def test_an_unreadable_record_runs_its_cell_again(spec, tmp_path, count_runs):
    run_sweep(spec, tmp_path / "out", scheduler="serial")
    count_runs.clear()
    (tmp_path / "out" / "cells" / f"{spec.cells[3].key}.json").write_text("{ half a reco")
    with pytest.warns(RuntimeWarning, match="unreadable cell record"):
        run_sweep(spec, tmp_path / "out", scheduler="serial")
    assert count_runs == [spec.cells[3].key]


def test_the_folder_holds_the_tables_and_one_record_per_cell(spec, tmp_path):
    out_dir = tmp_path / "out"
    run_sweep(spec, out_dir, scheduler="serial")
    assert sorted(p.stem for p in (out_dir / "cells").glob("*.json")) == sorted(
        c.key for c in spec.cells
    )
    results = pd.read_parquet(out_dir / "results.parquet")
    assert len(results) == 8 and len(pd.read_csv(out_dir / "summary.csv")) == 8
    pareto = pd.read_csv(out_dir / "pareto.csv")
    assert set(pareto["y_metric"]) == {"alloc_p99_us", "failure_rate"} and set(pareto["trace"]) == {
        "t1",
        "t2",
    }
    meta = json.loads((out_dir / "run.json").read_text())
    assert (meta["command"], meta["num_cells"], meta["scheduler"]) == ("sweep", 8, "serial")


def test_the_process_pool_gives_the_serial_table(spec, tmp_path):
    serial = run_sweep(spec, tmp_path / "serial", scheduler="serial")
    pool = run_sweep(spec, tmp_path / "pool", workers=2)
    assert pool.scheduler == "processes:2" and pool.num_run == 8
    pd.testing.assert_frame_equal(stable(pool.results), stable(serial.results))


def test_a_local_dask_cluster_gives_the_process_pool_table(spec, tmp_path):
    distributed = pytest.importorskip("distributed")
    pool = run_sweep(spec, tmp_path / "pool", workers=2)
    cluster = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0"
    )
    with cluster, distributed.Client(cluster) as client:
        dask = run_sweep(spec, tmp_path / "dask", scheduler=client)
    assert dask.num_run == 8 and dask.scheduler.startswith("dask:")
    pd.testing.assert_frame_equal(stable(dask.results), stable(pool.results))


def test_scheduler_local_n_starts_and_stops_its_own_cluster(spec, tmp_path):
    pytest.importorskip("distributed")
    out = run_sweep(spec, tmp_path / "out", scheduler="local:2")
    assert (out.scheduler, out.num_run, out.num_failed) == ("local:2", 8, 0)
    assert out.results["cell_key"].tolist() == [c.key for c in spec.cells]


_REAL_RUN_CELL = cells_module.run_cell


def die_on_t2(cell):
    """A worker that is killed while running t2's cells (stands in for the OOM killer)."""
    if cell.trace_name == "t2":
        os._exit(1)
    return _REAL_RUN_CELL(cell)


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(),
    reason="the patch reaches workers by fork",
)
def test_cells_lost_with_a_dead_worker_are_not_stored_and_run_next_time(
    spec, tmp_path, monkeypatch
):
    monkeypatch.setattr(cells_module, "run_cell", die_on_t2)
    broken = run_sweep(spec, tmp_path / "out", scheduler=ProcessExecutor(1, start_method="fork"))
    assert broken.num_lost > 0 and (broken.results["status"] != "failed").all()
    assert (
        broken.results.loc[broken.results["status"] == "lost", "error"]
        .str.contains("BrokenProcessPool")
        .all()
    )
    monkeypatch.setattr(cells_module, "run_cell", _REAL_RUN_CELL)
    healed = run_sweep(spec, tmp_path / "out", workers=1)
    assert healed.num_run == broken.num_lost and (healed.results["status"] == "ok").all()


@pytest.mark.parametrize(
    "scheduler, workers, needle",
    [
        ("local:0", None, "N in local:N"),
        ("local:2", 3, "disagree"),
        ("tcp://10.0.0.1:8786", 2, "--workers does not apply"),
        ("serial", 2, "one cell at a time"),
        ("yarn", None, "not understood"),
    ],
)
def test_bad_schedulers_are_errors_before_any_work(scheduler, workers, needle):
    with pytest.raises(SweepError, match=needle):
        make_executor(scheduler, workers)


def test_cells_go_out_in_batches_of_one_trace_each_cell_once(spec):
    from sim.sweep.runner import batch_cells

    for workers in (1, 2, 3, 16):
        batches = batch_cells(spec.cells, workers, tasks_per_worker=1)
        assert sorted(c.key for b in batches for c in b) == sorted(c.key for c in spec.cells)
        assert all(len({c.trace.fingerprint for c in b}) == 1 for b in batches)
        assert len(batches) >= min(workers, len(spec.cells))
    assert [c.key for b in batch_cells(spec.cells, 1, 1) for c in b] == [
        c.key
        for t in dict.fromkeys(c.trace.fingerprint for c in spec.cells)
        for c in spec.cells
        if c.trace.fingerprint == t
    ]


def test_the_outcome_says_where_the_time_went(spec, tmp_path):
    out = run_sweep(spec, tmp_path / "out", workers=2)
    assert set(out.phases_s) == {"plan_s", "startup_s", "cells_s", "collect_s"}
    assert all(v >= 0 for v in out.phases_s.values()) and out.phases_s["startup_s"] > 0
    assert out.results["cell_key"].tolist() == [c.key for c in spec.cells] and out.num_run == 8


def test_batches_shrink_to_single_cells_and_the_largest_trace_goes_first(tmp_path):
    from sim.sweep.runner import batch_cells

    class Trace:
        def __init__(self, path):
            self.path, self.fingerprint = str(path), str(path)

    class Cell:
        def __init__(self, key, trace):
            self.key, self.trace = key, trace

    small, large = tmp_path / "small.csv", tmp_path / "large.csv"
    small.write_bytes(b"x" * 10)
    large.write_bytes(b"x" * 1000)
    cells = [Cell(i, Trace(small if i < 50 else large)) for i in range(100)]
    batches = batch_cells(cells, 4)
    assert batches[0][0].trace.path == str(large)  # the longest expected cells go out first
    sizes = [len(b) for b in batches]
    assert sizes[0] == 13 and sizes[-1] == 1  # ceil(100 / (2 x 4)) first, one cell last
    for path in (large, small):  # shrinking within each trace
        group = [len(b) for b in batches if b[0].trace.path == str(path)]
        assert all(a >= b for a, b in zip(group, group[1:])) and sum(group) == 50
    assert sorted(c.key for b in batches for c in b) == list(range(100))
