"""``torch-caching``: PyTorch's CUDA caching allocator, rule for rule.

Follows ``c10/cuda/CUDACachingAllocator.cpp`` (read at v2.x with the search tool):

- sizes round up to 512 B (``round_size``), or to power-of-two divisions when
  ``roundup_power2_divisions`` is set (``roundup_power2_next_division``);
- requests <= 1 MiB use the small pool, packed into 2 MiB segments; 1-10 MiB requests get a
  20 MiB segment; >= 10 MiB are rounded to 2 MiB and get a segment of their own
  (``get_allocation_size``);
- best fit over free blocks ordered by (stream, size, address); another stream's blocks are
  never used (``get_free_block``); with ``max_split_size`` a small request never takes an
  oversize block and a large one takes an oversize block only within 20 MiB of its size;
- the allocated block is cut from the front; the small pool splits when >= 512 B remain, the
  large pool when > 1 MiB remains and the request is below ``max_split_size`` (``should_split``);
- a freed block merges with free neighbours in its segment (``free_block``);
- on a miss: garbage collection of old cached blocks when ``garbage_collection_threshold`` is
  set and usage passes it, then ``cudaMalloc``; on failure ``release_available_cached_blocks``
  (oversize blocks, only with ``max_split_size``) and retry, then ``release_cached_blocks``
  (every unsplit cached segment, what ``empty_cache`` does) and a last try, then OOM.

Not emulated: ``expandable_segments`` (mapping pages into one growing range; the option is
accepted only as False), CUDA events/``record_stream`` delays, graph-private pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedList

from policies.base import Allocation, Policy, Segment
from policies.errors import PolicyError

__all__ = ["TorchCaching", "round_size", "allocation_size", "roundup_power2_next_division"]

MiB = 1 << 20
K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 * MiB
K_SMALL_BUFFER = 2 * MiB
K_LARGE_BUFFER = 20 * MiB
K_MIN_LARGE_ALLOC = 10 * MiB
K_ROUND_LARGE = 2 * MiB


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """1200 with 4 divisions -> 1280 (the divisions of [1024, 2048) are 1024, 1280, 1536, 1792)."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    division = power2_floor >> (divisions.bit_length() - 1)
    if division == 0:
        return power2_floor << 1
    floor = size & ~(division - 1)
    return size if floor == size else floor + division


def round_size(size: int, divisions: int = 0) -> int:
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    if divisions > 1 and size > K_MIN_BLOCK * divisions:
        return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK * -(-size // K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    """Segment bytes ``cudaMalloc`` is asked for when a rounded request misses the cache."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)


@dataclass(slots=True, eq=False)
class _Block:
    ptr: int
    size: int
    stream: int
    small: bool
    segment: Segment
    prev: "_Block | None" = None
    next: "_Block | None" = None
    allocated: bool = False
    freed_at: int = 0  # malloc count when it became free, for garbage collection by age

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class TorchCaching(Policy):
    """PyTorch's CUDA caching allocator (see the module docstring for the rules followed).

    Args:
        max_split_size_bytes: blocks at least this large are never split (None: no limit).
        roundup_power2_divisions: round sizes up to this many divisions per power of two
            (0 or 1: plain 512 B rounding). One value for all sizes.
        garbage_collection_threshold: fraction 0..1 of ``capacity_bytes``; past it, cached
            blocks unused for longest are released before a new segment is reserved.
        expandable_segments: must be False (not emulated).
    """

    name = "torch-caching"
    coalesces = True

    def __init__(self, *, max_split_size_bytes: int | None = None, roundup_power2_divisions: int = 0,
                 garbage_collection_threshold: float = 0.0, expandable_segments: bool = False,
                 capacity_bytes: int | None = None, device=None):
        if max_split_size_bytes is not None and (not isinstance(max_split_size_bytes, int) or max_split_size_bytes <= K_LARGE_BUFFER):
            raise PolicyError(f"max_split_size_bytes(={max_split_size_bytes!r}) must be None or an integer > 20 MiB, as in PyTorch")
        if not isinstance(roundup_power2_divisions, int) or roundup_power2_divisions < 0 or (
                roundup_power2_divisions > 1 and roundup_power2_divisions & (roundup_power2_divisions - 1)):
            raise PolicyError(f"roundup_power2_divisions(={roundup_power2_divisions!r}) must be 0, 1 or a power of two")
        if not 0.0 <= float(garbage_collection_threshold) < 1.0:
            raise PolicyError(f"garbage_collection_threshold(={garbage_collection_threshold!r}) must be in [0, 1)")
        if expandable_segments:
            raise PolicyError("expandable_segments=True is not emulated by torch-caching yet")
        self.max_split_size_bytes = max_split_size_bytes
        self.roundup_power2_divisions = roundup_power2_divisions
        self.garbage_collection_threshold = garbage_collection_threshold
        self.expandable_segments = expandable_segments
        super().__init__(capacity_bytes=capacity_bytes, device=device)

    def _reset_state(self) -> None:
        # (stream, size, ptr) keys: PyTorch's BlockComparatorSize order, so the first key at or
        # after (stream, size, 0) is the best fit; SortedList gives that bisect in O(log n).
        self._pools = {True: SortedList(), False: SortedList()}
        self._free_blocks: dict[int, _Block] = {}
        self._num_mallocs = 0
        self._max_split = self.max_split_size_bytes if self.max_split_size_bytes is not None else float("inf")
        self.num_retries = 0  # times release_cached_blocks ran to satisfy a request (cudaMalloc retries)

    # ------------------------------------------------------------------ free-set helpers
    def _insert(self, b: _Block) -> None:
        b.freed_at = self._num_mallocs
        self._pools[b.small].add((b.stream, b.size, b.ptr))
        self._free_blocks[b.ptr] = b

    def _remove(self, b: _Block) -> None:
        self._pools[b.small].remove((b.stream, b.size, b.ptr))
        del self._free_blocks[b.ptr]

    def _get_free_block(self, small: bool, stream: int, size: int) -> _Block | None:
        pool = self._pools[small]
        i = pool.bisect_left((stream, size, -1))
        if i == len(pool):
            return None
        key = pool[i]
        if key[0] != stream:
            return None
        b = self._free_blocks[key[2]]
        if size < self._max_split and b.size >= self._max_split:
            return None  # do not hand an oversize block to a small request
        if size >= self._max_split and b.size >= size + K_LARGE_BUFFER:
            return None  # do not waste an oversize block far larger than the request
        return b

    # ------------------------------------------------------------------ Policy hooks
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        size = round_size(nbytes, self.roundup_power2_divisions)
        small = size <= K_SMALL_SIZE
        self._num_mallocs += 1
        b = self._get_free_block(small, stream, size)
        if b is None:
            alloc_bytes = allocation_size(size)
            if self.garbage_collection_threshold > 0 and self.capacity_bytes is not None:
                self._garbage_collect()
            b = self._new_segment_block(small, stream, alloc_bytes)
            if b is None and self._release_available_cached_blocks(small, stream, size):
                b = self._new_segment_block(small, stream, alloc_bytes)
            if b is None:
                self.num_retries += 1
                self._release_free_segments(None)
                b = self._new_segment_block(small, stream, alloc_bytes)
            if b is None:
                return None
        self._remove(b)
        remaining = b.size - size
        if (remaining >= K_MIN_BLOCK) if small else (size < self._max_split and remaining > K_SMALL_SIZE):
            front = _Block(b.ptr, size, stream, small, b.segment, prev=b.prev, next=b)
            if b.prev is not None:
                b.prev.next = front
            b.prev = front
            b.ptr += size
            b.size = remaining
            self._insert(b)
            b = front
        b.allocated = True
        b.segment.num_live += 1
        self.allocated_bytes += b.size
        return Allocation(nbytes, b.size, ((b.ptr, b.size),), stream, tag, b)

    def _free(self, allocation: Allocation) -> None:
        b: _Block = allocation.handle
        b.allocated = False
        b.segment.num_live -= 1
        self.allocated_bytes -= b.size
        prev, nxt = b.prev, b.next
        if prev is not None and not prev.allocated:
            self._remove(prev)
            b.ptr, b.size, b.prev = prev.ptr, prev.size + b.size, prev.prev
            if b.prev is not None:
                b.prev.next = b
        if nxt is not None and not nxt.allocated:
            self._remove(nxt)
            b.size += nxt.size
            b.next = nxt.next
            if b.next is not None:
                b.next.prev = b
        self._insert(b)

    def _new_segment_block(self, small: bool, stream: int, alloc_bytes: int) -> _Block | None:
        seg = self._reserve_segment(alloc_bytes, stream, retry=False)
        if seg is None:
            return None
        seg.handle = small
        b = _Block(seg.offset, alloc_bytes, stream, small, seg)
        self._insert(b)
        return b

    def _release_block(self, b: _Block) -> int:
        self._remove(b)
        self._release_segment(b.segment)
        return b.size

    def _release_free_segments(self, max_bytes: int | None) -> int:
        """``release_cached_blocks``: free every cached block that is a whole segment."""
        released = 0
        for b in [b for b in self._free_blocks.values() if not b.is_split]:
            released += self._release_block(b)
            if max_bytes is not None and released >= max_bytes:
                break
        return released

    def _release_available_cached_blocks(self, small: bool, stream: int, size: int) -> bool:
        """Free oversize cached blocks to make room (only meaningful with ``max_split_size``)."""
        if self.max_split_size_bytes is None:
            return False
        key = max(size, self._max_split)
        pool = self._pools[small]
        i = pool.bisect_left((stream, key, -1))
        if i < len(pool) and pool[i][0] == stream:
            b = self._free_blocks[pool[i][2]]
            if not b.is_split:
                self._release_block(b)
                return True
        total = 0
        j = i - 1
        while j >= 0 and total < key:
            s, bsize, ptr = pool[j]
            if s != stream or bsize < self._max_split:
                break
            b = self._free_blocks[ptr]
            j -= 1
            if not b.is_split:
                total += self._release_block(b)
        return total >= key

    def _garbage_collect(self) -> None:
        """Release the cached unsplit blocks unused for longest until under the threshold."""
        target = self.garbage_collection_threshold * self.capacity_bytes
        if self.reserved_bytes <= target:
            return
        while self.reserved_bytes > target:
            candidates = [b for b in self._free_blocks.values() if not b.is_split]
            if not candidates:
                return
            ages = [self._num_mallocs - b.freed_at for b in candidates]
            mean_age = sum(ages) / len(ages)
            for b, age in zip(candidates, ages):
                if age >= mean_age and self.reserved_bytes > target:
                    self._release_block(b)

    def _add_segment(self, segment: Segment) -> None:
        segment.handle = False
        self._insert(_Block(segment.offset, segment.nbytes, segment.stream, False, segment))

    def _segment_size_for(self, nbytes: int) -> int:
        return allocation_size(round_size(nbytes, self.roundup_power2_divisions))

    # ------------------------------------------------------------------ inspection
    def free_extents(self) -> list[tuple[int, int]]:
        return sorted((b.ptr, b.size) for b in self._free_blocks.values())

    def largest_free_bytes(self) -> int:
        if all(not pool or pool[0][0] == pool[-1][0] for pool in self._pools.values()):
            # one stream: the last key of each pool is its largest block
            return max((pool[-1][1] for pool in self._pools.values() if pool), default=0)
        return max((b.size for b in self._free_blocks.values()), default=0)

    def empty_cache(self) -> int:
        """``torch.cuda.empty_cache()``: release every unsplit cached segment."""
        return self._release_free_segments(None)

    def allocator_info(self) -> dict[str, Any]:
        return {"num_retries": self.num_retries, "num_cached_blocks": len(self._free_blocks)}
