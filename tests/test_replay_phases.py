"""``benchmarks/replay_phases.py``: every phase and every job of a replay is timed (issue 33)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _phases(*options: str) -> str:
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "replay_phases.py"),
            str(REPO / "traces" / "data" / "llama1b_generate_slice.pickle.gz"),
            "--workers",
            "2",
            *options,
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout


def test_every_job_is_timed_in_its_worker():
    out = _phases()
    for name in ("best-fit", "paged", "torch-caching", "expandable", "vmm-stitch", "bounds"):
        assert f"job {name} " in out
    for phase in (
        "read (child, overlaps the imports)",
        "take + trace table (parent)",
        "trace_events (parent)",
        "merge (parent)",
        "write (parent)",
    ):
        assert phase in out
    assert "read ahead in a child" in out
    assert "critical path with a core a job: max(imports" in out
    assert "imports before the read (parent)" in out
    assert "with the command's imports before the read" in out
    # the wall gaps around the jobs: a figure each (the pool's start, the results' way back)
    for gap in ("wall: pool call to first job start", "wall: last job end to results"):
        line = next(x for x in out.splitlines() if x.strip().startswith(gap))
        assert float(line.split()[-1]) >= 0.0
    assert "with the workers' start and the results' way back" in out
    line = next(x for x in out.splitlines() if "wall: first job start to last job end" in x)
    assert float(line.split()[-1]) > 0.0


def test_in_process_times_the_read_after_the_imports():
    out = _phases("--in-process", "--repeat", "2")
    assert "read (parent)" in out and "read (child" not in out
    assert "critical path with a core a job: imports" in out
    assert "first round's read" not in out


def test_the_first_rounds_read_beside_the_imports_is_printed_apart():
    out = _phases("--repeat", "2", "--no-command")
    line = next(x for x in out.splitlines() if x.startswith("first round's read"))
    assert float(line.split()[-2]) > 0.0


def test_the_command_itself_is_run_and_its_start_and_exit_timed():
    out = _phases()
    line = next(x for x in out.splitlines() if x.startswith("the command itself"))
    # "... wall W s, of which the interpreter's start S s and its exit E s"
    words = line.replace(",", "").split()
    wall_s = float(words[words.index("wall") + 1])
    start_s = float(words[words.index("start") + 1])
    exit_s = float(words[words.index("exit") + 1])
    assert 0.0 < start_s < wall_s and 0.0 < exit_s < wall_s
    assert start_s + exit_s < wall_s
    assert "the command itself" not in _phases("--no-command")
