"""Which process of a `poollab replay` holds its peak memory (issue 33): the parent or a worker.

    PYTHONPATH=. python benchmarks/replay_peaks.py SNAPSHOT [--workers N] [--interval-s 0.02]

Runs ``python -m poollab replay SNAPSHOT`` under the five policies of ``bench_user_speed.py``
and samples each process of it (``/proc/PID/status``, every ``--interval-s``): its high-water
resident set (``VmHWM``, the kernel's own peak, so no sample misses it) and its proportional set
(``Pss`` of ``smaps_rollup``: shared pages split between the processes that map them). Prints
one line per process, the largest single process's ``VmHWM``, the replay's ``ru_maxrss`` (what
``bench_user_speed.py``'s peak is, from ``wait4``; it also counts the image a forked child had
before its exec, so under a large parent, such as a long pytest run, it reads the parent's size)
and the largest sum of Pss over the tree (what the machine gives the command). Linux only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_user_speed import FIVE  # noqa: E402


def _descendants(pid: int) -> list[int]:
    out = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    out += _descendants(int(child))
    except OSError:  # gone meanwhile
        pass
    return out


def _field_mb(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", type=Path)
    ap.add_argument("--workers", type=int, default=None, help="poollab replay --workers")
    ap.add_argument("--interval-s", type=float, default=0.02)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "poollab", "replay", str(args.snapshot)]
        cmd += [a for p in FIVE for a in ("-p", p)] + ["--out", out, "--no-progress"]
        cmd += ["--workers", str(args.workers)] if args.workers else []
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
        hwm: dict[int, int] = {}
        first_seen: dict[int, float] = {}
        pss_sum_peak, t0 = 0, time.perf_counter()
        while True:
            # wait4 rather than poll: its rusage is this child's (and its workers'), not every
            # child this process ever had (a shell's `bash -c "A && python replay_peaks.py"`
            # execs into the last command, whose RUSAGE_CHILDREN then still holds A's peak)
            pid, status, child_usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            pss_sum = 0
            for pid in _descendants(proc.pid):
                first_seen.setdefault(pid, time.perf_counter() - t0)
                peak = _field_mb(f"/proc/{pid}/status", "VmHWM")
                if peak is not None:
                    hwm[pid] = max(hwm.get(pid, 0), peak)
                pss_sum += _field_mb(f"/proc/{pid}/smaps_rollup", "Pss:") or 0
            pss_sum_peak = max(pss_sum_peak, pss_sum)
            time.sleep(args.interval_s)
        wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"poollab replay exited {proc.returncode}")
    rusage_mb = child_usage.ru_maxrss // 1024
    print(
        f"# replay_peaks · python {sys.version.split()[0]} · {os.cpu_count()} cores · "
        f"{wall_s:.1f} s"
    )
    for pid, mb in hwm.items():
        role = "parent" if pid == proc.pid else "child "
        print(f"{role} pid {pid}: peak {mb:5d} MB (first seen at {first_seen[pid]:5.1f} s)")
    print(f"largest single process (VmHWM): {max(hwm.values(), default=0)} MB")
    print(f"the replay's ru_maxrss (bench_user_speed's peak): {rusage_mb} MB")
    print(f"largest sum of Pss over the processes: {pss_sum_peak} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
