"""The replay and sweep benchmarks run on a fresh clone with the bundled data (figures:
benchmarks/RESULTS.md)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_replay_prints_the_floors_and_the_harness_ratio(capsys, tmp_path):
    bench = _load("bench_replay")
    assert (
        bench.main(
            [
                str(bench.BUNDLED_TRACE),
                "-p",
                "paged",
                "--repeat",
                "1",
                "--out",
                str(tmp_path / "r.csv"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for row in ("(inline dict)", "(trivial object)", "(do-nothing)", "paged"):
        assert f"\n{row} " in out
    assert "harness over bare loop" in out
    assert "x trivial+Allocation <= 1.6: " in out  # the do-nothing row's verdict
    assert (
        (tmp_path / "r.csv")
        .read_text()
        .splitlines()[0]
        .startswith("row,bare_ns,x_dict,x_nothing,harness_ns")
    )


def test_bench_replay_gives_issue_33s_verdicts_from_the_rows_of_its_run():
    bench = _load("bench_replay")
    bare = {
        bench.INLINE: 1.0,
        bench.OBJECT: 4.0,
        bench.NOTHING: 6.0,
        "best-fit": 18.5,
        "first-fit": 17.0,
        "paged": 9.0,
    }
    assert bench.verdict(bench.NOTHING, bare) == "1.50x trivial+Allocation <= 1.6: ok"
    assert bench.verdict("best-fit", bare).endswith("MISS") and bench.verdict(
        "first-fit", bare
    ).endswith("ok")
    assert bench.verdict("paged", bare) == bench.verdict(bench.OBJECT, bare) == "-"


def test_bench_replay_parts_builds_the_harness_up(capsys):
    bench = _load("bench_replay")
    assert bench.main([str(bench.BUNDLED_TRACE), "-p", "paged", "--repeat", "1", "--parts"]) == 0
    out = capsys.readouterr().out
    assert "loop   +timing  +monitor" in out
    for row in ("(do-nothing)", "paged"):
        assert f"\n{row} " in out


def test_bench_replay_engine_calls_counts_what_timing_adds(capsys):
    """``--engine-calls``: the engine's calls per event; timing a call adds at most two clock
    reads, the ``TimedCalls`` frame and an append to the policy's own calls."""
    bench = _load("bench_replay")
    assert bench.main([str(bench.BUNDLED_TRACE), "-p", "paged", "--engine-calls"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("paged "))
    bare, sampled, every = map(float, line.split()[1:])
    assert (
        bare < sampled <= every <= bare + 4.05
    )  # at most: 2 clock reads, the TimedCalls frame, an append


def test_bench_sweep_writes_the_speedups_and_phases(capsys, tmp_path):
    bench = _load("bench_sweep")
    assert bench.main(["--workers", "1,2", "--cells", "25", "--out", str(tmp_path / "s.json")]) == 0
    report = json.loads((tmp_path / "s.json").read_text())
    assert set(report["best"]) == {"1", "2"} and report["best"]["1"]["speedup"] == 1.0
    assert {"plan_s", "startup_s", "cells_s", "collect_s"} <= set(report["best"]["2"])
    assert "speed-up over 1" in capsys.readouterr().out


def test_bench_sweep_rejects_a_grid_it_cannot_build():
    with pytest.raises(SystemExit):
        _load("bench_sweep").main(["--cells", "30"])


def test_bench_malloc_path_prints_malloc_beside_its_floors(capsys, tmp_path):
    bench = _load("bench_malloc_path")
    out_csv = tmp_path / "m.csv"
    assert (
        bench.main(
            ["-p", "size-class", "--iterations", "2000", "--repeat", "1", "--out", str(out_csv)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "size-class: malloc's own share" in out
    rows = {r.split(",")[1]: float(r.split(",")[2]) for r in out_csv.read_text().splitlines()[1:]}
    assert set(rows) == {
        "(stand-in pointer)",
        "size-class: (policy round trip)",
        "size-class: malloc + drop",
    }
    assert all(
        ns > 0 for ns in rows.values()
    )  # (no ordering of timings here: a loaded machine reorders them)


def test_bench_best_fit_floor_checks_its_placements_then_times_both(capsys):
    bench = _load("bench_best_fit_floor")
    assert bench.main([str(_load("bench_replay").BUNDLED_TRACE), "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "placed all" in out and "where best-fit did" in out
    for row in ("(do-nothing)", "best-fit", bench.FLOOR):
        assert f"\n{row} " in out
    assert bench.FLOOR not in bench.policies.available()  # registered for the run only


def test_bench_best_fit_floor_refuses_a_floor_that_places_elsewhere(monkeypatch):
    bench = _load("bench_best_fit_floor")
    monkeypatch.setattr(bench, "_SEGMENT_BYTES", 64 << 20)  # other segments: other offsets
    with pytest.raises(SystemExit, match="the floor is not best fit"):
        bench.main([str(_load("bench_replay").BUNDLED_TRACE), "--repeat", "1"])


@pytest.mark.parametrize("script", ["bench_replay", "bench_best_fit_floor"])
def test_a_benchmark_given_a_malformed_trace_says_where_in_one_line_and_exits_2(tmp_path, script):
    bad = tmp_path / "bad.csv"
    bad.write_text("time_us,op,alloc_id,nbytes,stream,tag\n0,alloc,1,1024,0,\n1,free,2,0,0,\n")
    run = subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), str(bad), "--repeat", "1"],
        capture_output=True,
        text=True,
        cwd=BENCH.parent,
    )
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f"{script}.py: error: {bad}:3: free of allocation 2, which is not live at that point"
    ]
