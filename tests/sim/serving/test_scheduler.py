import math
import pytest
from hypothesis import given, settings, strategies as st

import policies
from sim.replay.costs import CostedDevice
from sim.serving.config import ServerConfig
from sim.serving.kv import ContiguousKV, PagedKV
from sim.serving.pools import TimedPool
from sim.serving.scheduler import Request, RequestState, Scheduler

WAITING, RUNNING, SWAPPED, FINISHED, REJECTED = (
    RequestState.WAITING,
    RequestState.RUNNING,
    RequestState.SWAPPED,
    RequestState.FINISHED,
    RequestState.REJECTED,
)

BPT = 1024
MiB = 1 << 20


def make(
    budget_tokens=1024,
    preemption="recompute",
    max_num_seqs=8,
    max_num_batched_tokens=256,
    chunked_prefill=True,
    watermark=0.0,
    kind="paged",
    max_model_len=100_000,
):
    budget = budget_tokens * BPT
    cfg = ServerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        chunked_prefill=chunked_prefill,
        watermark=watermark,
        preemption=preemption,
        max_model_len=max_model_len,
        prefix_block_tokens=64,
        grow_tokens=64,
        kv_strategy=kind if kind != "paged" else "pow2",
    )
    if kind == "paged":
        pool = TimedPool(
            policies.create(
                "paged",
                bytes_per_token=BPT,
                tokens_per_page=16,
                segment_bytes=MiB,
                device=CostedDevice(),
            )
        )
        kv = PagedKV(pool, cfg, bytes_per_token=BPT, budget_bytes=budget, tokens_per_page=16)
    else:
        pool = TimedPool(policies.create("best-fit", device=CostedDevice()))
        kv = ContiguousKV(pool, cfg, bytes_per_token=BPT, budget_bytes=budget)
    return Scheduler(kv, cfg)


def req(sched, rid, prompt, output, hash_ids=()):
    return Request(
        rid,
        float(rid),
        prompt,
        output,
        sched.kv.new_handle(prompt, output, hash_ids),
        num_tokens=prompt,
    )


def step(sched, now=1.0):
    plan = sched.schedule()
    sched.complete(plan, now)
    return plan


def test_prefill_then_one_token_per_step_until_done():
    s = make()
    r = req(s, 0, 40, 3)
    s.add(r)
    plan = step(s)
    assert (plan.prefill_tokens, plan.decode_seqs) == (40, 0)
    assert r.num_generated == 1 and r.num_tokens == 41
    plan = step(s)
    assert (plan.prefill_tokens, plan.decode_seqs, plan.context_tokens) == (0, 1, 40)
    step(s, now=3.0)
    assert r.status is FINISHED and r.finish_s == 3.0
    assert s.kv.allocated_bytes == 0 and not s.has_work()


def test_chunked_prefill_respects_the_token_budget():
    s = make(max_num_batched_tokens=100)
    r = req(s, 0, 250, 2)
    s.add(r)
    assert [step(s).prefill_tokens for _ in range(3)] == [100, 100, 50]
    assert r.num_generated == 1


def test_decodes_go_before_new_prefills_within_the_budget():
    s = make(max_num_batched_tokens=64)
    a, b = req(s, 0, 30, 10), req(s, 1, 200, 10)
    s.add(a)
    step(s)
    s.add(b)
    plan = step(s)
    assert plan.scheduled == [a, b]
    assert (plan.decode_seqs, plan.prefill_tokens) == (1, 63)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_of_its_own():
    s = make(max_num_batched_tokens=64, chunked_prefill=False)
    a, b = req(s, 0, 30, 10), req(s, 1, 64, 10)
    s.add(a)
    step(s)
    s.add(b)
    plan = step(s)
    assert plan.scheduled == [a]  # b's 64 tokens do not fit beside a's decode
    assert b.status is WAITING


def test_a_prompt_over_the_budget_without_chunking_is_rejected():
    s = make(max_num_batched_tokens=64, chunked_prefill=False)
    r = req(s, 0, 65, 1)
    assert not s.add(r)
    assert r.status is REJECTED and "max_num_batched_tokens" in r.reject_reason


def test_max_num_seqs_caps_the_batch():
    s = make(max_num_seqs=2)
    rs = [req(s, i, 10, 5) for i in range(3)]
    for r in rs:
        s.add(r)
    step(s)
    assert [r.status for r in rs] == [RUNNING, RUNNING, WAITING]


def test_admission_is_first_come_first_served():
    s = make(budget_tokens=64)
    big, small = req(s, 0, 60, 2), req(s, 1, 10, 2)
    blocker = req(s, 2, 30, 20)
    s.add(blocker)
    step(s)
    s.add(big)
    s.add(small)
    step(s)
    # big does not fit beside the blocker, and small may not overtake it
    assert big.status is WAITING and small.status is WAITING


def test_request_larger_than_the_whole_pool_is_rejected_on_arrival():
    s = make(budget_tokens=256)
    r = req(s, 0, 300, 10)
    assert not s.add(r)
    assert r.status is REJECTED and s.rejected == [r]
    assert not s.has_work()


def test_prompt_at_max_model_len_is_rejected():
    s = make(max_model_len=100)
    r = req(s, 0, 100, 1)
    assert not s.add(r)
    assert "max_model_len" in r.reject_reason


def test_growth_failure_preempts_the_newest_request_by_recompute():
    s = make(budget_tokens=96)  # 6 pages of 16
    a, b = req(s, 0, 40, 20), req(s, 1, 40, 20)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 3 pages each
    for _ in range(20):  # each needs a 4th page for token 49
        step(s)
        if s.num_preemptions:
            break
    assert s.num_preemptions == 1
    assert b.status is WAITING and b.num_computed == 0 and b.num_preemptions == 1
    assert s.waiting[0] is b
    assert a.status is RUNNING


def test_swap_preemption_moves_kv_to_host_and_back():
    s = make(budget_tokens=96, preemption="swap")
    a, b = req(s, 0, 40, 20), req(s, 1, 40, 20)
    s.add(a)
    s.add(b)
    step(s)
    swapped_out = 0
    while s.num_swap_outs == 0:
        swapped_out = step(s).swap_out_bytes
    assert b.status is SWAPPED and b.num_computed > 0
    assert swapped_out == b.num_computed * BPT == s.host_swap_bytes
    swapped_in = 0
    while b.status is SWAPPED:
        swapped_in += step(s).swap_in_bytes
    assert swapped_in == swapped_out and s.host_swap_bytes == 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_every_request_finishes_under_memory_pressure(preemption):
    s = make(budget_tokens=160, preemption=preemption)
    rs = [req(s, i, 30 + 7 * i, 40) for i in range(6)]
    for r in rs:
        s.add(r)
    for _ in range(2000):
        if not s.has_work():
            break
        step(s)
    assert all(r.status is FINISHED for r in rs)
    assert s.num_preemptions > 0
    assert s.kv.allocated_bytes == 0


def test_a_request_that_cannot_grow_even_alone_is_rejected_not_looped_on():
    # pow2 needs the old and the doubled copy at once while it grows: 128 + 256 > 300 tokens
    s = make(budget_tokens=300, kind="pow2")
    r = req(s, 0, 100, 150)  # final reservation 256 fits the budget, the copy does not
    assert s.add(r)
    for _ in range(500):
        if not s.has_work():
            break
        step(s)
    assert r.status is REJECTED and "alone" in r.reject_reason
    assert s.kv.allocated_bytes == 0


def test_watermark_holds_back_admission_while_others_run():
    s = make(budget_tokens=1000, watermark=0.5, max_num_batched_tokens=1024)
    a, b = req(s, 0, 100, 50), req(s, 1, 450, 5)
    s.add(a)
    step(s)
    s.add(b)
    step(s)
    assert b.status is WAITING  # would leave under half the budget free
    s2 = make(budget_tokens=1000, watermark=0.5, max_num_batched_tokens=1024)
    c = req(s2, 0, 600, 5)
    s2.add(c)
    step(s2)
    assert c.status is RUNNING  # alone: nothing to protect


def test_prefix_hit_skips_computing_the_cached_tokens():
    s = make()
    a = req(s, 0, 140, 2, hash_ids=(1, 2))
    s.add(a)
    step(s)
    b = req(s, 1, 140, 2, hash_ids=(1, 2))
    s.add(b)
    plan = step(s)
    assert b.prefix_hit_tokens == 128
    assert b in plan.scheduled and b.num_new == 12


def test_unschedule_last_undoes_exactly_what_scheduling_counted():
    s = make(max_num_batched_tokens=64, preemption="swap")
    a, b = req(s, 0, 30, 10), req(s, 1, 200, 10)
    s.add(a)
    step(s)
    s.add(b)
    plan = s.schedule()  # a decodes, b prefills a chunk
    assert s.unschedule_last(plan)
    assert plan.scheduled == [a] and (plan.decode_seqs, plan.context_tokens) == (1, 30)
    assert (plan.prefill_tokens, plan.num_prefill_seqs, plan.prefill_context_tokens) == (0, 0, 0)
    assert (
        b.status is WAITING and plan.num_preemptions == 1
    )  # nothing computed yet: recomputed, not swapped
    assert plan.swap_out_bytes == 0
    assert s.unschedule_last(plan) and plan.num_batched_tokens == 0 and a.status is SWAPPED
    assert plan.swap_out_bytes == 30 * BPT  # the swap-out is charged to the plan it was taken from
    assert not s.unschedule_last(plan)


# ---------------------------------------------------------------------- DecodeRun (the closed form)
def _decoding_batch(kind, slack=False):
    """A scheduler whose five running requests all decode next (prompts admitted, one step run);
    with ``slack``, the last holds a page more than its tokens need (its slots run out later than
    a page's worth of steps, so it shares a step's grows with requests ahead of it)."""
    s = make(budget_tokens=4096, max_num_batched_tokens=1024, kind=kind)
    for rid, (prompt, output) in enumerate([(40, 9), (17, 40), (63, 4), (5, 21), (33, 36)]):
        s.add(req(s, rid, prompt, output))
    step(s, now=0.5)
    # 15 slots to spare, as request 1 has: its grow at step 15 is due again at 31, with this one's
    # first
    if slack:
        r = s.running[-1]
        assert s.kv.grow(r.kv, r.kv.capacity_tokens + 16, r.num_computed)
    return s


def log_kv_calls(pool):
    """Record every call the policy behind ``pool`` (a ``TimedPool``) sees from now on, in order:
    ``("alloc", nbytes, extents or None)`` and ``("free", extents)``. What a closed form of the
    engine's steps must reproduce exactly."""
    log = []
    calls = pool._calls
    alloc, free = calls._allocate, calls._free

    def logged_alloc(nbytes, **kw):
        a = alloc(nbytes, **kw)
        log.append(("alloc", nbytes, None if a is None else a.extents))
        return a

    def logged_free(a):
        log.append(("free", a.extents))
        free(a)

    calls._allocate, calls._free = logged_alloc, logged_free
    # a policy's batched calls (paged's fused page loops) stand for one call each
    alloc_each, free_each = calls._allocate_batch, calls._free_batch
    if alloc_each is not None:

        def logged_alloc_each(nbytes, num_calls, **kw):
            out = alloc_each(nbytes, num_calls, **kw)
            log.extend(("alloc", nbytes, None if a is None else a.extents) for a in out)
            return out

        calls._allocate_batch = logged_alloc_each
    if free_each is not None:

        def logged_free_each(handles):
            log.extend(("free", a.extents) for a in handles)
            free_each(handles)

        calls._free_batch = logged_free_each
    allocate_pages = calls._allocate_pages
    if allocate_pages is not None:  # page grants: the one-page allocations they stand for

        def logged_allocate_pages(nbytes, num_calls):
            out = allocate_pages(nbytes, num_calls)
            if out is not None:
                log.extend(("alloc", nbytes, pg.extents) for pg in out)
            return out

        calls._allocate_pages = logged_allocate_pages
    return log


@pytest.mark.parametrize("kind,slack", [("paged", False), ("paged", True), ("grow", False)])
def test_decode_run_does_what_schedule_and_complete_do_step_by_step(kind, slack):
    slow, fast = _decoding_batch(kind, slack), _decoding_batch(kind, slack)
    slow_log, fast_log = log_kv_calls(slow.kv.pool), log_kv_calls(fast.kv.pool)
    slow_reqs, fast_reqs = list(slow.running), list(fast.running)
    run = fast.decode_run(fast.kv.pool.policy if kind == "paged" else None)
    assert run is not None and run.num_seqs == 5
    steps = 0
    while run.num_seqs and run.take_slots(run.num_steps):
        plan = slow.schedule()
        assert (plan.decode_seqs, plan.context_tokens, plan.prefill_tokens) == (
            run.num_seqs,
            run.context_tokens,
            0,
        )
        slow.complete(plan, 1.0 + steps)
        run.end_step(1.0 + steps)
        steps += 1
        assert fast.num_finished == slow.num_finished
        run.apply()
        assert run.num_own_tokens == slow.num_own_tokens
        assert [
            (
                r.num_tokens,
                r.num_computed,
                r.num_generated,
                r.finish_s,
                r.status,
                r.kv.capacity_tokens,
                [a.extents for a in r.kv.allocs],
            )
            for r in fast_reqs
        ] == [
            (
                r.num_tokens,
                r.num_computed,
                r.num_generated,
                r.finish_s,
                r.status,
                r.kv.capacity_tokens,
                [a.extents for a in r.kv.allocs],
            )
            for r in slow_reqs
        ]
    if kind == "paged":  # pages come from the free list: the run goes until every request is done
        assert not fast.running and not slow.running and steps == 39
    else:  # a contiguous grow reallocates and copies: the run stops before the first
        assert fast.running and steps < 39
    assert fast.num_finished == slow.num_finished and fast.num_own_tokens == slow.num_own_tokens
    assert fast.kv.allocated_bytes == slow.kv.allocated_bytes
    assert fast_log == slow_log and (kind == "grow" or len(fast_log) > 10)


def test_decode_run_is_none_unless_every_running_request_decodes():
    s = make(budget_tokens=4096, max_num_batched_tokens=1024)
    s.add(req(s, 0, 40, 9))
    assert s.decode_run() is None  # it waits: the next step is its prefill
    step(s)
    assert s.decode_run() is not None
    s.add(req(s, 1, 20, 5))
    assert s.decode_run() is None  # someone waits: the next step admits it


def test_decode_run_advance_is_end_step_over_steps_where_nothing_finishes():
    """The server advances a run's counters in one go between finishes (``advance`` up to
    ``next_finish_step``): the same counters as one ``end_step`` per step, and the finishes
    fall on the same steps."""
    one, bulk = _decoding_batch("paged"), _decoding_batch("paged")
    page_source = one.kv.pool.policy
    a = one.decode_run(page_source)
    b = bulk.decode_run(bulk.kv.pool.policy)
    finishes = []
    while a.num_seqs:
        assert a.take_slots(a.num_steps) and b.take_slots(a.num_steps)
        if a.end_step(1.0 + a.num_steps):
            finishes.append(a.num_steps - 1)
    steps = []
    while b.num_seqs:
        due = b.next_finish_step()
        assert due >= b.num_steps
        for s in range(b.num_steps, due):  # the pages due in between (the server takes them too)
            assert b.take_slots(s)
        b.advance(due - b.num_steps)
        assert b.take_slots(due)
        assert b.end_step(1.0 + due) > 0
        steps.append(due)
    assert steps == finishes and len(steps) >= 3
    a.apply(), b.apply()
    assert (b.num_steps, b.context_tokens, b.num_own_tokens) == (
        a.num_steps,
        a.context_tokens,
        a.num_own_tokens,
    )
    assert bulk.num_finished == one.num_finished == 5
    assert bulk.num_own_tokens == one.num_own_tokens
    assert b.next_finish_step() == math.inf


def _request_state(requests):
    return [
        (r.status, r.kv.capacity_tokens, r.kv.num_own_pages, [a.extents for a in r.kv.allocs])
        for r in requests
    ]


_LONG_BATCH = [(40, 9), (17, 60), (63, 100), (5, 140), (33, 70)]  # (prompt, output) tokens


def _long_decoding_batch(slack, requests=_LONG_BATCH):
    """``_decoding_batch`` with outputs long enough for windows of more than a page's steps
    between finishes (a request then grows twice in one)."""
    s = make(budget_tokens=4096, max_num_batched_tokens=1024, kind="paged")
    for rid, (prompt, output) in enumerate(requests):
        s.add(req(s, rid, prompt, output))
    step(s, now=0.5)
    if slack:  # 15 slots to spare: its grows fall on steps that others grow on too
        r = s.running[-1]
        assert s.kv.grow(r.kv, r.kv.capacity_tokens + 16, r.num_computed)
    return s


@settings(max_examples=40, deadline=None)
@given(windows=st.lists(st.integers(1, 50), min_size=1, max_size=30), slack=st.booleans())
def test_slots_taken_through_a_window_are_those_taken_step_by_step(windows, slack):
    """``DecodeRun.take_slots_through`` (the server's quiet steps take a window's page grows in
    one call): windows of any length up to the next finish, longer than a page's worth of steps
    too (a request grows twice in one) and with a request that shares a later step's grows
    (``slack``), give the KV policy the calls ``take_slots`` makes step by step, in the same
    order, and the KV's allocated bytes after each step."""
    one, many = _long_decoding_batch(slack), _long_decoding_batch(slack)
    log_one, log_many = log_kv_calls(one.kv.pool), log_kv_calls(many.kv.pool)
    a, b = one.decode_run(one.kv.pool.policy), many.decode_run(many.kv.pool.policy)
    reqs_one, reqs_many = list(one.running), list(many.running)
    sizes = iter(windows)
    while b.num_seqs:
        first = b.num_steps
        last = min(first + next(sizes, 1) - 1, b.next_finish_step())
        taken = b.take_slots_through(first, last)
        assert taken is not None
        for s in range(first, last + 1):
            before = one.kv.allocated_bytes
            assert a.take_slots(s)
            if one.kv.allocated_bytes != before:
                assert taken.pop(s) == one.kv.allocated_bytes
            assert s not in taken
            a.end_step(1.0 + s), b.end_step(1.0 + s)
        assert not taken and many.kv.allocated_bytes == one.kv.allocated_bytes
        assert sorted(b._slots_at) == sorted(a._slots_at)
        a.apply(), b.apply()
        assert _request_state(reqs_many) == _request_state(reqs_one)
    assert not one.running and log_many == log_one and len(log_one) > 10


def test_a_window_takes_its_pages_as_the_pools_page_grants():
    """A quiet window's page grows come from the paged KV pool as page grants
    (``Paged.allocate_pages``: the pages themselves, no ``Allocation`` each), one latency
    sample a page, each counted by the pool as the one-page allocation it stands for; a
    finished request's grants go back with its other allocations (``free_each``)."""
    s = _long_decoding_batch(False, _LONG_BATCH[1:])
    pool, policy = s.kv.pool, s.kv.pool.policy
    run = s.decode_run(policy)
    num_allocs, num_samples = policy.num_allocs, len(pool.alloc_ns)
    taken = run.take_slots_through(0, run.next_finish_step())
    grants = [a for r in s.running for a in r.kv.allocs if type(a) is not type(r.kv.allocs[0])]
    assert taken and grants and {type(a).__name__ for a in grants} == {"_Page"}
    assert policy.num_allocs - num_allocs == len(grants) == len(pool.alloc_ns) - num_samples
    assert policy.live_bytes == sum(a.nbytes for r in s.running for a in r.kv.allocs)
    assert s.kv.allocated_bytes == policy.allocated_bytes
    for r in list(s.running):
        s.kv.free(r.kv)
    assert policy.live_bytes == policy.allocated_bytes == 0
    assert policy.num_frees == policy.num_allocs


def _slot_state(run):
    """A run's due steps as request ids: first due steps, ring phases, the next slot step."""
    ids = {r.kv: r.request_id for r in run._first}
    return (
        {s: [r.request_id for r in due] for s, due in run._slots_at.items()},
        {p: [ids[h] for h in due] for p, due in run._ring.items()},
        list(run._phases),
        run.next_slot_step,
    )


def test_a_window_the_pool_refuses_leaves_its_due_steps_as_they_were():
    """When the KV cannot promise a window's pages (``grow_from_free_pages`` False),
    ``take_slots_through`` is None with nothing done: a request first due inside the window
    (the slack one, whose first page step joins a ring phase others hold) is back in its first
    due step, and the windows taken after give the calls ``take_slots`` makes step by step."""
    one, many = _long_decoding_batch(True), _long_decoding_batch(True)
    log_one, log_many = log_kv_calls(one.kv.pool), log_kv_calls(many.kv.pool)
    a, b = one.decode_run(one.kv.pool.policy), many.decode_run(many.kv.pool.policy)
    assert b._slots_at and b._next_first <= 2 * one.kv.tokens_per_page  # a join to undo
    before = _slot_state(b)
    grow = many.kv.grow_from_free_pages
    many.kv.grow_from_free_pages = lambda *args: False
    assert b.take_slots_through(0, b._next_first + 3) is None
    assert _slot_state(b) == before and not log_many
    many.kv.grow_from_free_pages = grow
    while b.num_seqs:
        first = b.num_steps
        last = min(first + 20, b.next_finish_step())
        taken = b.take_slots_through(first, last)
        for s in range(first, last + 1):
            assert a.take_slots(s)
            assert taken.pop(s, None) in (None, one.kv.allocated_bytes)
            a.end_step(1.0 + s), b.end_step(1.0 + s)
        assert _slot_state(a) == _slot_state(b)
    assert log_many == log_one and len(log_one) > 10


class _CountingDict(dict):
    """A dict that counts its keyed lookups and deletions (not its iteration)."""

    num_lookups = 0

    def get(self, key, default=None):
        self.num_lookups += 1
        return super().get(key, default)

    def pop(self, key, *default):
        self.num_lookups += 1
        return super().pop(key, *default)

    def __getitem__(self, key):
        self.num_lookups += 1
        return super().__getitem__(key)

    def __contains__(self, key):
        self.num_lookups += 1
        return super().__contains__(key)

    def __delitem__(self, key):
        self.num_lookups += 1
        super().__delitem__(key)


@pytest.mark.parametrize("slack", [False, True])
def test_a_window_walk_visits_only_its_slot_steps(slack):
    """``take_slots_through`` looks up only the steps at which some request grows (a few per
    step: its due list, the step it moves to, its removal), not every step of the window: the
    server's quiet windows are long, their slot steps few. The window is the whole way to the
    first finish (more than a page's worth of steps), and the pages are those step by step."""
    batch = _LONG_BATCH[1:]  # no early finish: the first is at step 58
    one, many = _long_decoding_batch(slack, batch), _long_decoding_batch(slack, batch)
    a, b = one.decode_run(one.kv.pool.policy), many.decode_run(many.kv.pool.policy)
    b._slots_at = counting = _CountingDict(b._slots_at)
    last = b.next_finish_step()
    assert last > 2 * one.kv.tokens_per_page
    taken = b.take_slots_through(0, last)
    assert taken and counting.num_lookups <= 3 * len(taken) < last
    for s in range(last + 1):
        before = one.kv.allocated_bytes
        assert a.take_slots(s)
        if one.kv.allocated_bytes != before:
            assert taken.pop(s) == one.kv.allocated_bytes
    assert not taken and many.kv.allocated_bytes == one.kv.allocated_bytes
    assert sorted(b._slots_at) == sorted(a._slots_at)


def test_take_slots_without_a_page_source_passes_only_steps_whose_requests_finished():
    """A run without a page source (``decode_run(None)``: a contiguous KV, or no free pages to
    take) takes no slot: ``take_slots`` of a step due for a running request is False with nothing
    done, and True once every request due then has finished (the step is dropped, the next slot
    step moves on), as ``take_slots_through``'s one-step window. The next finish steps come in
    order from the run's sorted list."""
    s = _decoding_batch("paged")
    first = next(r for r in s.running if r.request_id == 0)  # finishes at step 7, a slot at 8
    for r in s.running:  # the others' slots last past the test's steps
        if r is not first:
            assert s.kv.grow(r.kv, r.kv.capacity_tokens + 64, r.num_computed)
    run = s.decode_run(None)
    assert run is not None and run.next_slot_step == 8 and run.next_finish_step() == 2
    log = log_kv_calls(s.kv.pool)
    assert not run.take_slots(8) and run.next_slot_step == 8  # request 0 still runs
    assert [run.take_slots(k) for k in range(8)] == [True] * 8  # nothing due before 8
    finishes = []
    while run.num_steps < 8:
        if run.end_step(1.0 + run.num_steps):
            finishes.append(run.num_steps - 1)
            assert run.next_finish_step() > finishes[-1]
    assert finishes == [2, 7] and first.status is RequestState.FINISHED
    assert run.take_slots(8) and run.next_slot_step > 8 and 8 not in run._slots_at
    due_running = min(
        k for k, due in run._slots_at.items() if any(r.status is RequestState.RUNNING for r in due)
    )
    assert not run.take_slots(due_running) and due_running in run._slots_at  # still False
    assert log and {c[0] for c in log} == {"free"}  # the two finishes' frees, no grow
