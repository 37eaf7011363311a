"""First fit: the lowest-address free block that fits, split and coalesced.

Address-ordered first fit packs live data towards low addresses, so the free space left at the
top of the pool tends to stay in large pieces (Johnstone & Wilson found it among the least
fragmenting policies; RMM's arena allocator uses it).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import islice

from policies._blocks import NO_STREAM, Block, ContiguousPolicy, bisect_ints, cut_block, merge_down
from policies.base import Allocation, Policy, Segment

try:
    import cython
except ImportError:  # a pure install: the same names as no-ops (policies/_cython_shim.py)
    from policies._cython_shim import cython

__all__ = ["FirstFit"]

#: a stream's free list turns chunked once a first-fit scan passes this many free blocks (and
#: flat again below half of it): below it the flat C-level scan is the fastest there is
CHUNKED_FROM_ENTRIES = 256
#: entries per chunk of a chunked free list (chunks hold half to twice this)
CHUNK_ENTRIES = 64

#: whether this module is compiled: the flat scan is then ``_first_at_least``'s C loop
_COMPILED = cython.compiled
#: no block is larger (``Block.size`` is a C 64-bit integer in the compiled build)
_LARGEST_BLOCK_BYTES = (1 << 63) - 1


@cython.locals(i=cython.longlong, n=cython.longlong, want=cython.longlong, s=cython.longlong)
def _first_at_least(sizes: list[int], size: int) -> int:
    """The index of the first entry of ``sizes`` that is ``>= size``, or -1: the compiled flat
    scan, a C loop over C integers (interpreted, ``filter`` + ``list.index`` find it in C faster
    than this loop; ``_FirstFitCore._allocate`` takes that path there)."""
    if size > _LARGEST_BLOCK_BYTES:  # no block holds it (and it would not fit a C integer)
        return -1
    want = size
    n = len(sizes)
    for i in range(n):
        s = sizes[i]
        if s >= want:
            return i
    return -1


class _ChunkedFreeList:
    """One stream's free blocks in address order, cut into chunks, with each chunk's first
    offset and an upper bound of its largest size: a first fit scans the bounds, then one chunk.

    Why chunks: the flat scan is linear in the free blocks below the fit; here it passes (number
    of chunks) bounds and one chunk's entries, both in C, and an insert or delete moves one
    chunk's entries only. The bounds are upper bounds, not maxima, so that a split or a removal
    (the block that shrinks is often its chunk's largest) costs no ``max`` over the chunk: a
    search that meets a bound too high for its chunk tightens it (``max`` over that chunk, in C)
    and goes on to the next chunk, so each stale bound is paid for once.
    """

    __slots__ = ("offsets", "sizes", "blocks", "firsts", "bounds", "num_entries")

    def __init__(self, offsets: list[int], sizes: list[int], blocks: list[Block]) -> None:
        k = CHUNK_ENTRIES
        starts = range(0, len(offsets), k)
        self.offsets = [offsets[j : j + k] for j in starts]
        self.sizes = [sizes[j : j + k] for j in starts]
        self.blocks = [blocks[j : j + k] for j in starts]
        self.firsts = [c[0] for c in self.offsets]
        self.bounds = [max(c) for c in self.sizes]
        self.num_entries = len(offsets)

    def flat(self) -> tuple[list[int], list[int], list[Block]]:
        """The entries as the flat parallel lists, in address order."""
        return (
            [o for c in self.offsets for o in c],
            [s for c in self.sizes for s in c],
            [b for c in self.blocks for b in c],
        )

    def find(self, size: int) -> tuple[Block, int, int] | None:
        """The lowest-address block that holds ``size``, with its chunk and place in it; or None."""
        bounds, j = self.bounds, 0
        while True:
            bound = next(filter(size.__le__, islice(bounds, j, None)), 0)  # found in C
            if not bound:
                return None
            j = bounds.index(bound, j)
            sizes = self.sizes[j]
            fit = next(filter(size.__le__, sizes), 0)
            if fit:
                i = sizes.index(fit)
                return self.blocks[j][i], j, i
            bounds[j] = max(sizes)  # a stale bound: tighten it and look further up
            j += 1

    def replace(self, j: int, i: int, block: Block) -> None:
        """Entry ``i`` of chunk ``j`` becomes ``block``, no larger and not below its predecessor."""
        self.offsets[j][i] = block.offset
        self.sizes[j][i] = block.size
        self.blocks[j][i] = block
        if i == 0:
            self.firsts[j] = block.offset

    def delete(self, j: int, i: int) -> None:
        """Drop entry ``i`` of chunk ``j``; the chunk's bound stays (an upper bound still)."""
        offsets = self.offsets[j]
        del offsets[i], self.sizes[j][i], self.blocks[j][i]
        self.num_entries -= 1
        if not offsets:
            del self.offsets[j], self.sizes[j], self.blocks[j], self.firsts[j], self.bounds[j]
            return
        if i == 0:
            self.firsts[j] = offsets[0]
        if len(offsets) < CHUNK_ENTRIES // 2 and len(self.firsts) > 1:
            self._join(j if j + 1 < len(self.firsts) else j - 1)

    def _locate(self, block: Block) -> tuple[int, int]:
        j = bisect_right(self.firsts, block.offset) - 1
        i = bisect_left(self.offsets[j], block.offset)
        assert j >= 0 and self.blocks[j][i] is block, "a block that is not indexed"
        return j, i

    def add(self, block: Block) -> None:
        offset, size = block.offset, block.size
        firsts = self.firsts
        self.num_entries += 1
        if not firsts:  # every chunk went (only with a threshold of 1 or less)
            self.offsets.append([offset])
            self.sizes.append([size])
            self.blocks.append([block])
            firsts.append(offset)
            self.bounds.append(size)
            return
        j = max(bisect_right(firsts, offset) - 1, 0)
        offsets = self.offsets[j]
        i = bisect_left(offsets, offset)
        offsets.insert(i, offset)
        self.sizes[j].insert(i, size)
        self.blocks[j].insert(i, block)
        if i == 0:
            firsts[j] = offset
        if size > self.bounds[j]:
            self.bounds[j] = size
        if len(offsets) > 2 * CHUNK_ENTRIES:
            self._split(j)

    def remove(self, block: Block) -> None:
        self.delete(*self._locate(block))

    def resize(self, block: Block) -> None:
        """``block`` grew in place (same offset)."""
        j, i = self._locate(block)
        self.sizes[j][i] = block.size
        if block.size > self.bounds[j]:
            self.bounds[j] = block.size

    def largest_bytes(self) -> int:
        return max(map(max, self.sizes), default=0)

    def _split(self, j: int) -> None:
        half = len(self.offsets[j]) // 2
        for chunks in (self.offsets, self.sizes, self.blocks):
            chunk = chunks[j]
            chunks.insert(j + 1, chunk[half:])
            del chunk[half:]
        self.firsts.insert(j + 1, self.offsets[j + 1][0])
        self.bounds[j] = max(self.sizes[j])
        self.bounds.insert(j + 1, max(self.sizes[j + 1]))

    def _join(self, j: int) -> None:
        """Chunk ``j + 1`` joins chunk ``j``; split again when too long."""
        for chunks in (self.offsets, self.sizes, self.blocks):
            chunks[j] += chunks.pop(j + 1)
        del self.firsts[j + 1]
        self.bounds[j] = max(self.bounds[j], self.bounds.pop(j + 1))
        if len(self.offsets[j]) > 2 * CHUNK_ENTRIES:
            self._split(j)


class _FirstFitCore(Policy):
    """``FirstFit``'s hot path: ``ContiguousPolicy._allocate`` (``_take`` + ``_cut``) and
    ``_free`` with the flat index's updates inlined, one frame each (calls are most of what a
    pure-Python pool pays). The compiled build declares it a ``cdef class`` (``first_fit.pxd``);
    ``FirstFit`` stays a Python class over it and ``ContiguousPolicy`` (see
    ``best_fit._BestFitCore``).
    """

    @cython.locals(
        block=Block, a=Block, rest=Block, offsets=list, sizes=list, blocks=list, i=cython.longlong
    )
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        mask = self._round_mask
        size = (nbytes + mask) & ~mask if mask is not None else self.rounded_size(nbytes)
        lists = self._hot_lists if stream is self._hot_stream else self._make_hot(stream)
        i = -1
        if lists is not None:
            offsets, sizes, blocks = lists
            if _COMPILED:
                i = _first_at_least(sizes, size)
            else:
                fit = next(
                    filter(size.__le__, sizes), 0
                )  # the first size that holds it, found in C
                if fit:
                    i = sizes.index(fit)  # no size before it equals it: they are all smaller
        elif stream in self._chunked_by_stream:  # a long free list
            return self._allocate_chunked(
                self._chunked_by_stream[stream], size, nbytes, stream, tag
            )
        if i >= 0:
            block = blocks[i]
        else:
            block = self._miss(size, stream)
            if block is None:
                return None
            offsets, sizes, blocks = self._lists(stream)
            i = -1
        a = cut_block(block, size, nbytes, stream, tag, self._split_min_bytes)
        rest = a.next
        if (
            rest is not None and rest.free
        ):  # a split: the rest keeps the block's place in address order
            if i < 0:  # a miss: the block came from outside the index
                i = bisect_ints(offsets, rest.offset)
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
        if (
            i >= CHUNKED_FROM_ENTRIES
        ):  # this search scanned that many free blocks: bound the next ones
            self._chunk(stream)
        return a

    def _make_hot(self, stream: int) -> tuple[list[int], list[int], list[Block]] | None:
        """Make ``stream``'s flat lists the hot ones (``_hot_lists``) and return them; None for a
        stream that has none (chunked, or never indexed): the hot paths' way to a stream other
        than the last one used."""
        lists = self._free_by_stream.get(stream)
        if lists is not None:
            self._hot_stream = stream
            self._hot_lists = lists
        return lists

    @cython.locals(
        block=Block,
        nxt=Block,
        prev=Block,
        after=Block,
        seg=Segment,
        offsets=list,
        sizes=list,
        blocks=list,
        size=cython.longlong,
        i=cython.longlong,
        offset=cython.longlong,
    )
    def _free(self, allocation: Allocation) -> None:
        block: Block = (
            allocation.handle
        )  # a block is its own handle; a subclass's allocation wraps one
        size = block.size
        assert not block.free and size == allocation.size_bytes
        seg = block.segment
        lists = self._hot_lists if seg.stream is self._hot_stream else self._make_hot(seg.stream)
        if lists is None:  # a chunked stream: the generic path, through the hooks
            return ContiguousPolicy._free(self, allocation)
        offsets, sizes, blocks = lists
        block.handle = None
        self.allocated_bytes -= size
        seg.num_live -= 1
        nxt = block.next
        prev = block.prev
        if (
            nxt is not None and nxt.free
        ):  # absorb the free block above: its entry is the merged block's
            i = bisect_ints(offsets, nxt.offset)
            assert blocks[i] is nxt, "merging a block that is not indexed"
            size += nxt.size
            if not nxt.size_bytes and (prev is None or not prev.free):  # ``nxt`` absorbs the block
                merge_down(block, nxt, prev, seg)
                offsets[i] = nxt.offset
                sizes[i] = size
                return
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
            i = bisect_ints(offsets, prev.offset)
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
            i = bisect_ints(offsets, offset)
            offsets.insert(i, offset)
            sizes.insert(i, size)
            blocks.insert(i, block)
            block.free = True


class FirstFit(_FirstFitCore, ContiguousPolicy):
    """Serve each request from the lowest-address free block that holds it.

    Address order runs across segments (segments are disjoint ranges). Free blocks serve only
    requests on the stream their segment was reserved for (as in PyTorch and CuPy: reuse across
    streams would need an event to be safe). Knobs: see ``ContiguousPolicy``.

    Index: per stream, the free blocks in address order as three parallel ``list``s (offsets,
    sizes, blocks), because the first fit is then the first size that is large enough, which
    C finds (``filter`` + ``list.index``, no Python-level loop), a split or a merge changes a
    block's entry in place (address order never changes), and the neighbours' entries are one
    ``bisect`` of the offsets away. The scan is linear in the free blocks below the answer
    (about 13 ns each, in C); the snapshot's pools hold about 30. A stream whose scan passes
    ``CHUNKED_FROM_ENTRIES`` blocks gets a ``_ChunkedFreeList`` instead (the search bounded by
    per-chunk size bounds; allocations by ``_allocate_chunked``, frees by the generic
    ``ContiguousPolicy._free`` through the index hooks), and gets the flat lists back below half
    of that: the flat streams' hot path pays one comparison for it.
    """

    name = "first-fit"

    # the core's inlined hot path goes with this class's index
    # (``ContiguousPolicy.__init_subclass__`` gives a subclass that brings another index the generic
    # path)
    _allocate = vars(_FirstFitCore)[
        "_allocate"
    ]  # vars(): compiled, the method itself, not its C function
    _free = vars(_FirstFitCore)["_free"]

    def _index_reset(self) -> None:
        self._free_by_stream: dict[int, tuple[list[int], list[int], list[Block]]] = {}
        self._chunked_by_stream: dict[int, _ChunkedFreeList] = {}  # streams absent from the above
        self._forget_hot()

    def _forget_hot(self) -> None:
        """Forget the hot lists, after a stream's flat lists came or went. The hot lists are the
        flat lists of the stream the hot paths used last, kept beside the dict: one identity test
        instead of a dict lookup a call (a trace's requests are nearly all on one stream)."""
        self._hot_stream: object = NO_STREAM
        self._hot_lists: tuple[list[int], list[int], list[Block]] | None = None

    def _chunk(self, stream: int) -> None:
        self._chunked_by_stream[stream] = _ChunkedFreeList(*self._free_by_stream.pop(stream))
        self._forget_hot()

    def _flatten(self, stream: int) -> None:
        self._free_by_stream[stream] = self._chunked_by_stream.pop(stream).flat()
        self._forget_hot()

    def _lists(self, stream: int) -> tuple[list[int], list[int], list[Block]]:
        lists = self._free_by_stream.get(stream)
        if lists is None:
            lists = self._free_by_stream[stream] = ([], [], [])
        return lists

    def _index_add(self, block: Block) -> None:
        chunked = self._chunked_by_stream.get(block.segment.stream)
        if chunked is not None:
            return chunked.add(block)
        offsets, sizes, blocks = self._lists(block.segment.stream)
        i = bisect_left(offsets, block.offset)
        offsets.insert(i, block.offset)
        sizes.insert(i, block.size)
        blocks.insert(i, block)

    def _index_remove(self, block: Block) -> None:
        stream = block.segment.stream
        chunked = self._chunked_by_stream.get(stream)
        if chunked is not None:
            chunked.remove(block)
            if chunked.num_entries < CHUNKED_FROM_ENTRIES // 2:
                self._flatten(stream)
            return
        offsets, sizes, blocks = self._free_by_stream[block.segment.stream]
        i = bisect_left(offsets, block.offset)
        assert blocks[i] is block, "removing a block that is not indexed"
        del offsets[i], sizes[i], blocks[i]

    def _index_resize(self, block: Block, old_size: int) -> None:
        chunked = self._chunked_by_stream.get(block.segment.stream)
        if chunked is not None:
            return chunked.resize(block)
        offsets, sizes, blocks = self._free_by_stream[block.segment.stream]
        i = bisect_left(offsets, block.offset)
        assert blocks[i] is block, "resizing a block that is not indexed"
        sizes[i] = block.size

    def _find(self, size: int, stream: int) -> Block | None:
        lists = self._free_by_stream.get(stream)
        if lists is None:
            chunked = self._chunked_by_stream.get(stream)
            found = None if chunked is None else chunked.find(size)
            return None if found is None else found[0]
        sizes = lists[1]
        fit = next(filter(size.__le__, sizes), 0)
        return lists[2][sizes.index(fit)] if fit else None

    def _allocate_chunked(
        self, chunked: _ChunkedFreeList, size: int, nbytes: int, stream: int, tag: str | None
    ) -> Allocation | None:
        """``_allocate`` on a chunked stream: the split's rest keeps the taken block's entry."""
        found = chunked.find(size)
        if found is None:  # a miss may release free segments and so turn the stream flat: the hooks
            block = self._miss(size, stream)
            return None if block is None else self._cut(block, size, nbytes, stream, tag)
        block, j, i = found
        a = cut_block(block, size, nbytes, stream, tag, self._split_min_bytes)
        rest = a.next
        if rest is not None and rest.free:
            chunked.replace(j, i, rest)
        else:
            chunked.delete(j, i)
            if chunked.num_entries < CHUNKED_FROM_ENTRIES // 2:
                self._flatten(stream)
        self.allocated_bytes += a.size
        return a

    def check_invariants(self) -> None:
        super().check_invariants()
        indexes = dict(self._free_by_stream)
        if (
            self._hot_lists is not None
        ):  # (not ``_hot_stream``: a copy of the pool has a copy of the sentinel)
            assert indexes.get(self._hot_stream) is self._hot_lists, (
                "the hot lists are not the hot stream's"
            )
        for stream, chunked in self._chunked_by_stream.items():
            assert stream not in indexes, f"stream {stream}: indexed flat and chunked"
            indexes[stream] = chunked.flat()
            assert chunked.num_entries == len(indexes[stream][0]) and all(chunked.offsets), (
                f"stream {stream}: chunk counts"
            )
            assert chunked.firsts == [c[0] for c in chunked.offsets], (
                f"stream {stream}: chunk first offsets"
            )
            assert all(map(int.__ge__, chunked.bounds, map(max, chunked.sizes))), (
                f"stream {stream}: chunk bounds"
            )
            assert len(chunked.bounds) == len(chunked.offsets), f"stream {stream}: chunk bounds"
            assert max(map(len, chunked.offsets), default=0) <= 2 * CHUNK_ENTRIES, (
                f"stream {stream}: a chunk too long"
            )
        for stream, (offsets, sizes, blocks) in indexes.items():
            expected = [b for b in self.blocks() if b.free and b.segment.stream == stream]
            assert blocks == expected, f"stream {stream}: the index and the free blocks differ"
            assert offsets == [b.offset for b in expected] and sizes == [b.size for b in expected]

    def _index_largest_bytes(self) -> int:
        largest = [max(sizes) for _, sizes, _ in self._free_by_stream.values() if sizes]
        largest += [c.largest_bytes() for c in self._chunked_by_stream.values()]
        return max(largest, default=0)
