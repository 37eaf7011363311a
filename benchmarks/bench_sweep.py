"""Sweep scaling: the same 100-cell replay sweep on 1 worker and on 2, speed-up printed.

    python benchmarks/bench_sweep.py [--trace PATH] [--scheduler processes|local] [--workers 1 2] [--repeat 1]

The grid is 5 policies x 5 knob values x 4 capacities over one allocation trace (default: the
bundled slice of the PyTorch snapshot, about 24k events a cell). Every run starts from an empty
output folder, so each one replays all 100 cells; the time includes starting the workers (and,
with ``--scheduler local``, the Dask cluster), reading the trace once per worker and writing the
tables. Runs alternate between worker counts and the best of ``--repeat`` is kept for each, so a
busy shared machine hits every count alike. Prints one line per run and the speed-up of each
count over the first.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sim.sweep import load_sweep, run_sweep  # noqa: E402
from traces import bundled_path  # noqa: E402

GRID = """\
name: bench-100
traces: ["{trace}"]
policies:
  - {{policy: first-fit, params: {{segment_bytes: [8MiB, 16MiB, 32MiB, 64MiB, 128MiB]}}}}
  - {{policy: best-fit, params: {{segment_bytes: [8MiB, 16MiB, 32MiB, 64MiB, 128MiB]}}}}
  - {{policy: size-class, params: {{classes_per_doubling: [1, 2, 4, 8, 16]}}}}
  - {{policy: paged, params: {{tokens_per_page: [4, 8, 16, 32, 64]}}}}
  - {{policy: elastic, params: {{high: [0.6, 0.7, 0.8, 0.9, 0.95]}}}}
capacities: [null, 2GiB, 3GiB, 4GiB]
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=bundled_path("llama1b_generate_slice.pickle.gz"))
    ap.add_argument("--scheduler", choices=["processes", "local"], default="processes",
                    help="processes: the local pool; local: a local Dask cluster (local:N)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=1, help="runs per worker count; the best is kept")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
        sweep_path = Path(tmp) / "sweep.yaml"
        sweep_path.write_text(GRID.format(trace=args.trace.resolve()))
        spec = load_sweep(sweep_path)
        assert len(spec.cells) == 100, len(spec.cells)
        print(f"# bench_sweep {datetime.datetime.now().isoformat(timespec='seconds')} · "
              f"python {platform.python_version()} · {os.cpu_count()} cores · {platform.platform()}")
        print(f"# command: python benchmarks/bench_sweep.py {' '.join(argv if argv is not None else sys.argv[1:])}")
        print(f"# {len(spec.cells)} cells over {args.trace.name}, scheduler {args.scheduler}, "
              f"load average before {os.getloadavg()[0]:.2f} (a shared machine: others' work counts)")
        best: dict[int, float] = {}
        for rep in range(args.repeat):  # interleaved, so machine noise hits every worker count alike
            for n in args.workers:
                out = Path(tmp) / f"out-{n}-{rep}"
                scheduler = f"local:{n}" if args.scheduler == "local" else None
                t0 = time.perf_counter()
                outcome = run_sweep(spec, out, scheduler=scheduler, workers=None if scheduler else n)
                wall_s = time.perf_counter() - t0
                assert outcome.num_run == 100 and outcome.num_failed == 0 and outcome.num_lost == 0
                best[n] = min(best.get(n, float("inf")), wall_s)
                cell_s = float(outcome.results["elapsed_s"].sum())
                print(f"workers={n} run {rep + 1}: {wall_s:6.2f} s wall, {100 / wall_s:5.1f} cells/s, "
                      f"{cell_s:6.2f} s inside cells (load average {os.getloadavg()[0]:.2f})")
        base = args.workers[0]
        for n in args.workers:
            print(f"workers={n}: best {best[n]:.2f} s, speed-up over {base} worker(s): {best[base] / best[n]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
