import numpy as np
import pytest

from policies.base import Allocation, Policy, PoolStats, Segment, check_positive_int, round_up
from policies.device import VirtualDevice
from policies.errors import PolicyError
from policies.testing import SegmentPerRequest

MiB = 1 << 20


def _pool(**kw):
    return SegmentPerRequest(**kw)


# ---------------------------------------------------------------------------- request sizes
@pytest.mark.parametrize("nbytes", [0, -1, -(1 << 40)])
def test_size_not_above_zero_raises_and_changes_nothing(nbytes):
    p = _pool()
    p.allocate(4096)
    before = p.stats()
    with pytest.raises(PolicyError, match=rf"nbytes\(={nbytes}\) must be > 0"):
        p.allocate(nbytes)
    assert p.stats() == before


@pytest.mark.parametrize("nbytes", [1.5, 4096.0, "10", True, False, None, b"1", np.float64(8.0)])
def test_size_that_is_no_integer_raises_naming_it(nbytes):
    p = _pool()
    before = p.stats()
    with pytest.raises(PolicyError, match=r"nbytes\(=.*\) must be an integer number of bytes"):
        p.allocate(nbytes)
    assert p.stats() == before


@pytest.mark.parametrize("nbytes", [np.int64(4096), np.uint32(4096), np.int8(100)])
def test_numpy_integer_size_is_accepted_as_an_int(nbytes):
    a = _pool().allocate(nbytes)
    assert a.nbytes == int(nbytes) and type(a.nbytes) is int


def test_negative_numpy_integer_raises():
    with pytest.raises(PolicyError, match="must be > 0"):
        _pool().allocate(np.int64(-5))


# ---------------------------------------------------------------------------- construction
@pytest.mark.parametrize("capacity", [0, -1, 1.5, "1GiB"])
def test_bad_capacity_raises(capacity):
    with pytest.raises(PolicyError, match=r"capacity_bytes\(=.*\) must be an integer >= 1 or None"):
        _pool(capacity_bytes=capacity)


def test_bool_capacity_raises():
    with pytest.raises(PolicyError):
        _pool(capacity_bytes=True)


def test_default_device_is_a_fresh_virtual_device():
    a, b = _pool(), _pool()
    assert isinstance(a.device, VirtualDevice) and a.device is not b.device


@pytest.mark.parametrize("value", [0, -1, 1.0, "8", True, None])
def test_check_positive_int_names_the_knob(value):
    with pytest.raises(
        PolicyError, match=rf"^rounding_bytes\(={value!r}\) must be an integer >= 1$"
    ):
        check_positive_int("rounding_bytes", value)


def test_check_positive_int_takes_a_minimum():
    assert check_positive_int("n", 0, minimum=0) == 0
    with pytest.raises(PolicyError, match=">= 2"):
        check_positive_int("n", 1, minimum=2)


# ---------------------------------------------------------------------------- parameters
def test_get_params_lists_every_keyword_knob():
    assert _pool(rounding_bytes=1024, capacity_bytes=MiB).get_params() == {
        "rounding_bytes": 1024,
        "capacity_bytes": MiB,
    }


def test_param_defaults_come_from_the_signatures():
    assert SegmentPerRequest.param_defaults() == {"capacity_bytes": None, "rounding_bytes": 512}


def test_spec_lists_changed_knobs_only():
    assert _pool().spec == "segment-per-request"
    assert (
        _pool(rounding_bytes=1024, capacity_bytes=MiB).spec
        == "segment-per-request:rounding_bytes=1024"
    )


def test_repr_shows_spec_and_capacity():
    assert (
        repr(_pool(capacity_bytes=MiB))
        == "<SegmentPerRequest 'segment-per-request' capacity_bytes=1048576>"
    )


# ---------------------------------------------------------------------------- free
def test_free_of_no_allocation_names_the_type():
    with pytest.raises(PolicyError, match="free\\(\\) takes an Allocation, got int"):
        _pool().free(5)


def test_double_free_says_so():
    p = _pool()
    a = p.allocate(4096)
    p.free(a)
    with pytest.raises(PolicyError, match="double free: allocation of 4096 B at offset"):
        p.free(a)


def test_free_of_another_pools_allocation_says_unknown():
    a = _pool().allocate(4096)
    with pytest.raises(PolicyError, match="unknown allocation"):
        _pool().free(a)


def test_allocation_from_before_reset_is_unknown():
    p = _pool()
    a = p.allocate(4096)
    p.reset()
    with pytest.raises(PolicyError, match="unknown allocation"):
        p.free(a)


# ---------------------------------------------------------------------------- counters
def test_counters_follow_allocs_frees_and_failures():
    p = _pool(capacity_bytes=4 * MiB)
    a = p.allocate(1000)
    p.allocate(2000)
    assert p.allocate(8 * MiB) is None
    p.free(a)
    s = p.stats()
    assert (s.num_allocs, s.num_frees, s.num_failures, s.num_live) == (2, 1, 1, 1)
    assert (s.live_bytes, s.peak_live_bytes) == (2000, 3000)
    assert (s.allocated_bytes, s.peak_allocated_bytes) == (2048, 3072)


def test_reset_releases_every_segment_and_zeroes_counters():
    device = VirtualDevice()
    p = _pool(device=device)
    p.allocate(MiB)
    p.grow(MiB)
    p.reset()
    assert device.used_bytes == 0
    assert p.stats() == _pool().stats()


def test_reserve_releases_free_segments_and_retries_when_capacity_refuses():
    p = _pool(capacity_bytes=4 * MiB)
    p.free(p.allocate(3 * MiB))  # a cached 3 MiB segment
    assert p.allocate(2 * MiB, stream=1) is not None  # cannot reuse it across streams
    s = p.stats()
    assert (s.reserved_bytes, s.num_shrinks) == (2 * MiB, 1)


def test_reserve_without_retry_keeps_free_segments():
    p = _pool(capacity_bytes=4 * MiB)
    p.free(p.allocate(3 * MiB))
    assert p._reserve_segment(2 * MiB, retry=False) is None
    assert p.stats().reserved_bytes == 3 * MiB


def test_grow_adds_a_free_segment():
    p = _pool()
    assert p.grow(3 * MiB)
    s = p.stats()
    assert (s.reserved_bytes, s.free_bytes, s.num_grows, s.grown_bytes) == (
        3 * MiB,
        3 * MiB,
        1,
        3 * MiB,
    )


def test_grow_beyond_capacity_returns_false():
    p = _pool(capacity_bytes=2 * MiB)
    assert not p.grow(3 * MiB)
    assert p.stats().reserved_bytes == 0


def test_grow_never_gives_free_memory_back():
    p = _pool(capacity_bytes=4 * MiB)
    p.grow(3 * MiB)
    p.grow(2 * MiB)  # 3 + 2 > 4: refused, and it should leave the free 3 MiB alone
    assert p.stats().free_bytes >= 3 * MiB


def test_trim_returns_the_bytes_released():
    p = _pool()
    _, b = p.allocate(MiB), p.allocate(2 * MiB)  # the first stays live: its segment must stay
    p.free(b)
    assert p.trim() == 2 * MiB
    s = p.stats()
    assert (s.reserved_bytes, s.num_shrinks, s.shrunk_bytes) == (MiB, 1, 2 * MiB)


def test_peak_reserved_survives_a_trim():
    p = _pool()
    p.free(p.allocate(2 * MiB))
    p.trim()
    assert (p.stats().reserved_bytes, p.stats().peak_reserved_bytes) == (0, 2 * MiB)


# ---------------------------------------------------------------------------- records
def test_round_up():
    assert [round_up(n, 512) for n in (1, 512, 513, 1024)] == [512, 512, 1024, 1024]


def test_allocation_offset_and_live():
    a = Allocation(10, 512, ((4096, 512),))
    assert (a.offset, a.live) == (4096, False)
    a.owner = object()
    assert a.live


def test_segment_end():
    assert Segment(offset=4096, nbytes=1024).end == 5120


def _stats(free_bytes, largest_free_bytes):
    zero = {f: 0 for f in PoolStats.__dataclass_fields__}
    return PoolStats(
        **{
            **zero,
            "free_bytes": free_bytes,
            "largest_free_bytes": largest_free_bytes,
            "capacity_bytes": None,
        }
    )


def test_frag_ext_is_one_minus_largest_over_free():
    assert _stats(4096, 1024).frag_ext == 0.75


def test_frag_ext_is_zero_when_nothing_is_free():
    assert _stats(0, 0).frag_ext == 0.0


def test_as_dict_carries_frag_ext():
    d = _stats(4096, 4096).as_dict()
    assert d["frag_ext"] == 0.0 and d["free_bytes"] == 4096


def test_default_free_extents_is_not_implemented():
    class Bare(SegmentPerRequest):
        free_extents = Policy.free_extents

    with pytest.raises(NotImplementedError):
        Bare().free_extents()


def test_default_largest_free_is_the_largest_free_extent():
    p = _pool()
    p.grow(MiB)
    p.grow(3 * MiB)
    assert Policy.largest_free_bytes(p) == 3 * MiB


def test_a_request_above_the_devices_max_bytes_fails_before_any_work():
    device = VirtualDevice(max_bytes=64 * MiB)
    pool = _pool(device=device)
    keep = pool.allocate(MiB)
    before = pool.stats()
    assert pool.allocate(64 * MiB + 1) is None and pool.grow(64 * MiB + 1) is False
    after = pool.stats()
    assert after.num_failures == 1 and (after.reserved_bytes, device.used_bytes) == (MiB, MiB)
    assert after.num_grows == before.num_grows and keep.live
    assert pool.allocate(64 * MiB) is not None  # the limit itself is allowed


def test_the_default_device_limit_is_far_above_any_gpu_and_far_below_2_62():
    from policies.device import MAX_DEVICE_BYTES

    assert 1 << 40 < MAX_DEVICE_BYTES < 1 << 62
    assert _pool().allocate(2**64) is None
