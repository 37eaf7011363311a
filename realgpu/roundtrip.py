"""Allocate-then-free round trips at one size: the hot-path cost of a pool, call by call.

Each iteration is timed on its own (``perf_counter_ns`` around the allocation and the free), after
warm-up iterations that let the pool reserve its segment; the median and p99 are reported. The
same loop times a ``GpuPool`` (through ``allocate``/``free`` or CuPy's ``malloc`` protocol) and
the baselines, so the numbers compare like for like.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from realgpu.baselines import Baseline
from realgpu.pool import GpuPool

__all__ = [
    "time_roundtrips",
    "pool_roundtrip",
    "baseline_roundtrip",
    "pointer_floor_roundtrip",
    "summarize",
]


def time_roundtrips(
    alloc: Callable[[int], Any],
    free: Callable[[Any], None] | None,
    nbytes: int,
    *,
    iterations: int,
    warmup: int = 100,
    timer: Callable[[], int] = time.perf_counter_ns,
) -> np.ndarray:
    """Nanoseconds of each ``alloc(nbytes)`` + free; ``free=None`` frees by dropping the handle."""
    out = np.empty(iterations, dtype=np.int64)
    if free is None:
        for i in range(-warmup, iterations):
            t0 = timer()
            h = alloc(nbytes)
            del h
            t1 = timer()
            if i >= 0:
                out[i] = t1 - t0
    else:
        for i in range(-warmup, iterations):
            t0 = timer()
            h = alloc(nbytes)
            free(h)
            t1 = timer()
            if i >= 0:
                out[i] = t1 - t0
    return out


def summarize(name: str, path: str, nbytes: int, samples_ns: np.ndarray) -> dict[str, Any]:
    p50, p99 = np.percentile(samples_ns, [50, 99])
    return {
        "allocator": name,
        "path": path,
        "nbytes": nbytes,
        "iterations": int(samples_ns.size),
        "p50_us": float(p50) / 1e3,
        "p99_us": float(p99) / 1e3,
        "mean_us": float(samples_ns.mean()) / 1e3,
    }


def pool_roundtrip(
    pool: GpuPool,
    nbytes: int,
    *,
    path: str = "allocate",
    iterations: int = 20000,
    warmup: int = 100,
) -> dict[str, Any]:
    """Round trips through ``pool.allocate``/``pool.free`` (``path="allocate"``) or ``pool.malloc``
    + drop."""
    if path == "allocate":
        samples = time_roundtrips(
            pool.allocate, pool.free, nbytes, iterations=iterations, warmup=warmup
        )
    elif path == "malloc":
        samples = time_roundtrips(pool.malloc, None, nbytes, iterations=iterations, warmup=warmup)
    else:
        raise ValueError(f"path(={path!r}) must be 'allocate' or 'malloc'")
    assert pool.policy.num_live == 0, "a round trip left allocations live"
    return summarize(pool.policy.spec, path, nbytes, samples)


def baseline_roundtrip(
    baseline: Baseline, nbytes: int, *, iterations: int = 20000, warmup: int = 100
) -> dict[str, Any]:
    """Round trips through a baseline's own allocate/free (or drop) calls."""
    samples = time_roundtrips(
        baseline.alloc,
        None if baseline.drop else baseline.free,
        nbytes,
        iterations=iterations,
        warmup=warmup,
    )
    return summarize(baseline.name, "native", nbytes, samples)


class _Owner:
    """A pointer's owner that frees nothing: what is left of ``GpuPool``'s lease with no policy."""

    __slots__ = ()


class _FinalizingOwner:
    """An owner whose ``__del__`` runs and does nothing: the lease's finalizer, with no policy
    behind it."""

    __slots__ = ()

    def __del__(self) -> None:
        pass


def pointer_floor_roundtrip(
    nbytes: int, *, iterations: int = 20000, warmup: int = 100, finalizer: bool = False
) -> dict[str, Any]:
    """The floor of any allocator that hands CuPy a foreign pointer (``GpuPool.malloc``): build
    ``MemoryPointer(UnownedMemory(ptr, nbytes, owner, device), 0)`` over one fixed real
    allocation and drop it, deciding nothing and allocating nothing.

    ``finalizer=True`` gives the owner a ``__del__`` (how ``GpuPool`` learns a pointer is gone).
    CuPy's own ``MemoryPool`` builds its pointer in compiled code; this row is what a Python pool
    pays before its policy does any work.
    """
    import cupy

    base = cupy.cuda.alloc(nbytes)  # a real address, held for the whole run
    device_id = base.device_id
    ptr = base.ptr
    Pointer, Unowned = cupy.cuda.MemoryPointer, cupy.cuda.UnownedMemory
    owner_type = _FinalizingOwner if finalizer else _Owner

    def alloc(n: int):
        return Pointer(Unowned(ptr, n, owner_type(), device_id), 0)

    samples = time_roundtrips(alloc, None, nbytes, iterations=iterations, warmup=warmup)
    del base
    return summarize(
        "CuPy pointer, owner with __del__ (floor)" if finalizer else "CuPy pointer (floor)",
        "native",
        nbytes,
        samples,
    )
