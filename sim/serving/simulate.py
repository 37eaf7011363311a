"""``simulate``: a request trace through a simulated server whose KV cache a policy manages.

Builds the pieces (memory plan, pools, KV manager, scheduler, step-time model), runs the
``sim.serving.server.Server`` and turns what it recorded into the report tables: one summary row in
the schema replay writes (``sim.replay.schema.SUMMARY_COLUMNS``) plus the serving columns, a
per-request table and a time series.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

import policies
from policies.base import Policy
from sim.replay.costs import CostModel, costed_page_mapped_device
from sim.replay.hardware import load_gpu
from sim.serving.kv import ContiguousKV, PagedKV, VirtualKV
from sim.serving.choices import VIRTUAL
from sim.serving.kv_groups import HybridKV, plan_layout
from sim.replay.models import load_model
from sim.serving.pools import ServerPools, plan_memory
from sim.replay.costed_policy import create_policy
from sim.replay.schema import params_text, summary_frame, summary_row
from sim.serving.scheduler import Request, Scheduler
from sim.serving.config import ServerConfig
from sim.serving.server import Server
from sim.replay.serving_metrics import prefix_hit_rates, request_table, serving_summary
from sim.serving.steptime import StepTimeModel
from sim.serving.fit_range import RANGE_TABLE_COLUMNS
from traces.requests import RequestTrace

__all__ = [
    "SimResult",
    "ServingSetup",
    "build_serving",
    "serving_result",
    "simulate",
    "simulate_many",
    "check_kv_policy",
    "simulate_runs",
    "result_tables",
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_HASH_BLOCK_TOKENS",
    "PREFIX_CACHING_OFF",
]

#: ``max_model_len`` when neither the config nor the model (``max_position_embeddings``) gives one.
DEFAULT_MAX_MODEL_LEN = 8192
#: Tokens per ``hash_ids`` block when the trace does not say (Mooncake's 512).
DEFAULT_HASH_BLOCK_TOKENS = 512
#: Why a run shares no prompt blocks (``SimResult.prefix_caching_off``), in the order they are told.
PREFIX_CACHING_OFF = ("config", "virtual", "hybrid", "contiguous")


@dataclass
class SimResult:
    """One (trace, policy) simulation.

    Attributes:
        summary: one row: ``SUMMARY_COLUMNS``, the serving columns, then simulator facts.
        requests: one row per request (``sim.replay.serving_metrics.REQUEST_TABLE_COLUMNS`` plus
            labels).
        timeseries: sampled pool and server state (``TIMESERIES_COLUMNS`` plus serving columns).
        kv_groups: one row per layer group of a hybrid model
            (``sim.serving.kv_groups.GROUP_TABLE_COLUMNS``: pages, pool, and bytes held, padded and
            needed when the cache held the most); empty for a model of full attention only.
        policy: the policy object after the run.
        config: the server knobs used, with the defaults that depend on the model and trace
            resolved (``max_model_len``, ``prefix_block_tokens``, ``sample_every_s``).
        prefix_caching_off: why the run shared no prompt blocks, when it did not (None: it
            could): one of ``PREFIX_CACHING_OFF`` (the config turned it off; the virtual KV cache
            has no block table; a hybrid model's layer groups; a contiguous KV cache).
    """

    summary: dict[str, Any]
    requests: pd.DataFrame
    timeseries: pd.DataFrame
    policy: Policy
    config: ServerConfig
    kv_groups: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    prefix_caching_off: str | None = None


def _as_trace(requests: RequestTrace | pd.DataFrame) -> RequestTrace:
    if isinstance(requests, RequestTrace):
        return requests
    if isinstance(requests, pd.DataFrame):
        return RequestTrace(requests=requests, name="requests")
    raise TypeError(
        f"requests must be a RequestTrace or a request DataFrame, got {type(requests).__name__}"
    )


def _costs(costs: CostModel | str | Path | None) -> CostModel:
    if costs is None or isinstance(costs, CostModel):
        return costs if costs is not None else CostModel.load()
    return CostModel.load(costs)


def _page_bytes(policy: Policy) -> int | None:
    """Page size of a paged policy, or of the paged policy a wrapper holds."""
    size = policy.page_size_bytes  # declared on every policy; wrappers forward their base's
    return int(size) if size else None


def check_kv_policy(spec: str, policy: Policy | None = None) -> None:
    """Raise ValueError unless ``spec`` (or ``policy``, built from it) can hold a KV cache
    (``Policy.can_hold_kv``, read from the spec without building it), naming those that can."""
    able = policy.can_hold_kv if policy is not None else policies.registry.can_hold_kv(spec)
    if not able:
        raise ValueError(
            f"policy {spec!r} cannot hold a KV cache: "
            "its allocations are neither one range nor whole pages; "
            f"policies that can: {', '.join(policies.available(holds_kv=True))}"
        )


def _page_knob(policy: Policy, bytes_per_token: int) -> str:
    """What to change for a larger page: the knob that sets it (``Policy.page_size_knob``; a
    wrapper's base's), with a page of 16 tokens as the example; for errors."""
    from policies.wrapper import layers

    for layer in layers(policy):
        knob = type(layer).page_size_knob
        if layer.page_size_bytes and knob:
            where = "" if layer is policy else f" of its base {layer.spec!r}"
            return f"set {knob}{where} (e.g. {layer.name}:{knob}={16 * bytes_per_token}, 16 tokens)"
    return "it declares no knob that sets its page (Policy.page_size_knob)"


def simulate(
    requests: RequestTrace | pd.DataFrame,
    policy_spec: str,
    *,
    model: Any,
    gpu: Any,
    calibration: Any = None,
    costs: CostModel | str | Path | None = None,
    trace_name: str | None = None,
    config: ServerConfig | None = None,
    progress: Callable[[float], None] | None = None,
    **options: Any,
) -> SimResult:
    """Serve ``requests`` with ``model`` on ``gpu``, the KV cache in a ``policy_spec`` pool.

    Args:
        requests: a ``RequestTrace`` (or its request table).
        policy_spec: the policy under test, e.g. ``"paged"`` or ``"best-fit"``.
        model, gpu: preset names, JSON paths or specs (``sim.replay.models``,
            ``sim.replay.hardware``).
        calibration: step-time efficiency factors (``sim.serving.steptime``), None for the defaults.
        costs: driver cost model (or its JSON path), None for the bundled H200 figures.
        trace_name: the report's ``trace`` column (default: the trace's name).
        config: the server's settings (default: ``ServerConfig`` built from ``options``).
        progress: called with the simulated time (s) as the run advances
            (``sim.serving.server.Server``).
        **options: ``ServerConfig`` knobs (``kv_strategy``, ``preemption``, ``max_num_seqs``, ...),
            when no ``config`` is given.

    Returns:
        A ``SimResult``. Raises ValueError (or PolicyError) naming a bad option, model, GPU or
        policy, or an empty trace, before anything runs.

    Under tensor parallelism (``tensor_parallel`` > 1) one GPU is simulated: its shard of the
    weights and KV heads, its own KV pool and memory plan (every GPU's is the same), and steps
    that include the all-reduces; byte columns are per GPU, times and token counts the server's.
    """
    wall0 = time.perf_counter()
    setup = build_serving(
        requests,
        policy_spec,
        model=model,
        gpu=gpu,
        calibration=calibration,
        costs=costs,
        config=config,
        progress=progress,
        **options,
    )
    end_s = setup.server.run()
    return serving_result(
        setup, end_s=end_s, wall_s=time.perf_counter() - wall0, trace_name=trace_name
    )


@dataclass
class ServingSetup:
    """Every piece of one simulated server, built and not yet run (``build_serving``).

    A dataclass so that ``sim.serving.tenants`` can build several (one per model instance on a GPU)
    and turn each into a ``SimResult`` with the same ``serving_result``.
    """

    trace: RequestTrace
    policy_spec: str
    model: Any
    gpu: Any
    cfg: ServerConfig
    plan: Any
    policy: Policy
    pools: ServerPools
    kv: Any
    kv_layout: str
    scheduler: Scheduler
    requests: list[Request]
    server: Server
    notes: list[
        str
    ]  # what the run turned off or ignored (the row's ``kv_note``; the CLI prints each)


def build_serving(
    requests: RequestTrace | pd.DataFrame,
    policy_spec: str,
    *,
    model: Any,
    gpu: Any,
    calibration: Any = None,
    costs: CostModel | str | Path | None = None,
    config: ServerConfig | None = None,
    progress: Callable[[float], None] | None = None,
    env: Any = None,
    policy: Policy | None = None,
    kv_class: Callable[..., PagedKV] = PagedKV,
    kv_budget_bytes: int | None = None,
    **options: Any,
) -> ServingSetup:
    """``simulate``'s pieces, validated and built, not run; arguments as ``simulate``'s.

    For a GPU shared by several servers (``sim.serving.tenants``): ``env`` is the one simpy
    environment, ``policy`` a KV pool built already (shared by several servers; None builds
    ``policy_spec`` over the memory plan's KV budget), ``kv_class`` the paged KV manager to build,
    and ``kv_budget_bytes`` the KV budget that manager and the scheduler see (default: the plan's).
    """
    trace = _as_trace(requests)
    if len(trace.requests) == 0:
        raise ValueError(
            f"{trace.name}: the trace has no requests (a header only?); nothing to simulate"
        )
    if config is not None and options:
        raise ValueError(
            f"give simulator options in the config or as keywords, not both ({', '.join(options)})"
        )
    cfg = config if config is not None else ServerConfig.from_kwargs(**options)
    model, gpu = load_model(model), load_gpu(gpu)
    tp = cfg.tensor_parallel
    shard = model.shard(tp)  # what one GPU holds: every byte below is per GPU
    cost_model = _costs(costs)
    step_model = StepTimeModel(model, gpu, calibration=calibration, tensor_parallel=tp)
    bytes_per_token = shard.kv_bytes_per_token
    plan = plan_memory(
        model,
        gpu,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        workspace_bytes=cfg.workspace_bytes,
        kv_capacity_bytes=cfg.kv_capacity_bytes,
        tensor_parallel=tp,
    )
    budget_bytes = plan.kv_budget_bytes if kv_budget_bytes is None else kv_budget_bytes
    shared = cfg.pool_layout == "shared"
    virtual = cfg.kv_strategy == VIRTUAL
    cfg.check_rules()
    layout = None
    fill = {"bytes_per_token": bytes_per_token, "tokens_per_page": cfg.tokens_per_page}
    if shard.is_hybrid:  # the layout's granule is the KV policy's page
        layout = plan_layout(
            shard,
            cfg.hybrid_kv_layout,
            tokens_per_page=cfg.tokens_per_page or 16,
            budget_bytes=budget_bytes,
            max_model_len=cfg.max_model_len
            or model.max_position_embeddings
            or DEFAULT_MAX_MODEL_LEN,
        )
        fill = {"page_bytes": layout.granule_bytes}
    check_kv_policy(policy_spec, policy)
    if policy is None:
        policy = create_policy(
            policy_spec,
            capacity_bytes=plan.usable_bytes if shared else plan.kv_budget_bytes,
            costs=cost_model,
            fill=fill,
            device=costed_page_mapped_device(
                cost_model, granularity_bytes=cfg.virtual_page_bytes, limit_bytes=budget_bytes
            )
            if virtual
            else None,
        )
    cfg.check_rules(kv_policy=policy)  # what the controls need of the KV pool
    pools = ServerPools(policy, plan, cfg, costs=cost_model, num_weight_tensors=model.num_layers)
    cfg = cfg.replace(
        max_model_len=cfg.max_model_len or model.max_position_embeddings or DEFAULT_MAX_MODEL_LEN,
        prefix_block_tokens=cfg.prefix_block_tokens
        or int(trace.meta.get("hash_block_tokens", DEFAULT_HASH_BLOCK_TOKENS)),
        sample_every_s=cfg.sample_every_s or max(trace.duration_s / 2000, 1e-3),
    )
    notes = []
    if virtual:
        kv = VirtualKV(
            pools.kv,
            cfg,
            bytes_per_token=bytes_per_token,
            budget_bytes=budget_bytes,
            num_kv_tensors=2 * model.num_layers,
        )
        kv_layout = VIRTUAL
        notes.append(
            "kv_strategy=virtual maps KV pages straight onto the device: "
            f"policy {policy_spec!r} holds no KV"
        )
        if cfg.prefix_caching:
            notes.append(
                "prefix caching off: kv_strategy=virtual has no block table to share prompt blocks "
                "by"
            )
    elif layout is not None:
        if policy.contiguous or _page_bytes(policy) != layout.granule_bytes:
            raise ValueError(
                f"{model.name} keeps KV in layer groups "
                f"({', '.join(p.name for p in layout.groups)}): "
                f"it needs a paged policy whose page is the layout's {layout.granule_bytes:,} B "
                f"(leave {type(policy).page_size_knob or 'its page size'} unset), "
                f"not {policy_spec!r}"
            )
        kv = HybridKV(
            pools.kv, cfg, layout=layout, bytes_per_token=bytes_per_token, budget_bytes=budget_bytes
        )
        kv_layout = "paged"
    elif policy.contiguous:
        kv = ContiguousKV(pools.kv, cfg, bytes_per_token=bytes_per_token, budget_bytes=budget_bytes)
        kv_layout = cfg.kv_strategy
    else:
        page_bytes = _page_bytes(policy)
        if page_bytes is None:
            raise ValueError(
                f"policy {policy_spec!r} places its allocations in pieces "
                "but declares no page size (Policy.page_size_bytes): "
                "a KV cache cannot be laid out in it; it should declare can_hold_kv = False. "
                f"Policies that can: {', '.join(policies.available(holds_kv=True))}"
            )
        if page_bytes < bytes_per_token:
            raise ValueError(
                f"policy {policy_spec!r}: its page "
                f"({page_bytes:,} B) must hold at least one token's KV "
                f"({bytes_per_token:,} B for {model.name}): {_page_knob(policy, bytes_per_token)}"
            )
        kv = kv_class(
            pools.kv,
            cfg,
            bytes_per_token=bytes_per_token,
            budget_bytes=budget_bytes,
            tokens_per_page=page_bytes // bytes_per_token,
            page_bytes=page_bytes,
            block_recompute_s=_block_recompute_s(step_model, cfg.prefix_block_tokens),
        )
        kv_layout = "paged"
    scheduler = Scheduler(kv, cfg)
    reqs = _build_requests(trace, kv, cfg.max_model_len)
    server = Server(reqs, scheduler, pools, step_model, shard, cfg, progress=progress, env=env)
    return ServingSetup(
        trace,
        policy_spec,
        model,
        gpu,
        cfg,
        plan,
        policy,
        pools,
        kv,
        kv_layout,
        scheduler,
        reqs,
        server,
        notes,
    )


def serving_result(
    setup: ServingSetup,
    *,
    end_s: float,
    wall_s: float,
    trace_name: str | None = None,
    extra: dict[str, Any] | None = None,
) -> SimResult:
    """The report of a server that has run until ``end_s``: its summary row (with ``extra``
    columns appended), request table and time series."""
    trace, model, gpu, cfg, policy = setup.trace, setup.model, setup.gpu, setup.cfg, setup.policy
    pools, kv, scheduler, server = setup.pools, setup.kv, setup.scheduler, setup.server
    policy_spec, reqs, tp = setup.policy_spec, setup.requests, cfg.tensor_parallel
    virtual, notes = setup.kv_layout == VIRTUAL, setup.notes
    name = trace_name or trace.name
    table = request_table(reqs)
    serving = serving_summary(
        table,
        duration_s=end_s,
        num_preemptions=scheduler.num_preemptions,
        kv_token_util=server.kv_token_util,
        kv_token_util_pressure=server.kv_token_util_pressure,
        kv_pressure_s=server.kv_pressure_s,
        busy_s=server.busy_s,
        slo_ttft_s=cfg.slo_ttft_s,
        slo_tpot_s=cfg.slo_tpot_s,
        slo_e2e_s=cfg.slo_e2e_s,
    )
    # the spec as the user chose it, normalised as replay writes it (the knobs filled in from
    # the model are the params column's)
    spec = policies.create(policy_spec).spec
    row = summary_row(
        trace=name,
        policy=spec,
        backend="sim",
        params=params_text(policy.get_params()),
        capacity_bytes=policy.capacity_bytes,
        monitor=server.monitor,
        alloc_ns=_int64_array(pools.kv.alloc_ns),
        free_ns=_int64_array(pools.kv.free_ns),
        wall_s=wall_s,
        device_calls=policy.device.call_stats(),
        **serving,
        **{
            "model": model.name,
            "gpu": gpu.name,
            "kv_strategy": setup.kv_layout,
            "pool_layout": cfg.pool_layout,
            "preemption": cfg.preemption,
            "kv_budget_bytes": kv.budget_bytes,
            "tensor_parallel": tp,
            "max_model_len": cfg.max_model_len,
            "prefix_caching": bool(kv.paged and kv.prefix_caching),
            "prefix_eviction": cfg.prefix_eviction,
            "prefix_block_tokens": cfg.prefix_block_tokens,
            "kv_page_bytes": kv.page_bytes if (kv.paged or virtual) else 0,
            "map_overlap": cfg.map_overlap if virtual else None,
            "n_reused_pages": kv.num_reused_pages if virtual else 0,
            "kv_driver_s": server.kv_driver_s,
            "kv_driver_step_s": server.kv_driver_step_s,
            "kv_note": "; ".join(
                notes
            ),  # what the run turned off or ignored; the CLI prints each note
            **prefix_hit_rates(
                lookup_tokens=kv.prefix_lookup_tokens,
                hit_tokens=kv.prefix_hit_tokens,
                first_lookup_tokens=kv.prefix_first_lookup_tokens,
                first_hit_tokens=kv.prefix_first_hit_tokens,
            ),
            "prefix_saved_bytes": kv.prefix_saved_bytes,
            "n_prefix_evictions": kv.num_evictions,
            "n_kv_reallocs": kv.num_reallocs,
            "kv_copied_bytes": kv.copied_bytes,
            "n_swap_outs": scheduler.num_swap_outs,
            "n_activation_failures": server.num_activation_failures,
            "aux_peak_reserved_bytes": pools.aux_peak_reserved_bytes(),
            "n_steps": server.num_steps,
            **_range_fields(server.step_model),
            "sim_time_s": end_s,
            "busy_s": server.busy_s,
            "alloc_stall_s": server.alloc_stall_s,
            **_control_fields(server, policy),
            **_group_fields(kv),
            **(extra or {}),
        },
    )
    table.insert(0, "policy", spec)
    table.insert(0, "trace", name)
    groups = pd.DataFrame(kv.group_rows()) if isinstance(kv, HybridKV) else pd.DataFrame()
    if len(groups):
        groups.insert(0, "policy", spec)
        groups.insert(0, "trace", name)
    return SimResult(
        summary=row,
        requests=table,
        timeseries=_timeseries(server, name, spec),
        policy=policy,
        config=cfg,
        kv_groups=groups,
        prefix_caching_off=_prefix_caching_off(cfg, kv, virtual),
    )


def _int64_array(samples_ns: array) -> np.ndarray:
    """A pool's latency samples (``TimedPool.alloc_ns``: a C int64 array) as a numpy array of
    its own: a copy of the buffer, not a view (a view would stop the pool's array from growing
    while it lives)."""
    return np.frombuffer(samples_ns, np.int64).copy()


def _prefix_caching_off(cfg: ServerConfig, kv: Any, virtual: bool) -> str | None:
    """``SimResult.prefix_caching_off``: None when the KV manager shares prompt blocks."""
    if kv.paged and kv.prefix_caching:
        return None
    if not cfg.prefix_caching:
        return "config"
    if virtual:
        return "virtual"
    return "hybrid" if isinstance(kv, HybridKV) else "contiguous"


def _group_fields(kv: Any) -> dict[str, Any]:
    """A hybrid model's layout and, when its cache held the most, the padding and all waste
    (bytes held beyond those the tokens in each window and the states need); nothing otherwise."""
    if not isinstance(kv, HybridKV):
        return {}
    rows = kv.group_rows()
    held = sum(r["peak_held_bytes"] for r in rows)
    return {
        "hybrid_kv_layout": kv.layout.layout,
        "kv_peak_held_bytes": held,
        "kv_peak_padding_bytes": sum(r["peak_padding_bytes"] for r in rows),
        "kv_peak_waste_bytes": held - sum(r["peak_data_bytes"] for r in rows),
    }


#: The summary's columns of a calibrated run (``_range_fields``; docs/_hooks/columns.yml).
CALIBRATION_COLUMNS = ["n_priced_steps", *RANGE_TABLE_COLUMNS, "range_warning"]


def _range_fields(step_model: StepTimeModel) -> dict[str, Any]:
    """``CALIBRATION_COLUMNS``: the steps a calibration priced (``n_priced_steps``: a few more
    than ``n_steps``, the fast path's quiet stretches priced ahead; ``sim.serving.fit_range``);
    how many of them lay past the step features its fit saw, ``priced_past_range_frac``; how
    far, the largest KV tokens priced over the fit's (``extrapolation_ratio``); the share under its
    smallest (``priced_below_range_frac``; None: minima not recorded); all None when not checked
    (no fitted range); and the terminal's warning (``range_warning``, "" when none)."""
    count = getattr(step_model, "range_count", None)  # a recorded-steps replay has none
    if count is None:
        values: tuple[Any, ...] = (None, None, None, None, "")
    else:
        below = count.below_frac if count.fitted.min else None
        values = (
            count.num_steps,
            count.frac,
            count.extrapolation_ratio,
            below,
            count.warning(),
        )
    return dict(zip(CALIBRATION_COLUMNS, values))


def _block_recompute_s(step_model: StepTimeModel, block_tokens: int):
    """Seconds of prefill compute that rebuilding the prompt block at position ``i`` takes (its
    tokens attend to the ``i`` blocks before them): the ``cost`` eviction order's weight."""
    cache: dict[int, float] = {}

    def cost(i: int) -> float:
        if i not in cache:
            cache[i] = step_model.step_cost(block_tokens, 0, 0, i * block_tokens, 1).compute_s
        return cache[i]

    return cost


def _control_fields(server: Server, policy: Policy) -> dict[str, Any]:
    """What the pool controls did: freeze, pre-growth against hot-path grows, compaction."""
    s = policy.stats()
    comp = policy.compaction_stats()  # empty for a pool that never compacts
    return {
        "n_frozen_failures": s.num_frozen_failures,
        "frozen_at_s": server.frozen_at_s,  # None: never frozen
        "n_hot_grows": s.num_grows - server.initial_grows - server.num_pregrows,
        "n_pregrows": server.num_pregrows,
        "pregrow_bytes": server.pregrow_bytes,
        "pregrow_driver_s": server.pregrow_driver_s,
        "kv_idle_bytes_mean": server.idle_byte_s / server.busy_s if server.busy_s > 0 else 0.0,
        "n_compactions": comp.get("num_compactions", 0),
        "compaction_moved_bytes": comp.get("moved_bytes", 0),
        "compaction_s": server.compaction_s,
        "n_compaction_rescues": comp.get("num_rescues", 0),
    }


def _build_requests(trace: RequestTrace, kv: Any, max_model_len: int) -> list[Request]:
    df = trace.requests
    ids = df["request_id"].tolist()
    arrivals = df["arrival_s"].tolist()
    prompts = df["prompt_tokens"].tolist()
    outputs = df["output_tokens"].tolist()
    hashes = df["hash_ids"].tolist() if "hash_ids" in df else [()] * len(df)
    new_handle = kv.new_handle
    out = []
    # the collector paused meanwhile: two objects and two lists a request, none garbage, would
    # set off a young collection every few hundred requests (a hundred for the Azure hour) that
    # frees nothing
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for rid, t, p, o, h in zip(ids, arrivals, prompts, outputs, hashes):
            o = min(o, max_model_len - p) if p < max_model_len else o  # vLLM stops at max_model_len
            hash_ids = tuple(h) if h is not None and len(h) else ()
            out.append(Request(rid, t, p, o, new_handle(p, o, hash_ids), num_tokens=p))
    finally:
        if was_enabled:
            gc.enable()
    return out


def _timeseries(server: Server, trace_name: str, policy_spec: str) -> pd.DataFrame:
    pool = server.monitor.timeseries()
    serving = pd.DataFrame(server.rows, columns=Server.ROW_COLUMNS)
    assert len(pool) == len(serving), "pool and server samples are taken together"
    ts = pd.concat([pool, serving.drop(columns=["event", "time_us"])], axis=1)
    ts.insert(0, "backend", "sim")
    ts.insert(0, "policy", policy_spec)
    ts.insert(0, "trace", trace_name)
    return ts


def simulate_many(
    requests: RequestTrace | pd.DataFrame,
    policy_specs: Iterable[str] | None = None,
    *,
    model: Any,
    gpu: Any,
    progress: bool = False,
    **kwargs: Any,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``simulate`` under each spec (None: every registered policy that can hold KV,
    ``policies.available(holds_kv=True)``): ``(summary, timeseries, requests)`` tables, one block
    per policy.

    Keyword arguments are ``simulate``'s; ``sim.replay.schema.write_results(out, summary,
    timeseries, extra_tables={"requests": requests})`` writes them. ``progress`` shows a bar per
    policy on stderr (when it is a terminal) that advances with simulated time up to the last
    arrival.
    """
    return result_tables(
        simulate_runs(requests, policy_specs, model=model, gpu=gpu, progress=progress, **kwargs)
    )


def simulate_runs(
    requests: RequestTrace | pd.DataFrame,
    policy_specs: Iterable[str] | None = None,
    *,
    model: Any,
    gpu: Any,
    progress: bool = False,
    **kwargs: Any,
) -> list[SimResult]:
    """``simulate`` under each spec, in order (``simulate_many``'s runs, their ``SimResult`` whole:
    a hybrid model's ``kv_groups`` too); None: every registered policy that can hold KV."""
    trace = _as_trace(requests)
    results = []
    for spec in policies.available(holds_kv=True) if policy_specs is None else policy_specs:
        with _time_bar(trace, spec, progress) as advance:
            results.append(simulate(trace, spec, model=model, gpu=gpu, progress=advance, **kwargs))
    return results


def result_tables(results: list[SimResult]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(summary, timeseries, requests)`` of several runs, one block per run."""
    return (
        summary_frame([r.summary for r in results]),
        pd.concat([r.timeseries for r in results], ignore_index=True),
        pd.concat([r.requests for r in results], ignore_index=True),
    )


def _time_bar(trace: RequestTrace, spec: str, show: bool):
    """A progress bar in simulated seconds over the trace's arrivals, and the callback that moves
    it."""
    from sim.replay.progress import time_bar

    return time_bar(float(trace.duration_s), f"{trace.name} · {spec}", enabled=show)
