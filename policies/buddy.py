"""``buddy``: the binary buddy system (Knowlton 1965; Knuth, TAOCP vol. 1, 2.5).

Every block is a power of two and lies at an offset (from its segment's start) that is a
multiple of its size. A request takes a block of the next power of two: the smallest free block
at least that large is halved until it fits, and each unused half (the *buddy*) is kept free.
A freed block merges with its buddy when the buddy is free and whole, and again with the merged
block's buddy, up to the segment. Finding a buddy is an XOR, so both paths take
O(log segment / min block) steps.

Costs and limits: rounding to a power of two wastes up to half of a block, and two free
neighbours that are not buddies never merge (so free extents may touch: ``coalesces`` is
False). A request larger than ``segment_bytes`` gets a segment of its own, rounded up to a
power of two.
"""

from __future__ import annotations

from policies.base import Allocation, Policy, Segment, check_positive_int
from policies.device import Device
from policies.errors import PolicyError

__all__ = ["Buddy"]

_DEFAULT_SEGMENT_BYTES = 64 << 20  # a power of two comparable to the other policies' segments


def _order_of(nbytes: int) -> int:
    """log2 of the smallest power of two >= nbytes."""
    return (nbytes - 1).bit_length()


class Buddy(Policy):
    """Binary buddy allocation over power-of-two segments.

    Args:
        segment_bytes: size of each segment reserved on a miss (a power of two); larger
            requests get a segment of their own, rounded up to a power of two.
        min_block_bytes: the smallest block (a power of two, at most ``segment_bytes``); every
            request takes at least this much.
        capacity_bytes, device: see ``Policy``.

    Index: per (stream, order) a ``dict`` of free block offsets used as an insertion-ordered
    set (O(1) add, remove and LIFO pop, so a buddy is unlinked in O(1) when it merges), a
    per-stream bit mask of the orders that hold free blocks (the smallest usable order is one
    bit operation), and ``offset -> order`` of every free block (is my buddy free and whole?).
    """

    name = "buddy"
    contiguous = True
    coalesces = False  # free neighbours that are not buddies stay apart

    def __init__(
        self,
        *,
        segment_bytes: int = _DEFAULT_SEGMENT_BYTES,
        min_block_bytes: int = 512,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        for name, value in (("segment_bytes", segment_bytes), ("min_block_bytes", min_block_bytes)):
            check_positive_int(name, value)
            if value & (value - 1):
                raise PolicyError(f"{name}(={value}) must be a power of two")
        if min_block_bytes > segment_bytes:
            raise PolicyError(
                f"min_block_bytes(={min_block_bytes}) must be <= segment_bytes(={segment_bytes})"
            )
        self.segment_bytes = segment_bytes
        self.min_block_bytes = min_block_bytes
        super().__init__(capacity_bytes=capacity_bytes, device=device)

    def _reset_state(self) -> None:
        self._min_order = _order_of(self.min_block_bytes)
        self._lists: dict[tuple[int, int], dict[int, None]] = {}  # (stream, order) -> offsets
        self._masks: dict[int, int] = {}  # stream -> bit k set when order k has a free block
        self._free_order: dict[int, int] = {}  # offset of a free block -> its order
        self._segment_at: dict[int, Segment] = {}  # offset of a free block -> its segment

    # ------------------------------------------------------------------ free lists
    def _push(self, offset: int, order: int, seg: Segment) -> None:
        key = (seg.stream, order)
        blocks = self._lists.get(key)
        if blocks is None:
            blocks = self._lists[key] = {}
        blocks[offset] = None
        self._masks[seg.stream] = self._masks.get(seg.stream, 0) | (1 << order)
        self._free_order[offset] = order
        self._segment_at[offset] = seg

    def _unlink(self, offset: int, order: int, stream: int) -> None:
        blocks = self._lists[(stream, order)]
        del blocks[offset]
        if not blocks:
            self._masks[stream] &= ~(1 << order)
        del self._free_order[offset]
        del self._segment_at[offset]

    def _pop(self, stream: int, order: int) -> tuple[int, Segment]:
        offset, _ = self._lists[(stream, order)].popitem()  # LIFO: the most recently freed block
        if not self._lists[(stream, order)]:
            self._masks[stream] &= ~(1 << order)
        del self._free_order[offset]
        return offset, self._segment_at.pop(offset)

    # ------------------------------------------------------------------ Policy hooks
    def _segment_size_for(self, nbytes: int) -> int:
        return max(self.segment_bytes, 1 << _order_of(nbytes))

    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        order = max(self._min_order, _order_of(nbytes))
        usable = self._masks.get(stream, 0) >> order
        if usable:
            found = order + ((usable & -usable).bit_length() - 1)
            offset, seg = self._pop(stream, found)
        else:
            seg = self._reserve_segment(self._segment_size_for(nbytes), stream)
            if seg is None:
                return None
            seg.handle = found = seg.nbytes.bit_length() - 1
            offset = seg.offset
        while found > order:  # halve, keeping the upper half (the buddy) free
            found -= 1
            self._push(offset + (1 << found), found, seg)
        seg.num_live += 1
        size = 1 << order
        self.allocated_bytes += size
        return Allocation(nbytes, size, ((offset, size),), stream, tag, (seg, order))

    def _free(self, allocation: Allocation) -> None:
        seg, order = allocation.handle
        offset = allocation._extents[0][
            0
        ]  # its own plain allocation: the stored slot, no property call
        seg.num_live -= 1
        self.allocated_bytes -= 1 << order
        top, base = seg.handle, seg.offset
        while order < top:
            buddy = base + ((offset - base) ^ (1 << order))
            if self._free_order.get(buddy) != order:
                break
            self._unlink(buddy, order, seg.stream)
            offset = min(offset, buddy)
            order += 1
        self._push(offset, order, seg)

    def _add_segment(self, segment: Segment) -> None:
        segment.handle = segment.nbytes.bit_length() - 1
        self._push(segment.offset, segment.handle, segment)

    def _release_free_segments(self, max_bytes: int | None) -> int:
        """Release segments with nothing live (each one free block of its own size), oldest
        first."""
        released = 0
        for seg in [s for s in self._segments.values() if s.num_live == 0]:
            if max_bytes is not None and released >= max_bytes:
                break
            assert self._free_order.get(seg.offset) == seg.handle, (
                "an empty segment is not one free block"
            )
            self._unlink(seg.offset, seg.handle, seg.stream)
            self._release_segment(seg)
            released += seg.nbytes
        return released

    # ------------------------------------------------------------------ inspection
    def free_extents(self) -> list[tuple[int, int]]:
        return sorted((offset, 1 << order) for offset, order in self._free_order.items())

    def largest_free_bytes(self) -> int:
        return max(
            (1 << (mask.bit_length() - 1) for mask in self._masks.values() if mask), default=0
        )
