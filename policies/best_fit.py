"""Best fit: the smallest free block that fits (ties: lowest address), split and coalesced.

The general-purpose classic (RMM's pool, CuPy's MemoryPool and PyTorch's caching allocator
are best fit at heart): large free blocks stay whole for large requests.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from policies._blocks import OFFSET_BITS, Block, ContiguousPolicy, cut_block
from policies.base import Allocation, Policy, Segment

try:
    import cython
except ImportError:  # a pure install: the same names as no-ops (policies/_cython_shim.py)
    from policies._cython_shim import cython

__all__ = ["BestFit"]

_OFFSET_MASK = (1 << OFFSET_BITS) - 1


class _BestFitCore(Policy):
    """``BestFit``'s hot path: ``ContiguousPolicy._allocate`` (``_take`` + ``_cut``) and
    ``_free`` with the index's updates inlined, the same steps in one frame each instead of
    three to five (calls, not the list and dict work, are most of what a pure-Python pool pays
    per request).

    The compiled build declares it a ``cdef class`` (``best_fit.pxd``: the index and the split
    threshold as C fields, the block locals typed); ``BestFit`` stays a Python class over it
    and ``ContiguousPolicy`` (its knobs are ``ContiguousPolicy.__init__``'s, for ``get_params``),
    so this core is one more class in the MRO and nothing else.
    """

    @cython.locals(block=Block, a=Block, rest=Block, keys=list, free_at=dict, i=cython.longlong)
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        mask = self._round_mask
        size = (nbytes + mask) & ~mask if mask is not None else self.rounded_size(nbytes)
        keys = self._keys_by_stream.get(stream)
        free_at = self._free_at
        i = len(keys) if keys else 0  # where the taken block's key sits (0 and no keys: none)
        if i:
            i = bisect_left(keys, size << OFFSET_BITS)
            if i < len(keys):
                block = free_at.pop(keys[i] & _OFFSET_MASK)  # its key stays until the rest's is known
            else:
                i = 0
                keys = None
        if not keys:
            block = self._miss(size, stream)
            if block is None:
                return None
            keys = None
        a = cut_block(block, size, nbytes, stream, tag, self._split_min_bytes)
        rest = a.next
        if rest is not None and rest.free:  # a split: the rest goes back into the index
            rest_offset = rest.offset
            key = rest.size << OFFSET_BITS | rest_offset
            if keys is None:  # a miss: the block came from outside the index
                keys = self._keys_by_stream.get(stream)
                if keys is None:
                    keys = self._keys_by_stream[stream] = []
                insort(keys, key)
            elif i == 0 or keys[i - 1] < key:  # the rest keeps the block's place in the order: no shift
                keys[i] = key
            else:
                del keys[i]
                insort(keys, key)
            free_at[rest_offset] = rest
        elif keys is not None:
            del keys[i]
        self.allocated_bytes += a.size
        return a

    @cython.locals(block=Block, nxt=Block, prev=Block, after=Block, seg=Segment, keys=list, free_at=dict,
                   size=cython.longlong, i=cython.longlong, j=cython.longlong)
    def _free(self, allocation: Allocation) -> None:
        block: Block = allocation.handle  # a block is its own handle; a subclass's allocation wraps one
        size = block.size
        assert not block.free and size == allocation.size_bytes
        block.handle = None
        self.allocated_bytes -= size
        seg = block.segment
        seg.num_live -= 1
        free_at = self._free_at
        nxt = block.next
        if nxt is not None and nxt.free:  # absorb the free block above; its key is reused below
            keys = self._keys_by_stream[seg.stream]
            key = nxt.size << OFFSET_BITS | nxt.offset
            j = bisect_left(keys, key)
            assert keys[j] == key, "removing a block that is not indexed"
            del free_at[nxt.offset]
            size += nxt.size
            block.size = size
            after = block.next = nxt.next
            if after is not None:
                after.prev = block
            nxt.prev = nxt.next = None
        else:
            keys = None
            j = 0
        prev = block.prev
        if prev is not None and prev.free:  # merge into the free block below, re-keyed by its new size
            if keys is None:
                keys = self._keys_by_stream[seg.stream]
            else:
                del keys[j]
            offset = prev.offset
            key = prev.size << OFFSET_BITS | offset
            i = bisect_left(keys, key)
            assert keys[i] == key, "resizing a block that is not indexed"
            size += prev.size
            prev.size = size
            key = size << OFFSET_BITS | offset
            if i + 1 == len(keys) or keys[i + 1] > key:  # it grew but keeps its place in the order
                keys[i] = key
            else:
                del keys[i]
                insort(keys, key)
            after = prev.next = block.next
            if after is not None:
                after.prev = prev
            block.prev = block.next = None
        else:
            block.free = True
            offset = block.offset
            key = size << OFFSET_BITS | offset
            if keys is None:
                keys = self._keys_by_stream.get(seg.stream)
                if keys is None:
                    keys = self._keys_by_stream[seg.stream] = []
                insort(keys, key)
            elif j + 1 == len(keys) or keys[j + 1] > key:  # it takes the absorbed block's place in the order
                keys[j] = key
            else:
                del keys[j]
                insort(keys, key)
            free_at[offset] = block


class BestFit(_BestFitCore, ContiguousPolicy):
    """Serve each request from the smallest free block that holds it; lowest address on ties.

    Free blocks serve only requests on the stream their segment was reserved for (as in
    PyTorch and CuPy: reuse across streams would need an event to be safe). Knobs: see
    ``ContiguousPolicy``.

    Index: per stream, one sorted ``list`` of int keys ``size << 64 | offset``, so the best fit
    is the first key >= ``size << 64`` (an O(log n) bisect). A plain list rather than a
    ``SortedList`` because ``bisect``/``insort``/``del`` run in C: 2-4x faster up to ~5,000 free
    blocks per stream (pools hold tens to a few thousand); inserts and deletes move O(n)
    pointers, so at 30,000 free blocks an add+remove costs ~6 us against SortedList's ~1.5 us.
    """

    name = "best-fit"

    # the core's inlined hot path goes with this class's index (``ContiguousPolicy.__init_subclass__``
    # gives a subclass that brings another index the generic path)
    _allocate = vars(_BestFitCore)["_allocate"]  # vars(): compiled, the method itself, not its C function
    _free = vars(_BestFitCore)["_free"]

    @staticmethod
    def _key(size: int, offset: int) -> int:
        """The index key (the hot paths inline it): smallest size first, then lowest offset."""
        return size << OFFSET_BITS | offset

    def _index_reset(self) -> None:
        self._keys_by_stream: dict[int, list[int]] = {}
        self._free_at: dict[int, Block] = {}  # offset -> free block

    def _index_add(self, block: Block) -> None:
        stream = block.segment.stream
        keys = self._keys_by_stream.get(stream)
        if keys is None:
            keys = self._keys_by_stream[stream] = []
        insort(keys, block.size << OFFSET_BITS | block.offset)
        self._free_at[block.offset] = block

    def _index_remove(self, block: Block) -> None:
        keys = self._keys_by_stream[block.segment.stream]
        key = block.size << OFFSET_BITS | block.offset
        i = bisect_left(keys, key)
        assert keys[i] == key, "removing a block that is not indexed"
        del keys[i]
        del self._free_at[block.offset]

    def _index_resize(self, block: Block, old_size: int) -> None:
        keys = self._keys_by_stream[block.segment.stream]
        key = old_size << OFFSET_BITS | block.offset
        i = bisect_left(keys, key)
        assert keys[i] == key, "resizing a block that is not indexed"
        del keys[i]
        insort(keys, block.size << OFFSET_BITS | block.offset)

    def _find(self, size: int, stream: int) -> Block | None:
        keys = self._keys_by_stream.get(stream)
        if not keys:
            return None
        i = bisect_left(keys, size << OFFSET_BITS)
        return self._free_at[keys[i] & _OFFSET_MASK] if i < len(keys) else None

    def _take(self, size: int, stream: int) -> Block | None:
        keys = self._keys_by_stream.get(stream)
        if not keys:
            return None
        i = bisect_left(keys, size << OFFSET_BITS)
        return self._free_at.pop(keys.pop(i) & _OFFSET_MASK) if i < len(keys) else None

    def check_invariants(self) -> None:
        super().check_invariants()
        free_blocks = {b.offset: b for b in self.blocks() if b.free}
        assert self._free_at == free_blocks, "the index and the free blocks differ"
        expected: dict[int, list[int]] = {}
        for b in free_blocks.values():
            expected.setdefault(b.segment.stream, []).append(self._key(b.size, b.offset))
        for stream, keys in self._keys_by_stream.items():
            assert keys == sorted(expected.get(stream, [])), f"stream {stream}: keys differ from the free blocks"

    def _index_largest_bytes(self) -> int:
        return max((keys[-1] >> OFFSET_BITS for keys in self._keys_by_stream.values() if keys), default=0)
