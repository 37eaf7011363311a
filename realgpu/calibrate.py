"""Measure a GPU's driver costs into the simulator's cost-file schema (``sim/data/costs_h200.json``).

``cudaMalloc`` and ``cudaFree`` are timed apart, one call at a time from Python (the way a pool
calls them), at sizes from 4 KiB to 4 GiB; copies are timed with CUDA events. The file
``sim.costs.CostModel.load`` reads needs ``malloc_us``/``free_us`` (``nbytes`` and median
``us`` lists) and the three bandwidths in bytes copied per second; the rest (p99s, the repeat
counts, pageable-memory bandwidths, versions) is there for people.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["DEFAULT_SIZES", "calibrate", "write_costs", "repeats_for"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: 4 KiB to 4 GiB in steps of 4x.
DEFAULT_SIZES = tuple(4 * KiB * 4**k for k in range(11))


def repeats_for(nbytes: int) -> int:
    """Calls timed per size: many where calls are cheap, few where a free takes milliseconds."""
    if nbytes <= 4 * MiB:
        return 200
    if nbytes <= 256 * MiB:
        return 60
    if nbytes <= GiB:
        return 20
    return 8


def _time_malloc_free(nbytes: int, repeats: int, timer: Callable[[], int]) -> tuple[np.ndarray, np.ndarray]:
    import cupy

    rt = cupy.cuda.runtime
    for _ in range(3):  # warm-up: first calls at a new size map fresh driver state
        rt.free(rt.malloc(nbytes))
    m = np.empty(repeats, np.int64)
    f = np.empty(repeats, np.int64)
    for i in range(repeats):
        t0 = timer()
        ptr = rt.malloc(nbytes)
        t1 = timer()
        rt.free(ptr)
        t2 = timer()
        m[i], f[i] = t1 - t0, t2 - t1
    return m, f


def _event_ms(fn: Callable[[], None], repeats: int) -> float:
    """Median milliseconds of ``fn`` (queued work) timed with CUDA events."""
    import cupy

    fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def _bandwidths(copy_bytes: int, host_copy_bytes: int, repeats: int) -> dict[str, float]:
    import cupy

    rt = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream().ptr
    out: dict[str, float] = {}
    src, dst = rt.malloc(copy_bytes), rt.malloc(copy_bytes)
    try:
        rt.memset(src, 0x3C, copy_bytes)
        ms = _event_ms(lambda: rt.memcpyAsync(dst, src, copy_bytes, rt.memcpyDeviceToDevice, stream), repeats)
        out["d2d_bytes_per_s"] = copy_bytes / (ms / 1e3)
    finally:
        rt.free(src)
        rt.free(dst)
    dev = rt.malloc(host_copy_bytes)
    try:
        pinned = cupy.cuda.alloc_pinned_memory(host_copy_bytes)
        hptr = pinned.ptr
        ms = _event_ms(lambda: rt.memcpyAsync(dev, hptr, host_copy_bytes, rt.memcpyHostToDevice, stream), repeats)
        out["h2d_bytes_per_s"] = host_copy_bytes / (ms / 1e3)
        ms = _event_ms(lambda: rt.memcpyAsync(hptr, dev, host_copy_bytes, rt.memcpyDeviceToHost, stream), repeats)
        out["d2h_bytes_per_s"] = host_copy_bytes / (ms / 1e3)
        del pinned
        pageable = np.full(host_copy_bytes, 7, dtype=np.uint8)
        hp = pageable.ctypes.data
        for key, args in (("h2d_pageable_bytes_per_s", (dev, hp, rt.memcpyHostToDevice)),
                          ("d2h_pageable_bytes_per_s", (hp, dev, rt.memcpyDeviceToHost))):
            rt.memcpy(args[0], args[1], host_copy_bytes, args[2])
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                rt.memcpy(args[0], args[1], host_copy_bytes, args[2])
                samples.append(time.perf_counter() - t0)
            out[key] = host_copy_bytes / float(np.median(samples))
    finally:
        rt.free(dev)
    return out


def calibrate(*, device_id: int = 0, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int | None = None,
              copy_bytes: int = GiB, host_copy_bytes: int = 256 * MiB, copy_repeats: int = 10,
              progress: Callable[[str], None] | None = None,
              timer: Callable[[], int] = time.perf_counter_ns) -> dict[str, Any]:
    """Measure ``device_id`` and return a cost table (``json.dump`` it, or use ``write_costs``).

    Args:
        sizes: ``cudaMalloc`` sizes; those above half the free memory are skipped.
        repeats: calls timed per size (default ``repeats_for(size)``).
        copy_bytes / host_copy_bytes: buffer sizes for the device and host copies.
        progress: called with one line per measured size.
    """
    import cupy

    from realgpu.cuda import require_cuda
    from realgpu.replay import device_name

    require_cuda(device_id)
    with cupy.cuda.Device(device_id):
        free_bytes, total_bytes = cupy.cuda.runtime.memGetInfo()
        usable = [s for s in sizes if s <= free_bytes // 2]
        medians: dict[str, list[float]] = {"malloc": [], "free": []}
        p99s: dict[str, list[float]] = {"malloc": [], "free": []}
        counts = []
        for nbytes in usable:
            r = repeats or repeats_for(nbytes)
            m, f = _time_malloc_free(nbytes, r, timer)
            for key, samples in (("malloc", m), ("free", f)):
                medians[key].append(round(float(np.median(samples)) / 1e3, 3))
                p99s[key].append(round(float(np.percentile(samples, 99)) / 1e3, 3))
            counts.append(r)
            if progress is not None:
                progress(f"{nbytes:>13,} B  cudaMalloc {medians['malloc'][-1]:9.1f} us  cudaFree {medians['free'][-1]:9.1f} us"
                         f"  ({r} calls)")
        bandwidths = _bandwidths(min(copy_bytes, free_bytes // 4), min(host_copy_bytes, free_bytes // 4), copy_repeats)
    name = device_name(device_id)
    table = {
        "device": name,
        "source": (f"poollab gpu calibrate on {name}, {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC: "
                   "cudaMalloc alone / cudaFree alone through cupy.cuda.runtime, median of the calls per size, "
                   "after 3 warm-up pairs; copies timed with CUDA events (pinned host memory), median"),
        "malloc_us": {"nbytes": list(usable), "us": medians["malloc"]},
        "free_us": {"nbytes": list(usable), "us": medians["free"]},
        **{k: float(f"{v:.4g}") for k, v in bandwidths.items() if not k.endswith("pageable_bytes_per_s")},
        "malloc_p99_us": {"nbytes": list(usable), "us": p99s["malloc"]},
        "free_p99_us": {"nbytes": list(usable), "us": p99s["free"]},
        "calls_per_size": counts,
        **{k: float(f"{v:.4g}") for k, v in bandwidths.items() if k.endswith("pageable_bytes_per_s")},
        "copy_bytes": min(copy_bytes, free_bytes // 4),
        "host_copy_bytes": min(host_copy_bytes, free_bytes // 4),
        "total_bytes": int(total_bytes),
        "cuda_runtime_version": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver_version": cupy.cuda.runtime.driverGetVersion(),
        "cupy_version": cupy.__version__,
        "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return table


def write_costs(table: dict[str, Any], path: str | Path) -> Path:
    """Write a cost table and read it back through the simulator's loader (which checks the schema)."""
    from sim.costs import CostModel

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2) + "\n")
    CostModel.load(path)
    return path
