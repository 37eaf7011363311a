"""A random-weight Llama-shaped model's ``generate`` under PyTorch's allocator and under poollab
policies.

    python benchmarks/bench_torch_alloc.py [-p SPEC ...] [--shapes 8x128,32x64,16x512,4x1500]
        [--new-tokens 16] [--rounds 2] [--layers 16] [--validate SPEC] [--mempool] [--out DIR]
    python benchmarks/bench_torch_alloc.py --persistent --rounds 40 [--budget-s 200] [-p SPEC ...]
        [--pin-cpus auto] [--warmup-rounds 1] [--compiled DIR --compiled-only] [--out DIR]
    python benchmarks/bench_torch_alloc.py --calls 200000 [-p SPEC ...] [--rounds 3]
        [--compiled DIR] [--out DIR]
    python benchmarks/bench_torch_alloc.py --stitch -p paged:page_bytes=2MiB [--out DIR]

Pluggable mode (``realgpu.torch_allocator.use_policy(spec)``) can only be installed before a
process's first CUDA allocation and never swapped back, so every allocator runs in its own
worker process, started in turn: round 1 runs PyTorch's allocator, then each policy, round 2 the
same again (interleaved, so drift on the machine spreads over all of them). Each worker builds
the same model from the same seed, warms up, then times ``generate`` on each batch shape
(``BATCHxPROMPT``, greedy, a fixed number of new tokens), with deterministic kernels
(``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, eager
attention), and hashes the tokens. Reported per policy and shape: seconds (median over rounds)
and the ratio to PyTorch's allocator, the allocator's per-call cost (the trampoline's samples),
peak reserved bytes, whether the tokens equal PyTorch's bit for bit, and the device memory used
(``torch.cuda.mem_get_info``) before the allocator is installed and after its teardown.

``--persistent`` settles the ratio in one run: one worker per allocator for the whole run, all
pinned to the same CPUs (``--pin-cpus``), the model built and warmed once; then ``--rounds``
rounds (after ``--warmup-rounds`` untimed ones, until ``--budget-s``), each running every worker's
``generate`` on every shape once, one worker at a time, in an order shuffled each round. Per
policy: the median of the per-round ratios to PyTorch's run of the same round with a bootstrap
95 % interval, and the verdict (met / missed / not settled when the interval straddles 1.05x);
the per-round malloc and free means the same way against 1.5 us; the tokens compared round by
round (``torch_alloc_verdict.csv``, ``torch_alloc_rounds.csv``, ``torch_alloc_paired.json``, and
the tables below from the timed rounds). ``--device cpu`` runs it with a tiny model on PyTorch's
CPU allocator in every worker: the orchestration's own test.

``--compiled DIR`` runs each policy's worker in this tree and then in DIR, a compiled copy
(``policies.testing.compiled.build_compiled_copy``), labelled ``SPEC (compiled)``, against the
same PyTorch run of the round. ``--validate SPEC`` adds one worker with that policy in
validation mode (guards checked on every free) on the first shape; ``--mempool`` adds one worker
that runs PyTorch's allocator and each policy in mempool mode side by side in one process.

Writes ``torch_alloc_runs.csv`` (one row per worker, round and shape), ``torch_alloc_summary.csv``
(one row per policy and shape) and ``torch_alloc.json`` (everything, with the summary rows of
``realgpu.torch_allocator``) into ``--out``. ``--calls N`` needs torch but no GPU: the per-call cost
of the trampoline and the callback table on a host-backed pool (``torch_alloc_calls.csv``; with
``--compiled DIR``, this tree and the compiled copy in DIR, round by round, a ``build`` column).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import os
import queue
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_POLICIES = ["best-fit", "size-class", "paged", "torch-caching", "best-fit:virtual=true"]
DEFAULT_SHAPES = "8x128,32x64,16x512,4x1500"
BASELINE = "torch"
#: ``--floor``'s allocator: exact-size C++ free lists behind PyTorch's pluggable interface, no
#: Python (``benchmarks/torch_floor_alloc.cpp``): what a policy's 1.05x budget is measured against
FLOOR = "floor"
FLOOR_LABEL = "floor (C++, pluggable)"
FLOOR_SOURCE = REPO / "benchmarks" / "torch_floor_alloc.cpp"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            batch, prompt = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise SystemExit(
                f"bench_torch_alloc.py: error: --shapes: {part!r} is not BATCHxPROMPT"
            ) from None
        if batch <= 0 or prompt <= 0:
            raise SystemExit(f"bench_torch_alloc.py: error: --shapes: {part!r} must be positive")
        shapes.append((batch, prompt))
    return shapes


# --------------------------------------------------------------------- inside a worker (torch here)
def _deterministic(torch) -> None:
    # warn_only: the deterministic implementation wherever one exists, a warning (not an error)
    # for an op that has none, so that a run never dies on one
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


#: The model on a CPU (``--device cpu``: the orchestration's own test, no GPU): the same Llama
#: shape, tiny, so that a round takes milliseconds.
TINY_CPU_MODEL = {
    "vocab_size": 512,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
GPU_MODEL = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}


class FloorAllocator:
    """``FLOOR_SOURCE`` built with the host's C++ compiler (cached by the source's hash), loaded
    once: ``install`` makes it PyTorch's CUDA allocator (before the first CUDA allocation, as a
    pluggable allocator must be) and hands it the runtime's cudaMalloc and cudaFree."""

    def __init__(self, build_dir: Path | None = None):
        import ctypes
        import hashlib
        import shutil
        import tempfile

        source = FLOOR_SOURCE.read_bytes()
        tag = hashlib.sha256(source).hexdigest()[:12]
        build_dir = Path(build_dir or tempfile.gettempdir()) / f"poollab_floor_{tag}"
        self.path = build_dir / "torch_floor_alloc.so"
        if not self.path.exists():
            compiler = shutil.which("c++") or shutil.which("g++")
            if compiler is None:
                raise RuntimeError("--floor needs a C++ compiler (c++ or g++) on PATH")
            build_dir.mkdir(parents=True, exist_ok=True)
            partial = build_dir / f"partial_{os.getpid()}.so"
            subprocess.run(
                [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", str(FLOOR_SOURCE), "-o",
                 str(partial)],
                check=True,
            )  # fmt: skip
            os.replace(partial, self.path)  # whole or absent: a worker beside this one reads it
        self.lib = ctypes.CDLL(str(self.path))
        self.lib.floor_set_driver.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.floor_counters.argtypes = [ctypes.POINTER(ctypes.c_uint64)]

    def install(self, torch) -> None:
        from realgpu.torch_allocator import cudart_address

        torch.cuda.memory.change_current_allocator(
            torch.cuda.memory.CUDAPluggableAllocator(str(self.path), "floor_malloc", "floor_free")
        )
        torch.cuda.init()
        cuda_malloc, cuda_free = cudart_address("cudaMalloc"), cudart_address("cudaFree")
        if not (cuda_malloc and cuda_free):
            raise RuntimeError("--floor: no cudaMalloc/cudaFree in the CUDA runtime PyTorch loaded")
        self.lib.floor_set_driver(cuda_malloc, cuda_free)

    def counters(self) -> dict[str, int]:
        import ctypes

        out = (ctypes.c_uint64 * 4)()
        self.lib.floor_counters(out)
        keys = ("num_malloc", "num_driver_malloc", "num_free", "held_bytes")
        return dict(zip(keys, map(int, out)))


def build_model(torch, layers: int, device: str = "cuda"):
    """The same random-weight Llama-shaped model in every process (seeded), bf16, eager
    attention; on ``device`` "cpu" a tiny one (``TINY_CPU_MODEL``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **(GPU_MODEL if device == "cuda" else TINY_CPU_MODEL),
        num_hidden_layers=layers,
        max_position_embeddings=4096,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.eval()
    return model


class ShapeRunner:
    """``generate`` on each batch shape, greedy, a fixed number of new tokens, the inputs seeded:
    ``warm()`` once (the smallest shape), then ``run(repeats)`` as often as wanted (one shape
    after the other each repeat). Each run's row: ``seconds`` (the median over the repeats),
    ``seconds_all`` (each), ``tokens_sha`` (the set of the tokens' hashes, so a run whose tokens
    change from one repeat to the next shows it)."""

    def __init__(self, torch, model, shapes, new_tokens: int):
        self.torch, self.model, self.shapes, self.new_tokens = torch, model, shapes, new_tokens
        self.device = next(model.parameters()).device
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(1)
        self.inputs = [torch.randint(3, vocab, (b, p), generator=gen) for b, p in shapes]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def generate(self, ids):
        torch = self.torch
        ids = ids.to(self.device)
        with torch.no_grad():
            tokens = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=self.new_tokens,
                min_new_tokens=self.new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        self._sync()
        return tokens

    def warm(self) -> None:
        self.generate(self.inputs[0][:1, :16])

    def run(self, repeats: int = 1) -> list[dict]:
        seconds: list[list[float]] = [[] for _ in self.shapes]
        digests: list[set[str]] = [set() for _ in self.shapes]
        for _ in range(repeats):
            for k, ids in enumerate(self.inputs):
                t0 = time.perf_counter()
                tokens = self.generate(ids)
                seconds[k].append(time.perf_counter() - t0)
                digests[k].add(hashlib.sha256(tokens.cpu().numpy().tobytes()).hexdigest()[:16])
                del tokens
        return [
            {
                "shape": f"{b}x{p}",
                "seconds": statistics.median(secs),
                "seconds_all": secs,
                "tokens_sha": ",".join(sorted(sha)),
            }
            for (b, p), secs, sha in zip(self.shapes, seconds, digests)
        ]


def run_shapes(torch, model, shapes, new_tokens: int, repeats: int = 1) -> list[dict]:
    """Warm up on the smallest shape, then time ``generate`` on each shape ``repeats`` times
    (``ShapeRunner``)."""
    runner = ShapeRunner(torch, model, shapes, new_tokens)
    runner.warm()
    return runner.run(repeats)


def worker(args) -> dict:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    _deterministic(torch)
    shapes = parse_shapes(args.shapes)
    from realgpu.nvml import MemoryReader

    # NVML through CuPy: touching torch.cuda here would initialise PyTorch's allocator, and a
    # pluggable one can only be installed before that
    reader = MemoryReader(device_id=0)
    result = {
        "allocator": args.allocator,
        "build": _build(),
        "validate": bool(args.worker_validate),
        "mode": "pluggable",
        "device_used_before_bytes": reader.used_bytes(),
        "memory_source": reader.source,
    }
    if args.allocator == BASELINE:
        model = build_model(torch, args.layers)
        result["runs"] = run_shapes(torch, model, shapes, args.new_tokens, args.repeats)
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        del model
        torch.cuda.empty_cache()
    else:
        from realgpu.torch_allocator import use_policy

        with use_policy(args.allocator, validate=bool(args.worker_validate)) as alloc:
            model = build_model(torch, args.layers)
            marks = _CallMarks(alloc)  # the calls from here on are generate's
            result["runs"] = run_shapes(torch, model, shapes, args.new_tokens, args.repeats)
            marks.stop()
            del model
        result["malloc_breakdown"] = marks.breakdown(torch)
        row = alloc.summary_row()
        # the trampoline's own samples, entry to return: what PyTorch pays per call
        result["alloc_mean_us"] = float(alloc.shim.samples(0).mean()) / 1e3
        result["free_mean_us"] = float(alloc.shim.samples(1).mean()) / 1e3
        result["free_errors"] = [
            str(e) for e in alloc.core.errors[:3]
        ]  # double frees, corruption (validate)
        result["peak_reserved_bytes"] = row["peak_reserved_bytes"]
        result["peak_allocated_bytes"] = row["peak_allocated_bytes"]
        result["summary"] = row
        result["capture_check"] = alloc.capture_check
        result["pool_bytes_after"] = (
            alloc.pool.device.used_bytes
        )  # the policy's segments still held: 0
    torch.cuda.synchronize()
    result["device_used_after_bytes"] = reader.used_bytes()
    return result


class _CallMarks:
    """Where ``generate``'s mallocs through the trampoline went (issue 30's malloc target): the
    calls between ``__init__`` (after the model is built) and ``stop``, their per-call times (the
    shim keeps every sample, in order, below its capacity), the garbage collector's passes in
    that time, the calls that arrived without the GIL, the trampoline's split of its own steps,
    the core's calls off the hot path, and what a monitor sample and the trampoline's steps cost."""

    def __init__(self, alloc):
        import gc

        self.alloc, self.shim, self.core = alloc, alloc.shim, alloc.core
        c = self.shim.counters()
        self.n0 = (c["n_calls_malloc"], c["n_calls_free"])
        self.slow0 = getattr(self.core, "n_slow_mallocs", 0)
        self.maps0 = self.alloc.pool.device.num_maps
        self.gc_ns, self.gc_passes, self._gc_t0 = 0, 0, 0
        self.b0 = self.shim.breakdown() if hasattr(self.shim, "breakdown") else {}
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
        else:
            self.gc_ns += time.perf_counter_ns() - self._gc_t0
            self.gc_passes += 1

    def stop(self) -> None:
        import gc

        gc.callbacks.remove(self._gc)
        c = self.shim.counters()
        self.n1 = (c["n_calls_malloc"], c["n_calls_free"])
        self.b1 = self.shim.breakdown() if hasattr(self.shim, "breakdown") else {}
        self.slow1 = getattr(self.core, "n_slow_mallocs", 0)
        self.maps1 = self.alloc.pool.device.num_maps
        # a monitor sample (every DEFAULT_SAMPLE_EVERY calls), timed on the pool as generate left it
        t0 = time.perf_counter_ns()
        for _ in range(20):
            self.core.monitor.readings.sample()
        self.monitor_sample_ns = (time.perf_counter_ns() - t0) / 20

    def breakdown(self, torch) -> dict:
        import numpy as np

        out: dict = {}
        for kind, name in ((0, "malloc"), (1, "free")):
            # past the shim's capacity, one call in ``stride`` (evenly spread): the means and
            # percentiles are those of the kept calls, the counts over 10 us scaled up by it
            mine, stride = self.shim.calls_samples(kind, self.n0[kind], self.n1[kind])
            mine = mine.astype(np.float64)
            if not mine.size:
                continue
            out[f"gen_n_{name}"] = self.n1[kind] - self.n0[kind]
            out[f"gen_{name}_sample_stride"] = stride
            out[f"gen_{name}_mean_us"] = mine.mean() / 1e3
            for q in (50, 90, 99):
                out[f"gen_{name}_p{q}_us"] = float(np.percentile(mine, q)) / 1e3
            slow = mine >= 10_000
            out[f"gen_{name}_n_over_10us"] = int(slow.sum()) * stride
            out[f"gen_{name}_time_share_over_10us"] = float(mine[slow].sum() / mine.sum())
            out[f"gen_{name}_mean_us_under_10us"] = float(mine[~slow].mean()) / 1e3
        b0, b1 = self.b0, self.b1
        n_calls = (self.n1[0] - self.n0[0]) + (self.n1[1] - self.n0[1])
        if b1:
            out["gen_share_calls_without_gil"] = (
                (b1["n_calls_without_gil"] - b0["n_calls_without_gil"]) / n_calls if n_calls else 0
            )
            out["gen_n_capture_checks"] = b1["n_capture_checks"] - b0["n_capture_checks"]
            # the split's means over the whole run (every 16th malloc, the model's build included)
            out.update({k: v for k, v in b1.items() if k.startswith("split_")})
            out.update(self.shim.step_costs_ns(n=100_000))
            if torch.cuda.is_available():  # what the check costs where it is still made
                side = torch.cuda.Stream()
                out["capture_check_side_stream_ns"] = self.shim.step_costs_ns(
                    n=100_000, stream=side.cuda_stream
                )["capture_check_ns"]
        core = self.core
        out["gen_n_slow_mallocs"] = getattr(core, "n_slow_mallocs", 0) - self.slow0
        out["gen_n_new_segments"] = self.maps1 - self.maps0
        out["n_streams"] = len(core.streams)
        out["n_deferred_frees"] = core.n_deferred_frees
        out["n_align_padded"] = core.n_align_padded
        out["gen_gc_passes"] = self.gc_passes
        out["gen_gc_ms"] = self.gc_ns / 1e6
        out["monitor_sample_us"] = self.monitor_sample_ns / 1e3
        out["monitor_sample_every_calls"] = core._sample_every
        return out


def generate_breakdown_text(b: dict) -> str:
    """One line of ``_CallMarks.breakdown``: generate's malloc and free through the trampoline."""
    f = lambda k, spec=".2f": format(b[k], spec) if k in b else "?"  # noqa: E731
    return (
        f"generate: malloc mean {f('gen_malloc_mean_us')} p50 {f('gen_malloc_p50_us')} p99 "
        f"{f('gen_malloc_p99_us')} us "
        f"({f('gen_n_malloc', 'd')} calls, 1 in {f('gen_malloc_sample_stride', 'd')} timed; "
        f"{f('gen_malloc_n_over_10us', 'd')} "
        f"over 10 us hold {f('gen_malloc_time_share_over_10us', '.1%')} of the time, "
        f"the rest average {f('gen_malloc_mean_us_under_10us')} us), "
        f"free mean {f('gen_free_mean_us')} p50 {f('gen_free_p50_us')} us; "
        f"without the GIL {f('gen_share_calls_without_gil', '.0%')}; "
        f"off the hot path {f('gen_n_slow_mallocs', 'd')}, "
        f"new segments {f('gen_n_new_segments', 'd')}, streams {f('n_streams', 'd')}, "
        f"GC passes {f('gen_gc_passes', 'd')} ({f('gen_gc_ms')} ms); split (ns): "
        f"capture check {f('split_capture_check_ns', '.0f')}, "
        f"take GIL {f('split_take_gil_ns', '.0f')}, Python {f('split_python_call_ns', '.0f')}, "
        f"give GIL {f('split_release_gil_ns', '.0f')}; "
        f"a clock read {f('clock_read_ns', '.0f')} ns, "
        f"a capture check {f('capture_check_ns', '.0f')} ns "
        f"(null stream) / {f('capture_check_side_stream_ns', '.0f')} ns (side stream), "
        f"a monitor sample {f('monitor_sample_us')} us "
        f"every {f('monitor_sample_every_calls', 'd')} calls"
    )


#: A persistent worker's answers on its stdout start with this (a library may print there too).
ANSWER_PREFIX = "@@bench "


def parse_cpus(text: str | None) -> list[int] | None:
    """``--pin-cpus``: "2,3" or "2-3" (the CPUs), "none" or None (no pinning), "auto" (the
    two highest-numbered CPUs this process may run on, away from CPU 0's interrupts, where it
    may run on at least four; else all of them)."""
    if text is None or text == "none":
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if text == "auto":
        return allowed[-2:] if len(allowed) >= 4 else allowed
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SystemExit(
            f"bench_torch_alloc.py: error: --pin-cpus: {text!r} is not a list of CPUs (2,3 or 2-3)"
        ) from None
    if not cpus or not set(cpus) <= set(allowed):
        raise SystemExit(
            f"bench_torch_alloc.py: error: --pin-cpus: {text!r} names CPUs this process may not "
            f"run on (it may run on {allowed})"
        )
    return sorted(set(cpus))


def _answer(obj: dict) -> None:
    sys.stdout.write(ANSWER_PREFIX + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def _call_counts(shim) -> tuple[int, int]:
    c = shim.counters()
    return c["n_calls_malloc"], c["n_calls_free"]


def _call_means(shim, n0: tuple[int, int]) -> dict:
    """The mean malloc and free (us, the trampoline's samples) of the calls since ``n0``."""
    out: dict = {}
    n1 = _call_counts(shim)
    for kind, name in ((0, "malloc"), (1, "free")):
        # past the shim's capacity, the mean of one call in ``stride``, evenly spread
        ns, _ = shim.calls_samples(kind, n0[kind], n1[kind])
        if not ns.size:
            continue  # no call (or none kept)
        out[f"n_{name}"] = n1[kind] - n0[kind]
        out[f"{name}_mean_us"] = float(ns.mean()) / 1e3
    return out


def persistent_worker(args) -> int:
    """One allocator for a whole paired run (``--persistent``): pinned to ``--pin-cpus`` before
    torch starts a thread, the allocator installed, the model built and warmed once; then, for
    each ``{"cmd": "run", "round": R}`` line on stdin, one ``ShapeRunner.run`` answered on stdout
    (with the mean malloc and free of that round's calls); ``stop`` (or the end of stdin) ends it
    with what ``worker`` reports (the malloc breakdown of every timed round's calls, the summary
    row, device memory before and after). On the CPU (``--device cpu``: the orchestration's
    test) a policy cannot be PyTorch's allocator: every worker runs PyTorch's own,
    ``policy_installed`` false."""
    cpus = parse_cpus(args.pin_cpus)
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    _deterministic(torch)
    name, cuda = args.serve, args.device == "cuda"
    info: dict = {
        "allocator": name,
        "build": _build(),
        "pid": os.getpid(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "device": args.device,
        "policy_installed": False,
    }
    reader = alloc = marks = floor = None
    if cuda:
        from realgpu.nvml import MemoryReader

        # NVML through CuPy: touching torch.cuda first would initialise PyTorch's allocator
        reader = MemoryReader(device_id=0)
        info["device_used_before_bytes"] = reader.used_bytes()
    with contextlib.ExitStack() as stack:
        if cuda and name == FLOOR:
            floor = FloorAllocator()
            floor.install(torch)
            info["policy_installed"] = True
        elif cuda and name != BASELINE:
            from realgpu.torch_allocator import use_policy

            alloc = stack.enter_context(use_policy(name))
            info["policy_installed"] = True
        t0 = time.perf_counter()
        model = build_model(torch, args.layers, args.device)
        runner = ShapeRunner(torch, model, parse_shapes(args.shapes), args.new_tokens)
        runner.warm()
        info["setup_s"] = time.perf_counter() - t0
        _answer({"ready": True, **info})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                break
            if alloc is not None and marks is None and not cmd.get("warmup"):
                marks = _CallMarks(alloc)  # the breakdown: every timed round's calls
            n0 = _call_counts(alloc.shim) if alloc is not None else None
            answer = {"round": cmd["round"], "runs": runner.run(args.repeats)}
            if alloc is not None:
                answer.update(_call_means(alloc.shim, n0))
            _answer(answer)
        if marks is not None:
            marks.stop()
        del model, runner
    result = {"final": True, **info}
    if marks is not None:
        result["malloc_breakdown"] = marks.breakdown(torch)
    if alloc is not None:
        row = alloc.summary_row()
        result.update(
            summary=row,
            peak_reserved_bytes=row["peak_reserved_bytes"],
            peak_allocated_bytes=row["peak_allocated_bytes"],
            free_errors=[str(e) for e in alloc.core.errors[:3]],
            pool_bytes_after=alloc.pool.device.used_bytes,
        )
    elif floor is not None:
        result["floor"] = floor.counters()
        result["peak_reserved_bytes"] = result["floor"]["held_bytes"]
    elif cuda:
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
    if cuda:
        torch.cuda.synchronize()
        result["device_used_after_bytes"] = reader.used_bytes()
    _answer(result)
    return 0


def mempool_worker(args) -> dict:
    """PyTorch's allocator and each policy in mempool mode, side by side in this one process, ABAB
    round by round."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    from realgpu.torch_allocator import use_policy

    _deterministic(torch)
    shapes = parse_shapes(args.shapes)
    model = build_model(
        torch, args.layers
    )  # weights in PyTorch's own pool; activations and KV in the policy's
    out = {"runs": [], "summaries": []}
    for r in range(args.rounds):
        for name in round_order([BASELINE, *args.policies], r):
            if name == BASELINE:
                runs = run_shapes(torch, model, shapes, args.new_tokens, args.repeats)
            else:
                with use_policy(name, mode="mempool") as alloc:
                    runs = run_shapes(torch, model, shapes, args.new_tokens, args.repeats)
                out["summaries"].append(
                    {
                        **alloc.summary_row(round=r),
                        "alloc_mean_us": float(alloc.shim.samples(0).mean()) / 1e3,
                        "free_mean_us": float(alloc.shim.samples(1).mean()) / 1e3,
                    }
                )
            out["runs"].extend({"allocator": name, "round": r, **run} for run in runs)
    return out


def mempool_as_workers(mempool: dict) -> list[dict]:
    """The mempool worker's runs as one pseudo-worker per (allocator, round), for ``summarise``: the
    ratios are then to PyTorch's own allocator in the same process and round."""
    groups: dict[tuple[str, int], dict] = {}
    for run in mempool["runs"]:
        w = groups.setdefault(
            (run["allocator"], run["round"]),
            {"allocator": run["allocator"], "round": run["round"], "runs": []},
        )
        w["runs"].append({k: v for k, v in run.items() if k not in ("allocator", "round")})
    for row in mempool["summaries"]:
        w = groups.get((row["policy"], row["round"]))
        if w is not None:
            w.update(
                summary=row,
                alloc_mean_us=row["alloc_mean_us"],
                free_mean_us=row["free_mean_us"],
                peak_reserved_bytes=row["peak_reserved_bytes"],
            )
    return list(groups.values())


def calls_bench(args) -> list[dict]:
    """Per-call cost of the trampoline and the callback table, no GPU: the compiled trampoline's
    own samples (entry to return, what PyTorch pays per call) over a host-backed pool whose
    segments are aligned as ``cudaMalloc``'s; the first row is the trampoline alone (a callback
    that returns a constant).

    The requests: a cycle of six sizes, each freed at once (the default); or, with ``--trace``,
    a real allocation trace's requests in its order, with its sizes and lifetimes (PyTorch's
    own ``generate``: a few hundred live tensors, 4 B to 16 MiB; frees of tensors allocated
    before it began are skipped). ``--release-gil``: the trampoline entered without the GIL, as
    PyTorch's Python bindings call it (they let go of the GIL before an op allocates).

    Each row also says where the malloc time went (``malloc_breakdown``): the share of mallocs,
    and of malloc time, that took a new segment from the device, a monitor sample, or a path off
    the common case, and the trampoline's split of its own steps (``Shim.breakdown``)."""
    import random
    from types import SimpleNamespace

    import numpy as np

    from realgpu.torch_allocator import host_allocator_core, load_shim

    shim = load_shim()
    requests = _trace_requests(args.trace, args.calls) if args.trace else None
    if requests is None:
        rng = random.Random(0)
        cycle = [rng.choice([512, 4096, 65536, 1 << 20, 3 << 20, 8 << 20]) for _ in range(64)]
    rows = []
    null = SimpleNamespace(
        malloc=lambda size, device, stream: 1 << 21, free=lambda ptr, size, device, stream: None
    )
    release = bool(args.release_gil)
    for name in ["(trampoline only)", *args.policies]:
        if name.startswith("("):
            target = null
        else:
            target = host_allocator_core(name)  # what use_policy builds, on the host
        best = None
        for _ in range(args.rounds):
            shim.bind(target)
            shim.reset()
            tags = _replay_calls(
                shim, target, requests, cycle if requests is None else None, args.calls, release
            )
            a, f = shim.samples(0), shim.samples(1)
            row = {
                "allocator": name,
                "build": _build(),
                "workload": Path(args.trace).name if args.trace else "six-size cycle",
                "gil": "released" if release else "held",
                "n_calls": int(a.size + f.size),
                "alloc_p50_us": float(np.median(a)) / 1e3,
                "alloc_mean_us": float(a.mean()) / 1e3,
                "free_p50_us": float(np.median(f)) / 1e3,
                "free_mean_us": float(f.mean()) / 1e3,
                **malloc_breakdown(a, tags),
                **(shim.breakdown() if hasattr(shim, "breakdown") else {}),  # older trees: none
            }
            if (
                best is None
                or row["alloc_mean_us"] + row["free_mean_us"]
                < best["alloc_mean_us"] + best["free_mean_us"]
            ):
                best = row
        shim.bind(None)
        if target is not null:
            target.close()
        rows.append(best)
        print(
            f"{name:>24} alloc p50 {best['alloc_p50_us']:.2f} us mean {best['alloc_mean_us']:.2f} "
            f"us, free p50 {best['free_p50_us']:.2f} us mean {best['free_mean_us']:.2f} us; "
            + breakdown_text(best),
            flush=True,
        )
    return rows


#: Why a malloc left the common case, in the order ``_replay_calls`` tags it (one tag a malloc).
MALLOC_TAGS = ("new_segment", "monitor_sample", "slow_path", "fast")


def _trace_requests(path: Path, max_events: int) -> list[tuple[bool, int, int]]:
    """``(is_alloc, alloc_id, nbytes)`` of a trace's first ``max_events`` requests (``traces``'
    reader: any allocation-trace format), 0-byte requests left out (the trampoline answers them)."""
    from traces import read_alloc_trace

    _, is_alloc, ids, nbytes, _ = read_alloc_trace(path).arrays()
    out = [
        (bool(x), int(i), int(n))
        for x, i, n in zip(is_alloc[:max_events], ids[:max_events], nbytes[:max_events])
        if n > 0
    ]
    return out


def _replay_calls(shim, target, requests, cycle, n_pairs: int, release_gil: bool) -> list[str]:
    """Drive the trampoline as PyTorch would; per malloc, in order, the tag of ``MALLOC_TAGS`` it
    earned (read from the core's state after the call: outside the timed region)."""
    core = target if hasattr(target, "path") else None
    tags: list[str] = []
    probe = shim.probe_malloc if hasattr(shim, "breakdown") else _older_probe(shim)
    if core is None:
        tag = lambda: "fast"  # noqa: E731
    else:
        device, path = core.pool.device, core.path

        def tag() -> str:
            nonlocal maps, slow
            t = "fast"
            if device.num_maps != maps:
                t = "new_segment"
            elif path.countdown == core._sample_every:
                t = "monitor_sample"  # its countdown was just reset: this call took a sample
            elif getattr(core, "n_slow_mallocs", 0) != slow:
                t = "slow_path"
            maps, slow = device.num_maps, getattr(core, "n_slow_mallocs", 0)
            return t

        maps, slow = device.num_maps, getattr(core, "n_slow_mallocs", 0)
    if requests is None:
        for i in range(n_pairs):
            n = cycle[i % len(cycle)]
            _, ptr, _ = probe(n, release_gil=release_gil)
            tags.append(tag())
            shim.call_free(ptr, n)
        return tags
    ptrs: dict[int, tuple[int, int]] = {}
    for is_alloc, key, n in requests:
        if is_alloc:
            code, ptr, msg = probe(n, release_gil=release_gil)
            if code:
                raise SystemExit(f"bench_torch_alloc.py: the trace's request of {n:,} B: {msg}")
            tags.append(tag())
            ptrs[key] = (ptr, n)
        elif key in ptrs:
            ptr, n = ptrs.pop(key)
            shim.call_free(ptr, n)
    for ptr, n in ptrs.values():  # what the trace leaves live, freed (untimed rounds after)
        shim.call_free(ptr, n)
    return tags


def _older_probe(shim):
    """``Shim.probe_malloc(size, release_gil=...)`` for a tree from before it took
    ``release_gil`` (``--tree`` copies of the code before a change)."""
    import ctypes

    released = ctypes.CDLL(shim.path).poollab_probe_malloc
    released.argtypes = shim.lib.poollab_probe_malloc.argtypes

    def probe(size: int, stream: int = 0, *, release_gil: bool = False):
        out, buf = ctypes.c_void_p(), ctypes.create_string_buffer(4096)
        fn = released if release_gil else shim.lib.poollab_probe_malloc
        code = fn(size, stream or None, ctypes.byref(out), buf, len(buf))
        return int(code), int(out.value or 0), buf.value.decode(errors="replace")

    return probe


def malloc_breakdown(alloc_ns, tags: list[str]) -> dict[str, float]:
    """Per tag of ``MALLOC_TAGS``: the share of mallocs and the mean us of those (the shim's
    samples are the calls in order while fewer than its capacity)."""
    import numpy as np

    out: dict[str, float] = {}
    if len(tags) != len(alloc_ns):  # the shim thinned its samples: no per-call pairing
        return out
    kinds = np.array(tags)
    total = float(alloc_ns.sum()) or 1.0
    for t in MALLOC_TAGS:
        mine = alloc_ns[kinds == t]
        out[f"share_{t}"] = mine.size / max(1, alloc_ns.size)
        out[f"time_share_{t}"] = float(mine.sum()) / total
        out[f"mean_us_{t}"] = float(mine.mean()) / 1e3 if mine.size else float("nan")
    return out


def breakdown_text(row: dict) -> str:
    parts = [
        f"{t} {100 * row[f'share_{t}']:.2f}% of calls, "
        f"{100 * row[f'time_share_{t}']:.1f}% of time ({row[f'mean_us_{t}']:.2f} us)"
        for t in MALLOC_TAGS
        if f"share_{t}" in row and row[f"share_{t}"] > 0
    ]
    if "split_take_gil_ns" not in row:
        return "; ".join(parts)
    split = (
        f"split: check {row['split_capture_check_ns']:.0f} ns, "
        f"take GIL {row['split_take_gil_ns']:.0f}, Python {row['split_python_call_ns']:.0f}, "
        f"give GIL {row['split_release_gil_ns']:.0f}"
    )
    return "; ".join(parts + [split])


def stitch_bench(args) -> list[dict]:
    """No GPU: PyTorch's own requests (the bundled llama1b ``generate`` slice) through the callback
    table of each page policy on ``host-vmm``, as ``use_policy`` builds it; what its tensors over
    pages that are not one range cost: fresh ranges, kept ranges reused or taken over, driver calls,
    and their time at the bundled H200 costs (``sim.replay.costs.CostModel``: a reserve a range, a
    map and an access call a page mapped, an unmap a page unmapped). With and without take-overs
    and reuses inside a longer kept range (``TAKE_OVER_CANDIDATES`` 0: only exact reuse, the code
    before session 12's change); ``n_stitch_set_access`` counts the stitching's access calls."""
    import realgpu.torch_allocator as ta
    from sim.replay.costs import CostModel
    from traces import bundled_path, read_alloc_trace

    costs = CostModel.load()
    trace = read_alloc_trace(bundled_path("llama1b_generate_slice.pickle.gz"))
    _, is_alloc, ids, nbytes, _ = trace.arrays()
    rows = []
    candidates = ta.TAKE_OVER_CANDIDATES
    for name in args.policies:
        for take_over in (False, True):
            ta.TAKE_OVER_CANDIDATES = candidates if take_over else 0
            try:
                pool = ta._make_pool(
                    name, validate=False, device=0, capacity_bytes=None, backend="host"
                )
                core = ta.AllocatorCore(pool)
                calls0 = dict(
                    pool.device.num_calls
                )  # the pool's own segments are not the stitching's
                ptrs, n_multi, t0 = {}, 0, time.perf_counter()
                page = pool.device.granularity_bytes
                for alloc, key, n in zip(is_alloc.tolist(), ids.tolist(), nbytes.tolist()):
                    if alloc:
                        ptrs[key] = core.malloc(n, 0, 0)
                        n_multi += n > page
                    elif key in ptrs:
                        core.free(ptrs.pop(key), n, 0, 0)
                wall_s = time.perf_counter() - t0
                grown = pool.device.num_calls["create"] - calls0.get("create", 0)
                calls = {
                    c: pool.device.num_calls[c] - calls0.get(c, 0) for c in pool.device.num_calls
                }
                stitch_maps = (
                    calls["map"] - grown
                )  # one map per page created for the pool's own segments
                modelled_ns = (
                    calls["address_reserve"] * costs.vmm_call_ns("address_reserve", page)
                    + stitch_maps
                    * (costs.vmm_call_ns("map", page) + costs.vmm_call_ns("set_access", page))
                    + calls["unmap"] * costs.vmm_call_ns("unmap", page)
                )
                row = {
                    "policy": name,
                    "take_over": take_over,
                    "n_requests": int(is_alloc.sum()),
                    "n_over_pages": n_multi,
                    "n_fresh_ranges": core.n_stitched_maps,
                    "n_exact_reuses": core.n_stitch_reuses,
                    "n_inside_reuses": core.n_stitch_inside_reuses,
                    "n_take_overs": core.n_stitch_takeovers,
                    "n_pages_remapped": core.n_stitch_pages_remapped,
                    "n_stitch_maps": stitch_maps,
                    # one access call a segment the pool grew (each grow reserved a range of its
                    # own), the rest the stitching's
                    "n_stitch_set_access": calls["set_access"]
                    - (calls["address_reserve"] - core.n_stitched_maps),
                    "n_unmaps": calls["unmap"],
                    "n_idle_evictions": core.n_idle_evictions,
                    "modelled_driver_ms": modelled_ns / 1e6,
                    "host_wall_s": wall_s,
                    "n_errors": len(core.errors),
                }
                for q in list(core.live):
                    core.free(q, 1, 0, 0)
                core.close()
            finally:
                ta.TAKE_OVER_CANDIDATES = candidates
            rows.append(row)
            print(
                f"{name:>24} take-over={'on ' if take_over else 'off'} fresh "
                f"{row['n_fresh_ranges']:5d} reused {row['n_exact_reuses']:5d} inside "
                f"{row['n_inside_reuses']:5d} taken "
                f"over {row['n_take_overs']:5d} "
                f"({row['n_pages_remapped']} pages) "
                f"stitch maps {stitch_maps:6d} access calls {row['n_stitch_set_access']:5d} "
                f"unmaps {calls['unmap']:5d} "
                f"modelled {row['modelled_driver_ms']:7.1f} ms",
                flush=True,
            )
    return rows


def _build() -> str:
    """ "compiled" when the hot path (``realgpu.malloc_path``) is the compiled build's C
    extension."""
    import realgpu.malloc_path as mp

    return "compiled" if not mp.__file__.endswith(".py") else "interpreted"


def calls_side_by_side(args) -> list[dict]:
    """``--calls`` in this tree, in ``--compiled DIR`` (a compiled copy,
    ``policies.testing.compiled.build_compiled_copy``) and in each ``--tree DIR`` (another copy:
    the code before a change, with this benchmark copied in), alternating round by round in fresh
    processes, each tree with its own trampoline build (``TORCH_EXTENSIONS_DIR``); the best round
    of each (allocator, tree)."""
    trees = [REPO, *([args.compiled] if args.compiled else []), *(args.trees or [])]
    best: dict[tuple[str, str], dict] = {}
    for r in range(args.rounds):
        for tree in trees:
            label = "." if Path(tree) == REPO else Path(tree).name
            out = args.out / f"calls_{Path(tree).name}_{r}"
            cmd = [
                sys.executable,
                str(Path(tree) / "benchmarks" / "bench_torch_alloc.py"),
                "--calls",
                str(args.calls),
                "--rounds",
                "1",
                "--out",
                str(out),
            ]
            if args.trace:
                cmd += ["--trace", str(Path(args.trace).resolve())]
            if args.release_gil:
                cmd.append("--release-gil")
            for p in args.policies:
                cmd += ["-p", p]
            ext = Path(os.environ.get("TMPDIR", "/tmp")) / f"poollab_shim_{abs(hash(str(tree)))}"
            env = {**os.environ, "PYTHONPATH": str(tree), "TORCH_EXTENSIONS_DIR": str(ext)}
            subprocess.run(cmd, check=True, cwd=tree, env=env)
            with open(out / "torch_alloc_calls.csv") as f:
                for row in csv.DictReader(f):
                    row["tree"] = label
                    key = (row["allocator"], label)
                    cost = float(row["alloc_mean_us"]) + float(row["free_mean_us"])
                    if key not in best or cost < float(best[key]["alloc_mean_us"]) + float(
                        best[key]["free_mean_us"]
                    ):
                        best[key] = row
    labels = ["." if Path(t) == REPO else Path(t).name for t in trees]
    rows = sorted(
        best.values(),
        key=lambda r: (
            [*["(trampoline only)"], *args.policies].index(r["allocator"]),
            labels.index(r["tree"]),
        ),
    )
    print(
        f"{'allocator':>24} {'tree':>14} {'build':>11} {'alloc p50':>9} {'mean':>6} "
        f"{'free p50':>8} {'mean':>6}  "
        f"(us, best of {args.rounds} rounds "
        f"of {args.calls:,} {'events of ' + Path(args.trace).name if args.trace else 'pairs'})"
    )
    for r in rows:
        print(
            f"{r['allocator']:>24} {r['tree']:>14} {r['build']:>11} "
            f"{float(r['alloc_p50_us']):9.2f} {float(r['alloc_mean_us']):6.2f} "
            f"{float(r['free_p50_us']):8.2f} {float(r['free_mean_us']):6.2f}"
        )
    return rows


# ---------------------------------------------------------------------- the parent (no torch)
def spawn(args, extra: list[str], timeout_s: float, tree: Path = REPO) -> dict:
    """One worker process, running this benchmark in ``tree`` (this one, or a compiled copy)."""
    cmd = [
        sys.executable,
        str(Path(tree) / "benchmarks" / "bench_torch_alloc.py"),
        "--shapes",
        args.shapes,
        "--new-tokens",
        str(args.new_tokens),
        "--layers",
        str(args.layers),
        "--rounds",
        str(args.rounds),
        "--repeats",
        str(args.repeats),
        *extra,
    ]
    for p in args.policies:
        cmd += ["-p", p]
    env = _tree_env(tree)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, cwd=tree, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s", "wall_s": time.perf_counter() - t0}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        return {
            "error": f"exit {proc.returncode}: " + " | ".join(tail),
            "wall_s": time.perf_counter() - t0,
        }
    result = json.loads(lines[-1])
    result["wall_s"] = time.perf_counter() - t0
    return result


#: Issue 30's speed targets: ``generate`` at most this many times PyTorch's own allocator's time,
#: and one call (malloc or free, mean through the trampoline) at most this many microseconds.
GENERATE_RATIO_TARGET = 1.05
CALL_US_TARGET = 1.5
#: The summary's row over every shape: the seconds of all of them added, per round.
ALL_SHAPES = "all"


def _tree_env(tree: Path) -> dict:
    """The environment of a process that runs in ``tree``: a copy's modules first ("." in
    PYTHONPATH is the working folder)."""
    env = dict(os.environ)
    if Path(tree) != REPO:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(tree), *env.get("PYTHONPATH", "").split(os.pathsep)]
        )
    return env


class PersistentWorker:
    """A ``--serve`` process and the thread that reads its answers (so that a wait has a
    timeout); its stderr goes to ``log_path`` (a pipe nobody reads would fill and stall it)."""

    def __init__(self, label: str, cmd: list[str], tree: Path, log_path: Path):
        self.label = label
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            cwd=tree,
            env=_tree_env(tree),
        )
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(ANSWER_PREFIX):
                self._answers.put(json.loads(line[len(ANSWER_PREFIX) :]))
        self._answers.put(None)  # its stdout closed: it exited

    def ask(self, cmd: dict | None, timeout_s: float) -> dict:
        """Send ``cmd`` (None: send nothing) and wait for the next answer, or an ``error``."""
        if cmd is not None:
            try:
                self.proc.stdin.write(json.dumps(cmd) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass  # it exited: the answer below says how
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            return {"error": f"no answer in {timeout_s:.0f} s"}
        if answer is None:
            self._log.flush()
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-4:]
            return {"error": f"exit {self.proc.wait()}: " + " | ".join(tail)}
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


def persistent_cmd(args, name: str, tree: Path, cpus: list[int] | None) -> list[str]:
    return [
        sys.executable,
        str(Path(tree) / "benchmarks" / "bench_torch_alloc.py"),
        "--serve",
        name,
        "--shapes",
        args.shapes,
        "--new-tokens",
        str(args.new_tokens),
        "--layers",
        str(args.layers),
        "--repeats",
        str(args.repeats),
        "--device",
        args.device,
        "--pin-cpus",
        ",".join(map(str, cpus)) if cpus else "none",
    ]


def persistent_bench(args, entries: list[tuple[str, str, Path]]) -> dict:
    """Every allocator in ``entries`` (label, spec, tree; PyTorch's first) in a worker of its own
    for the whole run, all pinned to the same CPUs (``--pin-cpus``), so that the round, not the
    process or the core, is what varies; then rounds: each worker runs ``generate`` on every shape
    once, one worker at a time, in an order shuffled each round (seeded), until ``--rounds`` timed
    rounds ran (after ``--warmup-rounds`` untimed ones) or the next would end past ``--budget-s``
    since the start. A worker that errs or stalls is dropped; without PyTorch's the rounds end.
    The tables are rewritten after every round (``write_paired``)."""
    t_start = time.monotonic()
    cpus = parse_cpus(args.pin_cpus)
    logs = args.out / "worker_logs"
    logs.mkdir(parents=True, exist_ok=True)
    workers = {
        label: PersistentWorker(
            label,
            persistent_cmd(args, name, tree, cpus),
            tree,
            logs / (re.sub(r"[^A-Za-z0-9.=-]+", "_", label).strip("_") + ".txt"),
        )
        for label, name, tree in entries
    }
    run: dict = {"cpus": cpus, "ready": {}, "records": [], "finals": {}, "orders": []}
    try:
        alive = []
        for label, w in workers.items():
            ready = w.ask(None, args.worker_timeout)
            run["ready"][label] = ready
            print(
                f"{label}: "
                + (
                    ready["error"]
                    if "error" in ready
                    else f"ready in {ready['setup_s']:.1f} s, pid {ready['pid']}, "
                    f"cpus {ready['cpus']}, {ready['build']}"
                ),
                flush=True,
            )
            if "error" not in ready:
                alive.append(label)
        rng = random.Random(args.seed)
        round_s: list[float] = []
        for r in range(-args.warmup_rounds, args.rounds):
            if BASELINE not in alive or len(alive) < 2:
                print("rounds end: PyTorch's worker or every policy's is gone", flush=True)
                break
            spent = time.monotonic() - t_start
            if args.budget_s and round_s and spent + max(round_s[-3:]) > args.budget_s:
                print(f"rounds end: the next would end past --budget-s {args.budget_s:.0f}")
                break
            order = rng.sample(alive, len(alive))
            run["orders"].append({"round": r, "order": order})
            t0 = time.monotonic()
            for position, label in enumerate(order):
                answer = workers[label].ask(
                    {"cmd": "run", "round": r, "warmup": r < 0}, args.worker_timeout
                )
                record = {"allocator": label, "round": r, "position": position, **answer}
                record["warmup"] = r < 0
                run["records"].append(record)
                if "error" in answer:
                    print(f"round {r} {label}: {answer['error']}: dropped", flush=True)
                    alive.remove(label)
                    workers[label].close()
            round_s.append(time.monotonic() - t0)
            print(round_text(run["records"], r), flush=True)
            write_paired(args, run, [label for label, _, _ in entries])
        for label in alive:
            run["finals"][label] = workers[label].ask({"cmd": "stop"}, args.worker_timeout)
            if "malloc_breakdown" in run["finals"][label]:
                b = run["finals"][label]["malloc_breakdown"]
                print(f"{label}: " + generate_breakdown_text(b), flush=True)
    finally:
        for w in workers.values():
            w.close()
    run["wall_s"] = time.monotonic() - t_start
    return run


def _round_seconds(record: dict, shape: str) -> float | None:
    """A record's seconds on ``shape`` (``ALL_SHAPES``: every shape added), or None."""
    if "runs" not in record:
        return None
    runs = {run["shape"]: run["seconds"] for run in record["runs"]}
    if shape == ALL_SHAPES:
        return sum(runs.values())
    return runs.get(shape)


def paired_ratios(
    records: list[dict], label: str, shape: str = ALL_SHAPES, base: str = BASELINE
) -> list[float]:
    """Per timed round that both ran: ``label``'s seconds over ``base``'s (PyTorch's) in the same
    round."""
    by = {(r["allocator"], r["round"]): r for r in records if not r.get("warmup")}
    out = []
    for (name, rnd), rec in sorted(by.items(), key=lambda kv: kv[0][1]):
        base_rec = by.get((base, rnd))
        if name != label or base_rec is None:
            continue
        mine, theirs = _round_seconds(rec, shape), _round_seconds(base_rec, shape)
        if mine is not None and theirs:
            out.append(mine / theirs)
    return out


#: Bootstrap resamples for a median's interval, and the fewest rounds a verdict is drawn from.
N_BOOTSTRAP = 2000
MIN_ROUNDS_FOR_VERDICT = 5


def median_interval(
    values: list[float], *, confidence: float = 0.95, n_boot: int = N_BOOTSTRAP, seed: int = 0
) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of ``values`` (resampled with
    replacement, ``n_boot`` times, seeded: the same values give the same interval)."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(n_boot))
    tail = (1 - confidence) / 2
    return medians[int(tail * (n_boot - 1))], medians[int(round((1 - tail) * (n_boot - 1)))]


def settle(values: list[float], target: float, *, seed: int = 0) -> dict:
    """The median of ``values`` against ``target`` (at most): "met" when the 95 % interval of the
    median is at or below it, "missed" when above it, "not settled" when it straddles it or fewer
    than ``MIN_ROUNDS_FOR_VERDICT`` values were measured."""
    if not values:
        return {"n": 0, "median": None, "lo": None, "hi": None, "verdict": "not settled"}
    lo, hi = median_interval(values, seed=seed)
    verdict = "not settled"
    if len(values) >= MIN_ROUNDS_FOR_VERDICT:
        verdict = "met" if hi <= target else "missed" if lo > target else "not settled"
    return {
        "n": len(values),
        "median": statistics.median(values),
        "lo": lo,
        "hi": hi,
        "verdict": verdict,
    }


def round_text(records: list[dict], r: int) -> str:
    """One round's line: each allocator in the order it ran, seconds and the paired ratio."""
    mine = [rec for rec in records if rec["round"] == r]
    base = next((rec for rec in mine if rec["allocator"] == BASELINE), None)
    parts = []
    for rec in mine:
        s = _round_seconds(rec, ALL_SHAPES)
        if s is None:
            parts.append(f"{rec['allocator']} error")
            continue
        ratio = (
            "" if base is None or rec is base else f" {s / _round_seconds(base, ALL_SHAPES):.3f}x"
        )
        parts.append(f"{rec['allocator']} {s:.3f}s{ratio}")
    return f"round {r}{' (warm-up)' if r < 0 else ''}: " + ", ".join(parts)


def verdict_rows(run: dict, labels: list[str], seed: int = 0) -> list[dict]:
    """Per policy: the paired ratio's median over the timed rounds with its 95 % interval and the
    verdict against ``GENERATE_RATIO_TARGET``; the per-round malloc and free means against
    ``CALL_US_TARGET`` the same way; in how many rounds its tokens equalled PyTorch's."""
    records = run["records"]
    timed = [r for r in records if not r.get("warmup") and "runs" in r]
    base = {r["round"]: r for r in timed if r["allocator"] == BASELINE}
    rows = []
    for label in labels:
        mine = [r for r in timed if r["allocator"] == label and r["round"] in base]
        gen = settle(paired_ratios(records, label), GENERATE_RATIO_TARGET, seed=seed)
        row = {
            "allocator": label,
            "n_rounds": gen["n"],
            "ratio_median": gen["median"],
            "ratio_lo95": gen["lo"],
            "ratio_hi95": gen["hi"],
            "generate_verdict": gen["verdict"],
            "torch_seconds_median": (
                statistics.median(_round_seconds(base[r["round"]], ALL_SHAPES) for r in mine)
                if mine
                else None
            ),
        }
        for call in ("malloc", "free"):
            c = settle(
                [r[f"{call}_mean_us"] for r in mine if f"{call}_mean_us" in r],
                CALL_US_TARGET,
                seed=seed,
            )
            row.update(
                {
                    f"{call}_us_median": c["median"],
                    f"{call}_us_lo95": c["lo"],
                    f"{call}_us_hi95": c["hi"],
                    f"{call}_verdict": c["verdict"] if c["n"] else "",
                }
            )
        equal = [
            {run_["shape"]: run_["tokens_sha"] for run_ in r["runs"]}
            == {run_["shape"]: run_["tokens_sha"] for run_ in base[r["round"]]["runs"]}
            for r in mine
        ]
        row["n_rounds_tokens_equal_torch"] = sum(equal)
        b = run["finals"].get(label, {}).get("malloc_breakdown", {})
        row["gen_malloc_mean_us"] = b.get("gen_malloc_mean_us")
        row["gen_free_mean_us"] = b.get("gen_free_mean_us")
        row["policy_installed"] = run["ready"].get(label, {}).get("policy_installed")
        # against the floor of the same round (``--floor``): what the policy adds over the
        # cheapest allocator PyTorch's pluggable path can call
        to_floor = (
            settle(
                paired_ratios(records, label, base=FLOOR_LABEL), GENERATE_RATIO_TARGET, seed=seed
            )
            if label != FLOOR_LABEL and any(r["allocator"] == FLOOR_LABEL for r in timed)
            else {"median": None, "lo": None, "hi": None}
        )
        row.update(
            ratio_to_floor_median=to_floor["median"],
            ratio_to_floor_lo95=to_floor["lo"],
            ratio_to_floor_hi95=to_floor["hi"],
        )
        rows.append(row)
    return rows


def _paired_as_workers(run: dict) -> list[dict]:
    """The timed rounds as one pseudo-worker per (allocator, round), for ``summarise`` and
    ``write_results`` (their tables stay what the one-process-per-round mode writes), each with
    its worker's final fields; the malloc breakdown on its first round only."""
    out, seen = [], set()
    for rec in run["records"]:
        if rec.get("warmup") or "runs" not in rec:
            continue
        label = rec["allocator"]
        final = run["finals"].get(label, {})
        w = {
            **{k: v for k, v in final.items() if k not in ("malloc_breakdown", "final")},
            "allocator": label,
            "round": rec["round"],
            "runs": rec["runs"],
            "build": run["ready"].get(label, {}).get("build"),
        }
        if "malloc_mean_us" in rec:
            w["alloc_mean_us"], w["free_mean_us"] = rec["malloc_mean_us"], rec["free_mean_us"]
        if label not in seen and "malloc_breakdown" in final:
            w["malloc_breakdown"] = final["malloc_breakdown"]
        seen.add(label)
        out.append(w)
    return out


def write_paired(args, run: dict, labels: list[str]) -> list[dict]:
    """``--persistent``'s tables in ``--out``: ``torch_alloc_rounds.csv`` (one row per round,
    allocator and shape: its place in the round, seconds, tokens equal to PyTorch's that round,
    the round's malloc and free means), ``torch_alloc_verdict.csv`` (``verdict_rows``),
    ``torch_alloc_paired.json`` (everything), and ``write_results``' tables; the verdict rows."""
    args.out.mkdir(parents=True, exist_ok=True)
    base = {
        r["round"]: {run_["shape"]: run_ for run_ in r["runs"]}
        for r in run["records"]
        if r["allocator"] == BASELINE and "runs" in r
    }
    rows = []
    for rec in run["records"]:
        for run_ in rec.get("runs", []):
            theirs = base.get(rec["round"], {}).get(run_["shape"])
            rows.append(
                {
                    "allocator": rec["allocator"],
                    "round": rec["round"],
                    "warmup": rec["warmup"],
                    "position": rec["position"],
                    "shape": run_["shape"],
                    "seconds": run_["seconds"],
                    "ratio_to_torch": run_["seconds"] / theirs["seconds"] if theirs else None,
                    "tokens_sha": run_["tokens_sha"],
                    "tokens_equal_torch": (
                        theirs["tokens_sha"] == run_["tokens_sha"] if theirs else None
                    ),
                    "malloc_mean_us": rec.get("malloc_mean_us"),
                    "free_mean_us": rec.get("free_mean_us"),
                    "n_malloc": rec.get("n_malloc"),
                }
            )
    write_csv(args.out / "torch_alloc_rounds.csv", rows)
    verdicts = verdict_rows(run, labels[1:], seed=args.seed)
    write_csv(args.out / "torch_alloc_verdict.csv", verdicts)
    with open(args.out / "torch_alloc_paired.json", "w") as f:
        json.dump({**run, "verdict": verdicts, "argv": sys.argv[1:]}, f, indent=1, default=str)
    write_results(args, _paired_as_workers(run), labels[1:], None)
    return verdicts


def print_verdicts(rows: list[dict], run: dict) -> None:
    n_timed = len({r["round"] for r in run["records"] if not r.get("warmup")})
    print(
        f"paired rounds: one persistent worker per allocator, pinned to CPUs {run['cpus']}, "
        f"{n_timed} timed rounds in a shuffled order each, {run['wall_s']:.0f} s in all"
    )
    for row in rows:
        if row["ratio_median"] is None:
            print(f"{row['allocator']:>24}: no paired round")
            continue
        calls = "".join(
            f"; {call} {row[f'{call}_us_median']:.2f} us a call (95 % "
            f"{row[f'{call}_us_lo95']:.2f}-{row[f'{call}_us_hi95']:.2f}): "
            f"{row[f'{call}_verdict']} (target {CALL_US_TARGET} us)"
            for call in ("malloc", "free")
            if row[f"{call}_us_median"] is not None
        )
        if row.get("ratio_to_floor_median") is not None:
            calls += (
                f"; {row['ratio_to_floor_median']:.3f}x the floor (95 % "
                f"{row['ratio_to_floor_lo95']:.3f}-{row['ratio_to_floor_hi95']:.3f})"
            )
        print(
            f"{row['allocator']:>24}: generate {row['ratio_median']:.3f}x PyTorch's (95 % "
            f"{row['ratio_lo95']:.3f}-{row['ratio_hi95']:.3f}, {row['n_rounds']} rounds): "
            f"{row['generate_verdict']} (target {GENERATE_RATIO_TARGET}x){calls}; tokens equal "
            f"PyTorch's in {row['n_rounds_tokens_equal_torch']} of {row['n_rounds']} rounds"
        )


def round_order(names: list[str], r: int) -> list[str]:
    """ABAB...: the allocators in order on even rounds and reversed on odd ones, so that drift on
    the machine and the place in the round fall on every allocator alike."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def summarise(workers: list[dict], policies: list[str]) -> list[dict]:
    """One row per (allocator, shape), and per allocator one over all shapes (``ALL_SHAPES``).

    Ratios are paired: each round's seconds (a worker's median over its repeats) over PyTorch's in
    the same round; ``ratio_to_torch`` is their median, ``ratio_min``/``ratio_max`` their spread.
    ``meets_generate`` is ``ratio_to_torch <= GENERATE_RATIO_TARGET``; ``meets_call`` is both mean
    costs (median over rounds) at most ``CALL_US_TARGET``."""
    by: dict[tuple[str, int], dict] = {}
    for w in workers:
        if "error" not in w and not w.get("validate"):
            by[(w["allocator"], w.get("round", 0))] = w
    shapes = list(dict.fromkeys(run["shape"] for w in by.values() for run in w["runs"]))
    rows = []
    for name in dict.fromkeys([BASELINE, *policies]):
        rounds = sorted(r for n, r in by if n == name)
        if not rounds:
            continue
        first = by[(name, rounds[0])]
        for shape in [*shapes, ALL_SHAPES]:
            secs, ratios, tokens, base_tokens = [], [], set(), set()
            for r in rounds:
                mine = {run["shape"]: run for run in by[(name, r)]["runs"]}
                base = by.get((BASELINE, r))
                theirs = {run["shape"]: run for run in base["runs"]} if base else {}
                wanted = shapes if shape == ALL_SHAPES else [shape]
                if not all(k in mine for k in wanted):
                    continue
                sec = sum(mine[k]["seconds"] for k in wanted)
                secs.append(sec)
                if all(k in theirs for k in wanted):
                    ratios.append(sec / sum(theirs[k]["seconds"] for k in wanted))
                for k in wanted:
                    tokens.add((k, mine[k]["tokens_sha"]))
                    if k in theirs:
                        base_tokens.add((k, theirs[k]["tokens_sha"]))
            if not secs:
                continue
            s = first.get("summary", {})
            alloc_us = [
                by[(name, r)]["alloc_mean_us"] for r in rounds if "alloc_mean_us" in by[(name, r)]
            ]
            free_us = [
                by[(name, r)]["free_mean_us"] for r in rounds if "free_mean_us" in by[(name, r)]
            ]
            alloc_mean = statistics.median(alloc_us) if alloc_us else None
            free_mean = statistics.median(free_us) if free_us else None
            ratio = statistics.median(ratios) if ratios else float("nan")
            rows.append(
                {
                    "allocator": name,
                    "build": first.get("build"),
                    "shape": shape,
                    "n_rounds": len(secs),
                    "seconds_median": statistics.median(secs),
                    "seconds_min": min(secs),
                    "seconds_max": max(secs),
                    "ratio_to_torch": ratio,
                    "ratio_min": min(ratios) if ratios else float("nan"),
                    "ratio_max": max(ratios) if ratios else float("nan"),
                    "meets_generate": name != BASELINE and ratio <= GENERATE_RATIO_TARGET,
                    "alloc_mean_us": alloc_mean,
                    "free_mean_us": free_mean,
                    "alloc_mean_us_max": max(alloc_us) if alloc_us else None,
                    "free_mean_us_max": max(free_us) if free_us else None,
                    "meets_call": (
                        alloc_mean is not None
                        and free_mean is not None
                        and max(alloc_mean, free_mean) <= CALL_US_TARGET
                    ),
                    "tokens_equal_torch": tokens == base_tokens if base_tokens else None,
                    "tokens_stable": len(tokens) == len({k for k, _ in tokens})
                    and all("," not in t for _, t in tokens),
                    "peak_reserved_bytes": first.get("peak_reserved_bytes"),
                    "alloc_p50_us": s.get("alloc_p50_us"),
                    "alloc_p99_us": s.get("alloc_p99_us"),
                    "free_p50_us": s.get("free_p50_us"),
                    "free_p99_us": s.get("free_p99_us"),
                    "n_alloc": s.get("n_alloc"),
                    "n_failed": s.get("n_failed"),
                    "n_align_padded": s.get("n_align_padded"),
                    "n_stitched_maps": s.get("n_stitched_maps"),
                    "n_stitch_reuses": s.get("n_stitch_reuses"),
                    "n_idle_evictions": s.get("n_idle_evictions"),
                    "driver_ns_total": s.get("driver_ns_total"),
                    "sync_ns_total": s.get("sync_ns_total"),
                    "device_used_before_bytes": first.get("device_used_before_bytes"),
                    "device_used_after_bytes": first.get("device_used_after_bytes"),
                    "pool_bytes_after": first.get("pool_bytes_after"),
                    "n_live_at_close": s.get("n_live_at_close"),
                    "n_free_errors": s.get("n_free_errors"),
                }
            )
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "-p", "--policy", dest="policies", action="append", help="policy spec (repeatable)"
    )
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument(
        "--rounds", type=int, default=2, help="worker rounds (ABAB: reversed every other round)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="generate calls per shape in each worker (their median)",
    )
    ap.add_argument(
        "--compiled-only",
        action="store_true",
        help="with --compiled, run the policies in the compiled copy only "
        "(PyTorch's run is the same)",
    )
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument(
        "--validate", metavar="SPEC", help="also run SPEC in validation mode on the first shape"
    )
    ap.add_argument(
        "--mempool", action="store_true", help="also run every policy in mempool mode (one process)"
    )
    ap.add_argument("--worker-timeout", type=float, default=300.0)
    ap.add_argument(
        "--calls",
        type=int,
        metavar="N",
        help="no GPU: time N malloc/free pairs through the trampoline per policy, best of --rounds",
    )
    ap.add_argument(
        "--trace",
        type=Path,
        metavar="PATH",
        help="with --calls: replay this allocation trace's requests (sizes, order, lifetimes), "
        "its first N events, instead of the six-size cycle",
    )
    ap.add_argument(
        "--release-gil",
        action="store_true",
        help="with --calls: enter the trampoline without the GIL, as PyTorch's bindings do",
    )
    ap.add_argument(
        "--tree",
        dest="trees",
        type=Path,
        action="append",
        metavar="DIR",
        help="with --calls: also run in DIR, another copy of the tree (the code before a change, "
        "this benchmark copied in), round by round with this one (repeatable)",
    )
    ap.add_argument(
        "--stitch",
        action="store_true",
        help="no GPU: what tensors over scattered pages cost each page policy "
        "(-p) on the bundled slice",
    )
    ap.add_argument(
        "--compiled",
        type=Path,
        metavar="DIR",
        help="also run every policy in DIR, a compiled copy of this tree (build_compiled_copy), "
        "side by side: round by round with --calls, worker by worker otherwise",
    )
    ap.add_argument(
        "--persistent",
        action="store_true",
        help="one worker per allocator for the whole run (model built and warmed once, pinned to "
        "--pin-cpus); each round runs them one at a time in a shuffled order; the verdict is the "
        "median of the paired ratios with a bootstrap 95 %% interval",
    )
    ap.add_argument(
        "--pin-cpus",
        default="auto",
        metavar="CPUS",
        help="with --persistent: the CPUs every worker is pinned to (2,3 or 2-3; auto: the two "
        "highest-numbered this process may use; none)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        metavar="S",
        help="with --persistent: start no round that would end past S seconds since the start",
    )
    ap.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        help="with --persistent: untimed rounds first (default 1)",
    )
    ap.add_argument("--seed", type=int, default=0, help="with --persistent: the shuffle's seed")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="with --persistent: one more worker, exact-size C++ free lists behind PyTorch's "
        "pluggable interface and no Python (benchmarks/torch_floor_alloc.cpp): the floor row, "
        "what PyTorch's pluggable path costs on its own",
    )
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="with --persistent: cpu runs a tiny model on PyTorch's CPU allocator in every "
        "worker (the orchestration's test: no policy can be PyTorch's CPU allocator)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--worker", dest="allocator", help=argparse.SUPPRESS)
    ap.add_argument("--worker-validate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mempool-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.policies = args.policies or list(DEFAULT_POLICIES)
    parse_shapes(args.shapes)
    if args.serve:
        return persistent_worker(args)
    if args.allocator:
        print(json.dumps(worker(args), default=str))
        return 0
    if args.mempool_worker:
        print(json.dumps(mempool_worker(args), default=str))
        return 0
    if args.stitch:
        rows = stitch_bench(args)
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "torch_alloc_stitch.csv", rows)
        return 0
    if args.calls:
        rows = calls_side_by_side(args) if args.compiled or args.trees else calls_bench(args)
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "torch_alloc_calls.csv", rows)
        return 0

    workers = []
    # with --compiled, each policy runs in this tree and in the compiled copy, one after the other
    # (labelled "SPEC (compiled)"), against one PyTorch run per round
    runs = [(BASELINE, BASELINE, REPO)]
    if args.floor:
        if not args.persistent:
            ap.error("--floor needs --persistent")
        runs.append((FLOOR_LABEL, FLOOR, REPO))
    for name in args.policies:
        if not (args.compiled and args.compiled_only):
            runs.append((name, name, REPO))
        if args.compiled:
            runs.append((f"{name} (compiled)", name, args.compiled))
    if args.persistent:
        parse_cpus(args.pin_cpus)  # a bad list: one line, before any worker starts
        run = persistent_bench(args, runs)
        verdicts = write_paired(args, run, [label for label, _, _ in runs])
        print_rows(
            summarise(_paired_as_workers(run), [label for label, _, _ in runs[1:]]),
            "persistent workers: the timed rounds",
        )
        print_verdicts(verdicts, run)
        return 0
    for r in range(args.rounds):
        for label, name, tree in round_order(runs, r):
            w = spawn(args, ["--worker", name], args.worker_timeout, tree)
            w["allocator"] = label
            w.setdefault(
                "build", "compiled" if tree != REPO else "interpreted"
            )  # the worker's own word first
            w["round"] = r
            workers.append(w)
            print(
                f"round {r} {label}: "
                + (
                    w["error"]
                    if "error" in w
                    else " ".join(f"{run['shape']}={run['seconds']:.3f}s" for run in w["runs"])
                ),
                flush=True,
            )
            if "malloc_breakdown" in w:
                print("  " + generate_breakdown_text(w["malloc_breakdown"]), flush=True)
            write_results(
                args, workers, [label for label, _, _ in runs[1:]], None
            )  # a run cut short keeps these
    if args.validate:
        first = args.shapes.split(",")[0]
        w = spawn(
            argparse.Namespace(**{**vars(args), "shapes": first, "rounds": 1}),
            ["--worker", args.validate, "--worker-validate"],
            args.worker_timeout,
        )
        w.setdefault("allocator", args.validate)
        w["validate"] = True
        workers.append(w)
        found = (
            w.get("error") or "; ".join(w.get("free_errors", [])) or "no corruption, no bad free"
        )
        print(f"validate {args.validate}: {found}", flush=True)
    mempool = None
    if args.mempool:
        mempool = spawn(args, ["--mempool-worker"], 2 * args.worker_timeout, args.compiled or REPO)
        print("mempool: " + (mempool.get("error") or f"{len(mempool['runs'])} runs"), flush=True)

    rows, mempool_rows = write_results(args, workers, [label for label, _, _ in runs[1:]], mempool)
    print_rows(rows, "pluggable mode: one worker process per allocator and round")
    if mempool_rows:
        print_rows(
            mempool_rows,
            "mempool mode: PyTorch's allocator and each policy in one process, round by round",
        )
    return 0


def write_results(
    args, workers: list[dict], labels: list[str], mempool: dict | None
) -> tuple[list[dict], list[dict]]:
    """The runs, the summaries and the JSON in ``--out`` (rewritten after every worker); the
    summaries."""
    rows = summarise(workers, labels)
    mempool_rows = (
        summarise(mempool_as_workers(mempool), args.policies)
        if mempool and "runs" in mempool
        else []
    )
    args.out.mkdir(parents=True, exist_ok=True)
    run_rows = [
        {
            "allocator": w["allocator"],
            "round": w["round"] if "round" in w else -1,
            "validate": w.get("validate"),
            **run,
        }
        for w in workers
        if "runs" in w
        for run in w["runs"]
    ]
    write_csv(args.out / "torch_alloc_runs.csv", run_rows)
    write_csv(args.out / "torch_alloc_summary.csv", rows)
    write_csv(
        args.out / "torch_alloc_breakdown.csv",
        [
            {"allocator": w["allocator"], "round": w.get("round", -1), **w["malloc_breakdown"]}
            for w in workers
            if "malloc_breakdown" in w
        ],
    )
    write_csv(args.out / "torch_alloc_mempool_summary.csv", mempool_rows)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "argv": sys.argv[1:],
        "shapes": args.shapes,
        "new_tokens": args.new_tokens,
        "layers": args.layers,
        "rounds": args.rounds,
        "repeats": args.repeats,
    }
    with open(args.out / "torch_alloc.json", "w") as f:
        json.dump(
            {
                "meta": meta,
                "summary": rows,
                "workers": workers,
                "mempool": mempool,
                "mempool_summary": mempool_rows,
            },
            f,
            indent=1,
            default=str,
        )
    return rows, mempool_rows


def print_rows(rows: list[dict], title: str) -> None:
    print(title)
    print(
        f"{'allocator':>24} {'shape':>7} {'s (med)':>8} {'x torch':>7} {'min-max':>11} "
        f"{'alloc us':>8} {'free us':>7} {'targets':>8} tokens="
    )
    for row in rows:
        us = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
        met = (
            ""
            if row["allocator"] == BASELINE
            else (f"{'G' if row['meets_generate'] else '-'}{'C' if row['meets_call'] else '-'}")
        )
        print(
            f"{row['allocator']:>24} {row['shape']:>7} {row['seconds_median']:8.3f} "
            f"{row['ratio_to_torch']:7.3f} {row['ratio_min']:5.2f}-{row['ratio_max']:<5.2f} "
            f"{us(row['alloc_mean_us']):>8} {us(row['free_mean_us']):>7} {met:>8} "
            f"{row['tokens_equal_torch']} peak_reserved={row['peak_reserved_bytes']} "
            f"mem_before={row['device_used_before_bytes']} after={row['device_used_after_bytes']}"
        )
    print(
        f"targets: G = generate <= {GENERATE_RATIO_TARGET}x PyTorch's "
        "(median of the paired ratios), "
        f"C = malloc and free <= {CALL_US_TARGET} us a call (mean through the trampoline)"
    )


if __name__ == "__main__":
    from poollab.cli import run_script

    run_script(main)
