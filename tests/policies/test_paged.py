"""The ``paged`` policy: page counts, LIFO reuse, growth, reference-counted sharing, capacity."""

import csv
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from policies.device import VirtualDevice
from policies.base import Allocation
from policies.errors import PolicyError
from policies.paged import Paged
from policies.testing import check_invariants

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4 * KiB
AZURE_CODE = Path("/work/shared/data/traces/AzureLLMInferenceTrace_code.csv")


def small_pool(**knobs) -> Paged:
    """4 KiB pages, four to a segment, so tests can count pages by hand."""
    return Paged(**{"page_bytes": PAGE, "segment_bytes": 4 * PAGE, **knobs})


def pages_of(a) -> list[int]:
    return [off for off, _ in a.extents]


def check_pool(pool: Paged, live: list) -> None:
    """Reference counts, free pages and every counter agree with the live allocations."""
    held = Counter(off for a in live for off in pages_of(a))
    free = [off for off, _ in pool.free_extents()]
    assert not set(free) & set(held), "a page is both free and held"
    assert (
        len(free) + len(held)
        == pool.num_total_pages()
        == pool.reserved_bytes // pool.page_size_bytes
    )
    for off, count in held.items():
        assert pool.page_refcount(off) == count
    for off in free:
        assert pool.page_refcount(off) == 0
    assert pool.allocated_bytes == len(held) * pool.page_size_bytes
    assert pool.largest_free_bytes() == len(free) * pool.page_size_bytes
    for s in pool.segments():
        assert s.num_live == sum(1 for off in held if s.offset <= off < s.end)
        assert s.nbytes % pool.page_size_bytes == 0
    for a in live:
        assert len(set(pages_of(a))) == len(a.extents), "an allocation holds a page twice"
        assert all(n == pool.page_size_bytes for _, n in a.extents)


# ----------------------------------------------------------------- pages
def test_page_is_tokens_per_page_times_bytes_per_token_by_default():
    pool = Paged()
    assert pool.page_size_bytes == 16 * 131072 == 2 * MiB
    assert pool.pages_per_segment == 32
    assert pool.get_params()["page_bytes"] is None


def test_page_bytes_overrides_and_segment_rounds_up_to_whole_pages():
    pool = Paged(page_bytes=3 * MiB, segment_bytes=64 * MiB)
    assert pool.page_size_bytes == 3 * MiB and pool.pages_per_segment == 22


@pytest.mark.parametrize(
    "knobs",
    [
        {"page_bytes": 1000},
        {"tokens_per_page": 16, "bytes_per_token": 100},
        {"page_bytes": 0},
        {"tokens_per_page": 0},
        {"segment_bytes": 0},
    ],
)
def test_bad_knobs_raise_policy_error(knobs):
    with pytest.raises(PolicyError):
        Paged(**knobs)


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(1, 40 * PAGE))
def test_a_request_gets_ceil_nbytes_over_page_pages(nbytes):
    pool = small_pool()
    a = pool.allocate(nbytes)
    num_pages = -(-nbytes // PAGE)
    assert len(a.extents) == num_pages and a.size_bytes == num_pages * PAGE
    check_pool(pool, [a])


def test_a_fresh_segment_hands_out_pages_in_address_order():
    pool = small_pool()
    a = pool.allocate(3 * PAGE)
    start = pool.segments()[0].offset
    assert pages_of(a) == [start, start + PAGE, start + 2 * PAGE]


# ----------------------------------------------------------------- reuse and growth
def test_the_last_freed_page_is_reused_first():
    pool = small_pool()
    a, b, c = (pool.allocate(PAGE) for _ in range(3))
    pool.free(a)
    pool.free(c)
    assert pool.allocate(1).offset == c.offset
    assert pool.allocate(1).offset == a.offset


def test_allocate_then_free_leaves_the_free_stack_as_it_was():
    pool = small_pool()
    pool.free(pool.allocate(7 * PAGE))

    def pop_order() -> list[int]:
        singles = [pool.allocate(PAGE) for _ in range(8)]
        for x in reversed(singles):
            pool.free(x)
        return [x.offset for x in singles]

    before = pop_order()
    pool.free(pool.allocate(3 * PAGE))
    assert pop_order() == before


def test_growth_takes_free_pages_first_then_one_segment_for_the_shortfall():
    pool = small_pool()
    keep = pool.allocate(PAGE)  # 3 pages of the first segment stay free
    a = pool.allocate(5 * PAGE)  # 3 free + 2 of a new 4-page segment
    assert pool.num_grows == 2 and [s.nbytes for s in pool.segments()] == [4 * PAGE, 4 * PAGE]
    first, second = pool.segments()
    assert sum(first.offset <= off < first.end for off in pages_of(a)) == 3
    assert pool.num_free_pages() == 2
    check_pool(pool, [keep, a])


def test_a_big_request_grows_by_whole_segments_in_one_reservation():
    pool = small_pool()
    pool.allocate(10 * PAGE)
    assert [s.nbytes for s in pool.segments()] == [12 * PAGE]


def test_pages_freed_earlier_are_used_before_a_pre_grown_segment():
    pool = small_pool()
    a = pool.allocate(PAGE)
    pool.free(a)
    assert pool.grow(4 * PAGE)
    assert pool.allocate(PAGE).offset == a.offset
    assert pool.segments()[1].num_live == 0  # the grown segment stays trimmable


def test_segment_counts_are_exact_when_read_though_the_page_paths_skip_them():
    """The page paths (one page, many, the batched calls, forks) leave ``Segment.num_live``
    alone; ``segments()`` and a trim count it from the free stack, so every read is exact and a
    segment emptied by frees alone is released by ``trim``."""
    pool = small_pool()
    assert pool.grow(8 * PAGE)  # a second segment beside the first
    big = pool.allocate(5 * PAGE)
    ones = pool.allocate_each(PAGE, 3, stream=0, tag="kv")
    f = pool.fork(big)
    live = [big, f, *ones]
    for seg in pool.segments():
        held = sum(seg.offset <= off < seg.end for a in (big, *ones) for off in pages_of(a))
        assert seg.num_live == held
    check_pool(pool, live)
    pool.free_each([big, *ones])  # the fork still holds big's pages
    check_pool(pool, [f])
    pool.free(f)
    assert all(seg.num_live == 0 for seg in pool.segments())
    assert pool.trim() > 0 and pool.reserved_bytes == 0
    check_pool(pool, [])


# ----------------------------------------------------------------- sharing
def test_fork_shares_every_page_without_new_bytes():
    pool = small_pool()
    a = pool.allocate(3 * PAGE - 5, tag="beam")
    f = pool.fork(a)
    assert f.extents == a.extents and f.nbytes == a.nbytes and f.tag == "beam"
    assert pool.allocated_bytes == 3 * PAGE and pool.num_live == 2
    assert all(pool.page_refcount(off) == 2 for off in pages_of(a))
    check_pool(pool, [a, f])


@pytest.mark.parametrize("first", ["original", "fork"])
def test_a_shared_page_returns_only_when_its_last_holder_frees(first):
    pool = small_pool()
    a = pool.allocate(2 * PAGE)
    f = pool.fork(a)
    pool.free(a if first == "original" else f)
    assert pool.num_free_pages() == 2 and pool.allocated_bytes == 2 * PAGE
    pool.free(f if first == "original" else a)
    assert pool.num_free_pages() == 4 and pool.allocated_bytes == 0
    check_pool(pool, [])


@pytest.mark.parametrize("share", [None, "fork", "allocate_shared"])
def test_free_each_of_page_runs_is_the_loop_of_free_with_or_without_shared_pages(share):
    """``free_each`` hands a run of pages back without testing each page while no page was ever
    shared; once one is (a fork, ``allocate_shared``) it tests each again: either way the free
    stack, reference counts and counters of the loop of ``free``."""

    def build():
        pool = small_pool()
        runs = [pool.allocate(n * PAGE) for n in (3, 2, 4)]
        held = []
        if share == "fork":
            held.append(pool.fork(runs[0]))
        elif share == "allocate_shared":
            held.append(pool.allocate_shared(pages_of(runs[2])[1:3], PAGE))
        return pool, runs, held

    fused, runs, held = build()
    loop, loop_runs, loop_held = build()
    fused.free_each(runs)
    for a in loop_runs:
        loop.free(a)
    assert [off for off, _ in fused.free_extents()] == [off for off, _ in loop.free_extents()]
    assert [pg.offset for pg in fused._free_pages] == [pg.offset for pg in loop._free_pages]
    check_pool(fused, held)
    check_pool(loop, loop_held)
    for name in ("num_frees", "live_bytes", "allocated_bytes"):
        assert getattr(fused, name) == getattr(loop, name)


def test_allocate_shared_holds_the_prefix_pages_first_then_fresh_ones():
    pool = small_pool()
    prompt = pool.allocate(3 * PAGE)
    prefix = pages_of(prompt)[:2]
    b = pool.allocate_shared(prefix, PAGE + 1, tag="req-2")
    assert pages_of(b)[:2] == prefix and len(b.extents) == 4
    assert b.nbytes == 3 * PAGE + 1 and b.size_bytes == 4 * PAGE and b.tag == "req-2"
    assert [pool.page_refcount(off) for off in pages_of(prompt)] == [2, 2, 1]
    assert pool.allocated_bytes == 5 * PAGE
    check_pool(pool, [prompt, b])


def test_allocate_shared_with_an_allocation_shares_all_its_pages():
    pool = small_pool()
    a = pool.allocate(2 * PAGE)
    b = pool.allocate_shared(a, 1)
    assert pages_of(b)[:2] == pages_of(a) and len(b.extents) == 3
    check_pool(pool, [a, b])


@pytest.mark.parametrize(
    "bad", ["free page", "unknown offset", "twice", "negative extra", "empty", "freed allocation"]
)
def test_allocate_shared_rejects_bad_input_and_changes_nothing(bad):
    pool = small_pool()
    a = pool.allocate(2 * PAGE)
    gone = pool.allocate(PAGE)
    pool.free(gone)
    p0, p1 = pages_of(a)
    args = {
        "free page": ([gone.offset], 0),
        "unknown offset": ([p0 + 1], 0),
        "twice": ([p0, p0], 0),
        "negative extra": ([p0], -1),
        "empty": ([], 0),
        "freed allocation": (gone, 0),
    }[bad]
    before = (pool.stats(), pool.free_extents())
    with pytest.raises(PolicyError):
        pool.allocate_shared(*args)
    assert (pool.stats(), pool.free_extents()) == before
    check_pool(pool, [a])


def test_fork_of_a_freed_allocation_raises():
    pool = small_pool()
    a = pool.allocate(PAGE)
    pool.free(a)
    with pytest.raises(PolicyError, match="already freed"):
        pool.fork(a)


def test_refused_allocate_shared_is_a_failure_and_changes_nothing():
    pool = small_pool(capacity_bytes=4 * PAGE)
    a = pool.allocate(3 * PAGE)
    before = pool.free_extents()
    assert pool.allocate_shared(a, 2 * PAGE) is None
    assert pool.num_failures == 1 and pool.free_extents() == before
    assert [pool.page_refcount(off) for off in pages_of(a)] == [1, 1, 1]
    check_pool(pool, [a])


# ----------------------------------------------------------------- capacity and trim
def test_refused_request_returns_none_and_changes_nothing():
    pool = small_pool(capacity_bytes=8 * PAGE)
    a = pool.allocate(6 * PAGE)  # 8 pages reserved, 2 free
    stack = [pool.allocate(PAGE), pool.allocate(PAGE)]
    order = [x.offset for x in stack]
    for x in reversed(stack):
        pool.free(x)
    before = pool.stats()
    assert pool.allocate(3 * PAGE) is None
    assert {**pool.stats().as_dict(), "num_failures": 0} == {**before.as_dict(), "num_failures": 0}
    assert pool.num_failures == 1
    again = [pool.allocate(PAGE), pool.allocate(PAGE)]
    assert [x.offset for x in again] == order  # the stack is intact
    check_pool(pool, [a, *again])


def test_near_capacity_growth_takes_the_pages_that_still_fit():
    pool = small_pool(capacity_bytes=6 * PAGE)
    assert pool.allocate(5 * PAGE) is not None
    assert pool.reserved_bytes == 6 * PAGE


def test_device_refusal_falls_back_to_the_exact_shortfall():
    pool = small_pool(device=VirtualDevice(limit_bytes=2 * PAGE))
    assert pool.allocate(2 * PAGE) is not None and pool.reserved_bytes == 2 * PAGE
    assert pool.allocate(1) is None


def test_trim_releases_only_fully_free_segments_and_forgets_their_pages():
    pool = small_pool()
    keep = pool.allocate(PAGE)
    big = pool.allocate(8 * PAGE)  # 3 pages of segment 1 and one new 8-page segment (5 used)
    pool.free(big)
    assert pool.trim() == 8 * PAGE
    assert pool.num_total_pages() == 4 and pool.num_free_pages() == 3
    with pytest.raises(PolicyError):
        pool.page_refcount(pool.segments()[0].end + 2 * MiB)
    check_pool(pool, [keep])


def test_trim_max_bytes_releases_largest_segments_until_enough():
    pool = small_pool()
    live = [pool.allocate(4 * PAGE), pool.allocate(8 * PAGE), pool.allocate(4 * PAGE)]
    for a in live:
        pool.free(a)
    assert pool.trim(6 * PAGE) == 8 * PAGE
    assert pool.reserved_bytes == 8 * PAGE
    check_pool(pool, [])


def test_shared_extents_are_the_pages_with_several_holders():
    pool = small_pool()
    a = pool.allocate(3 * PAGE)
    b = pool.allocate_shared(pages_of(a)[1:], 0)
    assert pool.shared_extents() == [(off, PAGE) for off in pages_of(a)[1:]]
    pool.free(a)
    assert pool.shared_extents() == []
    check_invariants(pool, [b])


def test_free_extents_are_the_free_pages_in_address_order():
    pool = small_pool()
    a, b, c = (pool.allocate(PAGE) for _ in range(3))
    pool.free(c)
    pool.free(a)
    assert pool.free_extents() == [(a.offset, PAGE), (c.offset, PAGE), (c.offset + PAGE, PAGE)]
    assert pool.largest_free_bytes() == 3 * PAGE


# ----------------------------------------------------------------- prefix cache (vLLM's BlockPool)
def cached_pool():
    pool = small_pool()
    a = pool.allocate(2 * PAGE)
    pool.cache_block("h1", a)
    return pool, a


def test_a_cached_block_is_found_and_shared_by_page_reference_counts():
    pool, a = cached_pool()
    assert pool.cached_block("h1") is a and pool.cached_block("h2") is None
    allocated = pool.allocated_bytes
    assert pool.share_block("h1") is a
    assert [pool.page_refcount(off) for off in pages_of(a)] == [2, 2]
    assert pool.allocated_bytes == allocated  # a hit takes no new bytes


def test_a_block_nobody_holds_stays_cached_and_allocated_until_evicted():
    pool, a = cached_pool()
    pool.share_block("h1")
    assert pool.release_block("h1") is False  # one holder left
    assert pool.release_block("h1") is True
    assert [pool.page_refcount(off) for off in pages_of(a)] == [0, 0]
    assert pool.evictable_bytes == 2 * PAGE and pool.allocated_bytes == 2 * PAGE
    assert not set(pages_of(a)) & {off for off, _ in pool.free_extents()}, (
        "cached pages are not free"
    )
    assert pool.cached_block("h1") is a


def test_a_hit_takes_an_evictable_block_back_out_of_the_queue():
    pool, a = cached_pool()
    pool.release_block("h1")
    pool.share_block("h1")
    assert pool.evictable_bytes == 0 and pool.page_refcount(pages_of(a)[0]) == 1
    assert pool.evict_block() is None


def test_eviction_is_least_recently_released_first_and_hands_the_allocation_back():
    pool = small_pool()
    blocks = {key: pool.allocate(PAGE) for key in ("a", "b", "c")}
    for key, alloc in blocks.items():
        pool.cache_block(key, alloc)
    for key in ("b", "a", "c"):
        pool.release_block(key)
    pool.share_block("a")  # a hit: "a" is no longer evictable
    first = pool.evict_block()
    assert first is blocks["b"] and pool.cached_block("b") is None
    assert pool.page_refcount(pages_of(first)[0]) == 1  # the caller holds it now
    pool.free(first)
    assert pool.page_refcount(pages_of(first)[0]) == 0 and pool.evictable_bytes == PAGE
    assert pool.evict_block() is blocks["c"]
    assert pool.evict_block() is None and pool.num_cached_blocks() == 1


@pytest.mark.parametrize("evictable", [False, True])
def test_freeing_a_cached_block_is_refused_and_changes_nothing(evictable):
    pool, a = cached_pool()
    if evictable:
        pool.release_block("h1")
    with pytest.raises(PolicyError, match="cached block 'h1'"):
        pool.free(a)
    assert pool.cached_block("h1") is a and pool.allocated_bytes == 2 * PAGE and pool.num_frees == 0
    assert pool.page_refcount(pages_of(a)[0]) == (0 if evictable else 1)


def test_a_fork_of_a_cached_block_may_be_freed_while_the_block_is_held():
    pool, a = cached_pool()
    f = pool.fork(a)
    pool.free(f)
    assert pool.page_refcount(pages_of(a)[0]) == 1 and pool.cached_block("h1") is a


@pytest.mark.parametrize(
    "bad", ["twice", "unknown share", "unknown release", "unheld release", "freed"]
)
def test_bad_cache_calls_raise_and_change_nothing(bad):
    pool, a = cached_pool()
    before = (
        pool.allocated_bytes,
        pool.evictable_bytes,
        [pool.page_refcount(off) for off in pages_of(a)],
    )
    with pytest.raises(PolicyError):
        if bad == "twice":
            pool.cache_block("h1", pool.allocate(PAGE))
        elif bad == "unknown share":
            pool.share_block("nope")
        elif bad == "unknown release":
            pool.release_block("nope")
        elif bad == "unheld release":
            pool.release_block("h1")
            before = (pool.allocated_bytes, pool.evictable_bytes, [0, 0])
            pool.release_block("h1")
        else:
            b = pool.allocate(PAGE)
            pool.free(b)
            pool.cache_block("h2", b)
    if bad == "twice":
        before = (before[0] + PAGE,) + before[1:]
    assert (
        pool.allocated_bytes,
        pool.evictable_bytes,
        [pool.page_refcount(off) for off in pages_of(a)],
    ) == before


def test_the_cache_works_through_a_wrapper_stack():
    pool = policies.create("elastic:base=[paged:page_bytes=4KiB,segment_bytes=16KiB]")
    cache = pool.block_cache  # declared: the wrapper forwards its base's
    assert cache is pool.base_policy and policies.create("best-fit").block_cache is None
    a = pool.allocate(2 * PAGE)  # the wrapper's allocation; its extents are the paged layer's pages
    cache.cache_block(7, a)
    cache.release_block(7)
    assert cache.evict_block() is a
    pool.free(a)  # freed through the stack that handed it out
    assert pool.allocated_bytes == 0 and cache.num_cached_blocks() == 0


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "share", "release", "evict"]),
            st.integers(1, 3 * PAGE),
            st.integers(0, 99),
        ),
        max_size=60,
    )
)
def test_random_cache_workload_keeps_counts_in_step(ops):
    """A model of holders per key against the pool's page reference counts and queue."""
    pool = small_pool()
    holders: dict[int, int] = {}
    allocs: dict[int, object] = {}
    for i, (op, nbytes, pick) in enumerate(ops):
        keys = sorted(holders)
        if op == "alloc" or not keys:
            a = pool.allocate(nbytes)
            pool.cache_block(i, a)
            holders[i], allocs[i] = 1, a
        elif op == "share":
            key = keys[pick % len(keys)]
            pool.share_block(key)
            holders[key] += 1
        elif op == "release":
            held = [k for k in keys if holders[k]]
            if held:
                key = held[pick % len(held)]
                holders[key] -= 1
                assert pool.release_block(key) is (holders[key] == 0)
        else:
            a = pool.evict_block()
            if a is not None:
                key = next(k for k, v in allocs.items() if v is a)
                assert holders.pop(key) == 0
                del allocs[key]
                pool.free(a)
        for key, n in holders.items():
            assert {pool.page_refcount(off) for off in pages_of(allocs[key])} == {n}
        assert pool.evictable_bytes == sum(
            len(allocs[k].extents) * PAGE for k, n in holders.items() if n == 0
        )
        assert pool.allocated_bytes == sum(len(a.extents) * PAGE for a in allocs.values())
    assert pool.num_cached_blocks() == len(holders)


# ----------------------------------------------------------------- properties and real data
@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "fork", "shared"]),
            st.integers(1, 9 * PAGE),
            st.integers(0, 99),
        ),
        max_size=60,
    ),
    capacity=st.sampled_from([None, 16 * PAGE, 40 * PAGE]),
)
def test_random_workload_keeps_pages_disjoint_and_counted(ops, capacity):
    pool = small_pool(capacity_bytes=capacity)
    live = []
    for op, nbytes, pick in ops:
        if op == "alloc" or not live:
            a = pool.allocate(nbytes)
        elif op == "free":
            pool.free(live.pop(pick % len(live)))
            a = None
        elif op == "fork":
            a = pool.fork(live[pick % len(live)])
        else:
            src = live[pick % len(live)]
            a = pool.allocate_shared(pages_of(src)[: pick % (len(src.extents) + 1)], nbytes)
        if a is not None:
            live.append(a)
        if capacity is not None:
            assert pool.reserved_bytes <= capacity
    check_pool(pool, live)
    check_invariants(pool, live)  # the conformance suite's recount, shared pages included
    for a in live:
        pool.free(a)
    check_pool(pool, [])
    assert pool.num_free_pages() == pool.num_total_pages()


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6 * PAGE), min_size=1, max_size=40),
    frees=st.lists(st.integers(0, 99)),
)
def test_extents_of_unshared_allocations_never_overlap(sizes, frees):
    pool = small_pool()
    live = [pool.allocate(n) for n in sizes]
    for pick in frees[: len(live) - 1]:
        pool.free(live.pop(pick % len(live)))
    live += [pool.allocate(n) for n in sizes]
    ranges = sorted(ext for a in live for ext in a.extents)
    assert all(o0 + n0 <= o1 for (o0, n0), (o1, _) in zip(ranges, ranges[1:]))
    check_pool(pool, live)


@pytest.mark.skipif(not AZURE_CODE.exists(), reason="bundled Azure trace not found")
def test_azure_requests_get_one_page_per_sixteen_tokens():
    pool = Paged(segment_bytes=256 * MiB)
    with AZURE_CODE.open() as f:
        rows = [row for row, _ in zip(csv.DictReader(f), range(300))]
    live = []
    for row in rows:
        tokens = int(row["ContextTokens"]) + int(row["GeneratedTokens"])
        a = pool.allocate(tokens * pool.bytes_per_token, tag="kv")
        assert len(a.extents) == -(-tokens // 16)
        live.append(a)
    check_pool(pool, live)
    for a in live:
        pool.free(a)
    assert pool.trim() == pool.grown_bytes and pool.reserved_bytes == 0


def test_spec_round_trips_through_the_registry():
    pool = policies.create("paged:tokens_per_page=32,bytes_per_token=65536", capacity_bytes=1 << 30)
    assert isinstance(pool, Paged) and pool.page_size_bytes == 2 * MiB
    assert pool.spec == "paged:tokens_per_page=32,bytes_per_token=65536"


def test_a_request_no_device_holds_is_refused_at_once_not_built_page_by_page():
    # issue 11: allocate(2**62) with no capacity built one page object per 2 MiB until killed
    pool = Paged()
    a = pool.allocate(MiB)
    before = pool.stats()
    assert pool.allocate(2**62) is None and pool.allocate_shared(a, 2**62) is None
    after = check_invariants(pool, [a])
    assert (
        after.num_failures == 2
        and pool.num_total_pages() == before.reserved_bytes // pool.page_size_bytes
    )
    assert (after.reserved_bytes, after.num_grows) == (before.reserved_bytes, before.num_grows)


def _paged_state(p: Paged, live) -> tuple:
    return (
        p.stats().as_dict(),
        [(a.extents, a.size_bytes, a.nbytes, a.stream, a.tag, a.live) for a in live],
        [pg.offset for pg in p._free_pages],  # the free stack's order: the next pages handed out
        sorted((off, pg.ref_cnt) for off, pg in p._pages.items()),
        p.device.call_stats(),
    )


@settings(max_examples=60, deadline=None)
@given(
    page_kib=st.sampled_from([4, 64, 2048]),
    capacity_pages=st.one_of(st.none(), st.integers(4, 40)),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "alloc", "free", "fork", "cache"]),
            st.integers(0, 7),  # calls, or which allocations
            st.sampled_from([1, 100, 4096, 65536, 3 << 20]),  # bytes: one page or several
        ),
        max_size=40,
    ),
)
def test_batched_calls_equal_the_loop_of_single_calls(page_kib, capacity_pages, ops):
    """Paged's fused ``allocate_each``/``free_each`` (one-page requests off the free stack, a
    finished request's pages) against ``allocate``/``free`` one by one: the same pages in the same
    order, the same free stack, reference counts, counters and device calls, with forks (shared
    pages), cached blocks (``free_each`` then takes the loop) and refusals near capacity."""
    page = page_kib << 10
    cap = None if capacity_pages is None else capacity_pages * page
    pools = [
        policies.create(f"paged:page_bytes={page},segment_bytes={4 * page}", capacity_bytes=cap)
        for _ in range(2)
    ]
    lives: list[list] = [[], []]
    for n, (op, k, nbytes) in enumerate(ops):
        raised = [None, None]
        for batched, (p, live) in enumerate(zip(pools, lives)):
            if op == "alloc":
                got = (
                    p.allocate_each(nbytes, k, stream=0, tag="kv")
                    if batched
                    else [p.allocate(nbytes, stream=0, tag="kv") for _ in range(k)]
                )
                live.extend(a for a in got if a is not None)
            elif op == "free" and live:
                picks = sorted({(k * 7 + j * 3) % len(live) for j in range(k + 1)})
                handles = [live[i] for i in picks]
                try:  # a cached block's last holder may not free it: both raise, nothing freed
                    if batched:
                        p.free_each(handles)
                    else:
                        for a in handles:
                            p.free(a)
                except PolicyError as exc:
                    raised[batched] = str(exc)
                live[:] = [a for a in live if a.live]
            elif op == "fork" and live:
                live.append(p.fork(live[k % len(live)]))
            elif op == "cache" and live and p.num_cached_blocks() == 0:
                p.cache_block(("b", n), live[k % len(live)])
        assert raised[0] == raised[1], (n, op)
        assert _paged_state(pools[0], lives[0]) == _paged_state(pools[1], lives[1]), (n, op)
    for p, live in zip(pools, lives):
        check_invariants(p, live)


def test_a_subclass_with_its_own_calls_is_batched_by_the_loop():
    """A subclass that overrides ``_allocate``/``_free`` gets the base class's loop (its own
    calls, one by one), not the fused path that would bypass them."""

    class Counting(Paged):
        def _reset_state(self):
            super()._reset_state()
            self.calls = 0

        def _allocate(self, nbytes, stream, tag):
            self.calls += 1
            return super()._allocate(nbytes, stream, tag)

        def _free(self, allocation):
            self.calls += 1
            super()._free(allocation)

    p = Counting(page_bytes=4096, segment_bytes=1 << 20)
    p.free(p.allocate(100))  # a segment's free pages for the batch
    got = p.allocate_each(100, 5)
    p.free_each(got)
    assert p.calls == 2 + 10


def _held_state(p: Paged, held) -> tuple:
    """A pool's state with what it handed out, allocations and page grants alike, read the same
    way: each one's pages, size and bytes asked for."""
    return (
        p.stats().as_dict(),
        [(a.extents, a.size_bytes, a.nbytes) for a in held],
        [pg.offset for pg in p._free_pages],
        sorted((off, pg.ref_cnt) for off, pg in p._pages.items()),
        p.device.call_stats(),
    )


@settings(max_examples=60, deadline=None)
@given(
    page_kib=st.sampled_from([4, 64, 2048]),
    capacity_pages=st.one_of(st.none(), st.integers(4, 40)),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["pages", "pages", "alloc", "free", "share", "cache"]),
            st.integers(0, 7),  # calls, or which of the held ones
            st.sampled_from([1, 100, 4096, 65536, 3 << 20]),  # bytes: one page or several
        ),
        max_size=40,
    ),
)
def test_page_grants_are_the_one_page_allocations_they_stand_for(page_kib, capacity_pages, ops):
    """``Paged.allocate_pages`` (page grants: the pages themselves) against the loop of
    ``allocate``: the same pages in the same order, the same counters, free stack, reference
    counts and device calls; ``free_each`` of grants among allocations (a finished request's KV)
    frees them as ``free`` frees those allocations one by one, with shared pages
    (``allocate_shared`` of a grant's page) and cached blocks (``free_each`` then takes the
    loop). None, with nothing done, where the fused path does not apply (more than a page, too
    few free pages)."""
    page = page_kib << 10
    cap = None if capacity_pages is None else capacity_pages * page
    pools = [
        policies.create(f"paged:page_bytes={page},segment_bytes={4 * page}", capacity_bytes=cap)
        for _ in range(2)
    ]
    helds: list[list] = [[], []]
    for n, (op, k, nbytes) in enumerate(ops):
        raised = [None, None]
        for granted, (p, held) in enumerate(zip(pools, helds)):
            if op == "pages":
                before = _held_state(p, held)
                got = p.allocate_pages(nbytes, k) if granted else None
                if granted and got is None:
                    assert _held_state(p, held) == before  # nothing done: then the calls
                if got is None:  # the contract: the loop of single calls
                    got = [p.allocate(nbytes, stream=0, tag="kv") for _ in range(k)]
                held.extend(a for a in got if a is not None)
            elif op == "alloc":
                a = p.allocate(nbytes)
                if a is not None:
                    held.append(a)
            elif op == "free" and held:
                picks = sorted({(k * 7 + j * 3) % len(held) for j in range(k + 1)})
                try:  # a cached block's last holder may not free it: both raise there
                    if granted:
                        p.free_each([held[i] for i in picks])
                    else:
                        for i in picks:
                            p.free(held[i])
                except PolicyError as exc:
                    raised[granted] = str(exc)
                held[:] = [a for i, a in enumerate(held) if i not in set(picks)]
            elif op == "share" and held:
                off = held[k % len(held)].extents[0][0]
                held.append(p.allocate_shared([off]))
            elif op == "cache" and held and p.num_cached_blocks() == 0:
                p.cache_block(("b", n), held[k % len(held)])
        assert raised[0] == raised[1], (n, op)
        assert _held_state(pools[0], helds[0]) == _held_state(pools[1], helds[1]), (n, op)
        if raised[0] is not None:  # the frees before the refused one were made, in both
            break
    else:
        check_invariants(pools[0], helds[0])


def test_a_grant_freed_twice_or_in_another_pool_is_refused():
    """A page grant goes back once, to the pool that granted it: a second free, or a free in
    another pool, raises PolicyError, after the frees before it in the call and changing
    nothing of the refused one."""
    p, q = Paged(page_bytes=4096, segment_bytes=1 << 16), Paged(page_bytes=4096)
    p.free(p.allocate(100))
    g = p.allocate_pages(100, 3)
    assert [pg.size_bytes for pg in g] == [4096] * 3 and p.num_allocs == 4
    assert p.live_bytes == 300 and p.allocated_bytes == 3 * 4096
    p.free_each(g[:1])
    with pytest.raises(PolicyError, match="not a page this pool granted"):
        p.free_each([g[1], g[0]])  # g[1] is freed first, then g[0] is refused
    assert p.live_bytes == 100 and p.num_frees == 3 and p.allocated_bytes == 4096
    with pytest.raises(PolicyError, match="not a page this pool granted"):
        q.free_each([g[2]])
    assert q.num_frees == 0 and p.page_refcount(g[2].offset) == 1
    assert p.allocate_pages(5000, 1) is None and p.allocate_pages(100, 99) is None
    assert p.num_allocs == 4
    with pytest.raises(PolicyError, match="does not grant pages"):
        policies.create("best-fit").allocate_pages(100, 1)


def test_a_run_of_pages_builds_its_extents_when_read():
    """A multi-page allocation's ``extents`` (one ``(offset, page)`` a page, in allocation
    order) are built from its pages when first read, then kept; a one-page allocation holds its
    page's. Both free through the fused ``free_each`` and fork as before."""
    page = 4096
    p = Paged(page_bytes=page, segment_bytes=1 << 16)
    a = p.allocate(3 * page)
    assert a._extents is None  # nothing built at allocation
    assert a.extents == tuple((pg.offset, page) for pg in a.handle) and len(a.extents) == 3
    assert a.extents is a._extents and a.offset == a.handle[0].offset
    one = p.allocate(100)
    assert type(one) is Allocation and one.extents == ((one.handle[0].offset, page),)
    f = p.fork(a)
    assert f.extents == a.extents and p.page_refcount(a.extents[0][0]) == 2
    p.free_each([a, one, f])
    assert p.live_bytes == 0 and p.allocated_bytes == 0 and p.num_frees == 3
