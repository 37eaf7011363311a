"""``cupy-pool``: CuPy's MemoryPool rules (exact-size chunks, best fit, split, merge,
free_all_blocks)."""

import pytest

import policies
from policies.cupy_pool import CupyPool
from policies.device import VirtualDevice
from policies.errors import PolicyError
from policies.testing import check_invariants

KiB, MiB = 1 << 10, 1 << 20


def test_a_miss_allocates_a_chunk_of_exactly_the_rounded_size():
    pool = CupyPool()
    a = pool.allocate(1000)
    b = pool.allocate(3 * MiB + 1)
    assert (a.size_bytes, b.size_bytes) == (1024, 3 * MiB + 512)
    assert [s.nbytes for s in pool.segments()] == [1024, 3 * MiB + 512]


def test_a_free_chunk_is_split_and_the_remainder_kept_however_small():
    pool = CupyPool()
    pool.free(pool.allocate(4096))
    a = pool.allocate(3584)
    assert a.size_bytes == 3584 and len(pool.segments()) == 1
    assert pool.free_extents() == [(a.offset + 3584, 512)]


def test_best_fit_takes_the_smallest_chunk_that_fits():
    pool = CupyPool()
    big, small = pool.allocate(64 * KiB), pool.allocate(8 * KiB)
    pool.free(big)
    pool.free(small)
    assert pool.allocate(6 * KiB).offset == small.offset


def test_each_stream_has_its_own_arena():
    pool = CupyPool()
    pool.free(pool.allocate(4096, stream=1))
    pool.allocate(4096, stream=2)
    assert len(pool.segments()) == 2


def test_freed_chunks_merge_within_one_cudamalloc_only():
    pool = CupyPool()
    first, second = pool.allocate(8 * KiB), pool.allocate(8 * KiB)  # two cudaMallocs
    pool.free(first)
    a, b = pool.allocate(4 * KiB), pool.allocate(4 * KiB)  # split the first chunk
    pool.free(a)
    pool.free(b)
    pool.free(second)
    assert sorted(n for _, n in pool.free_extents()) == [8 * KiB, 8 * KiB]


def test_free_all_blocks_releases_only_unsplit_chunks():
    pool = CupyPool()
    keep = pool.allocate(4 * KiB)
    pool.free(pool.allocate(8 * KiB))
    pool.free(pool.allocate(16 * KiB))
    part = pool.allocate(4 * KiB)  # best fit splits the 8 KiB chunk
    assert pool.free_all_blocks() == 16 * KiB
    assert sorted(s.nbytes for s in pool.segments()) == [4 * KiB, 8 * KiB]
    check_invariants(pool, [keep, part])


def test_when_the_device_refuses_it_frees_all_blocks_and_retries():
    # _try_malloc: cudaMalloc fails with errorMemoryAllocation -> free_all_blocks() -> try again
    device = VirtualDevice(limit_bytes=10 * MiB)
    pool = CupyPool(device=device)
    pool.free(pool.allocate(6 * MiB))
    a = pool.allocate(7 * MiB)
    assert a is not None and [s.nbytes for s in pool.segments()] == [7 * MiB]
    assert (pool.stats().num_shrinks, device.used_bytes) == (1, 7 * MiB)


def test_past_the_limit_it_fails_without_freeing_anything():
    # _try_malloc: _total_bytes + size > limit raises OutOfMemoryError before any cudaMalloc or free
    pool = CupyPool(capacity_bytes=10 * MiB)
    pool.free(pool.allocate(6 * MiB))
    before = pool.stats()
    assert pool.allocate(7 * MiB) is None
    after = check_invariants(pool, [])
    assert [s.nbytes for s in pool.segments()] == [6 * MiB]
    assert (after.num_failures, after.num_shrinks, after.reserved_bytes) == (
        1,
        0,
        before.reserved_bytes,
    )
    assert (
        pool.free_all_blocks() == 6 * MiB and pool.allocate(7 * MiB) is not None
    )  # as a CuPy user would


def test_a_request_beyond_the_limit_fails_cleanly():
    pool = CupyPool(capacity_bytes=10 * MiB)
    live = [pool.allocate(4 * MiB)]
    assert pool.allocate(7 * MiB) is None
    check_invariants(pool, live)
    assert pool.stats().num_failures == 1


def test_it_has_no_knobs_but_the_limit():
    assert policies.create("cupy-pool").get_params() == {"capacity_bytes": None}
    with pytest.raises(PolicyError, match="segment_bytes"):
        policies.create("cupy-pool:segment_bytes=1MiB")


def test_counters_read_like_cupys():
    pool = CupyPool()
    a = pool.allocate(1000)
    pool.allocate(2000)
    pool.free(a)
    assert (pool.used_bytes(), pool.total_bytes()) == (2048, 3072)
