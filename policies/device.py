"""The upstream a pool reserves segments from: ``cudaMalloc``/``cudaFree`` in the abstract.

A ``Device`` hands out address ranges and accounts for the driver time its calls take.
``VirtualDevice`` (the default) invents addresses for free; ``sim.replay.costs.CostedDevice``
charges each call its modelled driver time and ``realgpu``'s devices make real
``cudaMalloc``/``cudaFree`` calls, mapping each segment's offset to a device pointer.

Driver time is part of the protocol, so no caller needs to know which device it holds:

- ``take_driver_ns()``: driver time accrued since the last call that the caller's own clock
  did not see, and reset it. A modelled device returns what it charged; a free device and a
  real one return 0 (a real call runs inside the caller's timed region already).
- ``driver_ns_total``: all driver time since the device was made, modelled or measured (the
  report's ``driver_ns_total`` column).
- ``driver_clock``: the ``DriverClock`` whose ``take()`` is ``take_driver_ns()``, declared by a
  device that keeps its pending time in one clock (None: it does not, e.g. a page-mapped device
  over a physical one keeps two). The replay loop then reads the clock's ``pending_ns``, an
  attribute, instead of calling ``take_driver_ns`` after every call
  (``sim.replay.engine.policy_target``); a device without it gets the same results through the
  calls.
- ``device_kind``: what kind of device it is (``policies.device_kind.DeviceKind``: segments or
  mapped pages), the report's ``device_kind`` column for a real device.

- ``call_stats()``: the report's per-call device columns (``VMM_STAT_KEYS``): virtual-memory
  calls and bytes. A segment device makes no such call and returns zeros (``vmm_stats()``).

The page-mapped device (``policies.mapped_device``: ``cuMemCreate``/``cuMemMap``, virtual memory)
implements the same protocol: ``reserve``/``release`` give a range mapped whole, and its own
calls (``address_reserve``, ``create``, ``map``, ``set_access``, ``unmap``, ``release_handle``)
charge the same ``DriverClock``, so ``take_driver_ns``/``driver_ns_total`` cover mapping with no
change to the replay engine, the simulator's ``TimedPool`` or the report.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from policies.device_kind import DeviceKind
from policies.units import round_up

__all__ = [
    "Device",
    "VirtualDevice",
    "DriverClock",
    "UnmodelledDriver",
    "ClockedDriver",
    "DeviceInFront",
    "SEGMENT_ALIGNMENT_BYTES",
    "MAX_DEVICE_BYTES",
    "VMM_STAT_KEYS",
    "vmm_stats",
    "NO_DRIVER_TIME",
]

#: Segments start on 2 MiB boundaries, the granularity CUDA's driver maps memory in.
SEGMENT_ALIGNMENT_BYTES = 2 << 20

#: The most bytes a device model can hold: 4 TiB, four times the largest GPU announced (1 TB of
#: HBM), yet far below 2**62, where offsets would soon overflow 64-bit addresses.
#: A request above a device's ``max_bytes`` is refused before a policy does any work.
MAX_DEVICE_BYTES = 4 << 40


#: The device columns of the report: ``cuMemMap``/``cuMemUnmap`` calls, bytes mapped in total,
#: the peak of reserved virtual address space, and modelled or measured driver time per VMM call.
VMM_STAT_KEYS = (
    "n_map",
    "n_unmap",
    "mapped_bytes",
    "peak_virtual_bytes",
    "driver_ns_address_reserve",
    "driver_ns_create",
    "driver_ns_map",
    "driver_ns_set_access",
    "driver_ns_unmap",
    "driver_ns_release",
    "driver_ns_address_free",
)


def vmm_stats(
    *,
    num_maps: int = 0,
    num_unmaps: int = 0,
    mapped_bytes: int = 0,
    peak_virtual_bytes: int = 0,
    call_ns: dict[str, int] | None = None,
) -> dict[str, int]:
    """``call_stats()``'s dict, every ``VMM_STAT_KEYS`` key present (zeros by default)."""
    out = {
        "n_map": num_maps,
        "n_unmap": num_unmaps,
        "mapped_bytes": mapped_bytes,
        "peak_virtual_bytes": peak_virtual_bytes,
    }
    for key in VMM_STAT_KEYS[4:]:
        out[key] = (call_ns or {}).get(key[len("driver_ns_") :], 0)
    return out


@runtime_checkable
class Device(Protocol):
    """Hands out segments; ``max_bytes`` is the largest request it could ever hold
    (``MAX_DEVICE_BYTES`` for the built-in ones): policies refuse larger ones up front."""

    max_bytes: int
    #: the clock ``take_driver_ns`` takes from, or None (see the module docstring)
    driver_clock: "DriverClock | None"
    #: segments or mapped pages (``policies.device_kind``)
    device_kind: DeviceKind

    def reserve(self, nbytes: int) -> int | None:
        """Reserve ``nbytes``; return the segment's offset in the pool address space, or None."""

    def release(self, offset: int, nbytes: int) -> None:
        """Give back a segment returned by ``reserve``."""

    def take_driver_ns(self) -> int:
        """Driver time since the last call that the caller's clock did not see; resets it to 0."""

    @property
    def driver_ns_total(self) -> int:
        """All driver time since the device was made (modelled or measured)."""

    def copy_ns(self, nbytes: int) -> int:
        """Modelled time of a device-to-device copy of ``nbytes`` (a compaction move); 0 when
        copies are not modelled (free, or real and measured by whoever copies)."""

    def call_stats(self) -> dict[str, int]:
        """Virtual-memory call counts, bytes and time (``VMM_STAT_KEYS``); zeros for a segment
        device."""


class UnmodelledDriver:
    """The driver-time half of ``Device`` for a segment device that models no cost: always 0.

    ``VirtualDevice`` and the replay's address-handing devices inherit it. Its ``driver_clock``
    is ``NO_DRIVER_TIME``, never charged; a subclass that takes driver time its own way
    (overrides ``take_driver_ns``) declares its own ``driver_clock``, or has None by default
    (``__init_subclass__``): an inherited declaration must never outlive the method it describes.
    """

    driver_ns_total = 0
    max_bytes = MAX_DEVICE_BYTES
    device_kind = DeviceKind.SEGMENT

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "take_driver_ns" in cls.__dict__ and "driver_clock" not in cls.__dict__:
            cls.driver_clock = None

    def take_driver_ns(self) -> int:
        return 0

    def copy_ns(self, nbytes: int) -> int:
        return 0

    def call_stats(self) -> dict[str, int]:
        return vmm_stats()


class DeviceInFront:
    """The accounting half of ``Device`` for a device that stands in front of another
    (``inner``) and hands out its addresses its own way: driver time, per-call stats and the
    size limit are the inner device's. Subclasses write ``reserve``/``release``."""

    inner: Device

    @property
    def max_bytes(self) -> int:
        return self.inner.max_bytes

    @property
    def driver_clock(self) -> "DriverClock | None":
        return getattr(
            self.inner, "driver_clock", None
        )  # a third-party device may predate the declaration

    @property
    def device_kind(self) -> DeviceKind:
        return self.inner.device_kind

    def take_driver_ns(self) -> int:
        return self.inner.take_driver_ns()

    @property
    def driver_ns_total(self) -> int:
        return self.inner.driver_ns_total

    def copy_ns(self, nbytes: int) -> int:
        return self.inner.copy_ns(nbytes)

    def call_stats(self) -> dict[str, int]:
        return self.inner.call_stats()


class DriverClock:
    """The driver-time ledger a device keeps: what is pending for the caller, and the total.

    ``charge(ns, pending=...)``: ``pending=True`` for modelled time (the caller adds it to its
    latency sample through ``take_driver_ns``), False for time measured around a real call
    (already inside the caller's timed region: it only counts towards the total).
    """

    __slots__ = ("pending_ns", "total_ns")

    def __init__(self) -> None:
        self.pending_ns = 0
        self.total_ns = 0

    def charge(self, ns: int, *, pending: bool) -> None:
        self.total_ns += ns
        if pending:
            self.pending_ns += ns

    def take(self) -> int:
        ns, self.pending_ns = self.pending_ns, 0
        return ns


class ClockedDriver:
    """The driver-time half of ``Device`` for a device that keeps all its driver time in one
    ``DriverClock``, ``self.clock`` (charged by its own ``reserve``/``release``): the three
    accessors, defined once (``sim.replay.costs.CostedDevice`` charges modelled time pending,
    ``realgpu.segments.SegmentDevice`` measured time not pending)."""

    clock: DriverClock

    def take_driver_ns(self) -> int:
        """Driver time accrued since the last call that the caller's clock did not see; resets
        it."""
        return self.clock.take()

    @property
    def driver_clock(self) -> DriverClock:
        """The clock ``take_driver_ns`` takes from (the ``Device`` protocol's declaration)."""
        return self.clock

    @property
    def driver_ns_total(self) -> int:
        return self.clock.total_ns


#: The clock of a device that models no driver time: nothing ever charges it (``UnmodelledDriver``).
NO_DRIVER_TIME = DriverClock()
UnmodelledDriver.driver_clock = NO_DRIVER_TIME


class VirtualDevice(UnmodelledDriver):
    """An address space with no memory behind it, and no driver time.

    Offsets only grow and a 2 MiB gap separates segments, so two segments are never adjacent
    (a policy cannot silently coalesce across them) and a released address is never reused
    (a stale allocation can never alias a new one).

    Args:
        limit_bytes: optional device memory size; ``reserve`` returns None past it.
        max_bytes: the largest request any pool on this device may make (see ``MAX_DEVICE_BYTES``).
    """

    def __init__(self, limit_bytes: int | None = None, max_bytes: int = MAX_DEVICE_BYTES):
        self.limit_bytes = limit_bytes
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._next_offset = SEGMENT_ALIGNMENT_BYTES

    def reserve(self, nbytes: int) -> int | None:
        if self.limit_bytes is not None and self.used_bytes + nbytes > self.limit_bytes:
            return None
        offset = self._next_offset
        span = round_up(nbytes, SEGMENT_ALIGNMENT_BYTES)
        self._next_offset = offset + span + SEGMENT_ALIGNMENT_BYTES
        self.used_bytes += nbytes
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        self.used_bytes -= nbytes
