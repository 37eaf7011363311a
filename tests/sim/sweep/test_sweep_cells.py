"""Cells: keys stable and sensitive to every input, running one cell, its flat columns."""

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sim.replay.trace_replay import replay
from sim.replay.schema import SUMMARY_COLUMNS
from sim.sweep import Cell, cell_columns, file_ref, run_cell
from sim.sweep import cells as cells_module
from traces import bundled_path, generate_alloc_trace, read_alloc_trace, write_alloc_trace


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "small.csv"
    write_alloc_trace(generate_alloc_trace(num_layers=2, num_requests=4, seed=1), path)
    return path


def replay_cell(path, policy="best-fit", **kw):
    return Cell("replay", file_ref(path), "small", "csv", policy, **kw)


def test_key_is_stable_across_processes(trace_path):
    cell = replay_cell(trace_path, "size-class:classes_per_doubling=8", capacity_bytes=1 << 30)
    code = (
        "import sys; from sim.sweep import Cell, file_ref; "
        "print(Cell('replay', file_ref(sys.argv[1]), 'small', 'csv', "
        "'size-class:classes_per_doubling=8', "
        f"capacity_bytes={1 << 30}).key)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(trace_path)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    assert out.stdout.strip() == cell.key


def test_key_follows_content_not_location(trace_path, tmp_path):
    moved = tmp_path / "elsewhere" / "copy.csv"
    moved.parent.mkdir()
    shutil.copy(trace_path, moved)
    assert replay_cell(moved).key == replay_cell(trace_path).key


def test_stat_fingerprint_follows_path_size_and_mtime(trace_path, tmp_path):
    moved = tmp_path / "copy.csv"
    shutil.copy(trace_path, moved)
    assert file_ref(moved, "stat").fingerprint != file_ref(trace_path, "stat").fingerprint
    assert file_ref(trace_path, "stat").fingerprint.startswith(f"stat:{trace_path.resolve()}:")


@pytest.mark.parametrize(
    "change",
    [
        dict(policy="best-fit:segment_bytes=16777216"),
        dict(policy="first-fit"),
        dict(capacity_bytes=1 << 30),
        dict(sample_every=100),
        dict(trace_name="other"),
        dict(trace_format="parquet"),
        dict(costs=cells_module.FileRef("/x/costs.json", "sha256:00")),
    ],
)
def test_key_changes_with_each_input(trace_path, change):
    base = replay_cell(trace_path)
    assert dataclasses.replace(base, **change).key != base.key


@pytest.mark.parametrize(
    "change",
    [
        dict(model="Llama-3-8B"),
        dict(gpu="H100"),
        dict(rate_scale=2.0),
        dict(options=(("kv_strategy", "grow"),)),
        dict(capacity_bytes=1 << 30),
    ],
)
def test_simulate_key_changes_with_each_input(trace_path, change):
    base = Cell(
        "simulate",
        file_ref(trace_path),
        "t",
        "azure",
        "paged",
        model="Llama-3.2-1B",
        gpu="H200",
        rate_scale=1.0,
    )
    assert dataclasses.replace(base, **change).key != base.key


def test_key_changes_with_the_trace_content(trace_path):
    before = replay_cell(trace_path).key
    write_alloc_trace(generate_alloc_trace(num_layers=2, num_requests=4, seed=2), trace_path)
    assert replay_cell(trace_path).key != before


def test_key_changes_with_the_poollab_version(trace_path, monkeypatch):
    before = replay_cell(trace_path).key
    monkeypatch.setattr(cells_module, "_poollab_version", lambda: "99.0")
    assert replay_cell(trace_path).key != before


def test_a_replay_cell_is_the_replay_of_its_inputs(trace_path):
    record = run_cell(
        replay_cell(trace_path, "size-class:classes_per_doubling=8", capacity_bytes=1 << 30)
    )
    assert (record["status"], record["error"]) == ("ok", None)
    direct = replay(
        read_alloc_trace(trace_path), "size-class:classes_per_doubling=8", capacity_bytes=1 << 30
    ).summary
    for col in [
        "n_alloc",
        "n_failed",
        "peak_live_bytes",
        "peak_reserved_bytes",
        "overhead",
        "n_grow",
    ]:
        assert record["summary"][col] == direct[col], col
    assert set(SUMMARY_COLUMNS) <= set(record["summary"])


def test_a_failing_cell_returns_its_error_instead_of_raising(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("time_us,op,alloc_id,nbytes,stream,tag\n0,free,99,4096,0,\n")
    record = run_cell(replay_cell(bad))
    assert record["status"] == "failed"
    assert record["error"].startswith("TraceFormatError:") and "not live" in record["error"]
    assert "Traceback" in record["traceback"] and record["summary"] == {}


def test_a_simulate_cell_runs_the_server_at_its_rate_and_budget():
    path = bundled_path("azure_code_slice.csv")
    cell = Cell(
        "simulate",
        file_ref(path),
        "azure",
        "azure",
        "paged",
        capacity_bytes=8 << 30,
        model="Llama-3.2-1B",
        gpu="H200",
        rate_scale=4.0,
        options=(("max_num_seqs", 64),),
    )
    record = run_cell(cell)
    assert record["status"] == "ok", record["error"]
    summary = record["summary"]
    assert (summary["trace"], summary["model"], summary["kv_budget_bytes"]) == (
        "azure",
        "Llama-3.2-1B",
        8 << 30,
    )
    assert summary["n_finished"] == summary["n_requests"] > 0


def test_columns_flatten_the_policy_knobs_and_simulator_options(trace_path):
    spec = "elastic:base=[size-class:classes_per_doubling=8],high=0.9"
    cell = Cell(
        "simulate",
        file_ref(trace_path),
        "t",
        "azure",
        spec,
        model="Llama-3.2-1B",
        gpu="H200",
        rate_scale=2.0,
        options=(("kv_strategy", "grow"),),
    )
    cols = cell_columns(cell)
    assert cols["param_base"] == "size-class:classes_per_doubling=8" and cols["param_high"] == 0.9
    assert (cols["cell_policy_name"], cols["option_kv_strategy"], cols["cell_rate_scale"]) == (
        "elastic",
        "grow",
        2.0,
    )
    assert cols["cell_key"] == cell.key
