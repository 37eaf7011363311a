"""Replay throughput of each policy against a bare-dict floor, measured side by side.

    python benchmarks/bench_replay.py [TRACE] [--policy SPEC ...] [--repeat 3]

For every policy the trace's events are pushed through a lean loop (``allocate`` / ``free`` and
the dict that maps trace ids to allocations, nothing else). The floor is the same loop driving
``DictPool``, the thinnest thing with a pool's interface: ``allocate`` is one dict insert,
``free`` one dict delete (the "Python floor" of the field notes, 0.36 us a round trip on the
H200 host). The same loop with the dict operations inlined (no calls at all) is printed too, as
the absolute bottom. Runs alternate (floor, policy, floor, policy, ...) and the best of
``--repeat`` is kept for each, so machine noise hits both sides alike. Prints events/s and the
ratio to the floor; targets (issue 2): paged and size-class within 3x, first-fit and best-fit
within 8x.
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


class DictPool:
    """The floor: a pool whose bookkeeping is one dict insert and one dict delete."""

    def __init__(self):
        self._live = {}
        self._next = 0

    def allocate(self, nbytes):
        key = self._next
        self._next = key + 1
        self._live[key] = nbytes
        return key

    def free(self, key):
        del self._live[key]


class DoNothing(policies.Policy):
    """The contract's own cost: a policy whose hooks do no work (printed as ``(do-nothing)``)."""

    name = "(do-nothing)"
    _EXTENTS = ((0, 512),)

    def _reset_state(self):
        pass

    def _allocate(self, nbytes, stream, tag):
        return policies.Allocation(nbytes, nbytes, self._EXTENTS, stream, tag, None)

    def _free(self, allocation):
        pass

    def _release_free_segments(self, max_bytes):
        return 0

    def _add_segment(self, segment):
        pass


def inline_loop(ops):
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
    ap.add_argument("--out", default=None, help="also write the table as CSV here")
    args = ap.parse_args(argv)
    trace = read_alloc_trace(args.trace)
    t_us, is_alloc, ids, sizes, _ = trace.arrays()
    ops = list(zip(is_alloc.tolist(), ids.tolist(), sizes.tolist()))
    specs = (args.specs or policies.available()) + [DoNothing]
    print(f"trace {trace.name}: {len(ops):,} events; python {platform.python_version()} on {platform.machine()}")
    print(f"{'policy':<28} {'events/s':>11} {'floor ev/s':>11} {'ratio':>7} {'target':>9} {'inline ev/s':>12} failed")
    rows = []
    for spec in specs:
        best_floor = best_policy = best_inline = float("inf")
        failed = 0
        for _ in range(args.repeat):
            best_inline = min(best_inline, inline_loop(ops))
            best_floor = min(best_floor, policy_loop(ops, DictPool())[0])
            elapsed, failed = policy_loop(ops, policies.create(spec))
            best_policy = min(best_policy, elapsed)
        ratio = best_policy / best_floor
        if not isinstance(spec, str):
            spec = spec.name
        target = TARGETS.get(spec.split(":")[0])
        mark = "" if target is None else f"{target:.0f}x {'ok' if ratio <= target else 'MISS'}"
        n = len(ops)
        print(f"{spec:<28} {n / best_policy:>11,.0f} {n / best_floor:>11,.0f} {ratio:>6.2f}x {mark:>9} {n / best_inline:>12,.0f} {failed}")
        rows.append({"policy": spec, "events_per_s": n / best_policy, "floor_events_per_s": n / best_floor,
                     "ratio_to_floor": ratio, "target": target, "inline_events_per_s": n / best_inline,
                     "ratio_to_inline": best_policy / best_inline, "failed": failed})
    if args.out:
        import csv

        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
