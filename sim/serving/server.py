"""The simulated inference server: simpy owns time, the scheduler owns requests, the policy owns
bytes.

Two simpy processes: ``arrivals`` hands each request to the scheduler at its arrival time and
wakes an idle engine; ``engine`` runs iterations back to back while there is work. One
iteration: the scheduler picks the batch and reserves its KV slots; the step's activations are
allocated; the step lasts the roofline time of its batch plus everything the memory system cost
on the way (driver calls of every pool, KV copies on reallocation, swaps over PCIe; a virtual KV
cache's page mapping whole, or with ``map_overlap`` only the part that outlasts the step's
compute, as vAttention maps in the background); then every
scheduled request advances and finished ones free their KV. No policy logic lives here.

On a clock of its own, the engine runs the steps that end before the next arrival back to back
without a simpy event each, computes quiet decode steps in closed form (``Scheduler.decode_run``:
the scheduler's and KV manager's arithmetic of decode steps, through finishes and page
boundaries, every KV allocate and free still made) and skips activation round trips known to
leave their pool as found (``Server.fast_path``; the results are identical with it off,
``tests/sim/serving/test_step_fast_path.py``). It then takes its arrivals itself (no arrival
process), and ``Server.run`` drives it without simpy's event loop: its timeouts' delays are added
to a clock of the server's (``_OwnClock``) as simpy adds them, to the same float times.

Pool controls the engine drives (``sim.serving.config.ServerConfig``): it can freeze the KV pool
after its first N steps (growth freeze, as CUDA Graph capture needs); ask an elastic pool, before
the steps that admit requests, to ``reserve`` the bytes the admissions will take (phase-aware
pre-growth); and call a compacting pool's ``compact()`` between steps (it runs a pass only when the
pool is fragmented). Compaction copies are charged to the next step. Pre-growth is taken to overlap
the previous step (``cudaMalloc`` is a host call that does not wait for the GPU), so its driver time
is reported apart (``pregrow_driver_s``), not added to any step.
"""

from __future__ import annotations

import gc
import itertools
import math
from bisect import bisect_left
from itertools import accumulate
from operator import attrgetter
from typing import Any, Callable

import simpy

from sim.serving.config import ServerConfig
from sim.serving.pools import ServerPools
from policies.base import Allocation, Policy
from sim.serving.scheduler import DecodeRun, Request, Scheduler, StepPlan

# ``Server._quiet_steps`` keeps its token bytes as a float under it: a specialised float add and
# multiply a step, not an int add and a mixed multiply, the same values
from sim.serving.steptime import FLOAT_EXACT_INT
from sim.replay.metrics import PoolMonitor

__all__ = ["Server"]

#: what ``Server._step_activations`` returns for a skipped round trip (nothing to free)
SKIPPED = object()
#: the activations of a quiet step begun in closed form (``Server._quiet_steps``): skipped, and
#: the plan is the ``DecodeRun`` that ends it
QUIET = object()
#: what ``Server._run_steps`` returns when nothing could be scheduled because another tenant holds
#: the memory
HELD_ELSEWHERE = object()
#: a pool's ``TimedCalls.pending_driver_ns`` (a C call where a comprehension makes a frame)
_pending_driver_ns = attrgetter("pending_driver_ns")
#: ``_quiet_steps``' window with nothing taken: no step, no bytes
_NONE_TAKEN = (math.inf, 0)


def _delays_to(now_s: float, end_s: float) -> tuple[float, ...]:
    """Delays whose timeouts, one after the other, take simpy from ``now_s`` to exactly
    ``end_s`` (it adds each to its clock), so that a run of steps ends at the float time one
    event per step would have reached. One when ``end_s - now_s`` lands there (always when
    ``end_s <= 2 now_s``, Sterbenz); else two, through a time past ``end_s / 2`` from which the
    rest is exact (rounding to even can leave ``end_s`` out of one addition's reach)."""
    delay = end_s - now_s
    if now_s + delay == end_s:
        return (delay,)
    first = 0.75 * delay
    mid_s = now_s + first  # what simpy reaches with ``first``, by construction
    assert end_s / 2 <= mid_s < end_s and mid_s + (end_s - mid_s) == end_s, (now_s, end_s)
    return first, end_s - mid_s


class _OwnClock:
    """The clock of a server that nothing else shares (``Server._may_batch_steps``), in place of
    its simpy environment while ``Server.run`` drives the engine itself: ``timeout(delay)`` is
    the delay, which the engine yields and ``run`` adds to ``now`` as simpy adds a timeout's
    (its event is scheduled at ``now + delay``, the clock then set to that), so every time is the
    float the event loop would reach, without an event, a heap push and a resumption each; a
    process on it is its generator, which ``run`` drives. ``now`` is a plain attribute."""

    __slots__ = ("now",)

    def __init__(self, now_s: float):
        self.now = now_s

    @staticmethod
    def timeout(delay: float) -> float:
        if delay < 0:  # as simpy refuses one
            raise ValueError(f"negative delay {delay}")
        return delay

    @staticmethod
    def process(generator):
        return generator


class Server:
    """One simulated server run over a list of requests (in arrival order).

    Args:
        requests: the requests, sorted by ``arrival_s``.
        scheduler: batching and KV decisions.
        pools: the memory pools (the policy under test is ``pools.kv.policy``).
        step_model: ``step_time_s``, ``decode_step_times_s``, ``copy_time_s``, ``swap_time_s``
            (``sim.serving.steptime.StepTimeModel``).
        model: the model spec (activation sizes).
        config: the server's settings; it reads ``sample_every_s`` (resolved: not None),
            ``horizon_s`` and the pool controls ``freeze_after_steps``, ``pregrow_safety`` and
            ``compact_between_steps``.
        progress: called with the simulated time (s) at each time-series sample, e.g. to move a
            progress bar; None for nothing.
        env: the simpy environment to run in (several servers share one when they share a GPU,
            ``sim.serving.tenants``); None for a fresh one.
        gpu: the GPU's compute when several servers time-share it (``sim.serving.tenants``): a simpy
            Resource of capacity 1 each step holds for its duration, so steps of different
            servers run one after another; None for a GPU of its own.

    ``gate`` (None here) is what a tenant on a shared GPU sets: its ``idle()`` is called when the
    engine runs out of work, and its ``before_step()`` before each step returns an event to wait
    for first (weights being restored) or None.

    The config has passed ``ServerConfig.check_rules(kv_policy=...)`` (``build_serving``): the
    pool offers what the controls need (``reserve`` for pre-growth, ``compact`` for compaction).
    """

    def __init__(
        self,
        requests: list[Request],
        scheduler: Scheduler,
        pools: ServerPools,
        step_model: Any,
        model: Any,
        config: ServerConfig,
        progress: Callable[[float], None] | None = None,
        env: simpy.Environment | None = None,
        gpu: simpy.Resource | None = None,
    ):
        assert config.sample_every_s is not None, "simulate() resolves the sampling interval"
        pregrow_safety = config.pregrow_safety
        self.config = config
        self._progress = progress
        policy = pools.kv.policy
        self._reserver = policy if pregrow_safety is not None and policy.can_reserve else None
        self._compactor = policy if policy.can_compact else None
        self.requests = requests
        self.scheduler = scheduler
        self.pools = pools
        self.step_model = step_model
        self._warmup_s = getattr(
            step_model, "warmup_s", 0.0
        )  # a fitted engine's cold first step, paid once
        self.model = model
        self.env = env if env is not None else simpy.Environment()
        self.gpu = gpu
        self.gate: Any = None
        #: private switch: multi-step decode runs and skipped activation round trips (results are
        #: the same either way, ``tests/sim/serving/test_step_fast_path.py``; off to check that)
        self.fast_path = env is None
        #: quiet decode steps whose step times are asked for at once (at most: a run's stretch
        #: also ends at its next finish); any value gives the same results (tested with 3)
        self.quiet_stretch_steps = 256
        self._quiet_pace_s = 0.0  # the last quiet step's time: how many steps reach an arrival
        self._private_env = env is None
        kv = scheduler.kv
        readings = (
            kv.pool_readings()
        )  # None: the KV policy's own (a virtual KV cache brings its own)
        self.monitor = PoolMonitor(pools.kv.policy, sample_every=1, readings=readings)
        self._kv_reserved_bytes = (
            readings.reserved_bytes if readings is not None else pools.kv_reserved_bytes
        )
        self.num_steps = 0
        self.busy_s = 0.0
        self.token_byte_s = 0.0  # integral of KV bytes holding token states over busy time
        self.reserved_byte_s = 0.0  # integral of KV bytes reserved over busy time
        self.pressure_byte_s = [
            0.0,
            0.0,
            0.0,
        ]  # token bytes, reserved bytes, seconds over KV-blocked steps
        self.alloc_stall_s = 0.0  # step time spent in driver calls, copies and swaps
        self.kv_driver_s = (
            0.0  # driver time of the KV cache's memory (its pool's grows, or page mapping)
        )
        self.kv_driver_step_s = (
            0.0  # the part of it that lengthened steps (overlapped mapping hides some)
        )
        self.num_activation_failures = 0
        self.idle_byte_s = 0.0  # integral of KV bytes reserved but not allocated over busy time
        self.frozen_at_s: float | None = None
        self.num_pregrows = 0  # segment grows made by pre-growth, off the hot path
        self.pregrow_bytes = 0
        self.pregrow_driver_s = 0.0
        self.compaction_s = 0.0  # modelled copy time of compaction passes, charged to steps
        self.initial_grows = (
            policy.stats().num_grows
        )  # grows before the first step (weights, workspace)
        self.rows: list[tuple] = []
        self._next_sample_s = 0.0
        self._wakeup: simpy.Event | None = None
        self._all_arrived = False
        self._num_empty = 0  # plans in a row that scheduled nothing
        self._batch_steps = self._quiet_runs = (
            False  # set when the engine starts (_may_batch_steps)
        )
        self._page_grows: Policy | None = None
        self._next_arrival_s = -math.inf  # when the arrival process wakes next (inf: all arrived)
        #: whether the engine takes the arrivals itself (``start``), and the next one's index
        self._owns_arrivals = False
        self._arrival_index = 0
        self._activation_bytes: dict[tuple[int, int], int] = {}  # (tokens, sampled) -> bytes
        #: sizes of activation round trips known to leave their pool as found (_step_activations)
        self._free_round_trips: set[int] = set()
        self._skips_round_trips = False  # set when the engine starts: fast path, separate layout
        self._round_trip_bytes = -1  # size of the round trip under way
        self._round_trip_before: tuple[int, int, int] = (
            0,
            0,
            0,
        )  # its pool's driver time, grows, shrinks before it
        self.num_skipped_activation_round_trips = 0
        self.num_batched_steps = (
            0  # steps run back to back without an event of their own (_run_steps)
        )
        self.num_quiet_steps = 0  # steps of them computed in closed form (_quiet_steps)
        #: each distinct pool's ``TimedCalls``, the KV pool's first (``ServerPools.distinct``):
        #: their ``pending_driver_ns`` is a plain attribute, read on the hot path
        self._timed_calls = tuple(pool.calls for pool in pools.distinct)
        assert self._timed_calls[0] is pools.kv.calls

    def run(self) -> float:
        """Simulate until every request is done (or ``horizon_s``); returns the end time.

        The objects made before the run (the modules, the trace, the requests, the pools: some
        150,000, alive through it) wait in the collector's permanent generation while it runs:
        a full collection, which the run's own allocations set off about once an hour of the
        Azure trace, walks only what the run made (40 ms less a run). A caller's frozen
        objects are its own to unfreeze: nothing is frozen or unfrozen then.

        A server whose clock nothing else shares (``_may_batch_steps``) is run without simpy's
        event loop (``_OwnClock``: the loop's events and resumptions were 1-2 % of the Azure
        hour's CPU time); ``env`` is afterwards a simpy environment at the time reached."""
        env = self.env
        # a clock nothing else shares (no other process, tenant, GPU or horizon): the engine is
        # driven here, its timeouts' delays added to an ``_OwnClock``; the simpy environment is
        # then a fresh one at the time reached (this server's own: nobody else holds it)
        clock = _OwnClock(env.now) if self._may_batch_steps() else None
        froze = gc.get_freeze_count() == 0
        if froze:
            gc.freeze()
        try:
            if clock is not None:
                self.env = clock
                engine = self.start()
                now_s = clock.now
                for delay in engine:
                    now_s = now_s + delay
                    clock.now = now_s
            else:
                engine = self.start()
                if self.config.horizon_s is None:
                    env.run(until=engine)
                else:
                    env.run(until=env.any_of([engine, env.timeout(self.config.horizon_s)]))
        finally:
            if froze:
                gc.unfreeze()
            if clock is not None:
                self.env = simpy.Environment(initial_time=clock.now)
        return self.finish()

    def start(self) -> simpy.Process:
        """Start the arrival and engine processes in ``env``; returns the engine's (done when all is
        served). A server whose steps run back to back (``_may_batch_steps``: nothing else
        shares its clock) takes its arrivals itself (``_arrive_through``), without an event
        each."""
        self._owns_arrivals = self._may_batch_steps()
        if self._owns_arrivals:
            self._arrival_index = 0
            self._take_arrivals(self.env.now)
        else:
            self.env.process(self._arrivals())
        return self.env.process(self._engine())

    def finish(self) -> float:
        """Take the last sample once the clock has stopped; returns the end time."""
        env = self.env
        self._sample(env.now)
        self.monitor.finish(self.num_steps, int(env.now * 1e6))
        return env.now

    # ------------------------------------------------------------------ processes
    def _arrivals(self):
        env, add = self.env, self.scheduler.add
        for r in self.requests:
            now_s = env.now
            delay = r.arrival_s - now_s
            if delay > 0:
                self._next_arrival_s = now_s + delay  # the time simpy gives the timeout
                yield env.timeout(delay)
            add(r)
            self._wake()
        self._all_arrived = True
        self._next_arrival_s = math.inf
        self._wake()

    def _take_arrivals(self, now_s: float) -> float:
        """What ``_arrivals`` does when it resumes at ``now_s``: add the requests due by then, and
        note the time its next timeout would reach (``_next_arrival_s``, returned; ``math.inf``
        once all arrived). For a server that owns its arrivals."""
        requests, add, i = self.requests, self.scheduler.add, self._arrival_index
        while i < len(requests):
            r = requests[i]
            delay = r.arrival_s - now_s
            if delay > 0:
                self._arrival_index = i
                self._next_arrival_s = now_s + delay  # the time simpy gives the timeout
                return self._next_arrival_s
            add(r)
            i += 1
        self._arrival_index = i
        self._all_arrived = True
        self._next_arrival_s = math.inf
        return math.inf

    def _arrive_through(self, now_s: float) -> None:
        """The arrivals ``_arrivals``' events would have brought during the engine's timeout that
        just ended at ``now_s``, in simpy's order: each one before ``now_s``; one at ``now_s``
        too when it is the first (its timeout was scheduled before the engine's, so it runs
        first: simpy orders a time's events as scheduled), not a later one (scheduled during
        the engine's timeout, after it). Nothing they do reads the clock."""
        a = self._next_arrival_s
        if a <= now_s:
            a = self._take_arrivals(a)
            while a < now_s:
                a = self._take_arrivals(a)

    def _wake(self, waiting: simpy.Event | None = None) -> None:
        """Wake the engine if it waits (for work, or for memory another tenant holds); with
        ``waiting``, only if it still waits on that event (a wake-up that came late is dropped)."""
        if self._wakeup is not None and (waiting is None or waiting is self._wakeup):
            wake, self._wakeup = self._wakeup, None
            wake.succeed()

    def _held_elsewhere(self, plan: StepPlan) -> bool:
        """Whether an empty ``plan`` must wait for memory another tenant holds: it preempted
        nobody (a round that preempted skips admission: the engine plans again at once) and
        the KV manager says the memory is held elsewhere."""
        return not plan.num_preemptions and self.scheduler.kv.held_elsewhere()

    def _memory_freed(self) -> simpy.Event:
        """An event that fires when another tenant frees KV memory of the shared pool (or a
        request arrives): what the engine waits for after ``_held_elsewhere``. Nothing but a
        free can change what the scheduler decides then (its queue is first come, first served:
        an arrival lines up behind the request that does not fit), so waking at the free is
        exact, where a fixed poll would retry late and repeat failed admissions meanwhile."""
        assert not self._owns_arrivals, "only another tenant holds memory: a shared clock"
        self._wakeup = waiting = self.env.event()
        self.scheduler.kv.call_when_freed(lambda: self._wake(waiting))
        return waiting

    def _engine(self):
        env, sched, kv = self.env, self.scheduler, self.scheduler.kv
        self._batch_steps = self._may_batch_steps()
        owns_arrivals = self._owns_arrivals
        assert owns_arrivals == self._batch_steps, "the arrivals are taken by the engine alone"
        self._skips_round_trips = self.fast_path and self.pools.layout == "separate"
        self._quiet_runs = self._batch_steps and self._may_run_quiet_steps()
        policy = self.pools.kv.policy
        #: a pool that counts its free pages (``Policy.counts_free_pages``), whose pages quiet runs
        #: may take at page boundaries (one page a request: a paged KV manager's pages are no
        #: larger)
        self._page_grows = (
            policy
            if (
                self._quiet_runs
                and kv.paged
                and policy.counts_free_pages
                and kv.page_bytes <= policy.page_size_bytes
            )
            else None
        )
        while True:
            if not sched.has_work():
                if self._all_arrived:
                    return
                if owns_arrivals:  # idle until the next arrival, at the time its event would be
                    arrival_s = self._next_arrival_s
                    if arrival_s > env.now:
                        for delay in _delays_to(env.now, arrival_s):
                            yield env.timeout(delay)
                    self._take_arrivals(arrival_s)
                    continue
                if self.gate is not None:
                    self.gate.idle()
                self._wakeup = env.event()
                yield self._wakeup
                continue
            begun = None
            if self.gate is not None:
                ready = self.gate.before_step()
                if ready is not None:
                    yield ready
            elif self._batch_steps:
                end_s, begun = self._run_steps()
                if type(begun) is tuple:
                    # the step begun at ``end_s``: the clock moves to its end at once (one event,
                    # not one to its start and one for it: nothing could happen at its start, the
                    # steps before end before the next arrival and no one else shares the clock),
                    # to the float time ``end_s + seconds`` as two events would reach it
                    now_s, step_end_s = env.now, end_s + begun[2]
                    delay = step_end_s - now_s
                    # (then the arrivals during the step: each timeout's, as simpy orders them)
                    if now_s + delay == step_end_s:  # ``_delays_to``'s one delay, inline
                        yield env.timeout(delay)
                        self._arrive_through(step_end_s)
                    else:
                        for delay in _delays_to(now_s, step_end_s):
                            yield env.timeout(delay)
                            self._arrive_through(env.now)
                    self._end_step(*begun, step_end_s)  # (``env.now`` is ``step_end_s``)
                    continue
                if end_s > env.now:  # (no arrival comes before ``end_s``: ``_run_steps``)
                    for delay in _delays_to(env.now, end_s):
                        yield env.timeout(delay)
                        self._arrive_through(env.now)
                if begun is HELD_ELSEWHERE:
                    yield self._memory_freed()
                    continue
                if begun is None:
                    continue
            if begun is None:
                plan = self._schedule(env.now)
                if not plan.scheduled:
                    if self._held_elsewhere(
                        plan
                    ):  # another tenant holds the memory: wait until it frees some
                        yield self._memory_freed()
                    else:
                        self._count_empty_round()
                    continue
                begun = self._begin_step(plan)
            if self.gpu is None:
                yield env.timeout(begun[2])
            else:  # a time-shared GPU: wait for the other servers' steps, hold it for this one
                with self.gpu.request() as turn:
                    yield turn
                    yield env.timeout(begun[2])
            self._end_step(*begun, env.now)

    # ------------------------------------------------------------------ one step
    def _schedule(self, now_s: float) -> StepPlan:
        """The controls due before a step (freeze, pre-growth), then the scheduler's plan."""
        sched = self.scheduler
        if (
            self.config.freeze_after_steps is not None
            and self.frozen_at_s is None
            and self.num_steps >= self.config.freeze_after_steps
        ):
            self.pools.kv.policy.freeze()
            self.frozen_at_s = now_s
        if self._reserver is not None and sched.waiting:
            self._pregrow()
        plan = sched.schedule()
        if plan.scheduled:
            self._num_empty = 0
        return plan

    def _count_empty_round(self) -> None:
        """A plan scheduled nothing: every running request was preempted or rejected this round,
        and the engine admits again at once. Each empty round preempts or rejects someone, so
        this cannot spin for ever."""
        self._num_empty += 1
        assert self._num_empty <= len(self.requests) + 1, "the scheduler makes no progress"

    def _begin_step(self, plan: StepPlan) -> tuple[StepPlan, Any, float, float]:
        """Allocate the step's activations and cost it: ``(plan, activations, seconds, stall
        seconds)``; the driver time, copies, mapping and swaps pending are charged to it."""
        sched, kv, step_model = self.scheduler, self.scheduler.kv, self.step_model
        act = self._step_activations(plan)
        while act is None and len(plan.scheduled) > 1:
            sched.unschedule_last(plan)
            act = self._step_activations(plan)
        if act is None:  # even one request's activations do not fit: it runs, the failure counts
            self.num_activation_failures += 1
        compute_s = step_model.step_time_s(
            plan.prefill_tokens,
            plan.decode_seqs,
            plan.context_tokens,
            plan.prefill_context_tokens,
            plan.num_prefill_seqs,
        )
        if self._warmup_s:
            compute_s += self._warmup_s
            self._warmup_s = 0.0
        # the pools' pending driver time, taken off their ``TimedCalls`` (plain attributes; the
        # KV pool's first: ``pools.kv.take_driver_ns()`` then ``pools.take_driver_ns()``)
        timed = self._timed_calls
        kv_calls = timed[0]
        kv_driver_ns = kv_calls.pending_driver_ns
        if kv_driver_ns:
            kv_calls.pending_driver_ns = 0
        aux_driver_ns = 0
        for calls in timed:
            if calls.pending_driver_ns:
                aux_driver_ns += calls.pending_driver_ns
                calls.pending_driver_ns = 0
        map_s = kv.take_map_ns() * 1e-9
        # vAttention maps pages in the background: only what outlasts the step's compute shows
        map_step_s = max(0.0, map_s - compute_s) if self.config.map_overlap else map_s
        self.kv_driver_s += kv_driver_ns * 1e-9 + map_s
        self.kv_driver_step_s += kv_driver_ns * 1e-9 + map_step_s
        stall_s = (kv_driver_ns + aux_driver_ns) * 1e-9 + map_step_s
        compactor = self._compactor
        if compactor is not None:  # passes on the allocation path, or between the last two steps
            compaction_s = compactor.take_compaction_ns() * 1e-9
            self.compaction_s += compaction_s
            stall_s += compaction_s
        copy_bytes = kv.take_copy_bytes()
        if copy_bytes:
            stall_s += step_model.copy_time_s(copy_bytes)
        if plan.swap_out_bytes:
            stall_s += step_model.swap_time_s(plan.swap_out_bytes)
        if plan.swap_in_bytes:
            stall_s += step_model.swap_time_s(plan.swap_in_bytes)
        return plan, act, compute_s + stall_s, stall_s

    def _end_step(self, plan: StepPlan, act: Any, dt: float, stall_s: float, now_s: float) -> None:
        """The step ended at ``now_s``: free its activations, advance its requests, integrate the
        pool's figures over it, compact if asked, and take a sample when one is due."""
        sched, kv = self.scheduler, self.scheduler.kv
        bytes_per_token = kv.bytes_per_token
        if act is QUIET:  # the closed form's step: the DecodeRun advances its requests
            plan.end_step(now_s)
            plan.apply()
        else:
            if act is not None:
                self._free_activations(act)
            sched.complete(plan, now_s)
        self.num_steps += 1
        self.busy_s += dt
        self.alloc_stall_s += stall_s
        token_bytes = (sched.num_own_tokens + kv.cached_tokens) * bytes_per_token
        self.token_byte_s += token_bytes * dt
        reserved = self._kv_reserved_bytes()
        self.reserved_byte_s += reserved * dt
        if (
            plan.kv_blocked
        ):  # token states of running requests only: cached blocks nobody holds are free
            pressure = self.pressure_byte_s
            pressure[0] += (token_bytes - kv.evictable_tokens * bytes_per_token) * dt
            pressure[1] += reserved * dt
            pressure[2] += dt
        self.idle_byte_s += (reserved - kv.allocated_bytes) * dt
        if self.config.compact_between_steps:
            self._compactor.compact()
        if now_s >= self._next_sample_s:
            self._sample(now_s)

    # ------------------------------------------------------------------ runs of steps
    def _may_batch_steps(self) -> bool:
        """Whether this server may run steps back to back in one simpy event: only its own
        arrivals share its clock (no other tenant, no shared GPU) and no horizon can stop it
        inside a step. Then a step that ends before the next arrival changes nothing anyone
        else could see in between, and the clock can jump over it."""
        return (
            self.fast_path
            and self._private_env
            and self.gpu is None
            and self.gate is None
            and self.config.horizon_s is None
        )

    def _may_run_quiet_steps(self) -> bool:
        """Whether quiet decode steps may be computed in closed form (``_quiet_steps``): no
        compaction, activations in a pool of their own, and a KV manager that declares its
        decode steps grow exactly when ``capacity_tokens`` runs out (``decode_grows_at_capacity``;
        not the hybrid layouts)."""
        return (
            self._compactor is None
            and self.pools.layout == "separate"
            and self.scheduler.kv.decode_grows_at_capacity
        )

    def _run_steps(self) -> tuple[float, tuple | object | None]:
        """Run the engine's next steps back to back without yielding, as long as each ends
        strictly before the next arrival; returns the time reached and the step begun but not
        run (it ends at or after the next arrival: the engine yields its time, as it would have
        without the run) or None (no work left, or a round that scheduled nothing).

        Each step is the engine's own (``_schedule``, ``_begin_step``, ``_end_step`` with the
        run's clock), or, when quiet, ``_quiet_steps``'s closed form of the same: the results
        are identical to one event per step (``tests/sim/serving/test_step_fast_path.py``).
        """
        sched, next_arrival_s = self.scheduler, self._next_arrival_s
        now_s = self.env.now
        while sched.has_work():
            if self._quiet_runs and not sched.waiting and not sched.swapped:
                now_s, begun = self._quiet_steps(now_s, next_arrival_s)
                if begun is not None:
                    return now_s, begun
                if not sched.has_work():  # the run finished the last request
                    break
            plan = self._schedule(now_s)
            if not plan.scheduled:
                if self._held_elsewhere(plan):  # someone else's memory: the engine waits for it
                    return now_s, HELD_ELSEWHERE
                self._count_empty_round()
                continue
            begun = self._begin_step(plan)
            end_s = now_s + begun[2]
            if end_s >= next_arrival_s:
                return now_s, begun
            now_s = end_s
            self.num_batched_steps += 1
            self._end_step(*begun, now_s)
        return now_s, None

    def _quiet_steps(self, now_s: float, next_arrival_s: float) -> tuple[float, tuple | None]:
        """Advance the quiet decode steps due next from ``now_s`` in closed form; returns the
        time reached and the quiet step begun there that ends at or after the next arrival
        (``(run, QUIET, seconds, 0.0)``, which ``_end_step`` ends once the engine has yielded its
        time, as it does for any step), or None.

        Quiet: a decode step of the whole running batch (``Scheduler.decode_run``: the
        scheduler's closed form says which requests finish and which need a KV slot at each
        step) whose slots are there or come from free pages (``DecodeRun.take_slots``), with no
        driver time, copy or mapping pending, activations that are a skippable round trip
        (``_step_activations``), the freeze not due, and ending strictly before the next
        arrival. Such a step's plan, time and effects are functions of the running requests
        alone, so the loop computes them as the step-time model and ``_end_step`` would, in the
        same order of float operations; the run goes on through finishes (their KV freed as
        ``Scheduler.complete`` frees it) and samples, and stops after a finish that left driver
        time pending (the next step is charged it) or emptied the batch.
        """
        sched, kv = self.scheduler, self.scheduler.kv
        if kv.copy_bytes_pending or kv.pending_map_ns or self._warmup_s:
            return now_s, None
        timed = self._timed_calls  # each pool's ``TimedCalls``: a plain attribute, no property
        for calls in timed:
            if calls.pending_driver_ns:
                return now_s, None
        run = sched.decode_run(self._page_grows)
        if run is None:
            return now_s, None
        max_steps = math.inf
        freeze = self.config.freeze_after_steps
        if freeze is not None and self.frozen_at_s is None:
            max_steps = freeze - self.num_steps
        step_times = self.step_model.decode_step_times_s
        bytes_per_token = kv.bytes_per_token
        cached = kv.cached_tokens
        # the KV bytes reserved and reserved but not allocated, as the integrals multiply them:
        # floats (``float(x) * dt`` is ``x * dt``: the int is converted so), kept exact in ints
        reserved_int = self._kv_reserved_bytes()
        reserved = float(reserved_int)
        idle = float(reserved_int - kv.allocated_bytes)
        busy_s, token_byte_s, reserved_byte_s, idle_byte_s = (
            self.busy_s,
            self.token_byte_s,
            self.reserved_byte_s,
            self.idle_byte_s,
        )
        next_sample_s = self._next_sample_s
        free_round_trips, activation_bytes = self._free_round_trips, self._activation_bytes
        needs_slots, stretch = run.needs_slots, self.quiet_stretch_steps
        no_page_grows = self._page_grows is None
        t = now_s
        num_steps = stored = 0
        m = -1
        # The run's steps between two finishes have one batch size: their step times come in
        # one call (``times``, from ``times_at``), and the run's counters are advanced in one
        # go (``lag`` steps behind ``num_steps``) before anything reads them.
        times: list[float] = []
        times_at = lag = 0
        dt = self._quiet_pace_s  # the last quiet step's time (0.0: none yet)
        #: ``(step, the KV's allocated bytes after its grows)`` for the steps of the window whose
        #: slots were taken ahead (``DecodeRun.take_slots_through``), in step order: ``take_at``,
        #: ``take_bytes`` the next one (``_NONE_TAKEN``: none)
        taken = iter(())
        take_at, take_bytes = _NONE_TAKEN
        # the token states' bytes, ``(own + cached) * bytes_per_token``, kept as a float that
        # grows by ``step_bytes`` a step: exact, the same integer the product gives, as long as
        # it stays below ``FLOAT_EXACT_INT`` (each stretch checks; the run stops short of it)
        own_bytes = float((run.num_own_tokens + cached) * bytes_per_token)
        step_bytes = 0.0
        finish_step = run.next_finish_step()
        while num_steps < max_steps:
            if run.num_seqs != m:
                # a new batch size: its activations must be a round trip known to change nothing
                m = run.num_seqs
                step_bytes = float(m * bytes_per_token)
                nbytes = activation_bytes.get((m, m))
                if nbytes is None:
                    nbytes = activation_bytes[(m, m)] = self.model.activation_bytes(m, m)
                if nbytes not in free_round_trips:
                    break
                times, times_at = [], num_steps
            i = num_steps - times_at
            if i == len(times):
                # the next stretch: up to the next finish, at most ``stretch`` steps, and about
                # as many as reach the next arrival at the last step's pace (steps only get
                # longer as the context grows; a stretch that falls short is followed by another)
                times_at, i = num_steps, 0
                n = min(finish_step, num_steps + stretch - 1, max_steps - 1) - num_steps + 1
                if no_page_grows and run.next_slot_step - num_steps < n:
                    # no pages to take: the run stops at its next slot step (unless all due then
                    # finished), whose time it reads; times past it would go unused
                    n = run.next_slot_step - num_steps + 1
                if not dt:  # the first stretch of all: no pace known yet
                    n = min(n, 16)
                elif next_arrival_s - t < n * dt:
                    n = int((next_arrival_s - t) / dt) + 2
                if own_bytes + n * step_bytes >= FLOAT_EXACT_INT:
                    break  # a float might no longer hold the token bytes exactly: steps as before
                times = step_times(m, run.context_tokens + lag * m, int(n))
            # the plain steps from here (none yields, samples, finishes, or needs a slot not yet
            # taken): the integrals alone, the same float operations in the same order as below
            k = i
            # min(len(times), the finish's, the freeze's, the next slot step's), as compares
            # (a frame-less form of the same: the first of the smallest, so an int)
            end = len(times)
            bound = finish_step - times_at
            if bound < end:
                end = bound
            bound = max_steps - times_at
            if bound < end:
                end = bound
            bound = run.next_slot_step - times_at
            if bound < end:
                end = bound
            # one bound for both checks below (``end_s >= a or end_s >= b``), a ``for`` over
            # the steps (``k`` is the step it stops at: a break's, else ``end``)
            stop_s = next_arrival_s if next_arrival_s < next_sample_s else next_sample_s
            for k in range(i, end):
                dt = times[k]
                end_s = t + dt
                if end_s >= stop_s:
                    break
                if times_at + k == take_at:
                    idle = float(reserved_int - take_bytes)  # free pages taken: nothing reserved
                    take_at, take_bytes = next(taken, _NONE_TAKEN)
                t = end_s
                busy_s += dt
                own_bytes += step_bytes
                token_byte_s += own_bytes * dt
                reserved_byte_s += reserved * dt
                idle_byte_s += idle * dt
            else:
                if end > i:
                    k = end
            if k > i:
                num_steps += k - i
                lag += k - i
                if k == len(times) or num_steps >= max_steps:
                    continue  # the loop's own checks: the next stretch, or the freeze
                i = k  # the step the plain ones stopped at: one for the whole body below
            dt = times[i]
            end_s = t + dt
            # some requests need a page now (none before the run's next slot step: no call)
            if num_steps >= run.next_slot_step and needs_slots(num_steps):
                # and this step's window: the steps up to the one that yields, takes a sample,
                # ends the stretch or finishes someone (same float adds as below), whose slots
                # come in one grow (a stretch may reach a step past its finish: the run's own
                # bounds cut it there)
                # The ends of the steps from this one to the stretch's bound: the same float adds
                # in the same order as the steps make them (``accumulate`` in C), increasing
                # (step times are positive), so the first that reaches the next arrival or
                # sample (``stop_s``, as above: neither moved since) is a bisection
                end = min(len(times) - 1, finish_step - times_at, max_steps - 1 - times_at)
                ends = list(accumulate(times[i + 1 : end + 1], initial=end_s))
                last = i + bisect_left(ends, stop_s)
                if last > end:  # none reaches it: the bound's step
                    last = end
                window = run.take_slots_through(num_steps, times_at + last)
                if window is None:  # not all at once: this step's alone, as before
                    taken = iter(())
                    take_at, take_bytes = _NONE_TAKEN
                    if not run.take_slots(num_steps):
                        break
                    # free pages taken: nothing reserved
                    idle = float(reserved_int - kv.allocated_bytes)
                else:
                    taken = iter(window.items())
                    take_at, take_bytes = next(taken, _NONE_TAKEN)
            if num_steps == take_at:
                idle = float(reserved_int - take_bytes)  # free pages taken: nothing reserved
                take_at, take_bytes = next(taken, _NONE_TAKEN)
            if end_s >= next_arrival_s:  # the engine yields for this one (arrivals come during it)
                if lag:
                    run.advance(lag)
                # the requests are written when the step ends (``_end_step``: one ``apply`` for
                # the run's steps and this one): the arrivals meanwhile read none of them
                self._store_quiet(
                    run,
                    num_steps - stored,
                    busy_s,
                    token_byte_s,
                    reserved_byte_s,
                    idle_byte_s,
                    apply=False,
                )
                self.num_skipped_activation_round_trips += 1
                self.num_quiet_steps += 1
                self._quiet_pace_s = dt
                return t, (run, QUIET, dt, 0.0)
            t = end_s
            busy_s += dt
            if num_steps == finish_step:
                if lag:
                    run.advance(lag)
                    lag = 0
                num_steps += 1
                finished = run.end_step(t)
                finish_step = run.next_finish_step()
                reserved_int = self._kv_reserved_bytes()
                reserved = float(reserved_int)
                idle = float(reserved_int - kv.allocated_bytes)
                cached = kv.cached_tokens
                own_bytes = float((run.num_own_tokens + cached) * bytes_per_token)
            else:
                num_steps += 1
                lag += 1
                own_bytes += step_bytes
                finished = 0
            token_byte_s += own_bytes * dt
            reserved_byte_s += reserved * dt
            idle_byte_s += idle * dt
            if t >= next_sample_s:
                # the sample reads the requests and the server's figures: store them first
                if lag:
                    run.advance(lag)
                    lag = 0
                self._store_quiet(
                    run, num_steps - stored, busy_s, token_byte_s, reserved_byte_s, idle_byte_s
                )
                stored = num_steps
                self._sample(t)
                next_sample_s = self._next_sample_s
            if finished and (not run.num_seqs or any(map(_pending_driver_ns, timed))):
                break
        if lag:
            run.advance(lag)
        self._store_quiet(
            run, num_steps - stored, busy_s, token_byte_s, reserved_byte_s, idle_byte_s
        )
        return t, None

    def _store_quiet(
        self,
        run: DecodeRun,
        new: int,
        busy_s: float,
        token_byte_s: float,
        reserved_byte_s: float,
        idle_byte_s: float,
        apply: bool = True,
    ) -> None:
        """Store a quiet run's figures (``new`` more steps) in the server, and (``apply``) its
        steps in the requests."""
        self.busy_s, self.token_byte_s, self.reserved_byte_s, self.idle_byte_s = (
            busy_s,
            token_byte_s,
            reserved_byte_s,
            idle_byte_s,
        )
        self.num_steps += new
        self.num_skipped_activation_round_trips += new
        self.num_batched_steps += new
        self.num_quiet_steps += new
        if apply:
            run.apply()

    # ------------------------------------------------------------------ activations
    def _step_activations(self, plan: StepPlan) -> Allocation | None | object:
        """The step's activations: an allocation, None when they do not fit, or ``SKIPPED``.

        A round trip is skipped (and counted in ``num_skipped_activation_round_trips``) when
        its size is in ``_free_round_trips``: round trips known to leave the pool as they found
        it, in a pool private to activations (the separate layout: nothing else touches it
        between two steps, and it holds nothing between them). Which sizes are known:

        - in a pool that ``coalesces``, every size whose last round trip charged no driver
          time and grew or shrank no segment: with nothing live, such a pool's state is its set
          of segments (each one free block), so any such round trip leaves it as found, and so
          does the next of any of these sizes, until a round trip changes the segments (which
          forgets them all);
        - in any other pool, the size of the last round trip, when it charged nothing: one that
          left a caching pool as it found it (a size class popped and pushed) leaves it so again.

        Only the pool's own call counters, which no report reads, differ from making the calls.
        Sizes are memoised per batch shape (the dict: one entry per (tokens, sampled) seen, a
        few hundred at most).
        """
        shape = (plan.prefill_tokens + plan.decode_seqs, plan.num_prefill_seqs + plan.decode_seqs)
        nbytes = self._activation_bytes.get(shape)
        if nbytes is None:
            nbytes = self._activation_bytes[shape] = self.model.activation_bytes(*shape)
        if nbytes in self._free_round_trips:
            self.num_skipped_activation_round_trips += 1
            return SKIPPED
        pool = self.pools.activations
        self._round_trip_before = (
            pool.pending_driver_ns,
            pool.policy.num_grows,
            pool.policy.num_shrinks,
        )
        a = self.pools.allocate_activations(nbytes)
        if a is None:  # a refusal may have released cached segments
            self._free_round_trips.clear()
        self._round_trip_bytes = nbytes
        return a

    def _free_activations(self, a: Allocation | object) -> None:
        if a is SKIPPED:
            return
        pool = self.pools.activations
        self.pools.free_activations(a)  # type: ignore[arg-type]
        if not self._skips_round_trips:
            return
        known = self._free_round_trips
        if (
            pool.pending_driver_ns,
            pool.policy.num_grows,
            pool.policy.num_shrinks,
        ) != self._round_trip_before:
            known.clear()  # the round trip changed the pool: no size is known to leave it as found
        else:
            if not pool.policy.coalesces:
                known.clear()  # only the last size is known to repeat
            known.add(self._round_trip_bytes)

    # ------------------------------------------------------------------ pre-growth
    def predicted_bytes(self) -> int:
        """Bytes the next step's admissions will allocate in the KV pool.

        The waiting requests the scheduler would admit (seats and the token budget left after
        one token per running request), each with the KV its first chunk takes, without prefix
        hits (an over-estimate at worst); plus the step's activations when they share the pool.
        """
        sched, kv = self.scheduler, self.scheduler.kv
        num_running = len(sched.running)
        budget = sched.config.max_num_batched_tokens - num_running
        total = tokens = seqs = 0
        for r in itertools.islice(sched.waiting, max(0, sched.config.max_num_seqs - num_running)):
            if budget <= 0:
                break
            n = min(r.num_tokens, budget)
            total += kv.estimate_bytes(r.kv, n)
            budget -= n
            tokens += n
            seqs += 1
        if seqs and self.pools.layout == "shared":
            total += self.model.activation_bytes(tokens + num_running, seqs + num_running)
        return total

    def _pregrow(self) -> None:
        """Reserve the predicted bytes x safety before the step; its driver time is kept apart."""
        nbytes = self.predicted_bytes()
        if nbytes <= 0:
            return
        reserver = self._reserver
        take = reserver.device.take_driver_ns
        self.pools.kv.pending_driver_ns += (
            take()
        )  # driver time still pending belongs to the step, as before
        grows, grown = reserver.num_grows, reserver.grown_bytes
        reserver.reserve(math.ceil(nbytes * self.config.pregrow_safety))
        self.num_pregrows += reserver.num_grows - grows
        self.pregrow_bytes += reserver.grown_bytes - grown
        self.pregrow_driver_s += take() * 1e-9

    # ------------------------------------------------------------------ time series
    def _sample(self, now: float) -> None:
        self._next_sample_s = now + self.config.sample_every_s
        sched, kv = self.scheduler, self.scheduler.kv
        time_us = int(now * 1e6)
        if self._progress is not None:
            self._progress(now)
        self.monitor.observe(self.num_steps, time_us)
        free_kv = (
            kv.free_bytes()
        )  # cached blocks nobody holds count as free, as in vLLM's free queue
        comp = (
            self._compactor.compaction_stats() if self._compactor is not None else {}
        )  # read per sample only
        self.rows.append(
            (
                self.num_steps,
                time_us,
                len(sched.running),
                len(sched.waiting),
                len(sched.swapped),
                (sched.num_own_tokens + kv.cached_tokens) * kv.bytes_per_token,
                kv.allocated_bytes,
                self._kv_reserved_bytes(),
                free_kv,
                free_kv // kv.page_bytes if kv.paged else -1,
                sched.num_finished,
                len(sched.rejected),
                comp.get("num_compactions", 0),
                comp.get("moved_bytes", 0),
            )
        )

    #: columns of ``rows``; ``free_pages`` is -1 for contiguous KV managers (they have no pages);
    #: ``num_compactions``, ``compaction_moved_bytes``: a compacting pool's passes so far (0 for
    #: others)
    ROW_COLUMNS = [
        "event",
        "time_us",
        "running",
        "waiting",
        "swapped",
        "kv_token_bytes",
        "kv_allocated_bytes",
        "kv_reserved_bytes",
        "kv_free_bytes",
        "free_pages",
        "finished",
        "rejected",
        "num_compactions",
        "compaction_moved_bytes",
    ]

    @property
    def kv_token_util(self) -> float:
        """Share of reserved KV bytes holding token states, averaged over busy time (vLLM Fig.
        2)."""
        return (
            self.token_byte_s / self.reserved_byte_s if self.reserved_byte_s > 0 else float("nan")
        )

    @property
    def kv_token_util_pressure(self) -> float:
        """Share of reserved KV bytes holding running requests' token states (their own and the
        cached prefix blocks they hold; cached blocks nobody holds are left out, they are free to
        evict), averaged over the steps the KV memory limited (``StepPlan.kv_blocked``) only: the
        pool's use when it matters, as in vLLM's Figure 2. NaN when no step was limited."""
        token, reserved, _ = self.pressure_byte_s
        return token / reserved if reserved > 0 else float("nan")

    @property
    def kv_pressure_s(self) -> float:
        """Busy seconds of the steps the KV memory limited."""
        return self.pressure_byte_s[2]
