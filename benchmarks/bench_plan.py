"""How long ``poollab plan`` takes on a long start-up snapshot (issue 34: a 2-million-event
snapshot).

    PYTHONPATH=. python benchmarks/bench_plan.py [SNAPSHOT] [--events 2000000] [--policy SPEC ...]
        [--memory BYTES] [--model M] [--block-tokens N] [--write PATH]

No real start-up snapshot has two million requests, so this one is made from SNAPSHOT (default:
the H200 recording ``tests/data/snapshots_h200/graphs.pickle.gz``: a 12 x 32 MiB KV cache, CUDA
graphs captured into a private pool, eager prefills) by repeating its last steps: the last window
of trace entries after the last private-pool request in which every allocation is freed again and
nothing freed was made before it. Copies of it go in before the rest of the trace, their times
shifted, until the snapshot holds ``--events`` requests (alloc and free entries). The segment
entries are not repeated: they are the allocator's decisions, which the replay makes itself.

Prints one line per policy: requests, seconds to read the snapshot, seconds to plan (all replays),
replays, seconds per replay and ns per replayed request, with the answer (safe KV bytes).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import os
import pickle
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from policies.units import format_bytes, parse_bytes  # noqa: E402
from sim.replay.fidelity import read_recording  # noqa: E402
from sim.planner.plan import plan  # noqa: E402
from traces.pytorch_snapshot import infer_request_pools, load_snapshot_dict, parse_snapshot  # noqa: E402

DEFAULT_SNAPSHOT = REPO / "tests" / "data" / "snapshots_h200" / "graphs.pickle.gz"


def repeatable_window(snap: dict) -> tuple[int, int]:
    """``(first, stop)`` trace-entry indices of the last balanced window of default-pool
    requests."""
    parsed = parse_snapshot(snap)
    req = parsed.requests
    pools = infer_request_pools(parsed).pools
    private = [k for k, p in enumerate(pools) if p != (0, 0)]
    first_req = private[-1] + 1 if private else 0
    alloc_at: dict[int, int] = {}  # alloc id -> request index of its alloc
    free_at: dict[int, int] = {}
    for k in range(len(req)):
        (alloc_at if req.is_alloc[k] else free_at)[req.alloc_id[k]] = k
    n = len(req)
    # a boundary p (before request p) is clean when no allocation that is freed crosses it
    cross = [0] * (n + 1)
    for aid, k in alloc_at.items():
        f = free_at.get(aid)
        if f is not None:
            cross[k + 1] += 1
            cross[f + 1] -= 1
    running, clean = 0, []
    for p in range(n + 1):
        running += cross[p]
        if running == 0:
            clean.append(p)
    never_freed = {k for aid, k in alloc_at.items() if aid not in free_at}
    # the clean boundaries from the end back: grow the window while it takes in no never-freed
    # request and nothing before the last private-pool request
    stop = start = None
    for q in reversed(clean):
        if stop is not None and q >= first_req and not any(q <= k < start for k in never_freed):
            start = q  # the window grows back by one more balanced stretch
        elif stop is None or start == stop:
            stop = start = q  # no window yet: it ends here
        else:
            break
    if stop is None or start is None or stop - start < 2:
        raise SystemExit(
            "bench_plan: the snapshot has no window of freed requests after its last capture "
            "to repeat"
        )
    return req.entry[start], req.entry[stop - 1] + 1


def lengthen(snap: dict, num_events: int) -> tuple[dict, int]:
    """A copy of ``snap`` whose trace repeats its last balanced window until ``num_events``
    requests."""
    first, stop = repeatable_window(snap)
    entries = snap["device_traces"][0]
    window = [
        e
        for e in entries[first:stop]
        if e["action"] in ("alloc", "free_requested", "free_completed")
    ]
    per_copy = sum(e["action"] in ("alloc", "free_completed") for e in window)
    have = sum(e["action"] in ("alloc", "free_completed") for e in entries)
    copies = max(0, -(-(num_events - have) // per_copy))
    span_us = entries[stop - 1]["time_us"] - entries[first]["time_us"] + 1
    out = entries[:stop]
    for c in range(1, copies + 1):
        out.extend(dict(e, time_us=e["time_us"] + c * span_us) for e in window)
    out.extend(dict(e, time_us=e["time_us"] + copies * span_us) for e in entries[stop:])
    return dict(snap, device_traces=[out] + snap["device_traces"][1:]), copies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot", nargs="?", type=Path, default=DEFAULT_SNAPSHOT)
    ap.add_argument(
        "--events", type=int, default=2_000_000, help="requests the lengthened snapshot holds"
    )
    ap.add_argument("--policy", "-p", dest="specs", action="append", default=None)
    ap.add_argument("--memory", default="2GiB", help="device memory the plan fits (default 2GiB)")
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--block-tokens", type=int, default=16, help="tokens per page with --model (default 16)"
    )
    ap.add_argument(
        "--write", type=Path, default=None, help="also keep the lengthened snapshot here"
    )
    args = ap.parse_args(argv)
    snap, copies = lengthen(load_snapshot_dict(args.snapshot), args.events)
    path = (
        args.write or Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_plan_{os.getpid()}.pickle.gz"
    )
    path.write_bytes(gzip.compress(pickle.dumps(snap, protocol=4), compresslevel=1))
    try:
        t0 = time.perf_counter()
        rec = read_recording(path)
        read_s = time.perf_counter() - t0
        print(
            f"# {datetime.date.today()} {platform.node()} Python {platform.python_version()}: "
            f"{args.snapshot.name} with its last window repeated {copies:,} times: "
            f"{len(rec.ops):,} requests; read in {read_s:.1f} s"
        )
        result = plan(
            rec,
            args.specs,
            device_bytes=parse_bytes(args.memory),
            model=args.model,
            block_tokens=args.block_tokens,
        )
        for p in result.plans:
            per_replay = p.plan_s / p.num_replays
            print(
                f"{p.spec}: plan {p.plan_s:.1f} s, {p.num_replays} replays, "
                f"{per_replay:.2f} s a replay "
                f"({per_replay / len(rec.ops) * 1e9:,.0f} ns a request); "
                f"safe KV {format_bytes(p.safe_pages * result.inputs.page_bytes)} "
                f"({p.safe_pages:,} pages)"
            )
    finally:
        if args.write is None:
            path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    from poollab.cli import run_script

    run_script(main)
