"""Replay an allocation trace on the device: policies and baselines, in the shared report schema.

A policy is replayed by the simulator's own loop (``sim.replay.trace_replay.replay``) with the
policy's upstream being a real device (``GpuPool``): the same ``PoolMonitor`` samples the same event
indices and the device hands out the simulator's offsets, so the GPU row and the simulated row of
one trace and policy agree exactly on peak live, peak reserved, failures and fragmentation. What
differs is real: each timed ``allocate``/``free`` includes any ``cudaMalloc``/``cudaFree`` it caused
(and, for a compacting policy, the device copies of the allocations it moved, through
``realgpu.compaction.DeviceMover``), every allocation is touched (or, with ``validate``, filled and
checked), and the device's own used memory is read (NVML).

Baselines (``realgpu.baselines``) go through the same loop (``sim.replay.engine.run``: same timer,
same sampling stride) and the same row (``sim.replay.schema.summary_row``), touching each allocation
and reporting their own reserved-bytes reading. Columns they cannot know (fragmentation,
rounding waste for some) are NaN.

Extra summary columns, after ``SUMMARY_COLUMNS``: ``kind`` (policy or baseline), ``device``,
``device_kind`` (``policies.device_kind.DeviceKind``: ``segment``, ``cudaMalloc``; ``page-mapped``,
pages mapped with ``cuMem*``, whose per-call counts and measured times fill the report's device
columns), ``validate``, ``n_events``, ``driver_ns_total`` (measured time inside
``cudaMalloc``/``cudaFree``, or inside the ``cuMem*`` calls, for policies), ``device_mallocs``,
``device_frees`` (``cudaMalloc`` / ``cudaFree``, or ``cuMemCreate`` / ``cuMemRelease``, during the
replay; teardown frees the rest), ``moved_bytes``/``move_ns_total`` (compaction copies),
``nvml_base_used_bytes``,
``nvml_peak_used_bytes``, ``nvml_end_used_bytes`` (after teardown), ``memory_source``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd

import policies
from policies.base import Policy
from policies.device_kind import DeviceKind
from realgpu.baselines import Baseline, make_baseline
from realgpu.pool import GpuPool
from sim.replay.costs import costed_device
from sim.replay.engine import ALLOC, FREE, Target
from sim.replay.engine import run as engine_run
from sim.replay.metrics import PoolMonitor, default_sample_every
from sim.replay.trace_replay import ReplayResult, replay, trace_events
from sim.replay.schema import latency_samples, summary_frame, summary_row
from traces.events import AllocTrace

__all__ = [
    "gpu_replay",
    "baseline_replay",
    "gpu_replay_tables",
    "GpuReplayTables",
    "BaselineResult",
    "device_name",
]

NAN = float("nan")


@dataclass
class BaselineResult:
    """One (trace, baseline) run: a summary row in the report schema and its time series."""

    summary: dict[str, Any]
    timeseries: pd.DataFrame
    alloc_ns: np.ndarray
    free_ns: np.ndarray


def device_name(device_id: int = 0) -> str:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _memory_watch(device_id: int):
    from realgpu.nvml import MemoryReader, PeakWatch

    return PeakWatch(MemoryReader(device_id=device_id))


def gpu_replay(
    trace: AllocTrace,
    policy: str | Policy,
    *,
    backend: str = "cuda",
    capacity_bytes: int | None = None,
    validate: bool = False,
    sample_every: int | None = None,
    progress: bool = False,
    device_id: int = 0,
) -> ReplayResult:
    """Replay ``trace`` through ``policy`` driving real memory.

    Args:
        trace: the allocation events.
        policy: a spec string or a fresh policy object (see ``GpuPool``).
        backend: ``"cuda"``, ``"host"`` (the CPU stand-in, for tests), ``"cuda-vmm"`` or
            ``"host-vmm"`` (pages mapped into reserved ranges; see ``GpuPool``).
        capacity_bytes: the policy's capacity; None: the GPU's free memory less headroom on
            CUDA (recorded in the row, so a simulated run can be given the same), none on the host.
        validate: fill every allocation with a pattern (rounding slack as guard) and check it
            before each free; raises ``CorruptionError`` at the first difference.
        sample_every: stats sample stride in events (as ``sim.replay.trace_replay``).
        progress: show a progress bar.
        device_id: the CUDA device.

    Returns:
        ``sim.replay.trace_replay.ReplayResult`` with ``backend="gpu"`` rows; the pool is closed
        (every segment freed) before it returns.
    """
    watch = _memory_watch(device_id) if backend.startswith("cuda") else None
    pool = GpuPool(
        policy,
        backend=backend,
        capacity_bytes=capacity_bytes,
        validate=validate,
        guard_bytes=0,
        device_id=device_id,
    )
    mover = _attach_mover(pool, verify=validate)
    hook_alloc, on_free = pool.replay_hooks()
    on_alloc = hook_alloc if watch is None else _with_reading(hook_alloc, pool.policy, watch)

    device = pool.device
    try:
        result = replay(
            trace,
            pool.policy,
            backend="gpu",
            sample_every=sample_every,
            progress=progress,
            on_alloc=on_alloc,
            on_free=on_free,
        )
        device.synchronize()
        measured = {
            "driver_ns_total": device.driver_ns_total,
            "device_mallocs": device.num_maps,
            "device_frees": device.num_unmaps,
            "moved_bytes": mover.moved_bytes if mover is not None else 0,
            "move_ns_total": mover.copy_ns if mover is not None else 0,
        }
    finally:
        pool.close()
    result.summary.update(
        {
            "kind": "policy",
            "device": device_name(device_id) if pool.is_cuda else "host",
            # a plain string in the table (``DeviceKind``'s value)
            "device_kind": device.device_kind.value,
            "validate": bool(validate),
            **measured,
            **_memory_columns(watch),
        }
    )
    return result


@dataclass
class GpuReplayTables:
    """``gpu_replay_tables``' result: one summary row per run, their time series and latency
    samples."""

    summary: pd.DataFrame
    timeseries: pd.DataFrame
    latency_samples: pd.DataFrame


def gpu_replay_tables(
    trace: AllocTrace,
    specs: list[str],
    *,
    baselines: list[str] | tuple[str, ...] = (),
    backend: str = "cuda",
    device_kind: DeviceKind | str = DeviceKind.SEGMENT,
    capacity_bytes: int | None = None,
    validate: bool = False,
    with_sim: bool = False,
    costs: Any = None,
    sample_every: int | None = None,
    progress: bool = False,
    device_id: int = 0,
) -> GpuReplayTables:
    """``gpu_replay`` under each spec, in order, each followed (``with_sim``) by its simulated twin,
    then ``baseline_replay`` under each baseline: what ``poollab gpu replay`` runs.

    Args:
        backend: ``"cuda"`` or ``"host"``; ``device_kind="page-mapped"`` maps pages into reserved
            virtual ranges on either.
        with_sim: also replay each policy in the simulator at the capacity the real run had, on the
            simulator's page-mapped device when the real one mapped pages (rows ``backend=sim``).
        costs: the simulator's cost model (None: the bundled figures).
        Others: ``gpu_replay``'s.
    """
    pool_backend = DeviceKind.parse(device_kind).backend(backend)
    rows, series, runs = [], [], []
    for spec in specs:
        result = gpu_replay(
            trace,
            spec,
            backend=pool_backend,
            capacity_bytes=capacity_bytes,
            validate=validate,
            sample_every=sample_every,
            progress=progress,
            device_id=device_id,
        )
        rows.append(result.summary)
        series.append(result.timeseries)
        runs.append(result)
        if with_sim:
            twin: str | Policy = spec
            if (
                result.summary["device_kind"] == DeviceKind.PAGE_MAPPED
            ):  # the simulator's page-mapped device, same pages
                twin = policies.create(
                    spec,
                    capacity_bytes=result.summary["capacity_bytes"],
                    device=costed_device(DeviceKind.PAGE_MAPPED, costs),
                )
            sim = replay(
                trace,
                twin,
                capacity_bytes=result.summary["capacity_bytes"],
                costs=costs,
                sample_every=sample_every,
                progress=progress,
            )
            rows.append(
                {**sim.summary, "kind": "policy", "device_kind": result.summary["device_kind"]}
            )
            series.append(sim.timeseries)
            runs.append(sim)
    for name in baselines:
        result = baseline_replay(
            trace, name, sample_every=sample_every, progress=progress, device_id=device_id
        )
        rows.append(result.summary)
        series.append(result.timeseries)
        runs.append(result)
    return GpuReplayTables(
        summary_frame(rows), pd.concat(series, ignore_index=True), latency_samples(runs)
    )


def baseline_replay(
    trace: AllocTrace,
    baseline: str | Baseline,
    *,
    sample_every: int | None = None,
    progress: bool = False,
    device_id: int = 0,
    timer: Callable[[], int] = time.perf_counter_ns,
) -> BaselineResult:
    """Replay ``trace`` through a baseline allocator (``realgpu.baselines``) on the GPU.

    The loop is ``sim.replay.engine.run`` and the row ``sim.replay.schema.summary_row``, as for a
    policy: the timed region is the allocator's own call (``alloc(nbytes)``; ``free(handle)`` or
    dropping the last reference), a failed allocation is counted and its free skipped. Each
    allocation is made on the stream the trace recorded (``Baseline.use_stream``, switched between
    events, outside the timed call), so an allocator that caches per stream sees the trace's
    streams. The baseline is closed (its cache emptied) before this returns.
    """
    from realgpu.cuda import touch_pointer

    watch = _memory_watch(device_id)
    bl = make_baseline(baseline, device_id=device_id) if isinstance(baseline, str) else baseline
    return _baseline_run(
        trace,
        bl,
        watch=watch,
        touch=touch_pointer,
        sample_every=sample_every,
        progress=progress,
        device=device_name(device_id),
        synchronize=lambda: _synchronize(device_id),
        timer=timer,
    )


def _synchronize(device_id: int) -> None:
    import cupy

    cupy.cuda.Device(device_id).synchronize()


def _baseline_run(
    trace: AllocTrace,
    bl: Any,
    *,
    watch: Any,
    touch: Callable[[int, int], None],
    sample_every: int | None,
    progress: bool,
    device: str,
    synchronize: Callable[[], None],
    timer: Callable[[], int],
) -> BaselineResult:
    """``baseline_replay`` once the allocator, the memory watch and the device calls exist
    (split off so that the host tests can drive it with a stand-in allocator)."""
    events = trace_events(trace)
    n = len(events.ops)
    readings = BaselineReadings(bl)
    monitor = PoolMonitor(readings=readings, sample_every=sample_every or default_sample_every(n))
    pointer, note, reserved = bl.pointer, bl.note_alloc, bl.reserved_bytes
    poke = watch.poke if watch is not None else _no_reading

    def on_alloc(h: Any, nbytes: int, key: int) -> None:
        readings.allocated(key, nbytes)
        touch(pointer(h), nbytes)
        note()
        poke(reserved())

    where = trace.source or trace.name

    def unknown_free(i: int, key: int) -> Exception:
        return ValueError(f"{where}: event {i} frees allocation {key}, which is not live")

    target = Target(
        allocate=bl.alloc,
        free=None if bl.drop else bl.free,
        oom_errors=bl.oom_errors,
        sized_only=True,
        flush=bl.empty_cache,
    )
    try:
        run = engine_run(
            events.ops,
            events.keys,
            events.sizes,
            target=target,
            times_us=events.times_us,
            observe=_booking(monitor.observe, readings, events),
            on_alloc=on_alloc,
            before=_stream_switches(bl, events),
            unknown_free=unknown_free,
            timer=timer,
            progress=f"{trace.name} · {bl.name}" if progress else None,
        )
    finally:
        if bl.keys_by_stream:
            bl.use_stream(0)
    if n:
        monitor.finish(n - 1, events.times_us[-1])
    synchronize()
    readings.num_failed, readings.num_frees = (
        run.num_failed,
        run.num_frees,
    )  # every free, not the timed ones
    readings.counters = bl.counters()  # read before teardown frees what is still live
    row = summary_row(
        trace=trace.name,
        policy=bl.name,
        backend="gpu",
        params="",
        capacity_bytes=None,
        monitor=monitor,
        alloc_ns=run.alloc_ns,
        free_ns=run.free_ns,
        wall_s=run.wall_s,
        device_calls=None,
        n_events=n,
        n_empty_cache=run.num_flushes,
        kind="baseline",
        device=device,
        validate=False,
        driver_ns_total=NAN,
        device_mallocs=readings.counters["n_grow"],
        device_frees=readings.counters["n_shrink"],
    )
    if not bl.drop:
        for h in run.live.values():
            bl.free(h)
    run.live.clear()
    bl.close()
    row.update(_memory_columns(watch))
    ts = monitor.timeseries()
    for col, value in (("backend", "gpu"), ("policy", bl.name), ("trace", trace.name)):
        ts.insert(0, col, value)
    return BaselineResult(summary=row, timeseries=ts, alloc_ns=run.alloc_ns, free_ns=run.free_ns)


class BaselineReadings:
    """A baseline's readings for ``PoolMonitor``: live bytes tracked here (exact at every event),
    allocated and reserved bytes the allocator's own, what it cannot know NaN.

    ``counters`` (the allocator's ``counters()``) must be set before ``totals()`` is read.
    """

    def __init__(self, bl: Any):
        self.bl = bl
        self._sizes: dict[int, int] = {}  # key -> bytes asked, for the live bytes a free takes back
        self.live_bytes = self.peak_live_bytes = 0
        self.num_attempts = self.num_failed = self.num_frees = 0
        self.counters: dict[str, float] = {}

    def allocated(self, key: int, nbytes: int) -> None:
        self._sizes[key] = nbytes
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes

    def freed(self, key: int) -> None:
        nbytes = self._sizes.pop(key, None)  # None: the allocation had failed
        if nbytes is not None:
            self.live_bytes -= nbytes

    def sample(self) -> tuple:
        return (self.live_bytes, self.bl.allocated_bytes(), self.bl.reserved_bytes(), NAN, NAN, NAN)

    def totals(self) -> dict[str, Any]:
        c = self.counters
        return {
            "n_alloc": self.num_attempts,
            "n_free": self.num_frees,
            "n_failed": self.num_failed,
            "peak_live_bytes": self.peak_live_bytes,
            "peak_allocated_bytes": c["peak_allocated_bytes"],
            "peak_reserved_bytes": c["peak_reserved_bytes"],
            "n_grow": c["n_grow"],
            "n_shrink": c["n_shrink"],
            "grown_bytes": NAN,
            "shrunk_bytes": NAN,
        }


def _booking(
    observe: Callable[[int, int], None], readings: BaselineReadings, events: Any
) -> Callable:
    """``observe``, after booking the event's attempt or free in ``readings``."""
    ops, keys = events.ops, events.keys

    def observe_event(i: int, time_us: int) -> None:
        op = ops[i]
        if op == ALLOC:
            readings.num_attempts += 1
        elif op == FREE:  # an empty_cache call changes no live bytes
            readings.freed(keys[i])
        observe(i, time_us)

    return observe_event


def _stream_switches(bl: Any, events: Any) -> Callable[[int], None] | None:
    """``before(i)`` for the engine: ahead of an allocation on another stream than the previous
    allocation's, make the trace's stream current (``Baseline.use_stream``), outside the timed
    call. None where the allocator ignores streams or the trace has one stream (nothing to switch).

    A free needs no switch (the allocators return a block to the stream it was allocated on).
    """
    if not bl.keys_by_stream or len(set(events.streams)) < 2:
        return None
    switch_to: dict[
        int, int
    ] = {}  # event index -> stream id, at the allocations that change stream
    current = 0
    for i, (op, stream) in enumerate(zip(events.ops, events.streams)):
        if op == ALLOC and stream != current:
            switch_to[i] = current = stream
    use_stream, switch_at = bl.use_stream, switch_to.get

    def before(i: int) -> None:
        stream = switch_at(i)
        if stream is not None:
            use_stream(stream)

    return before


def _no_reading(reserved_bytes: int) -> None:
    """Where no device memory reading is taken (the host tests)."""


def _attach_mover(pool: GpuPool, *, verify: bool):
    """For a policy that moves live allocations (compaction): copy their bytes on the device."""
    from realgpu.compaction import attach

    if not pool.policy.moves_allocations or pool.policy.on_move is not None:
        return None
    return attach(pool, verify=verify)


def _with_reading(hook: Callable, policy: Policy, watch) -> Callable:
    """``hook`` plus a device reading whenever the policy's reserved bytes reach a new high."""
    poke = watch.poke

    def on_alloc(a) -> None:
        hook(a)
        poke(policy.reserved_bytes)

    return on_alloc


def _memory_columns(watch) -> dict[str, Any]:
    if watch is None:
        return {
            "nvml_base_used_bytes": NAN,
            "nvml_peak_used_bytes": NAN,
            "nvml_end_used_bytes": NAN,
            "memory_source": "",
        }
    return {
        "nvml_base_used_bytes": watch.base_used_bytes,
        "nvml_peak_used_bytes": watch.peak_used_bytes,
        "nvml_end_used_bytes": watch.reader.used_bytes(),
        "memory_source": watch.reader.source,
    }
