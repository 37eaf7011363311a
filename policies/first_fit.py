"""First fit: the lowest-address free block that fits, split and coalesced.

Address-ordered first fit packs live data towards low addresses, so the free space left at the
top of the pool tends to stay in large pieces (Johnstone & Wilson found it among the least
fragmenting policies; RMM's arena allocator uses it).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

from policies._blocks import OFFSET_BITS, Block, ContiguousPolicy

__all__ = ["FirstFit"]

_NUM_BUCKETS = OFFSET_BITS  # block sizes are below 2**64
_NONE = 1 << OFFSET_BITS  # above every offset: "no block"


@dataclass(slots=True)
class _Arena:
    """The free blocks of one stream, bucketed by ``size.bit_length() - 1``.

    ``buckets[i]`` holds the offsets of free blocks with ``2**i <= size < 2**(i+1)``, ascending;
    ``firsts[i]`` is its lowest offset (``_NONE`` when empty); bit ``i`` of ``mask`` is set when
    it is non-empty.
    """

    buckets: list[list[int]] = field(default_factory=lambda: [[] for _ in range(_NUM_BUCKETS)])
    firsts: list[int] = field(default_factory=lambda: [_NONE] * _NUM_BUCKETS)
    mask: int = 0

    def forget_first(self, i: int) -> None:
        """Bucket ``i`` lost its lowest offset: record the next one (or that it is empty)."""
        bucket = self.buckets[i]
        if bucket:
            self.firsts[i] = bucket[0]
        else:
            self.firsts[i] = _NONE
            self.mask &= ~(1 << i)


class FirstFit(ContiguousPolicy):
    """Serve each request from the lowest-address free block that holds it.

    Address order runs across segments (segments are disjoint ranges). Free blocks serve only
    requests on the stream their segment was reserved for (as in PyTorch and CuPy: reuse across
    streams would need an event to be safe). Knobs: see ``ContiguousPolicy``.

    Index: per stream, per power-of-two size bucket a sorted ``list`` of offsets and its lowest
    offset, because every block of the buckets above the request's fits, so the answer is the
    lowest of their first offsets (one C-level ``min`` over at most 64 ints) unless a lower
    block of the request's own bucket fits (a scan that stops at that offset, skipped for
    power-of-two sizes), never a walk over every free block. Plain lists rather than
    ``SortedList``: C-level ``insort``/``del`` win at the tens to thousands of blocks a bucket
    holds (see ``BestFit``).
    """

    name = "first-fit"

    def _index_reset(self) -> None:
        self._arenas: dict[int, _Arena] = {}
        self._free_at: dict[int, Block] = {}  # offset -> free block

    def _index_add(self, block: Block) -> None:
        stream = block.segment.stream
        arena = self._arenas.get(stream)
        if arena is None:
            arena = self._arenas[stream] = _Arena()
        i = block.size.bit_length() - 1
        offset = block.offset
        insort(arena.buckets[i], offset)
        if offset < arena.firsts[i]:
            arena.firsts[i] = offset
            arena.mask |= 1 << i
        self._free_at[offset] = block

    def _index_remove(self, block: Block) -> None:
        arena = self._arenas[block.segment.stream]
        i = block.size.bit_length() - 1
        offset = block.offset
        bucket = arena.buckets[i]
        k = bisect_left(bucket, offset)
        assert bucket[k] == offset, "removing a block that is not indexed"
        del bucket[k]
        if k == 0:
            arena.forget_first(i)
        del self._free_at[offset]

    def _index_resize(self, block: Block, old_size: int) -> None:
        # most merges stay in their power-of-two bucket, where the offset already sits in order
        if old_size.bit_length() != block.size.bit_length():
            super()._index_resize(block, old_size)

    def _locate(self, size: int, stream: int) -> tuple[_Arena, int, int] | None:
        """``(arena, bucket, position)`` of the lowest-address free block of ``size`` or more."""
        arena = self._arenas.get(stream)
        if arena is None:
            return None
        top = arena.mask.bit_length()  # one past the highest non-empty bucket
        full = (size - 1).bit_length()  # every block of buckets full.. fits
        firsts = arena.firsts
        best = min(firsts[full:top]) if full < top else _NONE
        part = size.bit_length() - 1  # size's own bucket: only some of its blocks fit
        if part < full and firsts[part] < best:
            free_at = self._free_at
            for k, offset in enumerate(arena.buckets[part]):
                if offset >= best:
                    break
                if free_at[offset].size >= size:
                    return arena, part, k
        if best == _NONE:
            return None
        return arena, firsts.index(best, full, top), 0

    def _find(self, size: int, stream: int) -> Block | None:
        found = self._locate(size, stream)
        if found is None:
            return None
        arena, i, k = found
        return self._free_at[arena.buckets[i][k]]

    def _take(self, size: int, stream: int) -> Block | None:
        found = self._locate(size, stream)
        if found is None:
            return None
        arena, i, k = found
        offset = arena.buckets[i].pop(k)
        if k == 0:
            arena.forget_first(i)
        return self._free_at.pop(offset)

    def check_invariants(self) -> None:
        super().check_invariants()
        free_blocks = {b.offset: b for b in self.blocks() if b.free}
        assert self._free_at == free_blocks, "the index and the free blocks differ"
        for stream, arena in self._arenas.items():
            for i, bucket in enumerate(arena.buckets):
                assert bucket == sorted(bucket), f"stream {stream} bucket {i} is out of order"
                assert arena.firsts[i] == (bucket[0] if bucket else _NONE)
                assert bool(arena.mask >> i & 1) == bool(bucket)
                for offset in bucket:
                    block = free_blocks[offset]
                    assert block.segment.stream == stream and block.size.bit_length() - 1 == i

    def _index_largest_bytes(self) -> int:
        largest = 0
        for arena in self._arenas.values():
            if arena.mask:
                top = arena.buckets[arena.mask.bit_length() - 1]
                largest = max(largest, max(self._free_at[offset].size for offset in top))
        return largest
