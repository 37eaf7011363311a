"""``buddy``: power-of-two blocks, split by halves, freed buddies merge, large requests alone."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.buddy import Buddy
from policies.errors import PolicyError
from policies.testing import check_invariants

KiB, MiB = 1 << 10, 1 << 20


def test_requests_round_up_to_a_power_of_two_and_the_minimum_block():
    pool = Buddy()
    assert [pool.allocate(n).size_bytes for n in (1, 512, 513, 3000, 5 * MiB)] == [
        512,
        512,
        1024,
        4096,
        8 * MiB,
    ]


def test_halving_keeps_the_buddy_free_next_to_the_block():
    pool = Buddy(segment_bytes=MiB)
    a, b = pool.allocate(4 * KiB), pool.allocate(4 * KiB)
    base = pool.segments()[0].offset
    assert (a.offset - base, b.offset - base) == (0, 4 * KiB)
    assert pool.free_extents()[0] == (base + 8 * KiB, 8 * KiB)


def test_freed_buddies_merge_back_into_the_whole_segment():
    pool = Buddy(segment_bytes=MiB)
    allocs = [pool.allocate(n) for n in (4 * KiB, 4 * KiB, 100 * KiB, 300 * KiB)]
    for a in reversed(allocs):
        pool.free(a)
    assert pool.free_extents() == [(pool.segments()[0].offset, MiB)]
    assert pool.trim() == MiB


def test_free_neighbours_that_are_not_buddies_stay_apart():
    pool = Buddy(segment_bytes=MiB)
    a, b, c, d = (pool.allocate(4 * KiB) for _ in range(4))
    pool.free(b)
    pool.free(c)
    assert pool.free_extents()[:2] == [(b.offset, 4 * KiB), (c.offset, 4 * KiB)]


def test_a_request_larger_than_a_segment_gets_a_power_of_two_segment():
    pool = Buddy(segment_bytes=64 * MiB)
    a = pool.allocate(100 * MiB)
    assert a.size_bytes == 128 * MiB and [s.nbytes for s in pool.segments()] == [128 * MiB]


def test_the_smallest_free_block_that_fits_is_split():
    pool = Buddy(segment_bytes=MiB)
    keep = pool.allocate(256 * KiB)  # leaves 256 KiB and 512 KiB buddies free
    a = pool.allocate(100 * KiB)
    assert a.offset - keep.offset == 256 * KiB and pool.largest_free_bytes() == 512 * KiB


@pytest.mark.parametrize(
    "kw",
    [
        {"segment_bytes": 3 * MiB},
        {"min_block_bytes": 768},
        {"min_block_bytes": 0},
        {"segment_bytes": MiB, "min_block_bytes": 2 * MiB},
    ],
)
def test_bad_sizes_are_refused(kw):
    with pytest.raises(PolicyError):
        Buddy(**kw)


def _check_buddy_layout(pool):
    """Every free block is aligned to its size within its segment, and no two free buddies
    coexist."""
    free = dict(pool.free_extents())
    for seg in pool.segments():
        for off, n in free.items():
            if seg.offset <= off < seg.end:
                assert (off - seg.offset) % n == 0
                if n < seg.nbytes:
                    assert free.get(seg.offset + ((off - seg.offset) ^ n)) != n, (
                        "two free buddies did not merge"
                    )


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(1, 3 * MiB), st.integers(0, 1 << 16)), max_size=80
    )
)
def test_random_operations_keep_the_buddy_invariants(ops):
    pool = Buddy(segment_bytes=4 * MiB)
    live = []
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            live.append(pool.allocate(n))
        else:
            pool.free(live.pop(pick % len(live)))
        check_invariants(pool, live)
        _check_buddy_layout(pool)
    for a in live:
        pool.free(a)
    pool.trim()
    assert pool.stats().reserved_bytes == 0
