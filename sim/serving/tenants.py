"""Tenants: several model instances serving their own requests on ONE simulated GPU.

Each tenant is a whole single-tenant server (``sim.serving.simulate.build_serving``: its memory
plan, scheduler, KV manager, step-time model), and all of them run in one simpy environment, so they
share one clock. Compute is shared in one of two ways (``COMPUTE_MODES``):

- ``time-sliced`` (the default, what several vLLM processes on one GPU get without MPS: CUDA
  time-slices their contexts): one GPU resource every tenant's server holds for each step's
  duration, so steps of different tenants run one after another, first come first served. A
  step is the unit of interleaving: real time-slicing switches contexts inside a step too,
  which ends both tenants' steps at about the sum of their times where here the first one to
  ask ends first. No context-switch cost is modelled: neither the field notes nor a public
  source we found measure one for CUDA time-slicing between processes.
- ``independent``: every tenant steps as if the GPU were its own (each step takes the time it
  takes alone): the lower bound on queueing that MPS or MIG-style spatial sharing approaches
  when the tenants' kernels leave each other room.

Memory is shared in one of three layouts:

- ``static``: the GPU's KV memory cut in equal shares, one pool per tenant (vLLM instances each
  with its own ``gpu_memory_utilization``). A tenant here is exactly a single-tenant run with
  ``kv_capacity_bytes`` = its share.
- ``shared``: one pool whose capacity is all the GPU's KV memory, every tenant's KV manager a
  view over it (kvcached: one elastic page pool, pages mapped when a tenant needs them and
  unmapped when freed, the map/unmap calls costed by the page-mapped device). What a tenant
  sees free is what no tenant holds; cached prefix blocks nobody holds are evicted, its own
  first, when the pool is full. With prefix caching (a policy with a block cache, ``paged``)
  every tenant keeps its own prefix cache over the shared memory, as colocated vLLM instances
  do (kvcached shares memory, not caches): its keys are namespaced by tenant, so two tenants'
  equal hash ids never share a block, and each has its own evictable queue.
- ``sleep``: ``shared`` plus vLLM's sleep mode: a tenant idle for ``sleep_after_s`` drops its
  cached KV and releases its weights (their bytes join the pool); its next request waits for
  the pool to give the bytes back (other tenants' allocations fail meanwhile, so they preempt)
  and for the weights to come back over PCIe (``CostModel.h2d_ns``): that wait lands in the
  request's TTFT.

The GPU's memory is ``gpu_memory_utilization`` x its bytes; every tenant's weights, activation
reserve and workspace (``sim.serving.pools.plan_memory``) come off first and the rest is KV memory.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import simpy

from policies.base import Policy
from sim.serving.config import ServerConfig
from sim.replay.costs import CostModel
from sim.replay.hardware import load_gpu
from sim.serving.kv import PagedKV
from sim.replay.models import load_model
from sim.serving.pools import plan_memory
from sim.replay.costed_policy import create_policy
from sim.replay.schema import summary_frame
from sim.replay.serving_metrics import latency_percentiles
from sim.serving.simulate import ServingSetup, SimResult, build_serving, serving_result
from traces.requests import RequestTrace

__all__ = [
    "LAYOUTS",
    "COMPUTE_MODES",
    "DEFAULT_SLEEP_AFTER_S",
    "Colocation",
    "GpuSplit",
    "split_gpu",
    "share_trace",
    "scale_tenant_rates",
    "colocate",
    "colocate_layouts",
    "LayoutComparison",
]

LAYOUTS = ("static", "shared", "sleep")
#: How the tenants share the GPU's compute (module docstring); the first is the default.
COMPUTE_MODES = ("time-sliced", "independent")
#: Idle seconds before a tenant sleeps in the ``sleep`` layout.
DEFAULT_SLEEP_AFTER_S = 30.0


def share_trace(trace: RequestTrace, num_shares: int) -> list[RequestTrace]:
    """Deal ``trace``'s requests round-robin into ``num_shares`` traces (a share of one load).

    Arrival times and request ids are kept (the tenants share the GPU's clock); every request
    lands in exactly one share.
    """
    if int(num_shares) != num_shares or num_shares < 1:
        raise ValueError(f"num_shares(={num_shares!r}) must be a whole number >= 1")
    if len(trace) < num_shares:
        raise ValueError(
            f"{trace.name}: {len(trace)} requests cannot be shared among {num_shares} tenants"
        )
    df = trace.requests
    return [
        RequestTrace(
            requests=df.iloc[i::num_shares].reset_index(drop=True),
            name=f"{trace.name}[{i}/{num_shares}]",
            source=trace.source,
            format=trace.format,
            meta=dict(trace.meta),
        )
        for i in range(num_shares)
    ]


def scale_tenant_rates(traces: list[RequestTrace], scales: list[float]) -> list[RequestTrace]:
    """Tenant i's trace with its request rate times ``scales[i]`` (unequal loads: a scale of 4
    packs a tenant's share into a quarter of the time, a burst the others do not see)."""
    if len(scales) != len(traces):
        raise ValueError(
            f"{len(scales)} rate scales for {len(traces)} tenants: give one per tenant"
        )
    return [t.scale_rate(f) if f != 1.0 else t for t, f in zip(traces, scales)]


@dataclass(frozen=True)
class GpuSplit:
    """How one GPU's memory is split among tenants before the first request.

    ``kv_bytes = usable_bytes - sum(fixed_bytes)``; ``fixed_bytes[i]`` is tenant i's weights,
    activation reserve and workspace, of which ``weight_bytes[i]`` are its weights.
    """

    gpu_bytes: int
    usable_bytes: int
    fixed_bytes: tuple[int, ...]
    weight_bytes: tuple[int, ...]
    kv_bytes: int

    def static_share_bytes(self) -> int:
        """One tenant's KV pool in the static layout (equal shares)."""
        return self.kv_bytes // len(self.fixed_bytes)


def split_gpu(models: list[Any], gpu: Any, config: ServerConfig) -> GpuSplit:
    """``GpuSplit`` of ``gpu`` among ``models`` (one per tenant); ValueError when no KV is left."""
    fixed, weights = [], []
    usable = 0
    for m in models:
        p = plan_memory(
            m,
            gpu,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_batched_tokens=config.max_num_batched_tokens,
            workspace_bytes=config.workspace_bytes,
            kv_capacity_bytes=1,
            tensor_parallel=config.tensor_parallel,
        )
        fixed.append(p.weight_bytes + p.activation_reserve_bytes + p.workspace_bytes)
        weights.append(p.weight_bytes)
        usable = p.usable_bytes
    kv = usable - sum(fixed)
    if kv <= 0:
        names = ", ".join(m.name for m in models)
        raise ValueError(
            f"{len(models)} tenants ({names}) do not fit on {gpu.name}: their weights, "
            f"activations and workspace take {sum(fixed) / 2**30:.1f} GiB of "
            f"the {usable / 2**30:.1f} GiB usable"
        )
    return GpuSplit(int(gpu.memory_bytes), usable, tuple(fixed), tuple(weights), kv)


class _SharedPool:
    """The one KV pool of the shared layouts and the KV managers viewing it (a list: tenants are few
    and their order, the order evictions visit them in, must be fixed for determinism).

    Whoever waits for memory another tenant holds (a server that can schedule nothing, a tenant
    waking from sleep) registers with ``call_when_freed`` and is called back when the pool's
    free bytes rise past what they were (``memory_freed``, after every KV free and every sleep):
    event-driven, so the wait ends at the free itself, not at the next tick of a poll.
    """

    def __init__(self, policy: Policy):
        self.policy = policy
        self.kvs: list[SharedKV] = []
        #: (free bytes when registered, callback), in registration order (a list: called back in
        #: a fixed order for determinism; a handful of waiters at most, one per tenant)
        self._waiters: list[tuple[int, Callable[[], None]]] = []

    def free_bytes(self) -> int:
        cap = self.policy.capacity_bytes
        assert cap is not None, "the shared pool has a capacity"
        return cap - sum(k.allocated_bytes - k.evictable_bytes for k in self.kvs)

    def evict_any(self) -> bool:
        """Evict one cached block nobody holds, from any tenant; False when none is left."""
        return any(PagedKV._evict_one(k) for k in self.kvs)

    def call_when_freed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, at the first ``memory_freed`` that finds more bytes free than
        now."""
        self._waiters.append((self.free_bytes(), callback))

    def memory_freed(self) -> None:
        """Call back the waiters that now see more bytes free than when they registered. A
        failed admission allocates and frees the same bytes, so it wakes nobody (two waiting
        tenants cannot wake each other for ever)."""
        if not self._waiters:
            return
        free = self.free_bytes()
        due = [cb for before, cb in self._waiters if free > before]
        if due:
            self._waiters = [(before, cb) for before, cb in self._waiters if free <= before]
            for cb in due:
                cb()


class SharedKV(PagedKV):
    """A tenant's paged KV manager over the GPU's one shared pool: what it sees free is what no
    tenant holds, and when the pool is full it evicts cached blocks, its own first, then others'.
    Its prefix cache is its own: ``cache_owner`` is its index among the pool's tenants."""

    def __init__(self, *args: Any, shared: _SharedPool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.shared = shared
        self.cache_owner = len(shared.kvs)
        shared.kvs.append(self)

    def free_bytes(self) -> int:
        return self.shared.free_bytes()

    def _evict_one(self) -> bool:
        return super()._evict_one() or self.shared.evict_any()

    def held_elsewhere(self) -> bool:
        return any(k.allocated_bytes > k.evictable_bytes for k in self.shared.kvs if k is not self)

    def call_when_freed(self, callback: Callable[[], None]) -> None:
        self.shared.call_when_freed(callback)

    def free(self, h: Any) -> None:
        super().free(h)
        self.shared.memory_freed()


class _SleepGate:
    """vLLM sleep mode for one tenant (``Server.gate``): sleep after ``sleep_after_s`` idle, wake
    before the next step (pool bytes back, then the weights over PCIe)."""

    def __init__(
        self,
        env: simpy.Environment,
        shared: _SharedPool,
        kv: SharedKV,
        weight_bytes: int,
        restore_s: float,
        sleep_after_s: float,
    ):
        self.env, self.shared, self.kv = env, shared, kv
        self.weight_bytes = weight_bytes
        self.restore_s = restore_s
        self.sleep_after_s = sleep_after_s
        self.asleep = False
        self._epoch = 0  # bumped by every step: a sleep timer set before it is stale
        self._waking: simpy.Process | None = None
        self.num_sleeps = 0
        self.num_wakes = 0
        self.wake_s = 0.0  # total time steps waited for wakes (memory back + restore)
        self.restore_driver_s = 0.0  # unmap time of the pages trimmed to make room for the weights

    def idle(self) -> None:
        self.env.process(self._sleep_later(self._epoch))

    def _sleep_later(self, epoch: int):
        yield self.env.timeout(self.sleep_after_s)
        if epoch == self._epoch and not self.asleep and not self.kv_busy():
            self._sleep()

    def kv_busy(self) -> bool:
        return self.kv.allocated_bytes - self.kv.evictable_bytes > 0

    def _sleep(self) -> None:
        while PagedKV._evict_one(self.kv):  # level 1 discards the KV cache
            pass
        self.shared.policy.capacity_bytes += self.weight_bytes
        self.asleep = True
        self.num_sleeps += 1
        self.shared.memory_freed()  # the weights' bytes are the others' now

    def before_step(self) -> simpy.Process | None:
        self._epoch += 1
        if not self.asleep:
            return None
        if self._waking is None:
            self._waking = self.env.process(self._wake())
        return self._waking

    def _wake(self):
        env, policy = self.env, self.shared.policy
        t0 = env.now
        policy.capacity_bytes -= (
            self.weight_bytes
        )  # from now on no tenant may map into the weights' room
        while policy.reserved_bytes > policy.capacity_bytes:
            while policy.reserved_bytes > policy.capacity_bytes and self.shared.evict_any():
                pass
            policy.trim()
            driver_s = policy.device.take_driver_ns() * 1e-9
            self.restore_driver_s += driver_s
            freed = None
            if (
                policy.reserved_bytes > policy.capacity_bytes
            ):  # held by running requests: wait for a free
                freed = env.event()
                self.shared.call_when_freed(
                    freed.succeed
                )  # before the unmap time: a free in it counts
            if driver_s:
                yield env.timeout(driver_s)
            if freed is not None:
                yield freed
        yield env.timeout(self.restore_s)
        self.asleep = False
        self._waking = None
        self.num_wakes += 1
        self.wake_s += env.now - t0


class Colocation:
    """Tenants on one GPU, built and ready to ``run``.

    Args:
        traces: one request trace per tenant.
        policy_spec: the KV pool's policy (paged ones for the shared layouts: ``page-pool`` is
            kvcached's elastic page pool).
        models: one model (preset, file or spec) per tenant, or one for all.
        gpu: the GPU preset or spec.
        layout: ``static``, ``shared`` or ``sleep``.
        config: the settings every tenant's server gets (``kv_capacity_bytes`` must be unset:
            the layout decides each tenant's KV memory).
        sleep_after_s: idle seconds before a tenant sleeps (``sleep`` layout).
        compute: ``time-sliced`` (steps of different tenants take turns on the GPU) or
            ``independent`` (each tenant steps as if alone: the spatial-sharing lower bound).
        calibration, costs: as ``sim.serving.simulate.simulate``'s.

    ``env`` is the one simpy environment; a test may add processes to it before ``run``.
    """

    def __init__(
        self,
        traces: list[RequestTrace],
        policy_spec: str,
        *,
        models: list[Any] | Any,
        gpu: Any,
        layout: str = "shared",
        config: ServerConfig | None = None,
        sleep_after_s: float = DEFAULT_SLEEP_AFTER_S,
        calibration: Any = None,
        costs: CostModel | str | Path | None = None,
        compute: str = COMPUTE_MODES[0],
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown tenant layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
        if compute not in COMPUTE_MODES:
            raise ValueError(
                f"unknown compute sharing {compute!r}; modes: {', '.join(COMPUTE_MODES)}"
            )
        if not traces:
            raise ValueError("colocation needs at least one tenant trace")
        cfg = config if config is not None else ServerConfig()
        cfg.check_rules(tenants=True)
        if not (sleep_after_s > 0):
            raise ValueError(f"sleep_after_s(={sleep_after_s!r}) must be > 0")
        model_list = list(models) if isinstance(models, (list, tuple)) else [models] * len(traces)
        if len(model_list) == 1:
            model_list *= len(traces)
        if len(model_list) != len(traces):
            raise ValueError(
                f"{len(model_list)} models for {len(traces)} tenants: give one, or one per tenant"
            )
        loaded = [load_model(m) for m in model_list]
        gpu = load_gpu(gpu)
        self.layout = layout
        self.compute = compute
        #: the simulated seconds over which requests arrive (the longest tenant trace)
        self.arrivals_s = max(float(t.duration_s) for t in traces)
        self.split = split_gpu(loaded, gpu, cfg)
        self.env = simpy.Environment()
        # capacity 1: one step at a time; FIFO, so tenants with work take turns step by step
        self.gpu = simpy.Resource(self.env, capacity=1) if compute == "time-sliced" else None
        cost_model = costs if isinstance(costs, CostModel) else CostModel.load(costs)
        common = dict(gpu=gpu, calibration=calibration, costs=cost_model, env=self.env)
        self.shared: _SharedPool | None = None
        self.gates: list[_SleepGate | None] = [None] * len(traces)
        self.setups: list[ServingSetup] = []
        if layout == "static":
            share = self.split.static_share_bytes()
            for trace, m in zip(traces, loaded):
                self.setups.append(
                    build_serving(
                        trace,
                        policy_spec,
                        model=m,
                        config=cfg.replace(kv_capacity_bytes=share),
                        **common,
                    )
                )
            self._share_compute()
            return
        kv_bytes = self.split.kv_bytes
        bytes_per_token = loaded[0].shard(cfg.tensor_parallel).kv_bytes_per_token
        policy = create_policy(
            policy_spec,
            capacity_bytes=kv_bytes,
            costs=cost_model,
            fill={"bytes_per_token": bytes_per_token, "tokens_per_page": cfg.tokens_per_page},
        )
        if policy.contiguous:
            raise ValueError(
                f"the {layout} layout shares one paged pool; {policy_spec!r} is contiguous "
                "(try page-pool, kvcached's elastic page pool, or paged)"
            )
        self.shared = _SharedPool(policy)
        # the most any one tenant could hold: all the KV memory, plus every other tenant's weights
        # asleep
        budget = kv_bytes + (sum(self.split.weight_bytes) if layout == "sleep" else 0)
        kv_class = functools.partial(SharedKV, shared=self.shared)
        for i, (trace, m) in enumerate(zip(traces, loaded)):
            setup = build_serving(
                trace,
                policy_spec,
                model=m,
                config=cfg.replace(kv_capacity_bytes=kv_bytes),
                policy=policy,
                kv_class=kv_class,
                kv_budget_bytes=budget,
                **common,
            )
            self.setups.append(setup)
            if layout == "sleep":
                gate = _SleepGate(
                    self.env,
                    self.shared,
                    setup.kv,
                    self.split.weight_bytes[i],
                    cost_model.h2d_ns(self.split.weight_bytes[i]) * 1e-9,
                    sleep_after_s,
                )
                setup.server.gate = gate
                self.gates[i] = gate
        self._share_compute()

    def _share_compute(self) -> None:
        for setup in self.setups:
            setup.server.gpu = self.gpu

    def gpu_used_bytes(self) -> int:
        """Bytes the tenants hold on the GPU now: KV pools' reserved bytes plus every awake
        tenant's weights and every tenant's activation reserve and workspace."""
        fixed = sum(
            f - (w if g is not None and g.asleep else 0)
            for f, w, g in zip(self.split.fixed_bytes, self.split.weight_bytes, self.gates)
        )
        if self.shared is not None:
            return fixed + self.shared.policy.reserved_bytes
        return fixed + sum(s.policy.reserved_bytes for s in self.setups)

    def run(
        self,
        *,
        tenant_names: list[str] | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> list[SimResult]:
        """Serve every tenant's requests (until all are done, or the config's ``horizon_s``); one
        ``SimResult`` per tenant, its summary row with the ``tenant`` columns.

        ``progress`` is called with the simulated time (s) about 200 times over the tenants'
        arrivals (``sim.replay.progress.time_bar``'s callback), from a process of its own that reads
        the clock and touches nothing else, so the results are the same with it or without."""
        wall0 = time.perf_counter()
        env = self.env
        if progress is not None:
            env.process(_report_time(env, progress, self.arrivals_s / 200))
        engines = [s.server.start() for s in self.setups]
        done = env.all_of(engines)
        horizon_s = self.setups[0].cfg.horizon_s
        env.run(until=done if horizon_s is None else env.any_of([done, env.timeout(horizon_s)]))
        wall_s = time.perf_counter() - wall0
        names = tenant_names or [f"t{i}" for i in range(len(self.setups))]
        results = []
        end_s = env.now
        gpu_busy_s = sum(s.server.busy_s for s in self.setups)
        for name, setup, gate in zip(names, self.setups, self.gates):
            setup.server.finish()
            results.append(
                serving_result(
                    setup,
                    end_s=end_s,
                    wall_s=wall_s,
                    extra={
                        "tenant": name,
                        "tenant_layout": self.layout,
                        "tenant_compute": self.compute,
                        "num_tenants": len(self.setups),
                        # steps of all tenants over the run: above 1 only when compute is
                        # independent
                        "gpu_busy_share": gpu_busy_s / end_s if end_s > 0 else 0.0,
                        "gpu_kv_bytes": self.split.kv_bytes,
                        "n_sleeps": gate.num_sleeps if gate else 0,
                        "n_wakes": gate.num_wakes if gate else 0,
                        "wake_s": gate.wake_s if gate else 0.0,
                        # this tenant's own prefix cache (held or evictable blocks): at the end and
                        # at peak
                        "prefix_cached_bytes": setup.kv.cached_bytes(setup.kv.cached_tokens),
                        "prefix_peak_cached_bytes": setup.kv.cached_bytes(
                            setup.kv.peak_cached_tokens
                        ),
                    },
                )
            )
        return results


def _report_time(env: simpy.Environment, progress: Callable[[float], None], every_s: float):
    """A simpy process: ``progress(env.now)`` every ``every_s`` simulated seconds (until the run
    stops)."""
    every_s = max(every_s, 1e-3)
    while True:
        yield env.timeout(every_s)
        progress(env.now)


def colocate(
    traces: list[RequestTrace],
    policy_spec: str,
    *,
    tenant_names: list[str] | None = None,
    progress: Callable[[float], None] | None = None,
    **kwargs: Any,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Build and run a ``Colocation``: ``(summary, timeseries, requests)`` tables, one block per
    tenant (a ``tenant`` column in each), as ``sim.serving.simulate.simulate_many`` returns them.
    ``progress``: see ``Colocation.run``."""
    results = Colocation(traces, policy_spec, **kwargs).run(
        tenant_names=tenant_names, progress=progress
    )
    names = [r.summary["tenant"] for r in results]
    for name, r in zip(names, results):
        r.timeseries.insert(0, "tenant", name)
        r.requests.insert(0, "tenant", name)
    return (
        summary_frame([r.summary for r in results]),
        pd.concat([r.timeseries for r in results], ignore_index=True),
        pd.concat([r.requests for r in results], ignore_index=True),
    )


@dataclass
class LayoutComparison:
    """The same tenants under each memory layout (``colocate_layouts``): the tables of every
    run, one block per (layout, tenant), with a ``tenant_layout`` column in each."""

    summary: pd.DataFrame
    timeseries: pd.DataFrame
    requests: pd.DataFrame

    def served(self) -> pd.DataFrame:
        """One row per layout over all tenants' requests: ``n_finished`` of ``n_requests``, the
        TTFT of the finished ones (``ttft_p50_s``, ``ttft_p99_s``, ``ttft_mean_s``) and
        ``gpu_busy_share`` (above 1 only when compute is independent: steps overlap)."""
        busy = self.summary.groupby("tenant_layout", sort=False)["gpu_busy_share"].first()
        rows = []
        for layout, rq in self.requests.groupby("tenant_layout", sort=False):
            finished = rq[rq["status"] == "finished"]
            quantiles = latency_percentiles(finished)
            rows.append(
                {
                    "tenant_layout": layout,
                    "n_finished": len(finished),
                    "n_requests": len(rq),
                    "ttft_p50_s": quantiles["ttft_p50_s"],
                    "ttft_p99_s": quantiles["ttft_p99_s"],
                    "ttft_mean_s": float(finished["ttft_s"].mean()),
                    "gpu_busy_share": float(busy[layout]),
                }
            )
        return pd.DataFrame(rows)


def colocate_layouts(
    traces: list[RequestTrace],
    policy_spec: str,
    *,
    layouts: tuple[str, ...] | list[str] = LAYOUTS,
    tenant_names: list[str] | None = None,
    progress: bool = False,
    **kwargs: Any,
) -> LayoutComparison:
    """``colocate`` under each of ``layouts``, in order; keyword arguments are ``Colocation``'s.

    ``progress`` shows a bar per layout on stderr, in simulated seconds up to the last arrival.
    """
    from sim.replay.progress import time_bar

    arrivals_s = max(float(t.duration_s) for t in traces)
    summaries, series, tables = [], [], []
    for layout in layouts:
        with time_bar(arrivals_s, f"colocate · {layout}", enabled=progress) as advance:
            s, ts, rq = colocate(
                traces,
                policy_spec,
                tenant_names=tenant_names,
                layout=layout,
                progress=advance,
                **kwargs,
            )
        ts.insert(0, "tenant_layout", layout)
        rq.insert(0, "tenant_layout", layout)
        summaries.append(s)
        series.append(ts)
        tables.append(rq)
    return LayoutComparison(
        pd.concat(summaries, ignore_index=True),
        pd.concat(series, ignore_index=True),
        pd.concat(tables, ignore_index=True),
    )
