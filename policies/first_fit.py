"""First fit: the lowest-address free block that fits, split and coalesced.

Address-ordered first fit packs live data towards low addresses, so the free space left at the
top of the pool tends to stay in large pieces (Johnstone & Wilson found it among the least
fragmenting policies; RMM's arena allocator uses it).
"""

from __future__ import annotations

from bisect import bisect_left

from policies._blocks import Block, ContiguousPolicy, cut_block
from policies.base import Allocation

__all__ = ["FirstFit"]


class FirstFit(ContiguousPolicy):
    """Serve each request from the lowest-address free block that holds it.

    Address order runs across segments (segments are disjoint ranges). Free blocks serve only
    requests on the stream their segment was reserved for (as in PyTorch and CuPy: reuse across
    streams would need an event to be safe). Knobs: see ``ContiguousPolicy``.

    Index: per stream, the free blocks in address order as three parallel ``list``s (offsets,
    sizes, blocks), because the first fit is then the first size that is large enough, which
    C finds (``filter`` + ``list.index``, no Python-level loop), a split or a merge changes a
    block's entry in place (address order never changes), and the neighbours' entries are one
    ``bisect`` of the offsets away. The scan is linear in the free blocks below the answer
    (about 15 ns each, in C); pools hold tens to a few thousand.
    """

    name = "first-fit"

    def _index_reset(self) -> None:
        self._free_by_stream: dict[int, tuple[list[int], list[int], list[Block]]] = {}

    def _lists(self, stream: int) -> tuple[list[int], list[int], list[Block]]:
        lists = self._free_by_stream.get(stream)
        if lists is None:
            lists = self._free_by_stream[stream] = ([], [], [])
        return lists

    def _index_add(self, block: Block) -> None:
        offsets, sizes, blocks = self._lists(block.segment.stream)
        i = bisect_left(offsets, block.offset)
        offsets.insert(i, block.offset)
        sizes.insert(i, block.size)
        blocks.insert(i, block)

    def _index_remove(self, block: Block) -> None:
        offsets, sizes, blocks = self._free_by_stream[block.segment.stream]
        i = bisect_left(offsets, block.offset)
        assert blocks[i] is block, "removing a block that is not indexed"
        del offsets[i], sizes[i], blocks[i]

    def _index_resize(self, block: Block, old_size: int) -> None:
        offsets, sizes, blocks = self._free_by_stream[block.segment.stream]
        i = bisect_left(offsets, block.offset)
        assert blocks[i] is block, "resizing a block that is not indexed"
        sizes[i] = block.size

    def _find(self, size: int, stream: int) -> Block | None:
        lists = self._free_by_stream.get(stream)
        if not lists:
            return None
        sizes = lists[1]
        fit = next(filter(size.__le__, sizes), 0)
        return lists[2][sizes.index(fit)] if fit else None

    # ----------------------------------------------------------------- the hot path
    # ``ContiguousPolicy._allocate`` (``_take`` + ``_cut``) and ``_free`` with this index's
    # updates inlined: one Python frame each (calls are most of what a pure-Python pool pays).
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        mask = self._round_mask
        size = (nbytes + mask) & ~mask if mask is not None else self.rounded_size(nbytes)
        lists = self._free_by_stream.get(stream)
        fit = 0
        if lists is not None:
            offsets, sizes, blocks = lists
            fit = next(filter(size.__le__, sizes), 0)  # the first size that holds it, found in C
        if fit:
            i = sizes.index(fit)  # no size before it equals it: they are all smaller
            block = blocks[i]
        else:
            block = self._miss(size, stream)
            if block is None:
                return None
            offsets, sizes, blocks = self._lists(stream)
            i = -1
        a = cut_block(block, size, nbytes, stream, tag, self._split_min_bytes)
        rest = a.next
        if rest is not None and rest.free:  # a split: the rest keeps the block's place in address order
            if i < 0:  # a miss: the block came from outside the index
                i = bisect_left(offsets, rest.offset)
                offsets.insert(i, rest.offset)
                sizes.insert(i, rest.size)
                blocks.insert(i, rest)
            else:
                offsets[i] = rest.offset
                sizes[i] = rest.size
                blocks[i] = rest
        elif i >= 0:
            del offsets[i], sizes[i], blocks[i]
        self.allocated_bytes += a.size
        return a

    def _free(self, allocation: Allocation) -> None:
        block: Block = allocation if allocation.__class__ is Block else allocation.handle
        size = block.size
        assert not block.free and size == allocation.size_bytes
        self.allocated_bytes -= size
        seg = block.segment
        seg.num_live -= 1
        offsets, sizes, blocks = self._free_by_stream[seg.stream]
        nxt = block.next
        prev = block.prev
        if nxt is not None and nxt.free:  # absorb the free block above: its entry is the merged block's
            i = bisect_left(offsets, nxt.offset)
            assert blocks[i] is nxt, "merging a block that is not indexed"
            size += nxt.size
            after = block.next = nxt.next
            if after is not None:
                after.prev = block
            nxt.prev = nxt.next = None
            if prev is not None and prev.free:  # and into the one below: the entry before
                del offsets[i], sizes[i], blocks[i]
                i -= 1
                sizes[i] += size
                prev.size += size
                prev.next = after
                if after is not None:
                    after.prev = prev
                block.prev = block.next = None
            else:
                offsets[i] = block.offset
                sizes[i] = size
                blocks[i] = block
                block.size = size
                block.free = True
        elif prev is not None and prev.free:  # merge into the free block below
            i = bisect_left(offsets, prev.offset)
            assert blocks[i] is prev, "merging a block that is not indexed"
            size += prev.size
            sizes[i] = size
            prev.size = size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block.prev = block.next = None
        else:
            offset = block.offset
            i = bisect_left(offsets, offset)
            offsets.insert(i, offset)
            sizes.insert(i, size)
            blocks.insert(i, block)
            block.free = True

    def check_invariants(self) -> None:
        super().check_invariants()
        for stream, (offsets, sizes, blocks) in self._free_by_stream.items():
            expected = [b for b in self.blocks() if b.free and b.segment.stream == stream]
            assert blocks == expected, f"stream {stream}: the index and the free blocks differ"
            assert offsets == [b.offset for b in expected] and sizes == [b.size for b in expected]

    def _index_largest_bytes(self) -> int:
        return max((max(sizes) for _, sizes, _ in self._free_by_stream.values() if sizes), default=0)
