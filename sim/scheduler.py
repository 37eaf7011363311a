"""Iteration-level (continuous) batching, FCFS, in the manner of vLLM's scheduler.

Each step, in order:

1. Running requests, oldest first, each get their next tokens (one when decoding, a chunk of the
   prompt when prefilling) within the step's token budget. A request whose KV cache cannot grow
   preempts the newest running request (``recompute``: its KV is dropped and it is requeued at
   the front; ``swap``: its KV is copied to host memory at PCIe speed) until it fits, or is
   preempted itself. A request that cannot grow while it runs alone can never finish: it is
   rejected.
2. Unless someone was preempted this step, swapped-out requests come back first, then waiting
   requests are admitted in arrival order while seats (``max_num_seqs``), budget and memory
   last. Admission keeps ``watermark`` of the KV budget free, so a new request does not push a
   running one out at its next token (vLLM's admission watermark).

Requests that can never fit (their KV peak exceeds the whole KV budget, or a prompt exceeds the
step budget without chunked prefill) are rejected on arrival and counted, never looped on. Each
rejection carries a kind (``REJECT_KINDS``: what a summary groups by) and a sentence with its
numbers.

A step whose plan the KV memory limited (an admission or swap-in that did not fit, a running
request that preempted or was preempted) is marked ``StepPlan.kv_blocked``: the steps where the
pool is under pressure, over which the server takes ``kv_token_util_pressure``.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sim.kv import KVHandle

if TYPE_CHECKING:
    from sim.config import ServerConfig

__all__ = ["Request", "RequestState", "StepPlan", "Scheduler", "PREEMPTION_MODES", "REJECT_KINDS"]

PREEMPTION_MODES = ("recompute", "swap")

#: Why requests are rejected: kind -> what it means (a summary's ``rejected_by`` names kinds).
REJECT_KINDS = {
    "prompt>=max_model_len": "the prompt leaves no room to generate below max_model_len",
    "kv>budget": "the request's KV peak exceeds the whole KV budget",
    "prompt>step_budget": "the prompt exceeds max_num_batched_tokens and chunked prefill is off",
    "kv_cannot_grow": "its KV cache could not grow even with the pool to itself",
}


class RequestState(enum.Enum):
    """Where a request is; the value is what the request table's ``status`` column says."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"
    REJECTED = "rejected"


@dataclass(slots=True, eq=False)
class Request:
    """One request's progress.

    ``num_tokens`` is what is known (prompt + generated so far); ``num_computed`` of them have
    their KV in memory. A step computes ``num_new`` more; when it reaches ``num_tokens`` a token
    is generated. Times are simulated seconds.
    """

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    kv: KVHandle
    num_tokens: int = 0
    num_computed: int = 0
    num_generated: int = 0
    num_new: int = 0
    first_token_s: float = math.nan
    finish_s: float = math.nan
    num_preemptions: int = 0
    num_swaps: int = 0
    prefix_hit_tokens: int = 0
    status: RequestState = RequestState.WAITING
    reject_kind: str = ""  # a key of REJECT_KINDS
    reject_reason: str = ""  # the same with this request's numbers


@dataclass(slots=True)
class StepPlan:
    """What one step computes, in the step-time model's terms, plus its transfers.

    Built by ``Scheduler.schedule`` and passed explicitly to whatever changes it (preemptions
    add their swap-outs, ``Scheduler.unschedule_last`` takes a request off): the scheduler keeps
    no reference to it.
    """

    scheduled: list[Request] = field(default_factory=list)
    prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    prefill_context_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    num_preemptions: int = 0  # requests preempted while this plan was built or trimmed
    kv_blocked: bool = False  # KV memory refused something this step (admission, swap-in or growth)

    @property
    def num_batched_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    def add(self, r: Request, num_new: int) -> None:
        """Schedule ``num_new`` tokens of ``r`` (before ``r.num_computed`` advances)."""
        r.num_new = num_new
        self.scheduled.append(r)
        self._count(r, 1)

    def pop(self) -> Request:
        """Take the last scheduled request off, undoing what ``add`` counted."""
        r = self.scheduled.pop()
        self._count(r, -1)
        return r

    def _count(self, r: Request, sign: int) -> None:
        # a decode step computes the one token generated last; anything else is (chunked) prefill
        # (Scheduler.schedule inlines this for running requests: change both together)
        if r.num_new == 1 and r.num_generated and r.num_computed == r.num_tokens - 1:
            self.decode_seqs += sign
            self.context_tokens += sign * r.num_computed
        else:
            self.prefill_tokens += sign * r.num_new
            self.num_prefill_seqs += sign
            self.prefill_context_tokens += sign * r.num_computed


class Scheduler:
    """FCFS continuous batching over a KV manager (``sim.kv``).

    Args:
        kv: the KV-cache manager.
        config: the server's settings; the scheduler reads ``max_num_seqs``,
            ``max_num_batched_tokens``, ``chunked_prefill``, ``watermark`` (share of the KV
            budget admission keeps free), ``preemption``, ``swap_space_bytes`` (a victim that does
            not fit there is recomputed instead) and ``max_model_len`` (resolved: not None; a
            prompt this long or longer is rejected, it leaves no room to generate).
    """

    def __init__(self, kv, config: ServerConfig):
        assert config.max_model_len is not None, "simulate() resolves max_model_len"
        self.kv = kv
        self.config = config
        self.watermark_bytes = int(config.watermark * kv.budget_bytes)
        self.waiting: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []
        self.rejected: list[Request] = []
        self.num_finished = 0
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.host_swap_bytes = 0
        #: tokens whose KV running requests hold outside shared prefix blocks (for kv_token_util)
        self.num_own_tokens = 0

    # ------------------------------------------------------------------ arrivals
    def add(self, r: Request) -> bool:
        """A request arrives; False (and counted) when it can never be served."""
        kind, reason = self._never_fits(r)
        if kind:
            self._reject(r, kind, reason)
            return False
        self.waiting.append(r)
        return True

    def _never_fits(self, r: Request) -> tuple[str, str]:
        """``(kind, reason)`` when ``r`` can never be served, else ``("", "")``."""
        if r.prompt_tokens >= self.config.max_model_len:
            return ("prompt>=max_model_len", f"prompt of {r.prompt_tokens} tokens leaves no room below "
                    f"max_model_len={self.config.max_model_len}")
        peak = self.kv.peak_bytes(r.prompt_tokens, r.output_tokens)
        if peak > self.kv.budget_bytes:
            return "kv>budget", f"needs {peak} B of KV cache, more than the whole budget of {self.kv.budget_bytes} B"
        if not self.config.chunked_prefill and r.prompt_tokens > self.config.max_num_batched_tokens:
            return ("prompt>step_budget", f"prompt of {r.prompt_tokens} tokens exceeds max_num_batched_tokens="
                    f"{self.config.max_num_batched_tokens} without chunked prefill")
        return "", ""

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan:
        """Choose the next step's work and reserve its KV slots."""
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        running = self.running
        scheduled = plan.scheduled
        # StepPlan.add inlined (the loop runs once per running request per step), its counts
        # kept in locals and stored once: preemptions below change the plan's other fields only
        decode_seqs = context_tokens = prefill_tokens = num_prefill_seqs = prefill_context_tokens = 0
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            c = r.num_computed
            n = r.num_tokens - c
            if n > budget:  # only a chunked prefill can be longer than one token here
                n = budget
            total = c + n
            if total > r.kv.capacity_tokens and not self._grow_or_preempt(plan, r, total):
                break  # r was preempted: it was the newest, so nobody is left behind it
            r.num_new = n
            scheduled.append(r)
            if n == 1 and r.num_generated and c == r.num_tokens - 1:  # as StepPlan._count
                decode_seqs += 1
                context_tokens += c
            else:
                prefill_tokens += n
                num_prefill_seqs += 1
                prefill_context_tokens += c
            budget -= n
            i += 1
        plan.decode_seqs, plan.context_tokens = decode_seqs, context_tokens
        plan.prefill_tokens, plan.num_prefill_seqs, plan.prefill_context_tokens = (
            prefill_tokens, num_prefill_seqs, prefill_context_tokens)
        if not plan.num_preemptions:
            budget = self._swap_in(plan, budget)
            if not self.swapped:
                self._admit(plan, budget)
        return plan

    def _grow_or_preempt(self, plan: StepPlan, r: Request, total: int) -> bool:
        """Grow ``r``'s KV to ``total`` slots, preempting the newest running requests as needed.

        Returns False when ``r`` itself was preempted (or rejected: it ran alone and still did
        not fit, so it never will).
        """
        kv, running = self.kv, self.running
        while not kv.grow(r.kv, total, r.num_computed):
            plan.kv_blocked = True
            victim = running.pop()
            if victim is r:
                if not running and not kv.held_elsewhere():
                    self._drop_kv(r)
                    self._reject(r, "kv_cannot_grow", f"its KV cache cannot grow to {total} tokens even running alone")
                else:
                    self._preempt(plan, r)
                return False
            self._preempt(plan, victim)
        return True

    def _preempt(self, plan: StepPlan, r: Request) -> None:
        """Take ``r`` off the GPU: swap its KV out (charged to ``plan``), or drop it to recompute later."""
        plan.num_preemptions += 1
        self.num_preemptions += 1
        r.num_preemptions += 1
        nbytes = r.num_computed * self.kv.bytes_per_token
        swap = self.config.preemption == "swap" and r.num_computed > 0 and (
            self.config.swap_space_bytes is None or self.host_swap_bytes + nbytes <= self.config.swap_space_bytes)
        self._drop_kv(r)
        if swap:
            self.num_swap_outs += 1
            r.num_swaps += 1
            self.host_swap_bytes += nbytes
            plan.swap_out_bytes += nbytes
            r.status = RequestState.SWAPPED
            self.swapped.appendleft(r)  # victims go newest first, so earlier arrivals end up in front
        else:
            r.num_computed = 0
            r.status = RequestState.WAITING
            self.waiting.appendleft(r)

    def _drop_kv(self, r: Request) -> None:
        self.num_own_tokens -= max(0, r.num_computed - r.kv.prefix_tokens)
        self.kv.free(r.kv)

    def _reject(self, r: Request, kind: str, reason: str) -> None:
        r.status = RequestState.REJECTED
        r.reject_kind = kind
        r.reject_reason = reason
        self.rejected.append(r)

    def _fits(self, h: KVHandle, total: int) -> bool:
        """Admission test: the new KV leaves the watermark free (waived when nothing else runs)."""
        if not self.running:
            return True
        return self.kv.free_bytes() - self.kv.estimate_bytes(h, total) >= self.watermark_bytes

    def _swap_in(self, plan: StepPlan, budget: int) -> int:
        kv, running, swapped = self.kv, self.running, self.swapped
        while swapped and len(running) < self.config.max_num_seqs and budget > 0:
            r = swapped[0]
            n = min(r.num_tokens - r.num_computed, budget)
            total = r.num_computed + n
            if not self._fits(r.kv, total):
                plan.kv_blocked = True
                break
            if not kv.admit(r.kv, total):
                if running or kv.held_elsewhere():
                    plan.kv_blocked = True
                    break
                swapped.popleft()  # it cannot come back even to an empty pool
                self.host_swap_bytes -= r.num_computed * kv.bytes_per_token
                self._reject(r, "kv_cannot_grow", f"its KV cache for {total} tokens does not fit back in an empty pool")
                continue
            kv.mark_computed(r.kv, r.num_computed)  # the copy refills every block it holds
            swapped.popleft()
            nbytes = r.num_computed * kv.bytes_per_token
            self.host_swap_bytes -= nbytes
            plan.swap_in_bytes += nbytes
            self.num_own_tokens += max(0, r.num_computed - r.kv.prefix_tokens)
            r.status = RequestState.RUNNING
            running.append(r)
            plan.add(r, n)
            budget -= n
        return budget

    def _admit(self, plan: StepPlan, budget: int) -> None:
        kv, running, waiting = self.kv, self.running, self.waiting
        while waiting and len(running) < self.config.max_num_seqs and budget > 0:
            r = waiting[0]
            h = r.kv
            hit = kv.match_prefix(h)
            n = r.num_tokens - hit
            if n > budget:
                if not self.config.chunked_prefill:
                    if budget < self.config.max_num_batched_tokens:
                        break
                else:
                    n = budget
            total = hit + n
            if not self._fits(h, total):
                plan.kv_blocked = True
                break
            if not kv.admit(h, total):
                if running or kv.held_elsewhere():
                    plan.kv_blocked = True
                    break
                # nothing else holds KV memory and it still does not fit: it never will
                waiting.popleft()
                self._reject(r, "kv_cannot_grow", f"its KV cache for {total} tokens does not fit in an empty pool")
                continue
            waiting.popleft()
            r.num_computed = hit
            r.prefix_hit_tokens += hit
            r.status = RequestState.RUNNING
            running.append(r)
            plan.add(r, n)
            budget -= n

    def unschedule_last(self, plan: StepPlan) -> bool:
        """Preempt the last request scheduled in ``plan`` (the server calls this when a step's
        activations do not fit). False when nothing is left to take off."""
        if not plan.scheduled:
            return False
        victim = plan.pop()
        self.running.remove(victim)  # rare path: O(running) is fine
        self._preempt(plan, victim)
        return True

    # ------------------------------------------------------------------ after a step
    def complete(self, plan: StepPlan, now_s: float) -> int:
        """The step ran: advance every scheduled request; returns how many finished."""
        kv = self.kv
        num_finished = 0
        own = self.num_own_tokens
        for r in plan.scheduled:
            h = r.kv
            p = h.prefix_tokens
            before = r.num_computed
            c = before + r.num_new
            r.num_computed = c
            if p == 0:
                own += r.num_new
            elif c > p:
                own += c - max(before, p)
            if h.blocks and h.num_computed_blocks < len(h.blocks):
                kv.mark_computed(h, c)
            if c == r.num_tokens:
                g = r.num_generated + 1
                r.num_generated = g
                if g == 1:
                    r.first_token_s = now_s
                if g >= r.output_tokens:
                    own -= c - p if c > p else 0
                    kv.free(h)
                    r.finish_s = now_s
                    r.status = RequestState.FINISHED
                    num_finished += 1
                else:
                    r.num_tokens = c + 1
        self.num_own_tokens = own
        if num_finished:
            self.num_finished += num_finished
            self.running = [r for r in self.running if r.status is RequestState.RUNNING]
        return num_finished
