"""Sweep scaling: the same replay sweep on 1, 2, ... workers, speed-up printed, serial parts apart.

    PYTHONPATH=. python3 benchmarks/bench_sweep.py [--workers 1,2] [--cells 100] [--repeat 1]
        [--trace PATH] [--scheduler processes|local] [--out sweep.json]

The grid is 5 policies x 5 knob values x (``--cells`` / 25) capacities over one allocation trace
(default: the bundled slice of the PyTorch snapshot, about 24k events a cell, so a fresh clone
runs it; replay cells need neither simpy nor a GPU). Every run starts from an empty output
folder, so each one replays every cell; its time includes starting the workers, reading the
trace once per worker and writing the tables. Runs alternate between worker counts and the best
of ``--repeat`` is kept for each, so a busy machine hits every count alike. Before them one tiny
sweep starts the fork server (once per process, as in any ``poollab sweep``; printed apart).

Per count it prints the wall time and where it went (``SweepOutcome.phases_s``): ``plan``
(reading the store), ``startup`` (starting the workers), ``cells`` (handing out, running and
collecting the cells) and ``collect`` (merging and writing the tables); the speed-up of the
whole run over the first count (issue 16: >= 1.8x on 2 workers, >= 12x on 16) and that of the
``cells`` phase alone. On a 16-core machine: ``--workers 1,2,4,8,16`` (about a minute).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sim.sweep import load_sweep, run_sweep  # noqa: E402
from sim.sweep.runner import batch_cells  # noqa: E402
from traces import bundled_path  # noqa: E402

POLICIES = """\
  - {policy: first-fit, params: {segment_bytes: [8MiB, 16MiB, 32MiB, 64MiB, 128MiB]}}
  - {policy: best-fit, params: {segment_bytes: [8MiB, 16MiB, 32MiB, 64MiB, 128MiB]}}
  - {policy: size-class, params: {classes_per_doubling: [1, 2, 4, 8, 16]}}
  - {policy: paged, params: {tokens_per_page: [4, 8, 16, 32, 64]}}
  - {policy: elastic, params: {high: [0.6, 0.7, 0.8, 0.9, 0.95]}}
"""
CELLS_PER_CAPACITY = 25
TARGETS = {2: 1.8, 16: 12.0}


def grid(trace: Path, num_cells: int, name: str = "bench") -> str:
    """The sweep file: ``num_cells`` / 25 capacities (no limit, then 2 GiB up in 256 MiB steps)."""
    if num_cells < CELLS_PER_CAPACITY or num_cells % CELLS_PER_CAPACITY:
        raise SystemExit(f"--cells {num_cells} must be a multiple of {CELLS_PER_CAPACITY}")
    capacities = ["null"] + [
        f"{2048 + 256 * k}MiB" for k in range(num_cells // CELLS_PER_CAPACITY - 1)
    ]
    return (
        f'name: {name}\ntraces: ["{trace}"]\npolicies:\n{POLICIES}capacities: '
        f"[{', '.join(capacities)}]\n"
    )


def worker_counts(text: str) -> list[int]:
    counts = [int(t) for t in text.replace(",", " ").split()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give worker counts >= 1, e.g. 1,2,4")
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=bundled_path("llama1b_generate_slice.pickle.gz"))
    ap.add_argument(
        "--scheduler",
        choices=["processes", "local"],
        default="processes",
        help="processes: the local pool; local: a local Dask cluster (local:N)",
    )
    ap.add_argument(
        "--workers",
        type=worker_counts,
        nargs="+",
        default=[[1, 2]],
        help="worker counts, e.g. 1,2,4,8,16 (or 1 2 4)",
    )
    ap.add_argument(
        "--cells", type=int, default=100, help=f"grid size, a multiple of {CELLS_PER_CAPACITY}"
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per worker count; the best is kept")
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    args.workers = [n for group in args.workers for n in group]

    command = (
        f"python benchmarks/bench_sweep.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "trace": str(args.trace),
        "cells": args.cells,
        "scheduler": args.scheduler,
        "load_average_before": os.getloadavg()[0],
        "runs": [],
        "best": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
        sweep_path = Path(tmp) / "sweep.yaml"
        sweep_path.write_text(grid(args.trace.resolve(), args.cells))
        spec = load_sweep(sweep_path)
        print(
            f"# bench_sweep {report['date']} · python {report['python']} · {report['cores']} cores "
            f"· {report['platform']}"
        )
        print(f"# command: {command}")
        print(
            f"# {len(spec.cells)} cells over {args.trace.name}, scheduler {args.scheduler}, "
            f"load average before {report['load_average_before']:.2f} "
            "(a shared machine: others' work counts)"
        )
        if args.scheduler == "processes":
            warm_path = Path(tmp) / "warm.yaml"
            warm_path.write_text(
                f'name: warm\ntraces: ["{args.trace.resolve()}"]\npolicies: [paged]\n'
            )
            t0 = time.perf_counter()
            run_sweep(load_sweep(warm_path), Path(tmp) / "warm", workers=1)
            report["fork_server_start_s"] = time.perf_counter() - t0
            print(
                "# fork server start and a 1-cell sweep (once per process): "
                f"{report['fork_server_start_s']:.2f} s"
            )
        if args.scheduler == "processes":
            for n in (
                args.workers
            ):  # how the cells go out (sim.sweep.runner.batch_cells): the tail is one batch
                sizes = [len(b) for b in batch_cells(spec.cells, n)]
                print(
                    f"# workers={n}: {len(sizes)} batches handed out as workers free up, "
                    f"{sizes[0]} cells first down to {sizes[-1]} last"
                )
        best: dict[int, dict] = {}
        for rep in range(
            args.repeat
        ):  # interleaved, so machine noise hits every worker count alike
            for n in args.workers:
                out = Path(tmp) / f"out-{n}-{rep}"
                scheduler = f"local:{n}" if args.scheduler == "local" else None
                t0 = time.perf_counter()
                outcome = run_sweep(
                    spec, out, scheduler=scheduler, workers=None if scheduler else n
                )
                wall_s = time.perf_counter() - t0
                assert (
                    outcome.num_run == len(spec.cells)
                    and outcome.num_failed == 0
                    and outcome.num_lost == 0
                )
                run = {
                    "workers": n,
                    "repeat": rep,
                    "wall_s": wall_s,
                    **outcome.phases_s,
                    "inside_cells_s": float(outcome.results["elapsed_s"].sum()),
                    "load_average": os.getloadavg()[0],
                }
                report["runs"].append(run)
                if n not in best or wall_s < best[n]["wall_s"]:
                    best[n] = run
                print(
                    f"workers={n:<3} run {rep + 1}: "
                    f"{wall_s:6.2f} s wall = plan {run['plan_s']:.2f} + startup "
                    f"{run['startup_s']:.2f} + cells {run['cells_s']:.2f} + collect "
                    f"{run['collect_s']:.2f}; {run['inside_cells_s']:.2f} s inside cells "
                    f"(load average {run['load_average']:.2f})"
                )
        base = best[args.workers[0]]
        for n in args.workers:
            b = best[n]
            speedup, cells_speedup = base["wall_s"] / b["wall_s"], base["cells_s"] / b["cells_s"]
            target = TARGETS.get(n) if args.workers[0] == 1 else None
            mark = (
                ""
                if target is None
                else f" (target >= {target}x: {'ok' if speedup >= target else 'MISS'})"
            )
            print(
                f"workers={n:<3} best {b['wall_s']:6.2f} s, speed-up over {args.workers[0]}: "
                f"{speedup:5.2f}x whole run, {cells_speedup:5.2f}x cells phase{mark}"
            )
            report["best"][str(n)] = {**b, "speedup": speedup, "cells_speedup": cells_speedup}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
