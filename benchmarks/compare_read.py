"""The read-ahead child's read of a snapshot in two trees, side by side: identical parse, CPU time.

    python benchmarks/compare_read.py BEFORE_TREE SNAPSHOT [--repeat 5]

``poollab replay`` of a large snapshot waits for its read (``traces.read_ahead``'s child: the
gunzip in a thread, the streamed unpickle and the per-entry parse in the main thread), which is
the first part of its critical path on a many-core host (``replay_phases.py``). Each run here is
what that child runs, ``read_snapshot_overlapped(SNAPSHOT)``, in a fresh interpreter whose
``PYTHONPATH`` is the tree (``PYTHONHASHSEED=0``), this tree being the one this script lies in,
trees alternating ``--repeat`` times. Printed: the main thread's CPU seconds of the read and of its
parse (``_EntryParser.feed``, timed around each batch), best of the runs, and the ratio after /
before. The parsed snapshots must be equal (a digest of the pickled snapshot, the same in every
run of a tree and across the trees); exit status 1 when they are not.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, pickle, sys, time
import traces.pytorch_snapshot as P

feed, spent = P._EntryParser.feed, [0.0]

def timed_feed(self, entries, start):
    t = time.thread_time()
    feed(self, entries, start)
    spent[0] += time.thread_time() - t

P._EntryParser.feed = timed_feed
t = time.thread_time()
snap = P.read_snapshot_overlapped(sys.argv[1])
read_s = time.thread_time() - t
if snap is None:
    sys.exit("not read by the streamed, overlapped path: nothing to compare")
digest = hashlib.sha256(pickle.dumps(snap, protocol=5)).hexdigest()[:16]
print(read_s, spent[0], len(snap.requests), digest)
"""


def _env(tree: Path) -> dict[str, str]:
    # as compare_simulate.py: the tree first, then the caller's other paths but this repository
    kept = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != REPO
    ]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *kept]), "PYTHONHASHSEED": "0"}


def run_read(tree: Path, snapshot: str) -> tuple[float, float, int, str]:
    """One read in ``tree``: ``(read CPU s, parse CPU s, requests, digest)``."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, snapshot],
        cwd=tree,
        env=_env(tree),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return float(out[0]), float(out[1]), int(out[2]), out[3]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", type=Path, help="the tree to compare with")
    ap.add_argument("snapshot", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    snapshot = str(args.snapshot.resolve())
    trees = {"before": args.before.resolve(), "after": REPO}
    runs: dict[str, list[tuple[float, float, int, str]]] = {name: [] for name in trees}
    print(f"# compare_read · {snapshot} · load average {os.getloadavg()[0]:.2f}")
    for _ in range(args.repeat):
        for name, tree in trees.items():
            read_s, parse_s, num_requests, digest = run_read(tree, snapshot)
            runs[name].append((read_s, parse_s, num_requests, digest))
            print(
                f"{name:6s} read {read_s:.3f} s CPU, parse {parse_s:.3f} s, "
                f"{num_requests:,} requests, digest {digest}"
            )
    best = {name: (min(r[0] for r in rs), min(r[1] for r in rs)) for name, rs in runs.items()}
    digests = {r[3] for rs in runs.values() for r in rs}
    for name, (read_s, parse_s) in best.items():
        print(f"{name:6s} best of {args.repeat}: read {read_s:.3f} s CPU, parse {parse_s:.3f} s")
    print(
        f"after/before: read {best['after'][0] / best['before'][0]:.3f}, "
        f"parse {best['after'][1] / best['before'][1]:.3f}; "
        + ("parsed snapshots identical" if len(digests) == 1 else "PARSED SNAPSHOTS DIFFER")
        + f" · load average {os.getloadavg()[0]:.2f}"
    )
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
