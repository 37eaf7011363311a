import math

import pytest
from hypothesis import given, settings, strategies as st

import policies
from policies import registry
from policies.best_fit import BestFit
from policies.device import VirtualDevice
from policies.elastic import Elastic
from policies.errors import PolicyError
from policies.first_fit import FirstFit
from policies.testing import SegmentPerRequest, check_invariants, check_policy

MiB = 1 << 20


class FixedPool(SegmentPerRequest):
    """Serves only from segments handed to it by ``grow``: never reserves on a miss."""

    name = "fixed-pool"

    def _allocate(self, nbytes, stream, tag):
        size = self._segment_size_for(nbytes)
        fits = [s for s in self._cached if s.nbytes >= size]
        if not fits:
            return None
        seg = min(fits, key=lambda s: s.nbytes)
        self._cached.remove(seg)
        seg.num_live = 1
        self.allocated_bytes += seg.nbytes
        return policies.Allocation(
            nbytes, seg.nbytes, ((seg.offset, seg.nbytes),), stream, tag, seg
        )


@pytest.fixture(autouse=True)
def test_policies():
    for cls in (SegmentPerRequest, FixedPool):
        registry.register(cls.name, cls, replace=True)
    yield
    for cls in (SegmentPerRequest, FixedPool):
        registry.unregister(cls.name)


def elastic(**kw):
    kw.setdefault("base", "segment-per-request")
    return Elastic(**kw)


# ---------------------------------------------------------------------------- construction
def test_default_base_is_best_fit():
    assert isinstance(Elastic().base_policy, BestFit)


def test_nested_spec_builds_the_base_with_its_params():
    e = policies.create("elastic:base=[first-fit:segment_bytes=4MiB],high=0.9,patience=3")
    assert isinstance(e.base_policy, FirstFit)
    assert e.base_policy.segment_bytes == 4 * MiB
    assert (e.high, e.patience) == (0.9, 3)


def test_base_gets_the_capacity_and_device():
    device = VirtualDevice()
    e = elastic(capacity_bytes=64 * MiB, device=device)
    assert e.base_policy.capacity_bytes == 64 * MiB
    assert e.base_policy.device is device and e.device is device


def test_spec_round_trips_through_create():
    e = policies.create(
        "elastic:base=[first-fit:segment_bytes=4MiB],high=0.9,low=0.1,min_reserved_bytes=8MiB"
    )
    assert policies.create(e.spec).get_params() == e.get_params()


def test_elastic_can_wrap_elastic():
    e = policies.create(
        "elastic:base=[elastic:base=[segment-per-request],patience=2],grow_bytes=2MiB"
    )
    assert isinstance(e.base_policy, Elastic)
    a = e.allocate(MiB)
    check_invariants(e, [a])


def test_unknown_base_names_the_base_and_the_choices():
    with pytest.raises(PolicyError, match=r"elastic base\(='nope'\).*available: first-fit"):
        Elastic(base="nope")


@pytest.mark.parametrize(
    "kw",
    [
        {"high": 1.5},
        {"high": -0.1},
        {"low": 0.9, "high": 0.8},
        {"low": 0.5, "high": 0.5},
        {"high": True},
        {"low": "0.3"},
        {"patience": 0},
        {"patience": 1.5},
        {"grow_bytes": 0},
        {"min_reserved_bytes": -1},
        {"min_reserved_bytes": 128 * MiB, "capacity_bytes": 64 * MiB},
        {"base": BestFit},
    ],
)
def test_bad_knobs_raise_policy_error(kw):
    with pytest.raises(PolicyError):
        elastic(**kw)


def test_takes_placement_flags_from_its_base():
    paged = Elastic(base="paged")
    assert (paged.contiguous, paged.coalesces) == (False, False)
    assert (Elastic(base="first-fit").contiguous, Elastic(base="first-fit").coalesces) == (
        True,
        True,
    )


# ---------------------------------------------------------------------------- growing
def test_pregrows_when_use_exceeds_high():
    e = elastic(grow_bytes=4 * MiB)
    e.allocate(MiB)  # its own 1 MiB segment: use 1.0
    assert e.stats().reserved_bytes == 5 * MiB
    assert (e.mapped_bytes, e.num_maps) == (4 * MiB, 1)


def test_next_request_is_served_from_the_pregrown_segment():
    e = elastic(grow_bytes=4 * MiB)
    e.allocate(MiB)
    grown = [s for s in e.segments() if s.num_live == 0]
    a = e.allocate(3 * MiB)
    assert a.offset == grown[0].offset


def test_no_pregrow_while_use_is_at_most_high():
    e = Elastic(base="first-fit:segment_bytes=10MiB", grow_bytes=4 * MiB, high=0.85)
    e.allocate(8 * MiB)  # from a 10 MiB segment: use 0.8
    assert e.stats().reserved_bytes == 10 * MiB
    assert e.num_maps == 0


def test_high_of_one_never_pregrows():
    e = elastic(high=1.0)
    e.allocate(MiB)
    assert (e.stats().reserved_bytes, e.mapped_bytes) == (MiB, 0)


def test_pregrow_that_would_pass_capacity_is_skipped_and_keeps_cached_segments():
    # a refused grow would make the base release its free segments first (trim-and-retry)
    e = Elastic(base="first-fit:segment_bytes=4MiB", grow_bytes=8 * MiB, capacity_bytes=32 * MiB)
    e.grow(4 * MiB)  # a free stream-0 segment that stream-1 requests cannot use
    for _ in range(6):
        e.allocate(4 * MiB, stream=1)  # the sixth leaves use 24/28 > high; 28 + 8 > 32
    s = e.stats()
    assert (s.reserved_bytes, s.num_shrinks, e.num_maps) == (28 * MiB, 0, 1)


def test_failed_allocation_grows_and_retries_once():
    e = elastic(base="fixed-pool", grow_bytes=4 * MiB, high=1.0)
    a = e.allocate(MiB)
    assert a is not None and a.nbytes == MiB
    assert e.num_retries == 1
    assert e.stats().num_failures == 0
    assert e.base_policy.stats().num_failures == 1  # the base's attempt before the retry


def test_retry_maps_at_least_the_request():
    e = elastic(base="fixed-pool", grow_bytes=MiB, high=1.0)
    assert e.allocate(6 * MiB) is not None
    assert e.mapped_bytes == 6 * MiB


def test_refused_request_counts_one_failure():
    e = elastic(base="fixed-pool", capacity_bytes=4 * MiB)
    assert e.allocate(8 * MiB) is None
    assert e.stats().num_failures == 1
    assert e.stats().reserved_bytes == 0


def test_fixed_pool_becomes_elastic():
    check_policy(lambda **kw: elastic(base="fixed-pool", patience=2, grow_bytes=2 * MiB, **kw))


# ---------------------------------------------------------------------------- reserve
def test_reserve_pregrows_until_that_many_bytes_are_free():
    e = elastic(grow_bytes=MiB)
    assert e.reserve(10 * MiB)
    assert e.stats().free_bytes >= 10 * MiB
    assert e.mapped_bytes == 10 * MiB


def test_reserve_does_nothing_when_enough_is_free():
    e = elastic()
    e.grow(8 * MiB)
    assert e.reserve(6 * MiB)
    assert e.stats().num_grows == 1


def test_reserve_beyond_capacity_returns_false_and_changes_nothing():
    e = elastic(capacity_bytes=16 * MiB)
    cached = e.allocate(4 * MiB)
    e.free(cached)
    before = e.stats()
    assert not e.reserve(32 * MiB)
    assert e.stats() == before


def test_reserve_near_capacity_maps_only_what_is_missing():
    e = elastic(capacity_bytes=16 * MiB, grow_bytes=32 * MiB)
    assert e.reserve(10 * MiB)
    assert e.stats().reserved_bytes == 10 * MiB


# ---------------------------------------------------------------------------- trimming
def _filled(num, **kw):
    kw.setdefault("high", 1.0)  # no pre-growing: one 1 MiB segment per request
    e = elastic(**kw)
    return e, [e.allocate(MiB) for _ in range(num)]


def test_trims_after_patience_frees_below_low():
    e, live = _filled(10, patience=3, low=0.5)
    for a in live[:7]:
        e.free(a)  # use 0.9 .. 0.3: below 0.5 from the 6th free on
        assert e.num_unmaps == 0
    e.free(live[7])  # the third free in a row below low
    assert e.num_unmaps == 1
    assert e.stats().reserved_bytes < 10 * MiB


def test_a_request_that_lifts_use_above_low_restarts_the_count():
    e, live = _filled(10, patience=3, low=0.5)
    for a in live[:7]:
        e.free(a)  # two frees below low so far
    live[:7] = [e.allocate(MiB) for _ in range(3)] + [None] * 4  # use back above low
    e.free(live[7])
    e.free(live[8])
    assert e.num_unmaps == 0


def test_trim_stops_mid_band_so_the_next_request_does_not_regrow():
    e, live = _filled(20, patience=1, low=0.3)
    e.high = 0.85  # pre-growing on from here
    for a in live[:15]:
        e.free(a)
    assert e.num_unmaps >= 1
    assert e.usage <= (0.3 + 0.85) / 2
    e.allocate(MiB)
    assert e.num_maps == 0


@pytest.mark.parametrize(
    "base",
    [
        "segment-per-request",
        "first-fit:segment_bytes=4MiB",
        "paged:page_bytes=1MiB,segment_bytes=4MiB",
    ],
)
def test_trim_never_goes_below_min_reserved_bytes(base):
    e = Elastic(base=base, patience=1, high=1.0, min_reserved_bytes=10 * MiB)
    live = [e.allocate(MiB) for _ in range(24)]
    for a in live:
        e.free(a)
        assert e.stats().reserved_bytes >= 10 * MiB
    assert e.num_unmaps >= 1


def test_zero_low_never_trims():
    e, live = _filled(10, patience=1, low=0.0)
    for a in live:
        e.free(a)
    assert e.stats().reserved_bytes == 10 * MiB


def test_explicit_trim_releases_everything_free():
    e, live = _filled(4, min_reserved_bytes=8 * MiB, low=0.0)
    for a in live:
        e.free(a)
    assert e.trim() == 4 * MiB
    assert e.stats().reserved_bytes == 0
    assert e.unmapped_bytes == 4 * MiB


@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 12 * MiB)), max_size=60),
    st.sampled_from(
        ["segment-per-request", "first-fit:segment_bytes=4MiB", "paged:page_bytes=2MiB"]
    ),
)
@settings(max_examples=60, deadline=None)
def test_controller_trims_never_cross_the_floor(ops, base):
    e = Elastic(
        base=base, patience=2, low=0.5, high=0.9, grow_bytes=2 * MiB, min_reserved_bytes=16 * MiB
    )
    live = []
    for is_alloc, n in ops:
        if is_alloc or not live:
            live.append(e.allocate(n))
        else:
            before = e.stats().reserved_bytes
            e.free(live.pop(n % len(live)))
            after = e.stats().reserved_bytes
            assert after >= min(before, 16 * MiB)
        check_invariants(e, live)


# ---------------------------------------------------------------------------- the Policy contract
def test_stats_are_the_base_stats():
    e = elastic(grow_bytes=2 * MiB, patience=1)
    live = [e.allocate(n) for n in (MiB, 3 * MiB, 512)]
    e.free(live.pop())
    s, b = e.stats(), e.base_policy.stats()
    assert s == b
    assert (e.reserved_bytes, e.allocated_bytes, e.num_grows) == (
        b.reserved_bytes,
        b.allocated_bytes,
        b.num_grows,
    )


def test_counts_mapped_and_unmapped_bytes():
    e, live = _filled(6, patience=1, grow_bytes=MiB)
    e.grow(2 * MiB)
    for a in live:
        e.free(a)
    e.trim()
    st_ = e.elastic_stats()
    assert st_["mapped_bytes"] == e.mapped_bytes == 2 * MiB
    assert st_["unmapped_bytes"] == e.unmapped_bytes == e.stats().shrunk_bytes == 8 * MiB
    assert set(st_) >= {"usage", "num_maps", "num_unmaps", "num_retries"}


def test_wrapper_allocations_free_only_through_the_wrapper():
    e = elastic()
    a = e.allocate(MiB)
    with pytest.raises(PolicyError):
        e.base_policy.free(a)
    with pytest.raises(PolicyError):
        e.free(a.handle)
    e.free(a)
    assert e.stats().num_live == 0


def test_inspection_delegates_to_the_base():
    e = Elastic(base="first-fit:segment_bytes=4MiB", high=1.0)
    a = e.allocate(MiB)
    b = e.base_policy
    assert e.segments() == b.segments()
    assert e.free_extents() == b.free_extents() == [(a.offset + MiB, 3 * MiB)]
    assert e.largest_free_bytes() == b.largest_free_bytes() == 3 * MiB


def test_reset_resets_base_device_and_controller():
    device = VirtualDevice()
    e = elastic(device=device, grow_bytes=MiB)
    e.allocate(MiB)
    e.reset()
    assert device.used_bytes == 0
    assert e.stats() == elastic(grow_bytes=MiB).stats()
    assert e.elastic_stats()["mapped_bytes"] == 0


def test_usage_is_allocated_over_reserved():
    e = Elastic(base="first-fit:segment_bytes=4MiB", high=1.0)
    assert e.usage == 0.0
    e.allocate(MiB)
    assert math.isclose(e.usage, MiB / (4 * MiB))
