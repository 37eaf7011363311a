"""First fit's worst case: N small free holes below the first block that fits, old and new index
side by side.

    python benchmarks/bench_first_fit_holes.py [--holes 30 1000 5000 20000] [--before-rev bcff0ce]
                                               [--events 4000] [--repeat 5] [--clock cpu]

The pool: one 64 MiB segment, N pairs of 512 B blocks with the lower of each pair freed (N free
512 B holes) and the free tail above them. The loop allocates 4 KiB and frees it: the request
fits only the tail, so a flat address-ordered scan passes all N holes. Printed: ns per event (an
allocate or a free, as ``bench_replay.py`` counts them: two per loop iteration), best of
``--repeat`` with the two classes alternating, for ``policies.first_fit.FirstFit`` of this tree
("new") and the ``FirstFit`` of ``policies/first_fit.py`` at ``--before-rev`` ("before", loaded
from ``git show`` under another module name; the rest of ``policies`` is this tree's). Both
classes' placements are checked equal on every pool before timing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_replay import CLOCKS  # noqa: E402  (the one clock table of the bare loops)

from policies.first_fit import FirstFit  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
HOLE_BYTES = 512
REQUEST_BYTES = 4 * KiB


def load_before(rev: str) -> type:
    """``FirstFit`` of ``policies/first_fit.py`` at git revision ``rev``, as module
    ``first_fit_before``."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:policies/first_fit.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="first_fit_before_")) / "first_fit_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("first_fit_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FirstFit


def holed_pool(cls: type, num_holes: int):
    """A pool of ``cls`` with ``num_holes`` free 512 B holes below its free tail; the live blocks
    kept."""
    p = cls(segment_bytes=64 * MiB)
    pairs = [(p.allocate(HOLE_BYTES), p.allocate(HOLE_BYTES)) for _ in range(num_holes)]
    for hole, _ in pairs:
        p.free(hole)
    return p, pairs


def time_events(p, num_events: int, clock) -> float:
    """ns per event: ``num_events`` / 2 iterations of allocate + free of ``REQUEST_BYTES``."""
    allocate, free = p.allocate, p.free
    t0 = clock()
    for _ in range(num_events // 2):
        free(allocate(REQUEST_BYTES))
    return (clock() - t0) / (num_events // 2 * 2) * 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--holes", type=int, nargs="+", default=[30, 1000, 5000, 20000])
    ap.add_argument(
        "--before-rev", default="bcff0ce", help="git revision of the previous first_fit.py"
    )
    ap.add_argument("--events", type=int, default=4000, help="events per timed loop")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    args = ap.parse_args(argv)
    clock = CLOCKS[args.clock]
    classes = {"before": load_before(args.before_rev), "new": FirstFit}
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"Python {platform.python_version()}; best of {args.repeat}, "
        f"{args.events} events per loop, {args.clock} clock; before = {args.before_rev}"
    )
    print(f"{'holes':>7} {'before ns/event':>16} {'new ns/event':>13} {'before / new':>13}")
    for num_holes in args.holes:
        pools = {name: holed_pool(cls, num_holes)[0] for name, cls in classes.items()}
        placed = {name: p.allocate(REQUEST_BYTES) for name, p in pools.items()}
        assert placed["before"].offset == placed["new"].offset, (
            f"{num_holes} holes: placements differ"
        )
        for name, p in pools.items():
            p.free(placed[name])
        best = {name: float("inf") for name in pools}
        for _ in range(args.repeat):
            for name, p in pools.items():  # alternating, so that a busy machine hits both alike
                best[name] = min(best[name], time_events(p, args.events, clock))
        for p in pools.values():
            p.check_invariants()
        print(
            f"{num_holes:>7,} {best['before']:>16,.0f} {best['new']:>13,.0f} "
            f"{best['before'] / best['new']:>13.2f}"
        )
    return 0


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
