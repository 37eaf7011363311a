"""``benchmarks/compare_read.py``: the read-ahead child's read in two trees, its parse checked."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLICE = REPO / "traces" / "data" / "llama1b_generate_slice.pickle.gz"


def _compare(before: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compare_read.py"), str(before), str(SLICE)]
        + ["--repeat", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


def test_the_same_tree_reads_the_same_snapshot():
    done = _compare(REPO)
    assert done.returncode == 0, done.stderr
    assert "parsed snapshots identical" in done.stdout
    assert "24,161 requests" in done.stdout
    assert "after/before: read " in done.stdout


def test_a_tree_whose_parse_differs_fails(tmp_path):
    tree = tmp_path / "before"
    shutil.copytree(REPO / "traces", tree / "traces", ignore=shutil.ignore_patterns("data"))
    module = tree / "traces" / "pytorch_snapshot.py"
    module.write_text(
        module.read_text()
        + "\n\n_read = read_snapshot_overlapped\n\n\n"
        + "def read_snapshot_overlapped(path, *, device=None):\n"
        + "    import dataclasses\n\n"
        + "    snap = _read(path, device=device)\n"
        + "    return dataclasses.replace(snap, name=snap.name + '-changed')\n"
    )
    done = _compare(tree)
    assert done.returncode == 1, done.stderr
    assert "PARSED SNAPSHOTS DIFFER" in done.stdout
