"""The simulated inference server: simpy owns time, the scheduler owns requests, the policy owns bytes.

Two simpy processes: ``arrivals`` hands each request to the scheduler at its arrival time and
wakes an idle engine; ``engine`` runs iterations back to back while there is work. One
iteration: the scheduler picks the batch and reserves its KV slots; the step's activations are
allocated; the step lasts the roofline time of its batch plus everything the memory system cost
on the way (driver calls of every pool, KV copies on reallocation, swaps over PCIe); then every
scheduled request advances and finished ones free their KV. No policy logic lives here.

Pool controls the engine drives (``ServerConfig``): it can freeze the KV pool after its first N
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
from dataclasses import asdict, dataclass, fields
from typing import Any

import simpy

from sim.kv import STRATEGIES
from sim.pools import DEFAULT_WORKSPACE_BYTES, POOL_LAYOUTS, ServerPools
from sim.scheduler import PREEMPTION_MODES, Request, Scheduler
from sim.metrics import PoolMonitor

__all__ = ["ServerConfig", "Server"]


@dataclass(frozen=True)
class ServerConfig:
    """Every knob of the simulated server (defaults follow vLLM's).

    Memory:
        gpu_memory_utilization: share of GPU memory the server may use (vLLM: 0.9).
        kv_capacity_bytes: KV budget; None derives it as usable - weights - activations -
            workspace.
        workspace_bytes: kept outside the KV cache for library workspaces.
        pool_layout: "separate" (KV pool alone) or "shared" (one pool for everything).
        aux_policy: policy spec of the weights/activations/workspace pools when separate.
    KV cache:
        kv_strategy: reservation of contiguous policies: max, oracle, pow2, pow2-oracle, grow.
        grow_tokens: chunk of the ``grow`` strategy.
        tokens_per_page: page size of paged policies in tokens (None: the policy's own).
        prefix_caching: share prompt blocks by ``hash_ids`` (paged policies only).
        prefix_block_tokens: tokens per hash block (None: the trace's, else 512).
        max_model_len: longest sequence; longer outputs are cut there, ``max`` reserves it
            (None: 8192).
    Scheduling:
        max_num_seqs, max_num_batched_tokens, chunked_prefill, watermark: see ``Scheduler``.
        preemption: "recompute" or "swap"; swap_space_bytes: host memory for it (None: unlimited).
    Reporting:
        slo_ttft_s, slo_tpot_s, slo_e2e_s: goodput counts requests meeting all that are set.
        sample_every_s: time-series interval (None: the trace's duration / 2000).
        horizon_s: stop the clock here (None: run until every request is done).
    Pool controls:
        freeze_after_steps: freeze the KV pool after this many steps (None: never).
        pregrow_safety: before a step that admits requests, reserve this multiple of the KV
            (and, in a shared pool, activation) bytes they will take; needs a pool with
            ``reserve`` (elastic). None: react to failures only.
        compact_between_steps: call the KV pool's ``compact()`` after every step (a pass runs
            when the pool is fragmented); needs a compacting pool.
    """

    gpu_memory_utilization: float = 0.9
    kv_capacity_bytes: int | None = None
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    pool_layout: str = "separate"
    aux_policy: str = "best-fit"
    kv_strategy: str = "pow2"
    grow_tokens: int = 512
    tokens_per_page: int | None = None
    prefix_caching: bool = True
    prefix_block_tokens: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    watermark: float = 0.01
    preemption: str = "recompute"
    swap_space_bytes: int | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    slo_e2e_s: float | None = None
    sample_every_s: float | None = None
    horizon_s: float | None = None
    freeze_after_steps: int | None = None
    pregrow_safety: float | None = None
    compact_between_steps: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}(={getattr(self, name)!r}) {why}")

        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", "must be in (0, 1]")
        for name in ("kv_capacity_bytes", "swap_space_bytes", "tokens_per_page", "prefix_block_tokens",
                     "max_model_len"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad(name, "must be a positive integer or None")
        for name in ("grow_tokens", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "must be a positive integer")
        if isinstance(self.workspace_bytes, bool) or not isinstance(self.workspace_bytes, int) or self.workspace_bytes < 0:
            bad("workspace_bytes", "must be an integer >= 0")
        if self.pool_layout not in POOL_LAYOUTS:
            bad("pool_layout", f"must be one of {', '.join(POOL_LAYOUTS)}")
        if self.kv_strategy not in STRATEGIES:
            bad("kv_strategy", f"must be one of {', '.join(STRATEGIES)}")
        if self.preemption not in PREEMPTION_MODES:
            bad("preemption", f"must be one of {', '.join(PREEMPTION_MODES)}")
        if not isinstance(self.compact_between_steps, bool):
            bad("compact_between_steps", "must be true or false")
        v = self.freeze_after_steps
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            bad("freeze_after_steps", "must be an integer >= 0 or None")
        v = self.pregrow_safety
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
            bad("pregrow_safety", "must be a positive number or None")
        if not 0 <= self.watermark < 1:
            bad("watermark", "must be in [0, 1)")
        for name in ("slo_ttft_s", "slo_tpot_s", "slo_e2e_s", "sample_every_s", "horizon_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
                bad(name, "must be a positive number of seconds or None")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerConfig:
        """Build from keyword options; an unknown name is a ValueError listing the known ones."""
        known = [f.name for f in fields(cls)]
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise ValueError(f"unknown simulator option {unknown[0]!r}; options: {', '.join(known)}")
        return cls(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Server:
    """One simulated server run over a list of requests (in arrival order).

    Args:
        requests: the requests, sorted by ``arrival_s``.
        scheduler: batching and KV decisions.
        pools: the memory pools (the policy under test is ``pools.kv.policy``).
        step_model: ``step_time_s``, ``copy_time_s``, ``swap_time_s`` (``sim.steptime``).
        model: the model spec (activation sizes).
        sample_every_s: interval of the time series.
        horizon_s: stop here even if requests remain.
        freeze_after_steps, pregrow_safety, compact_between_steps: the pool controls (see ``ServerConfig``).

    Raises:
        ValueError: a control the KV pool does not offer (pre-growth without ``reserve``,
            compaction without ``compact``).
    """

    def __init__(self, requests: list[Request], scheduler: Scheduler, pools: ServerPools, step_model: Any,
                 model: Any, *, sample_every_s: float, horizon_s: float | None = None,
                 freeze_after_steps: int | None = None, pregrow_safety: float | None = None,
                 compact_between_steps: bool = False):
        policy = pools.kv.policy
        self._reserver = policy if pregrow_safety is not None and policy.can_reserve else None
        if pregrow_safety is not None and self._reserver is None:
            raise ValueError(f"pregrow_safety needs a KV pool that can reserve (elastic), not {policy.spec!r}")
        self._compactor = policy if policy.can_compact else None
        if compact_between_steps and self._compactor is None:
            raise ValueError(f"compact_between_steps needs a compacting KV pool (e.g. compacting:base=[best-fit]), "
                             f"not {policy.spec!r}")
        self.freeze_after_steps = freeze_after_steps
        self.pregrow_safety = pregrow_safety
        self.compact_between_steps = compact_between_steps
        self.requests = requests
        self.scheduler = scheduler
        self.pools = pools
        self.step_model = step_model
        self.model = model
        self.sample_every_s = sample_every_s
        self.horizon_s = horizon_s
        self.env = simpy.Environment()
        self.monitor = PoolMonitor(pools.kv.policy, sample_every=1)
        self.num_steps = 0
        self.busy_s = 0.0
        self.token_byte_s = 0.0  # integral of KV bytes holding token states over busy time
        self.reserved_byte_s = 0.0  # integral of KV bytes reserved over busy time
        self.alloc_stall_s = 0.0  # step time spent in driver calls, copies and swaps
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
        env.process(self._arrivals())
        engine = env.process(self._engine())
        if self.horizon_s is None:
            env.run(until=engine)
        else:
            env.run(until=env.any_of([engine, env.timeout(self.horizon_s)]))
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
                self._wakeup = env.event()
                yield self._wakeup
                continue
            if self.freeze_after_steps is not None and self.frozen_at_s is None \
                    and self.num_steps >= self.freeze_after_steps:
                pools.kv.policy.freeze()
                self.frozen_at_s = env.now
            if self._reserver is not None and sched.waiting:
                self._pregrow()
            plan = sched.schedule()
            if not plan.scheduled:
                # every running request was preempted or rejected this round: admit again at once.
                # Each empty round preempts or rejects someone, so this cannot spin for ever.
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
            stall_s = pools.take_driver_ns() * 1e-9
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
            yield env.timeout(dt)
            if act is not None:
                pools.free_activations(act)
            sched.complete(plan, env.now)
            self.num_steps += 1
            self.busy_s += dt
            self.alloc_stall_s += stall_s
            self.token_byte_s += (sched.num_own_tokens + kv.cached_tokens) * bytes_per_token * dt
            reserved = pools.kv_reserved_bytes()
            self.reserved_byte_s += reserved * dt
            self.idle_byte_s += (reserved - kv.allocated_bytes) * dt
            if self.compact_between_steps:
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
        budget = sched.max_num_batched_tokens - num_running
        total = tokens = seqs = 0
        for r in itertools.islice(sched.waiting, max(0, sched.max_num_seqs - num_running)):
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
        reserver.reserve(math.ceil(nbytes * self.pregrow_safety))
        self.num_pregrows += reserver.num_grows - grows
        self.pregrow_bytes += reserver.grown_bytes - grown
        self.pregrow_driver_s += take() * 1e-9

    # ------------------------------------------------------------------ time series
    def _sample(self) -> None:
        now = self.env.now
        self._next_sample_s = now + self.sample_every_s
        sched, kv = self.scheduler, self.scheduler.kv
        time_us = int(now * 1e6)
        self.monitor.observe(self.num_steps, time_us)
        free_kv = kv.free_bytes()  # cached blocks nobody holds count as free, as in vLLM's free queue
        self.rows.append((
            self.num_steps, time_us, len(sched.running), len(sched.waiting), len(sched.swapped),
            (sched.num_own_tokens + kv.cached_tokens) * kv.bytes_per_token, kv.allocated_bytes,
            self.pools.kv_reserved_bytes(), free_kv,
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
