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
from bisect import bisect_left, insort
from itertools import accumulate
from operator import attrgetter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sim.serving.kv import KVHandle
from sim.serving.choices import PREEMPTION_MODES  # noqa: F401 (moved; importable here too)

if TYPE_CHECKING:
    from sim.serving.config import ServerConfig

__all__ = [
    "Request",
    "RequestState",
    "StepPlan",
    "Scheduler",
    "DecodeRun",
    "PREEMPTION_MODES",
    "REJECT_KINDS",
]

#: Why requests are rejected: kind -> what it means (a summary's ``rejected_by`` names kinds).
REJECT_KINDS = {
    "prompt>=max_model_len": "the prompt leaves no room to generate below max_model_len",
    "kv>budget": "the request's KV peak exceeds the whole KV budget",
    "prompt>step_budget": "the prompt exceeds max_num_batched_tokens and chunked prefill is off",
    "kv_cannot_grow": "its KV cache could not grow even with the pool to itself",
}


#: a request's KV handle (a C call where a comprehension would make a frame)
_kv_of = attrgetter("kv")


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
    """FCFS continuous batching over a KV manager (``sim.serving.kv``).

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
            return (
                "prompt>=max_model_len",
                f"prompt of {r.prompt_tokens} tokens leaves no room below "
                f"max_model_len={self.config.max_model_len}",
            )
        peak = self.kv.peak_bytes(r.prompt_tokens, r.output_tokens)
        if peak > self.kv.budget_bytes:
            return (
                "kv>budget",
                f"needs {peak} B of KV cache, "
                f"more than the whole budget of {self.kv.budget_bytes} B",
            )
        if not self.config.chunked_prefill and r.prompt_tokens > self.config.max_num_batched_tokens:
            return (
                "prompt>step_budget",
                f"prompt of {r.prompt_tokens} tokens exceeds "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens} "
                "without chunked prefill",
            )
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
        decode_seqs = context_tokens = prefill_tokens = num_prefill_seqs = (
            prefill_context_tokens
        ) = 0
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
            prefill_tokens,
            num_prefill_seqs,
            prefill_context_tokens,
        )
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
                    self._reject(
                        r,
                        "kv_cannot_grow",
                        f"its KV cache cannot grow to {total} tokens even running alone",
                    )
                else:
                    self._preempt(plan, r)
                return False
            self._preempt(plan, victim)
        return True

    def _preempt(self, plan: StepPlan, r: Request) -> None:
        """Take ``r`` off the GPU: swap its KV out (charged to ``plan``), or drop it to recompute
        later."""
        plan.num_preemptions += 1
        self.num_preemptions += 1
        r.num_preemptions += 1
        nbytes = r.num_computed * self.kv.bytes_per_token
        swap = (
            self.config.preemption == "swap"
            and r.num_computed > 0
            and (
                self.config.swap_space_bytes is None
                or self.host_swap_bytes + nbytes <= self.config.swap_space_bytes
            )
        )
        self._drop_kv(r)
        if swap:
            self.num_swap_outs += 1
            r.num_swaps += 1
            self.host_swap_bytes += nbytes
            plan.swap_out_bytes += nbytes
            r.status = RequestState.SWAPPED
            self.swapped.appendleft(
                r
            )  # victims go newest first, so earlier arrivals end up in front
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
                self._reject(
                    r,
                    "kv_cannot_grow",
                    f"its KV cache for {total} tokens does not fit back in an empty pool",
                )
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
                self._reject(
                    r,
                    "kv_cannot_grow",
                    f"its KV cache for {total} tokens does not fit in an empty pool",
                )
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

    # ------------------------------------------------------------------ quiet decode runs
    def decode_run(self, page_source=None) -> DecodeRun | None:
        """The closed form of the next steps, when each of them decodes one token of every running
        request (``DecodeRun``); None when the next one does not.

        The next step is such a decode step when nothing waits or is swapped out, the batch fits
        the token budget and every running request has a generated token to compute, its KV
        slots up to it filled and its prefix blocks computed: ``schedule`` then gives each
        request its one token in running order, and ``complete`` advances them all. Only a KV
        manager that ``decode_grows_at_capacity`` qualifies. ``page_source``: a pool whose free
        pages may be taken at page boundaries inside the run (``DecodeRun.take_slots``); None:
        the run stops at the first step that needs a new KV slot.
        """
        kv, running = self.kv, self.running
        if self.waiting or self.swapped or not kv.decode_grows_at_capacity:
            return None
        if not running or len(running) > self.config.max_num_batched_tokens:
            return None
        # one walk checks every request and files it by the step it finishes at and the step it
        # needs a slot at (``DecodeRun``'s dicts: built here, not in a second walk): with a page
        # source, one first due within a page's steps straight into its ring slot
        context = 0
        finish_at: dict[int, list[Request]] = {}
        slots_at: dict[int, list[Request]] = {}
        ring: dict[int, list[KVHandle]] = {}
        tpp = kv.tokens_per_page if page_source is not None else 0
        for r in running:  # in running order, so every list below is too
            c = r.num_computed
            h = r.kv
            if (
                r.num_tokens - c != 1
                or not r.num_generated
                or c < h.prefix_tokens
                or (h.blocks and h.num_computed_blocks < len(h.blocks))
            ):
                return None
            context += c
            finish_at.setdefault(r.output_tokens - r.num_generated - 1, []).append(r)
            due = h.capacity_tokens - c
            if 0 <= due < tpp:
                ring.setdefault(due, []).append(h)
            else:
                slots_at.setdefault(due, []).append(r)
        return DecodeRun(self, context, page_source, finish_at, slots_at, ring)


class DecodeRun:
    """Consecutive decode steps of a scheduler's running batch, computed arithmetically.

    What ``Scheduler.schedule`` and ``Scheduler.complete`` would do to a batch in which every
    request decodes one token per step, step after step: the plan of step ``s`` (counted from
    the run's start) has ``num_seqs`` decode sequences over ``context_tokens``; before it, the
    requests whose KV slots run out take one page each (``take_slots``, in running order, as
    ``schedule`` grows them); after it, every request has one more token and those that reach
    their output length finish (``end_step``: KV freed in running order, as ``complete`` frees
    it). Every allocate and free the KV pool sees is the one the step-by-step path makes, in
    the same order; only the per-request counters are written lazily (``apply``, which a reader
    of the requests calls first). Tested equal to the step-by-step path:
    ``tests/sim/serving/test_step_fast_path.py``.

    The caller (``sim.serving.server.Server``) owns time: it asks for each step's plan, checks what
    the scheduler cannot see (the step ends before the next arrival, the activations repeat),
    and integrates its figures over the step.
    """

    #: a quiet step is never limited by KV memory (``StepPlan.kv_blocked``)
    kv_blocked = False

    __slots__ = (
        "sched",
        "kv",
        "num_seqs",
        "context_tokens",
        "num_own_tokens",
        "num_steps",
        "_applied",
        "_live",
        "_first",
        "_order",
        "_finish_at",
        "_finish_steps",
        "_slots_at",
        "_next_first",
        "_ring",
        "_phases",
        "_tpp",
        "_taken_through",
        "_page_source",
        "_num_finished",
        "next_slot_step",
    )

    def __init__(
        self,
        sched: Scheduler,
        context_tokens: int,
        page_source=None,
        finish_at: dict[int, list[Request]] | None = None,
        slots_at: dict[int, list[Request]] | None = None,
        ring: dict[int, list[KVHandle]] | None = None,
    ):
        self.sched, self.kv = sched, sched.kv
        running = sched.running
        self.num_seqs = len(running)
        self.context_tokens = context_tokens
        self.num_own_tokens = sched.num_own_tokens
        self.num_steps = 0  # steps ended since the run began
        self._applied = 0  # of them, those written into the requests
        self._live = self._first = list(running)  # ``_first``: the run's requests, running order
        #: KV handle -> its request's place in running order, built when first needed
        #: (``_running_order``: only requests that join a ring slot others hold sort by it, rare)
        self._order: dict[KVHandle, int] | None = None
        tpp = self.kv.tokens_per_page if page_source is not None else 0
        if finish_at is None or slots_at is None or ring is None:  # (``decode_run`` passes them)
            finish_at, slots_at, ring = {}, {}, {}
            for r in running:  # in running order, so every list below is too
                finish_at.setdefault(r.output_tokens - r.num_generated - 1, []).append(r)
                due = r.kv.capacity_tokens - r.num_computed
                if 0 <= due < tpp:
                    ring.setdefault(due, []).append(r.kv)
                else:
                    slots_at.setdefault(due, []).append(r)
        #: step -> requests that finish at its end
        self._finish_at = finish_at
        #: the steps of ``_finish_at``, latest first: a sorted list, so that the next finish is
        #: its last item (popped as ``end_step`` reaches it), not a ``min`` over the dict per call
        self._finish_steps = sorted(finish_at, reverse=True)
        #: step -> requests whose next token first needs a slot beyond their capacity then,
        #: a page's steps or more ahead (a slack), or any step without a page source: once given
        #: that slot, a request joins the ring below
        self._slots_at = slots_at
        #: the first step of ``_slots_at`` (``math.inf``: none), kept as it changes
        self._next_first = min(slots_at, default=math.inf)
        self._page_source = page_source
        #: With a page source, a request needs a page every ``tokens_per_page`` steps as long
        #: as it runs: ``_ring[p]`` holds the KV handles (running order) of those due at the
        #: steps ``s`` past the ones taken with ``s % _tpp == p``, ``_phases`` its phases sorted.
        #: A window's grows are then its phases' lists in step order, and nobody's due step
        #: moves. (No page source: no request moves on, the ring stays empty.)
        self._tpp = tpp or 1
        self._ring = ring
        self._phases = sorted(ring)
        self._taken_through = -1  # the last step whose slots were taken (-1: none)
        self._num_finished = 0  # requests of the run finished so far
        #: the first step at which some request may need a new KV slot (``math.inf``: none);
        #: kept as the slot steps change (an attribute: the server reads it every few steps)
        phases, first_due = self._phases, self._next_first  # (``_slot_step_after(-1)``)
        self.next_slot_step = phases[0] if phases and phases[0] < first_due else first_due

    def next_finish_step(self) -> int | float:
        """The next step (counted from the run's start, >= ``num_steps``) at whose end some
        request finishes; ``math.inf`` when none does. Until then ``num_seqs`` stays as it is."""
        steps = self._finish_steps
        return steps[-1] if steps else math.inf

    def advance(self, num_steps: int) -> None:
        """``num_steps`` x ``end_step`` of steps at whose end nothing finishes (the caller knows:
        ``next_finish_step``), in one go: the same counters, the same order of integer adds."""
        self.num_steps += num_steps
        n = num_steps * self.num_seqs
        self.context_tokens += n
        self.num_own_tokens += n

    def take_slots(self, step: int) -> bool:
        """Give each request due at ``step`` its new slot, as ``schedule`` would (``kv.grow`` in
        running order), when the KV manager can promise every one at once
        (``kv.grow_from_free_pages``); False, with nothing done, when it cannot (the engine's
        own step then runs, with its growth, eviction or preemption). The window of one step
        (``take_slots_through``: one place for how due requests move on)."""
        if not self.needs_slots(step):
            return True
        return self.take_slots_through(step, step) is not None

    def needs_slots(self, step: int) -> bool:
        """Whether some request needs a new KV slot at ``step`` (``take_slots`` then), a step
        past those taken already."""
        nxt = self.next_slot_step
        if step <= nxt:
            return step == nxt
        return step % self._tpp in self._ring or step in self._slots_at

    def _running_order(self) -> dict[KVHandle, int]:
        """A request's KV handle -> the request's place in the run's running order (built once,
        when first needed)."""
        if self._order is None:
            self._order = {r.kv: i for i, r in enumerate(self._first)}
        return self._order

    def _slot_step_after(self, step: int) -> int | float:
        """The first step past ``step`` at which some request needs a slot (``math.inf``: none),
        when none does between the steps taken and ``step``."""
        phases, nxt = self._phases, self._next_first
        if not phases:
            return nxt
        tpp = self._tpp
        f = (step + 1) % tpp
        i = bisect_left(phases, f)
        s = step + 1 - f + (phases[i] if i < len(phases) else tpp + phases[0])
        return s if s < nxt else nxt

    def take_slots_through(self, first: int, last: int) -> dict[int, int] | None:
        """``take_slots(s)`` for each step ``s`` from ``first`` to ``last`` (steps at whose ends
        nothing finishes, but maybe the last), in one KV grow: the same pages to the same
        requests in the same order (step by step, running order in each), since nothing else
        calls the pool in between. Returns each step's ``kv.allocated_bytes`` after its grows
        (steps that grow nothing left out; the keys in step order), or None, with nothing
        done, when the KV manager cannot promise them all at once, or the run has no page source
        and none of its requests finished yet (the caller then takes them step by step).
        ``take_slots`` is its window of one step: the one place that moves due requests on.
        ``first`` is no later than ``next_slot_step`` (the steps before it were taken)."""
        slots_at = self._slots_at  # (a finished request has left its due list: ``end_step``)
        if self._page_source is None:
            # no pages to take: done only when no request of the run is due in the window
            # (always None before any finished: the case of every run of a contiguous KV)
            if not self._num_finished:
                return None
            for s in slots_at:
                if first <= s <= last:
                    return None
            return {}
        ring, phases, tpp = self._ring, self._phases, self._tpp
        handles: list[KVHandle] = []
        counts: list[tuple[int, int]] = []  # (step, grows up to and including it)
        # The window's slot steps are its ring phases' steps, in step order (a walk over the
        # sorted phases from the first step's, a cycle a page's steps); a request first due at a
        # step (a slack) joins its phase there, the walk going on from that step. The joins are
        # undone if the grow fails.
        nxt = self._next_first
        joined: list[tuple[int, list[KVHandle] | None, int, list[Request]]] = []
        start = first
        while True:
            end = last if nxt > last else nxt - 1  # the ring's steps up to the next join
            if phases and start <= end:
                f = start % tpp
                cycle = start - f
                i = bisect_left(phases, f)
                n = len(phases)
                while True:
                    if i == n:
                        i = 0
                        cycle += tpp
                    p = phases[i]
                    s = cycle + p
                    if s > end:
                        break
                    handles += ring[p]
                    counts.append((s, len(handles)))
                    i += 1
            if nxt > last:
                break
            due = slots_at.pop(nxt)
            p = nxt % tpp
            before = ring.get(p)
            joining = list(map(_kv_of, due))
            if before:  # others hold the phase: keep running order
                joining = before + joining
                joining.sort(key=self._running_order().__getitem__)
            else:
                insort(phases, p)
            ring[p] = joining
            joined.append((p, before, nxt, due))
            start = nxt
            nxt = min(slots_at, default=math.inf)
        taken: dict[int, int] = {}
        if handles:
            sizes: list[int] = []
            allocated = self.kv.allocated_bytes
            if not self.kv.grow_from_free_pages(handles, self._page_source, sizes):
                for p, before, s, due in reversed(joined):
                    if before:
                        ring[p] = before
                    else:
                        del ring[p]
                        phases.remove(p)
                    slots_at[s] = due
                return None
            # integer bytes: a step's sum is exact in any order; the running sums in one C pass
            totals = list(accumulate(sizes, initial=allocated))
            for s, k in counts:
                taken[s] = totals[k]
        self._next_first = nxt
        self._taken_through = last
        self.next_slot_step = self._slot_step_after(last)
        return taken

    def _forget_slow(self, r: Request) -> None:
        """Take ``r`` out of whichever due list holds it, by a scan (``end_step``'s fallback)."""
        for k, d in list(self._slots_at.items()):
            if r in d:
                d.remove(r)
                if not d:
                    del self._slots_at[k]
        for p, d in list(self._ring.items()):
            if r.kv in d:
                d.remove(r.kv)
                if not d:
                    del self._ring[p]
                    self._phases.remove(p)
        self._next_first = min(self._slots_at, default=math.inf)
        self.next_slot_step = self._slot_step_after(self._taken_through)

    def end_step(self, now_s: float) -> int:
        """Step ``num_steps`` ended at ``now_s``: every request has its token; those at their
        output length finish (KV freed, in running order). Returns how many finished."""
        step = self.num_steps
        self.num_steps = step + 1
        self.context_tokens += self.num_seqs
        self.num_own_tokens += self.num_seqs
        done = self._finish_at.pop(step, None)
        if done is None:
            return 0
        self._finish_steps.pop()  # ``step``: finishes are reached in step order
        sched, kv = self.sched, self.kv
        ahead = step + 1 - self._applied
        own = self.num_own_tokens
        slots_at, ring, tpp = self._slots_at, self._ring, self._tpp
        live = self._live
        if live is self._first:  # (``_first`` keeps the run's running order)
            live = self._live = live.copy()
        for r in done:
            c = r.num_computed + ahead
            h = r.kv
            # leave its due list: the step it would next need a slot at (run-relative: its
            # capacity less its tokens at the run's start), so no window grows it
            s = h.capacity_tokens - c + step + 1
            due = slots_at.get(s)
            if due is not None and r in due:  # no slot taken in the run yet: its first
                if len(due) == 1:
                    del slots_at[s]
                    if s == self._next_first:
                        self._next_first = min(slots_at, default=math.inf)
                else:
                    due.remove(r)
            else:  # in its ring phase
                p = s % tpp
                phase = ring.get(p)
                if phase is not None and h in phase:
                    if len(phase) == 1:
                        del ring[p]
                        self._phases.remove(p)
                    else:
                        phase.remove(h)
                else:  # (never: a scan keeps it exact all the same)
                    self._forget_slow(r)
            if s == self.next_slot_step:
                self.next_slot_step = self._slot_step_after(self._taken_through)
            r.num_new = 1
            r.num_computed = c
            r.num_tokens = c
            r.num_generated += ahead
            own -= c - h.prefix_tokens
            kv.free(h)
            r.finish_s = now_s
            r.status = RequestState.FINISHED
            self.context_tokens -= c
            live.remove(r)  # (running order kept; a request finishes once)
        self.num_own_tokens = own
        n = len(done)
        self.num_seqs -= n
        self._num_finished += n
        sched.num_finished += n
        return n

    def apply(self) -> None:
        """Write the steps run so far into the running requests and the scheduler's counters."""
        ahead = self.num_steps - self._applied
        if ahead:
            for r in self._live:
                r.num_new = 1
                r.num_computed += ahead
                r.num_generated += ahead
                r.num_tokens += ahead
            self._applied = self.num_steps
        sched = self.sched
        sched.num_own_tokens = self.num_own_tokens
        if len(sched.running) != len(self._live):
            sched.running = list(self._live)
