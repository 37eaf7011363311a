"""The page-mapped device: cuMem calls in the abstract, their accounting and their errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from policies.device import VMM_STAT_KEYS, Device
from policies.errors import PolicyError
from policies.mapped_device import VMM_CALLS, PageMappedDevice

MiB = 1 << 20
G = 2 * MiB


class FlatCosts:
    """1 µs per call and 1 ns per MiB, so tests can tell calls and sizes apart."""

    def vmm_call_ns(self, call, nbytes):
        return 1000 + nbytes // MiB


def test_it_is_a_device():
    assert isinstance(PageMappedDevice(), Device)


def test_reserve_costs_address_space_only():
    d = PageMappedDevice(limit_bytes=4 * G)
    va = d.address_reserve(1 << 40)  # far more than the device holds
    assert va is not None and d.virtual_bytes == 1 << 40 and d.physical_bytes == 0
    d.address_free(va, 1 << 40)
    assert d.virtual_bytes == 0 and d.peak_virtual_bytes == 1 << 40


def test_grow_in_place_page_by_page_and_give_back():
    d = PageMappedDevice(limit_bytes=4 * G, costs=FlatCosts())
    va = d.address_reserve(64 * G)
    assert d.map_new(va, G) and d.map_new(va + G, 2 * G)  # a later grow lands right after the first
    assert d.mapped_bytes_in(va, 3 * G) == 3 * G and d.physical_bytes == 3 * G
    assert not d.map_new(va + 3 * G, 2 * G)  # past the 4-page limit: refused, nothing mapped
    assert d.physical_bytes == 3 * G and d.mapped_bytes_in(va, 8 * G) == 3 * G
    d.unmap_release(va + G, 2 * G)
    assert d.physical_bytes == G and d.num_handles == 1
    stats = d.call_stats()
    assert set(stats) == set(VMM_STAT_KEYS)
    assert (stats["n_map"], stats["n_unmap"], stats["mapped_bytes"]) == (3, 2, 3 * G)
    # one create per page, one set-access per map_new, the refused create charged too
    assert (
        d.num_calls["create"] == 4
        and d.num_calls["set_access"] == 2
        and d.num_calls["release"] == 2
    )
    assert (
        d.driver_ns_total == sum(d.call_ns.values()) == d.take_driver_ns()
        and d.take_driver_ns() == 0
    )


def test_a_handle_can_be_mapped_twice_and_is_released_once_unmapped_everywhere():
    d = PageMappedDevice()
    a, b = d.address_reserve(G), d.address_reserve(G)
    h = d.create(G)
    d.map(a, h)
    d.map(b, h)  # GMLake's stitching maps existing physical chunks into a new range
    assert d.physical_bytes == G
    d.unmap_release(a, G)
    assert d.num_handles == 1  # still mapped at b
    d.unmap_release(b, G)
    assert d.num_handles == 0 and d.physical_bytes == 0


@pytest.mark.parametrize(
    "bad",
    [
        lambda d, va, h: d.map(va + MiB, h),  # not on the granularity
        lambda d, va, h: d.map(va + 4 * G, h),  # outside the reserved range
        lambda d, va, h: (d.map(va, h), d.map(va, h)),  # over a mapping
        lambda d, va, h: d.set_access(va, G),  # nothing mapped
        lambda d, va, h: d.release_handle(999),  # no such handle
        lambda d, va, h: (d.map(va, h), d.release_handle(h)),  # still mapped
        lambda d, va, h: (d.map(va, h), d.address_free(va, 4 * G)),  # pages still mapped
        lambda d, va, h: d.address_free(va + G, G),  # not a reserved range
        lambda d, va, h: d.create(MiB),  # not a multiple of the granularity
    ],
)
def test_misuse_is_an_error_that_changes_nothing_it_names(bad):
    d = PageMappedDevice()
    va = d.address_reserve(4 * G)
    h = d.create(G)
    with pytest.raises(PolicyError):
        bad(d, va, h)


def test_unmap_of_part_of_a_mapping_is_refused():
    d = PageMappedDevice()
    va = d.address_reserve(4 * G)
    d.map(va, d.create(2 * G))
    with pytest.raises(PolicyError, match="sticks out"):
        d.unmap(va, G)
    assert d.mapped_bytes_in(va, 2 * G) == 2 * G


def test_every_policy_runs_on_it_through_the_segment_protocol():
    for name in ("best-fit", "paged", "size-class", "torch-caching"):
        d = PageMappedDevice(limit_bytes=256 * MiB)
        p = policies.create(name, device=d)
        a = p.allocate(3 * MiB)
        assert a is not None and d.physical_bytes == p.reserved_bytes > 0
        p.free(a)
        p.trim()
        assert d.physical_bytes == p.reserved_bytes and d.virtual_bytes == p.reserved_bytes


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["grow", "shrink"]), st.integers(1, 4)), max_size=40))
def test_physical_bytes_are_what_is_mapped_in_random_grows(ops):
    d = PageMappedDevice(limit_bytes=16 * G)
    va = d.address_reserve(64 * G)
    top = 0
    for op, pages in ops:
        if op == "grow":
            if d.map_new(va + top, pages * G):
                top += pages * G
        elif top:
            cut = min(pages * G, top)
            d.unmap_release(va + top - cut, cut)
            top -= cut
        assert d.physical_bytes == d.mapped_bytes_in(va, 64 * G) == top <= 16 * G


def test_the_cost_model_prices_every_vmm_call():
    from sim.replay.costs import CostModel, costed_page_mapped_device

    costs = CostModel.load()
    for call in VMM_CALLS:
        assert costs.vmm_call_ns(call, G) > 0
    # field notes: a 2 MiB page's create + map + set-access is about 44 µs on the H200
    assert (
        40_000
        < costs.vmm_call_ns("create", G)
        + costs.vmm_call_ns("map", G)
        + costs.vmm_call_ns("set_access", G)
        < 50_000
    )
    d = costed_page_mapped_device(costs)
    va = d.address_reserve(G)
    d.map_new(va, G)
    assert d.take_driver_ns() == sum(
        costs.vmm_call_ns(c, G) for c in ("address_reserve", "create", "map", "set_access")
    )


def test_physical_pages_can_come_from_a_segment_device():
    from policies.device import VirtualDevice
    from policies.mapped_device import as_page_mapped

    upstream = VirtualDevice(limit_bytes=3 * G)
    d = as_page_mapped(upstream)
    assert as_page_mapped(d) is d
    va = d.address_reserve(8 * G)
    assert d.map_new(va, 2 * G) and upstream.used_bytes == 2 * G
    handles = d.num_handles
    assert not d.map_new(
        va + 2 * G, 2 * G
    )  # the second page is refused upstream: the first is given back
    assert upstream.used_bytes == d.physical_bytes == 2 * G and d.num_handles == handles
    assert d.mapped_bytes_in(va, 8 * G) == 2 * G
    h = d.handle_at(va)
    d.unmap_release(va, 2 * G)
    assert upstream.used_bytes == 0 and h not in d._handles
    with pytest.raises(PolicyError):
        d.handle_at(va)
