"""Best fit: the smallest free block that fits (ties: lowest address), split and coalesced.

The general-purpose classic (RMM's pool, CuPy's MemoryPool and PyTorch's caching allocator
are best fit at heart): large free blocks stay whole for large requests.
"""

from __future__ import annotations

from bisect import bisect_left

from policies._blocks import (
    NO_STREAM,
    Block,
    ContiguousPolicy,
    bisect_blocks,
    bisect_ints,
    cut_block,
    merge_down,
)
from policies.base import Allocation, Policy, Segment

try:
    import cython
except ImportError:  # a pure install: the same names as no-ops (policies/_cython_shim.py)
    from policies._cython_shim import cython

__all__ = ["BestFit"]

#: whether this module is compiled: its hot paths then bisect C integers, so keys must fit 63 bits
_COMPILED = cython.compiled


class _BestFitCore(Policy):
    """``BestFit``'s hot path: ``ContiguousPolicy._allocate`` (``_take`` + ``_cut``) and
    ``_free`` with the index's updates inlined, the same steps in one frame each instead of
    three to five (calls, not the list and dict work, are most of what a pure-Python pool pays
    per request).

    The compiled build declares it a ``cdef class`` (``best_fit.pxd``: the index and the split
    threshold as C fields, the block locals typed); ``BestFit`` stays a Python class over it
    and ``ContiguousPolicy`` (its knobs are ``ContiguousPolicy.__init__``'s, for ``get_params``),
    so this core is one more class in the MRO and nothing else. A key read back from a list goes
    into ``k`` (a walrus inside a condition), typed ``long long``: compiled, the comparison is then
    C's, where ``keys[i] < key`` would box ``key`` into a fresh Python int first. Compiled, an
    index entry leaves its two lists by ``list.pop(i)``, which Cython makes one ``memmove`` when
    the index is a ``Py_ssize_t`` (the positions are typed so; with a ``long long`` it calls the
    method), where ``del keys[i]`` is CPython's general slice assignment (``list_ass_slice``,
    ~110 instructions a list: benchmarks/RESULTS.md, session 16); interpreted the ``del`` opcode
    stays, cheaper there than a method call. Compiled, a position in the index is found by
    ``bisect_blocks`` over the blocks' C fields, not ``bisect_ints`` over the keys, each of which
    it would read back from a two-digit Python int (a quarter of best fit's ``_free``: session 18);
    interpreted, ``bisect_left`` over the keys stays (one C call there).
    """

    @cython.locals(
        block=Block,
        a=Block,
        rest=Block,
        keys=list,
        blocks=list,
        i=cython.Py_ssize_t,
        j=cython.Py_ssize_t,
        size=cython.longlong,
        key=cython.longlong,
        k=cython.longlong,
        shift=cython.longlong,
        n=cython.longlong,
        m=cython.longlong,
    )
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        mask = self._round_mask
        if not _COMPILED:
            size = (nbytes + mask) & ~mask if mask is not None else self.rounded_size(nbytes)
        elif (
            mask is not None and nbytes <= self._rounded_request_limit
        ):  # compared as objects: no overflow
            n = nbytes
            m = mask
            size = (n + m) & ~m  # in C: the limit leaves room for the mask and the key
        # a key past 63 bits, or a rounding not a power of two: the generic path's Python ints
        else:
            return ContiguousPolicy._allocate(self, nbytes, stream, tag)
        keys = self._hot_keys if stream is self._hot_stream else self._make_hot(stream)
        if not keys:
            return self._cut_miss(size, nbytes, stream, tag)
        shift = self._key_shift
        blocks = self._hot_blocks
        if _COMPILED:  # the blocks' C fields (class docstring)
            i = bisect_blocks(blocks, size, 0)
        else:
            i = bisect_ints(keys, size << shift)
        if i == len(keys):
            return self._cut_miss(size, nbytes, stream, tag)
        block = blocks[i]  # its key and entry stay until the rest's are known
        a = cut_block(block, size, nbytes, stream, tag, self._split_min_bytes)
        rest = a.next
        if rest is not None and rest.free:  # a split: the rest goes back into the index
            key = rest.size << shift | rest.offset
            if (
                i == 0 or keys[i - 1] < key
            ):  # the rest keeps the block's place in the order: no shift
                keys[i] = key
                blocks[i] = rest
            else:
                if _COMPILED:  # compiled: ``pop`` (class docstring)
                    keys.pop(i)
                    blocks.pop(i)
                else:
                    del keys[i], blocks[i]
                j = (
                    bisect_blocks(blocks, rest.size, rest.offset)
                    if _COMPILED
                    else bisect_ints(keys, key)
                )
                keys.insert(j, key)
                blocks.insert(j, rest)
        else:
            if _COMPILED:  # compiled: ``pop`` (class docstring)
                keys.pop(i)
                blocks.pop(i)
            else:
                del keys[i], blocks[i]
        self.allocated_bytes += a.size
        return a

    def _cut_miss(self, size: int, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        """No free block holds ``size``: grow (``_miss``), fit the keys to the segment, cut."""
        block = self._miss(size, stream)
        if block is None:
            return None
        self._fit_keys(block.segment)
        return self._cut(block, size, nbytes, stream, tag)

    def _make_hot(self, stream: int) -> list[int]:
        """Make ``stream``'s lists the hot ones (``_hot_keys``, ``_hot_blocks``; made empty if it
        has none yet) and return its keys: the hot paths' way to a stream other than the last one
        used."""
        keys = self._keys_by_stream.get(stream)
        if keys is None:
            keys = self._keys_by_stream[stream] = []
            self._blocks_by_stream[stream] = []
        self._hot_keys = keys
        self._hot_blocks = self._blocks_by_stream[stream]
        self._hot_stream = stream
        return keys

    @cython.locals(
        block=Block,
        nxt=Block,
        prev=Block,
        after=Block,
        survivor=Block,
        seg=Segment,
        keys=list,
        blocks=list,
        size=cython.longlong,
        i=cython.Py_ssize_t,
        j=cython.Py_ssize_t,
        key=cython.longlong,
        shift=cython.longlong,
        offset=cython.longlong,
        k=cython.longlong,
        alloc=Allocation,
    )
    def _free(self, allocation: Allocation) -> None:
        alloc = allocation  # compiled: typed, so its fields are read as C fields
        block: Block = alloc.handle  # a block is its own handle; a subclass's allocation wraps one
        size = block.size
        if (
            _COMPILED and block.segment.nbytes > self._key_size_limit
        ):  # keys past 63 bits: Python ints
            return ContiguousPolicy._free(self, allocation)
        assert not block.free and size == alloc.size_bytes
        block.handle = None
        self.allocated_bytes -= size
        seg = block.segment
        seg.num_live -= 1
        keys = self._hot_keys if seg.stream is self._hot_stream else self._make_hot(seg.stream)
        blocks = self._hot_blocks
        shift = self._key_shift
        nxt = block.next
        prev = block.prev
        survivor = (
            block  # the block that stays for the merged range, if ``prev`` does not absorb it
        )
        j = -1  # where ``nxt``'s key was, once merged (its place is reused below)
        if nxt is not None and nxt.free:  # merge with the free block above
            if _COMPILED:  # the blocks' C fields (class docstring)
                j = bisect_blocks(blocks, nxt.size, nxt.offset)
            else:
                j = bisect_ints(keys, nxt.size << shift | nxt.offset)
            assert blocks[j] is nxt, "removing a block that is not indexed"
            size += nxt.size
            if not nxt.size_bytes and (prev is None or not prev.free):  # ``nxt`` absorbs the block
                merge_down(block, nxt, prev, seg)
                survivor = nxt
            else:
                block.size = size
                after = block.next = nxt.next
                if after is not None:
                    after.prev = block
                nxt.prev = nxt.next = None
        if (
            prev is not None and prev.free
        ):  # merge into the free block below, re-keyed by its new size
            if j >= 0:
                if _COMPILED:  # compiled: ``pop`` (class docstring)
                    keys.pop(j)
                    blocks.pop(j)
                else:
                    del keys[j], blocks[j]
            offset = prev.offset
            if _COMPILED:  # the blocks' C fields (class docstring)
                i = bisect_blocks(blocks, prev.size, offset)
            else:
                i = bisect_ints(keys, prev.size << shift | offset)
            assert blocks[i] is prev, "resizing a block that is not indexed"
            size += prev.size
            prev.size = size
            key = size << shift | offset
            if (
                i + 1 == len(keys) or (k := keys[i + 1]) > key
            ):  # it grew but keeps its place in the order
                keys[i] = key
            else:
                if _COMPILED:  # compiled: ``pop`` (class docstring)
                    keys.pop(i)
                    blocks.pop(i)
                else:
                    del keys[i], blocks[i]
                i = bisect_blocks(blocks, size, offset) if _COMPILED else bisect_ints(keys, key)
                keys.insert(i, key)
                blocks.insert(i, prev)
            after = prev.next = block.next
            if after is not None:
                after.prev = prev
            block.prev = block.next = None
        else:
            survivor.free = True
            key = size << shift | survivor.offset
            if j < 0:
                if _COMPILED:  # the blocks' C fields (class docstring)
                    j = bisect_blocks(blocks, size, survivor.offset)
                else:
                    j = bisect_ints(keys, key)
                keys.insert(j, key)
                blocks.insert(j, survivor)
            elif (
                j + 1 == len(keys) or (k := keys[j + 1]) > key  # noqa: F841 (the walrus types it)
            ):  # it takes the absorbed block's place in the order
                keys[j] = key
                blocks[j] = survivor
            else:
                if _COMPILED:  # compiled: ``pop`` (class docstring)
                    keys.pop(j)
                    blocks.pop(j)
                else:
                    del keys[j], blocks[j]
                if _COMPILED:  # the blocks' C fields (class docstring)
                    j = bisect_blocks(blocks, size, survivor.offset)
                else:
                    j = bisect_ints(keys, key)
                keys.insert(j, key)
                blocks.insert(j, survivor)


class BestFit(_BestFitCore, ContiguousPolicy):
    """Serve each request from the smallest free block that holds it; lowest address on ties.

    Free blocks serve only requests on the stream their segment was reserved for (as in
    PyTorch and CuPy: reuse across streams would need an event to be safe). Knobs: see
    ``ContiguousPolicy``.

    Index: per stream, one sorted ``list`` of int keys ``size << _key_shift | offset`` (the size
    in units of ``alignment_bytes`` above an offset field as wide as the highest segment end), so
    the best fit is the first key >= ``size << _key_shift`` (an O(log n) bisect), and beside it a
    list of the blocks in the same order (``blocks[i]`` is ``keys[i]``'s block: every insert and
    delete is made at the same position in both), so a found key gives its block by position, not
    through an offset -> block dict (no hash, no boxed offset; faster in both builds). Plain lists
    rather than a ``SortedList`` because ``bisect``/``insert``/``del`` run in C: 2-4x faster up to
    ~5,000 free blocks per stream (pools hold tens to a few thousand); inserts and deletes move
    O(n) pointers, so at 30,000 free blocks an add+remove costs ~6 us against SortedList's ~1.5 us.
    The offset field is as narrow as the segments allow (not a fixed 64 bits) so that keys fit a
    C 64-bit integer: the compiled build then bisects with C comparisons; where a pool's keys
    cannot fit (``_key_size_limit`` -1) it takes the generic path, whose keys are Python ints.
    """

    name = "best-fit"
    # the key's layout is part of the index: a subclass with other keys (worst fit) takes the
    # generic path
    _index_hooks = ContiguousPolicy._index_hooks + ("_key", "_fit_keys")

    # the core's inlined hot path goes with this class's index
    # (``ContiguousPolicy.__init_subclass__`` gives a subclass that brings another index the generic
    # path)
    _allocate = vars(_BestFitCore)[
        "_allocate"
    ]  # vars(): compiled, the method itself, not its C function
    _free = vars(_BestFitCore)["_free"]

    def _key(self, size: int, offset: int) -> int:
        """The index key (the hot paths inline it): smallest size first, then lowest offset."""
        return size << self._key_shift | offset

    def _index_reset(self) -> None:
        self._keys_by_stream: dict[int, list[int]] = {}
        self._blocks_by_stream: dict[
            int, list[Block]
        ] = {}  # per stream, the block of each key, same order
        # the lists of the stream the hot paths used last, beside the dicts: one identity test
        # instead of two dict lookups a call (a trace's requests are nearly all on one stream)
        self._hot_stream: object = NO_STREAM
        self._hot_keys: list[int] | None = None
        self._hot_blocks: list[Block] | None = None
        self._unit_bits = self.alignment_bytes.bit_length() - 1  # every block size is a multiple
        self._max_segment_bytes = (
            0  # no block is larger than the largest segment the keys were fit to
        )
        self._set_offset_bits(self._unit_bits)

    def _set_offset_bits(self, offset_bits: int) -> None:
        """Key offsets below ``2**offset_bits`` (the keys already in the index are the caller's)."""
        self._offset_bits = offset_bits
        self._keys_end = 1 << offset_bits  # the first offset the keys cannot hold
        self._key_shift = offset_bits - self._unit_bits
        self._offset_mask = (1 << offset_bits) - 1
        # the largest size whose key fits a C 64-bit integer, or -1 if a segment's blocks may not
        limit = (1 << (63 - self._key_shift)) - 1 if self._key_shift < 63 else -1
        self._key_size_limit = limit = limit if self._max_segment_bytes <= limit else -1
        # the largest request whose rounding (``nbytes + mask``) and key both fit, or -1: the
        # compiled hot path compares the request with it before it reads it as a C integer
        mask = self._round_mask
        self._rounded_request_limit = (
            limit - mask if mask is not None and 0 <= mask <= limit else -1
        )

    def _fit_keys(self, segment: Segment) -> None:
        """Widen the keys' offset field to hold ``segment`` (re-keying the index: rare, as the
        highest segment end doubles) and lower ``_key_size_limit`` to what its blocks need.
        Called for every segment before a key of its blocks is made."""
        end = segment.end
        if end <= self._keys_end and segment.nbytes <= self._max_segment_bytes:
            return
        self._max_segment_bytes = max(self._max_segment_bytes, segment.nbytes)
        old_bits = self._offset_bits
        bits = max(old_bits, end.bit_length())
        old_mask = self._offset_mask
        self._set_offset_bits(bits)
        if bits != old_bits:  # the same order: the size field moves up, the offsets stay
            for keys in self._keys_by_stream.values():
                keys[:] = [(k >> old_bits) << bits | (k & old_mask) for k in keys]

    def _index_add(self, block: Block) -> None:
        seg = block.segment
        if seg.offset + seg.nbytes > self._keys_end or seg.nbytes > self._max_segment_bytes:
            self._fit_keys(
                seg
            )  # its own test, inlined: most adds are of fitted segments (a call each costs)
        stream = seg.stream
        keys = self._keys_by_stream.get(stream)
        if keys is None:
            keys = self._keys_by_stream[stream] = []
            self._blocks_by_stream[stream] = []
        key = self._key(block.size, block.offset)
        i = bisect_left(keys, key)
        keys.insert(i, key)
        self._blocks_by_stream[stream].insert(i, block)

    def _index_position(self, stream: int, key: int) -> int:
        """Where ``key`` is in ``stream``'s keys (and its block in the blocks); it must be there."""
        keys = self._keys_by_stream[stream]
        i = bisect_left(keys, key)
        assert i < len(keys) and keys[i] == key, "a block that is not indexed"
        return i

    def _index_remove(self, block: Block) -> None:
        stream = block.segment.stream
        i = self._index_position(stream, self._key(block.size, block.offset))
        del self._keys_by_stream[stream][i], self._blocks_by_stream[stream][i]

    def _index_resize(self, block: Block, old_size: int) -> None:
        stream = block.segment.stream
        i = self._index_position(stream, self._key(old_size, block.offset))
        del self._keys_by_stream[stream][i], self._blocks_by_stream[stream][i]
        self._index_add(block)  # a grown range: _index_add fits the keys to it

    def _find(self, size: int, stream: int) -> Block | None:
        keys = self._keys_by_stream.get(stream)
        if not keys:
            return None
        i = bisect_left(keys, size << self._key_shift)
        return self._blocks_by_stream[stream][i] if i < len(keys) else None

    def _take(self, size: int, stream: int) -> Block | None:
        keys = self._keys_by_stream.get(stream)
        if not keys:
            return None
        i = bisect_left(keys, size << self._key_shift)
        if i == len(keys):
            return None
        del keys[i]
        return self._blocks_by_stream[stream].pop(i)

    def check_invariants(self) -> None:
        super().check_invariants()
        free_blocks = sorted(
            (b for b in self.blocks() if b.free), key=lambda b: self._key(b.size, b.offset)
        )
        expected: dict[int, list[Block]] = {}
        for b in free_blocks:
            expected.setdefault(b.segment.stream, []).append(b)
        assert self._keys_by_stream.keys() == self._blocks_by_stream.keys(), (
            "keys and blocks index other streams"
        )
        if (
            self._hot_keys is not None
        ):  # (not ``_hot_stream``: a copy of the pool has a copy of the sentinel)
            assert (
                self._hot_keys is self._keys_by_stream.get(self._hot_stream)
                and self._hot_blocks is self._blocks_by_stream[self._hot_stream]
            ), "the hot lists are another stream's"
        assert expected.keys() <= self._keys_by_stream.keys(), (
            "a stream's free blocks are not indexed"
        )
        for stream, keys in self._keys_by_stream.items():
            blocks = expected.get(stream, [])
            assert self._blocks_by_stream[stream] == blocks, (
                f"stream {stream}: blocks differ from the free blocks"
            )
            assert keys == [self._key(b.size, b.offset) for b in blocks], (
                f"stream {stream}: keys differ from the blocks"
            )

    def _index_largest_bytes(self) -> int:
        # each stream's largest block is its last key: a plain loop (a monitor sample, every 256
        # calls under PyTorch; the generator and ``max`` it replaces cost 4x more)
        bits, units = self._offset_bits, 0
        for keys in self._keys_by_stream.values():
            if keys and keys[-1] >> bits > units:
                units = keys[-1] >> bits
        return units << self._unit_bits
