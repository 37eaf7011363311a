"""Replay cost per event: each policy against honest floors, and the replay harness against the bare
loop.

    PYTHONPATH=. python benchmarks/bench_replay.py [TRACE] [--policy SPEC ...] [--repeat 5] [--out
    CSV] [--parts]

TRACE defaults to the full PyTorch snapshot of the shared data folder when it is there, else the
bundled slice (``traces/data``), so a fresh clone runs it as it is.

Rows, all measured in one run, interleaved (every row once per repeat, best of ``--repeat``
kept) so that a busy machine hits them alike:

- ``(inline dict)``: the loop with a dict insert / delete inlined, no call at all: the floor;
- ``(trivial object)``: ``allocate`` / ``free`` of an object that does one dict op each;
- ``(trivial + Allocation)``: the same, handing out an ``Allocation``: the floor of one object
  per request, which every policy builds;
- ``(do-nothing)``: a ``Policy`` subclass whose hooks do no work: the contract's own cost;
- every policy (all registered ones by default).

Columns: ``bare_ns`` is ns per event of the bare loop, which calls ``allocate(nbytes,
stream=, tag=)`` and ``free(a)`` exactly as replay does and keeps the trace-id -> allocation
dict, nothing else; ``x_dict`` and ``x_nothing`` are its ratios to the inline dict and to the
do-nothing policy; ``calls`` (``calls_per_event``) counts the calls the loop makes per event,
Python functions and built-ins alike (cProfile, in a separate untimed pass). ``harness_ns`` is ns
per event of ``sim.replay.engine.run`` driving the same allocator as
``sim.replay.trace_replay.replay`` does (two clock reads and the device's driver time per call, the
latency samples, the ``PoolMonitor``): for a policy it is ``replay()``'s own ``wall_s``; and
``harness_x`` = harness_ns / bare_ns (issue 16: <= 1.2). The harness times the replay's default
share of calls (``sim.replay.engine.default_latency_sample``: about 20,000 on a long trace);
``every_ns``/``every_x`` are the same with every call timed (``latency_sample=1``), its cost before
sampling. ``replay_ns`` is the whole ``replay()`` call (turning the trace into event lists, the
summary row and time series included).

``verdict``: issue 33's pure-Python targets, restated against the floors issue 16 measured:
the do-nothing policy within ``NOTHING_TARGET`` (1.6x) the ``(trivial + Allocation)`` floor,
and the block policies issue 16 held to 2x (``BLOCK_POLICIES``: best-fit, first-fit, which cut
and merge blocks) within ``BLOCK_TARGET`` (3x) the do-nothing policy, both by ``bare_ns`` of
this run; ``ok`` or ``MISS``, and ``-`` for rows no target covers.

``--parts`` instead builds the harness up piece by piece for each policy row (ns per event, best
of ``--repeat``): the bare loop; ``sim.replay.engine.run`` timing no call (the loop alone); timing
the default sample; and with the ``PoolMonitor`` that ``replay()`` drives (its engine time).

``--engine-calls`` instead counts, for each policy row, the calls ``sim.replay.engine.run`` makes
per event (cProfile, Python functions and built-ins, the clock reads included; the ``run`` frame
itself excluded) at the default sampling and timing every call: a count that a busy machine does not
blur, for comparing two versions of the loop.

``--sample-bytes`` instead measures the per-call latency samples of a replay of the README's 13
policies (``sim.replay.trace_replay.replay_tables``): bytes per trace event in memory and as
``latency_samples.parquet`` (issue 16: <= 400 B per event).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import policies  # noqa: E402
from sim.replay import engine  # noqa: E402
from sim.replay.costs import CostedDevice, CostModel  # noqa: E402
from sim.replay.trace_replay import replay, trace_events  # noqa: E402
from traces import bundled_path, read_alloc_trace  # noqa: E402

SHARED_TRACE = REPO.parent / "shared" / "data" / "traces" / "llama1b_generate_mixed.pickle.gz"
BUNDLED_TRACE = bundled_path("llama1b_generate_slice.pickle.gz")
#: the trace the benchmarks replay when given none: the full snapshot where the shared data is, else
#: the slice
DEFAULT_TRACE = str(SHARED_TRACE if SHARED_TRACE.exists() else BUNDLED_TRACE)
HARNESS_TARGET = 1.2
#: issue 33: the do-nothing policy's bare loop over the "(trivial + Allocation)" floor's
NOTHING_TARGET = 1.6
#: issue 33: a block policy's bare loop over the do-nothing policy's, for these policies
BLOCK_TARGET = 3.0
BLOCK_POLICIES = ("best-fit", "first-fit")
#: The README workflow's 13-policy replay.
README_POLICIES = [
    "first-fit",
    "best-fit",
    "size-class",
    "paged",
    "elastic",
    "torch-caching",
    "cupy-pool",
    "tlsf",
    "arena",
    "buddy",
    "compacting",
    "tag-limits",
    "worst-fit",
]
INLINE, TRIVIAL, OBJECT, NOTHING = (
    "(inline dict)",
    "(trivial object)",
    "(trivial + Allocation)",
    "(do-nothing)",
)


class TrivialPool:
    """An object whose ``allocate`` is one dict insert and ``free`` one dict delete."""

    __slots__ = ("_live", "_next")

    def __init__(self):
        self._live = {}
        self._next = 0

    def allocate(self, nbytes, *, stream=0, tag=None):
        key = self._next
        self._next = key + 1
        self._live[key] = nbytes
        return key

    def free(self, key):
        del self._live[key]


class TrivialAllocationPool(TrivialPool):
    """``TrivialPool`` that hands out an ``Allocation``: the floor of one object per request."""

    __slots__ = ()
    _EXTENTS = ((0, 512),)

    def allocate(self, nbytes, *, stream=0, tag=None):
        key = self._next
        self._next = key + 1
        self._live[key] = nbytes
        a = policies.Allocation(nbytes, nbytes, self._EXTENTS, stream, tag, key)
        return a

    def free(self, a):
        del self._live[a.handle]


class DoNothing(policies.Policy):
    """The contract's own cost: a policy whose hooks do no work."""

    name = NOTHING
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

    def free_extents(self):
        return []


#: the clock the bare loops read (``--clock``): wall time, or the process's CPU time, which a
#: shared machine's other jobs do not inflate (a preempted loop is not charged for the wait)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


#: the floors that are not policies, by row
FLOORS = {TRIVIAL: TrivialPool, OBJECT: TrivialAllocationPool}


def request_events(ev) -> list[tuple[bool, int, int, int, str | None]]:
    """The reference loops' events: ``(is_alloc, key, nbytes, stream, tag)`` for each request of the
    ``sim.replay.trace_replay.TraceEvents`` ``ev`` (flushes dropped: the reference loops replay
    requests only)."""
    tags = [t or None for t in ev.tags] if ev.tags is not None else [None] * len(ev.ops)
    return [
        (op == engine.ALLOC, *rest)
        for op, *rest in zip(ev.ops, ev.keys, ev.sizes, ev.streams, tags)
        if op != engine.FLUSH
    ]


def inline_loop(events) -> float:
    live = {}
    t0 = _clock()
    for is_alloc, key, nbytes, _stream, _tag in events:
        if is_alloc:
            live[key] = nbytes
        else:
            del live[key]
    return _clock() - t0


def bare_loop(events, allocate, free) -> float:
    """The policy's calls and the id -> allocation dict, nothing else (a refused request's free is
    skipped)."""
    live = {}
    t0 = _clock()
    for is_alloc, key, nbytes, stream, tag in events:
        if is_alloc:
            a = allocate(nbytes, stream=stream, tag=tag)
            if a is not None:
                live[key] = a
        else:
            a = live.pop(key, None)
            if a is not None:
                free(a)
    return _clock() - t0


def calls_per_event(events, row, costs) -> float:
    """Python-level calls per event of the bare loop (cProfile's count, the loop's own frame
    excluded).

    The call structure is what a pure-Python policy pays for: each call costs tens of ns.
    """
    import cProfile
    import pstats

    if row == INLINE:
        return 0.0
    pool = FLOORS[row]() if row in FLOORS else make_policy(row, costs)
    profiler = cProfile.Profile()
    profiler.runcall(bare_loop, events, pool.allocate, pool.free)
    stats = pstats.Stats(profiler).stats
    num_calls = sum(
        nc
        for (_, _, name), (_, nc, *_rest) in stats.items()
        if name
        not in (
            "bare_loop",
            "<built-in method time.perf_counter>",
            "<built-in method time.process_time>",
        )
    )
    return num_calls / len(events)


def engine_calls_per_event(ev, spec, costs, latency_sample=None) -> float:
    """Calls per event of ``sim.replay.engine.run`` replaying ``ev`` through ``spec``
    (``--engine-calls``)."""
    import cProfile
    import pstats

    policy = make_policy(spec, costs)
    profiler = cProfile.Profile()
    profiler.runcall(
        engine.run,
        ev.ops,
        ev.keys,
        ev.sizes,
        streams=ev.streams,
        tags=ev.tags,
        target=engine.policy_target(policy),
        unknown_free=_unknown_free,
        latency_sample=latency_sample,
    )
    stats = pstats.Stats(profiler).stats
    num_calls = sum(
        nc
        for (path, _, name), (_, nc, *_rest) in stats.items()
        if not (name == "run" and path.endswith("engine.py"))
    )
    return num_calls / len(ev.ops)


def _unknown_free(i, key):
    return ValueError(f"event {i} frees {key}, which is not live")


def trivial_harness(ev, pool_type, latency_sample=None) -> float:
    pool = pool_type()
    return engine.run(
        ev.ops,
        ev.keys,
        ev.sizes,
        streams=ev.streams,
        tags=ev.tags,
        times_us=ev.times_us,
        target=engine.Target(allocate=pool.allocate, free=pool.free),
        unknown_free=_unknown_free,
        latency_sample=latency_sample,
    ).wall_s


def verdict(row, bare) -> str:
    """Issue 33's target for ``row`` and whether this run met it (see the module docstring)."""
    if row == NOTHING:
        x, target, what = bare[NOTHING] / bare[OBJECT], NOTHING_TARGET, "x trivial+Allocation"
    elif row in BLOCK_POLICIES:
        x, target, what = bare[row] / bare[NOTHING], BLOCK_TARGET, "x do-nothing"
    else:
        return "-"
    return f"{x:.2f}{what} <= {target}: {'ok' if x <= target else 'MISS'}"


def make_policy(spec, costs):
    device = CostedDevice(costs)
    return DoNothing(device=device) if spec == NOTHING else policies.create(spec, device=device)


#: ``--parts``: the harness built up piece by piece, ``sim.replay.engine.run`` keyword arguments by
#: part (``latency_sample=1e-9`` times no call; the monitor is the one ``replay()`` drives)
PARTS = {"loop": {"latency_sample": 1e-9}, "+timing": {}, "+monitor": "monitor"}


def harness_parts(ev, spec, costs) -> dict[str, float]:
    """Seconds of ``sim.replay.engine.run`` for each of ``PARTS``, driving a fresh ``spec``
    policy."""
    from sim.replay.metrics import PoolMonitor, default_sample_every

    out = {}
    for part, kwargs in PARTS.items():
        policy = make_policy(spec, costs)
        if kwargs == "monitor":
            monitor = PoolMonitor(policy, sample_every=default_sample_every(len(ev.ops)))
            kwargs = {"observe": monitor.sample, "observe_every": monitor.sample_every}
        out[part] = engine.run(
            ev.ops,
            ev.keys,
            ev.sizes,
            streams=ev.streams,
            tags=ev.tags,
            times_us=ev.times_us,
            target=engine.policy_target(policy),
            unknown_free=_unknown_free,
            **kwargs,
        ).wall_s
    return out


def sample_bytes(trace) -> dict:
    """Bytes per trace event of the latency samples of a 13-policy replay, in memory and in
    Parquet."""
    import tempfile

    from sim.replay.trace_replay import replay_tables

    samples = replay_tables(trace, README_POLICIES, with_bounds=False).latency_samples
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "latency_samples.parquet"
        samples.to_parquet(path, index=False)
        file_bytes = path.stat().st_size
    n = len(trace)
    return {
        "trace": trace.name,
        "events": n,
        "rows": len(samples),
        "memory_bytes_per_event": samples.memory_usage(deep=True).sum() / n,
        "parquet_bytes_per_event": file_bytes / n,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument(
        "-p", "--policy", action="append", dest="specs", help="a policy spec (repeat; default: all)"
    )
    ap.add_argument(
        "--repeat", type=int, default=5, help="runs per row, interleaved; the best is kept"
    )
    ap.add_argument("--out", default=None, help="also write the table as CSV here")
    ap.add_argument(
        "--sample-bytes", action="store_true", help="measure latency-sample storage instead"
    )
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="clock of the bare loops: "
        "wall (default) or cpu (process CPU time, for a busy machine)",
    )
    ap.add_argument(
        "--parts",
        action="store_true",
        help="instead: the bare loop and sim.replay.engine.run piece by piece (the loop alone, "
        "+ sampled timing, + the monitor), ns per event, policy rows only",
    )
    ap.add_argument(
        "--engine-calls",
        action="store_true",
        help="instead: calls per event of sim.replay.engine.run, "
        "at the default sampling and timing every call",
    )
    ap.add_argument(
        "--bare-only",
        action="store_true",
        help="time the bare loops only "
        "(no replay() rows: harness_ns, harness_x, replay_ns left empty)",
    )
    args = ap.parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]
    trace = read_alloc_trace(args.trace)
    if args.sample_bytes:
        r = sample_bytes(trace)
        print(
            f"# latency samples of a {len(README_POLICIES)}-policy replay of {r['trace']} "
            f"({r['events']:,} events, {r['rows']:,} rows): "
            f"{r['memory_bytes_per_event']:,.0f} B per event in memory, "
            f"{r['parquet_bytes_per_event']:,.0f} B per event in Parquet (target <= 400)"
        )
        return 0
    ev = trace_events(trace)
    events = request_events(ev)
    n = len(events)
    costs = CostModel.load()
    rows = [INLINE, TRIVIAL, OBJECT, NOTHING] + (args.specs or policies.available())
    print(
        f"# bench_replay {datetime.datetime.now().isoformat(timespec='seconds')} · "
        f"python {platform.python_version()} · {os.cpu_count()} cores · {platform.platform()}"
    )
    print(
        "# command: "
        f"python benchmarks/bench_replay.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    print(
        f"# trace {trace.name}: {n:,} events; best of {args.repeat}, rows interleaved, "
        f"{args.clock} clock; "
        f"load average before {os.getloadavg()[0]:.2f}"
    )
    if args.parts:
        return print_parts(ev, events, rows[rows.index(NOTHING) :], costs, args.repeat)
    if args.engine_calls:
        print(f"{'row':<24} {'bare_calls':>10} {'engine_calls':>12} {'every_calls':>11}")
        for row in rows[rows.index(NOTHING) :]:
            print(
                f"{row:<24} {calls_per_event(events, row, costs):>10.3f} "
                f"{engine_calls_per_event(ev, row, costs):>12.3f} "
                f"{engine_calls_per_event(ev, row, costs, latency_sample=1.0):>11.3f}"
            )
        return 0
    bare = dict.fromkeys(rows, float("inf"))
    harness = dict.fromkeys(rows, float("inf"))
    every = dict.fromkeys(rows, float("inf"))  # the harness timing every call
    whole = dict.fromkeys(rows, float("inf"))
    failed = dict.fromkeys(rows, 0)
    for _ in range(args.repeat):
        for row in rows:
            if row == INLINE:
                bare[row] = min(bare[row], inline_loop(events))
                continue
            if row in FLOORS:
                pool = FLOORS[row]()
                bare[row] = min(bare[row], bare_loop(events, pool.allocate, pool.free))
                if not args.bare_only:
                    harness[row] = min(harness[row], trivial_harness(ev, FLOORS[row]))
                    every[row] = min(
                        every[row], trivial_harness(ev, FLOORS[row], latency_sample=1.0)
                    )
                continue
            policy = make_policy(row, costs)
            bare[row] = min(bare[row], bare_loop(events, policy.allocate, policy.free))
            if args.bare_only:
                continue
            policy = make_policy(row, costs)
            t0 = time.perf_counter()
            result = replay(trace, policy)
            whole[row] = min(whole[row], time.perf_counter() - t0)
            harness[row] = min(harness[row], result.summary["wall_s"])
            failed[row] = result.summary["n_failed"]
            every[row] = min(
                every[row],
                replay(trace, make_policy(row, costs), latency_sample=1.0).summary["wall_s"],
            )
    calls = {row: calls_per_event(events, row, costs) for row in rows}
    print(
        f"# harness: timing {engine.default_latency_sample(len(ev.ops)):.3f} of the calls "
        "(the default); every_*: timing every call"
    )
    print(
        f"{'row':<24} {'bare_ns':>9} {'x_dict':>7} {'x_nothing':>9} {'calls':>6} "
        f"{'harness_ns':>10} {'harness_x':>9} {'every_ns':>9} {'every_x':>8} {'replay_ns':>9} "
        "failed harness verdict"
    )
    out_rows = []
    ns = 1e9 / n
    for row in rows:
        harness_x = harness[row] / bare[row]
        timed = harness[row] != float("inf")  # not with --bare-only: no harness ratio to mark
        mark = (
            ""
            if row == INLINE or not timed
            else f"{'ok' if harness_x <= HARNESS_TARGET else 'MISS'}"
        )
        if timed:
            harness_cols = (
                f"{harness[row] * ns:>10.0f} {harness_x:>8.2f}x {every[row] * ns:>9.0f} "
                f"{every[row] / bare[row]:>7.2f}x "
                f"{f'{whole[row] * ns:.0f}' if whole[row] != float('inf') else '-':>9} "
                f"{failed[row]}"
            )
        else:  # --bare-only: the harness columns were not measured
            harness_cols = f"{'-':>10} {'-':>9} {'-':>9} {'-':>8} {'-':>9} -"
        target = verdict(row, bare)
        print(
            f"{row:<24} {bare[row] * ns:>9.0f} {bare[row] / bare[INLINE]:>6.2f}x "
            f"{bare[row] / bare[NOTHING]:>8.2f}x {calls[row]:>6.1f} {harness_cols} {mark or '-'} "
            f"{target}"
        )
        out_rows.append(
            {
                "row": row,
                "bare_ns": bare[row] * ns,
                "x_dict": bare[row] / bare[INLINE],
                "x_nothing": bare[row] / bare[NOTHING],
                "harness_ns": harness[row] * ns if timed else None,
                "harness_x": harness_x if timed else None,
                "every_ns": every[row] * ns if timed else None,
                "every_x": every[row] / bare[row] if timed else None,
                "replay_ns": whole[row] * ns if whole[row] != float("inf") else None,
                "failed": failed[row],
                "calls_per_event": calls[row],
                "clock": args.clock,
                "verdict": target,
            }
        )
    policy_rows = [r for r in out_rows if r["row"] not in (INLINE, *FLOORS)]
    total_bare = sum(bare[r["row"]] for r in policy_rows)
    total_harness = sum(harness[r["row"]] for r in policy_rows)
    if not args.bare_only:
        total_every = sum(every[r["row"]] for r in policy_rows)
        print(
            f"# harness over bare loop, all policies together: {total_harness / total_bare:.2f}x "
            f"(target <= {HARNESS_TARGET}x); timing every call {total_every / total_bare:.2f}x"
        )
    if args.out:
        import csv

        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(out_rows[0]))
            w.writeheader()
            w.writerows(out_rows)
    return 0


def print_parts(ev, events, specs, costs, repeat) -> int:
    """``--parts``: best of ``repeat`` (interleaved) ns per event of the bare loop and of each of
    ``PARTS``."""
    best = {spec: dict.fromkeys(["bare", *PARTS], float("inf")) for spec in specs}
    for _ in range(repeat):
        for spec in specs:
            policy = make_policy(spec, costs)
            times = {
                "bare": bare_loop(events, policy.allocate, policy.free),
                **harness_parts(ev, spec, costs),
            }
            best[spec] = {k: min(best[spec][k], t) for k, t in times.items()}
    ns = 1e9 / len(events)
    print(
        f"# ns per event, best of {repeat}: the bare loop; sim.replay.engine.run timing no call "
        "(loop), timing the default sample (+timing), "
        "and with the monitor (+monitor: replay's engine)"
    )
    print(f"{'row':<24} {'bare':>6} " + " ".join(f"{p:>9}" for p in PARTS) + f" {'x_bare':>7}")
    for spec, t in best.items():
        print(
            f"{spec:<24} {t['bare'] * ns:>6.0f} "
            + " ".join(f"{t[p] * ns:>9.0f}" for p in PARTS)
            + f" {t['+monitor'] / t['bare']:>6.2f}x"
        )
    return 0


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
