"""``policies.device.ClockedDriver``: the three driver-time accessors of a device that keeps its
time in one ``DriverClock``, defined once and used by the simulator's costed device and the real
segment devices."""

import inspect

import pytest

from policies.device import ClockedDriver, DriverClock, UnmodelledDriver
from realgpu.host import HostDevice
from realgpu.segments import SegmentDevice
from sim.replay.costs import CostedDevice

ACCESSORS = ("take_driver_ns", "driver_clock", "driver_ns_total")


class _Toy(ClockedDriver):
    def __init__(self):
        self.clock = DriverClock()


def test_pending_time_is_taken_once_and_all_time_counts_in_the_total():
    dev = _Toy()
    dev.clock.charge(70, pending=True)
    dev.clock.charge(30, pending=False)  # measured inside the caller's timed region
    assert dev.driver_clock is dev.clock
    assert dev.take_driver_ns() == 70 and dev.take_driver_ns() == 0
    assert dev.driver_ns_total == 100


@pytest.mark.parametrize("cls", [CostedDevice, SegmentDevice, HostDevice])
def test_the_costed_and_the_real_segment_devices_share_the_one_definition(cls):
    for name in ACCESSORS:
        assert inspect.getattr_static(cls, name) is ClockedDriver.__dict__[name], (cls, name)


def test_a_costed_device_charges_pending_time_a_host_one_measured_time():
    costed = CostedDevice()
    costed.reserve(4 << 20)
    ns = costed.take_driver_ns()
    assert ns > 0 and costed.take_driver_ns() == 0 and costed.driver_ns_total == ns
    host = HostDevice()
    offset = host.reserve(4 << 20)
    host.release(offset, 4 << 20)
    assert host.take_driver_ns() == 0 and host.driver_ns_total > 0
    assert host.driver_clock is host.clock and host.driver_clock.pending_ns == 0


def test_a_subclass_taking_time_its_own_way_still_declares_no_clock():
    """``UnmodelledDriver``'s rule holds under the mixin: an inherited declaration never outlives
    the method it describes."""

    class OwnWay(HostDevice):
        def take_driver_ns(self) -> int:
            return 0

    assert OwnWay.driver_clock is None
    assert isinstance(HostDevice(), UnmodelledDriver)  # copy_ns, call_stats, max_bytes from there
