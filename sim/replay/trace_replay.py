"""Replay an allocation trace against a policy and report it in the shared schema.

The loop is ``sim.replay.engine.run`` (the one every backend uses); the row is
``sim.replay.schema.summary_row``. A failed allocation is counted and the trace goes on; its
matching free is skipped. The latency of each call is the policy's own bookkeeping time, measured
with ``perf_counter_ns``, plus the modelled driver time of any segment grow or shrink it caused
(``sim.replay.costs``), so a ``cudaMalloc`` on the hot path shows as it would on the device. A long
trace times a random sample of its calls (``latency_sample``, column ``latency_sampled_frac``):
timing costs as much as a cheap
call.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from policies.base import Allocation, Policy
from sim.replay.bounds import bounds
from sim.replay.compaction_log import CompactionLog
from sim.replay import engine
from sim.replay.costs import CostModel
from sim.replay.costed_policy import create_policy
from sim.replay.metrics import PoolMonitor, default_sample_every
from sim.replay.schema import latency_samples, params_text, summary_frame, summary_row
from traces.events import ALLOC_OP, AllocTrace

__all__ = [
    "ReplayResult",
    "ReplayTables",
    "replay",
    "replay_many",
    "replay_tables",
    "TraceEvents",
    "trace_events",
    "available_cores",
    "MIN_EVENTS_FOR_WORKERS",
]


@dataclass
class ReplayResult:
    """One (trace, policy, backend) run: a summary row and its time series."""

    summary: dict[str, Any]
    timeseries: pd.DataFrame
    policy: (
        Policy | None
    )  # None for a run made in a worker process (``replay_tables``): the pool stayed there
    alloc_ns: np.ndarray
    free_ns: np.ndarray
    layout: pd.DataFrame | None = (
        None  # ``sim.replay.layout.LAYOUT_COLUMNS`` with run keys; when recorded
    )
    compactions: pd.DataFrame | None = (
        None  # ``sim.replay.compaction_log.COMPACTION_COLUMNS`` with run keys; compacting pools
    )


def replay(
    trace: AllocTrace,
    policy: Policy | str,
    *,
    capacity_bytes: int | None = None,
    costs: CostModel | None = None,
    backend: str = "sim",
    sample_every: int | None = None,
    progress: bool | Callable[[int], None] = False,
    on_alloc: Callable[[Allocation], None] | None = None,
    on_free: Callable[[Allocation], None] | None = None,
    timer: Callable[[], int] = time.perf_counter_ns,
    record_layout: bool = False,
    latency_sample: float | None = None,
    events: "TraceEvents | None" = None,
) -> ReplayResult:
    """Replay ``trace`` through ``policy``.

    Args:
        trace: the allocation events.
        policy: a policy object (used as is: its device decides what grows cost) or a spec
            string (built with ``capacity_bytes`` on the costed device it declares:
            ``sim.serving.pools.create_policy``).
        capacity_bytes: only used when ``policy`` is a spec.
        costs: driver-time model for a spec-built policy (bundled H200 figures by default).
        backend: the report's ``backend`` column ("sim"; realgpu passes "gpu").
        sample_every: stats sample stride in events (about 2,000 samples by default).
        progress: show a progress bar (on a terminal), or a callable given the events done
            as the run advances (``sim.replay.engine.run``).
        on_alloc / on_free: hooks run after each successful allocate / before each free,
            outside the timed region (realgpu touches memory there).
        timer: nanosecond clock.
        record_layout: also record the pool's segment layout (``sim.replay.layout``) at
            about 200 of the monitor's sample points and at the first refusals; off by default
            (it adds a callback per event and a walk over the segments per layout).
        latency_sample: the share of calls timed (``sim.replay.engine.run``).
        events: ``trace_events(trace)`` when the caller already has it (several policies over
            one trace share one table); made here when None.

    Returns:
        A ``ReplayResult`` whose ``summary`` has every ``SUMMARY_COLUMNS`` entry.
    """
    if isinstance(policy, str):
        policy = create_policy(policy, capacity_bytes=capacity_bytes, costs=costs)
    events = trace_events(trace) if events is None else events
    n = len(events.ops)
    monitor = PoolMonitor(policy, sample_every=sample_every or default_sample_every(n))
    where = trace.source or trace.name

    def unknown_free(i: int, key: int) -> Exception:
        return ValueError(f"{where}: event {i} frees allocation {key}, which is not live")

    target, observe, before, recorder = engine.policy_target(policy), monitor.sample, None, None
    if record_layout:
        from sim.replay.layout import LayoutRecorder

        recorder = LayoutRecorder(policy, num_monitor_samples=n // monitor.sample_every + 1)
        target.allocate = recorder.wrap_allocate(target.allocate, events.times_us)
        before = recorder.before

        def observe_both(event: int, time_us: int) -> None:
            monitor.sample(event, time_us)
            recorder.observe(event, time_us)

        observe = observe_both
    log = CompactionLog(policy) if policy.can_compact else None
    if log is not None:  # read the pool's compaction totals at the sample points only
        observe_before_log = observe

        def observe(event: int, time_us: int) -> None:
            observe_before_log(event, time_us)
            log.observe(event, time_us)

    run = engine.run(
        events.ops,
        events.keys,
        events.sizes,
        streams=events.streams,
        tags=events.tags,
        times_us=events.times_us,
        target=target,
        observe=observe,
        before=before,
        observe_every=monitor.sample_every,
        on_alloc=(lambda a, nbytes, key: on_alloc(a)) if on_alloc is not None else None,
        on_free=on_free,
        unknown_free=unknown_free,
        timer=timer,
        latency_sample=latency_sample,
        progress=(
            progress
            if callable(progress)
            else f"{trace.name} · {policy.spec}"
            if progress
            else None
        ),
    )
    if n:
        monitor.finish(n - 1, events.times_us[-1])
        if recorder is not None:
            recorder.finish(n - 1, events.times_us[-1])
        if log is not None:
            log.observe(n - 1, events.times_us[-1])
    row = summary_row(
        trace=trace.name,
        policy=policy.spec,
        backend=backend,
        params=params_text(policy.get_params()),
        capacity_bytes=policy.capacity_bytes,
        monitor=monitor,
        alloc_ns=run.alloc_ns,
        free_ns=run.free_ns,
        wall_s=run.wall_s,
        device_calls=policy.device.call_stats(),
        n_events=n,
        driver_ns_total=policy.device.driver_ns_total,
        n_empty_cache=run.num_flushes,
    )
    ts = monitor.timeseries()
    ts.insert(0, "backend", backend)
    ts.insert(0, "policy", policy.spec)
    ts.insert(0, "trace", trace.name)
    layout, compactions = (
        (recorder.table() if recorder is not None else None),
        (log.table() if log is not None else None),
    )
    for table in (t for t in (layout, compactions) if t is not None):
        for i, (key, value) in enumerate(
            (("trace", trace.name), ("policy", policy.spec), ("backend", backend))
        ):
            table.insert(i, key, value)
    return ReplayResult(
        summary=row,
        timeseries=ts,
        policy=policy,
        alloc_ns=run.alloc_ns,
        free_ns=run.free_ns,
        layout=layout,
        compactions=compactions,
    )


@dataclass(slots=True)
class TraceEvents:
    """An ``AllocTrace`` as the engine's event columns, compact: 8 bytes an event a column.

    ``ops`` is ``bytes`` (one op code an event, read by the engine's tight loop as a buffer:
    ``engine._event_codes``); ``keys``, ``sizes``, ``streams`` and ``times_us`` are ``array('q')``,
    which iterate and index as ints as lists do, at a fifth of a list's memory (a list holds an
    8-byte pointer to a 32-byte int per event) and with no object per event, so worker processes
    forked over one table share its pages instead of copying them as they touch each int's
    reference count (``replay_tables``). ``tags`` is a list (None: no event has one), its
    entries the few distinct strings.
    """

    ops: bytes
    keys: array
    sizes: array
    streams: array
    tags: list[Any] | None
    times_us: array


def trace_events(trace: AllocTrace) -> TraceEvents:
    """Every row of the trace as an engine event, an ``empty_cache`` row as a ``FLUSH``."""
    ev = trace.events
    tags = _engine_tags(ev["tag"]) if "tag" in ev else None
    is_alloc = (ev["op"] == ALLOC_OP).to_numpy()
    ops = np.where(
        is_alloc, engine.ALLOC, np.where(trace.is_empty_cache(), engine.FLUSH, engine.FREE)
    ).astype(np.uint8)
    ops = ops.tobytes()
    return TraceEvents(
        ops,
        *(_int_column(ev[c]) for c in ("alloc_id", "nbytes", "stream")),
        tags,
        _int_column(ev["time_us"]),
    )


def _engine_tags(tag: pd.Series) -> list[Any] | None:
    """The tag column as the engine's list, ``""`` as None (no tag); None where no row has one.

    The column's few distinct values are found once (``pd.factorize``: a dictionary encode in
    C for Arrow strings) and each row's entry taken from them, so the list holds those few
    objects, not a new str a row (``tolist``): 0.03 s less for 1.5 M rows, and pages that
    forked workers share.
    """
    codes, uniques = pd.factorize(tag, use_na_sentinel=False)
    values = [u or None for u in uniques]  # a missing value (NaN) stays itself, as it is truthy
    if not any(values):
        return None
    return np.array(values, dtype=object)[codes].tolist()


def _int_column(column: pd.Series) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(column.to_numpy(np.int64)).tobytes())
    return out


@dataclass
class ReplayTables:
    """Several runs of one trace as report tables."""

    summary: pd.DataFrame
    timeseries: pd.DataFrame
    latency_samples: pd.DataFrame  # one row per call (``sim.replay.schema.LATENCY_SAMPLE_COLUMNS``)
    layout: pd.DataFrame | None = (
        None  # segment layouts (``record_layout``), PyTorch's recorded ones included
    )
    compactions: pd.DataFrame | None = (
        None  # compaction passes of the compacting runs (``sim.replay.compaction_log``)
    )


def replay_tables(
    trace: AllocTrace,
    specs: Iterable[str],
    *,
    capacity_bytes: int | None = None,
    costs: CostModel | None = None,
    sample_every: int | None = None,
    progress: bool = False,
    with_bounds: bool = True,
    record_layout: bool = False,
    latency_sample: float | None = None,
    workers: int | None = None,
) -> ReplayTables:
    """Replay one trace under several policy specs.

    The trace becomes one compact event table (``trace_events``) that every run reads. With
    ``workers`` above 1 (by default: the cores this process may use, when there are several
    runs, a long trace and no other thread: ``_num_workers``), the runs, and the bounds, go to that
    many forked worker processes, which share the table's pages; each run is the same as in this
    process (the same ``replay`` of the same table), its rows come back in spec order, and one bar
    counts the events of all of them.

    With ``with_bounds`` each row also shows how far the policy is from the best possible:
    ``lower_bound_bytes`` (peak live bytes: no pool reserves less), ``planner_peak_bytes`` (an
    offline planner that knows every lifetime, ``sim.replay.bounds``) and the gaps
    ``gap_to_bound = peak_reserved / lower_bound - 1``, ``gap_to_planner = peak_reserved /
    planner_peak - 1`` (negative when a pool refused requests the planner placed), and
    ``planner``/``planner_s``: which planner ran and the seconds the bounds took (the same for
    every row: one reference per trace).

    With ``record_layout`` the tables also hold every run's segment layouts (``replay``) and,
    for a PyTorch snapshot, the segments its allocator held at the same moments
    (``sim.replay.layout.pytorch_layout``).
    """
    specs = list(specs)
    events = trace_events(trace)
    bounded = with_bounds and len(trace) > 0
    options = {
        "capacity_bytes": capacity_bytes,
        "costs": costs,
        "sample_every": sample_every,
        "record_layout": record_layout,
        "latency_sample": latency_sample,
    }
    num_workers = _num_workers(workers, len(specs) + bounded, len(events.ops))
    if num_workers > 1:
        results, ref = _replay_in_workers(
            trace, events, specs, options, bounded, num_workers, progress
        )
    else:
        results = [
            replay(trace, spec, progress=progress, events=events, **options) for spec in specs
        ]
        ref = bounds(trace) if bounded else None
    summary = summary_frame([r.summary for r in results])
    if ref is not None:
        summary["lower_bound_bytes"] = ref["lower_bound_bytes"]
        summary["planner_peak_bytes"] = ref["planner_peak_bytes"]
        summary["planner"] = ref["planner"]
        summary["planner_s"] = ref[
            "planner_s"
        ]  # its time, apart from the policies' wall_s (up to a quarter of a replay)
        summary["gap_to_bound"] = summary["peak_reserved_bytes"] / ref["lower_bound_bytes"] - 1
        summary["gap_to_planner"] = summary["peak_reserved_bytes"] / ref["planner_peak_bytes"] - 1
    return ReplayTables(
        summary,
        pd.concat([r.timeseries for r in results], ignore_index=True),
        latency_samples(results),
        _layouts(trace, results) if record_layout else None,
        _compactions(results),
    )


#: Below this many events a run takes well under a second: forking workers would cost more than it
#: saves.
MIN_EVENTS_FOR_WORKERS = 50_000


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or ``taskset``
    narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _num_workers(workers: int | None, num_jobs: int, num_events: int) -> int:
    """Workers for ``replay_tables``: by default the cores, but one (this process) for a short
    trace, off POSIX (no fork), or where threads run already (a notebook's kernel): a fork
    copies a lock another thread may hold."""
    if workers is None:
        if (
            num_events < MIN_EVENTS_FOR_WORKERS
            or os.name != "posix"
            or threading.active_count() > 1
        ):
            return 1
        workers = available_cores()
    if workers < 1:
        raise ValueError(f"workers(={workers}) must be >= 1")
    return max(1, min(workers, num_jobs))


#: What a forked worker reads: set in the parent just before the fork, so the children inherit it
#: (the trace and its event table are shared pages, never pickled).
_JOB: dict[str, Any] = {}
#: A worker's youngest-generation collection threshold (CPython's default: 700). A replay makes
#: and drops three tracked objects a call (allocation, block, extents tuple): at 700 a young
#: collection runs every few hundred events and walks objects that die soon after anyway; at
#: this threshold most die before one (with the parent's objects frozen: -2.4 % of an expandable
#: replay's instructions, -3.6 % of torch-caching's; ``benchmarks/RESULTS.md``, session 19 t2).
#: The cyclic garbage a worker holds between collections stays a few MB.
WORKER_GC_THRESHOLD = 50_000


def _start_worker() -> None:
    """In a forked worker, before its first job: the collection threshold above (results do not
    depend on when the collector runs)."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(WORKER_GC_THRESHOLD, older, oldest)


def _worker_job(job: int) -> Any:
    """One job in a worker: replay ``specs[job]``, or the bounds for the last job."""
    trace, events, specs, options, counts = (
        _JOB[k] for k in ("trace", "events", "specs", "options", "counts")
    )
    if job == len(specs):
        return bounds(trace)
    result = replay(
        trace, specs[job], events=events, progress=lambda n: counts.add(job, n), **options
    )
    result.policy = (
        None  # the pool stays here: its state can be large and it is no part of the tables
    )
    return result


def _replay_in_workers(
    trace: AllocTrace,
    events: TraceEvents,
    specs: list[str],
    options: dict[str, Any],
    bounded: bool,
    num_workers: int,
    progress: bool,
) -> tuple[list[ReplayResult], dict | None]:
    import concurrent.futures as cf
    import multiprocessing

    from sim.replay.progress import SharedCounts, progress_bar

    ctx = multiprocessing.get_context("fork")
    counts = SharedCounts(len(specs), ctx)
    _JOB.update(trace=trace, events=events, specs=specs, options=options, counts=counts)
    bar = None
    # the objects made so far (the trace, the modules) go to the collector's permanent generation
    # until the workers are done: a worker's collections never walk them, nor write their
    # headers, so their pages stay shared with this process
    froze = gc.get_freeze_count() == 0  # a caller's own frozen objects are its to unfreeze
    if froze:
        gc.freeze()
    try:
        with cf.ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=_start_worker) as pool:
            # the bounds first: a single long job that would otherwise finish last
            jobs = ([len(specs)] if bounded else []) + list(range(len(specs)))
            futures = {job: pool.submit(_worker_job, job) for job in jobs}
            # the bar after the fork (the workers start at the first submit): its thread stays here
            bar = progress_bar(
                len(events.ops) * len(specs),
                f"{trace.name} · {len(specs)} policies, {num_workers} workers",
                enabled=progress,
            )
            pending = set(futures.values())
            while pending:
                done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_EXCEPTION)
                bar.update(counts.total() - bar.n)
                failed = next((f for f in done if f.exception() is not None), None)
                if failed is not None:  # the first error, at once: the jobs not started are dropped
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise failed.exception()
            outcomes = {job: f.result() for job, f in futures.items()}
    finally:
        if froze:
            gc.unfreeze()
        _JOB.clear()
        if bar is not None:
            bar.close()
    return [outcomes[j] for j in range(len(specs))], outcomes.get(len(specs))


def _compactions(results: list[ReplayResult]) -> pd.DataFrame | None:
    """The compacting runs' compaction tables (None when no run could compact)."""
    parts = [r.compactions for r in results if r.compactions is not None]
    return pd.concat(parts, ignore_index=True) if parts else None


def _layouts(trace: AllocTrace, results: list[ReplayResult]) -> pd.DataFrame | None:
    """The runs' layouts, and PyTorch's recorded segments at the first run's sample moments."""
    from sim.replay.layout import RECORDED_POLICY, pytorch_layout

    parts = [r.layout for r in results if r.layout is not None and len(r.layout)]
    if parts:
        first = parts[0][~parts[0]["at_failure"]].drop_duplicates("sample")
        recorded = pytorch_layout(
            trace.meta, list(zip(first["event"].tolist(), first["time_us"].tolist())), trace.events
        )
        if recorded is not None:
            for i, (key, value) in enumerate(
                (("trace", trace.name), ("policy", RECORDED_POLICY), ("backend", "snapshot"))
            ):
                recorded.insert(i, key, value)
            parts.append(recorded)
    return pd.concat(parts, ignore_index=True) if parts else None


def replay_many(
    trace: AllocTrace, specs: Iterable[str], **kwargs: Any
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(summary, timeseries)`` of ``replay_tables`` (same arguments)."""
    tables = replay_tables(trace, specs, **kwargs)
    return tables.summary, tables.timeseries
