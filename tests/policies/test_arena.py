"""``arena``: bump allocation, rewind when empty, retire and cache full arenas."""

import pytest

from policies.arena import Arena
from policies.errors import PolicyError
from policies.testing import check_invariants

KiB, MiB = 1 << 10, 1 << 20


def test_allocations_are_bumped_back_to_back():
    pool = Arena(arena_bytes=MiB)
    a, b, c = pool.allocate(1000), pool.allocate(5000), pool.allocate(1)
    assert (b.offset - a.offset, c.offset - b.offset) == (1024, 5120)


def test_freed_space_is_not_reused_until_the_arena_is_empty():
    pool = Arena(arena_bytes=MiB)
    a, b = pool.allocate(4 * KiB), pool.allocate(4 * KiB)
    pool.free(a)
    c = pool.allocate(4 * KiB)
    assert c.offset == b.offset + 4 * KiB
    pool.free(b)
    pool.free(c)
    assert pool.allocate(4 * KiB).offset == a.offset and pool.num_resets == 1


def test_a_full_arena_is_retired_and_reused_once_empty():
    pool = Arena(arena_bytes=MiB)
    first = pool.allocate(600 * KiB)
    second = pool.allocate(600 * KiB)  # does not fit: a second arena
    assert len(pool.segments()) == 2
    pool.free(first)  # the retired arena is empty: cached
    third = pool.allocate(600 * KiB)  # does not fit in the second: takes the cached one
    assert third.offset == first.offset and len(pool.segments()) == 2
    check_invariants(pool, [second, third])


def test_a_request_larger_than_an_arena_gets_its_own():
    pool = Arena(arena_bytes=MiB)
    a = pool.allocate(3 * MiB + 1)
    assert [s.nbytes for s in pool.segments()] == [4 * MiB] and a.size_bytes == 3 * MiB + 512


def test_streams_bump_in_arenas_of_their_own():
    pool = Arena(arena_bytes=MiB)
    pool.allocate(4096, stream=0)
    pool.allocate(4096, stream=1)
    assert len(pool.segments()) == 2


def test_free_extents_list_only_what_can_be_handed_out():
    pool = Arena(arena_bytes=MiB)
    a, b = pool.allocate(4 * KiB), pool.allocate(4 * KiB)
    pool.free(a)  # dead space inside a live arena: free bytes, but no free extent
    assert pool.free_extents() == [(b.offset + 4 * KiB, MiB - 8 * KiB)]
    assert pool.stats().free_bytes == MiB - 4 * KiB


def test_trim_releases_empty_arenas_only():
    pool = Arena(arena_bytes=MiB)
    keep = pool.allocate(600 * KiB)
    pool.free(pool.allocate(600 * KiB))  # the current arena, now empty
    assert pool.trim() == MiB and keep.live
    assert len(pool.segments()) == 1


@pytest.mark.parametrize(
    "kw", [{"alignment_bytes": 384}, {"arena_bytes": 1000}, {"arena_bytes": 0}]
)
def test_bad_knobs_are_refused(kw):
    with pytest.raises(PolicyError):
        Arena(**kw)


def test_an_arena_released_by_the_retry_is_not_cached_again():
    # issue 11: alloc 1 MiB, free, alloc 100 MiB, alloc 2 MiB under 128 MiB. The 100 MiB arena
    # does not fit next to the empty current one, so the reservation's trim-and-retry releases
    # that arena; it must not come back as a cached arena and serve the 2 MiB.
    pool = Arena(capacity_bytes=128 * MiB)
    pool.free(pool.allocate(MiB))
    big = pool.allocate(100 * MiB)
    # a new 64 MiB arena does not fit beside the 100 MiB one: refused, not served from freed memory
    assert pool.allocate(2 * MiB) is None
    check_invariants(pool, [big])
    pool.free(big)
    stats = check_invariants(pool, [])
    assert stats.num_failures == 1 and stats.peak_live_bytes <= stats.peak_reserved_bytes
