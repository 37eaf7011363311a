"""``poollab sweep``: fronts printed and files written, exit 1 for failed cells, 2 for bad input."""

import textwrap

import pandas as pd
import pytest

from poollab.cli import main
from traces import generate_alloc_trace, write_alloc_trace


def run(argv, capsys):
    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def sweep_file(tmp_path):
    write_alloc_trace(generate_alloc_trace(num_layers=2, num_requests=4, seed=1), tmp_path / "t.csv")
    path = tmp_path / "sweep.yaml"
    path.write_text(textwrap.dedent("""
        traces: [t.csv]
        policies: [first-fit, {policy: size-class, params: {classes_per_doubling: [2, 8]}}]
    """))
    return path


def test_sweep_prints_the_fronts_and_writes_the_tables(sweep_file, tmp_path, capsys):
    code, out, _ = run(["sweep", str(sweep_file), "--out", str(tmp_path / "out"), "--scheduler", "serial",
                        "--no-progress"], capsys)
    assert code == 0
    assert "3 run on serial, 0 already done" in out
    assert "pareto front (trace=t): overhead vs alloc_p99_us" in out
    assert len(pd.read_parquet(tmp_path / "out" / "results.parquet")) == 3
    assert (tmp_path / "out" / "pareto.csv").exists()


def test_dry_run_counts_what_is_left(sweep_file, tmp_path, capsys):
    run(["sweep", str(sweep_file), "--out", str(tmp_path / "out"), "--scheduler", "serial", "--no-progress"], capsys)
    sweep_file.write_text(sweep_file.read_text().replace("[2, 8]", "[2, 4, 8]"))
    code, out, _ = run(["sweep", str(sweep_file), "--out", str(tmp_path / "out"), "--dry-run"], capsys)
    assert code == 0 and "4 replay cells, 3 already done; 1 to run" in out


def test_a_failed_cell_exits_1_after_the_others_ran(sweep_file, tmp_path, capsys):
    (tmp_path / "bad.csv").write_text("time_us,op,alloc_id,nbytes,stream,tag\n0,free,99,4096,0,\n")
    sweep_file.write_text(sweep_file.read_text().replace("[t.csv]", "[t.csv, bad.csv]"))
    code, out, err = run(["sweep", str(sweep_file), "--out", str(tmp_path / "out"), "--scheduler", "serial",
                          "--no-progress"], capsys)
    assert code == 1
    assert "3 cells failed" in err and "bad · first-fit" in err and "TraceFormatError" in err
    results = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert results["status"].value_counts().to_dict() == {"ok": 3, "failed": 3}


def test_a_bad_file_is_one_line_naming_file_line_and_key_and_exit_2(sweep_file, tmp_path, capsys):
    sweep_file.write_text("traces: [t.csv]\npolicies:\n  - size-class:classes_per_doubling=0\n")
    code, _, err = run(["sweep", str(sweep_file), "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert err.startswith(f"poollab: error: {sweep_file}, line 3: policies[0]: ")
    assert "classes_per_doubling" in err and len(err.strip().splitlines()) == 1


def test_a_bad_scheduler_is_exit_2_before_any_work(sweep_file, tmp_path, capsys):
    code, _, err = run(["sweep", str(sweep_file), "--out", str(tmp_path / "out"), "--scheduler", "yarn"], capsys)
    assert code == 2 and "--scheduler 'yarn' is not understood" in err
    assert not (tmp_path / "out").exists()
