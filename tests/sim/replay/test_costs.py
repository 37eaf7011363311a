import json

import pytest

from policies.device import VirtualDevice
from sim.replay.costs import CostedDevice, CostModel


def test_bundled_model_reproduces_field_note_points():
    costs = CostModel.load()
    assert costs.malloc_ns(1 << 20) == pytest.approx(47_000, rel=1e-6)
    assert costs.free_ns(1 << 30) == pytest.approx(658_000, rel=1e-6)


def test_interpolation_is_monotone_between_points():
    costs = CostModel.load()
    sizes = [4096 * 2**k for k in range(0, 20)]
    times = [costs.malloc_ns(s) for s in sizes]
    assert times == sorted(times)
    assert costs.malloc_ns(1 << 20) < costs.malloc_ns(3 << 20) < costs.malloc_ns(64 << 20)


def test_below_smallest_size_costs_the_smallest_measurement():
    costs = CostModel.load()
    assert costs.malloc_ns(512) == costs.malloc_ns(4096)


def test_copy_time_follows_bandwidth():
    costs = CostModel.load()
    assert costs.copy_ns(int(costs.d2d_bytes_per_s)) == pytest.approx(1e9, rel=1e-6)


def test_bad_cost_file_names_file_and_field(tmp_path):
    p = tmp_path / "costs.json"
    table = json.loads(json.dumps(CostModel.load().table))
    table["d2d_bytes_per_s"] = -1
    p.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=r"costs.json: d2d_bytes_per_s"):
        CostModel.load(p)
    p.write_text("{ not json")
    with pytest.raises(ValueError, match=r"costs.json:1: not valid JSON"):
        CostModel.load(p)


def test_costed_device_charges_each_call_once():
    device = CostedDevice(CostModel.load(), VirtualDevice())
    off = device.reserve(1 << 20)
    assert off is not None
    first = device.take_driver_ns()
    assert first == device.costs.malloc_ns(1 << 20)
    assert device.take_driver_ns() == 0
    device.release(off, 1 << 20)
    assert device.take_driver_ns() == device.costs.free_ns(1 << 20)
    assert device.driver_ns_total == first + device.costs.free_ns(1 << 20)


def test_failed_reserve_still_costs_a_call():
    device = CostedDevice(CostModel.load(), VirtualDevice(limit_bytes=1 << 20))
    assert device.reserve(2 << 20) is None
    assert device.take_driver_ns() > 0


def test_every_device_speaks_the_driver_time_protocol():
    from policies.device import Device

    virtual = VirtualDevice()
    assert isinstance(virtual, Device) and isinstance(CostedDevice(), Device)
    off = virtual.reserve(1 << 20)
    virtual.release(off, 1 << 20)
    assert (virtual.take_driver_ns(), virtual.driver_ns_total) == (0, 0)
