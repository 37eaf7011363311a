"""Where a `poollab replay`'s wall time goes on a many-core host (issue 33): its critical path.

    PYTHONPATH=. python benchmarks/replay_phases.py SNAPSHOT [--workers N] [--repeat R]
        [--in-process]

Runs what ``poollab replay SNAPSHOT`` runs under the five policies of ``bench_user_speed.py``, in
this process, phase by phase, in the command's order: the imports the command makes before it
can start its read (the command line, ``poollab.commands.replay``); the read started ahead in a
child interpreter
(``traces.read_ahead``: gunzip, streamed unpickle and parse) while this process imports what the
replay needs; taking the parsed snapshot back and making the trace table (``snapshot_to_trace``);
the compact event table (``trace_events``); the jobs in ``--workers`` forked workers
(``replay_tables``' own ``_replay_in_workers``: the five policies and the bounds); the merge of
their tables and the writing of the result folder. Each phase is timed in CPU seconds of the
process that runs it (``time.process_time``: on a loaded machine the wall time of a phase says
how busy the machine was, its CPU time what the phase costs), each job in its worker, the read in
the child's main thread (its decompression thread runs ahead on another core; the child's CPU
of every thread and its wall time are printed beside it). ``--in-process`` reads in this
process after the imports instead (the structure before the read ahead).

With one core per job (a 16-core host runs the six at once) the wall time is the longer of the
imports and the child's read, then the parent's serial phases, then the longest job: the script
prints that sum, the critical path, and which job is the longest, then the same with the imports
before the read added (printed apart: sessions 14-16 left them out of the sum), then with two
wall-clock gaps no CPU figure holds added: from the pool's call to the first job's start (the
fork of the workers) and from the last job's end to its results in the parent (pickled back,
the pool's shutdown). Only the first round overlaps the imports (they happen once a process);
``--repeat`` takes each figure's minimum over the rounds. Last, unless ``--no-command``, it runs
the command itself (``python -m poollab replay SNAPSHOT -p ...``, its console script's ``run``)
``--repeat`` times in a child and prints the two walls no phase above holds, min over the runs:
the interpreter's start (the child's spawn to its first line of code: ``site``, the path
hooks) and its exit (the last ``atexit`` handler to the child reaped: the teardown, the freeing
of what the command made), with the command's whole wall beside them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

_TC = time.process_time()
_WC = time.perf_counter()
# what ``poollab replay`` imports before its read can start: the command line and the command's
# module (click parses the options, their callbacks run, then the command starts the read)
import poollab.cli  # noqa: E402, F401
import poollab.commands.replay  # noqa: E402, F401

_T0 = time.process_time()
_W0 = time.perf_counter()
#: The command's imports before the read starts, CPU and wall seconds: serial, on the
#: critical path ahead of the read.
PRE_READ_CPU_S, PRE_READ_WALL_S = _T0 - _TC, _W0 - _WC
from traces import read_ahead  # noqa: E402 (the command's first import after the CLI's)

read_ahead.MIN_READ_AHEAD_BYTES = 0  # the command's structure for any snapshot, the small too

_IN_PROCESS = "--in-process" in sys.argv
_SNAPSHOT = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
# the command starts the read before its heavy imports: so does the first round here
_FIRST_READ = None if _IN_PROCESS or _SNAPSHOT is None else read_ahead.start_read(_SNAPSHOT)
_T1 = time.process_time()
import pandas as pd  # noqa: E402

import traces  # noqa: E402
from bench_user_speed import FIVE  # noqa: E402
from sim.replay import trace_replay  # noqa: E402
from sim.replay.schema import write_results  # noqa: E402

IMPORT_CPU_S = time.process_time() - _T0
#: The imports' wall time: their CPU time counts every thread of the process, and numpy's BLAS
#: starts one a core that spins a while (on the H200 host `import numpy` alone: 0.31 s wall, 2.2 s
#: CPU), so on a many-core host the wall is the imports' share of the critical path.
IMPORT_WALL_S = time.perf_counter() - _W0
#: Of which starting the read ahead (the sniff and the start of the child interpreter).
START_CPU_S = _T1 - _T0

#: Where each worker appends one line a job: ``job cpu_s start end`` (a worker may run several
#: jobs; start and end: ``perf_counter``).
_JOB_LOG: list[str] = []
#: Wall-clock rows (not CPU, not summed into the critical path): from the call that forks the
#: workers to the first job's start, and from the last job's end to the results in the parent.
_WALL_TO_FIRST_JOB = "wall: pool call to first job start"
_WALL_AFTER_LAST_JOB = "wall: last job end to results"
_WALL_JOB_SPAN = "wall: first job start to last job end"
_plain_job = trace_replay._worker_job


def _timed_job(job: int):
    """``_worker_job`` timed in the worker's CPU seconds, appended to the log file with the wall
    clock (``perf_counter``: CLOCK_MONOTONIC, one clock for every process) at its start and end."""
    w0, t0 = time.perf_counter(), time.process_time()
    out = _plain_job(job)
    cpu_s, w1 = time.process_time() - t0, time.perf_counter()
    with open(_JOB_LOG[0], "a") as f:
        f.write(f"{job} {cpu_s:.4f} {w0:.6f} {w1:.6f}\n")
    return out


def _one_round(snapshot: Path, workers: int, reading) -> dict[str, float]:
    """One round's CPU seconds by phase; ``reading``: a read started ahead (None: read here)."""
    got: dict[str, float] = {}
    t = time.process_time()
    if reading is None:
        trace = traces.read_alloc_trace(snapshot)
        got["read (parent)"] = time.process_time() - t
    else:
        with reading:
            trace = reading.result()
        if not reading.ran_in_child:
            raise SystemExit(f"{snapshot}: not read ahead (no snapshot?)")
        got["take + trace table (parent)"] = time.process_time() - t
        # the child's main thread (start-up, unpickle, parse): its decompression thread runs
        # ahead of it on a core of its own (``read_snapshot_overlapped``)
        got["read (child, overlaps the imports)"] = reading.child_cpu_s
        got["  child, every thread's CPU"] = reading.child_all_cpu_s
        got["  child, wall from its start"] = reading.child_wall_s
    t = time.process_time()
    events = trace_replay.trace_events(trace)
    got["trace_events (parent)"] = time.process_time() - t
    options = dict(
        capacity_bytes=None, costs=None, sample_every=None, record_layout=False, latency_sample=None
    )
    with tempfile.NamedTemporaryFile("w", suffix=".jobs", delete=False) as log:
        _JOB_LOG[:] = [log.name]
    trace_replay._worker_job = _timed_job  # the forked workers run it by this name
    try:
        t, w_fork = time.process_time(), time.perf_counter()
        results, ref = trace_replay._replay_in_workers(
            trace, events, list(FIVE), options, True, workers, False
        )
        got["parent while the workers ran"] = time.process_time() - t
        w_back = time.perf_counter()
    finally:
        trace_replay._worker_job = _plain_job
    names = [*FIVE, "bounds"]
    starts, ends = [], []
    for line in Path(_JOB_LOG[0]).read_text().split("\n"):
        if line:
            job, cpu_s, w0, w1 = line.split()
            got[f"job {names[int(job)]}"] = float(cpu_s)
            starts.append(float(w0))
            ends.append(float(w1))
    os.unlink(_JOB_LOG[0])
    # wall seconds outside every phase above: the workers' start (the fork, at the first
    # submit) and the results' way back (pickled through the pool's pipe, the pool's shutdown)
    got[_WALL_TO_FIRST_JOB] = min(starts) - w_fork
    got[_WALL_AFTER_LAST_JOB] = w_back - max(ends)
    # the jobs' span on the wall clock: above the longest job's CPU where the jobs, run side by
    # side, wait for a core or run slower than alone (memory, a shared core's clock)
    got[_WALL_JOB_SPAN] = max(ends) - min(starts)
    t = time.process_time()
    summary = trace_replay.summary_frame([r.summary for r in results])
    timeseries = pd.concat([r.timeseries for r in results], ignore_index=True)
    samples = trace_replay.latency_samples(results)
    got["merge (parent)"] = time.process_time() - t
    t = time.process_time()
    with tempfile.TemporaryDirectory() as out:
        write_results(out, summary, timeseries, extra_tables={"latency_samples": samples})
    got["write (parent)"] = time.process_time() - t
    del ref
    return got


#: The command as the console script runs it, with a clock line at its first line of code and one
#: from an ``atexit`` handler registered first (so it runs last, as the interpreter's exit begins).
_COMMAND_PROBE = (
    "import atexit, sys, time\n"
    "print('start', time.perf_counter(), file=sys.stderr)\n"
    "atexit.register(lambda: print('exit', time.perf_counter(), file=sys.stderr))\n"
    "from poollab.__main__ import run\n"
    "run(sys.argv[1:])\n"
)


def _command_walls(snapshot: Path) -> dict[str, float]:
    """One run of ``poollab replay snapshot`` under the five policies in a child: its wall, the
    interpreter's start and its exit (the module docstring), in seconds."""
    import subprocess

    with tempfile.TemporaryDirectory() as out:
        argv = ["replay", str(snapshot), *[a for p in FIVE for a in ("-p", p)], "--out", out]
        w0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", _COMMAND_PROBE, *argv, "--no-progress"],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
        )
        w1 = time.perf_counter()
    if done.returncode != 0:
        raise SystemExit(f"poollab {' '.join(argv)}: exit {done.returncode}: {done.stderr}")
    clock = dict(
        line.split() for line in done.stderr.splitlines() if line[:5] in ("start", "exit ")
    )
    return {
        "command": w1 - w0,
        "start": float(clock["start"]) - w0,
        "exit": w1 - float(clock["exit"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", type=Path)
    ap.add_argument("--workers", type=int, default=len(FIVE) + 1, help="default: one a job")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--in-process", action="store_true", help="read after the imports, in this process"
    )
    ap.add_argument(
        "--no-command", action="store_true", help="do not run the command itself after the phases"
    )
    args = ap.parse_args(argv)
    rounds = []
    for k in range(args.repeat):
        reading = None
        if not args.in_process:
            reading = _FIRST_READ if k == 0 and _FIRST_READ is not None else None
            reading = reading or read_ahead.start_read(args.snapshot)
        rounds.append(_one_round(args.snapshot, args.workers, reading))
    best = {k: min(r[k] for r in rounds) for k in rounds[0]}
    how = "read in this process" if args.in_process else "read ahead in a child"
    print(f"{args.snapshot}: {args.workers} workers, {how}, min of {args.repeat}, CPU seconds")
    print(
        f"  {'imports before the read (parent)':37s} {PRE_READ_CPU_S:6.2f}  "
        f"(wall {PRE_READ_WALL_S:.2f})"
    )
    print(f"  {'imports (parent)':37s} {IMPORT_CPU_S:6.2f}  (wall {IMPORT_WALL_S:.2f})")
    imports_s = min(IMPORT_CPU_S, IMPORT_WALL_S)
    pre_read_s = min(PRE_READ_CPU_S, PRE_READ_WALL_S)
    for name, cpu_s in best.items():
        print(f"  {name:37s} {cpu_s:6.2f}")
    jobs = {k: v for k, v in best.items() if k.startswith("job ")}
    longest = max(jobs, key=jobs.get)
    serial_s = sum(v for k, v in best.items() if k.endswith("(parent)"))
    outside_s = best[_WALL_TO_FIRST_JOB] + best[_WALL_AFTER_LAST_JOB]
    if args.in_process:
        first_s, first = imports_s, f"imports {imports_s:.2f} s"
    else:
        child_s = START_CPU_S + best["read (child, overlaps the imports)"]
        first_s = max(imports_s, child_s)
        first = f"max(imports {imports_s:.2f}, start + child's read {child_s:.2f}) s"
    print(
        f"critical path with a core a job: {first} + parent's serial phases {serial_s:.2f} s "
        f"+ the longest job ({longest[4:]}) {jobs[longest]:.2f} s "
        f"= {first_s + serial_s + jobs[longest]:.2f} s"
        f"; all the jobs {sum(jobs.values()):.2f} s"
    )
    print(
        f"with the command's imports before the read ({pre_read_s:.2f} s): "
        f"{pre_read_s + first_s + serial_s + jobs[longest]:.2f} s"
    )
    print(
        f"with the workers' start and the results' way back ({outside_s:.2f} s wall, min of "
        f"{args.repeat}; on a loaded machine an upper bound): "
        f"{pre_read_s + first_s + serial_s + jobs[longest] + outside_s:.2f} s"
    )
    if not args.in_process and args.repeat > 1:
        # only the first round's read runs beside the imports (numpy's BLAS threads spin a while
        # after its import, on every core): the minimum above may be a later round's, alone
        first = rounds[0]
        print(
            "first round's read, beside the imports: child's read "
            f"{first['read (child, overlaps the imports)']:.2f} s CPU, wall from its start "
            f"{first['  child, wall from its start']:.2f} s"
        )
    if not args.no_command:
        walls = [_command_walls(args.snapshot) for _ in range(args.repeat)]
        best = {k: min(w[k] for w in walls) for k in walls[0]}
        print(
            f"the command itself (python -m poollab replay, min of {args.repeat}): wall "
            f"{best['command']:.2f} s, of which the interpreter's start {best['start']:.3f} s "
            f"and its exit {best['exit']:.3f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
