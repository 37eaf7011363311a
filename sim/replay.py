"""Replay an allocation trace against a policy and report it in the shared schema.

A failed allocation is counted and the trace goes on; its matching free is skipped. The latency
of each call is the policy's own bookkeeping time, measured with ``perf_counter_ns``, plus the
modelled driver time of any segment grow or shrink it caused (``sim.costs``), so a ``cudaMalloc``
on the hot path shows as it would on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

import policies
from policies.base import Allocation, Policy
from sim.bounds import bounds
from sim.costs import CostedDevice, CostModel
from sim.metrics import PoolMonitor, default_sample_every
from sim.report import latency_percentiles, latency_samples, summary_frame
from traces.events import AllocTrace

__all__ = ["ReplayResult", "ReplayTables", "replay", "replay_many", "replay_tables"]

#: How often (in events) the progress bar is advanced: often enough to move, rarely enough to be free.
_PROGRESS_STRIDE = 8192


@dataclass
class ReplayResult:
    """One (trace, policy, backend) run: a summary row and its time series."""

    summary: dict[str, Any]
    timeseries: pd.DataFrame
    policy: Policy
    alloc_ns: np.ndarray
    free_ns: np.ndarray


def replay(trace: AllocTrace, policy: Policy | str, *, capacity_bytes: int | None = None,
           costs: CostModel | None = None, backend: str = "sim", sample_every: int | None = None,
           progress: bool = False, on_alloc: Callable[[Allocation], None] | None = None,
           on_free: Callable[[Allocation], None] | None = None,
           timer: Callable[[], int] = time.perf_counter_ns) -> ReplayResult:
    """Replay ``trace`` through ``policy``.

    Args:
        trace: the allocation events.
        policy: a policy object (used as is: its device decides what grows cost) or a spec
            string (built with ``capacity_bytes`` on a ``CostedDevice`` charging ``costs``).
        capacity_bytes: only used when ``policy`` is a spec.
        costs: driver-time model for a spec-built policy (bundled H200 figures by default).
        backend: the report's ``backend`` column ("sim"; realgpu passes "gpu").
        sample_every: stats sample stride in events (about 2,000 samples by default).
        progress: show a progress bar.
        on_alloc / on_free: hooks run after each successful allocate / before each free,
            outside the timed region (realgpu touches memory there).
        timer: nanosecond clock.

    Returns:
        A ``ReplayResult`` whose ``summary`` has every ``SUMMARY_COLUMNS`` entry.
    """
    if isinstance(policy, str):
        policy = policies.create(policy, capacity_bytes=capacity_bytes, device=CostedDevice(costs))
    device = policy.device
    take_ns = device.take_ns if isinstance(device, CostedDevice) else None
    if take_ns is not None:
        take_ns()

    time_us, is_alloc, alloc_id, nbytes, stream = trace.arrays()
    tags = trace.events["tag"].to_numpy() if "tag" in trace.events else None
    n = len(time_us)
    every = sample_every or default_sample_every(n)
    monitor = PoolMonitor(policy, sample_every=every)
    observe = monitor.observe
    allocate, free = policy.allocate, policy.free
    live: dict[int, Allocation] = {}
    failed: set[int] = set()
    alloc_ns = np.zeros(int(is_alloc.sum()), dtype=np.int64)
    free_ns = np.zeros(n - len(alloc_ns), dtype=np.int64)
    ia = ifree = 0

    bar = _progress_bar(n, f"{trace.name} · {policy.spec}") if progress else None
    is_alloc_l, ids_l, sizes_l, streams_l, times_l = (is_alloc.tolist(), alloc_id.tolist(), nbytes.tolist(),
                                                       stream.tolist(), time_us.tolist())
    tags_l = tags.tolist() if tags is not None else None
    wall0 = time.perf_counter()
    for i in range(n):
        if is_alloc_l[i]:
            tag = tags_l[i] if tags_l is not None else None
            t0 = timer()
            a = allocate(sizes_l[i], stream=streams_l[i], tag=tag or None)
            t1 = timer()
            extra = take_ns() if take_ns is not None else 0
            alloc_ns[ia] = t1 - t0 + extra
            ia += 1
            if a is None:
                failed.add(ids_l[i])
            else:
                live[ids_l[i]] = a
                if on_alloc is not None:
                    on_alloc(a)
        else:
            a = live.pop(ids_l[i], None)
            if a is None:
                if ids_l[i] in failed:
                    failed.discard(ids_l[i])
                    observe(i, times_l[i])
                    continue
                raise ValueError(f"{trace.source or trace.name}: event {i} frees allocation {ids_l[i]}, which is not live")
            if on_free is not None:
                on_free(a)
            t0 = timer()
            free(a)
            t1 = timer()
            extra = take_ns() if take_ns is not None else 0
            free_ns[ifree] = t1 - t0 + extra
            ifree += 1
        observe(i, times_l[i])
        if bar is not None and i % _PROGRESS_STRIDE == _PROGRESS_STRIDE - 1:
            bar.update(_PROGRESS_STRIDE)
    wall_s = time.perf_counter() - wall0
    if bar is not None:
        bar.update(n - bar.n)
        bar.close()
    if n:
        monitor.finish(n - 1, times_l[-1])

    free_ns = free_ns[:ifree]
    row: dict[str, Any] = {
        "trace": trace.name,
        "policy": policy.spec,
        "backend": backend,
        "params": _params_text(policy),
        "capacity_bytes": policy.capacity_bytes,
        **monitor.summary_fields(),
        **latency_percentiles(alloc_ns, "alloc"),
        **latency_percentiles(free_ns, "free"),
        "wall_s": wall_s,
        "n_events": n,
        "driver_ns_total": getattr(device, "total_ns", 0),
    }
    ts = monitor.timeseries()
    ts.insert(0, "backend", backend)
    ts.insert(0, "policy", policy.spec)
    ts.insert(0, "trace", trace.name)
    return ReplayResult(summary=row, timeseries=ts, policy=policy, alloc_ns=alloc_ns, free_ns=free_ns)


@dataclass
class ReplayTables:
    """Several runs of one trace as report tables."""

    summary: pd.DataFrame
    timeseries: pd.DataFrame
    latency_samples: pd.DataFrame  # one row per call (``sim.report.LATENCY_SAMPLE_COLUMNS``)


def replay_tables(trace: AllocTrace, specs: Iterable[str], *, capacity_bytes: int | None = None,
                  costs: CostModel | None = None, sample_every: int | None = None,
                  progress: bool = False, with_bounds: bool = True) -> ReplayTables:
    """Replay one trace under several policy specs.

    With ``with_bounds`` each row also shows how far the policy is from the best possible:
    ``lower_bound_bytes`` (peak live bytes: no pool reserves less), ``planner_peak_bytes`` (an
    offline planner that knows every lifetime, ``sim.bounds``) and the gaps
    ``gap_to_bound = peak_reserved / lower_bound - 1``, ``gap_to_planner = peak_reserved /
    planner_peak - 1`` (negative when a pool refused requests the planner placed).
    """
    results = [replay(trace, spec, capacity_bytes=capacity_bytes, costs=costs, sample_every=sample_every,
                      progress=progress) for spec in specs]
    summary = summary_frame([r.summary for r in results])
    if with_bounds and len(trace):
        ref = bounds(trace)
        summary["lower_bound_bytes"] = ref["lower_bound_bytes"]
        summary["planner_peak_bytes"] = ref["planner_peak_bytes"]
        summary["planner"] = ref["planner"]
        summary["gap_to_bound"] = summary["peak_reserved_bytes"] / ref["lower_bound_bytes"] - 1
        summary["gap_to_planner"] = summary["peak_reserved_bytes"] / ref["planner_peak_bytes"] - 1
    return ReplayTables(summary, pd.concat([r.timeseries for r in results], ignore_index=True),
                        latency_samples(results))


def replay_many(trace: AllocTrace, specs: Iterable[str], **kwargs: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(summary, timeseries)`` of ``replay_tables`` (same arguments)."""
    tables = replay_tables(trace, specs, **kwargs)
    return tables.summary, tables.timeseries


def _params_text(policy: Policy) -> str:
    params = {k: v for k, v in policy.get_params().items() if k != "capacity_bytes"}
    return ";".join(f"{k}={getattr(v, 'spec', v)}" for k, v in params.items())


def _progress_bar(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="ev", unit_scale=True, leave=False, mininterval=0.5)
