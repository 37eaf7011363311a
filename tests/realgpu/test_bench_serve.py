"""``benchmarks/bench_serve.py record`` (the recordings' driver) and ``benchmarks/gc_log`` (the GC
log of every process of a recording), without a GPU: ``--dry-run`` runs a stand-in child for each
run."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
BENCH_SERVE = REPO / "benchmarks" / "bench_serve.py"
GC_LOG = REPO / "benchmarks" / "gc_log"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "POOLLAB_GC_LOG_DIR"}
    return {**env, **extra}


def _record(tmp_path, *args, **env):
    return subprocess.run(
        [sys.executable, str(BENCH_SERVE), "record", *args, "--out", str(tmp_path / "eng")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(**env),
        timeout=120,
    )


def test_each_runs_processes_log_their_collections_into_its_folder(tmp_path):
    run = _record(
        tmp_path,
        "azure_code_60s_x2_b",
        "synth_mixed_10s_x1_a",
        "--dry-run",
        PYTHONPATH=os.pathsep.join([str(GC_LOG), str(REPO)]),
        POOLLAB_GC_LOG_DIR=str(tmp_path / "gc"),
    )
    assert run.returncode == 0, run.stderr
    for name in ("azure_code_60s_x2_b", "synth_mixed_10s_x1_a"):
        logs = list((tmp_path / "eng" / name / "gc").glob("gc_*.csv"))
        assert len(logs) == 1  # the stand-in child's own, not the driver's
        log = pd.read_csv(logs[0])
        assert list(log.columns) == ["t_s", "wall_s", "generation", "duration_s", "collected"]
        assert (log["generation"] == 2).any() and (log["duration_s"] >= 0).all()  # its gc.collect()
    assert list(
        (tmp_path / "gc").glob("gc_*.csv")
    )  # the driver's collections stay in the top folder


def test_runs_share_the_budget_and_one_left_without_time_is_skipped_by_name(tmp_path):
    run = _record(
        tmp_path, "azure_code_60s_x2_b", "azure_code_60s_x2_c", "--dry-run", "--budget-s", "20"
    )
    assert run.returncode == 124
    assert "== azure_code_60s_x2_b: skipped, 20 s of the budget left" in run.stdout
    assert "== azure_code_60s_x2_c: skipped" in run.stdout
    run = _record(tmp_path, "azure_code_60s_x2_b", "--dry-run", "--budget-s", "600")
    assert run.returncode == 0 and "== azure_code_60s_x2_b: exit 0" in run.stdout


def test_the_gc_logger_still_runs_the_sitecustomize_it_shadows_and_is_off_without_its_variable(
    tmp_path,
):
    other = tmp_path / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('yes')\n")
    path = os.pathsep.join([str(GC_LOG), str(other)])
    code = "import gc; gc.collect()"
    subprocess.run([sys.executable, "-c", code], env=_env(PYTHONPATH=path), check=True)
    assert (tmp_path / "ran").read_text() == "yes"
    assert not (tmp_path / "gc").exists()  # no variable: nothing logged
    subprocess.run(
        [sys.executable, "-c", code],
        env=_env(PYTHONPATH=path, POOLLAB_GC_LOG_DIR=str(tmp_path / "gc")),
        check=True,
    )
    (log,) = (tmp_path / "gc").glob("gc_*.csv")
    assert (pd.read_csv(log)["generation"] == 2).sum() >= 1
