"""The virtual-memory policies' own rules: in-place growth (``virtual=true``), GMLake stitching
(``vmm-stitch``) and kvcached's page reserve (``page-pool``). The conformance battery runs
over the registered ones (``test_conformance.py``); here it also runs over ``virtual=true``."""

import functools

import pytest

import policies
from policies import testing
from policies.device import VirtualDevice
from policies.mapped_device import PageMappedDevice
from policies.registry import device_kind
from policies.testing import check_invariants

MiB = 1 << 20
G = 2 * MiB

VIRTUAL_SPECS = ["best-fit:virtual=true", "first-fit:virtual=true", "worst-fit:virtual=true"]


@pytest.mark.parametrize(
    "check",
    [c for c in testing.POLICY_CHECKS if c is not testing.check_grow],
    ids=lambda c: c.__name__,
)
@pytest.mark.parametrize("spec", VIRTUAL_SPECS)
def test_virtual_block_policies_pass_the_battery(spec, check):
    # check_grow expects a grow to add a segment; a virtual pool grows its one range in place
    # (test_virtual_grow_maps_in_place_and_coalesces checks that instead)
    check(functools.partial(policies.create, spec))


def test_virtual_pool_is_one_range_per_stream_growing_in_place():
    d = PageMappedDevice()
    p = policies.create("best-fit:virtual=true", device=d)
    a = p.allocate(3 * MiB)
    b = p.allocate(5 * MiB)
    c = p.allocate(100, stream=1)
    segs = p.segments()
    assert len(segs) == 2 and d.virtual_bytes == 2 << 40  # one reserved range per stream
    s0 = next(s for s in segs if s.stream == 0)
    # the second request mapped only the pages it lacked, right after the first's: no new range
    assert b.offset == a.offset + 3 * MiB and s0.nbytes == 8 * MiB
    assert p.reserved_bytes == d.physical_bytes == 8 * MiB + G and p.num_grows == 2
    p.free(b)
    big = p.allocate(9 * MiB)  # the free tail (5 MiB) coalesces with 4 MiB of new pages
    assert big.offset == b.offset and s0.nbytes == 12 * MiB and len(p.segments()) == 2
    check_invariants(p, [a, c, big])


def test_virtual_trim_unmaps_free_end_pages_only():
    d = PageMappedDevice()
    p = policies.create("best-fit:virtual=true", device=d)
    a, b = p.allocate(3 * MiB), p.allocate(6 * MiB)
    p.free(b)
    assert p.trim() == 6 * MiB  # pages [4, 10) MiB: not the page a shares with the free tail
    assert p.reserved_bytes == d.physical_bytes == 4 * MiB
    p.free(a)
    assert p.trim() == 4 * MiB and p.segments() == [] and d.virtual_bytes == 0


def test_virtual_grow_maps_in_place_and_coalesces():
    p = policies.create("best-fit:virtual=true", capacity_bytes=64 * MiB)
    a = p.allocate(MiB)
    assert p.grow(8 * MiB) and p.largest_free_bytes() == 9 * MiB and len(p.segments()) == 1
    assert not p.grow(64 * MiB)  # past capacity: refused, nothing mapped
    assert p.reserved_bytes == 10 * MiB
    check_invariants(p, [a])


def test_virtual_capacity_retry_unmaps_other_streams_free_tails():
    p = policies.create("best-fit:virtual=true", capacity_bytes=16 * MiB)
    x = p.allocate(12 * MiB, stream=1)
    p.free(x)
    a = p.allocate(10 * MiB)  # stream 1's free 12 MiB are unmapped to make room
    assert a is not None and p.reserved_bytes == 10 * MiB
    check_invariants(p, [a])


def test_virtual_spec_declares_a_page_mapped_device():
    assert device_kind("best-fit") == "segment"
    assert device_kind("best-fit:virtual=true") == "page-mapped"
    assert device_kind("elastic:base=[page-pool]") == "page-mapped"
    assert device_kind("vmm-stitch") == "page-mapped"
    with pytest.raises(policies.PolicyError, match="virtual"):
        policies.create("best-fit:virtual=3")


def test_replay_builds_a_costed_page_mapped_device_for_a_virtual_spec():
    from sim.replay.costed_policy import create_policy

    p = create_policy("best-fit:virtual=true", capacity_bytes=None, costs=None)
    p.allocate(3 * MiB)
    stats = p.device.call_stats()
    assert (
        isinstance(p.device, PageMappedDevice)
        and stats["n_map"] == 2
        and p.device.driver_ns_total > 0
    )
    seg = create_policy("best-fit", capacity_bytes=None, costs=None)
    assert not isinstance(seg.device, PageMappedDevice)


# ---------------------------------------------------------------------------- vmm-stitch
def test_stitching_maps_free_chunks_instead_of_growing():
    d = PageMappedDevice()
    p = policies.create("vmm-stitch", device=d)
    a, hole1, b, hole2, c = (p.allocate(n) for n in (G, 2 * G, G, 2 * G, G))
    p.free(hole1)
    p.free(hole2)
    created = d.num_calls["create"]
    physical = d.physical_bytes
    s = p.allocate(4 * G)  # no free run of 4 chunks: stitch the two 2-chunk holes
    assert s is not None and d.num_calls["create"] == created and d.physical_bytes == physical
    assert sorted(s.extents) == sorted([hole1.extents[0], hole2.extents[0]])
    address = p.stitched_address(s)
    assert d.mapped_bytes_in(address, 4 * G) == 4 * G  # one contiguous range over the chunks
    assert p.stitch_stats()["num_stitches"] == 1
    check_invariants(p, [a, b, c, s])
    # freed and asked again: the cached stitched range is reused with no driver call
    p.free(s)
    maps = d.num_calls["map"]
    again = p.allocate(4 * G)
    assert p.stitched_address(again) == address and d.num_calls["map"] == maps
    assert p.stitch_stats()["num_stitch_reuses"] == 1


def test_stitching_creates_only_the_shortfall():
    d = PageMappedDevice()
    p = policies.create("vmm-stitch", device=d)
    a, hole, b = p.allocate(G), p.allocate(2 * G), p.allocate(G)
    p.free(hole)
    s = p.allocate(5 * G)  # 2 chunks free: create 3 more, stitch all 5
    assert p.reserved_bytes == d.physical_bytes == 7 * G  # 4 chunks before, 3 created
    assert sum(n for _, n in s.extents) == 5 * G
    check_invariants(p, [a, b, s])


def test_trim_unmaps_stitched_ranges_before_releasing_their_chunks():
    d = PageMappedDevice()
    p = policies.create("vmm-stitch", device=d)
    a, h1, b, h2 = (p.allocate(n) for n in (G, G, G, G))
    p.free(h1)
    p.free(h2)
    s = p.allocate(2 * G)
    for x in (a, b, s):
        p.free(x)
    p.trim()
    assert p.reserved_bytes == d.physical_bytes == 0 and d.num_handles == 0 and d.virtual_bytes == 0


# ---------------------------------------------------------------------------- page-pool
def test_page_pool_keeps_its_reserve_between_the_watermarks():
    d = PageMappedDevice()
    p = policies.create("page-pool:min_free_pages=2,max_free_pages=4", device=d)
    allocs = [p.allocate(G) for _ in range(3)]
    # each allocation past the reserve tops it up to the low watermark
    assert p.pool_stats()["num_free_pages"] >= 2
    assert p.pool_stats()["num_free_pages"] == 2
    reserve = {off for off, _ in p.free_extents()}
    creates = d.num_calls["create"]
    more = p.allocate(G)
    assert more.offset in reserve  # served from a page mapped ahead ...
    assert (
        d.num_calls["create"] == creates + 1 and p.pool_stats()["num_free_pages"] == 2
    )  # ... then topped up
    allocs.append(more)
    for a in allocs:
        p.free(a)
        assert p.pool_stats()["num_free_pages"] <= 4  # above the high watermark pages are unmapped
    assert p.reserved_bytes == d.physical_bytes == 4 * G
    check_invariants(p, [])


def test_page_pool_hot_path_rarely_calls_the_driver():
    d = PageMappedDevice()
    p = policies.create("page-pool", device=d)
    live = [p.allocate(G) for _ in range(6)]
    calls_before = d.num_calls["create"]
    for _ in range(200):  # churn within the reserve
        p.free(live.pop())
        live.append(p.allocate(G))
    assert d.num_calls["create"] == calls_before


def test_page_pool_is_one_virtual_range():
    d = PageMappedDevice()
    p = policies.create("page-pool", device=d)
    p.allocate(5 * G)
    p.grow(8 * G)
    assert d.virtual_bytes == 1 << 40  # every page lives in the one range


def test_page_pool_runs_under_elastic_and_on_a_segment_device():
    dev = VirtualDevice(limit_bytes=16 * MiB)
    p = policies.create("elastic:base=[page-pool]", device=dev)
    a = p.allocate(3 * MiB)
    assert a is not None and dev.used_bytes == p.reserved_bytes
    assert p.allocate(64 * MiB) is None and dev.used_bytes == p.reserved_bytes


def test_page_pool_refuses_a_page_off_the_granularity():
    with pytest.raises(policies.PolicyError, match="granularity"):
        policies.create("page-pool:page_bytes=1MiB")
    with pytest.raises(policies.PolicyError, match="watermarks"):
        policies.create("page-pool:min_free_pages=8,max_free_pages=2")


def test_page_pool_range_never_runs_out_of_address_space_in_a_long_run():
    """Batches of pages freed and taken again for ever stay inside the virtual range (a run
    once crept past its 1 TiB end after 45 simulated minutes of three tenants)."""
    import random

    from policies.mapped_device import PageMappedDevice
    from policies.page_pool import RangeDevice

    page = 2 << 20
    dev = RangeDevice(PageMappedDevice(), page, range_bytes=64 * page)
    rng, held = random.Random(0), []
    for _ in range(5000):
        if held and (len(held) > 8 or rng.random() < 0.5):
            off, n = held.pop(rng.randrange(len(held)))
            dev.release(off, n)
        else:
            n = rng.choice([1, 1, 2, 3, 4]) * page
            off = dev.reserve(n)
            assert off is not None, "refused with at most 36 of 64 pages held"
            assert dev.base <= off and off + n <= dev.base + dev.range_bytes
            held.append((off, n))
        mapped = sum(n for _, n in held)
        assert dev.mapped.physical_bytes == mapped
        assert sum(n for _, n in held) <= 8 * 4 * page
    # never refused for want of address space: at most 36 pages are ever held in a 64-page range
    assert all(
        dev.reserve(page) is not None
        for _ in range(64 - len(held) - sum(n // page - 1 for _, n in held))
    )
