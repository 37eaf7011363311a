"""Replay an allocation trace against a policy and report it in the shared schema.

The loop is ``sim.engine.run`` (the one every backend uses); the row is ``sim.report.summary_row``.
A failed allocation is counted and the trace goes on; its matching free is skipped. The latency
of each call is the policy's own bookkeeping time, measured with ``perf_counter_ns``, plus the
modelled driver time of any segment grow or shrink it caused (``sim.costs``), so a ``cudaMalloc``
on the hot path shows as it would on the device. A long trace times a random sample of its calls
(``latency_sample``, column ``latency_sampled_frac``): timing costs as much as a cheap call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from policies.base import Allocation, Policy
from sim.bounds import bounds
from sim.compaction_log import CompactionLog
from sim import engine
from sim.costs import CostModel
from sim.pools import create_policy
from sim.metrics import PoolMonitor, default_sample_every
from sim.report import latency_samples, params_text, summary_frame, summary_row
from traces.events import ALLOC_OP, AllocTrace

__all__ = ["ReplayResult", "ReplayTables", "replay", "replay_many", "replay_tables", "TraceEvents", "trace_events"]


@dataclass
class ReplayResult:
    """One (trace, policy, backend) run: a summary row and its time series."""

    summary: dict[str, Any]
    timeseries: pd.DataFrame
    policy: Policy
    alloc_ns: np.ndarray
    free_ns: np.ndarray
    layout: pd.DataFrame | None = None  # ``sim.interactive.layout.LAYOUT_COLUMNS`` with run keys; when recorded
    compactions: pd.DataFrame | None = None  # ``sim.compaction_log.COMPACTION_COLUMNS`` with run keys; compacting pools


def replay(trace: AllocTrace, policy: Policy | str, *, capacity_bytes: int | None = None,
           costs: CostModel | None = None, backend: str = "sim", sample_every: int | None = None,
           progress: bool = False, on_alloc: Callable[[Allocation], None] | None = None,
           on_free: Callable[[Allocation], None] | None = None,
           timer: Callable[[], int] = time.perf_counter_ns, record_layout: bool = False,
           latency_sample: float | None = None) -> ReplayResult:
    """Replay ``trace`` through ``policy``.

    Args:
        trace: the allocation events.
        policy: a policy object (used as is: its device decides what grows cost) or a spec
            string (built with ``capacity_bytes`` on the costed device it declares:
            ``sim.pools.create_policy``).
        capacity_bytes: only used when ``policy`` is a spec.
        costs: driver-time model for a spec-built policy (bundled H200 figures by default).
        backend: the report's ``backend`` column ("sim"; realgpu passes "gpu").
        sample_every: stats sample stride in events (about 2,000 samples by default).
        progress: show a progress bar.
        on_alloc / on_free: hooks run after each successful allocate / before each free,
            outside the timed region (realgpu touches memory there).
        timer: nanosecond clock.
        record_layout: also record the pool's segment layout (``sim.interactive.layout``) at
            about 200 of the monitor's sample points and at the first refusals; off by default
            (it adds a callback per event and a walk over the segments per layout).

    Returns:
        A ``ReplayResult`` whose ``summary`` has every ``SUMMARY_COLUMNS`` entry.
    """
    if isinstance(policy, str):
        policy = create_policy(policy, capacity_bytes=capacity_bytes, costs=costs)
    events = trace_events(trace)
    n = len(events.ops)
    monitor = PoolMonitor(policy, sample_every=sample_every or default_sample_every(n))
    where = trace.source or trace.name

    def unknown_free(i: int, key: int) -> Exception:
        return ValueError(f"{where}: event {i} frees allocation {key}, which is not live")

    target, observe, before, recorder = engine.policy_target(policy), monitor.sample, None, None
    if record_layout:
        from sim.interactive.layout import LayoutRecorder

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

    run = engine.run(events.ops, events.keys, events.sizes, streams=events.streams, tags=events.tags,
                     times_us=events.times_us, target=target, observe=observe, before=before,
                     observe_every=monitor.sample_every,
                     on_alloc=(lambda a, nbytes, key: on_alloc(a)) if on_alloc is not None else None, on_free=on_free,
                     unknown_free=unknown_free, timer=timer, latency_sample=latency_sample,
                     progress=f"{trace.name} · {policy.spec}" if progress else None)
    if n:
        monitor.finish(n - 1, events.times_us[-1])
        if recorder is not None:
            recorder.finish(n - 1, events.times_us[-1])
        if log is not None:
            log.observe(n - 1, events.times_us[-1])
    row = summary_row(trace=trace.name, policy=policy.spec, backend=backend, params=params_text(policy.get_params()),
                      capacity_bytes=policy.capacity_bytes, monitor=monitor, alloc_ns=run.alloc_ns,
                      free_ns=run.free_ns, wall_s=run.wall_s, device_calls=policy.device.call_stats(), n_events=n,
                      driver_ns_total=policy.device.driver_ns_total, n_empty_cache=run.num_flushes)
    ts = monitor.timeseries()
    ts.insert(0, "backend", backend)
    ts.insert(0, "policy", policy.spec)
    ts.insert(0, "trace", trace.name)
    layout, compactions = (recorder.table() if recorder is not None else None), (log.table() if log is not None else None)
    for table in (t for t in (layout, compactions) if t is not None):
        for i, (key, value) in enumerate((("trace", trace.name), ("policy", policy.spec), ("backend", backend))):
            table.insert(i, key, value)
    return ReplayResult(summary=row, timeseries=ts, policy=policy, alloc_ns=run.alloc_ns, free_ns=run.free_ns,
                        layout=layout, compactions=compactions)


@dataclass(slots=True)
class TraceEvents:
    """An ``AllocTrace`` as the engine's event lists (lists, not arrays: the loop indexes them).

    ``ops`` is ``bytes``, one op code an event (indexed and iterated as ints like the lists): the
    engine's tight loop reads it as a buffer (``engine._event_codes``), where a list would cost it
    a pass in Python (5 ns an event on dev, 2026-11-30).
    """

    ops: bytes
    keys: list[int]
    sizes: list[int]
    streams: list[int]
    tags: list[Any] | None
    times_us: list[int]


def trace_events(trace: AllocTrace) -> TraceEvents:
    """Every row of the trace as an engine event, an ``empty_cache`` row as a ``FLUSH``."""
    ev = trace.events
    tags = [t or None for t in ev["tag"].tolist()] if "tag" in ev else None  # "" is no tag
    is_alloc = (ev["op"] == ALLOC_OP).to_numpy()
    ops = np.where(is_alloc, engine.ALLOC, np.where(trace.is_empty_cache(), engine.FLUSH, engine.FREE)).astype(np.uint8)
    ops = ops.tobytes()
    return TraceEvents(ops, *(ev[c].to_numpy(np.int64).tolist() for c in ("alloc_id", "nbytes", "stream")), tags,
                       ev["time_us"].to_numpy(np.int64).tolist())


@dataclass
class ReplayTables:
    """Several runs of one trace as report tables."""

    summary: pd.DataFrame
    timeseries: pd.DataFrame
    latency_samples: pd.DataFrame  # one row per call (``sim.report.LATENCY_SAMPLE_COLUMNS``)
    layout: pd.DataFrame | None = None  # segment layouts (``record_layout``), PyTorch's recorded ones included
    compactions: pd.DataFrame | None = None  # compaction passes of the compacting runs (``sim.compaction_log``)


def replay_tables(trace: AllocTrace, specs: Iterable[str], *, capacity_bytes: int | None = None,
                  costs: CostModel | None = None, sample_every: int | None = None,
                  progress: bool = False, with_bounds: bool = True, record_layout: bool = False,
                  latency_sample: float | None = None) -> ReplayTables:
    """Replay one trace under several policy specs.

    With ``with_bounds`` each row also shows how far the policy is from the best possible:
    ``lower_bound_bytes`` (peak live bytes: no pool reserves less), ``planner_peak_bytes`` (an
    offline planner that knows every lifetime, ``sim.bounds``) and the gaps
    ``gap_to_bound = peak_reserved / lower_bound - 1``, ``gap_to_planner = peak_reserved /
    planner_peak - 1`` (negative when a pool refused requests the planner placed), and
    ``planner``/``planner_s``: which planner ran and the seconds the bounds took (the same for
    every row: one reference per trace).

    With ``record_layout`` the tables also hold every run's segment layouts (``replay``) and,
    for a PyTorch snapshot, the segments its allocator held at the same moments
    (``sim.interactive.layout.pytorch_layout``).
    """
    results = [replay(trace, spec, capacity_bytes=capacity_bytes, costs=costs, sample_every=sample_every,
                      progress=progress, record_layout=record_layout, latency_sample=latency_sample)
               for spec in specs]
    summary = summary_frame([r.summary for r in results])
    if with_bounds and len(trace):
        ref = bounds(trace)
        summary["lower_bound_bytes"] = ref["lower_bound_bytes"]
        summary["planner_peak_bytes"] = ref["planner_peak_bytes"]
        summary["planner"] = ref["planner"]
        summary["planner_s"] = ref["planner_s"]  # its time, apart from the policies' wall_s (up to a quarter of a replay)
        summary["gap_to_bound"] = summary["peak_reserved_bytes"] / ref["lower_bound_bytes"] - 1
        summary["gap_to_planner"] = summary["peak_reserved_bytes"] / ref["planner_peak_bytes"] - 1
    return ReplayTables(summary, pd.concat([r.timeseries for r in results], ignore_index=True),
                        latency_samples(results), _layouts(trace, results) if record_layout else None,
                        _compactions(results))


def _compactions(results: list[ReplayResult]) -> pd.DataFrame | None:
    """The compacting runs' compaction tables (None when no run could compact)."""
    parts = [r.compactions for r in results if r.compactions is not None]
    return pd.concat(parts, ignore_index=True) if parts else None


def _layouts(trace: AllocTrace, results: list[ReplayResult]) -> pd.DataFrame | None:
    """The runs' layouts, and PyTorch's recorded segments at the first run's sample moments."""
    from sim.interactive.layout import RECORDED_POLICY, pytorch_layout

    parts = [r.layout for r in results if r.layout is not None and len(r.layout)]
    if parts:
        first = parts[0][~parts[0]["at_failure"]].drop_duplicates("sample")
        recorded = pytorch_layout(trace.meta, list(zip(first["event"].tolist(), first["time_us"].tolist())),
                                  trace.events)
        if recorded is not None:
            for i, (key, value) in enumerate((("trace", trace.name), ("policy", RECORDED_POLICY),
                                              ("backend", "snapshot"))):
                recorded.insert(i, key, value)
            parts.append(recorded)
    return pd.concat(parts, ignore_index=True) if parts else None


def replay_many(trace: AllocTrace, specs: Iterable[str], **kwargs: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(summary, timeseries)`` of ``replay_tables`` (same arguments)."""
    tables = replay_tables(trace, specs, **kwargs)
    return tables.summary, tables.timeseries
