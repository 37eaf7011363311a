"""The simulated inference server: simpy owns time, the scheduler owns requests, the policy owns bytes.

Two simpy processes: ``arrivals`` hands each request to the scheduler at its arrival time and
wakes an idle engine; ``engine`` runs iterations back to back while there is work. One
iteration: the scheduler picks the batch and reserves its KV slots; the step's activations are
allocated; the step lasts the roofline time of its batch plus everything the memory system cost
on the way (driver calls of every pool, KV copies on reallocation, swaps over PCIe; a virtual KV
cache's page mapping whole, or with ``map_overlap`` only the part that outlasts the step's
compute, as vAttention maps in the background); then every
scheduled request advances and finished ones free their KV. No policy logic lives here.

Pool controls the engine drives (``sim.config.ServerConfig``): it can freeze the KV pool after its first N
steps (growth freeze, as CUDA Graph capture needs); ask an elastic pool, before the steps that
admit requests, to ``reserve`` the bytes the admissions will take (phase-aware pre-growth); and
call a compacting pool's ``compact()`` between steps (it runs a pass only when the pool is
fragmented). Compaction copies are charged to the next step. Pre-growth is taken to overlap the
previous step (``cudaMalloc`` is a host call that does not wait for the GPU), so its driver time
is reported apart (``pregrow_driver_s``), not added to any step.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

import simpy

from sim.config import ServerConfig
from sim.pools import ServerPools
from sim.scheduler import Request, Scheduler
from sim.metrics import PoolMonitor

__all__ = ["Server", "HELD_ELSEWHERE_WAIT_S"]

#: Simulated seconds a server with nothing it can schedule waits while another tenant of its
#: shared pool holds the memory (``KV.held_elsewhere``), before it tries again.
HELD_ELSEWHERE_WAIT_S = 2e-3


class Server:
    """One simulated server run over a list of requests (in arrival order).

    Args:
        requests: the requests, sorted by ``arrival_s``.
        scheduler: batching and KV decisions.
        pools: the memory pools (the policy under test is ``pools.kv.policy``).
        step_model: ``step_time_s``, ``copy_time_s``, ``swap_time_s`` (``sim.steptime``).
        model: the model spec (activation sizes).
        config: the server's settings; it reads ``sample_every_s`` (resolved: not None),
            ``horizon_s`` and the pool controls ``freeze_after_steps``, ``pregrow_safety`` and
            ``compact_between_steps``.
        progress: called with the simulated time (s) at each time-series sample, e.g. to move a
            progress bar; None for nothing.
        env: the simpy environment to run in (several servers share one when they share a GPU,
            ``sim.tenants``); None for a fresh one.
        gpu: the GPU's compute when several servers time-share it (``sim.tenants``): a simpy
            Resource of capacity 1 each step holds for its duration, so steps of different
            servers run one after another; None for a GPU of its own.

    ``gate`` (None here) is what a tenant on a shared GPU sets: its ``idle()`` is called when the
    engine runs out of work, and its ``before_step()`` before each step returns an event to wait
    for first (weights being restored) or None.

    Raises:
        ValueError: a control the KV pool does not offer (pre-growth without ``reserve``,
            compaction without ``compact``).
    """

    def __init__(self, requests: list[Request], scheduler: Scheduler, pools: ServerPools, step_model: Any,
                 model: Any, config: ServerConfig, progress: Callable[[float], None] | None = None,
                 env: simpy.Environment | None = None, gpu: simpy.Resource | None = None):
        assert config.sample_every_s is not None, "simulate() resolves the sampling interval"
        pregrow_safety, compact_between_steps = config.pregrow_safety, config.compact_between_steps
        self.config = config
        self._progress = progress
        policy = pools.kv.policy
        self._reserver = policy if pregrow_safety is not None and policy.can_reserve else None
        if pregrow_safety is not None and self._reserver is None:
            raise ValueError(f"pregrow_safety needs a KV pool that can reserve (elastic), not {policy.spec!r}")
        self._compactor = policy if policy.can_compact else None
        if compact_between_steps and self._compactor is None:
            raise ValueError(f"compact_between_steps needs a compacting KV pool (e.g. compacting:base=[best-fit]), "
                             f"not {policy.spec!r}")
        self.requests = requests
        self.scheduler = scheduler
        self.pools = pools
        self.step_model = step_model
        self.model = model
        self.env = env if env is not None else simpy.Environment()
        self.gate: Any = None
        self.gpu = gpu
        kv = scheduler.kv
        readings = kv.pool_readings()  # None: the KV policy's own (a virtual KV cache brings its own)
        self.monitor = PoolMonitor(pools.kv.policy, sample_every=1, readings=readings)
        self._kv_reserved_bytes = readings.reserved_bytes if readings is not None else pools.kv_reserved_bytes
        self.num_steps = 0
        self.busy_s = 0.0
        self.token_byte_s = 0.0  # integral of KV bytes holding token states over busy time
        self.reserved_byte_s = 0.0  # integral of KV bytes reserved over busy time
        self.pressure_byte_s = [0.0, 0.0, 0.0]  # token bytes, reserved bytes, seconds over KV-blocked steps
        self.alloc_stall_s = 0.0  # step time spent in driver calls, copies and swaps
        self.kv_driver_s = 0.0  # driver time of the KV cache's memory (its pool's grows, or page mapping)
        self.kv_driver_step_s = 0.0  # the part of it that lengthened steps (overlapped mapping hides some)
        self.num_activation_failures = 0
        self.idle_byte_s = 0.0  # integral of KV bytes reserved but not allocated over busy time
        self.frozen_at_s: float | None = None
        self.num_pregrows = 0  # segment grows made by pre-growth, off the hot path
        self.pregrow_bytes = 0
        self.pregrow_driver_s = 0.0
        self.compaction_s = 0.0  # modelled copy time of compaction passes, charged to steps
        self.initial_grows = policy.stats().num_grows  # grows before the first step (weights, workspace)
        self.rows: list[tuple] = []
        self._next_sample_s = 0.0
        self._wakeup: simpy.Event | None = None
        self._all_arrived = False

    def run(self) -> float:
        """Simulate until every request is done (or ``horizon_s``); returns the end time."""
        env = self.env
        engine = self.start()
        if self.config.horizon_s is None:
            env.run(until=engine)
        else:
            env.run(until=env.any_of([engine, env.timeout(self.config.horizon_s)]))
        return self.finish()

    def start(self) -> simpy.Process:
        """Start the arrival and engine processes in ``env``; returns the engine's (done when all is served)."""
        self.env.process(self._arrivals())
        return self.env.process(self._engine())

    def finish(self) -> float:
        """Take the last sample once the clock has stopped; returns the end time."""
        env = self.env
        self._sample()
        self.monitor.finish(self.num_steps, int(env.now * 1e6))
        return env.now

    # ------------------------------------------------------------------ processes
    def _arrivals(self):
        env, add = self.env, self.scheduler.add
        for r in self.requests:
            delay = r.arrival_s - env.now
            if delay > 0:
                yield env.timeout(delay)
            add(r)
            if self._wakeup is not None:
                wake, self._wakeup = self._wakeup, None
                wake.succeed()
        self._all_arrived = True
        if self._wakeup is not None:
            wake, self._wakeup = self._wakeup, None
            wake.succeed()

    def _engine(self):
        env, sched, pools, kv = self.env, self.scheduler, self.pools, self.scheduler.kv
        step_time, copy_time, swap_time = (self.step_model.step_time_s, self.step_model.copy_time_s,
                                           self.step_model.swap_time_s)
        activation_bytes = self.model.activation_bytes
        bytes_per_token = kv.bytes_per_token
        num_empty = 0
        compactor = self._compactor
        while True:
            if not sched.has_work():
                if self._all_arrived:
                    return
                if self.gate is not None:
                    self.gate.idle()
                self._wakeup = env.event()
                yield self._wakeup
                continue
            if self.gate is not None:
                ready = self.gate.before_step()
                if ready is not None:
                    yield ready
            if self.config.freeze_after_steps is not None and self.frozen_at_s is None \
                    and self.num_steps >= self.config.freeze_after_steps:
                pools.kv.policy.freeze()
                self.frozen_at_s = env.now
            if self._reserver is not None and sched.waiting:
                self._pregrow()
            plan = sched.schedule()
            if not plan.scheduled:
                # every running request was preempted or rejected this round: admit again at once.
                # Each empty round preempts or rejects someone, so this cannot spin for ever.
                if kv.held_elsewhere():  # another tenant holds the memory: wait for its steps to free some
                    yield env.timeout(HELD_ELSEWHERE_WAIT_S)
                    continue
                num_empty += 1
                assert num_empty <= len(self.requests) + 1, "the scheduler makes no progress"
                continue
            num_empty = 0
            act = pools.allocate_activations(activation_bytes(plan.num_batched_tokens,
                                                              plan.num_prefill_seqs + plan.decode_seqs))
            while act is None and len(plan.scheduled) > 1:
                sched.unschedule_last(plan)
                act = pools.allocate_activations(activation_bytes(plan.num_batched_tokens,
                                                                  plan.num_prefill_seqs + plan.decode_seqs))
            if act is None:  # even one request's activations do not fit: it runs, the failure counts
                self.num_activation_failures += 1
            compute_s = step_time(plan.prefill_tokens, plan.decode_seqs, plan.context_tokens,
                                  plan.prefill_context_tokens, plan.num_prefill_seqs)
            kv_driver_ns = pools.kv.take_driver_ns()
            map_s = kv.take_map_ns() * 1e-9
            # vAttention maps pages in the background: only what outlasts the step's compute shows
            map_step_s = max(0.0, map_s - compute_s) if self.config.map_overlap else map_s
            self.kv_driver_s += kv_driver_ns * 1e-9 + map_s
            self.kv_driver_step_s += kv_driver_ns * 1e-9 + map_step_s
            stall_s = (kv_driver_ns + pools.take_driver_ns()) * 1e-9 + map_step_s
            if compactor is not None:  # passes on the allocation path, or between the last two steps
                compaction_s = compactor.take_compaction_ns() * 1e-9
                self.compaction_s += compaction_s
                stall_s += compaction_s
            copy_bytes = kv.take_copy_bytes()
            if copy_bytes:
                stall_s += copy_time(copy_bytes)
            if plan.swap_out_bytes:
                stall_s += swap_time(plan.swap_out_bytes)
            if plan.swap_in_bytes:
                stall_s += swap_time(plan.swap_in_bytes)
            dt = compute_s + stall_s
            if self.gpu is None:
                yield env.timeout(dt)
            else:  # a time-shared GPU: wait for the other servers' steps, hold it for this one
                with self.gpu.request() as turn:
                    yield turn
                    yield env.timeout(dt)
            if act is not None:
                pools.free_activations(act)
            sched.complete(plan, env.now)
            self.num_steps += 1
            self.busy_s += dt
            self.alloc_stall_s += stall_s
            token_bytes = (sched.num_own_tokens + kv.cached_tokens) * bytes_per_token
            self.token_byte_s += token_bytes * dt
            reserved = self._kv_reserved_bytes()
            self.reserved_byte_s += reserved * dt
            if plan.kv_blocked:  # token states of running requests only: cached blocks nobody holds are free
                pressure = self.pressure_byte_s
                pressure[0] += (token_bytes - kv.evictable_tokens * bytes_per_token) * dt
                pressure[1] += reserved * dt
                pressure[2] += dt
            self.idle_byte_s += (reserved - kv.allocated_bytes) * dt
            if self.config.compact_between_steps:
                compactor.compact()
            if env.now >= self._next_sample_s:
                self._sample()

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
        self.pools.kv.pending_driver_ns += take()  # driver time still pending belongs to the step, as before
        grows, grown = reserver.num_grows, reserver.grown_bytes
        reserver.reserve(math.ceil(nbytes * self.config.pregrow_safety))
        self.num_pregrows += reserver.num_grows - grows
        self.pregrow_bytes += reserver.grown_bytes - grown
        self.pregrow_driver_s += take() * 1e-9

    # ------------------------------------------------------------------ time series
    def _sample(self) -> None:
        now = self.env.now
        self._next_sample_s = now + self.config.sample_every_s
        sched, kv = self.scheduler, self.scheduler.kv
        time_us = int(now * 1e6)
        if self._progress is not None:
            self._progress(now)
        self.monitor.observe(self.num_steps, time_us)
        free_kv = kv.free_bytes()  # cached blocks nobody holds count as free, as in vLLM's free queue
        self.rows.append((
            self.num_steps, time_us, len(sched.running), len(sched.waiting), len(sched.swapped),
            (sched.num_own_tokens + kv.cached_tokens) * kv.bytes_per_token, kv.allocated_bytes,
            self._kv_reserved_bytes(), free_kv,
            free_kv // kv.page_bytes if kv.paged else -1,
            sched.num_finished, len(sched.rejected),
        ))

    #: columns of ``rows``; ``free_pages`` is -1 for contiguous KV managers (they have no pages)
    ROW_COLUMNS = ["event", "time_us", "running", "waiting", "swapped", "kv_token_bytes", "kv_allocated_bytes",
                   "kv_reserved_bytes", "kv_free_bytes", "free_pages", "finished", "rejected"]

    @property
    def kv_token_util(self) -> float:
        """Share of reserved KV bytes holding token states, averaged over busy time (vLLM Fig. 2)."""
        return self.token_byte_s / self.reserved_byte_s if self.reserved_byte_s > 0 else float("nan")

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
