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
    largest = int(out.split("largest single process (VmHWM): ")[1].split()[0])
    assert (
        20 < largest < 2000
        and "bench_user_speed's peak): " in out
        and "largest sum of Pss over the processes: " in out
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_replay_peaks_reads_its_replays_peak_not_an_earlier_childs(tmp_path):
    """Run as a shell's last command it is exec'd into the shell, whose earlier children's peak
    (here a 600 MB one) RUSAGE_CHILDREN would still report: the H200 run printed the 'before'
    tree's 1,015 MB that way."""
    import subprocess

    trace = BENCH.parents[1] / "traces" / "data" / "llama1b_generate_slice.pickle.gz"
    script = (
        f"{sys.executable} -c 'b = bytearray(600 << 20); b[::4096] = b\"x\" * len(b[::4096])' && "
        f"exec {sys.executable} {BENCH} {trace} --workers 2"
    )
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    largest = int(out.split("bench_user_speed's peak): ")[1].split()[0])
    assert largest < 550, out
