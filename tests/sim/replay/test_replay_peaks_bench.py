"""``benchmarks/replay_peaks.py``: the peak of each process of a replay (issue 33's measure)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "replay_peaks.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_replay_peaks_names_the_parent_and_each_worker(capsys):
    spec = importlib.util.spec_from_file_location("replay_peaks", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trace = BENCH.parents[1] / "traces" / "data" / "llama1b_generate_slice.pickle.gz"
    assert module.main([str(trace), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nparent pid ") == 1 and out.count("\nchild  pid ") >= 2, out
    largest = int(out.split("bench_user_speed's peak): ")[1].split()[0])
    assert 20 < largest < 2000 and "largest sum of Pss over the processes: " in out
