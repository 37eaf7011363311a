"""The upstream of a real pool: segments backed by memory, at the simulator's offsets.

A policy sees a ``policies.device.Device``: ``reserve(nbytes) -> offset | None`` and
``release(offset, nbytes)``. ``SegmentDevice`` takes its offsets from a ``VirtualDevice`` (the
simulator's default upstream) and backs each segment with real memory (``cudaMalloc`` in
``realgpu.cuda.CudaDevice``, a host array in ``realgpu.host.HostDevice``). Since the offsets are
exactly the simulator's, the same policy on the same trace makes the same decisions on the
device as in ``sim.replay.trace_replay``: peaks, failures and fragmentation agree to the byte.

Backends implement ``_map``/``_unmap`` (get and give back ``nbytes`` of memory) and the memory
operations the pool's validation mode and replay use (``fill``, ``first_mismatch``, ``touch``).
"""

from __future__ import annotations

import abc
import bisect
import time
from typing import Any

from policies.device import ClockedDriver, DriverClock, UnmodelledDriver, VirtualDevice

__all__ = ["SegmentDevice", "add_range", "remove_range"]


def add_range(starts: list[int], bases: list[int], offset: int, base: int) -> None:
    """Record a range at pool offset ``offset`` whose memory starts at address ``base``: ``starts``
    stays sorted and ``bases[i]`` stays ``starts[i]``'s address (the address tables)."""
    i = bisect.bisect_left(starts, offset)
    starts.insert(i, offset)
    bases.insert(i, base)


def remove_range(starts: list[int], bases: list[int], offset: int) -> int:
    """Forget the range at pool offset ``offset`` (``add_range``'s); returns its address."""
    i = bisect.bisect_left(starts, offset)
    del starts[i]
    return bases.pop(i)


class SegmentDevice(ClockedDriver, UnmodelledDriver, abc.ABC):
    """Address bookkeeping shared by the backends.

    ``_starts`` is a sorted list of segment offsets: a segment lookup is one ``bisect`` (pools
    hold tens of segments, so list insertion beats a tree). ``_bases`` is the list of their
    memory's addresses in the same order (``add_range``): the bisect's index gives the address
    with no dict lookup (``GpuPool.malloc`` makes one for every array). ``_buffers`` maps a
    segment offset to the backend's handle for it.

    Counters: ``num_maps``/``num_unmaps`` real calls, ``driver_ns_total`` the time measured
    around them (the ``Device`` protocol through ``ClockedDriver``; the clock is charged never
    pending, so ``take_driver_ns`` is always 0, since a real call runs
    inside the caller's timed region; copies are measured by ``realgpu.compaction``, not modelled),
    ``used_bytes``/``peak_used_bytes`` memory currently held
    from the backend.
    """

    #: the memory operations' array module name ("numpy" or "cupy"), for reports
    kind: str = ""
    #: the CUDA device the memory lives on (0 on the host)
    device_id: int = 0

    def __init__(self) -> None:
        self._addresses = VirtualDevice()
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}
        self._bases: list[int] = []  # _starts[i]'s address, for each i
        self._buffers: dict[int, Any] = {}
        self.num_maps = 0
        self.num_unmaps = 0
        self.num_refused = 0
        self.clock = DriverClock()
        self.used_bytes = 0
        self.peak_used_bytes = 0

    # ------------------------------------------------------------------ Device protocol
    def reserve(self, nbytes: int) -> int | None:
        t0 = time.perf_counter_ns()
        mapped = self._map(nbytes)
        self.clock.charge(time.perf_counter_ns() - t0, pending=False)
        if mapped is None:
            self.num_refused += 1
            return None
        base, buffer = mapped
        offset = self._addresses.reserve(nbytes)
        assert offset is not None  # the address space itself has no limit
        add_range(self._starts, self._bases, offset, base)
        self._sizes[offset] = nbytes
        self._buffers[offset] = buffer
        self.num_maps += 1
        self.used_bytes += nbytes
        if self.used_bytes > self.peak_used_bytes:
            self.peak_used_bytes = self.used_bytes
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        size = self._sizes.get(offset)
        assert size == nbytes, (
            f"release({offset}, {nbytes}) does not match a reserved segment (size {size})"
        )
        remove_range(self._starts, self._bases, offset)
        del self._sizes[offset]
        buffer = self._buffers.pop(offset)
        t0 = time.perf_counter_ns()
        self._unmap(buffer)
        self.clock.charge(time.perf_counter_ns() - t0, pending=False)
        self._addresses.release(offset, nbytes)
        self.num_unmaps += 1
        self.used_bytes -= nbytes

    # ------------------------------------------------------------------ lookups
    @property
    def num_segments(self) -> int:
        return len(self._starts)

    def locate(self, offset: int) -> tuple[int, int]:
        """``(segment offset, offset within it)`` of a pool offset; AssertionError outside every
        segment."""
        starts = self._starts
        i = bisect.bisect_right(starts, offset) - 1
        assert i >= 0, f"offset {offset} lies below every segment"
        seg = starts[i]
        rel = offset - seg
        assert rel < self._sizes[seg], (
            f"offset {offset} lies past segment [{seg}, {seg + self._sizes[seg]})"
        )
        return seg, rel

    def address(self, offset: int) -> int:
        """The real address (device pointer or host address) of a pool offset."""
        starts = self._starts
        i = bisect.bisect_right(starts, offset) - 1
        return self._bases[i] + offset - starts[i]

    def address_tables(self) -> tuple[list[int], list[int]]:
        """What ``address`` reads: the sorted segment offsets and their real bases in the same
        order, the live lists (mutated in place as segments come and go), for a hot path that
        inlines the
        lookup."""
        return self._starts, self._bases

    def check_range(self, offset: int, nbytes: int) -> None:
        """Assert that ``[offset, offset + nbytes)`` lies inside one segment: two segments are two
        ``cudaMalloc`` blocks, not one range, so a range over both reaches memory outside any
        allocation (policies must not straddle). Every memory operation of the backends checks
        it."""
        seg, rel = self.locate(offset)
        assert rel + nbytes <= self._sizes[seg], (
            f"range [{offset}, {offset + nbytes}) runs past the end of segment [{seg}, "
            f"{seg + self._sizes[seg]}): "
            "the policy handed out memory outside any segment"
        )

    def close(self) -> None:
        """Give back every segment still held (the policy's ``reset`` normally did already)."""
        for offset in list(self._starts):
            self.release(offset, self._sizes[offset])

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _map(self, nbytes: int) -> tuple[int, Any] | None:
        """Get ``nbytes`` of memory: ``(address, handle)``, or None when the backend is out of
        memory."""

    @abc.abstractmethod
    def _unmap(self, buffer: Any) -> None:
        """Give back memory returned by ``_map``."""

    @abc.abstractmethod
    def fill(self, offset: int, nbytes: int, word: int, phase: int) -> None:
        """Write the little-endian 32-bit ``word`` repeatedly over ``[offset, offset + nbytes)``.

        Byte ``k`` of the range gets byte ``(k + phase) % 4`` of ``word``.
        """

    @abc.abstractmethod
    def first_mismatch(self, offset: int, nbytes: int, word: int, phase: int) -> int:
        """Index (from ``offset``) of the first byte that differs from what ``fill`` wrote; -1 if
        none."""

    @abc.abstractmethod
    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        """A copy of ``[offset, offset + nbytes)`` (for error messages)."""

    @abc.abstractmethod
    def touch(self, offset: int, nbytes: int) -> None:
        """Write the first and last few bytes of a range (so an unmapped address would fault)."""

    def synchronize(self) -> None:
        """Wait for queued memory operations (a no-op on the host)."""
