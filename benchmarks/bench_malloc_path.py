"""``GpuPool.malloc``'s own cost, on any machine: CuPy's pointer classes replaced by C stand-ins.

    python benchmarks/bench_malloc_path.py [-p SPEC ...] [--repeat 7] [--iterations 200000]
    [--compiled] [--out CSV]

On the GPU, ``benchmarks/bench_gpu.py --stages roundtrip`` times ``GpuPool.malloc`` against CuPy's
``MemoryPool`` (the issue 16 target). This measures the part of that round trip that is
poollab's, without a GPU: a host-backed pool whose pointer types are C callables that keep their
arguments as CuPy's do (``operator.itemgetter`` for ``UnownedMemory(ptr, nbytes, owner,
device_id)``, ``slice`` for ``MemoryPointer(memory, 0)``), so dropping the pointer drops the lease
and frees the allocation, as on CUDA. Rows, each timed in the same process, best of ``--repeat``:

- ``(stand-in pointer)``: building and dropping the two stand-ins around a plain owner: the floor;
- ``(policy round trip)``: ``policy.free(policy.allocate(nbytes))``, the policy's own share;
- ``malloc + drop``: ``pool.malloc(nbytes)`` and dropping the pointer (the lease frees it).

``--compiled`` also builds a compiled copy of the tree (``policies.testing.compiled``) and runs
the same rows there, alternating the two builds.
"""

from __future__ import annotations

import argparse
import csv
import json
import operator
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
DEFAULT_POLICIES = ["size-class", "paged", "best-fit"]


def best_ns(call, nbytes: int, iterations: int, repeat: int) -> float:
    """Best ns per call of ``call(nbytes)`` over ``repeat`` loops of ``iterations`` (after a
    warm-up)."""
    for _ in range(1000):
        call(nbytes)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(iterations):
            call(nbytes)
        best = min(best, (time.perf_counter_ns() - t0) / iterations)
    return best


def measure(specs: list[str], nbytes: int, iterations: int, repeat: int) -> list[dict]:
    """The rows of this tree (the one first on the import path)."""
    import realgpu.malloc_path
    from realgpu.pool import GpuPool

    build = "compiled" if realgpu.malloc_path.__file__.endswith((".so", ".pyd")) else "pure"
    pointer, memory = slice, operator.itemgetter

    def floor(n: int):
        return pointer(memory(0x7F0000000000, n, object(), 0), 0)

    rows = [
        {
            "build": build,
            "row": "(stand-in pointer)",
            "ns": best_ns(floor, nbytes, iterations, repeat),
        }
    ]
    for spec in specs:
        pool = GpuPool(spec, backend="host")
        allocate, free = pool.policy.allocate, pool.policy.free

        def round_trip(n: int) -> None:
            free(allocate(n))

        path = (
            pool._malloc_path
        )  # the stand-ins in place of CuPy's classes (host pools build HostMemoryPointer)
        path.pointer_type, path.memory_type = pointer, memory
        rows.append(
            {
                "build": build,
                "row": f"{spec}: (policy round trip)",
                "ns": best_ns(round_trip, nbytes, iterations, repeat),
            }
        )
        rows.append(
            {
                "build": build,
                "row": f"{spec}: malloc + drop",
                "ns": best_ns(pool.malloc, nbytes, iterations, repeat),
            }
        )
        assert pool.policy.num_live == 0 and not pool.lease_errors, (
            "a round trip left allocations live"
        )
        pool.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "-p",
        "--policy",
        action="append",
        dest="specs",
        metavar="SPEC",
        help="a policy spec (repeat)",
    )
    ap.add_argument("--nbytes", type=int, default=MiB)
    ap.add_argument("--iterations", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument(
        "--rounds", type=int, default=2, help="with --compiled: runs of each build, alternating"
    )
    ap.add_argument("--compiled", action="store_true", help="also run a compiled copy of this tree")
    ap.add_argument(
        "--json", action="store_true", help=argparse.SUPPRESS
    )  # one tree's rows, for --compiled
    ap.add_argument("--out", type=Path, help="also write the rows as CSV here")
    args = ap.parse_args(argv)
    specs = args.specs or DEFAULT_POLICIES
    one = [
        "--nbytes",
        str(args.nbytes),
        "--iterations",
        str(args.iterations),
        "--repeat",
        str(args.repeat),
    ]
    for spec in specs:
        one += ["-p", spec]

    if args.json:
        print(json.dumps(measure(specs, args.nbytes, args.iterations, args.repeat)))
        return 0
    trees = [REPO]
    with tempfile.TemporaryDirectory(prefix="poollab-malloc-") as tmp:
        if args.compiled:
            from policies.testing.compiled import build_compiled_copy, unavailable_reason

            reason = unavailable_reason()
            if reason is not None:
                print(f"error: no compiled build here: {reason}", file=sys.stderr)
                return 2
            build_compiled_copy(Path(tmp) / "tree")
            trees.append(Path(tmp) / "tree")
        best: dict[tuple[str, str], float] = {}
        for _ in range(args.rounds if args.compiled else 1):
            for tree in trees:
                from policies.testing.compiled import run_in

                out = run_in(
                    tree,
                    [sys.executable, str(tree / "benchmarks/bench_malloc_path.py"), "--json", *one],
                    capture_output=True,
                    text=True,
                ).stdout
                for row in json.loads(out):
                    key = (row["build"], row["row"])
                    best[key] = min(best.get(key, float("inf")), row["ns"])
    builds = sorted({b for b, _ in best}, reverse=True)  # pure first
    names = list(dict.fromkeys(r for _, r in best))
    print(f"ns per call, best of {args.repeat} x {args.iterations:,} ({args.nbytes:,} B):")
    print(f"{'row':40s}" + "".join(f"{b:>12s}" for b in builds))
    for name in names:
        print(f"{name:40s}" + "".join(f"{best.get((b, name), float('nan')):12.0f}" for b in builds))
    for b in builds:
        floor = best[(b, "(stand-in pointer)")]
        for spec in specs:
            own = (
                best[(b, f"{spec}: malloc + drop")]
                - floor
                - best[(b, f"{spec}: (policy round trip)")]
            )
            print(
                f"{b}: {spec}: malloc's own share {own:.0f} ns "
                "(malloc + drop, less the floor and the policy)"
            )
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["build", "row", "ns"])
            w.writeheader()
            w.writerows({"build": b, "row": r, "ns": round(ns, 1)} for (b, r), ns in best.items())
    return 0


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
