"""The console script's exit (``poollab.__main__.run``): the objects made are frozen for the
collector once the command has returned, and the command's output is whole all the same."""

import subprocess
import sys
from pathlib import Path

import pandas as pd

SLICE = Path(__file__).resolve().parents[2] / "traces" / "data" / "llama1b_generate_slice.pickle.gz"

#: Runs ``run(argv)`` as the console script does, with an ``atexit`` probe registered first (so it
#: runs after every other handler, as the interpreter's exit begins): what the collector holds
#: frozen then, printed to the piped (block-buffered) stdout that the exit must still flush.
_PROBE = (
    "import atexit, gc, sys\n"
    "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
    "from poollab.__main__ import run\n"
    "run(sys.argv[1:])\n"
)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=300
    )


def test_a_replay_exits_with_its_objects_frozen_and_its_output_whole(tmp_path):
    out = tmp_path / "replay"
    done = _run("replay", str(SLICE), "-p", "paged", "-p", "best-fit", "--out", str(out))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-2] == f"wrote {out}/summary.csv, {out}/timeseries.parquet"
    frozen = int(lines[-1].removeprefix("frozen at exit: "))
    assert frozen > 10_000  # the modules, their functions and classes: the exit leaves them be
    summary = pd.read_csv(out / "summary.csv")
    assert summary["policy"].tolist() == ["paged", "best-fit"]
    assert len(pd.read_parquet(out / "timeseries.parquet")) > 0


def test_a_failed_command_still_exits_2_in_one_line(tmp_path):
    bad = tmp_path / "bad.pickle.gz"
    bad.write_bytes(b"not a snapshot")
    done = _run("replay", str(bad), "--out", str(tmp_path / "o"))
    assert done.returncode == 2
    assert done.stderr.startswith("poollab: error: ") and len(done.stderr.splitlines()) == 1


def test_the_command_line_called_in_process_freezes_nothing():
    # ``poollab.cli.main`` is what tests and scripts call: their collector must keep seeing
    # their objects, so only the console script's ``run`` freezes
    code = (
        "import gc\nfrom poollab.cli import main\nmain(['presets'])\n"
        "print('frozen:', gc.get_freeze_count())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "frozen: 0"
