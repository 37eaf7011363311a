"""``benchmarks/replay_phases.py``: every phase and every job of a replay is timed (issue 33)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_job_is_timed_in_its_worker():
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "replay_phases.py"),
            str(REPO / "traces" / "data" / "llama1b_generate_slice.pickle.gz"),
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    for name in ("best-fit", "paged", "torch-caching", "expandable", "vmm-stitch", "bounds"):
        assert f"job {name} " in out
    for phase in ("read (parent)", "trace_events (parent)", "merge (parent)", "write (parent)"):
        assert phase in out
    assert "critical path with a core a job" in out
