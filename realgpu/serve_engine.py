"""One policy's real serving run, in a process of its own: ``python -m realgpu.serve_engine
WORK_DIR``.

``WORK_DIR`` holds ``job.json`` (spec, trace name, ``realgpu.serve.ServeSettings``) and ``plan.csv``
(``realgpu.serve.plan_requests``); the run writes ``steps.csv``, ``requests.csv``,
``timeseries.parquet`` (PyTorch's own allocator), ``result.json`` (the memory columns and what the
parent needs to assemble the summary) and, when asked, ``snapshot.pickle.gz`` (and with
``snapshot_until="both"`` the whole run's ``snapshot_run.pickle.gz``), each with the device memory
the process held outside PyTorch's allocator beside it (``traces.engine_memory``); on failure
``error.txt`` with one line. Its own process because a pluggable allocator must be installed before
the process's first CUDA allocation, and so that each policy starts from an empty device.

The engine is transformers' ``ContinuousBatchingManager`` (``TransformersEngine``). Its step profile
is recorded by wrapping the manager's loop body (one pass: schedule, forward, sample, update; a
pass that found nothing to schedule and waited is not a step) for the time (wall, and the engine
thread's CPU time: ``cpu_s``), and its scheduler's ``schedule_batch`` for the batch composition.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import pickle
import queue
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from realgpu.serve import (
    PYTORCH,
    Completion,
    ServeSettings,
    StepRow,
    drive,
    served_table,
    step_table,
)

#: How long to wait for the last requests after the last arrival before calling the run stuck.
GIVE_UP_AFTER_S = 1800.0
#: History entries kept for ``--snapshot`` (PyTorch's ring buffer; a start-up needs far fewer).
SNAPSHOT_MAX_ENTRIES = 200_000
#: ... and when the serving run is recorded too (``--snapshot-until end|both``): a few hundred
#: entries a step.
SNAPSHOT_RUN_MAX_ENTRIES = 2_000_000


def model_config(spec: Any, *, max_len_tokens: int | None):
    """A ``LlamaConfig`` of ``spec``'s shape (``sim.replay.models.ModelSpec``): a dense
    Llama-architecture decoder (Llama, Mistral and Qwen presets keep their shapes; Qwen's qkv biases
    are left out). Raises ValueError for a shape that architecture cannot take (plain MLP, hybrid
    layers)."""
    from transformers import LlamaConfig

    if not spec.gated_mlp:
        raise ValueError(
            f"model {spec.name!r} has a plain (non-gated) MLP: "
            "random weights are built as a Llama-architecture model; pass --checkpoint DIR for it"
        )
    if spec.layer_groups is not None:
        raise ValueError(
            f"model {spec.name!r} has hybrid layer groups (sliding window or Mamba layers): "
            "random weights are built as a dense Llama-architecture model; "
            "pass --checkpoint DIR for it"
        )
    return LlamaConfig(
        num_hidden_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tied_embeddings,
        max_position_embeddings=max_len_tokens or spec.max_position_embeddings or 8192,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )


_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}


def build_model(settings: ServeSettings, device: Any):
    """The model on ``device``: a checkpoint, or random weights of the preset's shape, made there
    directly in the preset's dtype (no host copy, no download)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if settings.checkpoint:
        return AutoModelForCausalLM.from_pretrained(
            settings.checkpoint,
            dtype="auto",
            device_map={"": device},
            attn_implementation=settings.attn_implementation,
        ).eval()
    from sim.replay.models import load_model

    spec = load_model(settings.model)
    cfg = model_config(spec, max_len_tokens=settings.max_len_tokens)
    cfg._attn_implementation = settings.attn_implementation
    dtype = getattr(torch, _DTYPES.get(spec.dtype, "bfloat16"))
    torch.manual_seed(settings.seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval()


class TransformersEngine:
    """transformers' continuous batching behind ``realgpu.serve.Engine``, recording every step.

    ``steps`` holds a ``StepRow`` per step; ``num_preemptions`` counts requests the engine took off
    the GPU to make room (its offloading manager: recomputed later, or restored from host memory).
    """

    def __init__(self, model: Any, settings: ServeSettings, *, on_step: Any = None):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model = model
        self.settings = settings
        gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=16)
        cb = ContinuousBatchingConfig(
            block_size=settings.block_tokens,
            num_blocks=settings.num_blocks,
            max_batch_tokens=settings.max_batch_tokens,
            max_requests_per_batch=settings.max_num_seqs,
            max_memory_percent=settings.max_memory_percent,
            use_cuda_graph=settings.cuda_graphs,
            use_async_batching=False,
            scheduler_type="fifo",
            seed=settings.seed,
        )
        self.manager = model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=cb
        )
        self.steps: list[StepRow] = []
        self.num_preemptions = 0
        self._on_step = on_step
        self._batch: list | None = None
        self._scheduler = None
        self._instrument()

    def _instrument(self) -> None:
        manager, body = self.manager, self.manager._generation_loop_body
        clock, cpu_clock = time.perf_counter, time.thread_time  # the loop runs in one thread

        def timed_body(batch_processor, bootstrapping):
            if batch_processor.scheduler is not self._scheduler:
                self._watch(batch_processor)
            self._batch = None
            c, t = cpu_clock(), clock()
            more = body(batch_processor, bootstrapping)
            if self._batch:
                wall = clock() - t
                self.steps.append(StepRow(t, wall, *self._batch, cpu_s=cpu_clock() - c))
                if self._on_step is not None:
                    self._on_step(len(self.steps))
            return more

        manager._generation_loop_body = timed_body  # the loop calls self._generation_loop_body

    def _watch(self, batch_processor) -> None:
        """Wrap the scheduler's ``schedule_batch`` (the batch's composition, before positions
        advance) and the offloading manager's ``offload_requests`` (preemptions)."""
        scheduler = self._scheduler = batch_processor.scheduler
        schedule = scheduler.schedule_batch

        def schedule_batch(token_budget, cache_budget):
            out = schedule(token_budget, cache_budget)
            batch = out[0]
            if not batch:
                self._batch = None
                return out
            counts = [0, 0, 0, 0, 0]
            for fs in batch:
                state, q = fs.state, fs.query_length
                context = state.position_offset + q  # KV read: cached (and prefix-matched) plus new
                if state.generated_len() > 0:  # has produced a token before: a decode
                    counts[3] += 1
                    counts[4] += context
                else:
                    counts[0] += 1
                    counts[1] += q
                    counts[2] += context
            self._batch = counts
            return out

        scheduler.schedule_batch = schedule_batch
        offloading = batch_processor.offloading_manager
        offload = offloading.offload_requests

        def offload_requests(*args, **kwargs):
            n = offload(*args, **kwargs)
            self.num_preemptions += int(n or 0)
            return n

        offloading.offload_requests = offload_requests

    # --- realgpu.serve.Engine ---
    def start(self, timeout_s: float = 600.0) -> None:
        """Start the engine's thread and wait for its KV cache (made in that thread), so that no
        request's latency includes the cache's allocation. Without ``engine_footprint_check`` the
        engine's own footprint estimate cannot refuse the size (``footprint_check_off``)."""
        check = (
            contextlib.nullcontext()
            if self.settings.engine_footprint_check
            else footprint_check_off()
        )
        with check:
            self.manager.start()
            deadline = time.perf_counter() + timeout_s
            while self.manager.batch_processor is None:
                running = self.manager.is_running()
                if not running or time.perf_counter() > deadline:
                    error = self.manager.background_thread_status.fatal_error or (
                        f"no KV cache after {timeout_s:.0f} s"
                        if running
                        else "its thread ended before making the KV cache (its traceback is above)"
                    )
                    raise RuntimeError(f"the engine did not start: {error}")
                time.sleep(0.01)

    def submit(self, request_id: int, prompt_ids: list[int], output_tokens: int) -> None:
        self.manager.add_request(
            prompt_ids,
            request_id=str(request_id),
            max_new_tokens=output_tokens,
            record_timestamps=True,
            eos_token_id=-1,
        )

    def results(self, timeout_s: float) -> list[Completion]:
        out, wait = [], timeout_s
        q = self.manager.output_router.output_queue
        while True:
            try:
                r = q.get(block=wait > 0, timeout=wait if wait > 0 else None)
            except queue.Empty:
                return out
            wait = 0.0
            if not r.is_finished():
                continue
            stamps = r.timestamps or []
            out.append(
                Completion(
                    int(r.request_id),
                    stamps[0] if stamps else math.nan,
                    r.lifespan[1] if r.lifespan[1] > 0 else math.nan,
                    len(r.generated_tokens),
                    str(r.error) if r.error is not None else "",
                )
            )

    def alive(self) -> bool:
        return self.manager.is_running()

    def stop(self) -> None:
        self.manager.stop(block=True, timeout=60)

    # --- what the report needs ---
    def cache(self):
        bp = self.manager.batch_processor
        return bp.cache if bp is not None else None

    def kv_info(self) -> dict[str, Any]:
        cache = self.cache()
        if cache is None:
            return {"kv_blocks": 0, "kv_bytes": 0, "kv_capacity_tokens": 0}
        tensors = list(cache.key_cache) + list(cache.value_cache)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return {
            "kv_blocks": int(cache.num_blocks),
            "kv_block_tokens": int(cache.block_size),
            "kv_capacity_tokens": int(cache.num_blocks * cache.block_size),
            "kv_bytes": int(nbytes),
            "kv_num_tensors": len(tensors),
            "kv_tensor_bytes": int(tensors[0].numel() * tensors[0].element_size()),
            "kv_tensor_shape": list(tensors[0].shape),
            "max_batch_tokens_engine": int(cache.max_batch_tokens),
        }


@contextlib.contextmanager
def footprint_check_off():
    """While open, transformers' ``PagedAttentionMemoryHandler._check_footprint`` (5.17: its
    estimate of the cache and activation peaks against ``max_memory_percent`` of free memory,
    raising MemoryError before anything is allocated) keeps its sanity check on the sizes but lets a
    footprint beyond the estimate through, and says so on stdout; restored on exit."""
    from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

    original = PagedAttentionMemoryHandler._check_footprint

    def check_sizes_only(self, max_batch_tokens: int, num_blocks: int) -> tuple[int, int]:
        footprint = self.compute_memory_footprint(max_batch_tokens, num_blocks)
        if footprint > self.available_memory:
            print(
                "serve: footprint check off: "
                f"transformers estimates {footprint:,} B for {num_blocks:,} blocks, "
                f"more than the {self.available_memory:,} B it allows; starting anyway",
                flush=True,
            )
        if max_batch_tokens <= 0 or num_blocks <= 0:
            raise ValueError(
                f"Invalid values: max_batch_tokens = {max_batch_tokens}, num_blocks = {num_blocks}"
            )
        return max_batch_tokens, num_blocks

    PagedAttentionMemoryHandler._check_footprint = check_sizes_only
    try:
        yield
    finally:
        PagedAttentionMemoryHandler._check_footprint = original


def warm_up(
    engine: TransformersEngine, settings: ServeSettings, *, vocab_size: int, max_len_tokens: int
) -> None:
    """Serve, unrecorded, one step's worth of prefill (``max_batch_tokens`` in prompts of at most
    the longest sequence) and then a decode of as many sequences as fit, so kernels are loaded and
    the largest activations allocated before the clock starts."""
    rng = np.random.default_rng(settings.seed + 1)
    budget = settings.max_batch_tokens
    prompt = max(1, min(max_len_tokens - 4, budget))
    n_prefill = max(1, budget // prompt)
    n_decode = min(settings.max_num_seqs, 64)
    jobs = [(prompt, 4)] * n_prefill + [(16, 8)] * n_decode
    for i, (p, o) in enumerate(jobs):
        engine.manager.add_request(
            rng.integers(0, vocab_size, size=p).tolist(),
            request_id=f"warmup{i}",
            max_new_tokens=o,
            eos_token_id=-1,
        )
    got = 0
    deadline = time.perf_counter() + 600
    while got < len(jobs) and time.perf_counter() < deadline and engine.alive():
        try:
            r = engine.manager.output_router.output_queue.get(timeout=1.0)
        except queue.Empty:
            continue
        if r.is_finished():
            got += 1
            if r.error is not None:
                raise RuntimeError(f"the warm-up request {r.request_id} failed: {r.error}")
    if got < len(jobs):
        raise RuntimeError(f"the warm-up did not finish ({got} of {len(jobs)} requests)")


class TorchMemoryReadings:
    """PyTorch's caching allocator as ``sim.replay.metrics.PoolMonitor`` readings: its own counters
    (live = requested bytes, allocated, reserved) and, from ``torch.cuda.memory_snapshot()``, the
    largest free block inside its segments (for external fragmentation)."""

    def __init__(self, device: Any):
        import torch

        self.torch, self.device = torch, device
        raw = torch._C._cuda_memoryStats
        self._stats = lambda: raw(device.index or 0)

    def sample(self) -> tuple:
        from policies.base import frag_ext

        s = self._stats()
        live = s["requested_bytes"]["all"]["current"]
        allocated = s["allocated_bytes"]["all"]["current"]
        reserved = s["reserved_bytes"]["all"]["current"]
        segments = [
            seg
            for seg in self.torch.cuda.memory_snapshot()
            if seg.get("device", 0) == (self.device.index or 0)
        ]
        largest = max(
            (b["size"] for seg in segments for b in seg["blocks"] if b["state"] == "inactive"),
            default=0,
        )
        return (
            live,
            allocated,
            reserved,
            largest,
            frag_ext(reserved - allocated, largest),
            len(segments),
        )

    def totals(self) -> dict[str, Any]:
        s = self.torch.cuda.memory_stats(self.device)
        return {
            "n_alloc": s.get("allocation.all.allocated", 0),
            "n_free": s.get("allocation.all.freed", 0),
            "n_failed": s.get("num_ooms", 0),
            "peak_live_bytes": s.get("requested_bytes.all.peak", 0),
            "peak_allocated_bytes": s.get("allocated_bytes.all.peak", 0),
            "peak_reserved_bytes": s.get("reserved_bytes.all.peak", 0),
            "n_grow": s.get("segment.all.allocated", 0),
            "n_shrink": s.get("segment.all.freed", 0),
            "grown_bytes": math.nan,
            "shrunk_bytes": math.nan,
        }


class HostReadings:
    """A run on the host: no allocator to read (every memory column NaN)."""

    def sample(self) -> tuple:
        return (math.nan,) * 6

    def totals(self) -> dict[str, Any]:
        return dict.fromkeys(
            (
                "n_alloc",
                "n_free",
                "n_failed",
                "peak_live_bytes",
                "peak_allocated_bytes",
                "peak_reserved_bytes",
                "n_grow",
                "n_shrink",
                "grown_bytes",
                "shrunk_bytes",
            ),
            math.nan,
        )


class NonTorchMemory:
    """The device memory this process holds outside PyTorch's allocator: ``cudaMemGetInfo``'s used
    (total - free) less ``torch.cuda.memory_reserved`` (the policy's reserved under a pluggable
    policy, ``_policy_memory_counters``). The CUDA context, cuBLAS handles, kernels' modules loaded
    as first used: a snapshot holds none of it. Device-wide, so another process on the device
    would count too (the serving machine is the engine's alone).

    ``at_startup`` reads it once start-up and warm-up are done; ``sample`` while serving (at the
    memory samples) keeps the largest reading.
    """

    def __init__(self, device: Any):
        import torch

        self.torch, self.device = torch, device
        self.total_bytes: int | None = None
        self.startup: dict[str, int] | None = None
        self.serving_max: dict[str, int] | None = None

    def read(self) -> dict[str, int]:
        free, total = self.torch.cuda.mem_get_info(self.device)
        reserved = int(self.torch.cuda.memory_reserved(self.device))
        self.total_bytes = int(total)
        return {
            "device_used_bytes": int(total - free),
            "torch_reserved_bytes": reserved,
            "non_torch_bytes": int(total - free) - reserved,
        }

    def at_startup(self) -> None:
        self.startup = self.read()

    def sample(self) -> None:
        r = self.read()
        if self.serving_max is None or r["non_torch_bytes"] > self.serving_max["non_torch_bytes"]:
            self.serving_max = r

    def fields(self) -> dict[str, Any]:
        """The sidecar's figures (``traces.engine_memory`` keys, and the readings they come
        from)."""
        out: dict[str, Any] = {
            "mem_get_info_total_bytes": self.total_bytes,
            "non_torch_how": "cudaMemGetInfo used (total - free) less torch.cuda.memory_reserved, "
            "in the engine's process",
        }
        for name, r in (("startup", self.startup), ("serving_max", self.serving_max)):
            if r is not None:
                out[f"non_torch_{name}_bytes"] = r["non_torch_bytes"]
                out[f"device_used_{name}_bytes"] = r["device_used_bytes"]
                out[f"torch_reserved_{name}_bytes"] = r["torch_reserved_bytes"]
        return out


def _allocator(spec: str, settings: ServeSettings):
    """PyTorch's own allocator (nothing to install), or ``spec`` through ``use_policy``."""
    if spec == PYTORCH:
        return contextlib.nullcontext(None)
    try:
        from realgpu.torch_allocator import use_policy
    except ImportError as exc:
        raise RuntimeError(
            f"policy {spec!r} needs realgpu.torch_allocator (a policy as PyTorch's allocator), "
            f"which this install lacks ({exc}); -p pytorch runs PyTorch's own allocator"
        ) from None
    return use_policy(
        spec, mode=settings.allocator_mode, validate=settings.validate, device=settings.device
    )


def _engine_thread_in_mempool(engine: TransformersEngine, alloc: Any, device: Any) -> None:
    """A ``MemPool`` serves the allocations of the thread that entered it; the engine allocates its
    KV cache and activations in its own thread, so that thread enters the policy's pool. PyTorch
    routes a pool for one thread at a time (the H200 refused the engine's thread: "already
    recording to mempool_id"), so this thread hands it over from ``start`` to ``stop``."""
    import torch

    loop, start, stop = engine.manager._run_generation_loop, engine.start, engine.stop

    def loop_in_pool():
        with torch.cuda.use_mem_pool(alloc.mempool, device=device):
            loop()

    def start_in_pool(*args, **kwargs):
        alloc.pause_routing()
        try:
            return start(*args, **kwargs)
        except BaseException:
            alloc.resume_routing()
            raise

    def stop_in_pool(*args, **kwargs):
        try:
            return stop(*args, **kwargs)
        finally:
            alloc.resume_routing()

    engine.manager._run_generation_loop = (
        loop_in_pool  # start() makes the thread from this attribute
    )
    engine.start, engine.stop = start_in_pool, stop_in_pool


@contextlib.contextmanager
def _policy_memory_counters(alloc: Any):
    """Under a pluggable policy PyTorch keeps no counters (``torch.cuda.memory_reserved`` raises
    "CUDAPluggableAllocator does not yet support getDeviceStats"), yet the engine reads it to size
    its KV cache: answer with the policy's own reserved bytes, what PyTorch's counter means."""
    if alloc is None or alloc.mode != "pluggable":
        yield
        return
    import torch

    original = torch.cuda.memory_reserved
    torch.cuda.memory_reserved = lambda device=None: int(alloc.pool.stats().reserved_bytes)
    try:
        yield
    finally:
        torch.cuda.memory_reserved = original


def run_job(work: Path) -> None:
    """The child's work (module docstring)."""
    import torch

    job = json.loads((work / "job.json").read_text())
    spec, trace_name = job["spec"], job["trace"]
    settings = ServeSettings(**job["settings"])
    plan = pd.read_csv(work / "plan.csv")
    if settings.on_cpu:
        if spec != PYTORCH or settings.snapshot:
            raise RuntimeError(
                "a run on the host takes -p pytorch and no --snapshot (policies hold GPU memory)"
            )
    elif not torch.cuda.is_available():
        raise RuntimeError(
            "CUDA is not available to PyTorch here (gpu serve runs the model on a GPU)"
        )
    device = torch.device("cpu") if settings.on_cpu else torch.device("cuda", settings.device)
    wall0 = time.perf_counter()
    with _allocator(spec, settings) as alloc, _policy_memory_counters(alloc):
        if not settings.on_cpu:
            torch.cuda.set_device(device)
        recording = (
            settings.snapshot
            and spec == PYTORCH
            or (settings.snapshot and settings.allocator_mode == "mempool")
        )
        if settings.snapshot and not recording:
            print(
                "serve: --snapshot records PyTorch's caching allocator, "
                "which a pluggable policy replaces: no snapshot for this policy",
                flush=True,
            )
        if recording:
            # the Python stack of each allocation only (C++ frames make a start-up snapshot tens of
            # MB)
            max_entries = (
                SNAPSHOT_MAX_ENTRIES
                if settings.snapshot_until == "startup"
                else SNAPSHOT_RUN_MAX_ENTRIES
            )
            torch.cuda.memory._record_memory_history(
                max_entries=max_entries, context="alloc", stacks="python"
            )
        model = build_model(settings, device)
        max_len = settings.max_len_tokens or int(model.config.max_position_embeddings)
        readings = (
            (HostReadings() if settings.on_cpu else TorchMemoryReadings(device))
            if alloc is None
            else None
        )
        monitor = None
        if readings is not None:
            from sim.replay.metrics import PoolMonitor

            monitor = PoolMonitor(readings=readings)
        t_ref = [time.perf_counter()]
        non_torch = None if settings.on_cpu else NonTorchMemory(device)
        serving = [False]  # warm-up steps are start-up's

        def on_step(i: int) -> None:
            if i % settings.sample_every_steps == 0:
                if monitor is not None:
                    monitor.sample(i, int((time.perf_counter() - t_ref[0]) * 1e6))
                if non_torch is not None and serving[0]:
                    non_torch.sample()

        engine = TransformersEngine(model, settings, on_step=on_step)
        if alloc is not None and alloc.mempool is not None:
            _engine_thread_in_mempool(engine, alloc, device)
        engine.start()
        vocab = int(model.config.vocab_size)
        if settings.warmup:
            warm_up(engine, settings, vocab_size=vocab, max_len_tokens=max_len)
        info = engine.kv_info()
        print(
            f"serve: KV cache {info['kv_blocks']:,} blocks of {settings.block_tokens} tokens "
            f"({info['kv_bytes'] / 2**30:,.2f} GiB); "
            f"{len(plan)} requests over {plan['arrival_s'].iloc[-1]:,.1f} s",
            flush=True,
        )
        if non_torch is not None:
            non_torch.at_startup()
        snapshot = run_snapshot = None
        if recording and settings.snapshot_until in ("startup", "both"):
            snapshot = _dump_snapshot(
                work, "snapshot.pickle.gz", stop=settings.snapshot_until == "startup"
            )
        serving[0] = True
        engine.steps.clear()
        t_ref[0] = time.perf_counter()
        if monitor is not None:
            monitor.sample(0, 0)
        t0, submit_t, done = drive(
            engine, plan, vocab_size=vocab, seed=settings.seed, give_up_s=GIVE_UP_AFTER_S
        )
        alive = engine.alive()
        print(
            f"serve: {len(done)} of {len(plan)} requests done, {len(engine.steps)} steps, "
            f"{time.perf_counter() - t0:,.1f} s after the first arrival",
            flush=True,
        )
        engine.stop()
        if not settings.on_cpu:
            torch.cuda.synchronize(device)
            non_torch.sample()  # the cache and the last step's blocks are still held
        if recording and settings.snapshot_until == "end":
            snapshot = _dump_snapshot(work, "snapshot.pickle.gz")
        elif recording and settings.snapshot_until == "both":
            run_snapshot = _dump_snapshot(work, "snapshot_run.pickle.gz")
        steps = step_table(engine.steps, t0)
        served = served_table(plan, t0, submit_t, done)
        wall_s = time.perf_counter() - wall0
        extra = {
            "engine": "transformers-cb",
            "model": settings.checkpoint or settings.model,
            "device_name": "host" if settings.on_cpu else torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "rate_plan_requests": len(plan),
            "engine_alive_at_end": alive,
            # the step profile's zero on time.perf_counter (CLOCK_MONOTONIC, one clock for every
            # process of the machine): lines other logs up with the steps (benchmarks/gc_log)
            "t0_perf_counter_s": t0,
            "max_len_tokens": max_len,
            "block_tokens": settings.block_tokens,
            "max_batch_tokens": settings.max_batch_tokens,
            "max_num_seqs": settings.max_num_seqs,
            "cuda_graphs": settings.cuda_graphs,
            "attn_implementation": settings.attn_implementation,
            **{k: v for k, v in info.items() if k != "kv_capacity_tokens"},
        }
        if non_torch is not None:
            extra.update(
                {
                    k: v
                    for k, v in non_torch.fields().items()
                    if k.startswith("non_torch_") and k != "non_torch_how"
                }
            )
        if snapshot or run_snapshot:
            _write_sidecars(
                work,
                [
                    (snapshot, "startup" if settings.snapshot_until != "end" else "run"),
                    (run_snapshot, "run"),
                ],
                non_torch,
                info,
                settings,
                extra,
            )
        if alloc is None:
            from sim.replay.schema import summary_row

            monitor.finish(len(engine.steps) + 1, int((time.perf_counter() - t_ref[0]) * 1e6))
            memory_row = summary_row(
                trace=trace_name,
                policy=PYTORCH,
                backend="host" if settings.on_cpu else "torch-cuda",
                params="",
                monitor=monitor,
                capacity_bytes=None if settings.on_cpu else torch.cuda.mem_get_info(device)[1],
                alloc_ns=[],
                free_ns=[],
                wall_s=wall_s,
                device_calls=None,
            )
            ts = monitor.timeseries()
            for col, value in (
                ("backend", memory_row["backend"]),
                ("policy", PYTORCH),
                ("trace", trace_name),
            ):
                ts.insert(0, col, value)
            ts.to_parquet(work / "timeseries.parquet", index=False)
        preempted = engine.num_preemptions
        del engine, model
    if alloc is not None:  # closed now: its row fixed after the model's memory went back
        memory_row = alloc.summary_row(trace=trace_name)
    steps.to_csv(work / "steps.csv", index=False)
    served.to_csv(work / "requests.csv", index=False)
    result = {
        "memory_row": memory_row,
        "num_steps": len(steps),
        "kv_capacity_tokens": info["kv_capacity_tokens"],
        "num_preemptions": preempted,
        "extra": extra,
        "snapshot": snapshot,
        "run_snapshot": run_snapshot,
    }
    (work / "result.json").write_text(json.dumps(result, default=_jsonable))


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    return str(v)


#: Allocations at least this large keep their stack frames in a written snapshot (weights' and the
#: KV cache's, which is how a reader tells them apart); smaller ones drop theirs, to keep the file
#: small.
SNAPSHOT_FRAMES_MIN_BYTES = 16 << 20


def _write_sidecars(
    work: Path,
    snapshots: list[tuple[str | None, str]],
    non_torch: NonTorchMemory | None,
    info: dict[str, Any],
    settings: ServeSettings,
    extra: dict[str, Any],
) -> None:
    """Beside each written snapshot, its JSON (``traces.engine_memory``): the device memory outside
    PyTorch's allocator in this process, the engine's KV figures, torch's peaks over the run."""
    import torch

    from traces.engine_memory import write_engine_memory

    stats = torch.cuda.memory_stats(settings.device)
    shape = info.get("kv_tensor_shape")
    padding = (
        int(shape[0]) // int(info["kv_block_tokens"]) - int(info["kv_blocks"])
        if shape and info.get("kv_block_tokens")
        else None
    )  # transformers: [blocks x block tokens, heads, dim]
    common = {
        **(non_torch.fields() if non_torch is not None else {}),
        **{
            k: info[k]
            for k in (
                "kv_blocks",
                "kv_block_tokens",
                "kv_bytes",
                "kv_num_tensors",
                "kv_tensor_bytes",
                "kv_tensor_shape",
            )
            if k in info
        },
        "kv_padding_blocks": padding,
        "whole_run_peak_reserved_bytes": stats.get("reserved_bytes.all.peak"),
        "whole_run_peak_allocated_bytes": stats.get("allocated_bytes.all.peak"),
        "gpu": extra.get("device_name"),
        "torch": extra.get("torch"),
        "transformers": extra.get("transformers"),
        "model": extra.get("model"),
        "num_blocks_option": settings.num_blocks,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    for name, what in snapshots:
        if name is not None:
            write_engine_memory(work / name, {"snapshot": what, **common})


def _dump_snapshot(work: Path, name: str, *, stop: bool = True) -> str:
    """Write PyTorch's memory snapshot (with its history) gzipped as ``name``; ``stop``: stop
    recording."""
    import torch

    snap = torch.cuda.memory._snapshot()
    if stop:
        torch.cuda.memory._record_memory_history(enabled=None)
    for trace in snap.get("device_traces", []):
        for entry in trace:
            if entry.get("size", 0) < SNAPSHOT_FRAMES_MIN_BYTES:
                entry["frames"] = []
    for seg in snap.get("segments", []):
        for block in seg.get("blocks", []):
            if block.get("size", 0) < SNAPSHOT_FRAMES_MIN_BYTES:
                block["frames"] = []
    with gzip.open(work / name, "wb", compresslevel=6) as f:
        pickle.dump(snap, f, protocol=4)
    return name


def main(argv: list[str]) -> int:
    work = Path(argv[1])
    try:
        run_job(work)
    except Exception as exc:  # noqa: BLE001 (one line for the parent; the traceback for whoever debugs)
        traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        (work / "error.txt").write_text(f"{type(exc).__name__}: {first}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
