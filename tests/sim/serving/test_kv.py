import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from sim.replay.costs import CostedDevice
from sim.serving.config import ServerConfig
from sim.serving.kv import ContiguousKV, PagedKV, next_pow2
from sim.serving.pools import TimedPool

BPT = 1024  # bytes per token
MiB = 1 << 20


def contiguous(strategy, budget_bytes=64 * MiB, max_model_len=4096, grow_tokens=256):
    # the policy may reserve more (its segments are 32 MiB): the manager keeps KV within the budget
    pool = TimedPool(policies.create("best-fit", device=CostedDevice()))
    cfg = ServerConfig(kv_strategy=strategy, max_model_len=max_model_len, grow_tokens=grow_tokens)
    return ContiguousKV(pool, cfg, bytes_per_token=BPT, budget_bytes=budget_bytes)


def paged(budget_bytes=64 * MiB, prefix_caching=True, block_tokens=64, tokens_per_page=16):
    pool = TimedPool(
        policies.create(
            "paged",
            capacity_bytes=budget_bytes,
            bytes_per_token=BPT,
            tokens_per_page=tokens_per_page,
            segment_bytes=MiB,
            device=CostedDevice(),
        )
    )
    cfg = ServerConfig(prefix_caching=prefix_caching, prefix_block_tokens=block_tokens)
    return PagedKV(
        pool, cfg, bytes_per_token=BPT, budget_bytes=budget_bytes, tokens_per_page=tokens_per_page
    )


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 1000, 1024, 1025)] == [
        1,
        2,
        4,
        4,
        8,
        1024,
        1024,
        2048,
    ]


@pytest.mark.parametrize(
    "strategy, expected_tokens",
    [("max", 4096), ("oracle", 300 + 50), ("pow2", 512), ("pow2-oracle", 300 + 64), ("grow", 512)],
)
def test_first_reservation_follows_the_strategy(strategy, expected_tokens):
    kv = contiguous(strategy)
    h = kv.new_handle(300, 50)
    assert kv.admit(h, 300)
    assert h.capacity_tokens == expected_tokens
    assert h.allocs[0].nbytes == expected_tokens * BPT


def test_pow2_doubles_and_copies_the_written_tokens_on_overflow():
    kv = contiguous("pow2")
    h = kv.new_handle(300, 1000)
    kv.admit(h, 301)
    assert kv.grow(h, 513, 512)
    assert h.capacity_tokens == 1024
    assert kv.take_copy_bytes() == 512 * BPT
    assert kv.num_reallocs == 1
    assert kv.take_copy_bytes() == 0  # taken once


def test_grow_adds_one_chunk_on_overflow():
    kv = contiguous("grow", grow_tokens=256)
    h = kv.new_handle(100, 1000)
    kv.admit(h, 101)
    assert h.capacity_tokens == 256
    kv.grow(h, 257, 256)
    assert h.capacity_tokens == 512


def test_growth_within_capacity_allocates_nothing():
    kv = contiguous("oracle")
    h = kv.new_handle(100, 100)
    kv.admit(h, 101)
    n = len(kv.pool.alloc_ns)
    assert kv.grow(h, 199, 198)
    assert len(kv.pool.alloc_ns) == n


def test_contiguous_stays_within_the_budget_and_fails_without_change():
    kv = contiguous("oracle", budget_bytes=1000 * BPT)
    a, b = kv.new_handle(500, 100), kv.new_handle(500, 100)
    assert kv.admit(a, 500)
    assert not kv.admit(b, 500)
    assert b.capacity_tokens == 0 and not b.allocs
    assert kv.allocated_bytes == a.allocs[0].size_bytes


def test_free_returns_every_byte():
    kv = contiguous("pow2")
    h = kv.new_handle(100, 1000)
    kv.admit(h, 101)
    kv.grow(h, 300, 128)
    kv.free(h)
    assert kv.allocated_bytes == 0
    assert kv.pool.policy.allocated_bytes == 0


def test_unknown_strategy_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_strategy"):
        contiguous("lucky")


def test_peak_bytes_is_the_final_reservation():
    assert contiguous("max").peak_bytes(100, 10) == 4096 * BPT
    assert contiguous("pow2").peak_bytes(100, 29) == 128 * BPT
    assert paged().peak_bytes(100, 29) == 128 * BPT  # 128 tokens = 8 pages of 16


def test_paged_grows_one_page_at_a_time():
    kv = paged(prefix_caching=False)
    h = kv.new_handle(20, 100)
    kv.admit(h, 20)
    assert h.capacity_tokens == 32 and h.num_own_pages == 2
    kv.grow(h, 33)
    assert h.capacity_tokens == 48 and len(h.allocs) == 2
    assert h.allocs[1].size_bytes == kv.page_bytes


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=20))
def test_paged_accounting_is_exact(sizes):
    kv = paged(prefix_caching=False)
    handles = []
    for p, o in sizes:
        h = kv.new_handle(p, o)
        if kv.admit(h, p) and kv.grow(h, p + o):
            handles.append(h)
        assert kv.allocated_bytes == kv.pool.policy.allocated_bytes
        assert kv.allocated_bytes <= kv.budget_bytes
    for h in handles:
        assert h.capacity_tokens == h.num_own_pages * kv.tokens_per_page
        kv.free(h)
    assert kv.allocated_bytes == 0 == kv.pool.policy.allocated_bytes


# ----------------------------------------------------------------------------- prefix cache
def run_prefill(kv, h, tokens):
    kv.mark_computed(h, tokens)


def test_a_computed_prefix_is_hit_and_shared():
    kv = paged(block_tokens=64)
    a = kv.new_handle(200, 10, (1, 2, 3))
    assert kv.match_prefix(a) == 0
    kv.admit(a, 200)
    run_prefill(kv, a, 200)
    b = kv.new_handle(200, 10, (1, 2, 9))
    assert kv.match_prefix(b) == 128
    before = kv.allocated_bytes
    kv.admit(b, 200)
    first_page = kv.block_cache.cached_block(b.blocks[0]).extents[0][0]
    assert b.blocks[:2] == a.blocks[:2] and kv.block_cache.page_refcount(first_page) == 2
    # b holds its own third block and pages for the 8-token tail, but not the two shared blocks
    assert kv.allocated_bytes - before == kv.block_bytes + kv.page_bytes
    assert kv.prefix_hit_tokens == 128 and kv.prefix_saved_bytes == 2 * kv.block_bytes


def test_a_block_not_yet_computed_is_not_hit():
    kv = paged(block_tokens=64)
    a = kv.new_handle(200, 10, (1, 2, 3))
    kv.admit(a, 100)
    run_prefill(kv, a, 63)  # not one whole block yet
    assert kv.match_prefix(kv.new_handle(200, 10, (1, 2, 3))) == 0
    run_prefill(kv, a, 64)
    assert kv.match_prefix(kv.new_handle(200, 10, (1, 2, 3))) == 64


def test_the_last_prompt_token_is_always_computed():
    kv = paged(block_tokens=64)
    a = kv.new_handle(128, 10, (1, 2))
    kv.admit(a, 128)
    run_prefill(kv, a, 128)
    assert kv.match_prefix(kv.new_handle(128, 10, (1, 2))) == 127


def test_freed_blocks_stay_cached_until_evicted_lru_first():
    budget = 6 * 64 * BPT  # six blocks of 64 tokens
    kv = paged(budget_bytes=budget, block_tokens=64)
    for hid in (1, 2, 3):
        h = kv.new_handle(64, 1, (hid,))
        kv.admit(h, 64)
        run_prefill(kv, h, 64)
        kv.free(h)
    assert kv.evictable_bytes == 3 * kv.block_bytes
    assert kv.allocated_bytes == 3 * kv.block_bytes
    big = kv.new_handle(4 * 64, 1)
    assert kv.admit(big, 4 * 64)  # needs one block's worth evicted: the oldest, id 1
    assert kv.num_evictions == 1
    assert kv.match_prefix(kv.new_handle(64 + 1, 1, (1,))) == 0
    assert kv.match_prefix(kv.new_handle(64 + 1, 1, (2,))) == 64


def test_a_hit_on_a_cached_block_takes_it_off_the_eviction_list():
    kv = paged(block_tokens=64)
    a = kv.new_handle(65, 1, (7,))
    kv.admit(a, 65)
    run_prefill(kv, a, 65)
    kv.free(a)
    b = kv.new_handle(65, 1, (7,))
    kv.admit(b, 65)
    assert kv.evictable_bytes == 0 and b.blocks == [7]
    page = kv.block_cache.cached_block(7).extents[0][0]
    assert kv.block_cache.page_refcount(page) == 1  # the policy counts the holder: b


def test_the_paged_policy_owns_the_reference_counts_of_shared_blocks():
    kv = paged(block_tokens=64)
    a = kv.new_handle(65, 1, (7,))
    kv.admit(a, 65)
    run_prefill(kv, a, 65)
    b = kv.new_handle(65, 1, (7,))
    kv.admit(b, 65)
    cache = kv.block_cache
    pages = [off for off, _ in cache.cached_block(7).extents]
    assert [cache.page_refcount(p) for p in pages] == [2] * len(pages)
    kv.free(a)
    assert cache.page_refcount(pages[0]) == 1 and kv.evictable_bytes == 0
    kv.free(b)
    assert cache.page_refcount(pages[0]) == 0 and kv.evictable_bytes == kv.block_bytes
    assert cache.num_cached_blocks() == 1


def test_a_block_freed_before_it_was_computed_is_not_cached():
    kv = paged(block_tokens=64)
    a = kv.new_handle(129, 1, (1, 2))
    kv.admit(a, 64)  # a chunk: block 1 computed after the step, block 2 not
    kv.mark_computed(a, 64)
    kv.free(a)
    assert kv.block_cache.num_cached_blocks() == 1 and kv.evictable_bytes == kv.block_bytes
    assert kv.allocated_bytes == kv.block_bytes  # block 2 went back to the pool


def test_without_prefix_caching_hash_ids_are_ignored():
    kv = paged(prefix_caching=False, block_tokens=64)
    assert kv.new_handle(200, 10, (1, 2, 3)).hash_ids == ()


def test_failed_admission_leaves_the_cache_as_it_was():
    budget = 4 * 64 * BPT
    kv = paged(budget_bytes=budget, block_tokens=64)
    a = kv.new_handle(128, 1, (1, 2))
    kv.admit(a, 128)
    run_prefill(kv, a, 128)
    b = kv.new_handle(10 * 64, 1, (1, 2, 3))
    assert not kv.admit(b, 10 * 64)
    cache = kv.block_cache
    assert [cache.page_refcount(cache.cached_block(hid).extents[0][0]) for hid in a.blocks] == [
        1,
        1,
    ]
    assert kv.allocated_bytes == 2 * kv.block_bytes
    assert cache.cached_block(3) is None and cache.num_cached_blocks() == 2
