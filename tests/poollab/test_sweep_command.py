"""``poollab sweep``: fronts printed and files written, exit 1 for failed cells, 2 for bad input."""

import os
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from traces import generate_alloc_trace, write_alloc_trace


@pytest.fixture
def sweep_file(tmp_path):
    write_alloc_trace(
        generate_alloc_trace(num_layers=2, num_requests=4, seed=1), tmp_path / "t.csv"
    )
    path = tmp_path / "sweep.yaml"
    path.write_text(
        textwrap.dedent("""
        traces: [t.csv]
        policies: [first-fit, {policy: size-class, params: {classes_per_doubling: [2, 8]}}]
    """)
    )
    return path


def test_sweep_prints_the_fronts_and_writes_the_tables(sweep_file, tmp_path, cli):
    code, out, _ = cli(
        [
            "sweep",
            str(sweep_file),
            "--out",
            str(tmp_path / "out"),
            "--scheduler",
            "serial",
            "--no-progress",
        ]
    )
    assert code == 0
    assert "3 run on serial, 0 already done" in out
    assert "pareto front (trace=t): overhead vs alloc_p99_us" in out
    assert len(pd.read_parquet(tmp_path / "out" / "results.parquet")) == 3
    assert (tmp_path / "out" / "pareto.csv").exists()


def test_dry_run_counts_what_is_left(sweep_file, tmp_path, cli):
    cli(
        [
            "sweep",
            str(sweep_file),
            "--out",
            str(tmp_path / "out"),
            "--scheduler",
            "serial",
            "--no-progress",
        ]
    )
    sweep_file.write_text(sweep_file.read_text().replace("[2, 8]", "[2, 4, 8]"))
    code, out, _ = cli(["sweep", str(sweep_file), "--out", str(tmp_path / "out"), "--dry-run"])
    assert code == 0 and "4 replay cells, 3 already done; 1 to run" in out


def test_a_failed_cell_exits_1_after_the_others_ran(sweep_file, tmp_path, cli):
    (tmp_path / "bad.csv").write_text("time_us,op,alloc_id,nbytes,stream,tag\n0,free,99,4096,0,\n")
    sweep_file.write_text(sweep_file.read_text().replace("[t.csv]", "[t.csv, bad.csv]"))
    code, out, err = cli(
        [
            "sweep",
            str(sweep_file),
            "--out",
            str(tmp_path / "out"),
            "--scheduler",
            "serial",
            "--no-progress",
        ]
    )
    assert code == 1
    assert "3 cells failed" in err and "bad · first-fit" in err and "TraceFormatError" in err
    results = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert results["status"].value_counts().to_dict() == {"ok": 3, "failed": 3}


def test_a_bad_file_is_one_line_naming_file_line_and_key_and_exit_2(sweep_file, tmp_path, cli):
    sweep_file.write_text("traces: [t.csv]\npolicies:\n  - size-class:classes_per_doubling=0\n")
    code, _, err = cli(["sweep", str(sweep_file), "--out", str(tmp_path / "out")])
    assert code == 2
    assert err.startswith(f"poollab: error: {sweep_file}, line 3: policies[0]: ")
    assert "classes_per_doubling" in err and len(err.strip().splitlines()) == 1


def test_a_bad_scheduler_is_exit_2_before_any_work(sweep_file, tmp_path, cli):
    code, _, err = cli(
        ["sweep", str(sweep_file), "--out", str(tmp_path / "out"), "--scheduler", "yarn"]
    )
    assert code == 2 and "--scheduler 'yarn' is not understood" in err
    assert not (tmp_path / "out").exists()


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc"
)
def test_pool_workers_die_when_the_main_process_is_killed(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from traces import bundled_path

    sweep = tmp_path / "long.yaml"
    sweep.write_text(
        f"traces: [{bundled_path('llama1b_generate_slice.pickle.gz')}]\n"
        "policies: [first-fit, best-fit, torch-caching, size-class]\n"
        f"capacities: [{', '.join(f'{g}GiB' for g in range(2, 40))}]\n"
    )
    exe = Path(sys.executable).with_name("poollab")
    main = subprocess.Popen(
        [
            str(exe),
            "sweep",
            str(sweep),
            "--out",
            str(tmp_path / "out"),
            "--workers",
            "2",
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    below: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while (tmp_path / "out" / "cells").exists() is False or len(_descendants(main.pid)) < 3:
            assert main.poll() is None, "the sweep ended before the test could kill it"
            assert time.monotonic() < deadline, "the pool never started"
            time.sleep(0.2)
        below = _descendants(main.pid)  # the fork server, its workers, the resource tracker
        main.send_signal(signal.SIGKILL)
        main.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in below if _alive(p)], "pool processes outlived the killed sweep"
    finally:
        if main.poll() is None:
            main.kill()
            main.wait()
        for p in below:  # only what this test started, and only if the fix failed
            if _alive(p):
                os.kill(p, signal.SIGKILL)
