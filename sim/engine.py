"""The one replay loop: walk an allocation event stream once, driving any allocator.

Every backend replays through ``run``: a policy in the simulator (``sim.replay``), a policy on
a real device (``realgpu.replay.gpu_replay``), a baseline allocator (``realgpu.replay.baseline_replay``)
and a PyTorch recording (``sim.fidelity``). What differs is a ``Target``, the small adapter
that says how to allocate, free and flush, what an out-of-memory looks like and where driver
time comes from; the loop, the timing and the sampling are the same code for all of them.

Latency of one call = the call's own time on ``timer`` + the driver time its device modelled
for it (``Device.take_driver_ns``; 0 for a free or a real device, whose calls already run
inside the timed region). ``TimedCalls`` is that definition; ``sim.pools.TimedPool`` uses it too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from policies.base import Policy

__all__ = ["ALLOC", "FREE", "FLUSH", "Target", "policy_target", "TimedCalls", "EngineRun", "run"]

# op codes of an event stream
ALLOC, FREE, FLUSH = 0, 1, 2

#: How often (in events) the progress bar is advanced: often enough to move, rarely enough to be free.
_PROGRESS_STRIDE = 8192


def _no_driver_ns() -> int:
    return 0


@dataclass(slots=True)
class Target:
    """How the engine drives one allocator.

    Attributes:
        allocate: ``allocate(nbytes, stream=, tag=) -> handle | None`` (None: refused), or
            ``allocate(nbytes)`` when ``sized_only``.
        free: ``free(handle)``; None when dropping the last reference frees (CuPy pointers,
            torch tensors): the engine then lets go of the handle inside the timed region.
        take_driver_ns: modelled driver time since the last call (``Device.take_driver_ns``).
        oom_errors: exceptions ``allocate`` raises when out of memory (counted as refusals).
        flush: what a ``FLUSH`` op calls (``Policy.empty_cache``).
        sized_only: ``allocate`` takes the size alone (baselines ignore streams and tags).
    """

    allocate: Callable[..., Any]
    free: Callable[[Any], Any] | None
    take_driver_ns: Callable[[], int] = _no_driver_ns
    oom_errors: tuple[type[BaseException], ...] = ()
    flush: Callable[[], Any] | None = None
    sized_only: bool = False


def policy_target(policy: Policy) -> Target:
    """A policy as a target: its own calls, its device's driver time, ``empty_cache`` on flush."""
    return Target(allocate=policy.allocate, free=policy.free, take_driver_ns=policy.device.take_driver_ns,
                  flush=policy.empty_cache)


class TimedCalls:
    """A target's calls, each returning its latency (call time + modelled driver time).

    The driver time of each call also accrues in ``pending_driver_ns`` until taken (the
    serving simulator charges it to the step that caused it). Driver time the device accrued
    before this object existed is dropped: construction-time calls belong to no call.
    """

    __slots__ = ("_allocate", "_free", "_take", "_oom", "_sized", "timer", "pending_driver_ns")

    def __init__(self, target: Target, *, timer: Callable[[], int] = time.perf_counter_ns):
        self._allocate, self._free, self._take = target.allocate, target.free, target.take_driver_ns
        self._oom, self._sized = target.oom_errors, target.sized_only
        self.timer = timer
        self.pending_driver_ns = 0
        self._take()

    def allocate(self, nbytes: int, stream: int = 0, tag: str | None = None) -> tuple[Any, int]:
        """``(handle or None, latency_ns)``."""
        timer = self.timer
        t0 = timer()
        try:
            h = self._allocate(nbytes) if self._sized else self._allocate(nbytes, stream=stream, tag=tag)
            t1 = timer()
        except self._oom:
            t1 = timer()
            h = None
        driver = self._take()
        self.pending_driver_ns += driver
        return h, t1 - t0 + driver

    def free(self, handle: Any) -> int:
        """Free ``handle``; latency in ns. Pass the last reference (for a dropping target the
        argument is what frees: CPython hands it to this frame, and ``del`` lets go of it)."""
        timer = self.timer
        free = self._free
        t0 = timer()
        if free is not None:
            free(handle)
        del handle
        t1 = timer()
        driver = self._take()
        self.pending_driver_ns += driver
        return t1 - t0 + driver

    def take_driver_ns(self) -> int:
        ns, self.pending_driver_ns = self.pending_driver_ns, 0
        return ns


@dataclass
class EngineRun:
    """What one walk over the events measured."""

    alloc_ns: np.ndarray  # one latency per allocation attempt, refused ones included
    free_ns: np.ndarray  # one per free of a live allocation
    num_failed: int
    wall_s: float
    live: dict[Any, Any] = field(default_factory=dict)  # key -> handle still live at the end


def run(ops: list[int], keys: list[Any], sizes: list[int], *, target: Target,
        streams: list[int] | None = None, tags: list[Any] | None = None, times_us: list[int] | None = None,
        observe: Callable[[int, int], None] | None = None, live: dict[Any, Any] | None = None,
        on_alloc: Callable[[Any, int, Any], None] | None = None, on_free: Callable[[Any], None] | None = None,
        before: Callable[[int], None] | None = None, unknown_free: Callable[[int, Any], Exception],
        timer: Callable[[], int] = time.perf_counter_ns, progress: str | None = None) -> EngineRun:
    """Replay the events ``ops[i]`` (``ALLOC``/``FREE``/``FLUSH``) of allocation ``keys[i]``.

    A refused allocation is counted and the trace goes on; its matching free is skipped. A free
    of a key neither live nor refused raises ``unknown_free(i, key)``.

    Args:
        ops, keys, sizes: the events (lists: indexing them is the loop's hot path).
        target: the allocator.
        streams, tags: per event (stream 0 and no tag when None).
        times_us: per event, passed to ``observe`` (the event index when None).
        observe: ``observe(i, time_us)`` after every event (``sim.metrics.PoolMonitor.observe``).
        live: allocations live before the first event, by key (a recording's starting state).
        on_alloc: ``on_alloc(handle, nbytes, key)`` after each successful allocation, outside
            the timed region (realgpu touches memory there).
        on_free: ``on_free(handle)`` before each free, outside the timed region.
        before: ``before(i)`` ahead of each event (the fidelity replay logs which op a segment
            call served).
        timer: nanosecond clock.
        progress: a progress bar's title; None for no bar.
    """
    n = len(ops)
    calls = TimedCalls(target, timer=timer)
    allocate, free = calls.allocate, calls.free
    flush = target.flush
    live = {} if live is None else live
    failed: set[Any] = set()
    num_allocs = sum(1 for op in ops if op == ALLOC)
    alloc_ns = np.zeros(num_allocs, dtype=np.int64)
    free_ns = np.zeros(n - num_allocs, dtype=np.int64)
    ia = ifree = num_failed = 0
    bar = _progress_bar(n, progress) if progress is not None else None
    wall0 = time.perf_counter()
    for i in range(n):
        if before is not None:
            before(i)
        op, key = ops[i], keys[i]
        if op == ALLOC:
            nbytes = sizes[i]
            a, alloc_ns[ia] = allocate(nbytes, streams[i] if streams is not None else 0,
                                       (tags[i] or None) if tags is not None else None)
            ia += 1
            if a is None:
                failed.add(key)
                num_failed += 1
            else:
                live[key] = a
                if on_alloc is not None:
                    on_alloc(a, nbytes, key)
            del a  # the live map holds the only reference (a dropping target frees on its last)
        elif op == FREE:
            if key in live:
                if on_free is None:
                    free_ns[ifree] = free(live.pop(key))
                else:
                    a = live.pop(key)
                    on_free(a)
                    free_ns[ifree] = free(a)
                    del a
                ifree += 1
            elif key in failed:
                failed.discard(key)
            else:
                raise unknown_free(i, key)
        else:
            flush()
        if observe is not None:
            observe(i, times_us[i] if times_us is not None else i)
        if bar is not None and i % _PROGRESS_STRIDE == _PROGRESS_STRIDE - 1:
            bar.update(_PROGRESS_STRIDE)
    wall_s = time.perf_counter() - wall0
    if bar is not None:
        bar.update(n - bar.n)
        bar.close()
    return EngineRun(alloc_ns=alloc_ns, free_ns=free_ns[:ifree], num_failed=num_failed,
                     wall_s=wall_s, live=live)


def _progress_bar(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="ev", unit_scale=True, leave=False, mininterval=0.5)
