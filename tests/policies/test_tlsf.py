"""``tlsf``: two-level classes, O(1) good fit through bit maps, immediate coalescing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.errors import PolicyError
from policies.testing import check_invariants
from policies.tlsf import TLSF

KiB, MiB = 1 << 10, 1 << 20
U = 512  # alignment unit


def test_small_sizes_have_exact_classes():
    pool = TLSF(second_level_log2=4)
    assert [pool._class_of(n * U) for n in (1, 2, 15)] == [(0, 1), (0, 2), (0, 15)]


def test_each_power_of_two_is_split_into_second_level_classes():
    pool = TLSF(second_level_log2=2)  # 4 classes per power of two
    assert [pool._class_of(n * U) for n in (8, 9, 10, 12, 14, 15, 16)] == [
        (2, 0),
        (2, 0),
        (2, 1),
        (2, 2),
        (2, 3),
        (2, 3),
        (3, 0),
    ]


def _class_floor(fl, sl, sl_log2):
    """The smallest size (in units) filed in class (fl, sl)."""
    return sl if fl == 0 else ((1 << sl_log2) + sl) << (fl - 1)


@settings(max_examples=300, deadline=None)
@given(sl_log2=st.integers(1, 6), units=st.integers(1, 1 << 24))
def test_the_search_class_holds_only_blocks_that_fit_and_rounds_by_at_most_one_class(
    sl_log2, units
):
    pool = TLSF(second_level_log2=sl_log2)
    fl, sl = pool._search_class(units * U)
    floor = _class_floor(fl, sl, sl_log2)
    assert floor >= units  # every block filed there (or higher) fits
    assert floor < units + max(1, units >> sl_log2) + 1  # and the search skips less than one class
    assert pool._class_of(floor * U) == (fl, sl)


def test_a_good_fit_skips_a_block_of_the_requests_own_class():
    pool = TLSF(second_level_log2=2, segment_bytes=MiB)
    # units 40..47 form one class at 4 classes per power of two: a 41-unit request searches above
    # it. A 44-unit free block (40 + 4 merged) sits in that class and is skipped for the 56-unit
    # one.
    a, b, _, big, _ = (pool.allocate(n * U) for n in (40, 4, 1, 56, 1))
    for x in (a, b, big):
        pool.free(x)
    assert (a.offset, 44 * U) in pool.free_extents()
    assert pool.allocate(41 * U).offset == big.offset


def test_a_request_is_rounded_up_to_its_class_boundary():
    pool = TLSF(second_level_log2=2)
    # 4 classes per power of two: [32, 64) units are cut at 32, 40, 48, 56
    assert [pool.rounded_size(n * U) for n in (1, 3, 4, 5, 32, 33, 40, 41, 57)] == [
        n * U for n in (1, 3, 4, 5, 32, 40, 40, 48, 64)
    ]
    assert pool.rounded_size(1) == U and pool.allocate(41 * U - 7).size_bytes == 48 * U


def test_a_freed_block_is_found_again_by_a_request_of_the_same_size():
    pool = TLSF(second_level_log2=2, segment_bytes=MiB)
    a, _ = pool.allocate(41 * U), pool.allocate(U)  # the guard keeps a from merging with the rest
    pool.free(a)
    assert pool.allocate(41 * U).offset == a.offset


def test_an_exact_size_reuses_a_freed_block_of_a_small_class():
    pool = TLSF(segment_bytes=MiB)
    a, _ = pool.allocate(3 * U), pool.allocate(U)
    pool.free(a)
    assert pool.allocate(3 * U).offset == a.offset


def test_freed_neighbours_merge_at_once():
    pool = TLSF(segment_bytes=MiB)
    a, b, c = (pool.allocate(64 * KiB) for _ in range(3))
    pool.free(a)
    pool.free(c)
    pool.free(b)
    assert pool.free_extents() == [(pool.segments()[0].offset, MiB)]


@pytest.mark.parametrize("bad", [0, 9, True, 2.0])
def test_second_level_must_be_1_to_8(bad):
    with pytest.raises(PolicyError, match="second_level_log2"):
        TLSF(second_level_log2=bad)


@settings(max_examples=50, deadline=None)
@given(
    sl=st.integers(1, 5),
    ops=st.lists(
        st.tuples(
            st.booleans(), st.integers(1, 6 * MiB), st.sampled_from([0, 1]), st.integers(0, 1 << 16)
        ),
        max_size=80,
    ),
)
def test_random_operations_keep_the_index_and_blocks_in_step(sl, ops):
    pool = TLSF(second_level_log2=sl, segment_bytes=8 * MiB)
    live = []
    for is_alloc, n, stream, pick in ops:
        if is_alloc or not live:
            live.append(pool.allocate(n, stream=stream))
        else:
            pool.free(live.pop(pick % len(live)))
        pool.check_invariants()
        indexed = sorted(
            (b.offset, b.size)
            for c in pool._streams.values()
            for bl in c.lists.values()
            for b in bl.values()
        )
        assert indexed == pool.free_extents()
    check_invariants(pool, live)


def test_a_reused_large_buffer_is_served_from_the_block_it_freed():
    # issue 11: the same 131,072,000 B buffer allocated and freed 50 times grew the pool 50 times
    pool = TLSF()
    for _ in range(50):
        pool.free(pool.allocate(131_072_000))
    stats = check_invariants(pool, [])
    assert stats.num_grows == 1 and stats.reserved_bytes == 128 * MiB
