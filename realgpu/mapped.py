"""The page-mapped device on real memory: ``policies.mapped_device`` with a driver behind each call.

``MappedRealDevice`` is a ``PageMappedDevice`` (same bookkeeping, same offsets, same refusals,
same per-call counts: a policy makes the same decisions on it as in the simulator) whose
primitives also make the real call through a ``VmmDriver``:

=================  =========================  ==============================================
call               CUDA (``realgpu.vmm``)     host stand-in (``realgpu.host_vmm``)
=================  =========================  ==============================================
address_reserve    cuMemAddressReserve        mmap PROT_NONE (anonymous, no reserve)
create             cuMemCreate                memfd_create + ftruncate
map                cuMemMap                   mmap MAP_FIXED|MAP_SHARED of the memfd
set_access         cuMemSetAccess             mprotect PROT_READ|PROT_WRITE
unmap              cuMemUnmap                 mmap PROT_NONE MAP_FIXED over it
release            cuMemRelease               close the memfd
address_free       cuMemAddressFree           munmap
=================  =========================  ==============================================

Each offset in a reserved range is a real address: the range's base plus the offset within it,
so a block that spans pages mapped at different times is contiguous memory and validation's
patterns work across page boundaries. Time is measured around each real call only and charged
with ``pending=False`` (it is inside the caller's timed region already), per call in
``call_ns`` (the report's ``driver_ns_*`` columns), so calibration and replay measure the same
thing.

The driver saying "out of memory" is a refusal (``create`` returns None, ``map_new`` False and
undoes what it mapped, ``reserve`` None), as the model refuses past ``limit_bytes``. Any other
driver error raises ``realgpu.errors.VmmDriverError``; misuse (an unaligned map, a release of a
mapped handle) is refused by the bookkeeping before the driver is called (``PolicyError``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

from policies.mapped_device import MAX_VIRTUAL_BYTES, PageMappedDevice
from policies.units import round_up
from realgpu.errors import PoolError
from realgpu.segments import SegmentDevice, add_range, remove_range
from traces.knobs import check_int

__all__ = ["MappedRealDevice", "VmmDriver"]


class VmmDriver(Protocol):
    """The seven driver calls, on real addresses and handles (``realgpu.vmm.CuMemDriver``,
    ``realgpu.host_vmm.HostMmapDriver``). ``None`` from a reserve or create means out of
    (address space or physical) memory; any other failure raises ``VmmDriverError``."""

    granularity_bytes: int

    def address_reserve(self, nbytes: int) -> int | None: ...
    def address_free(self, address: int, nbytes: int) -> None: ...
    def create(self, nbytes: int) -> Any: ...
    def map(self, address: int, nbytes: int, handle: Any) -> None: ...
    def set_access(self, address: int, nbytes: int) -> None: ...
    def unmap(self, address: int, nbytes: int) -> None: ...
    def release(self, handle: Any) -> None: ...
    def close(self) -> None: ...


class MappedRealDevice(PageMappedDevice):
    """A ``PageMappedDevice`` whose calls are real (see the module docstring).

    Args:
        driver: the ``VmmDriver``.
        granularity_bytes: the model's granularity; a multiple of the driver's (default: the
            driver's).
        limit_bytes: physical bytes the model lets be created (None: as many as the driver gives).
        virtual_limit_bytes: address space the model hands out.

    ``_starts`` is the sorted list of reserved ranges' offsets: turning an offset into an address
    is one ``bisect`` (pools hold few ranges), and ``_bases`` lists their real bases in the same
    order (``realgpu.segments.add_range``).
    """

    #: the memory operations' array module name ("numpy" or "cupy"), set by the memory mixin
    kind: str = ""
    device_id: int = 0

    def __init__(
        self,
        driver: VmmDriver,
        *,
        granularity_bytes: int | None = None,
        limit_bytes: int | None = None,
        virtual_limit_bytes: int = MAX_VIRTUAL_BYTES,
    ):
        g = driver.granularity_bytes if granularity_bytes is None else granularity_bytes
        check_int(
            "granularity_bytes",
            g,
            low=driver.granularity_bytes,
            multiple_of=driver.granularity_bytes,
            error=PoolError,
        )  # the driver's allocation granularity
        super().__init__(
            granularity_bytes=g,
            limit_bytes=limit_bytes,
            costs=None,
            virtual_limit_bytes=virtual_limit_bytes,
        )
        self.driver = driver
        self._starts: list[int] = []
        self._bases: list[int] = []  # _starts[i]'s real base, for each i
        self._sizes = self._ranges  # reserved range offset -> bytes (the model's own dict)
        self._physical: dict[int, Any] = {}  # the model's handle -> the driver's
        self.num_creates = 0  # physical allocations the driver made (the replay's device_mallocs)
        self.num_releases = 0
        self.num_refused = 0  # creates the driver refused (out of memory)
        self.sync_ns_total = (
            0  # waiting for queued work before unmapping (not a driver call's time)
        )

    # ------------------------------------------------------------------ timing
    def _timed(self, call: str, fn: Callable, *args: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = fn(*args)
        ns = time.perf_counter_ns() - t0
        self.call_ns[call] += ns
        self.clock.charge(ns, pending=False)
        return out

    # ------------------------------------------------------------------ address space
    def address_reserve(self, nbytes: int) -> int | None:
        span = round_up(nbytes, self.granularity_bytes)
        if self.virtual_bytes + span > self.virtual_limit_bytes:
            return super().address_reserve(span)  # the model's refusal
        base = self._timed("address_reserve", self.driver.address_reserve, span)
        if base is None:
            self.num_calls["address_reserve"] += 1
            return None
        offset = super().address_reserve(span)
        add_range(self._starts, self._bases, offset, base)
        return offset

    def address_free(self, offset: int, nbytes: int) -> None:
        super().address_free(offset, nbytes)
        base = remove_range(self._starts, self._bases, offset)
        self._timed(
            "address_free", self.driver.address_free, base, round_up(nbytes, self.granularity_bytes)
        )

    # ------------------------------------------------------------------ physical pages
    def create(self, nbytes: int) -> int | None:
        self._check_aligned("create", 0, nbytes)
        if self.limit_bytes is not None and self.physical_bytes + nbytes > self.limit_bytes:
            return super().create(nbytes)  # the model's refusal
        real = self._timed("create", self.driver.create, nbytes)
        if real is None:
            self.num_calls["create"] += 1
            self.num_refused += 1
            return None
        handle = super().create(nbytes)
        self._physical[handle] = real
        self.num_creates += 1
        return handle

    def map(self, offset: int, handle: int) -> None:
        super().map(offset, handle)
        self._timed(
            "map",
            self.driver.map,
            self.address(offset),
            self._handles[handle],
            self._physical[handle],
        )

    def set_access(self, offset: int, nbytes: int) -> None:
        super().set_access(offset, nbytes)
        self._timed("set_access", self.driver.set_access, self.address(offset), nbytes)

    def unmap(self, offset: int, nbytes: int, *, wait: bool = True) -> list[int]:
        """The model's ``unmap``, then the driver's, after waiting for queued work unless ``wait``
        is False (the caller knows the range's work is done: an event it recorded has completed)."""
        pieces = [(off, self._mappings[off][1]) for off in self._mappings_in(offset, nbytes)]
        handles = super().unmap(offset, nbytes)
        if pieces and wait:
            # queued kernels may still use the pages: cuMemUnmap does not wait for them (PyTorch
            # synchronizes before unmapping for the same reason)
            t0 = time.perf_counter_ns()
            self.synchronize()
            self.sync_ns_total += time.perf_counter_ns() - t0
        for off, size in pieces:
            self._timed("unmap", self.driver.unmap, self.address(off), size)
        return handles

    def release_handle(self, handle: int) -> None:
        super().release_handle(handle)
        self._timed("release", self.driver.release, self._physical.pop(handle))
        self.num_releases += 1

    # ---------------------------------------------------------------- the replay's device interface
    @property
    def num_maps(self) -> int:
        """Physical allocations made (``cuMemCreate``): what a segment device's ``cudaMalloc`` count
        is."""
        return self.num_creates

    @property
    def num_unmaps(self) -> int:
        return self.num_releases

    @property
    def num_segments(self) -> int:
        return len(self._starts)

    # a reserved range plays a segment's part in the lookups: ``_starts``, ``_sizes`` and ``_bases``
    # mean the same here, so the segment device's bisecting code serves both
    locate = SegmentDevice.locate
    address = SegmentDevice.address
    address_tables = SegmentDevice.address_tables

    def check_range(self, offset: int, nbytes: int) -> None:
        """Assert that ``[offset, offset + nbytes)`` is mapped (touching it otherwise would fault
        the process on the host, and the context on the GPU): ``SegmentDevice.check_range``'s part
        here, which every memory operation of the backends calls."""
        mapped = self.mapped_bytes_in(offset, nbytes)
        assert mapped == nbytes, (
            f"[{offset}, {offset + nbytes}) is not fully mapped ({mapped:,} of {nbytes:,} B): "
            "the policy handed out memory it had not mapped"
        )

    def synchronize(self) -> None:
        """Wait for queued memory operations (the memory mixin's)."""

    def close(self) -> None:
        """Unmap every mapping, release every physical allocation and free every range, then
        let the driver go. A policy's ``reset`` normally gave most of it back already."""
        for start in list(self._starts):
            self.unmap(start, self._ranges[start])
        for handle in list(self._handles):
            self.release_handle(handle)
        for start in list(self._starts):
            self.address_free(start, self._ranges[start])
        self.driver.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} on {self.kind}: {super().__repr__()[1:-1]}>"
