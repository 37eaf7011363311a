"""``page-pool``: kvcached's elastic page pool (kvcached, Berkeley Sky lab, 2025).

kvcached backs a serving engine's KV cache with one large virtual range and maps physical pages
(2 MiB by default) into it only as the cache fills, so several models share one GPU and each
holds only the memory it uses. Its ``PageAllocator`` keeps a small reserve of pages that are
*mapped and free* between two watermarks, so that the allocation hot path rarely calls the
driver:

- ``MIN_RESERVED_PAGES`` (5): after an allocation leaves fewer free mapped pages than this,
  more are mapped ahead (kvcached does it on a background thread; here the mapping is charged
  to the allocation that triggered it: the simulator has no second thread);
- ``MAX_RESERVED_PAGES`` (10): a freed page beyond this many free mapped ones is unmapped and
  its physical memory released at once.

A request takes ``ceil(nbytes / page_bytes)`` whole pages, anywhere in the range (one extent
per run of adjacent pages of one batch), free mapped pages first (the most recently freed first, as
kvcached pops its reserve). The pages it still lacks are created and mapped in one batch (one create
and one map per page, one set-access). ``grow(n)`` maps a batch too. Capacity counts mapped
(physical) bytes. The pool's segments are its mapping batches (usually one page); a batch is
unmapped once all its pages are free. ``trim`` unmaps every free page.

Usable on its own and as ``elastic``'s base (``elastic:base=[page-pool]``): elastic then
drives grows and trims from its use watermarks on top of the page reserve. kvcached subdivides
a page into KV blocks of the engine's block size; here the page is the unit handed out (set
``page_bytes`` to the block size you want: any multiple of the device granularity).
"""

from __future__ import annotations

from policies.base import Allocation, Policy, Segment, check_positive_int
from policies.device import Device, DeviceInFront
from policies.device_kind import DeviceKind
from policies.errors import PolicyError
from policies.mapped_device import PageMappedDevice, as_page_mapped
from policies.units import format_bytes

__all__ = ["PagePool", "RangeDevice"]

#: The virtual range a page pool reserves: 1 TiB (address space is free; see ``policies._blocks``).
_RANGE_BYTES = 1 << 40


class RangeDevice(DeviceInFront):
    """The segment protocol over ONE reserved virtual range of a page-mapped device.

    ``reserve(n)`` maps ``n`` bytes of fresh pages at a free place in the range: a single page
    reuses the most recently unmapped slot; a batch goes at the top (above every slot ever
    used) or, when the top has no room left, into a run of free slots; ``release`` unmaps the
    pages and releases their memory, and slots freed at the top lower the top again, so a
    long run does not creep through the address space. Driver time and call counts are the
    page-mapped device's (``mapped``). Free slots are a stack kept as an insertion-ordered
    dict: O(1) per single-page map and per slot freed or taken (a list cost O(free slots) each
    time the top fell, the tenants' long runs' hot spot); the run search (sorting the free
    slots) happens only when the top is full.
    """

    def __init__(self, mapped: PageMappedDevice, page_bytes: int, range_bytes: int = _RANGE_BYTES):
        self.mapped = self.inner = mapped
        self.page_bytes = page_bytes
        self.range_bytes = range_bytes
        self.base = mapped.address_reserve(range_bytes)
        if self.base is None:
            raise PolicyError(
                f"page-pool: the device cannot reserve a {format_bytes(range_bytes)} virtual range"
            )
        self._top = (
            self.base
        )  # slots at or above this are free and were never mapped since the top last fell
        self._free_slots: dict[int, None] = {}  # free slots below the top, most recently freed last

    @property
    def used_bytes(self) -> int:
        return self.mapped.physical_bytes

    def reserve(self, nbytes: int) -> int | None:
        end = self.base + self.range_bytes
        if nbytes == self.page_bytes and self._free_slots:
            offset, where = next(reversed(self._free_slots)), "slot"
        elif self._top + nbytes <= end:
            offset, where = self._top, "top"
        else:
            offset, where = self._free_run(nbytes), "run"
            if offset is None:
                return None
        if not self.mapped.map_new(offset, nbytes, self.page_bytes):
            return None
        if where == "slot":
            del self._free_slots[offset]
        elif where == "top":
            self._top += nbytes
        else:
            for slot in range(offset, offset + nbytes, self.page_bytes):
                del self._free_slots[slot]
        return offset

    def _free_run(self, nbytes: int) -> int | None:
        """The lowest start of ``nbytes / page`` consecutive free slots, or None."""
        need, page = nbytes // self.page_bytes, self.page_bytes
        run_start, run_len, prev = None, 0, None
        for slot in sorted(self._free_slots):
            if prev is not None and slot == prev + page:
                run_len += 1
            else:
                run_start, run_len = slot, 1
            if run_len == need:
                return run_start
            prev = slot
        return None

    def release(self, offset: int, nbytes: int) -> None:
        self.mapped.unmap_release(offset, nbytes)
        if offset + nbytes == self._top:  # the top falls, and with it any free slots just below
            self._top = offset
            free = self._free_slots
            while (
                self._top - self.page_bytes in free
            ):  # every free slot at or above the top is in this run
                self._top -= self.page_bytes
                del free[self._top]
            return
        self._free_slots.update(
            dict.fromkeys(range(offset + nbytes - self.page_bytes, offset - 1, -self.page_bytes))
        )


class PagePool(Policy):
    """Fixed-size pages mapped on demand into one virtual range, with a reserve of free mapped
    pages held between ``min_free_pages`` and ``max_free_pages`` (kvcached).

    Args:
        page_bytes: the page (a multiple of the device granularity; kvcached: 2 MiB).
        min_free_pages: low watermark: pages mapped ahead after an allocation (kvcached's
            ``MIN_RESERVED_PAGES``, 5); 0 maps only on demand.
        max_free_pages: high watermark: free mapped pages beyond this are unmapped when freed
            (``MAX_RESERVED_PAGES``, 10).
        capacity_bytes: most physical bytes mapped; None for no limit.
        device: a page-mapped device (a segment device given is wrapped,
            ``policies.mapped_device.as_page_mapped``); ``self.device`` is the pool's
            ``RangeDevice`` over it.

    Free mapped pages are an insertion-ordered dict (page offset -> its batch): the newest is
    popped in O(1) and a page of a batch being unmapped is dropped in O(1).
    """

    name = "page-pool"
    device_kind = DeviceKind.PAGE_MAPPED
    contiguous = False
    page_size_knob = "page_bytes"

    def __init__(
        self,
        *,
        page_bytes: int = 2 << 20,
        min_free_pages: int = 5,
        max_free_pages: int = 10,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        check_positive_int("page_bytes", page_bytes)
        check_positive_int("min_free_pages", min_free_pages, minimum=0)
        check_positive_int("max_free_pages", max_free_pages, minimum=0)
        if min_free_pages > max_free_pages:
            raise PolicyError(
                f"page-pool watermarks need min_free_pages(={min_free_pages}) "
                f"<= max_free_pages(={max_free_pages})"
            )
        mapped = as_page_mapped(device)
        if page_bytes % mapped.granularity_bytes:
            raise PolicyError(
                f"page_bytes(={page_bytes}) must be a multiple of the device granularity "
                f"({format_bytes(mapped.granularity_bytes)})"
            )
        self.page_bytes = page_bytes
        self.min_free_pages = min_free_pages
        self.max_free_pages = max_free_pages
        self.page_size_bytes = page_bytes
        super().__init__(
            capacity_bytes=capacity_bytes,
            device=RangeDevice(mapped, page_bytes, max(_RANGE_BYTES, capacity_bytes or 0)),
        )

    # ----------------------------------------------------------------- pages
    def _map_batch(self, num_pages: int, stream: int) -> Segment | None:
        """Map ``num_pages`` fresh pages as one batch (a segment); their pages join the free
        reserve. None when capacity or the device refuses (nothing changes)."""
        seg = self._reserve_segment(num_pages * self.page_bytes, stream, retry=False)
        if seg is not None:
            self._add_segment(seg)
        return seg

    def _unmap_free_batches(self, keep_pages: int) -> int:
        """Unmap fully free batches, smallest first, while more than ``keep_pages`` pages stay
        free and the batch fits in the excess; returns the bytes released."""
        released = 0
        page = self.page_bytes
        for seg in sorted(self._idle.values(), key=lambda s: (s.nbytes, -s.offset)):
            if len(self._free_pages) - seg.nbytes // page < keep_pages:
                continue
            released += self._drop(seg)
        return released

    def _drop(self, seg: Segment) -> int:
        free = self._free_pages
        for off in range(seg.offset, seg.end, self.page_bytes):
            del free[off]
        del self._idle[seg.offset]
        self._release_segment(seg)
        return seg.nbytes

    def pool_stats(self) -> dict[str, int]:
        """Free mapped pages now (the reserve) and pages mapped ahead by the low watermark."""
        return {
            "num_free_pages": len(self._free_pages),
            "num_prefetched_pages": self.num_prefetched_pages,
        }

    # ----------------------------------------------------------------- Policy hooks
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        page = self.page_bytes
        num_pages = -(-nbytes // page)
        free = self._free_pages
        lacking = num_pages - len(free)
        if lacking > 0:
            if (
                self.capacity_bytes is not None
                and self.reserved_bytes + lacking * page > self.capacity_bytes
            ):
                return None
            if self._map_batch(lacking, stream) is None:
                return None
        extents: list[tuple[int, int]] = []
        pages: list[int] = []
        idle = self._idle
        for _ in range(num_pages):
            off, seg = free.popitem()
            if seg.num_live == 0:
                del idle[seg.offset]
            seg.num_live += 1
            pages.append(off)
        page_seg, last_seg = self._page_seg, None
        for off in sorted(pages):  # a run of adjacent pages of one batch is one extent
            seg = page_seg[off]
            if seg is last_seg and extents[-1][0] + extents[-1][1] == off:
                extents[-1] = (extents[-1][0], extents[-1][1] + page)
            else:
                extents.append((off, page))
            last_seg = seg
        size = num_pages * page
        self.allocated_bytes += size
        if len(free) < self.min_free_pages and not self._frozen:
            want = self.min_free_pages - len(free)
            if self.capacity_bytes is not None:
                want = min(want, (self.capacity_bytes - self.reserved_bytes) // page)
            for _ in range(
                want
            ):  # one page a batch, so the high watermark can unmap them one by one
                if self._map_batch(1, stream) is None:
                    break
                self.num_prefetched_pages += 1
        return Allocation(nbytes, size, tuple(extents), stream, tag, pages)

    def _free(self, allocation: Allocation) -> None:
        free, idle, page_seg = self._free_pages, self._idle, self._page_seg
        for off in allocation.handle:
            seg = page_seg[off]
            free[off] = seg
            seg.num_live -= 1
            if seg.num_live == 0:
                idle[seg.offset] = seg
        self.allocated_bytes -= allocation.size_bytes
        if len(free) > self.max_free_pages and not self._frozen:
            self._unmap_free_batches(self.max_free_pages)

    def _release_free_segments(self, max_bytes: int | None) -> int:
        released = 0
        for seg in list(self._idle.values()):
            if max_bytes is not None and released >= max_bytes:
                break
            released += self._drop(seg)
        return released

    def _add_segment(self, segment: Segment) -> None:
        for off in range(segment.offset, segment.end, self.page_bytes):
            self._free_pages[off] = segment
            self._page_seg[off] = segment
        self._idle[segment.offset] = segment

    def _release_segment(self, seg: Segment) -> None:
        for off in range(seg.offset, seg.end, self.page_bytes):
            del self._page_seg[off]
        super()._release_segment(seg)

    def _reset_state(self) -> None:
        self._free_pages: dict[
            int, Segment
        ] = {}  # free mapped page -> its batch (insertion order: LIFO)
        self._page_seg: dict[int, Segment] = {}  # every mapped page -> its batch
        self._idle: dict[int, Segment] = {}  # batches with no live page, by offset
        self.num_prefetched_pages = 0

    def _segment_size_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes) * self.page_bytes

    # ----------------------------------------------------------------- inspection
    def free_extents(self) -> list[tuple[int, int]]:
        page = self.page_bytes
        return [(off, page) for off in sorted(self._free_pages)]

    def largest_free_bytes(self) -> int:
        return len(self._free_pages) * self.page_bytes
