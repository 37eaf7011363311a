import gc

import numpy as np
import pytest

import policies
from policies.errors import PolicyError
from realgpu.errors import CorruptionError, PoolError, PoolOutOfMemoryError
from realgpu.host import HostDevice, HostMemoryPointer
from realgpu.pool import GUARD_WORD, GpuPool, data_word

MiB = 1 << 20


def host_pool(spec="first-fit", **kw):
    return GpuPool(spec, backend="host", **kw)


def test_allocate_gives_an_address_inside_the_policys_segment():
    pool = host_pool()
    a = pool.allocate(1000)
    seg = pool.policy.segments()[0]
    assert pool.pointer(a) == pool.device.address(seg.offset) + (a.offset - seg.offset)
    pool.free(a)
    assert pool.stats().live_bytes == 0


def test_memory_written_through_one_allocation_is_seen_at_its_address():
    pool = host_pool()
    a = pool.allocate(4096)
    pool.device.view(a.offset, 4096)[:] = 9
    assert (
        np.ctypeslib.as_array(
            (np.ctypeslib.ctypes.c_uint8 * 4096).from_address(pool.pointer(a))
        ).sum()
        == 9 * 4096
    )
    pool.free(a)


def test_malloc_pointer_frees_in_the_policy_when_dropped():
    pool = host_pool()
    p = pool.malloc(3000)
    assert isinstance(p, HostMemoryPointer) and p.size == 3000 and p.array.size == 3000
    assert pool.policy.num_live == 1
    del p
    gc.collect()
    assert pool.policy.num_live == 0 and pool.policy.num_frees == 1


def test_malloc_of_zero_bytes_allocates_nothing():
    pool = host_pool()
    p = pool.malloc(0)
    assert p.ptr == 0 and p.size == 0 and pool.policy.num_allocs == 0


def test_paged_allocation_gives_its_pages_and_block_table():
    pool = host_pool("paged:page_bytes=1MiB")
    a = pool.allocate(3 * MiB + 1)
    pages = pool.pages(a)
    assert len(pages) == 4 and all(n == MiB for _, n in pages)
    table = pool.block_table(a)
    assert table.dtype == np.int64 and table.tolist() == [addr for addr, _ in pages]
    assert pool.pointer(a) == pages[0][0]


def test_malloc_refuses_discontiguous_pages_and_frees_them():
    pool = host_pool("paged:page_bytes=1MiB,segment_bytes=8MiB")
    held = [pool.allocate(MiB) for _ in range(8)]
    pool.free(held[1])
    pool.free(held[5])
    with pytest.raises(PoolError, match="discontiguous"):
        pool.malloc(2 * MiB)
    assert pool.policy.num_live == 6


def test_malloc_accepts_contiguous_pages():
    pool = host_pool("paged:page_bytes=1MiB,segment_bytes=8MiB")
    p = pool.malloc(3 * MiB)
    assert p.size == 3 * MiB and pool.stats().allocated_bytes == 3 * MiB


def test_out_of_memory_is_a_memory_error_with_the_pools_stats():
    pool = host_pool("first-fit", capacity_bytes=64 * MiB)
    a = pool.allocate(40 * MiB)
    with pytest.raises(PoolOutOfMemoryError) as info:
        pool.allocate(40 * MiB)
    msg = str(info.value)
    assert isinstance(info.value, MemoryError)
    for fact in ("40.0 MiB", "live", "reserved", "capacity 64.0 MiB", "fragmentation", "1 failed"):
        assert fact in msg
    assert info.value.stats.num_failures == 1 and info.value.nbytes == 40 * MiB
    pool.free(a)


def test_device_refusal_is_out_of_memory_too():
    pool = GpuPool("first-fit:segment_bytes=8MiB", backend=HostDevice(limit_bytes=8 * MiB))
    pool.allocate(6 * MiB)
    with pytest.raises(PoolOutOfMemoryError, match="no capacity limit"):
        pool.malloc(6 * MiB)
    assert pool.device.num_refused >= 1


def test_policy_object_is_rebuilt_from_its_knobs_on_the_pools_device():
    policy = policies.create("best-fit:alignment_bytes=1024", capacity_bytes=64 * MiB)
    pool = GpuPool(policy, backend="host")
    pool.allocate(1000)
    assert (
        pool.policy is not policy
        and pool.policy.device is pool.device
        and pool.device.num_segments == 1
    )
    assert pool.policy.get_params() == policy.get_params()  # capacity_bytes included
    assert policy.num_allocs == 0 and not policy.segments()  # the object given is left as it was


#: the wrappers (their bases rebuilt too), a page-mapped policy of each kind, and a plain one
OBJECT_SPECS = [
    "elastic",
    "compacting",
    "tag-limits",
    "expandable",
    "page-pool",
    "vmm-stitch",
    "elastic:base=[page-pool]",
    "tag-limits:base=[compacting:base=[first-fit]]",
    "best-fit:virtual=true",
]


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "plain"])
@pytest.mark.parametrize("spec", OBJECT_SPECS)
def test_a_policy_object_runs_on_the_pool_as_its_spec_does(spec, validate):
    """Issue 29: a policy object was handed the pool's device after it was built, so a wrapper's
    base (and an expandable or page pool's range) stayed on the old device: "offset 2097152 lies
    below every segment", "not fully mapped", or an IndexError from ``pointer()``."""
    by_object = GpuPool(policies.create(spec), backend="host", validate=validate)
    by_spec = GpuPool(spec, backend="host", validate=validate)
    for pool in (by_object, by_spec):
        held = [pool.allocate(n) for n in (3 * MiB, 1000, 5 * MiB + 7)]
        for a in held:
            for offset, length in a.extents:
                pool.device.check_range(offset, length)  # real memory the device handed out
            assert pool.pointer(a) >= pool.pages(a)[0][0]
        for layer in policies.wrapper.layers(
            pool.policy
        ):  # every layer's segments are the pool device's
            assert all(pool.device.locate(seg.offset) for seg in layer.segments())
        for a in held:
            pool.free(a)
    assert type(by_object.device) is type(by_spec.device)
    assert by_object.stats() == by_spec.stats()
    by_object.close(), by_spec.close()


def test_a_device_the_policy_cannot_run_on_is_refused():
    """A page-mapped policy given a segment device would lay a modelled page-mapped device over
    it, whose offsets the real device never handed out."""
    with pytest.raises(PoolError, match="page-mapped backend"):
        GpuPool("page-pool", backend=HostDevice())


def test_page_pool_ranges_never_cross_two_segments_on_the_host_backend(tmp_path):
    """Issue 29: page-pool on ``--backend host`` was built over a modelled page-mapped device in
    front of the segment device, so a 3 MiB request got two pages at consecutive virtual offsets
    that were two separate host arrays: "offset 12582912 lies past segment [10485760, 12582912)".
    It now gets the page-mapped backend, where consecutive pages are one range."""
    from realgpu.host_vmm import HostVmmDevice

    for validate in (True, False):
        pool = GpuPool("page-pool", backend="host", validate=validate)
        assert isinstance(pool.device, HostVmmDevice)
        small, large = pool.allocate(1 * MiB), pool.allocate(3 * MiB)
        for a in (small, large):
            for offset, length in a.extents:
                pool.device.check_range(offset, length)
        pool.free(small), pool.free(large)
        pool.close()


def test_host_segments_refuse_a_range_over_two_of_them():
    """A segment is one ``cudaMalloc`` block: a range that runs past its end is memory outside
    any allocation, whatever lies next (the host view used to come back shorter, silently)."""
    device = HostDevice()
    first = device.reserve(2 * MiB)
    device.reserve(2 * MiB)
    end = first + 2 * MiB
    for operation in (
        lambda: device.fill(end - 8, 16, GUARD_WORD, 0),
        lambda: device.touch(end - 8, 16),
        lambda: device.first_mismatch(end - 8, 16, GUARD_WORD, 0),
        lambda: device.view(end - 8, 16),
    ):
        with pytest.raises(AssertionError, match="outside any segment"):
            operation()
    device.fill(end - 16, 16, GUARD_WORD, 0)  # inside one segment: fine
    assert device.first_mismatch(end - 16, 16, GUARD_WORD, 0) == -1


def test_used_policy_object_is_refused():
    policy = policies.create("best-fit")
    policy.allocate(1000)
    with pytest.raises(PoolError, match="already been used"):
        GpuPool(policy, backend="host")


def test_unknown_backend_is_refused():
    with pytest.raises(PoolError, match="backend"):
        GpuPool("first-fit", backend="tpu")


def test_bad_spec_is_a_policy_error():
    with pytest.raises(PolicyError):
        GpuPool("no-such-policy", backend="host")


def test_close_releases_every_segment_and_refuses_more_work():
    pool = host_pool()
    keep = pool.malloc(5000)
    pool.allocate(MiB)
    pool.close()
    assert pool.device.num_segments == 0 and pool.device.used_bytes == 0
    with pytest.raises(PoolError, match="closed"):
        pool.allocate(10)
    del keep  # dropping a pointer after close frees nothing and raises nothing
    gc.collect()
    assert pool.lease_errors == []


# ---------------------------------------------------------------------- validation
def test_validation_asks_the_policy_for_guards_on_both_sides():
    pool = host_pool(validate=True, guard_bytes=256)
    a = pool.allocate(1000)
    assert a.nbytes == 1000 + 2 * 256
    assert pool.pointer(a) == pool.device.address(a.offset) + 256
    dev = pool.device
    assert dev.first_mismatch(a.offset, 256, GUARD_WORD, 0) == -1
    assert dev.first_mismatch(a.offset + 256, 1000, data_word(1), 256 % 4) == -1
    pool.free(a)


def test_clean_validated_run_finds_nothing():
    pool = host_pool("size-class", validate=True)
    live = [pool.allocate(n) for n in (100, 5000, 3 * MiB, 512)]
    for a in live:
        pool.free(a)
    assert pool.stats().num_frees == 4


def test_overrun_past_the_end_is_caught_with_its_offset():
    pool = host_pool(validate=True, guard_bytes=64)
    a = pool.allocate(1000)
    bad = a.offset + 64 + 1000 + 3
    pool.device.view(bad, 1)[:] = 0
    with pytest.raises(CorruptionError, match="guard-after") as info:
        pool.free(a)
    assert info.value.offset == bad and info.value.address == pool.device.address(bad)
    assert pool.policy.num_live == 0  # freed anyway: the pool stays consistent


def test_underrun_before_the_start_is_caught():
    pool = host_pool(validate=True, guard_bytes=64)
    a = pool.allocate(1000)
    pool.device.view(a.offset + 63, 1)[:] = 1
    with pytest.raises(CorruptionError, match="guard-before"):
        pool.free(a)


def test_overwritten_data_is_caught_when_contents_are_checked():
    pool = host_pool(validate=True)
    a = pool.allocate(1000)
    pool.device.view(a.offset + 256 + 500, 1)[:] = 0
    with pytest.raises(CorruptionError, match="data"):
        pool.free(a)


def _region_of(pos, guard, user):
    return "guard-before" if pos < guard else "data" if pos < guard + user else "guard-after"


def test_a_single_flipped_byte_anywhere_in_an_allocation_or_its_guards_is_caught():
    """Every byte position of a small allocation (guards, data, rounding slack), one at a time."""
    pool = host_pool("first-fit", validate=True, guard_bytes=64)
    user = 301  # the policy rounds up: the slack joins the trailing guard
    probe = pool.allocate(user)
    size = probe.size_bytes
    pool.free(probe)
    for pos in range(size):
        a = pool.allocate(user)
        pool.device.view(a.offset + pos, 1)[:] ^= 0x10
        with pytest.raises(CorruptionError, match=_region_of(pos, 64, user)) as info:
            pool.free(a)
        assert info.value.offset == a.offset + pos
        pool.device.view(a.offset + pos, 1)[:] ^= 0x10  # the next allocation lands here again
    assert pool.policy.num_live == 0


@pytest.mark.parametrize("spec", ["best-fit", "paged:page_bytes=65536"])
def test_a_single_flipped_byte_in_a_large_allocation_is_caught_wherever_it_lies(spec):
    """Positions at the check's piece boundaries, page boundaries and at random, over many
    pieces (a paged allocation spans extents the check walks one by one)."""
    from realgpu.host import _PIECE_BYTES

    rng = np.random.default_rng(7)
    guard, user = 256, 5 * _PIECE_BYTES + 12_345
    pool = host_pool(spec, validate=True, guard_bytes=guard)
    probe = pool.allocate(user)
    size = probe.size_bytes
    pool.free(probe)
    positions = {0, guard - 1, guard, guard + user - 1, guard + user, size - 1}
    positions |= {
        k * _PIECE_BYTES + d for k in range(1, size // _PIECE_BYTES + 1) for d in (-1, 0, 1)
    }
    positions |= set(rng.integers(0, size, 40).tolist())
    for pos in sorted(p for p in positions if 0 <= p < size):
        a = pool.allocate(user)
        span_offset = _span_offset(a, pos)
        pool.device.view(span_offset, 1)[:] ^= 0x80
        with pytest.raises(CorruptionError, match=_region_of(pos, guard, user)) as info:
            pool.free(a)
        assert info.value.offset == span_offset
        pool.device.view(span_offset, 1)[:] ^= 0x80
    a = pool.allocate(user)
    pool.free(a)  # clean again: nothing left behind


def _span_offset(a, pos):
    """The pool offset of byte ``pos`` of ``a``'s span (its extents in order)."""
    for offset, length in a.extents:
        if pos < length:
            return offset + pos
        pos -= length
    raise AssertionError("position past the allocation")


def test_data_written_by_the_caller_passes_without_content_checks():
    pool = host_pool(validate=True, check_contents=False)
    a = pool.allocate(1000)
    pool.device.view(a.offset + 256, 1000)[:] = 0
    pool.free(a)


def test_policy_that_overlaps_allocations_is_caught_naming_the_other(overlapping_policy):
    pool = host_pool(overlapping_policy, validate=True, guard_bytes=0)
    first = pool.allocate(8192)
    second = pool.allocate(1024)
    with pytest.raises(CorruptionError, match=f"live allocation at offset {second.offset}") as info:
        pool.free(first)
    assert info.value.region == "data"


def test_writes_through_a_malloc_pointer_are_not_corruption():
    pool = host_pool(validate=True)
    p = pool.malloc(1000)
    p.array[:] = 0
    del p
    gc.collect()
    assert pool.lease_errors == [] and pool.policy.num_live == 0


def test_overrun_through_a_malloc_pointer_surfaces_at_close():
    pool = host_pool(validate=True, guard_bytes=32)
    p = pool.malloc(100)
    offset = (
        p.ptr
        - pool.device.address(pool.policy.segments()[0].offset)
        + pool.policy.segments()[0].offset
    )
    pool.device.view(offset + 100, 1)[:] = 0  # one byte past the end
    del p
    gc.collect()
    assert len(pool.lease_errors) == 1
    with pytest.raises(CorruptionError, match="guard-after"):
        pool.close()


# page-mapped policies address a virtual range the segment backends cannot translate: they run on
# the cuMem backend (issue 13), not here
@pytest.mark.parametrize(
    "spec", [n for n in policies.available() if policies.registry.device_kind(n) == "segment"]
)
def test_every_registered_policy_validates_clean_under_a_random_workload(spec):
    rng = np.random.default_rng(7)
    pool = host_pool(spec, validate=True, guard_bytes=128)
    live = []
    for _ in range(300):
        if live and rng.random() < 0.45:
            pool.free(live.pop(int(rng.integers(len(live)))))
        else:
            live.append(pool.allocate(int(np.exp(rng.uniform(np.log(256), np.log(4 * MiB))))))
    for a in live:
        pool.free(a)
    pool.close()


def test_malloc_refuses_a_policy_that_moves_allocations_while_allocating():
    pool = host_pool("compacting:base=[best-fit]")
    with pytest.raises(PoolError, match="move live allocations"):
        pool.malloc(1000)
    assert pool.policy.num_allocs == 0


def test_malloc_accepts_a_compacting_policy_that_moves_only_on_demand():
    pool = host_pool("compacting:base=[best-fit],idle_only=true")
    p = pool.malloc(1000)
    assert p.size == 1000 and pool.policy.num_live == 1
