"""The one replay loop: walk an allocation event stream once, driving any allocator.

Every backend replays through ``run``: a policy in the simulator (``sim.replay.trace_replay``), a
policy on a real device (``realgpu.replay.gpu_replay``), a baseline allocator
(``realgpu.replay.baseline_replay``) and a PyTorch recording (``sim.replay.fidelity``). What differs
is a ``Target``, the small adapter that says how to allocate, free and flush, what an out-of-memory
looks like and where driver time comes from; the loop, the timing and the sampling are the same code
for all of them.

Latency of one call = the call's own time on ``timer`` + the driver time its device modelled
for it (``Device.take_driver_ns``; 0 for a free or a real device, whose calls already run
inside the timed region). ``TimedCalls`` is that definition, the one place it is written: both of
``run``'s loops time their calls through it, and so does ``sim.serving.pools.TimedPool``.

Which calls are timed: a long replay times a random sample of its calls (``latency_sample``;
about ``LATENCY_SAMPLE_CALLS`` of them by default), because timing one call costs CPython two
clock reads and one append (about 100 ns, as much as a cheap policy's whole call). Every call
still runs and is counted, and driver time is never lost (it is drained after every untimed
call, and the device's total counts it); only the latency percentiles become estimates, from a
uniform sample that a trace's periodic structure cannot alias.
"""

from __future__ import annotations

import functools
import itertools
import operator
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from policies.base import Policy
from policies.device import DriverClock

__all__ = [
    "ALLOC",
    "FREE",
    "FLUSH",
    "Target",
    "policy_target",
    "TimedCalls",
    "EngineRun",
    "run",
    "LATENCY_SAMPLE_CALLS",
    "default_latency_sample",
    "latency_sample_mask",
]

# op codes of an event stream
ALLOC, FREE, FLUSH = 0, 1, 2

#: How often (in events) the progress bar is advanced: often enough to move, rarely enough to be
#: free.
_PROGRESS_STRIDE = 8192

#: Timed calls a replay aims for by default: a p99 from 20,000 samples is within about 0.1
#: percentile points of the true one (binomial standard error), and beyond that each timed
#: call only adds cost.
LATENCY_SAMPLE_CALLS = 20_000


def default_latency_sample(num_events: int) -> float:
    """The share of calls to time in a run of ``num_events`` events: all of them up to
    ``LATENCY_SAMPLE_CALLS``, then about that many."""
    return 1.0 if num_events <= LATENCY_SAMPLE_CALLS else LATENCY_SAMPLE_CALLS / num_events


def latency_sample_mask(num_events: int, latency_sample: float, *, seed: int = 0) -> bytes | None:
    """Which events' calls to time: ``mask[i]`` is 1 for a timed event, each chosen with
    probability ``latency_sample`` (seeded: the same events every run); None to time all.

    Bytes, not a list: one byte per event (a 10M-event trace's mask is 10 MB, not 80), and
    iterating them yields the cached small ints 0 and 1.
    """
    if not 0.0 < latency_sample <= 1.0:
        raise ValueError(f"latency_sample(={latency_sample}) must be in (0, 1]")
    if latency_sample >= 1.0:
        return None
    rng = np.random.default_rng(seed)
    chunks = (
        rng.random(min(1 << 20, num_events - start), dtype=np.float32) < latency_sample
        for start in range(0, num_events, 1 << 20)
    )  # in chunks: no float array of the whole trace
    return b"".join(c.astype(np.uint8).tobytes() for c in chunks)


def _event_codes(ops: Sequence[int], mask: bytes | None) -> bytes:
    """Each event's op and whether it is timed in one small int (``op + 3 * timed``: 0 untimed
    alloc, 1 untimed free, 3 timed alloc, 4 timed free, 2 or 5 a flush), so that the tight loop
    of ``run`` tests one value per event. Bytes, as the mask (one byte an event; cached ints).
    ``ops`` given as ``bytes`` (``sim.replay.trace_replay.TraceEvents``) is read in place:
    ``bytes()`` of a ``bytes`` object is that object, so only a list is copied (in one C pass)."""
    codes = np.frombuffer(bytes(ops), dtype=np.uint8)
    if mask is None:
        codes = codes + np.uint8(3)
    else:
        codes = codes + np.uint8(3) * np.frombuffer(mask, dtype=np.uint8)
    return codes.tobytes()


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
        flush: what a ``FLUSH`` op calls (``Policy.empty_cache``; ``torch.cuda.empty_cache`` for
            that baseline); None: the target caches nothing to give back, the op is only counted.
        sized_only: ``allocate`` takes the size alone (baselines ignore streams and tags).
        driver_clock: the device's ``DriverClock`` when it declares one (``Device.driver_clock``,
            read by ``policy_target``): the loop then reads its pending time, an attribute, and
            calls ``take`` only when there is some (a call per event is a tenth of a cheap
            policy's replay); None: ``take_driver_ns`` is called after every call.
        allocate_each, free_each: the target's own batched calls (``Policy.allocate_each(nbytes,
            num_calls, stream=, tag=)``, ``Policy.free_each(handles)``) when its class
            overrides them with a faster path; None: ``TimedCalls`` makes the calls one by one.
        allocate_pages: ``Policy.allocate_pages(nbytes, num_calls)`` (page grants: one-page
            allocations handed out as the pages themselves) when the policy ``grants_pages``;
            None: the target grants none.
    """

    allocate: Callable[..., Any]
    free: Callable[[Any], Any] | None
    take_driver_ns: Callable[[], int] = _no_driver_ns
    oom_errors: tuple[type[BaseException], ...] = ()
    flush: Callable[[], Any] | None = None
    sized_only: bool = False
    driver_clock: DriverClock | None = None
    allocate_each: Callable[..., list[Any]] | None = None
    free_each: Callable[[list[Any]], None] | None = None
    allocate_pages: Callable[[int, int], list[Any] | None] | None = None


def policy_target(policy: Policy) -> Target:
    """A policy as a target: its own calls (batched ones where its class overrides
    ``Policy.allocate_each``/``free_each``), its device's driver time, ``empty_cache`` on
    flush."""
    device = policy.device
    cls = type(policy)
    # a third-party device may predate the ``driver_clock`` declaration: then it has none
    return Target(
        allocate=policy.allocate,
        free=policy.free,
        take_driver_ns=device.take_driver_ns,
        flush=policy.empty_cache,
        driver_clock=getattr(device, "driver_clock", None),
        allocate_each=(
            policy.allocate_each if cls.allocate_each is not Policy.allocate_each else None
        ),
        free_each=policy.free_each if cls.free_each is not Policy.free_each else None,
        allocate_pages=policy.allocate_pages if policy.grants_pages else None,
    )


class TimedCalls:
    """A target's calls, timed: THE definition of a call's latency.

    latency = the call's time on ``timer`` + the driver time its device has pending after it,
    taken (``Target.driver_clock``'s pending time when the device declares a clock, else
    ``Target.take_driver_ns()``). A caller that wants each sample to be its own call's alone drops
    what is pending before the call (``drop_pending``; ``run``'s loops do, after untimed calls).

    ``allocate`` returns the handle (None when refused, or out of memory) and ``free`` nothing;
    each appends its latency to ``alloc_ns``/``free_ns`` (not kept when None). The driver time
    also accrues in ``pending_driver_ns`` until taken (the serving simulator charges it to the
    step that caused it). Driver time the device accrued before this object existed is dropped:
    construction-time calls belong to no call. ``allocate_each`` and ``free_each`` make a run of
    such calls with the same timing, call by call, in one frame (a Python call is as dear as a
    cheap policy's whole call): the loop bodies are this definition, written out once more.
    Where the target has its own batched call (``Target.allocate_each``: a policy's fused path,
    one call to it), that call is timed as one and its latency split evenly among the calls it
    stands for (the remainder to the first), so there is still one sample per call and the
    samples add up to the batch's time; timing each page of a fused loop would cost more than
    the page.
    """

    __slots__ = (
        "_allocate",
        "_free",
        "_take",
        "_clock",
        "_oom",
        "_sized",
        "_alloc_append",
        "_free_append",
        "_allocate_batch",
        "_free_batch",
        "_allocate_pages",
        "timer",
        "pending_driver_ns",
        "alloc_ns",
        "free_ns",
    )

    def __init__(
        self,
        target: Target,
        *,
        timer: Callable[[], int] = time.perf_counter_ns,
        alloc_ns: Any = None,
        free_ns: Any = None,
    ):
        self._allocate, self._free, self._take = target.allocate, target.free, target.take_driver_ns
        self._clock = target.driver_clock
        self._oom, self._sized = target.oom_errors, target.sized_only
        self._allocate_batch, self._free_batch = target.allocate_each, target.free_each
        self._allocate_pages = target.allocate_pages
        self.timer = timer
        self.pending_driver_ns = 0
        #: where the latencies go (a list or an ``array``), or None to keep none
        self.alloc_ns, self.free_ns = alloc_ns, free_ns
        self._alloc_append = None if alloc_ns is None else alloc_ns.append
        self._free_append = None if free_ns is None else free_ns.append
        self.drop_pending()

    def drop_pending(self) -> None:
        """Drop the driver time the device has pending: it belongs to no timed call (the
        device's total keeps it)."""
        clock = self._clock
        if clock is None:
            self._take()
        elif clock.pending_ns:
            clock.take()

    def allocate(self, nbytes: int, stream: int = 0, tag: str | None = None) -> Any:
        """The handle, or None; the latency goes to ``alloc_ns``."""
        timer = self.timer
        t0 = timer()
        try:
            h = (
                self._allocate(nbytes)
                if self._sized
                else self._allocate(nbytes, stream=stream, tag=tag)
            )
            t1 = timer()
        except self._oom:
            t1 = timer()
            h = None
        clock = self._clock
        driver = self._take() if clock is None else clock.take() if clock.pending_ns else 0
        if driver:
            self.pending_driver_ns += driver
        if self._alloc_append is not None:
            self._alloc_append(t1 - t0 + driver)
        return h

    def free(self, handle: Any) -> None:
        """Free ``handle``; the latency goes to ``free_ns``. Pass the last reference (for a
        dropping target the argument is what frees: CPython hands it to this frame, and ``del``
        lets go of it inside the timed region)."""
        timer = self.timer
        free = self._free
        t0 = timer()
        if free is not None:
            free(handle)
        del handle
        t1 = timer()
        clock = self._clock
        driver = self._take() if clock is None else clock.take() if clock.pending_ns else 0
        if driver:
            self.pending_driver_ns += driver
        if self._free_append is not None:
            self._free_append(t1 - t0 + driver)

    def allocate_each(self, nbytes: int, num_calls: int, tag: str | None = None) -> list[Any]:
        """``[allocate(nbytes, 0, tag) for _ in range(num_calls)]``: the same calls, each timed
        as ``allocate`` times it, without a Python frame of this class per call (the serving
        simulator's page grows of a decode step)."""
        batch = self._allocate_batch
        if batch is not None:
            timer = self.timer
            t0 = timer()
            out = batch(nbytes, num_calls, stream=0, tag=tag)
            t1 = timer()
            # the definition for a batched call, written out as in ``_split`` (a frame a grow)
            clock = self._clock
            driver = self._take() if clock is None else clock.take() if clock.pending_ns else 0
            if driver:
                self.pending_driver_ns += driver
            samples = self.alloc_ns
            if samples is not None and num_calls > 0:
                each, rest = divmod(t1 - t0 + driver, num_calls)
                samples.append(each + rest)
                if num_calls > 1:
                    samples.extend([each] * (num_calls - 1))
            return out
        if self._sized or self._oom:
            return [self.allocate(nbytes, 0, tag) for _ in range(num_calls)]
        call = functools.partial(self._allocate, stream=0, tag=tag)
        return self._each(call, itertools.repeat(nbytes, num_calls), self._alloc_append)

    def allocate_pages(self, nbytes: int, num_calls: int) -> list[Any] | None:
        """The target's page grants (``Target.allocate_pages``: ``num_calls`` one-page
        allocations of ``nbytes``, handed out as the pages themselves), timed as
        ``allocate_each`` times a target's batch: one sample a call, the batch's latency split
        evenly. None, with nothing done and no sample, when the target grants no pages or
        answered None (the caller then makes the calls: ``allocate_each``)."""
        grant = self._allocate_pages
        if grant is None:
            return None
        timer = self.timer
        t0 = timer()
        out = grant(nbytes, num_calls)
        t1 = timer()
        if out is not None:
            self._split(t1 - t0, num_calls, self.alloc_ns)
        return out

    def free_each(self, handles: list[Any]) -> None:
        """``free(h)`` for each of ``handles`` in order, each timed as ``free`` times it, without
        a Python frame of this class per call (a finished request's pages). For a policy's
        target; one that frees by dropping the last reference (``Target.free`` None) is
        handed each to ``free`` (the caller's list still holds them: drop it after)."""
        batch = self._free_batch
        if batch is not None:
            timer = self.timer
            t0 = timer()
            batch(handles)
            self._split(timer() - t0, len(handles), self.free_ns)
            return
        if self._free is None:
            for h in handles:
                self.free(h)
            return
        self._each(self._free, handles, self._free_append)

    def _split(self, elapsed_ns: int, num_calls: int, samples: Any) -> None:
        """A batched call's latency (``elapsed_ns`` + the driver time it left pending), split
        evenly among its ``num_calls`` calls into ``samples`` (None: kept nowhere)."""
        clock = self._clock
        driver = self._take() if clock is None else clock.take() if clock.pending_ns else 0
        if driver:
            self.pending_driver_ns += driver
        if samples is not None and num_calls > 0:
            each, rest = divmod(elapsed_ns + driver, num_calls)
            samples.append(each + rest)
            if num_calls > 1:
                samples.extend([each] * (num_calls - 1))

    def _each(self, call: Callable[[Any], Any], args: Any, append: Any) -> list[Any]:
        """``call(x)`` for each ``x`` of ``args``, each timed: THE definition above, as a loop."""
        timer, clock, take = self.timer, self._clock, self._take
        out = []
        for x in args:
            t0 = timer()
            h = call(x)
            t1 = timer()
            driver = take() if clock is None else clock.take() if clock.pending_ns else 0
            if driver:
                self.pending_driver_ns += driver
            if append is not None:
                append(t1 - t0 + driver)
            out.append(h)
        return out

    def take_driver_ns(self) -> int:
        ns, self.pending_driver_ns = self.pending_driver_ns, 0
        return ns


@dataclass
class EngineRun:
    """What one walk over the events measured."""

    alloc_ns: (
        np.ndarray
    )  # one latency per timed allocation attempt, refused ones included (``latency_sample``)
    free_ns: np.ndarray  # one per timed free of a live allocation
    num_failed: int
    wall_s: float
    num_frees: int = 0  # frees of live allocations, timed or not (``free_ns`` holds the timed ones)
    live: dict[Any, Any] = field(default_factory=dict)  # key -> handle still live at the end
    num_flushes: int = 0  # ``FLUSH`` ops (``empty_cache`` calls): untimed, counted here


def run(
    ops: Sequence[int],
    keys: list[Any],
    sizes: list[int],
    *,
    target: Target,
    streams: list[int] | None = None,
    tags: list[Any] | None = None,
    times_us: list[int] | None = None,
    observe: Callable[[int, int], None] | None = None,
    observe_every: int = 1,
    live: dict[Any, Any] | None = None,
    on_alloc: Callable[[Any, int, Any], None] | None = None,
    on_free: Callable[[Any], None] | None = None,
    before: Callable[[int], None] | None = None,
    unknown_free: Callable[[int, Any], Exception],
    timer: Callable[[], int] = time.perf_counter_ns,
    latency_sample: float | None = None,
    progress: str | Callable[[int], None] | None = None,
) -> EngineRun:
    """Replay the events ``ops[i]`` (``ALLOC``/``FREE``/``FLUSH``) of allocation ``keys[i]``.

    A refused allocation is counted and the trace goes on; its matching free is skipped. A free
    of a key neither live nor refused raises ``unknown_free(i, key)``. A ``FLUSH`` calls
    ``target.flush`` outside the latency samples: it is counted (``EngineRun.num_flushes``), and
    the driver time its releases cost is dropped rather than charged to the next call.

    Args:
        ops, keys, sizes: the events (``ops`` a list of op codes, or ``bytes`` of them: see
            ``sim.replay.trace_replay.TraceEvents``).
        target: the allocator.
        streams, tags: per event (stream 0 and no tag when None; a tag of None is no tag).
        times_us: per event, passed to ``observe`` (the event index when None).
        observe: ``observe(i, time_us)`` after event ``i`` for every ``i`` divisible by
            ``observe_every`` (1: after every event, as ``PoolMonitor.observe`` wants;
            ``PoolMonitor.sample_every`` with ``PoolMonitor.sample``: the same samples, with
            no call on the events in between).
        live: allocations live before the first event, by key (a recording's starting state).
        on_alloc: ``on_alloc(handle, nbytes, key)`` after each successful allocation, outside
            the timed region (realgpu touches memory there).
        on_free: ``on_free(handle)`` before each free, outside the timed region.
        before: ``before(i)`` ahead of each event (the fidelity replay logs which op a segment
            call served).
        timer: nanosecond clock.
        latency_sample: the share of calls to time, chosen at random (``latency_sample_mask``);
            None for ``default_latency_sample(len(ops))``, 1.0 to time every call. Untimed calls
            add no sample to ``alloc_ns``/``free_ns``; their driver time is drained unsampled.
        progress: a progress bar's title (``sim.replay.progress.progress_bar``: on a terminal only),
            or a callable given the number of events done since its last call (a worker process
            reporting to the parent's bar, ``sim.replay.progress.SharedCounts``); None for neither.

    The loop is the hot path of every replay, so it is written for CPython: the event lists are
    walked by one ``zip`` (no indexing), an untimed call is made inline and reads no clock
    (``latency_sample``), a timed one goes through ``TimedCalls`` (the one definition of a
    latency; its latencies go to ``array`` buffers, an append cheaper than a NumPy store), driver
    time is read off the device's ``DriverClock`` when it declares one (an attribute read instead
    of a call), and the events run in chunks between two ``observe`` points, so events that are
    not observed cost no test at all. It comes in two variants, chosen once: a tight loop for the
    common case (``_tight_loop_serves``: no per-event hook), which tests one code per event
    (``_event_codes``: op and timed together) and drains driver time only before timed calls
    and at the end, and the general loop, which tests each feature per event. Both give the
    same results (``tests/sim/replay/test_engine.py``).
    """
    if observe_every < 1:
        raise ValueError(f"observe_every(={observe_every}) must be >= 1")
    n = len(ops)
    allocate, free, take, clock = (
        target.allocate,
        target.free,
        target.take_driver_ns,
        target.driver_clock,
    )
    oom, sized, flush = target.oom_errors, target.sized_only, target.flush
    # driver time accrued before the run belongs to no call (``TimedCalls`` drops it)
    calls = TimedCalls(target, timer=timer, alloc_ns=array("q"), free_ns=array("q"))
    timed_allocate, timed_free = calls.allocate, calls.free
    live = {} if live is None else live
    failed: set[Any] = set()
    num_failed = num_flushes = 0
    alloc_op, free_op = ALLOC, FREE  # locals: a global read per event costs
    every_event = observe if observe_every == 1 else None
    at_chunk_end = observe if observe_every > 1 else None
    stride = observe_every if at_chunk_end is not None else _PROGRESS_STRIDE
    if latency_sample is None:
        latency_sample = default_latency_sample(n)
    mask = latency_sample_mask(n, latency_sample)
    streams = itertools.repeat(0) if streams is None else streams
    tags = itertools.repeat(None) if tags is None else tags
    bar = (
        None
        if progress is None
        else _CallbackBar(progress)
        if callable(progress)
        else _progress_bar(n, progress)
    )
    tight = _tight_loop_serves(
        target, before=before, on_alloc=on_alloc, on_free=on_free, every_event=every_event
    )
    wall0 = time.perf_counter()
    if tight:
        codes = _event_codes(ops, mask)
        code_iter = iter(codes)
        events = zip(code_iter, keys, sizes, streams, tags)
    else:
        events = zip(
            itertools.count(),
            ops,
            keys,
            sizes,
            streams,
            tags,
            itertools.repeat(1) if mask is None else mask,
        )
    # chunk ends: 1, 1 + stride, 1 + 2 stride, ... (after events 0, stride, 2 stride, ...), then n
    start = 0
    stop = min(1, n)
    try:
        while start < n:
            if tight:
                # ``_event_codes``: 0 untimed alloc, 1 untimed free, 3 timed alloc, 4 timed free,
                # else a flush. Untimed calls leave their driver time pending; a timed call drops
                # it first (a test of the clock's pending time, or a ``take``), so its sample is
                # its own; the ``finally`` below drops the rest, as dropping after every call would.
                for code, key, nbytes, stream, tag in itertools.islice(events, stop - start):
                    if code == 0:
                        try:
                            a = allocate(nbytes, stream=stream, tag=tag)
                        except oom:
                            a = None
                        if a is None:
                            failed.add(key)
                            num_failed += 1
                        else:
                            live[key] = a
                    elif code == 1:
                        a = live.pop(key, None)
                        if a is not None:
                            free(a)
                        elif key in failed:
                            failed.discard(key)
                        else:  # the index from how many codes are left: no counter per event
                            raise unknown_free(n - 1 - operator.length_hint(code_iter), key)
                    elif code == 3:
                        if clock is None:
                            take()
                        elif clock.pending_ns:
                            clock.take()
                        a = timed_allocate(nbytes, stream, tag)
                        if a is None:
                            failed.add(key)
                            num_failed += 1
                        else:
                            live[key] = a
                    elif code == 4:
                        a = live.pop(key, None)
                        if a is not None:
                            if clock is None:
                                take()
                            elif clock.pending_ns:
                                clock.take()
                            timed_free(a)
                        elif key in failed:
                            failed.discard(key)
                        else:
                            raise unknown_free(n - 1 - operator.length_hint(code_iter), key)
                    else:
                        num_flushes += 1
                        if flush is not None:
                            flush()
            else:
                # driver time is dropped after every untimed call and flush: nothing is pending
                # when a timed call starts
                for i, op, key, nbytes, stream, tag, timed in itertools.islice(
                    events, stop - start
                ):
                    if before is not None:
                        before(i)
                    if op == alloc_op:
                        if timed:
                            a = timed_allocate(nbytes, stream, tag)
                        else:
                            try:
                                a = (
                                    allocate(nbytes)
                                    if sized
                                    else allocate(nbytes, stream=stream, tag=tag)
                                )
                            except oom:
                                a = None
                            if clock is None:  # an untimed call's driver time belongs to no sample
                                take()
                            elif clock.pending_ns:
                                clock.take()
                        if a is None:
                            failed.add(key)
                            num_failed += 1
                        else:
                            live[key] = a
                            if on_alloc is not None:
                                on_alloc(a, nbytes, key)
                        # the live map holds the only reference (a dropping target frees on its
                        # last)
                        del a
                    elif op == free_op:
                        a = live.get(key)
                        if a is not None:
                            if on_free is not None:
                                on_free(a)
                            del a  # the free below takes the live map's, the last reference
                            if timed:
                                timed_free(live.pop(key))
                            else:
                                if free is None:  # dropping the last reference is the free
                                    del live[key]
                                else:
                                    free(live.pop(key))
                                if clock is None:
                                    take()
                                elif clock.pending_ns:
                                    clock.take()
                        elif key in failed:
                            failed.discard(key)
                        else:
                            raise unknown_free(i, key)
                    else:
                        num_flushes += 1
                        if flush is not None:
                            flush()
                            if clock is None:
                                take()
                            else:
                                clock.take()
                    if every_event is not None:
                        every_event(i, times_us[i] if times_us is not None else i)
            if at_chunk_end is not None and (stop - 1) % stride == 0:
                at_chunk_end(stop - 1, times_us[stop - 1] if times_us is not None else stop - 1)
            if bar is not None:
                bar.update(stop - start)
            start, stop = stop, min(stop + stride, n)
    finally:
        if tight:  # untimed calls' driver time belongs to no sample (the device's total keeps it)
            calls.drop_pending()
    wall_s = time.perf_counter() - wall0
    if bar is not None:
        bar.close()
    # every FREE op freed a live allocation except the skipped frees of refused ones (counted
    # here, not per event: the loop stays as it is)
    num_frees = ops.count(free_op) - (num_failed - len(failed))
    return EngineRun(
        alloc_ns=np.frombuffer(calls.alloc_ns, dtype=np.int64),
        free_ns=np.frombuffer(calls.free_ns, dtype=np.int64),
        num_failed=num_failed,
        wall_s=wall_s,
        live=live,
        num_flushes=num_flushes,
        num_frees=num_frees,
    )


def _tight_loop_serves(
    target: Target, *, before: Any, on_alloc: Any, on_free: Any, every_event: Any
) -> bool:
    """Whether ``run`` can take its tight loop: the common case, a policy replayed with no
    per-event hook (a free call; calls with stream and tag).
    Anything else takes the general loop, which tests for each feature per event."""
    return (
        target.free is not None
        and not target.sized_only
        and before is None
        and on_alloc is None
        and on_free is None
        and every_event is None
    )


def _progress_bar(total: int, desc: str):
    from sim.replay.progress import progress_bar

    return progress_bar(total, desc, unit="ev")


class _CallbackBar:
    """``progress`` given as a callable: the loop's ``update(n)`` calls it; nothing to close."""

    __slots__ = ("update",)

    def __init__(self, advance: Callable[[int], None]):
        self.update = advance

    def close(self) -> None:
        pass
