"""The ``size-class`` policy: classes, batch refill, LIFO reuse, the large path, trim, capacity."""

import gzip
import pickle
import sys
from bisect import bisect_left
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from policies.device import VirtualDevice
from policies.errors import PolicyError
from policies.size_class import SizeClass, make_class_sizes
from policies.testing import check_invariants

KiB, MiB = 1 << 10, 1 << 20
SNAPSHOT = Path("/work/shared/data/traces/llama1b_generate_mixed.pickle.gz")


def check_pool(pool: SizeClass, live: list) -> None:
    """Live and free extents tile the segments exactly; every counter agrees with them."""
    segments = pool.segments()
    used = [(a.offset, a.size_bytes) for a in live]
    ranges = sorted(used + pool.free_extents())
    for (o0, n0), (o1, _) in zip(ranges, ranges[1:]):
        assert o0 + n0 <= o1, "extents overlap"
    for off, n in ranges:
        assert any(s.offset <= off and off + n <= s.end for s in segments), (
            "extent outside every segment"
        )
    assert sum(n for _, n in ranges) == pool.reserved_bytes
    assert pool.allocated_bytes == sum(a.size_bytes for a in live)
    assert pool.internal_waste_bytes() == sum(a.size_bytes - a.nbytes for a in live)
    for s in segments:
        assert s.num_live == sum(1 for a in live if s.offset <= a.offset < s.end)


# ----------------------------------------------------------------- classes
def test_class_sizes_are_ascending_512_multiples_from_min_to_max():
    sizes = make_class_sizes(1536, 3 * MiB, 3)
    assert sizes[0] == 1536 and sizes[-1] == 3 * MiB
    assert all(s % 512 == 0 for s in sizes)
    assert all(a < b for a, b in zip(sizes, sizes[1:]))


def test_default_classes_have_four_per_doubling_where_a_step_is_whole_512s():
    sizes = SizeClass().class_sizes()
    for base in (2 * KiB, 64 * KiB, 8 * MiB):
        assert [s for s in sizes if base <= s < 2 * base] == [
            base,
            base * 5 // 4,
            base * 6 // 4,
            base * 7 // 4,
        ]


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 8), min_units=st.integers(1, 16), span=st.integers(0, 14), data=st.data())
def test_rounding_picks_the_smallest_class_and_bounds_the_waste(k, min_units, span, data):
    pool = SizeClass(
        classes_per_doubling=k,
        min_class_bytes=512 * min_units,
        max_class_bytes=512 * min_units << span,
    )
    sizes = pool.class_sizes()
    nbytes = data.draw(st.integers(1, pool.max_class_bytes))
    rounded = pool.rounded_size(nbytes)
    assert rounded in sizes and rounded >= nbytes
    assert pool.allocate(nbytes).size_bytes == rounded  # the hot path's table agrees
    units = pool._table_max_bytes // 512 + 1  # the table, entry by entry, against a bisect per unit
    assert pool._class_by_units == [bisect_left(sizes, u * 512) for u in range(units)]
    assert all(s < nbytes for s in sizes if s < rounded)
    for below, size in zip(
        sizes, sizes[1:]
    ):  # the worst request of each class: one byte above the last
        assert pool.rounded_size(below + 1) == size
        waste = size - (below + 1)
        assert waste < 512 or waste * (k + 1) <= size


def test_allocation_holds_its_class_and_reports_the_waste():
    pool = SizeClass()
    a = pool.allocate(1000)
    assert a.size_bytes == 1024 and a.extents == ((a.offset, 1024),)
    assert a.offset % 512 == 0
    assert pool.internal_waste_bytes() == 24


# ----------------------------------------------------------------- refill and reuse
def test_refill_carves_a_batch_of_blocks_at_once():
    pool = SizeClass(refill_bytes=64 * KiB)
    allocs = [pool.allocate(4 * KiB) for _ in range(16)]
    assert pool.num_grows == 1
    assert [a.offset for a in allocs] == [allocs[0].offset + i * 4 * KiB for i in range(16)]
    assert (
        pool.largest_free_bytes() == 30 * MiB
    )  # the tail, rounded down to 2 MiB for the large path
    a17 = pool.allocate(4 * KiB)
    assert a17.offset == allocs[-1].offset + 4 * KiB  # the next batch comes from the same tail
    check_pool(pool, allocs + [a17])


def test_refill_carves_one_block_when_the_class_exceeds_refill_bytes():
    pool = SizeClass(refill_bytes=64 * KiB)
    pool.allocate(3 * MiB)
    assert pool.free_extents() == [(pool.segments()[0].offset + 3 * MiB, 29 * MiB)]


def test_freed_blocks_are_reused_last_in_first_out():
    pool = SizeClass()
    a, b = pool.allocate(4096), pool.allocate(4096)
    pool.free(a)
    pool.free(b)
    assert pool.allocate(4096).offset == b.offset
    assert pool.allocate(4096).offset == a.offset


def test_a_class_list_keeps_its_storage_when_its_last_block_is_taken():
    """Taking a class's only cached block leaves its placeholder, so the list keeps its storage:
    an emptied list would give it back, and the next free reallocate it, on every
    alloc-free-alloc of one size (benchmarks/RESULTS.md, "size-class lists that never empty")."""

    pool = SizeClass()
    a = pool.allocate(4096)
    blocks = pool._free_lists[a.handle.class_index]
    pool.free(a)
    b = pool.allocate(4096)  # takes the freed block back: the class has none left
    assert b.offset == a.offset
    assert sys.getsizeof(blocks) > sys.getsizeof([]), "the list gave its storage back"
    assert all(off != b.offset for off, _ in pool.free_extents())  # live, so not free
    pool.free(b)
    assert [e for e in pool.free_extents() if e[0] == b.offset] == [(b.offset, b.size_bytes)]
    check_pool(pool, [])


def test_tail_of_a_segment_serves_other_classes_before_growing():
    pool = SizeClass(segment_bytes=4 * MiB, refill_bytes=64 * KiB)
    live = [pool.allocate(n) for n in (512, 5000, 70 * KiB, 1 * MiB, 1536)]
    assert pool.num_grows == 1
    check_pool(pool, live)


# ----------------------------------------------------------------- large path
def test_large_request_gets_a_dedicated_segment_rounded_to_the_granularity():
    pool = SizeClass()
    a = pool.allocate(17 * MiB + 1)
    assert a.size_bytes == 18 * MiB
    assert [s.nbytes for s in pool.segments()] == [18 * MiB]
    assert pool.internal_waste_bytes() == MiB - 1


def test_freed_large_range_is_reused_for_a_request_within_its_slack():
    pool = SizeClass()  # k=4: a cached 20 MiB range serves requests rounded to 16..20 MiB
    pool.free(pool.allocate(20 * MiB))
    a = pool.allocate(16 * MiB + 1)
    assert a.size_bytes == 20 * MiB and pool.num_grows == 1


def test_freed_large_range_beyond_its_slack_is_recycled_not_handed_out_whole():
    pool = SizeClass()
    pool.free(pool.allocate(26 * MiB))
    a = pool.allocate(20 * MiB)  # 26 > 20 + 20/4: its free segment is carved afresh instead
    assert a.size_bytes == 20 * MiB and pool.num_grows == 1 and pool.num_recycles == 1
    assert pool.free_extents() == [(a.offset + 20 * MiB, 6 * MiB)]


def test_grown_space_serves_a_large_request_without_another_segment():
    pool = SizeClass()
    assert pool.grow(64 * MiB)
    a = pool.allocate(40 * MiB)
    assert pool.num_grows == 1
    check_pool(pool, [a])


# ----------------------------------------------------------------- recycle, trim, capacity
def test_fully_free_segment_is_recycled_for_another_class_without_growing():
    pool = SizeClass(segment_bytes=4 * MiB, refill_bytes=4 * MiB)
    pool.free(pool.allocate(4 * KiB))  # the whole segment is now cached 4 KiB blocks
    a = pool.allocate(1 * MiB)
    assert pool.num_grows == 1 and pool.num_recycles == 1
    check_pool(pool, [a])


def test_trim_releases_only_segments_without_live_blocks():
    pool = SizeClass(segment_bytes=2 * MiB, refill_bytes=2 * MiB)
    keep = pool.allocate(4096)
    pool.free(pool.allocate(1 * MiB + 1))  # a second segment: 1.25 MiB class, then freed
    assert pool.num_grows == 2
    assert pool.trim() == 2 * MiB
    assert [s.offset for s in pool.segments()] == [keep.offset]
    check_pool(pool, [keep])


def test_trim_max_bytes_stops_once_enough_is_released():
    pool = SizeClass()
    for a in [pool.allocate(40 * MiB) for _ in range(3)]:
        pool.free(a)
    assert pool.trim(50 * MiB) == 80 * MiB
    assert pool.reserved_bytes == 40 * MiB


def test_refused_request_returns_none_and_changes_nothing():
    pool = SizeClass(capacity_bytes=64 * MiB)
    live = [pool.allocate(4096), pool.allocate(20 * MiB)]
    before = (
        pool.stats(),
        pool.free_extents(),
        [(s.offset, s.nbytes, s.num_live) for s in pool.segments()],
    )
    assert pool.allocate(50 * MiB) is None
    after = (
        pool.stats(),
        pool.free_extents(),
        [(s.offset, s.nbytes, s.num_live) for s in pool.segments()],
    )
    assert after[1:] == before[1:]
    assert after[0].num_failures == before[0].num_failures + 1
    assert {**after[0].as_dict(), "num_failures": 0} == {**before[0].as_dict(), "num_failures": 0}
    check_pool(pool, live)


def test_refused_grow_releases_cached_segments_and_retries():
    pool = SizeClass(capacity_bytes=64 * MiB)
    pool.free(pool.allocate(40 * MiB))
    a = pool.allocate(60 * MiB)  # 40 + 60 > 64: the cached 40 MiB segment goes first
    assert a is not None and pool.num_shrinks == 1
    assert pool.reserved_bytes == 60 * MiB


def test_near_capacity_a_refill_reserves_what_still_fits():
    pool = SizeClass(capacity_bytes=3 * MiB)
    a = pool.allocate(4096)
    assert a is not None and pool.reserved_bytes == 3 * MiB


def test_device_refusal_is_a_failure_not_an_error():
    pool = SizeClass(device=VirtualDevice(limit_bytes=1 * MiB))
    assert pool.allocate(4096) is not None  # falls back to a 2 MiB batch, then to one block
    assert pool.allocate(2 * MiB) is None and pool.num_failures == 1


# ----------------------------------------------------------------- free space
def test_largest_free_is_servable_without_growing():
    pool = SizeClass(segment_bytes=8 * MiB, refill_bytes=64 * KiB)
    live = [pool.allocate(n) for n in (3000, 600 * KiB, 1 * MiB)]
    largest = pool.largest_free_bytes()
    assert largest == 6 * MiB  # the largest class in the 6.3 MiB tail
    live.append(pool.allocate(largest))
    assert pool.num_grows == 1
    check_pool(pool, live)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.booleans(),
            st.sampled_from([1, 511, 4096, 70_000, 900 * KiB, 3 * MiB + 5, 17 * MiB, 40 * MiB]),
            st.integers(0, 99),
        ),
        max_size=80,
    ),
    capacity=st.sampled_from([None, 48 * MiB, 100 * MiB]),
)
def test_random_workload_keeps_extents_disjoint_and_accounted(ops, capacity):
    pool = SizeClass(segment_bytes=8 * MiB, refill_bytes=256 * KiB, capacity_bytes=capacity)
    live = []
    for do_alloc, nbytes, pick in ops:
        if do_alloc or not live:
            a = pool.allocate(nbytes)
            if a is not None:
                live.append(a)
        else:
            pool.free(live.pop(pick % len(live)))
        if capacity is not None:
            assert pool.reserved_bytes <= capacity
    check_pool(pool, live)
    check_invariants(pool, live)  # the conformance suite's recount
    largest = pool.largest_free_bytes()
    if largest:
        grows = pool.num_grows
        live.append(pool.allocate(largest))
        assert pool.num_grows == grows
        check_pool(pool, live)
    for a in live:
        pool.free(a)
    pool.trim()
    assert pool.reserved_bytes == 0 and pool.free_extents() == []


# ----------------------------------------------------------------- contract
@pytest.mark.parametrize(
    "knobs",
    [
        {"classes_per_doubling": 0},
        {"min_class_bytes": 1000},
        {"min_class_bytes": 256},
        {"max_class_bytes": 1024, "min_class_bytes": 2048},
        {"large_granularity_bytes": 100},
        {"refill_bytes": 0},
        {"segment_bytes": -1},
    ],
)
def test_bad_knobs_raise_policy_error(knobs):
    with pytest.raises(PolicyError):
        SizeClass(**knobs)


def test_double_free_raises_and_keeps_the_block_cached_once():
    pool = SizeClass()
    a = pool.allocate(4096)
    pool.free(a)
    with pytest.raises(PolicyError):
        pool.free(a)
    assert pool.allocate(4096).offset != pool.allocate(4096).offset


def test_spec_round_trips_through_the_registry():
    pool = policies.create(
        "size-class:classes_per_doubling=8,max_class_bytes=4MiB", capacity_bytes=1 << 30
    )
    assert isinstance(pool, SizeClass)
    assert pool.spec == "size-class:classes_per_doubling=8,max_class_bytes=4194304"
    assert policies.create(pool.spec).get_params() == {**pool.get_params(), "capacity_bytes": None}


@pytest.mark.skipif(not SNAPSHOT.exists(), reason="bundled snapshot not found")
def test_llama_snapshot_replays_with_bounded_rounding_waste():
    with gzip.open(SNAPSHOT) as f:
        trace = pickle.load(f)["device_traces"][0]
    pool = SizeClass()
    live = {}
    for e in trace:
        if e["action"] == "alloc":
            a = live[e["addr"]] = pool.allocate(e["size"])
            waste = a.size_bytes - a.nbytes
            if a.nbytes > pool.max_class_bytes:  # granularity rounding, then a cached range's slack
                assert waste < pool.large_granularity_bytes + a.size_bytes / 5
            elif a.nbytes > 512:
                assert waste < 512 or waste * 5 <= a.size_bytes
        elif (
            e["action"] == "free_completed" and e["addr"] in live
        ):  # blocks from before recording are skipped
            pool.free(live.pop(e["addr"]))
    assert pool.num_failures == 0 and pool.num_allocs > 100_000
    check_pool(pool, list(live.values()))


def test_own_accounting_check_catches_a_block_cached_while_live():
    pool = SizeClass()
    a = pool.allocate(4096)
    pool.allocate(4096)
    pool.check_invariants()
    pool._free_lists[a.handle.class_index].append(a.handle)  # a live block also on its free list
    with pytest.raises(AssertionError, match="reserved"):
        pool.check_invariants()


class _SwapsAFreedBlock(SizeClass):
    """Every 20th free files its block twice and loses another: the byte counts still balance."""

    def _free(self, allocation):
        super()._free(allocation)
        home = allocation.handle.home
        if self.num_frees % 20 == 19 and home is not None and len(home) >= 2:
            home[-2] = home[-1]


def test_soak_finds_a_corruption_the_cheap_accounting_check_cannot_see():
    from policies.testing.soak import soak

    report = soak(_SwapsAFreedBlock, 4000, seed=2)
    assert report.num_violations > 0
    report = soak(SizeClass, 4000, seed=2)
    assert report.num_violations == 0, report.violations
