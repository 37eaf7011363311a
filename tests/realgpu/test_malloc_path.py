"""``realgpu.malloc_path``: the fast ``malloc`` a plain pool hands CuPy, against the general
path."""

import gc

import pytest

import policies
from policies.base import Allocation
from policies.best_fit import BestFit
from policies.errors import PolicyError
from realgpu.errors import PoolError, PoolOutOfMemoryError
from realgpu.malloc_path import Lease, MallocPath, extents_are_one_range
from realgpu.pool import GpuPool

MiB = 1 << 20


def test_a_plain_pool_answers_malloc_with_the_fast_path_and_a_validating_one_does_not():
    plain = GpuPool("best-fit", backend="host")
    assert plain.malloc == plain._malloc_path.malloc and isinstance(plain._malloc_path, MallocPath)
    checked = GpuPool("best-fit", backend="host", validate=True)
    assert (
        checked.malloc == checked.malloc.__self__.malloc
        and checked.malloc.__func__ is GpuPool.malloc
    )
    with pytest.raises(AttributeError):
        checked.validate = False  # fixed at construction: the choice of path rests on it


@pytest.mark.parametrize(
    "spec", ["best-fit:segment_bytes=4MiB", "size-class:segment_bytes=4MiB", "cupy-pool"]
)
def test_fast_malloc_addresses_match_the_devices_lookup_across_many_segments(spec):
    pool = GpuPool(spec, backend="host")
    pointers = [pool.malloc(n) for n in (300_000, 1 * MiB, 3 * MiB, 700, 2 * MiB, 5 * MiB) * 3]
    assert pool.device.num_segments > 3  # the inlined bisect picks among several segments
    for p in pointers:
        a = p.owner.allocation
        assert isinstance(p.owner, Lease) and p.ptr == pool.device.address(
            a.extents[0][0]
        ) == pool.pointer(a)
        assert p.array.size == p.size and p.array.ctypes.data == p.ptr
    live = pool.policy.num_live
    del pointers[::2]
    gc.collect()
    assert pool.policy.num_live == live - 9 and pool.lease_errors == []


def test_general_and_fast_malloc_make_the_same_placements():
    fast, general = GpuPool("first-fit", backend="host"), GpuPool("first-fit", backend="host")
    kept_fast, kept_general = [], []
    for i, n in enumerate([5000, 70_000, 1 * MiB, 300, 9 * MiB, 40_000] * 4):
        pf, pg = fast.malloc(n), GpuPool.malloc(general, n)
        assert pf.owner.allocation.extents == pg.owner.allocation.extents
        if i % 3:
            kept_fast.append(pf)
            kept_general.append(pg)
    del pf, pg
    gc.collect()
    assert fast.policy.num_live == general.policy.num_live == len(kept_fast)


def test_a_free_that_fails_on_drop_is_kept_for_check_not_raised():
    pool = GpuPool("best-fit", backend="host")
    p = pool.malloc(4096)
    pool.policy.free(
        p.owner.allocation
    )  # freed behind the pointer's back: the drop is a double free
    del p
    gc.collect()
    assert len(pool.lease_errors) == 1 and isinstance(pool.lease_errors[0], PolicyError)
    with pytest.raises(PolicyError):
        pool.check()


def test_fast_malloc_refuses_after_close_and_a_later_drop_frees_nothing():
    pool = GpuPool("size-class", backend="host")
    keep = pool.malloc(10_000)
    pool.close()
    with pytest.raises(PoolError, match="closed"):
        pool.malloc(100)
    del keep
    gc.collect()
    assert pool.lease_errors == [] and pool.policy.num_frees == 0


def test_fast_malloc_out_of_memory_leaves_the_pool_as_it_was():
    pool = GpuPool("best-fit:segment_bytes=2MiB", backend="host", capacity_bytes=4 * MiB)
    keep = pool.malloc(3 * MiB)
    before = (pool.policy.num_live, pool.policy.live_bytes, pool.device.used_bytes)
    with pytest.raises(PoolOutOfMemoryError):
        pool.malloc(2 * MiB)
    assert (pool.policy.num_live, pool.policy.live_bytes, pool.device.used_bytes) == before
    assert pool.malloc(0).size == 0 and pool.policy.num_allocs == 1
    del keep


@pytest.mark.parametrize(
    "extents, one_range",
    [
        (((4 * MiB, MiB),), True),
        (((4 * MiB, MiB), (5 * MiB, MiB), (6 * MiB, 2 * MiB)), True),
        (
            ((5 * MiB, MiB), (4 * MiB, MiB)),
            False,
        ),  # back to back, but not in the allocation's order
        (((4 * MiB, MiB), (6 * MiB, MiB)), False),  # a gap
        (((7 * MiB, MiB), (8 * MiB, MiB)), False),  # back to back across two segments
    ],
)
def test_extents_are_one_range_when_back_to_back_in_order_in_one_segment(extents, one_range):
    starts = [0, 8 * MiB, 16 * MiB]  # segments [0, 8), [8, 16), [16, ...) MiB
    assert extents_are_one_range(extents, starts) is one_range


@pytest.mark.parametrize("validate", [False, True])
def test_both_malloc_paths_refuse_discontiguous_pages_and_accept_contiguous_ones(validate):
    def paged_pool():
        return GpuPool(
            "paged:page_bytes=1MiB,segment_bytes=8MiB", backend="host", validate=validate
        )

    pool = paged_pool()
    guards = (
        2 * pool.guard_bytes if validate else 0
    )  # a validating pool asks the policy for its guards too
    held = [pool.allocate(MiB - guards) for _ in range(8)]  # a page each
    pool.free(held[1])
    pool.free(held[5])
    with pytest.raises(PoolError, match="discontiguous"):
        pool.malloc(2 * MiB - guards)
    assert pool.policy.num_live == 6  # the refused pages were given back
    fresh = paged_pool()
    p = fresh.malloc(3 * MiB - guards)  # three pages in a row
    assert p.size == 3 * MiB - guards and fresh.policy.num_live == 1
    assert p.ptr == fresh.pointer(p.owner.allocation)  # its first data byte, past any guard


class _ComputedExtents(Allocation):
    """An allocation that computes its extents (as ``policies._blocks.Block`` does) from a block."""

    __slots__ = ()

    @property
    def extents(self):
        return ((self.handle.offset, self.size_bytes),)


class _WrapsBlocks(BestFit):
    """A contiguous policy whose allocations are neither ``Allocation`` nor ``Block``."""

    def _allocate(self, nbytes, stream, tag):
        block = super()._allocate(nbytes, stream, tag)
        if block is None:
            return None
        a = _ComputedExtents(nbytes, block.size_bytes, None, stream, tag, block)
        return a

    def _free(self, allocation):
        super()._free(allocation.handle)


@pytest.mark.parametrize(
    "policy",
    [BestFit, _WrapsBlocks, lambda: policies.create("paged:page_bytes=1MiB")],
    ids=["block", "computed-extents", "paged"],
)
def test_fast_malloc_reads_each_kind_of_allocation_at_its_offset(policy):
    """A block's ``offset`` field, another subclass's computed ``extents`` and a plain
    allocation's stored ones: each gives the pointer the general path gives."""
    fast, general = GpuPool(policy(), backend="host"), GpuPool(policy(), backend="host")
    for n in (5000, 1 * MiB, 300, 3 * MiB // 2):
        pf, pg = fast.malloc(n), GpuPool.malloc(general, n)
        a = pf.owner.allocation
        assert a.extents == pg.owner.allocation.extents
        assert pf.ptr == fast.pointer(a) == fast.device.address(a.offset)
