"""Replay throughput of each policy against a bare-dict floor, measured side by side.

    python benchmarks/bench_replay.py [TRACE] [--policy SPEC ...] [--repeat 3]

For every policy the trace's events are pushed through a lean loop (``allocate`` / ``free`` and
the dict that maps trace ids to allocations, nothing else), and the same loop with the policy
calls removed (a dict insert on alloc, a delete on free) is the floor. Runs alternate (floor,
policy, floor, policy, ...) and the best of ``--repeat`` is kept for each, so machine noise hits
both sides alike. Prints events/s and the ratio to the floor; targets (issue 2): paged and
size-class within 3x, first-fit and best-fit within 8x.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import policies  # noqa: E402
from traces import read_alloc_trace  # noqa: E402

DEFAULT_TRACE = REPO.parent / "shared" / "data" / "traces" / "llama1b_generate_mixed.pickle.gz"
TARGETS = {"paged": 3.0, "size-class": 3.0, "first-fit": 8.0, "best-fit": 8.0}


def floor_loop(ops):
    live = {}
    t0 = time.perf_counter()
    for is_alloc, ident, size in ops:
        if is_alloc:
            live[ident] = size
        else:
            del live[ident]
    return time.perf_counter() - t0


def policy_loop(ops, policy):
    allocate, free = policy.allocate, policy.free
    live = {}
    failed = 0
    t0 = time.perf_counter()
    for is_alloc, ident, size in ops:
        if is_alloc:
            a = allocate(size)
            if a is None:
                failed += 1
            live[ident] = a
        else:
            a = live.pop(ident)
            if a is not None:
                free(a)
    return time.perf_counter() - t0, failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--policy", action="append", dest="specs")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    trace = read_alloc_trace(args.trace)
    t_us, is_alloc, ids, sizes, _ = trace.arrays()
    ops = list(zip(is_alloc.tolist(), ids.tolist(), sizes.tolist()))
    specs = args.specs or policies.available()
    print(f"trace {trace.name}: {len(ops):,} events; python {platform.python_version()} on {platform.machine()}")
    print(f"{'policy':<40} {'events/s':>12} {'floor ev/s':>12} {'ratio':>7} {'target':>7} failed")
    for spec in specs:
        best_floor = best_policy = float("inf")
        failed = 0
        for _ in range(args.repeat):
            best_floor = min(best_floor, floor_loop(ops))
            policy = policies.create(spec)
            elapsed, failed = policy_loop(ops, policy)
            best_policy = min(best_policy, elapsed)
        ratio = best_policy / best_floor
        target = TARGETS.get(spec.split(":")[0])
        mark = "" if target is None else f"{target:.0f}x {'ok' if ratio <= target else 'MISS'}"
        print(f"{spec:<40} {len(ops) / best_policy:>12,.0f} {len(ops) / best_floor:>12,.0f} {ratio:>6.2f}x {mark:>7} {failed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
