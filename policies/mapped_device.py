"""A page-mapped device: CUDA's virtual memory management (``cuMem*``) in the abstract.

Where a segment device (``policies.device``) hands out ranges that are physical memory from the
start (``cudaMalloc``), this one separates the two, as the driver does:

- **address space**: ``address_reserve(nbytes)`` / ``address_free`` (``cuMemAddressReserve`` /
  ``cuMemAddressFree``) take virtual ranges. They cost microseconds and no physical memory, so a
  pool can reserve far more than the GPU holds and grow in place.
- **physical pages**: ``create(nbytes)`` (``cuMemCreate``) makes a physical allocation of a
  multiple of the granularity; ``map(offset, handle)`` (``cuMemMap``) puts it at an address in a
  reserved range; ``set_access(offset, nbytes)`` (``cuMemSetAccess``) makes mapped pages usable (one
  call may cover many pages); ``unmap(offset, nbytes)`` (``cuMemUnmap``) and
  ``release_handle(handle)`` (``cuMemRelease``; ``release`` is the segment protocol's) undo them. A
  handle may be mapped at several addresses (GMLake's stitching).

Capacity counts **physical** bytes (created and not yet released): ``create`` returns None past
``limit_bytes``. Virtual bytes are reported apart (``peak_virtual_bytes``).

The two composite calls the policies use are ``map_new(offset, nbytes, page_bytes)`` (create and
map one handle per page, then one set-access over the range: what PyTorch's expandable segments
and kvcached do) and ``unmap_release(offset, nbytes)``. And the device also implements the plain
segment protocol (``reserve``/``release``: a range reserved and fully mapped at once), so every
existing policy runs on it unchanged.

A page-mapped device may take its physical memory from a segment device (``physical=``, or
``as_page_mapped(device)``): each ``create`` is then a ``reserve`` of that device and each
``release_handle`` its ``release``, so a VMM policy handed a plain ``Device`` (a test's
``VirtualDevice`` with a limit) maps pages whose physical bytes that device counts and refuses.

Every call is costed through ``costs.vmm_call_ns(call, nbytes)`` (``sim.replay.costs.CostModel`` has
a table for each of ``VMM_CALLS``; None: free) and counted per call; ``call_stats()`` gives the
report's columns. ``realgpu`` implements the same calls with ``cuda.bindings.driver``.
"""

from __future__ import annotations

from typing import Protocol

from sortedcontainers import SortedDict

from policies.device import (
    MAX_DEVICE_BYTES,
    SEGMENT_ALIGNMENT_BYTES,
    Device,
    DriverClock,
    vmm_stats,
)
from policies.device_kind import DeviceKind
from policies.errors import PolicyError
from traces.knobs import check_int
from policies.units import format_bytes, round_up

__all__ = ["PageMappedDevice", "VmmCosts", "VMM_CALLS", "MAX_VIRTUAL_BYTES", "as_page_mapped"]

#: The driver calls a page-mapped device makes, in the order a grow makes them.
VMM_CALLS = ("address_reserve", "create", "map", "set_access", "unmap", "release", "address_free")

#: Virtual address space a device hands out: 2**47 B (128 TiB), what x86-64 user space and CUDA's
#: unified addressing leave a process.
MAX_VIRTUAL_BYTES = 1 << 47


class VmmCosts(Protocol):
    def vmm_call_ns(self, call: str, nbytes: int) -> int:
        """Modelled time of one ``call`` (one of ``VMM_CALLS``) over ``nbytes``."""


class PageMappedDevice:
    """Virtual ranges with physical pages mapped into them on demand.

    Args:
        granularity_bytes: the driver's allocation granularity (2 MiB on the H200); every
            reserve, create and map is a multiple of it.
        limit_bytes: physical memory the device holds; None for no limit.
        costs: per-call driver time (``VmmCosts``); None charges nothing.
        virtual_limit_bytes: address space it can hand out.
        physical: a segment device the physical pages come from (one ``reserve`` per
            ``create``); None: the pages are this device's own.

    Mappings are kept in a ``SortedDict`` by address: range queries (``unmap``, ``mapped_in``)
    bisect to the first mapping in O(log n) and walk only the ones inside the range.
    """

    device_kind = DeviceKind.PAGE_MAPPED

    def __init__(
        self,
        *,
        granularity_bytes: int = SEGMENT_ALIGNMENT_BYTES,
        limit_bytes: int | None = None,
        costs: VmmCosts | None = None,
        virtual_limit_bytes: int = MAX_VIRTUAL_BYTES,
        physical: Device | None = None,
    ):
        check_int("granularity_bytes", granularity_bytes, error=PolicyError)
        self.granularity_bytes = granularity_bytes
        self.limit_bytes = limit_bytes
        self.costs = costs
        self.virtual_limit_bytes = virtual_limit_bytes
        self.physical = physical
        self.max_bytes = physical.max_bytes if physical is not None else MAX_DEVICE_BYTES
        self._physical_offset: dict[int, int] = {}  # handle -> its offset on ``physical``
        self.clock = DriverClock()
        self.num_calls = dict.fromkeys(VMM_CALLS, 0)
        self.call_ns = dict.fromkeys(VMM_CALLS, 0)
        self._ranges: SortedDict = (
            SortedDict()
        )  # reserved virtual range: offset -> bytes (bisected by range_of)
        self._mappings: SortedDict = SortedDict()  # offset -> (handle, bytes)
        self._handles: dict[int, int] = {}  # live physical handle -> bytes
        self._handle_maps: dict[int, int] = {}  # handle -> number of addresses it is mapped at
        self._next_handle = 1
        self._next_offset = granularity_bytes
        self.physical_bytes = self.peak_physical_bytes = 0
        self.virtual_bytes = self.peak_virtual_bytes = 0
        self.mapped_bytes_total = (
            0  # bytes mapped over the device's life (a page mapped twice counts twice)
        )
        self.used_bytes = 0  # the segment protocol's name for physical bytes held

    # ------------------------------------------------------------------ accounting
    def _charge(self, call: str, nbytes: int, *, piece_bytes: list[int] | None = None) -> None:
        """Count one ``call``; with costs, charge its modelled time: of ``nbytes``, or the sum
        over ``piece_bytes`` for a call whose time grows with the mappings it covers."""
        self.num_calls[call] += 1
        if self.costs is not None:
            if piece_bytes is None:
                ns = self.costs.vmm_call_ns(call, nbytes)
            else:
                ns = sum(self.costs.vmm_call_ns(call, n) for n in piece_bytes)
            self.call_ns[call] += ns
            self.clock.charge(ns, pending=True)

    def take_driver_ns(self) -> int:
        ns = self.clock.take()
        return ns + self.physical.take_driver_ns() if self.physical is not None else ns

    @property
    def driver_ns_total(self) -> int:
        return self.clock.total_ns + (
            self.physical.driver_ns_total if self.physical is not None else 0
        )

    @property
    def driver_clock(self) -> DriverClock | None:
        """``clock``, whose ``take()`` is ``take_driver_ns()``; None over a physical device (two
        clocks)."""
        return self.clock if self.physical is None else None

    def copy_ns(self, nbytes: int) -> int:
        return 0

    def call_stats(self) -> dict[str, int]:
        """The report's device columns (``policies.device.VMM_STAT_KEYS``)."""
        return vmm_stats(
            num_maps=self.num_calls["map"],
            num_unmaps=self.num_calls["unmap"],
            mapped_bytes=self.mapped_bytes_total,
            peak_virtual_bytes=self.peak_virtual_bytes,
            call_ns=self.call_ns,
        )

    def _check_aligned(self, what: str, offset: int, nbytes: int) -> None:
        g = self.granularity_bytes
        if nbytes <= 0 or offset % g or nbytes % g:
            raise PolicyError(
                f"{what}(offset={offset}, nbytes={nbytes}): "
                f"both must be multiples of the {format_bytes(g)} granularity, nbytes > 0"
            )

    # ------------------------------------------------------------------ address space
    def address_reserve(self, nbytes: int) -> int | None:
        """Reserve a virtual range of ``nbytes`` (rounded up to the granularity); None past the
        address space. One granule of gap keeps two ranges from ever touching."""
        span = round_up(nbytes, self.granularity_bytes)
        if self.virtual_bytes + span > self.virtual_limit_bytes:
            return None
        self._charge("address_reserve", span)
        offset = self._next_offset
        self._next_offset = offset + span + self.granularity_bytes
        self._ranges[offset] = span
        self.virtual_bytes += span
        if self.virtual_bytes > self.peak_virtual_bytes:
            self.peak_virtual_bytes = self.virtual_bytes
        return offset

    def address_free(self, offset: int, nbytes: int) -> None:
        span = self._ranges.get(offset)
        if span is None or span != round_up(nbytes, self.granularity_bytes):
            raise PolicyError(f"address_free({offset}, {nbytes}): no such reserved range")
        if self.mapped_in(offset, span):
            raise PolicyError(
                f"address_free({offset}, {nbytes}): pages are still mapped in the range"
            )
        self._charge("address_free", span)
        del self._ranges[offset]
        self.virtual_bytes -= span

    def range_of(self, offset: int) -> tuple[int, int] | None:
        """The reserved range ``(start, bytes)`` that holds ``offset``, or None."""
        i = self._ranges.bisect_right(offset) - 1
        if i < 0:
            return None
        start, span = self._ranges.peekitem(i)
        return (start, span) if offset < start + span else None

    # ------------------------------------------------------------------ physical pages
    def create(self, nbytes: int) -> int | None:
        """A physical allocation of ``nbytes`` (a multiple of the granularity); None past the
        limit (the refused call is charged too, as a failed ``cuMemCreate`` costs one)."""
        self._check_aligned("create", 0, nbytes)
        self._charge("create", nbytes)
        if self.limit_bytes is not None and self.physical_bytes + nbytes > self.limit_bytes:
            return None
        if self.physical is not None:
            where = self.physical.reserve(nbytes)
            if where is None:
                return None
            self._physical_offset[self._next_handle] = where
        handle = self._next_handle
        self._next_handle += 1
        self._handles[handle] = nbytes
        self._handle_maps[handle] = 0
        self.physical_bytes += nbytes
        self.used_bytes = self.physical_bytes
        if self.physical_bytes > self.peak_physical_bytes:
            self.peak_physical_bytes = self.physical_bytes
        return handle

    def map(self, offset: int, handle: int) -> None:
        """Map the whole of ``handle`` at ``offset`` inside a reserved range, over no mapping."""
        nbytes = self._handles.get(handle)
        if nbytes is None:
            raise PolicyError(f"map: handle {handle} is not a live physical allocation")
        self._check_aligned("map", offset, nbytes)
        rng = self.range_of(offset)
        if rng is None or offset + nbytes > rng[0] + rng[1]:
            raise PolicyError(
                f"map({offset}, {format_bytes(nbytes)}): not inside one reserved range"
            )
        if self.mapped_in(offset, nbytes):
            raise PolicyError(
                f"map({offset}, {format_bytes(nbytes)}): part of the range is mapped already"
            )
        self._charge("map", nbytes)
        self._mappings[offset] = (handle, nbytes)
        self._handle_maps[handle] += 1
        self.mapped_bytes_total += nbytes

    def set_access(self, offset: int, nbytes: int) -> None:
        """Make the mapped pages of ``[offset, offset + nbytes)`` readable and writable."""
        self._check_aligned("set_access", offset, nbytes)
        if self.mapped_bytes_in(offset, nbytes) != nbytes:
            raise PolicyError(
                f"set_access({offset}, {format_bytes(nbytes)}): the range is not fully mapped"
            )
        # one call, but the driver's time grows with the mappings it covers, not the bytes: on the
        # H200 a set-access over 32 mapped 2 MiB pages took ~35 us a page (the replay on the device,
        # benchmarks/RESULTS.md), a set-access over one 64 MiB mapping 56 us (calibration)
        self._charge(
            "set_access",
            nbytes,
            piece_bytes=[self._mappings[off][1] for off in self._mappings_in(offset, nbytes)],
        )

    def unmap(self, offset: int, nbytes: int) -> list[int]:
        """Unmap every mapping in ``[offset, offset + nbytes)`` (one call per mapping, as PyTorch
        unmaps handle by handle); returns their handles. A mapping that sticks out of the range
        is an error and nothing changes."""
        self._check_aligned("unmap", offset, nbytes)
        inside = self._mappings_in(offset, nbytes)
        end = offset + nbytes
        for off in inside:
            if off + self._mappings[off][1] > end:
                raise PolicyError(
                    f"unmap({offset}, {format_bytes(nbytes)}): the mapping at {off} sticks out"
                )
        handles = []
        for off in inside:
            handle, size = self._mappings.pop(off)
            self._charge("unmap", size)
            self._handle_maps[handle] -= 1
            handles.append(handle)
        return handles

    def release_handle(self, handle: int) -> None:
        """Release a physical allocation (``cuMemRelease``); it must be mapped nowhere."""
        nbytes = self._handles.get(handle)
        if nbytes is None:
            raise PolicyError(f"release: handle {handle} is not a live physical allocation")
        if self._handle_maps[handle]:
            raise PolicyError(f"release: handle {handle} is still mapped")
        self._charge("release", nbytes)
        del self._handles[handle], self._handle_maps[handle]
        if self.physical is not None:
            self.physical.release(self._physical_offset.pop(handle), nbytes)
        self.physical_bytes -= nbytes
        self.used_bytes = self.physical_bytes

    # ------------------------------------------------------------------ queries
    def _mappings_in(self, offset: int, nbytes: int) -> list[int]:
        """Offsets of the mappings that overlap ``[offset, offset + nbytes)``."""
        m = self._mappings
        i = m.bisect_right(offset)
        keys = m.keys()
        found = []
        if i > 0:
            prev = keys[i - 1]
            if prev + m[prev][1] > offset:
                found.append(prev)
        end = offset + nbytes
        while i < len(keys) and keys[i] < end:
            found.append(keys[i])
            i += 1
        return found

    def mapped_in(self, offset: int, nbytes: int) -> bool:
        return bool(self._mappings_in(offset, nbytes))

    def mapped_bytes_in(self, offset: int, nbytes: int) -> int:
        """Bytes of ``[offset, offset + nbytes)`` that are mapped."""
        end = offset + nbytes
        total = 0
        for off in self._mappings_in(offset, nbytes):
            size = self._mappings[off][1]
            total += min(end, off + size) - max(offset, off)
        return total

    def handle_at(self, offset: int) -> int:
        """The physical handle mapped at ``offset`` (the start of a mapping): what a stitch maps
        again."""
        found = self._mappings.get(offset)
        if found is None:
            raise PolicyError(f"handle_at({offset}): no mapping starts there")
        return found[0]

    def map_handles(self, offset: int, handles: list[int]) -> None:
        """Map existing physical ``handles`` one after another from ``offset``, then one
        set-access over them: GMLake's stitch (no ``create``: the memory is there already)."""
        at = offset
        for handle in handles:
            self.map(at, handle)
            at += self._handles[handle]
        self.set_access(offset, at - offset)

    @property
    def num_handles(self) -> int:
        return len(self._handles)

    # ------------------------------------------------------------------ composite calls
    def map_new(self, offset: int, nbytes: int, page_bytes: int | None = None) -> bool:
        """Create and map fresh physical pages over ``[offset, offset + nbytes)``, then one
        set-access over the range. False (and nothing changed, but the refused create charged)
        when the physical limit would be passed."""
        page = page_bytes or self.granularity_bytes
        self._check_aligned("map_new", offset, nbytes)
        self._check_aligned("map_new", 0, page)
        if nbytes % page:
            raise PolicyError(
                f"map_new: {format_bytes(nbytes)} is not a whole number "
                f"of {format_bytes(page)} pages"
            )
        if self.limit_bytes is not None and self.physical_bytes + nbytes > self.limit_bytes:
            self._charge("create", page)  # the first cuMemCreate past the limit fails
            return False
        handles: list[int] = []
        for _ in range(nbytes // page):
            handle = self.create(page)
            if handle is None:  # the physical device refused: give back what was made
                for made in handles:
                    self.release_handle(made)
                return False
            handles.append(handle)
        self.map_handles(offset, handles)
        return True

    def unmap_release(self, offset: int, nbytes: int) -> None:
        """Unmap the mappings in the range and release the handles mapped nowhere else."""
        for handle in self.unmap(offset, nbytes):
            if self._handle_maps[handle] == 0:
                self.release_handle(handle)

    # ------------------------------------------------------------------ segment protocol
    def reserve(self, nbytes: int) -> int | None:
        """A segment: a virtual range of ``nbytes`` (rounded up) mapped at once; None when the
        physical memory is not there (the range is given back)."""
        span = round_up(nbytes, self.granularity_bytes)
        if self.limit_bytes is not None and self.physical_bytes + span > self.limit_bytes:
            return None
        offset = self.address_reserve(span)
        if offset is None:
            return None
        if not self.map_new(offset, span):
            self.address_free(offset, span)
            return None
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        """Give back a segment returned by ``reserve``: unmap, release its pages, free the range."""
        span = round_up(nbytes, self.granularity_bytes)
        self.unmap_release(offset, span)
        self.address_free(offset, span)

    def __repr__(self) -> str:
        return (
            f"<PageMappedDevice physical {format_bytes(self.physical_bytes)} "
            f"of {format_bytes(self.limit_bytes) if self.limit_bytes else 'no limit'}, "
            f"virtual {format_bytes(self.virtual_bytes)}, {len(self._mappings)} mappings>"
        )


def as_page_mapped(device: Device | None) -> PageMappedDevice:
    """``device`` when it maps pages; otherwise a page-mapped device whose physical pages come
    from it (a fresh one for None). What a VMM policy does with the device it is handed, so it
    runs on any ``Device`` and a refusal or a byte count of that device stays true."""
    if isinstance(device, PageMappedDevice):
        return device
    return PageMappedDevice(physical=device)
