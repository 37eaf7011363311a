"""Replay an allocation trace on the device: policies and baselines, in the shared report schema.

A policy is replayed by the simulator's own loop (``sim.replay.replay``) with the policy's
upstream being a real device (``GpuPool``): the same ``PoolMonitor`` samples the same event
indices and the device hands out the simulator's offsets, so the GPU row and the simulated row
of one trace and policy agree exactly on peak live, peak reserved, failures and fragmentation.
What differs is real: each timed ``allocate``/``free`` includes any ``cudaMalloc``/``cudaFree``
it caused (and, for a compacting policy, the device copies of the allocations it moved, through
``realgpu.compaction.DeviceMover``), every allocation is touched (or, with ``validate``, filled
and checked), and the device's own used memory is read (NVML).

Baselines (``realgpu.baselines``) go through a loop built the same way (same timer, same
touching, same sampling stride), each reporting its own reserved-bytes reading. Columns they
cannot know (fragmentation, rounding waste for some) are NaN.

Extra summary columns, after ``SUMMARY_COLUMNS``: ``kind`` (policy or baseline), ``device``,
``validate``, ``n_events``, ``driver_ns_total`` (measured time inside ``cudaMalloc``/``cudaFree``
for policies), ``device_mallocs``, ``device_frees`` (during the replay; teardown frees the rest),
``moved_bytes``/``move_ns_total`` (compaction copies),
``nvml_base_used_bytes``,
``nvml_peak_used_bytes``, ``nvml_end_used_bytes`` (after teardown), ``memory_source``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd

from policies.base import Policy
from realgpu.baselines import Baseline, make_baseline
from realgpu.pool import GpuPool
from sim.metrics import default_sample_every
from sim.replay import ReplayResult, replay
from sim.report import latency_percentiles
from traces.events import AllocTrace

__all__ = ["gpu_replay", "baseline_replay", "BaselineResult", "device_name"]

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


def gpu_replay(trace: AllocTrace, policy: str | Policy, *, backend: str = "cuda",
               capacity_bytes: int | None = None, validate: bool = False, sample_every: int | None = None,
               progress: bool = False, device_id: int = 0) -> ReplayResult:
    """Replay ``trace`` through ``policy`` driving real memory.

    Args:
        trace: the allocation events.
        policy: a spec string or a fresh policy object (see ``GpuPool``).
        backend: ``"cuda"`` or ``"host"`` (the CPU stand-in, for tests).
        capacity_bytes: the policy's capacity; None: the GPU's free memory less headroom on
            CUDA (recorded in the row, so a simulated run can be given the same), none on the host.
        validate: fill every allocation with a pattern (rounding slack as guard) and check it
            before each free; raises ``CorruptionError`` at the first difference.
        sample_every: stats sample stride in events (as ``sim.replay``).
        progress: show a progress bar.
        device_id: the CUDA device.

    Returns:
        ``sim.replay.ReplayResult`` with ``backend="gpu"`` rows; the pool is closed (every
        segment freed) before it returns.
    """
    watch = _memory_watch(device_id) if backend == "cuda" else None
    pool = GpuPool(policy, backend=backend, capacity_bytes=capacity_bytes, validate=validate, guard_bytes=0,
                   device_id=device_id)
    mover = _attach_mover(pool, verify=validate)
    hook_alloc, on_free = pool.replay_hooks()
    on_alloc = hook_alloc if watch is None else _with_reading(hook_alloc, pool.policy, watch)

    device = pool.device
    try:
        result = replay(trace, pool.policy, backend="gpu", sample_every=sample_every, progress=progress,
                        on_alloc=on_alloc, on_free=on_free)
        device.synchronize()
        measured = {"driver_ns_total": device.map_ns + device.unmap_ns, "device_mallocs": device.num_maps,
                    "device_frees": device.num_unmaps,
                    "moved_bytes": mover.moved_bytes if mover is not None else 0,
                    "move_ns_total": mover.copy_ns if mover is not None else 0}
    finally:
        pool.close()
    result.summary.update({
        "kind": "policy",
        "device": device_name(device_id) if pool.is_cuda else "host",
        "validate": bool(validate),
        **measured,
        **_memory_columns(watch),
    })
    return result


def baseline_replay(trace: AllocTrace, baseline: str | Baseline, *, sample_every: int | None = None,
                    progress: bool = False, device_id: int = 0,
                    timer: Callable[[], int] = time.perf_counter_ns) -> BaselineResult:
    """Replay ``trace`` through a baseline allocator (``realgpu.baselines``) on the GPU.

    The timed region is the allocator's own call (``alloc(nbytes)``; ``free(handle)`` or
    dropping the last reference), as in ``sim.replay``. A failed allocation is counted and its
    free skipped. The baseline is closed (its cache emptied) before this returns.
    """
    from realgpu.cuda import touch_pointer

    watch = _memory_watch(device_id)
    bl = make_baseline(baseline, device_id=device_id) if isinstance(baseline, str) else baseline
    time_us, is_alloc, alloc_id, nbytes, _ = trace.arrays()
    n = len(time_us)
    every = sample_every or default_sample_every(n)
    alloc_ns = np.zeros(int(is_alloc.sum()), dtype=np.int64)
    free_ns = np.zeros(n - len(alloc_ns), dtype=np.int64)
    alloc, free, drop, pointer = bl.alloc, bl.free, bl.drop, bl.pointer
    oom, note, reserved, allocated = bl.oom_errors, bl.note_alloc, bl.reserved_bytes, bl.allocated_bytes
    poke = watch.poke
    live: dict[int, Any] = {}
    sizes: dict[int, int] = {}
    failed: set[int] = set()
    rows: list[tuple] = []
    ia = ifree = n_failed = 0
    live_bytes = peak_live = 0
    bar = _progress_bar(n, f"{trace.name} · {bl.name}") if progress else None
    is_alloc_l, ids_l, sizes_l, times_l = is_alloc.tolist(), alloc_id.tolist(), nbytes.tolist(), time_us.tolist()
    countdown = 1
    wall0 = time.perf_counter()
    for i in range(n):
        ident = ids_l[i]
        if is_alloc_l[i]:
            size = sizes_l[i]
            try:
                t0 = timer()
                h = alloc(size)
                t1 = timer()
            except oom:
                t1 = timer()
                alloc_ns[ia] = t1 - t0
                ia += 1
                failed.add(ident)
                n_failed += 1
            else:
                alloc_ns[ia] = t1 - t0
                ia += 1
                live[ident] = h
                sizes[ident] = size
                live_bytes += size
                if live_bytes > peak_live:
                    peak_live = live_bytes
                touch_pointer(pointer(h), size)
                note()
                poke(reserved())
                del h
        else:
            if ident not in live:
                if ident in failed:
                    failed.discard(ident)
                else:
                    raise ValueError(f"{trace.source or trace.name}: event {i} frees allocation {ident}, which is not live")
            elif drop:
                t0 = timer()
                del live[ident]
                t1 = timer()
                free_ns[ifree] = t1 - t0
                ifree += 1
                live_bytes -= sizes.pop(ident)
            else:
                h = live.pop(ident)
                t0 = timer()
                free(h)
                t1 = timer()
                free_ns[ifree] = t1 - t0
                ifree += 1
                live_bytes -= sizes.pop(ident)
        countdown -= 1
        if countdown == 0 or i == n - 1:
            countdown = every
            rows.append((i, times_l[i], live_bytes, allocated(), reserved()))
        if bar is not None and i % 8192 == 8191:
            bar.update(8192)
    wall_s = time.perf_counter() - wall0
    if bar is not None:
        bar.update(n - bar.n)
        bar.close()

    import cupy

    cupy.cuda.Device(device_id).synchronize()
    counters = bl.counters()
    n_grow, n_shrink = counters["n_grow"], counters["n_shrink"]
    if drop:
        live.clear()
    else:
        for h in live.values():
            free(h)
        live.clear()
    bl.close()
    ts = pd.DataFrame(rows, columns=["event", "time_us", "live_bytes", "allocated_bytes", "reserved_bytes"])
    ts["largest_free_bytes"] = NAN
    ts["frag_ext"] = NAN
    ts["num_segments"] = NAN
    for col, value in (("backend", "gpu"), ("policy", bl.name), ("trace", trace.name)):
        ts.insert(0, col, value)
    n_attempts = len(alloc_ns)
    peak_reserved = counters["peak_reserved_bytes"]
    alloc_col = ts["allocated_bytes"].to_numpy(np.float64)
    total_alloc = float(np.nansum(alloc_col))
    waste = (float((total_alloc - ts["live_bytes"].sum()) / total_alloc)
             if total_alloc > 0 and not np.isnan(alloc_col).any() else NAN)
    row: dict[str, Any] = {
        "trace": trace.name,
        "policy": bl.name,
        "backend": "gpu",
        "params": "",
        "capacity_bytes": None,
        "n_alloc": n_attempts,
        "n_free": ifree,
        "n_failed": n_failed,
        "failure_rate": n_failed / n_attempts if n_attempts else 0.0,
        "peak_live_bytes": peak_live,
        "peak_allocated_bytes": counters["peak_allocated_bytes"],
        "peak_reserved_bytes": peak_reserved,
        "overhead": peak_reserved / peak_live - 1.0 if peak_live else NAN,
        "frag_ext_mean": NAN,
        "frag_ext_max": NAN,
        "internal_waste_frac": waste,
        "n_grow": n_grow,
        "n_shrink": n_shrink,
        "grown_bytes": NAN,
        "shrunk_bytes": NAN,
        **latency_percentiles(alloc_ns, "alloc"),
        **latency_percentiles(free_ns[:ifree], "free"),
        "wall_s": wall_s,
        "n_events": n,
        "kind": "baseline",
        "device": device_name(device_id),
        "validate": False,
        "driver_ns_total": NAN,
        "device_mallocs": n_grow,
        "device_frees": n_shrink,
        **_memory_columns(watch),
    }
    return BaselineResult(summary=row, timeseries=ts, alloc_ns=alloc_ns, free_ns=free_ns[:ifree])


def _attach_mover(pool: GpuPool, *, verify: bool):
    """For a policy that moves live allocations (compaction): copy their bytes on the device."""
    from realgpu.compaction import attach
    from realgpu.pool import _layers

    layer = next((p for p in _layers(pool.policy) if getattr(p, "moves_allocations", False)), None)
    if layer is None or layer.on_move is not None:
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
        return {"nvml_base_used_bytes": NAN, "nvml_peak_used_bytes": NAN, "nvml_end_used_bytes": NAN,
                "memory_source": ""}
    return {"nvml_base_used_bytes": watch.base_used_bytes, "nvml_peak_used_bytes": watch.peak_used_bytes,
            "nvml_end_used_bytes": watch.reader.used_bytes(), "memory_source": watch.reader.source}


def _progress_bar(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="ev", unit_scale=True, leave=False, mininterval=0.5)
