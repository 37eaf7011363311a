"""How much KV cache can an engine allocate? The budget each policy really leaves, from a start-up
snapshot.

An engine's start-up (weights, a profiling run, the KV cache allocation, CUDA-graph capture, a few
steps at the largest batch) recorded as a PyTorch memory snapshot says everything that competes
with the KV cache for device memory. ``plan`` replays that recording (``sim.replay.fidelity``'s
starting state, ``sim.replay.engine.run``: the one loop) under each policy with the KV allocation(s)
resized and the pool limited to the device's memory, and finds the largest KV cache with which the
whole recorded run is served: exact to one page (``page_bytes``: ``block_tokens`` tokens of the
model's KV, split evenly over the KV tensors), by galloping from an estimate and then bisecting.

The KV cache is recognised from the snapshot, or named by the user (``sim.planner.startup_kv``: the
largest burst of equal-size allocations that live to the end). Buffers the engine sizes by the
cache (transformers' ``paged|sdpa`` attention mask: 4 MiB more per 32 MiB block of Llama-3-8B)
are resized with it in every replay: named by the user (``--kv-linked``) or recognised by an
engine preset's rule (``sim.serving.engines.KvLinkedRule``, ``--engine``); ``kv_linked_bytes`` is
their size at the safe KV size.

The device's memory less what the engine's process holds outside PyTorch's allocator (the CUDA
context, cuBLAS, the kernels' modules: no snapshot holds it) is what the pool may reserve. Both
figures come from the JSON beside the snapshot when ``gpu serve --snapshot`` measured them in the
engine's own process (``traces.engine_memory``), else from the caller (``device_memory_of``); each
row says where its figures came from (``device_source``, ``non_torch_source``).

What the rest of the run needs is read from the same replay:

- ``weights_bytes``: requests still live at the end that were made before the first KV allocation,
  the blocks live before recording began included (a snapshot taken after the weights were loaded
  keeps them as blocks never seen allocated: they count as weights/resident).
- ``peak_non_kv_reserved_bytes``: the most the pool reserved beyond the KV blocks it held, at the
  safe size, with ``frag_at_peak`` (the share of that non-KV reservation not holding live data).
- the ``gpu_memory_utilization``-style rule: ``fraction x device - weights - profiled peak``,
  where the profiled peak is the most live bytes beyond the weights before the KV cache was
  allocated (what an engine's profiling run measures), replayed to see whether it fits and at
  which event it would run out of memory.

Whether a KV size fits is assumed monotone (a larger cache never makes the rest fit better). The
search checks both neighbours of its answer: ``safe`` fits and ``safe + 1`` page does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from policies.errors import PolicyError
from policies.torch_caching import spec_from_settings
from policies.units import format_bytes, parse_bytes
from sim.replay import engine
from sim.replay.fidelity import ALLOC, FREE, Recording, read_recording, start_replay
from sim.planner.startup_kv import (
    KvCache,
    KvLinked,
    KvSelector,
    LinkedSelector,
    PlanError,
    parse_kv_linked,
    parse_kv_selector,
    recognise_kv,
    recognise_linked,
    select_kv,
    select_linked,
)
from traces.engine_memory import read_engine_memory, sidecar_path
from traces.errors import TraceFormatError

__all__ = [
    "PLAN_COLUMNS",
    "PLAN_FILE",
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_PAGE_SHARE_BYTES",
    "KvSelector",
    "KvCache",
    "KvLinked",
    "PlanInputs",
    "PolicyPlan",
    "PlanResult",
    "parse_kv_selector",
    "parse_kv_linked",
    "recognise_kv",
    "select_kv",
    "plan_inputs",
    "fits",
    "plan_policy",
    "plan",
    "plan_snapshot",
    "write_plan",
    "read_plan",
    "planned_budgets",
    "PlanError",
    "DeviceMemory",
    "device_memory_of",
]

#: The file ``write_plan`` writes in a plan folder (one row per policy).
PLAN_FILE = "plan.csv"
#: Columns of ``plan.csv`` and ``PlanResult.table()``, in order.
PLAN_COLUMNS = [
    "policy",
    "device_bytes",
    "non_torch_bytes",
    "capacity_bytes",
    "weights_bytes",
    "num_kv_allocs",
    "recorded_kv_bytes",
    "page_bytes",
    "safe_kv_pages",
    "safe_kv_bytes",
    "safe_kv_tokens",
    "engine_num_blocks",
    "num_kv_linked_allocs",
    "kv_linked_bytes",
    "peak_non_kv_reserved_bytes",
    "frag_at_peak",
    "peak_reserved_bytes",
    "margin_bytes",
    "next_page_oom_event",
    "next_page_oom_entry",
    "util_fraction",
    "profiled_peak_bytes",
    "util_rule_kv_bytes",
    "util_rule_fits",
    "util_rule_oom_event",
    "util_rule_oom_entry",
    "util_rule_excess_bytes",
    "model",
    "block_tokens",
    "num_replays",
    "plan_s",
    "device_source",
    "non_torch_source",
]
#: vLLM's KV block (field notes): the page a plan is exact to, in tokens, when a model is given.
DEFAULT_BLOCK_TOKENS = 16
#: Without a model, each KV tensor grows by this much a page: PyTorch rounds large blocks to 2 MiB.
DEFAULT_PAGE_SHARE_BYTES = 2 << 20


# ---------------------------------------------------------------- the inputs shared by every policy
@dataclass
class PlanInputs:
    """A recording and what the plan needs from it, policy-independent.

    Attributes:
        rec: the recording (``sim.replay.fidelity``).
        kv: its KV allocations.
        page_bytes: one page of KV cache (the plan's unit); each KV allocation grows by
            ``page_bytes // len(kv.ops)`` a page.
        block_tokens, kv_bytes_per_token, model: the page in tokens and the model it is from
            (None when no model was given: then no token counts).
        weights_bytes: requested bytes live at the end that were made before the first KV op.
        profiled_peak_bytes: most live bytes beyond ``weights_bytes`` before the first KV op.
        device_bytes, capacity_bytes: the device's memory and what the pool may reserve of it.
        linked: buffers resized with the KV cache (``KvLinked``): each of their allocations holds
            its recorded size plus ``bytes_per_page`` for every page beyond the recorded KV size.
        device_source, non_torch_source: where the device's memory and the memory outside the pool
            came from, in words.
        engine_block_tokens, engine_padding_blocks: the engine's KV block (tokens) and the blocks it
            adds to the ``--num-blocks`` it is given, where the snapshot's JSON says (else None).
    """

    rec: Recording
    kv: KvCache
    page_bytes: int
    block_tokens: int | None
    kv_bytes_per_token: int | None
    model: str | None
    weights_bytes: int
    profiled_peak_bytes: int
    device_bytes: int
    capacity_bytes: int
    linked: tuple[KvLinked, ...] = ()
    device_source: str = ""
    non_torch_source: str = ""
    engine_block_tokens: int | None = None
    engine_padding_blocks: int | None = None

    def engine_num_blocks(self, num_pages: int) -> int | None:
        """The ``--num-blocks`` that makes the engine allocate at most ``num_pages`` of KV (None:
        not known)."""
        if (
            self.block_tokens is None
            or not self.engine_block_tokens
            or self.engine_padding_blocks is None
        ):
            return None
        blocks = (
            num_pages * self.block_tokens // self.engine_block_tokens - self.engine_padding_blocks
        )
        return blocks if blocks > 0 else None

    @property
    def share_bytes(self) -> int:
        """Bytes each KV allocation grows by per page."""
        return self.page_bytes // len(self.kv.ops)

    @property
    def recorded_pages(self) -> float:
        return self.kv.total_bytes / self.page_bytes

    def sizes_for(self, num_pages: int) -> list[int]:
        """The recording's request sizes with every KV allocation holding ``num_pages`` pages."""
        sizes = list(self.rec.sizes)
        nbytes = num_pages * self.share_bytes
        for k in self.kv.ops:
            sizes[k] = nbytes
        for buffer in self.linked:
            for k in buffer.ops:
                sizes[k] = self._linked_size(self.rec.sizes[k], buffer.bytes_per_page, num_pages)
        return sizes

    def _linked_size(self, recorded_bytes: int, bytes_per_page: int, num_pages: int) -> int:
        """A linked allocation's size at ``num_pages`` of KV (at least 1 B: no request is empty)."""
        grown = (
            recorded_bytes
            + (num_pages * self.page_bytes - self.kv.total_bytes)
            * bytes_per_page
            // self.page_bytes
        )
        return max(grown, 1)

    @property
    def num_linked_allocs(self) -> int:
        return sum(len(b.ops) for b in self.linked)

    def linked_bytes(self, num_pages: int) -> int:
        """Requested bytes of every linked allocation at ``num_pages`` of KV (0 without any)."""
        return sum(
            self._linked_size(self.rec.sizes[k], b.bytes_per_page, num_pages)
            for b in self.linked
            for k in b.ops
        )

    def tokens(self, num_pages: int) -> int | None:
        return None if self.block_tokens is None else num_pages * self.block_tokens

    @functools.cached_property
    def alloc_positions(self) -> list[int]:
        """The alloc ops' indices into ``rec.ops``: the n-th allocation a replay makes is op
        ``[n]``."""
        return [k for k, op in enumerate(self.rec.ops) if op == ALLOC]


def _resident_and_profiled(rec: Recording, first_kv: int) -> tuple[int, int]:
    """``(weights_bytes, profiled_peak_bytes)``: see ``PlanInputs``."""
    live: dict[int, int] = {}  # address -> requested bytes, of what is live before the first KV op
    for seg in rec.seed_segments:
        for addr, (_, _, requested) in zip(seg.block_addrs, seg.blocks):
            live[addr] = requested
    for addr, requested, _ in rec.unplaced:
        live[addr] = requested
    live_bytes = peak_before = sum(live.values())
    for k in range(first_kv):
        if rec.ops[k] == ALLOC:
            live[rec.addrs[k]] = rec.sizes[k]
            live_bytes += rec.sizes[k]
            peak_before = max(peak_before, live_bytes)
        elif rec.ops[k] == FREE:
            live_bytes -= live.pop(rec.addrs[k], 0)
    for k in range(first_kv, len(rec.ops)):  # what is freed later was no weight
        if rec.ops[k] == FREE:
            live.pop(rec.addrs[k], None)
    weights = sum(live.values())
    return weights, max(peak_before - weights, 0)


def plan_inputs(
    rec: Recording,
    *,
    device_bytes: int,
    kv: KvCache | None = None,
    model: Any = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    non_torch_bytes: int = 0,
    kv_linked: Iterable[LinkedSelector] = (),
    engine: Any = None,
    device_source: str = "",
    non_torch_source: str = "",
    engine_block_tokens: int | None = None,
    engine_padding_blocks: int | None = None,
) -> PlanInputs:
    """Everything a plan needs from ``rec`` besides the policy.

    Args:
        device_bytes: the device's memory.
        kv: the KV allocations (default: ``recognise_kv``).
        model: a ``sim.replay.models`` preset name, file or ``ModelSpec`` for the page size and
            token counts (None: pages of ``DEFAULT_PAGE_SHARE_BYTES`` per KV tensor, no tokens).
        block_tokens: tokens per page when a model is given.
        non_torch_bytes: device memory outside the pool (CUDA context, NCCL, cuBLAS workspaces):
            the pool may reserve ``device_bytes - non_torch_bytes``.
        kv_linked: buffers the user names as sized by the KV cache (``--kv-linked``).
        engine: a ``sim.serving.engines`` preset (name or ``EnginePreset``) whose ``kv_linked``
            rules recognise such buffers (needs ``model``: the rules are per KV token).
        device_source, non_torch_source, engine_block_tokens, engine_padding_blocks: as
            ``PlanInputs``
            (``device_memory_of``).
    """
    if not rec.ops:
        raise PlanError(
            f"{rec.source}: the snapshot has no allocation trace "
            "(record with torch.cuda.memory._record_memory_history() before the engine starts)"
        )
    kv = recognise_kv(rec) if kv is None else kv
    if device_bytes <= 0 or non_torch_bytes < 0 or non_torch_bytes >= device_bytes:
        raise PlanError(
            f"device memory {device_bytes} B with {non_torch_bytes} B outside "
            "the pool leaves nothing for it"
        )
    per_token = name = None
    if model is not None:
        from sim.replay.models import load_model

        spec = load_model(model)
        per_token, name = int(spec.kv_bytes_per_token), spec.name
        if block_tokens < 1:
            raise PlanError(f"--block-tokens {block_tokens} must be >= 1")
        page = block_tokens * per_token
        if page % len(kv.ops):
            raise PlanError(
                f"a page of {name} ({block_tokens} tokens x {per_token:,} B) does not split evenly "
                f"over the {len(kv.ops)} KV allocations of the snapshot: "
                f"is the snapshot of {name}? (--model, or --kv to name the KV tensors)"
            )
    else:
        page = DEFAULT_PAGE_SHARE_BYTES * len(kv.ops)
    linked = select_linked(rec, kv, kv_linked)
    if engine is not None:
        linked += _engine_linked(
            rec,
            kv,
            engine,
            kv_bytes_per_token=per_token,
            block_tokens=block_tokens,
            named={k for b in linked for k in b.ops},
        )
    weights, profiled = _resident_and_profiled(rec, kv.ops[0])
    return PlanInputs(
        rec,
        kv,
        page,
        block_tokens if model is not None else None,
        per_token,
        name,
        weights,
        profiled,
        device_bytes,
        device_bytes - non_torch_bytes,
        tuple(linked),
        device_source,
        non_torch_source,
        engine_block_tokens,
        engine_padding_blocks,
    )


def _engine_linked(
    rec: Recording,
    kv: KvCache,
    engine: Any,
    *,
    kv_bytes_per_token: int | None,
    block_tokens: int,
    named: set[int],
) -> list[KvLinked]:
    """The buffers ``engine``'s ``kv_linked`` rules recognise in ``rec`` (those the user named
    aside)."""
    from sim.serving.engines import EnginePreset, load_engine

    preset = engine if isinstance(engine, EnginePreset) else load_engine(engine)
    if not preset.kv_linked:
        return []
    if kv_bytes_per_token is None:
        raise PlanError(
            f"--engine {preset.name}: its KV-linked buffers are sized per KV token: give --model"
        )
    if kv.total_bytes % kv_bytes_per_token:
        raise PlanError(
            f"--engine {preset.name}: the KV cache "
            f"({kv.total_bytes:,} B) is no whole number of tokens of {kv_bytes_per_token:,} B: "
            "is the snapshot of this model?"
        )
    tokens = kv.total_bytes // kv_bytes_per_token
    out = []
    for rule in preset.kv_linked:
        found = recognise_linked(
            rec,
            kv,
            name=f"{preset.name} {rule.name}",
            recorded_tokens=tokens,
            bytes_per_token=rule.bytes_per_token,
            fixed_bytes=rule.fixed_bytes,
            block_tokens=block_tokens,
        )
        if found is not None and not named & set(found.ops):
            out.append(found)
    return out


# ---------------------------------------------------------------------------- one replay
class _Refused(Exception):
    """An allocation the pool refused: the recorded run does not fit (stops the replay)."""


@dataclass
class Fit:
    """One replay at ``num_pages``: whether every request was served, else the op that was refused
    (index into ``Recording.ops``; ``at_start``: the starting allocations alone did not fit)."""

    num_pages: int
    fits: bool
    oom_op: int | None = None
    at_start: bool = False
    peak_reserved_bytes: int = 0
    peak_non_kv_reserved_bytes: int = 0
    peak_event: int | None = None
    frag_at_peak: float = float("nan")
    measured: bool = False


def fits(inputs: PlanInputs, spec: str, num_pages: int, *, measure: bool = False) -> Fit:
    """Replay the recording under ``spec`` with ``num_pages`` of KV, the pool limited to the
    capacity.

    Stops at the first refused request. ``measure`` also follows the non-KV reservation after
    every event (slower: the engine's general loop): its peak, where it was, and the share of
    it not holding live data then.
    """
    rec, kv_ops = inputs.rec, set(inputs.kv.ops)
    try:
        started = start_replay(rec, spec, capacity_bytes=inputs.capacity_bytes)
    except PolicyError as exc:
        try:  # too little memory for the starting state, or a policy that cannot hold it at all?
            start_replay(rec, spec)
        except PolicyError:
            raise PlanError(
                f"{spec} cannot start from {rec.source}'s state when recording began ({exc})"
            ) from None
        return Fit(num_pages, False, at_start=True)
    pool = started.pool
    sizes = inputs.sizes_for(num_pages)
    alloc_positions = inputs.alloc_positions
    counter = itertools.count()
    pool_allocate = pool.allocate

    def allocate(nbytes: int, stream: int = 0, tag: str | None = None):
        next(counter)
        a = pool_allocate(nbytes, stream=stream, tag=tag)
        if a is None:
            raise _Refused
        return a

    target = dataclasses.replace(engine.policy_target(pool), allocate=allocate)
    peak = {"non_kv": pool.reserved_bytes, "event": None, "frag": float("nan")}
    kv_held = 0
    live = started.live
    observe: Callable[[int, int], None] | None = None
    offset = 0
    if measure:

        def observe(i: int, _t: int) -> None:
            nonlocal kv_held
            k = offset + i
            if k in kv_ops:
                kv_held += live[rec.addrs[k]].size_bytes
            non_kv = pool.reserved_bytes - kv_held
            if non_kv > peak["non_kv"]:
                peak["non_kv"], peak["event"] = non_kv, k
                peak["frag"] = (
                    (pool.reserved_bytes - pool.allocated_bytes) / non_kv if non_kv else 0.0
                )

    def unknown_free(i: int, addr: int) -> Exception:
        return TraceFormatError(
            rec.source,
            rec.entries[offset + i],
            f"frees {addr:#x}, which is not live",
            unit=rec.entry_unit,
        )

    # runs between the private-pool calls (a capture window's begin and end), so no per-event hook
    # is needed
    cuts = sorted(k for k in started.pool_calls if 0 < k < len(rec.ops))
    bounds = list(zip([0] + cuts, cuts + [len(rec.ops)]))
    try:
        for start, stop in bounds:
            offset = start
            started.pool_call(start)
            engine.run(
                rec.ops[start:stop],
                rec.addrs[start:stop],
                sizes[start:stop],
                streams=rec.streams[start:stop],
                target=target,
                live=live,
                observe=observe,
                unknown_free=unknown_free,
                latency_sample=1e-9,
            )
    except _Refused:
        num_served = next(counter) - 1  # the refused call was counted too
        return Fit(
            num_pages,
            False,
            oom_op=alloc_positions[num_served],
            peak_reserved_bytes=pool.peak_reserved_bytes,
            measured=measure,
        )
    return Fit(
        num_pages,
        True,
        peak_reserved_bytes=pool.peak_reserved_bytes,
        peak_non_kv_reserved_bytes=peak["non_kv"],
        peak_event=peak["event"],
        frag_at_peak=peak["frag"],
        measured=measure,
    )


# ---------------------------------------------------------------------------- the search
@dataclass
class PolicyPlan:
    """The plan of one policy (see ``PLAN_COLUMNS``; ``safe`` is the measured replay at the
    answer)."""

    spec: str
    inputs: PlanInputs
    safe_pages: int
    safe: Fit | None
    next_page: Fit
    util_fraction: float
    util_pages: int
    util: Fit | None
    num_replays: int
    plan_s: float

    def row(self) -> dict[str, Any]:
        i, safe = self.inputs, self.safe
        entry = lambda k: i.rec.entries[k] if k is not None else None
        util_bytes = self.util_pages * i.page_bytes
        return {
            "policy": self.spec,
            "device_bytes": i.device_bytes,
            "non_torch_bytes": i.device_bytes - i.capacity_bytes,
            "capacity_bytes": i.capacity_bytes,
            "weights_bytes": i.weights_bytes,
            "num_kv_allocs": len(i.kv.ops),
            "recorded_kv_bytes": i.kv.total_bytes,
            "page_bytes": i.page_bytes,
            "safe_kv_pages": self.safe_pages,
            "safe_kv_bytes": self.safe_pages * i.page_bytes,
            "safe_kv_tokens": i.tokens(self.safe_pages),
            "engine_num_blocks": i.engine_num_blocks(self.safe_pages),
            "num_kv_linked_allocs": i.num_linked_allocs,
            "kv_linked_bytes": i.linked_bytes(self.safe_pages) if self.safe_pages else 0,
            "peak_non_kv_reserved_bytes": safe.peak_non_kv_reserved_bytes if safe else None,
            "frag_at_peak": safe.frag_at_peak if safe else None,
            "peak_reserved_bytes": safe.peak_reserved_bytes if safe else None,
            "margin_bytes": i.capacity_bytes - safe.peak_reserved_bytes if safe else None,
            "next_page_oom_event": self.next_page.oom_op,
            "next_page_oom_entry": entry(self.next_page.oom_op),
            "util_fraction": self.util_fraction,
            "profiled_peak_bytes": i.profiled_peak_bytes,
            "util_rule_kv_bytes": util_bytes,
            "util_rule_fits": self.util.fits if self.util is not None else None,
            "util_rule_oom_event": self.util.oom_op if self.util is not None else None,
            "util_rule_oom_entry": entry(self.util.oom_op) if self.util is not None else None,
            "util_rule_excess_bytes": util_bytes - self.safe_pages * i.page_bytes,
            "model": i.model,
            "block_tokens": i.block_tokens,
            "num_replays": self.num_replays,
            "plan_s": self.plan_s,
            "device_source": i.device_source,
            "non_torch_source": i.non_torch_source,
        }


def plan_policy(
    inputs: PlanInputs, spec: str, *, util_fraction: float = 0.9, progress: bool = False
) -> PolicyPlan:
    """The largest KV size (in pages) with which ``spec`` serves the whole recording.

    Replays the recorded size first (the engine sized its cache near the limit), then the
    estimate it gives (capacity minus the non-KV reservation it measured), gallops out from the
    known end in steps of 1, 2, 4, ... pages and bisects; ``safe`` fits and ``safe + 1`` does not.
    Also replays the ``gpu_memory_utilization`` rule's pick (``util_fraction``).
    """
    with _replay_bar(f"{inputs.rec.name} · {spec}", progress) as tick:
        return _search(inputs, spec, util_fraction, tick)


@contextlib.contextmanager
def _replay_bar(title: str, show: bool):
    """A progress bar counting one policy's replays (``sim.replay.progress``: on a terminal only),
    and its tick."""
    from sim.replay.progress import progress_bar

    with progress_bar(None, title, unit="replay", enabled=show, unit_scale=False) as bar:

        def tick(fit: Fit) -> None:
            bar.set_postfix_str(f"{fit.num_pages:,} pages {'fit' if fit.fits else 'do not fit'}")
            bar.update(1)

        yield tick


def _search(
    inputs: PlanInputs, spec: str, util_fraction: float, tick: Callable[[Fit], None]
) -> PolicyPlan:
    t0 = time.perf_counter()
    cache: dict[int, Fit] = {}

    def check(n: int) -> Fit:
        if n not in cache:
            cache[n] = fits(
                inputs, spec, n, measure=True
            )  # measured: its peak costs no second replay
            tick(cache[n])
        return cache[n]

    max_pages = inputs.capacity_bytes // inputs.page_bytes + 1  # more KV than capacity never fits
    lo, hi = (
        0,
        max_pages + 1,
    )  # lo fits (0: nothing is known to); hi does not (or is past every size worth trying)
    start = min(
        max(int(inputs.recorded_pages), 1), max_pages
    )  # where the engine sized it: usually close
    first = check(start)
    if first.fits:
        lo = start
        guess = min(
            max(
                (inputs.capacity_bytes - first.peak_non_kv_reserved_bytes) // inputs.page_bytes, lo
            ),
            max_pages,
        )
        if guess > lo:
            if check(guess).fits:
                lo = guess
            else:
                hi = guess
    else:
        hi = start
    step = 1
    while hi - lo > 1 and (
        lo == 0 or hi == max_pages + 1
    ):  # gallop out from the bracket's known end
        if lo > 0:
            n = min(lo + step, hi - 1)
            if check(n).fits:
                lo = n
            else:
                hi = n
        else:
            n = max(hi - step, 1)
            if check(n).fits:
                lo = n
            else:
                hi = n
                if n == 1:
                    break
        step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check(mid).fits:
            lo = mid
        else:
            hi = mid
    safe_pages = lo
    safe = cache[lo] if lo > 0 else None
    nxt = check(lo + 1)
    budget = util_fraction * inputs.device_bytes - inputs.weights_bytes - inputs.profiled_peak_bytes
    util_pages = max(int(budget // inputs.page_bytes), 0)
    util = check(util_pages) if util_pages > 0 else None
    return PolicyPlan(
        spec,
        inputs,
        safe_pages,
        safe,
        nxt,
        util_fraction,
        util_pages,
        util,
        len(cache),
        time.perf_counter() - t0,
    )


@dataclass
class PlanResult:
    """Every policy's plan for one recording."""

    inputs: PlanInputs
    plans: list[PolicyPlan]
    util_fraction: float

    def table(self) -> pd.DataFrame:
        """One row per policy, ``PLAN_COLUMNS``."""
        return pd.DataFrame([p.row() for p in self.plans], columns=PLAN_COLUMNS)

    def describe_oom(self, k: int | None) -> str:
        """Where op ``k`` is in the recording, in words (trace entry, size, stream, phase)."""
        if k is None:
            return ""
        rec, kv = self.inputs.rec, self.inputs.kv
        linked = {j for b in self.inputs.linked for j in b.ops}
        phase = (
            "the KV cache allocation"
            if k in kv.ops
            else "a buffer sized by the KV cache"
            if k in linked
            else "before the KV cache (profiling)"
            if k < kv.ops[0]
            else "after the KV cache"
        )
        return (
            f"event {k:,} ({rec.entry_unit} {rec.entries[k]:,}): "
            f"{format_bytes(rec.sizes[k])} on stream {rec.streams[k]}, {phase}"
        )


def plan(
    rec: Recording,
    specs: Iterable[str] | None = None,
    *,
    device_bytes: int,
    kv: Iterable[KvSelector] = (),
    model: Any = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    non_torch_bytes: int = 0,
    util_fraction: float = 0.9,
    progress: bool = False,
    kv_linked: Iterable[LinkedSelector] = (),
    engine: Any = None,
    device_source: str = "",
    non_torch_source: str = "",
    engine_block_tokens: int | None = None,
    engine_padding_blocks: int | None = None,
) -> PlanResult:
    """Plan the KV cache of ``rec`` under each spec (default: ``torch-caching`` with the snapshot's
    settings). See the module docstring; arguments as ``plan_inputs`` and ``plan_policy``."""
    if not 0 < util_fraction <= 1:
        raise PlanError(f"--utilization {util_fraction} must be in (0, 1]")
    cache = select_kv(rec, kv) if rec.ops else None
    inputs = plan_inputs(
        rec,
        device_bytes=device_bytes,
        kv=cache,
        model=model,
        block_tokens=block_tokens,
        non_torch_bytes=non_torch_bytes,
        kv_linked=kv_linked,
        engine=engine,
        device_source=device_source,
        non_torch_source=non_torch_source,
        engine_block_tokens=engine_block_tokens,
        engine_padding_blocks=engine_padding_blocks,
    )
    spec_list = list(specs or []) or [spec_from_settings(rec.settings)]
    return PlanResult(
        inputs,
        [plan_policy(inputs, s, util_fraction=util_fraction, progress=progress) for s in spec_list],
        util_fraction,
    )


@dataclass(frozen=True)
class DeviceMemory:
    """The memory a plan fits the recorded run into, and where each figure came from (in words)."""

    device_bytes: int
    device_source: str
    non_torch_bytes: int
    non_torch_source: str
    engine_block_tokens: int | None = (
        None  # the engine's KV block and its padding blocks, where the JSON says
    )
    engine_padding_blocks: int | None = None


#: The non-PyTorch source when nothing measured it (``{why}``: no file, or no figure in it): the
#: plan is then optimistic by that much.
UNMEASURED_NON_TORCH = (
    "none measured ({why}): 0 B assumed, "
    "so the plan is optimistic by the CUDA context and libraries' memory "
    "(0.72 GiB in an engine's process on an H200): record with `poollab gpu serve --snapshot`, "
    "or give --non-torch"
)


def device_memory_of(
    snapshot: str | Path,
    *,
    device_bytes: int | None = None,
    device_source: str = "",
    non_torch_bytes: int | None = None,
    non_torch_source: str = "",
    default_device: tuple[int, str] | None = None,
) -> DeviceMemory:
    """The device's memory and what lies outside the pool for a plan of ``snapshot``: the figures
    given (not None) win; else those the engine's process measured, from the JSON beside the
    snapshot (``traces.engine_memory``; TraceFormatError when it is malformed); else
    ``default_device`` for the device and 0 B outside the pool, said to be unmeasured."""
    found = read_engine_memory(snapshot)
    if device_bytes is None:
        if found is not None and found.total_bytes:
            device_bytes = found.total_bytes
            device_source = f"cudaMemGetInfo's total in the engine's process, {found.path.name}"
        elif default_device is not None:
            device_bytes, device_source = default_device
        else:
            raise PlanError(
                f"{snapshot}: no device memory given and none beside the snapshot "
                f"({sidecar_path(snapshot).name})"
            )
    if non_torch_bytes is None:
        if found is not None and found.non_torch_bytes is not None:
            non_torch_bytes, non_torch_source = found.non_torch_bytes, found.describe_non_torch()
        else:
            non_torch_bytes = 0
            name = sidecar_path(snapshot).name
            non_torch_source = UNMEASURED_NON_TORCH.format(
                why=f"{name} has no non_torch_bytes"
                if found is not None
                else f"no {name} beside the snapshot"
            )
    return DeviceMemory(
        device_bytes,
        device_source,
        non_torch_bytes,
        non_torch_source,
        found.block_tokens if found is not None else None,
        found.padding_blocks if found is not None else None,
    )


def plan_snapshot(
    path: str | Path,
    specs: Iterable[str] | None = None,
    *,
    device: int | None = None,
    memory: DeviceMemory | None = None,
    **kwargs: Any,
) -> PlanResult:
    """``plan`` of the snapshot file at ``path`` (``device``: which device's trace). Its memory:
    ``memory``, else ``device_memory_of(path)`` with the ``device_bytes`` / ``non_torch_bytes``
    given (each None or absent: the figures beside the snapshot)."""
    if memory is None:
        memory = device_memory_of(
            path,
            device_bytes=kwargs.pop("device_bytes", None),
            non_torch_bytes=kwargs.pop("non_torch_bytes", None),
        )
    return plan(
        read_recording(path, device=device),
        specs,
        device_bytes=memory.device_bytes,
        non_torch_bytes=memory.non_torch_bytes,
        device_source=memory.device_source,
        non_torch_source=memory.non_torch_source,
        engine_block_tokens=memory.engine_block_tokens,
        engine_padding_blocks=memory.engine_padding_blocks,
        **kwargs,
    )


# ---------------------------------------------------------------------------- plan.csv
def write_plan(out_dir: str | Path, result: PlanResult) -> Path:
    """Write ``plan.csv`` into ``out_dir``, all or nothing (``traces.atomic.replacing_folder``)."""
    from traces.atomic import replacing_folder

    out_dir = Path(out_dir)
    with replacing_folder(out_dir, carry=lambda entry: entry.name != PLAN_FILE) as tmp:
        result.table().to_csv(tmp / PLAN_FILE, index=False)
    return out_dir / PLAN_FILE


def read_plan(path: str | Path) -> pd.DataFrame:
    """A plan folder's ``plan.csv`` (or the file itself); TraceFormatError naming the file (and
    line) when it is not one (no ``policy`` / ``safe_kv_bytes`` column, a budget that is no whole
    number of bytes)."""
    path = Path(path)
    if path.is_dir():
        path = path / PLAN_FILE
    try:
        table = pd.read_csv(path)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise TraceFormatError(
            path, None, f"not a plan.csv ({type(exc).__name__}: {exc})"
        ) from None
    missing = [c for c in ("policy", "safe_kv_bytes") if c not in table.columns]
    if missing:
        raise TraceFormatError(
            path,
            1,
            f"not a plan.csv: no column {missing[0]!r} (write one with `poollab plan --out`)",
        )
    budgets = []
    for k, value in enumerate(table["safe_kv_bytes"].tolist()):
        budget = _whole_bytes(value)
        if budget is None:
            raise TraceFormatError(
                path,
                k + 2,
                f"safe_kv_bytes {value!r} of policy {table['policy'][k]!r} is no whole number "
                "of bytes",
            )
        budgets.append(budget)
    table["safe_kv_bytes"] = pd.Series(budgets, dtype="int64", index=table.index)
    return table


def _whole_bytes(value: Any) -> int | None:
    """A CSV cell (a number, or text where the column is mixed) as bytes (``parse_bytes``); None if
    it is none."""
    if isinstance(value, float) and value == value and value.is_integer() and abs(value) < 2**63:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    try:
        nbytes = parse_bytes(value)
    except PolicyError:
        return None
    return nbytes if nbytes < 2**63 else None


def planned_budgets(table: pd.DataFrame, specs: Iterable[str], *, source: str) -> dict[str, int]:
    """Each spec's ``safe_kv_bytes`` from a plan table (the row of that policy); PlanError naming
    the spec when the plan has no row for it (and the policies it has) or found no KV size for
    it."""
    by_policy = dict(zip(table["policy"].astype(str), table["safe_kv_bytes"]))
    out = {}
    for spec in specs:
        if spec not in by_policy:
            raise PlanError(
                f"{source}: no plan for policy {spec!r} (it has {', '.join(by_policy)}): "
                f"plan it with `poollab plan SNAPSHOT -p {spec}`"
            )
        if by_policy[spec] <= 0:
            raise PlanError(
                f"{source}: the plan found no KV size with which {spec} serves the recorded run "
                "(see `poollab plan`)"
            )
        out[spec] = int(by_policy[spec])
    return out
