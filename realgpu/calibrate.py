"""Measure a GPU's driver costs into the simulator's cost-file schema
(``sim/data/costs_h200.json``).

``cudaMalloc`` and ``cudaFree`` are timed apart, one call at a time from Python (the way a pool
calls them), at sizes from 4 KiB to 4 GiB; copies are timed with CUDA events. The file
``sim.replay.costs.CostModel.load`` reads needs ``malloc_us``/``free_us`` (``nbytes`` and median
``us`` lists) and the three bandwidths in bytes copied per second; the rest (p99s, the repeat
counts, pageable-memory bandwidths, versions) is there for people.

The virtual-memory calls (``cuMemAddressReserve`` ... ``cuMemAddressFree``, through cuda-bindings)
are timed one at a time too, a full reserve-create-map-set_access-unmap-release-free cycle per
repeat at page sizes from 2 MiB to 2 GiB (``time_vmm_calls``, which runs on any
``realgpu.mapped.VmmDriver``, the host stand-in included), into ``vmm_us``: one ``nbytes``/``us``
table per call of ``policies.mapped_device.VMM_CALLS``, what ``CostModel.vmm_call_ns`` reads.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = [
    "DEFAULT_SIZES",
    "DEFAULT_VMM_SIZES",
    "calibrate",
    "write_costs",
    "repeats_for",
    "time_vmm_calls",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: 4 KiB to 4 GiB in steps of 4x.
DEFAULT_SIZES = tuple(4 * KiB * 4**k for k in range(11))
#: Page sizes for the VMM calls: PyTorch's small and large pages, then the field notes' larger ones.
DEFAULT_VMM_SIZES = (2 * MiB, 20 * MiB, 64 * MiB, 512 * MiB, 2 * GiB)


def repeats_for(nbytes: int) -> int:
    """Calls timed per size: many where calls are cheap, few where a free takes milliseconds."""
    if nbytes <= 4 * MiB:
        return 200
    if nbytes <= 256 * MiB:
        return 60
    if nbytes <= GiB:
        return 20
    return 8


def _time_malloc_free(
    nbytes: int, repeats: int, timer: Callable[[], int]
) -> tuple[np.ndarray, np.ndarray]:
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


def time_vmm_calls(
    driver: Any,
    sizes: tuple[int, ...],
    *,
    repeats: int | None = None,
    timer: Callable[[], int] = time.perf_counter_ns,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time each VMM call alone, at each size (a multiple of ``driver.granularity_bytes``).

    Every repeat is one whole cycle (reserve, create, map, set_access, unmap, release, free),
    after 2 warm-up cycles. Returns ``{"vmm_us": ..., "vmm_p99_us": ..., "vmm_calls_per_size":
    ...}`` where ``vmm_us[call]`` is ``{"nbytes": sizes, "us": medians}`` for every call of
    ``VMM_CALLS``.
    """
    from policies.mapped_device import VMM_CALLS

    samples: dict[str, list[np.ndarray]] = {call: [] for call in VMM_CALLS}
    counts = []
    for nbytes in sizes:
        if nbytes % driver.granularity_bytes:
            raise ValueError(
                f"VMM size {nbytes:,} B is not a multiple of "
                f"the {driver.granularity_bytes:,} B granularity"
            )
        r = repeats or repeats_for(nbytes)
        t = {call: np.empty(r, np.int64) for call in VMM_CALLS}
        for i in range(-2, r):
            times = _vmm_cycle(driver, nbytes, timer)
            if i >= 0:
                for call in VMM_CALLS:
                    t[call][i] = times[call]
        for call in VMM_CALLS:
            samples[call].append(t[call])
        counts.append(r)
        if progress is not None:
            progress(
                f"{nbytes:>13,} B  "
                + "  ".join(f"{call} {np.median(t[call]) / 1e3:.1f}" for call in VMM_CALLS)
                + f" us  ({r} cycles)"
            )

    def table(stat: Callable[[np.ndarray], float]) -> dict[str, dict[str, list]]:
        # a call can take less than the timer's resolution on the host: 1 ns is the floor the cost
        # model accepts (times must be > 0)
        return {
            call: {
                "nbytes": list(sizes),
                "us": [max(round(stat(x) / 1e3, 3), 0.001) for x in samples[call]],
            }
            for call in VMM_CALLS
        }

    return {
        "vmm_us": table(np.median),
        "vmm_p99_us": table(lambda x: float(np.percentile(x, 99))),
        "vmm_calls_per_size": counts,
    }


def _vmm_cycle(driver: Any, nbytes: int, timer: Callable[[], int]) -> dict[str, int]:
    """One reserve-to-free cycle, each call timed alone; what it took is given back on failure."""
    t0 = timer()
    base = driver.address_reserve(nbytes)
    t1 = timer()
    if base is None:
        raise MemoryError(f"the driver refused to reserve {nbytes:,} B of address space")
    handle = None
    try:
        t2 = timer()
        handle = driver.create(nbytes)
        t3 = timer()
        if handle is None:
            raise MemoryError(f"the driver refused to create {nbytes:,} B of physical memory")
        driver.map(base, nbytes, handle)
        t4 = timer()
        driver.set_access(base, nbytes)
        t5 = timer()
        driver.unmap(base, nbytes)
        t6 = timer()
        driver.release(handle)
        t7 = timer()
    except BaseException:
        _give_back(driver, base, nbytes, handle)
        raise
    driver.address_free(base, nbytes)
    t8 = timer()
    return {
        "address_reserve": t1 - t0,
        "create": t3 - t2,
        "map": t4 - t3,
        "set_access": t5 - t4,
        "unmap": t6 - t5,
        "release": t7 - t6,
        "address_free": t8 - t7,
    }


def _give_back(driver: Any, base: int, nbytes: int, handle: Any) -> None:
    steps = [lambda: driver.unmap(base, nbytes)]
    if handle is not None:
        steps.append(lambda: driver.release(handle))
    steps.append(lambda: driver.address_free(base, nbytes))
    for undo in steps:
        try:
            undo()
        except Exception:  # noqa: BLE001 - best effort: the first error is the one raised
            pass


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
        ms = _event_ms(
            lambda: rt.memcpyAsync(dst, src, copy_bytes, rt.memcpyDeviceToDevice, stream), repeats
        )
        out["d2d_bytes_per_s"] = copy_bytes / (ms / 1e3)
    finally:
        rt.free(src)
        rt.free(dst)
    dev = rt.malloc(host_copy_bytes)
    try:
        pinned = cupy.cuda.alloc_pinned_memory(host_copy_bytes)
        hptr = pinned.ptr
        ms = _event_ms(
            lambda: rt.memcpyAsync(dev, hptr, host_copy_bytes, rt.memcpyHostToDevice, stream),
            repeats,
        )
        out["h2d_bytes_per_s"] = host_copy_bytes / (ms / 1e3)
        ms = _event_ms(
            lambda: rt.memcpyAsync(hptr, dev, host_copy_bytes, rt.memcpyDeviceToHost, stream),
            repeats,
        )
        out["d2h_bytes_per_s"] = host_copy_bytes / (ms / 1e3)
        del pinned
        pageable = np.full(host_copy_bytes, 7, dtype=np.uint8)
        hp = pageable.ctypes.data
        for key, args in (
            ("h2d_pageable_bytes_per_s", (dev, hp, rt.memcpyHostToDevice)),
            ("d2h_pageable_bytes_per_s", (hp, dev, rt.memcpyDeviceToHost)),
        ):
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


def calibrate(
    *,
    device_id: int = 0,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    repeats: int | None = None,
    copy_bytes: int = GiB,
    host_copy_bytes: int = 256 * MiB,
    copy_repeats: int = 10,
    vmm_sizes: tuple[int, ...] | None = DEFAULT_VMM_SIZES,
    progress: Callable[[str], None] | None = None,
    timer: Callable[[], int] = time.perf_counter_ns,
) -> dict[str, Any]:
    """Measure ``device_id`` and return a cost table (``json.dump`` it, or use ``write_costs``).

    Args:
        sizes: ``cudaMalloc`` sizes; those above half the free memory are skipped.
        vmm_sizes: page sizes for the VMM calls (rounded up to the granularity; those above half
            the free memory skipped); None or empty skips them (the file then has no ``vmm_us``
            and the simulator uses the bundled one). Without cuda-bindings they are skipped,
            with a progress line saying why.
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
                progress(
                    f"{nbytes:>13,} B  cudaMalloc {medians['malloc'][-1]:9.1f} us  "
                    f"cudaFree {medians['free'][-1]:9.1f} us  ({r} calls)"
                )
        bandwidths = _bandwidths(
            min(copy_bytes, free_bytes // 4), min(host_copy_bytes, free_bytes // 4), copy_repeats
        )
        vmm = _calibrate_vmm(device_id, vmm_sizes or (), free_bytes, repeats, timer, progress)
    name = device_name(device_id)
    table = {
        "device": name,
        "source": (
            f"poollab gpu calibrate on {name}, "
            f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC: "
            "cudaMalloc alone / cudaFree alone through cupy.cuda.runtime, "
            "median of the calls per size, after 3 warm-up pairs; "
            "copies timed with CUDA events (pinned host memory), median"
        ),
        "malloc_us": {"nbytes": list(usable), "us": medians["malloc"]},
        "free_us": {"nbytes": list(usable), "us": medians["free"]},
        **{
            k: float(f"{v:.4g}")
            for k, v in bandwidths.items()
            if not k.endswith("pageable_bytes_per_s")
        },
        "malloc_p99_us": {"nbytes": list(usable), "us": p99s["malloc"]},
        "free_p99_us": {"nbytes": list(usable), "us": p99s["free"]},
        "calls_per_size": counts,
        **{
            k: float(f"{v:.4g}")
            for k, v in bandwidths.items()
            if k.endswith("pageable_bytes_per_s")
        },
        "copy_bytes": min(copy_bytes, free_bytes // 4),
        "host_copy_bytes": min(host_copy_bytes, free_bytes // 4),
        "total_bytes": int(total_bytes),
        "cuda_runtime_version": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver_version": cupy.cuda.runtime.driverGetVersion(),
        "cupy_version": cupy.__version__,
        "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **vmm,
    }
    if vmm:
        table["source"] += (
            "; cuMem* calls through cuda-bindings, each alone, "
            "one reserve-to-free cycle per call timed, median, after 2 warm-up cycles"
        )
    return table


def _calibrate_vmm(
    device_id: int,
    sizes: tuple[int, ...],
    free_bytes: int,
    repeats: int | None,
    timer: Callable[[], int],
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    """The ``vmm_*`` entries of the cost table, or none (with a progress line) where VMM cannot
    run."""
    if not sizes:
        return {}
    from realgpu.errors import GpuUnavailableError
    from realgpu.vmm import CuMemDriver

    try:
        driver = CuMemDriver(device_id)
    except GpuUnavailableError as exc:
        if progress is not None:
            progress(f"VMM calls not measured: {exc}")
        return {}
    try:
        g = driver.granularity_bytes
        usable = tuple(sorted({-(-s // g) * g for s in sizes if s <= free_bytes // 2}))
        out = time_vmm_calls(driver, usable, repeats=repeats, timer=timer, progress=progress)
        out["vmm_granularity_bytes"] = g
        out["vmm_recommended_granularity_bytes"] = driver.recommended_granularity_bytes
        return out
    finally:
        driver.close()


def write_costs(table: dict[str, Any], path: str | Path) -> Path:
    """Write a cost table and read it back through the simulator's loader (which checks the
    schema)."""
    from sim.replay.costs import CostModel

    from traces.atomic import replacing_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing_file(path) as tmp:  # all or nothing; a full disk names the file
        tmp.write_text(json.dumps(table, indent=2) + "\n")
    CostModel.load(path)
    return path
