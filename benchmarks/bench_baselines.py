"""Every registered policy against the lower bound and the offline planner, on a real and a synthetic trace.

    python benchmarks/bench_baselines.py [--snapshot PATH] [--requests 12] [--seed 0]
                                         [--policy SPEC ...] [--repeat 1] [--out DIR]

Traces: the PyTorch snapshot (default: the full recording in ``shared/data``, else the bundled
slice) and a synthetic inference trace (``traces.generate_alloc_trace``: Llama-3.2-1B shape,
``--requests`` requests arriving at 4/s, continuous batching). For each trace it prints the
lower bound (peak live bytes) and the greedy-by-size planner's peak, then one row per policy:

- ``peak_reserved_MiB``, ``overhead_%`` (peak reserved / peak live - 1), ``failed`` requests;
- ``gap_to_bound_%`` = peak reserved / lower bound - 1 and ``gap_to_planner_%`` = peak reserved /
  planner peak - 1;
- ``Mops/s``: allocate/free calls per second in a lean loop (no sampling, no timers around
  calls), the best of ``--repeat`` runs.

Then the fidelity table of ``torch-caching`` against the snapshot's own segment events, with
recorded and with virtual segment addresses.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402

import policies  # noqa: E402
from sim.bounds import bounds  # noqa: E402
from sim.fidelity import read_recording, replay_recording  # noqa: E402
from sim.replay import replay  # noqa: E402
from traces import bundled_path, generate_alloc_trace, read_alloc_trace  # noqa: E402

FULL_SNAPSHOT = REPO.parent / "shared" / "data" / "traces" / "llama1b_generate_mixed.pickle.gz"
MiB = 1 << 20


def lean_ops_per_s(trace, spec: str, repeat: int) -> float:
    """Events per second of allocate/free alone (best of ``repeat``)."""
    _, is_alloc, ids, sizes, streams = trace.arrays()
    ops = list(zip(is_alloc.tolist(), ids.tolist(), sizes.tolist(), streams.tolist()))
    best = float("inf")
    for _ in range(repeat):
        policy = policies.create(spec)
        allocate, free = policy.allocate, policy.free
        live = {}
        t0 = time.perf_counter()
        for is_alloc_, ident, size, stream in ops:
            if is_alloc_:
                live[ident] = allocate(size, stream=stream)
            else:
                a = live.pop(ident)
                if a is not None:
                    free(a)
        best = min(best, time.perf_counter() - t0)
    return len(ops) / best


def compare(trace, specs: list[str], repeat: int) -> pd.DataFrame:
    b = bounds(trace)
    print(f"\n## {trace.name}: {len(trace):,} events, {b['num_allocations']:,} allocations")
    print(f"lower bound (peak live) {b['lower_bound_bytes'] / MiB:,.1f} MiB; planner ({b['planner']}) "
          f"{b['planner_peak_bytes'] / MiB:,.1f} MiB (+{100 * (b['planner_peak_bytes'] / b['lower_bound_bytes'] - 1):.2f} %, "
          f"{b['planner_s']:.1f} s)")
    rows = []
    for spec in specs:
        s = replay(trace, spec).summary
        rows.append({
            "policy": spec,
            "peak_reserved_MiB": s["peak_reserved_bytes"] / MiB,
            "overhead_%": 100 * s["overhead"],
            "failed": s["n_failed"],
            "gap_to_bound_%": 100 * (s["peak_reserved_bytes"] / b["lower_bound_bytes"] - 1),
            "gap_to_planner_%": 100 * (s["peak_reserved_bytes"] / b["planner_peak_bytes"] - 1),
            "segments": s["n_grow"],
            "Mops/s": lean_ops_per_s(trace, spec, repeat) / 1e6,
        })
    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format=lambda v: f"{v:,.2f}"))
    return table.assign(trace=trace.name, lower_bound_bytes=b["lower_bound_bytes"],
                        planner_peak_bytes=b["planner_peak_bytes"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_snapshot = FULL_SNAPSHOT if FULL_SNAPSHOT.exists() else bundled_path("llama1b_generate_slice.pickle.gz")
    ap.add_argument("--snapshot", default=str(default_snapshot))
    ap.add_argument("--requests", type=int, default=12, help="requests in the synthetic trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", action="append", dest="specs", help="policy spec, repeatable (default: all)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write baselines.csv and fidelity.csv here")
    args = ap.parse_args(argv)
    specs = args.specs or policies.available()
    print(f"# bench_baselines {datetime.date.today()}: python {platform.python_version()} on {platform.machine()}")
    print(f"command: {' '.join(['python', 'benchmarks/bench_baselines.py', *(argv if argv is not None else sys.argv[1:])])}")
    snapshot = read_alloc_trace(args.snapshot)
    synthetic = generate_alloc_trace(num_requests=args.requests, arrival_rate_per_s=4.0, seed=args.seed)
    synthetic.name = f"synthetic-{args.requests}req-seed{args.seed}"
    tables = [compare(snapshot, specs, args.repeat), compare(synthetic, specs, args.repeat)]

    print(f"\n## fidelity of torch-caching on {Path(args.snapshot).name}")
    rec = read_recording(args.snapshot)
    fidelity_tables = []
    for mode in ("recorded", "virtual"):
        result = replay_recording(rec, addresses=mode)
        print(result.format())
        fidelity_tables.append(result.table.assign(addresses=mode))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        pd.concat(tables).to_csv(args.out / "baselines.csv", index=False)
        pd.concat(fidelity_tables).to_csv(args.out / "fidelity.csv", index=False)
        print(f"\nwrote {args.out}/baselines.csv, {args.out}/fidelity.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
