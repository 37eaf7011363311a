"""``vmm-stitch``: GMLake's virtual-memory stitching (Guo et al., ASPLOS'24) over best fit.

GMLake keeps PyTorch's caching allocator but backs its large blocks with 2 MiB physical chunks
(``cuMemCreate`` each) mapped into virtual ranges: a *primitive block* (pBlock) is a range
whose chunks were created for it. When no free block is large enough, GMLake does not grow:
it maps the chunks of several free pBlocks into a fresh virtual range, a *stitched block*
(sBlock), which the request then uses as one contiguous range. Its allocation steps, followed
here:

1. best fit among free blocks (a larger one is split; the rest stays free);
2. otherwise, for a large request (at least one chunk), stitch: take free whole chunks of the
   stream, largest free run first (GMLake sorts candidate pBlocks by size, largest first, and
   splits the last one so that it takes only what is needed), reserve a virtual range and map
   them there: ``map`` per chunk and one ``set_access``, no ``create`` (``map_handles``);
3. if the free chunks do not add up, create one new pBlock for the shortfall only and stitch
   it with them (GMLake's "insufficient" case), so growth is what the request lacks;
4. a stitched range is kept after its allocation is freed (GMLake's sBlock cache): a later
   stitch of exactly the same chunks reuses it with no driver call. The cache holds at most
   ``max_stitched_ranges`` ranges; the least recently used is unmapped past that, and every
   range over a pBlock is unmapped before that pBlock is released (``trim``).

Model: the pool's segments are the pBlocks (their physical bytes are its reserved bytes; a
stitched range adds address space, ``peak_virtual_bytes``, not memory). A stitched allocation's
``extents`` are the chunks it occupies at their pBlock addresses (so it is not ``contiguous``
in that space); the contiguous address the caller uses is ``stitched_address(allocation)``.

Simplified from GMLake: small requests (under a chunk) share pBlocks with best fit instead of
a separate small pool; sBlock reuse needs exactly the same chunks, where GMLake also serves a
request from a cached sBlock whose chunks are free and that is larger (best fit over sBlocks);
there is no defragmentation of the sBlock cache beyond its LRU bound.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from policies._blocks import Block
from policies.base import Allocation, Segment, check_positive_int
from policies.best_fit import BestFit
from policies.device import Device
from policies.device_kind import DeviceKind
from policies.errors import PolicyError
from policies.mapped_device import as_page_mapped
from policies.units import round_up

__all__ = ["VmmStitch"]


@dataclass(slots=True, eq=False)
class _Stitched:
    """One stitched virtual range: where it is and the chunks (pBlock addresses) mapped in it."""

    address: int
    nbytes: int
    chunks: tuple[int, ...]


class VmmStitch(BestFit):
    """Best fit over physical chunks that stitches free chunks into a new range instead of growing.

    Args:
        max_stitched_ranges: stitched ranges kept mapped for reuse (GMLake's sBlock cache).
        alignment_bytes: request rounding below a chunk (PyTorch's 512 B).
        capacity_bytes: most physical bytes the pool may hold; None for no limit.
        device: a page-mapped device (``policies.mapped_device``; a segment device given is
            wrapped, its memory backing the chunks).

    Chunks are the device's granularity (2 MiB on the H200); a request of a chunk or more is
    rounded up to whole chunks, a smaller one to ``alignment_bytes`` and served from a 2 MiB
    pBlock. Index: best fit's (per-stream sorted keys); stitched ranges in an ``OrderedDict``
    by chunk tuple, so a reuse is one lookup and the LRU end is its first item.
    """

    name = "vmm-stitch"
    device_kind = DeviceKind.PAGE_MAPPED
    contiguous = False  # a stitched allocation spans chunks of several pBlocks
    #: neither one range (in the pool's space) nor whole pages: the simulator's KV managers know
    #: only those two, and its stitched address is not the pool's (``stitched_address``)
    can_hold_kv = False

    def __init__(
        self,
        *,
        max_stitched_ranges: int = 64,
        alignment_bytes: int = 512,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        check_positive_int("max_stitched_ranges", max_stitched_ranges, minimum=0)
        self.max_stitched_ranges = max_stitched_ranges
        device = as_page_mapped(device)
        super().__init__(
            segment_bytes=device.granularity_bytes,
            alignment_bytes=alignment_bytes,
            capacity_bytes=capacity_bytes,
            device=device,
        )

    # ----------------------------------------------------------------- stitching
    def stitched_address(self, allocation: Allocation) -> int:
        """The contiguous address ``allocation`` is used at: its stitched range, or its offset."""
        handle = allocation.handle
        return handle[0].address if isinstance(handle, tuple) else allocation.offset

    def stitch_stats(self) -> dict[str, int]:
        """Stitches made, stitches served from the cache, and ranges cached now."""
        return {
            "num_stitches": self.num_stitches,
            "num_stitch_reuses": self.num_stitch_reuses,
            "num_stitched_ranges": len(self._stitched),
        }

    def _free_chunks(self, stream: int) -> list[tuple[int, int, Block]]:
        """``(chunk-aligned start, bytes, block)`` of the whole free chunks in each free block of
        ``stream``, largest first (lowest address on ties)."""
        chunk = self.device.granularity_bytes
        runs = []
        for block in self._blocks_by_stream.get(stream, ()):
            start, end = round_up(block.offset, chunk), block.end // chunk * chunk
            if end > start:
                runs.append((start, end - start, block))
        runs.sort(key=lambda r: (-r[1], r[0]))
        return runs

    def _carve(self, block: Block, start: int, nbytes: int) -> Block:
        """Split free ``block`` (indexed) so that ``[start, start + nbytes)`` is a block of its
        own, not indexed; the pieces left over on either side stay free and indexed."""
        self._index_remove(block)
        if start > block.offset:
            left_bytes = start - block.offset
            right = Block(start, block.size - left_bytes, block.segment, block, block.next)
            if block.next is not None:
                block.next.prev = right
            block.next = right
            block.size = left_bytes
            self._index_add(block)
            block = right
        if block.size > nbytes:
            rest = Block(
                block.offset + nbytes, block.size - nbytes, block.segment, block, block.next
            )
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = nbytes
            self._index_add(rest)
        return block

    def _stitch(self, size: int, stream: int) -> tuple[_Stitched | None, list[Block]] | None:
        """Serve ``size`` (whole chunks) from free chunks mapped into one range, creating a
        pBlock for the shortfall only; None when capacity or the device refuses. The range is
        None when the chunks taken are one run already (no stitch needed)."""
        runs = self._free_chunks(stream)
        free_bytes = sum(n for _, n, _ in runs)
        if free_bytes < size:
            seg = self._reserve_segment(size - free_bytes, stream, retry=False)
            if seg is None:
                return None
            self._add_segment(seg)
            runs = self._free_chunks(stream)
        taken: list[tuple[int, int, Block]] = []
        left = size
        for start, nbytes, block in runs:
            take = min(nbytes, left)
            taken.append((start, take, block))
            left -= take
            if not left:
                break
        taken.sort(key=lambda r: r[0])  # map in address order: the same chunks give the same key
        blocks = [self._carve(block, start, take) for start, take, block in taken]
        if len(blocks) == 1:
            return None, blocks
        chunk = self.device.granularity_bytes
        chunks = tuple(off for b in blocks for off in range(b.offset, b.end, chunk))
        stitched = self._stitched.get(chunks)
        if stitched is not None:
            self._stitched.move_to_end(chunks)
            self.num_stitch_reuses += 1
        else:
            device = self.device
            address = device.address_reserve(size)
            if address is None:
                raise PolicyError(f"{self.name}: the device's address space is exhausted")
            device.map_handles(address, [device.handle_at(off) for off in chunks])
            stitched = self._stitched[chunks] = _Stitched(address, size, chunks)
            for seg_offset in {b.segment.offset for b in blocks}:
                self._stitched_over.setdefault(seg_offset, set()).add(chunks)
            self.num_stitches += 1
            self._evict_stitched(self.max_stitched_ranges)
        return stitched, blocks

    def _evict_stitched(self, keep: int, only: set[tuple[int, ...]] | None = None) -> None:
        """Unmap cached stitched ranges (least recently used first) down to ``keep``, or those in
        ``only``. A range whose allocation is live is kept."""
        device = self.device
        victims = (
            list(only)
            if only is not None
            else list(self._stitched)[: max(0, len(self._stitched) - keep)]
        )
        for chunks in victims:
            if chunks in self._live_stitches:
                continue
            stitched = self._stitched.pop(chunks)
            device.unmap(
                stitched.address, stitched.nbytes
            )  # the chunks stay mapped in their pBlocks
            device.address_free(stitched.address, stitched.nbytes)
            for owners in self._stitched_over.values():
                owners.discard(chunks)

    # ----------------------------------------------------------------- Policy hooks
    # best fit's hooks are called by class (``BestFit._allocate(self, ...)``), the method
    # ``super()`` finds: on Python 3.11 a ``super()`` makes a proxy object each call, on every
    # event of a replay
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        chunk = self.device.granularity_bytes
        if nbytes < chunk or self._find(round_up(nbytes, chunk), stream) is not None:
            if nbytes >= chunk:  # whole chunks, so a freed block can be stitched again
                nbytes_rounded = round_up(nbytes, chunk)
                a = BestFit._allocate(self, nbytes_rounded, stream, tag)
                if a is not None:
                    a.nbytes = nbytes
                return a
            return BestFit._allocate(self, nbytes, stream, tag)
        size = round_up(nbytes, chunk)
        found = self._stitch(size, stream)
        if found is None:
            return None
        stitched, blocks = found
        if stitched is None:  # the chunks lie in one run (a fresh pBlock): no range to stitch
            block = blocks[0]
            block.free = False
            block.segment.num_live += 1
            self.allocated_bytes += size
            return Allocation(nbytes, size, ((block.offset, size),), stream, tag, block)
        for block in blocks:
            block.free = False
            block.segment.num_live += 1
        self.allocated_bytes += size
        self._live_stitches.add(stitched.chunks)
        return Allocation(
            nbytes, size, tuple((b.offset, b.size) for b in blocks), stream, tag, (stitched, blocks)
        )

    def _free(self, allocation: Allocation) -> None:
        handle = allocation.handle
        if not isinstance(handle, tuple):
            return BestFit._free(self, allocation)
        stitched, blocks = handle
        self._live_stitches.discard(stitched.chunks)
        for block in blocks:
            BestFit._free(
                self,
                Allocation(block.size, block.size, ((block.offset, block.size),), handle=block),
            )

    def _release_segment(self, seg: Segment) -> None:
        owners = self._stitched_over.pop(seg.offset, set())
        if owners:
            self._evict_stitched(0, only=set(owners))
        super()._release_segment(seg)

    def _reset_state(self) -> None:
        self._stitched: OrderedDict[tuple[int, ...], _Stitched] = OrderedDict()
        self._stitched_over: dict[
            int, set[tuple[int, ...]]
        ] = {}  # pBlock offset -> stitched ranges over it
        self._live_stitches: set[tuple[int, ...]] = set()
        self.num_stitches = 0
        self.num_stitch_reuses = 0
        super()._reset_state()

    def reset(self) -> None:
        self._live_stitches.clear()
        self._evict_stitched(0)
        super().reset()
