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


def _precedes(a: Block, b: Block) -> bool:
    """Whether ``a`` comes before ``b`` in best fit's order of free blocks (smaller size first,
    then lower offset: ``bisect_blocks``'s order, which the keys ``size << shift | offset``
    encode). Compiled, a C function over the fields (``best_fit.pxd``; static, so the C compiler
    inlines it): the compiled hot paths' neighbour tests, where the keys were compared before."""
    return a.size < b.size or (a.size == b.size and a.offset < b.offset)


class _BestFitCore(Policy):
    """``BestFit``'s hot path: ``ContiguousPolicy._allocate`` (``_take`` + ``_cut``) and
    ``_free`` with the index's updates inlined, the same steps in one frame each instead of
    three to five (calls, not the list and dict work, are most of what a pure-Python pool pays
    per request).

    The compiled build declares it a ``cdef class`` (``best_fit.pxd``: the index and the split
    threshold as C fields, the block locals typed); ``BestFit`` stays a Python class over it
    and ``ContiguousPolicy`` (its knobs are ``ContiguousPolicy.__init__``'s, for ``get_params``),
    so this core is one more class in the MRO and nothing else. Compiled, the index keeps no
    keys (``BestFit._keyless``; only a class with best fit's own index runs these paths): a
    position is found by ``bisect_blocks`` over the blocks' C fields and the neighbour tests
    compare two blocks' fields (``_precedes``), where keys were read back from two-digit Python
    ints, stored, popped and inserted beside the blocks (most of what best fit's pair cost over
    size class's under PyTorch: benchmarks/RESULTS.md, sessions 18 and 20); an entry leaves the
    blocks list by ``list.pop(i)``, which Cython makes one ``memmove`` when the index is a
    ``Py_ssize_t`` (the positions are typed so), where ``del blocks[i]`` is CPython's general
    slice assignment (``list_ass_slice``, ~110 instructions: session 16). Interpreted, the keys
    stay beside the blocks and are what the paths bisect (``bisect_left``, one C call there) and
    compare; the ``del`` opcode stays, cheaper there than a method call.
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
        shift=cython.longlong,
        n=cython.longlong,
        m=cython.longlong,
        keeps_place=cython.bint,
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
        blocks = self._hot_blocks if stream is self._hot_stream else self._make_hot(stream)
        if not blocks:
            return self._cut_miss(size, nbytes, stream, tag)
        if _COMPILED:  # no keys: the blocks' C fields (class docstring)
            i = bisect_blocks(blocks, size, 0)
        else:
            keys = self._hot_keys
            shift = self._key_shift
            i = bisect_ints(keys, size << shift)
        if i == len(blocks):
            return self._cut_miss(size, nbytes, stream, tag)
        block = blocks[i]  # its entry stays until the rest's place is known
        a = cut_block(block, size, nbytes, stream, tag, self._split_min_bytes)
        rest = a.next
        if rest is not None and rest.free:  # a split: the rest goes back into the index
            if _COMPILED:
                keeps_place = i == 0 or _precedes(blocks[i - 1], rest)
            else:
                key = rest.size << shift | rest.offset
                keeps_place = i == 0 or keys[i - 1] < key
            if keeps_place:  # the rest keeps the block's place in the order: no shift
                blocks[i] = rest
                if not _COMPILED:
                    keys[i] = key
            elif _COMPILED:  # ``pop`` (class docstring)
                blocks.pop(i)
                blocks.insert(bisect_blocks(blocks, rest.size, rest.offset), rest)
            else:
                del keys[i], blocks[i]
                j = bisect_ints(keys, key)
                keys.insert(j, key)
                blocks.insert(j, rest)
        elif _COMPILED:  # ``pop`` (class docstring)
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

    def _make_hot(self, stream: int) -> list[Block]:
        """Make ``stream``'s lists the hot ones (``_hot_blocks``, and ``_hot_keys`` where the index
        keeps keys; made empty if it has none yet) and return its blocks: the hot paths' way to a
        stream other than the last one used."""
        # compiled, the hot paths keep no keys: only a class with best fit's own index runs them
        assert not _COMPILED or self._keyless, "compiled best fit's hot path on a keyed index"
        blocks = self._blocks_by_stream.get(stream)
        if blocks is None:
            blocks = self._blocks_by_stream[stream] = []
            if not self._keyless:
                self._keys_by_stream[stream] = []
        if not self._keyless:
            self._hot_keys = self._keys_by_stream[stream]
        self._hot_blocks = blocks
        self._hot_stream = stream
        return blocks

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
        keeps_place=cython.bint,
        alloc=Allocation,
    )
    def _free(self, allocation: Allocation) -> None:
        alloc = allocation  # compiled: typed, so its fields are read as C fields
        block: Block = alloc.handle  # a block is its own handle; a subclass's allocation wraps one
        size = block.size
        # no test of the keys' width (``_key_size_limit``), as ``_allocate`` has: compiled, the
        # index keeps no keys, and the blocks' sizes and offsets are C integers whatever the keys'
        # width would be; interpreted, keys are Python ints
        assert not block.free and size == alloc.size_bytes
        block.handle = None
        self.allocated_bytes -= size
        seg = block.segment
        seg.num_live -= 1
        blocks = self._hot_blocks if seg.stream is self._hot_stream else self._make_hot(seg.stream)
        if not _COMPILED:
            keys = self._hot_keys
            shift = self._key_shift
        nxt = block.next
        prev = block.prev
        survivor = (
            block  # the block that stays for the merged range, if ``prev`` does not absorb it
        )
        j = -1  # where ``nxt``'s entry was, once merged (its place is reused below)
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
            if _COMPILED:  # the next entry is above the grown ``prev``: it keeps its place
                keeps_place = i + 1 == len(blocks) or _precedes(prev, blocks[i + 1])
            else:
                key = size << shift | offset
                keeps_place = i + 1 == len(keys) or keys[i + 1] > key
            if keeps_place:  # it grew but keeps its place in the order
                if not _COMPILED:
                    keys[i] = key
            elif _COMPILED:  # ``pop`` (class docstring)
                blocks.pop(i)
                blocks.insert(bisect_blocks(blocks, size, offset), prev)
            else:
                del keys[i], blocks[i]
                i = bisect_ints(keys, key)
                keys.insert(i, key)
                blocks.insert(i, prev)
            after = prev.next = block.next
            if after is not None:
                after.prev = prev
            block.prev = block.next = None
        else:
            survivor.free = True
            offset = survivor.offset
            if j < 0:
                if _COMPILED:  # the blocks' C fields (class docstring)
                    blocks.insert(bisect_blocks(blocks, size, offset), survivor)
                else:
                    key = size << shift | offset
                    j = bisect_ints(keys, key)
                    keys.insert(j, key)
                    blocks.insert(j, survivor)
                return
            # it takes the absorbed block's place in the order if the next entry is above it
            if _COMPILED:
                keeps_place = j + 1 == len(blocks) or _precedes(survivor, blocks[j + 1])
            else:
                key = size << shift | offset
                keeps_place = j + 1 == len(keys) or keys[j + 1] > key
            if keeps_place:
                blocks[j] = survivor
                if not _COMPILED:
                    keys[j] = key
            elif _COMPILED:  # ``pop`` (class docstring)
                blocks.pop(j)
                blocks.insert(bisect_blocks(blocks, size, offset), survivor)
            else:
                del keys[j], blocks[j]
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
    C 64-bit integer; where a pool's keys cannot fit (``_key_size_limit`` -1) it takes the generic
    path, whose keys are Python ints.

    Compiled (``_keyless``), the index keeps no keys: the blocks list alone, in the same order
    (size, then offset), searched by ``bisect_blocks`` over the blocks' C fields, so a free or a
    split moves one list's entries, not two, and boxes no key (the keys list's ints, pops and
    inserts were most of what best fit's pair cost over size class's: benchmarks/RESULTS.md,
    session 20). ``_keys_by_stream`` and ``_hot_keys`` are then None; the key layout's limits
    (``_key_size_limit``, ``_rounded_request_limit``) still choose the hot or the generic path, so
    every decision is the keyed index's. A subclass with an index of its own (worst fit's keys)
    keeps the keys (``__init_subclass__``), as the interpreted build does (there ``bisect_left``
    over int keys is one C call, which a bisect over the blocks' attributes is not).
    """

    name = "best-fit"
    # the key's layout is part of the index: a subclass with other keys (worst fit) takes the
    # generic path
    _index_hooks = ContiguousPolicy._index_hooks + ("_key", "_fit_keys")
    #: whether the index keeps only its blocks lists, no keys (class docstring): compiled, and
    #: for a subclass only if it keeps best fit's index (the condition for running the hot paths)
    _keyless = _COMPILED

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if any(hook in cls.__dict__ for hook in cls._index_hooks):
            cls._keyless = False  # an index of its own (worst fit's keys) reads keys

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
        # per stream, the keys in order (None: a keyless index, class docstring)
        self._keys_by_stream: dict[int, list[int]] | None = None if self._keyless else {}
        self._blocks_by_stream: dict[
            int, list[Block]
        ] = {}  # per stream, the free blocks in the keys' order (the block of each key)
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
        if bits != old_bits and not self._keyless:  # the same order: the size field moves up
            for keys in self._keys_by_stream.values():
                keys[:] = [(k >> old_bits) << bits | (k & old_mask) for k in keys]

    def _index_add(self, block: Block) -> None:
        seg = block.segment
        if seg.offset + seg.nbytes > self._keys_end or seg.nbytes > self._max_segment_bytes:
            self._fit_keys(
                seg
            )  # its own test, inlined: most adds are of fitted segments (a call each costs)
        stream = seg.stream
        blocks = self._blocks_by_stream.get(stream)
        if self._keyless:
            if blocks is None:
                blocks = self._blocks_by_stream[stream] = []
            blocks.insert(bisect_blocks(blocks, block.size, block.offset), block)
            return
        if blocks is None:
            blocks = self._blocks_by_stream[stream] = []
            self._keys_by_stream[stream] = []
        keys = self._keys_by_stream[stream]
        key = self._key(block.size, block.offset)
        i = bisect_left(keys, key)
        keys.insert(i, key)
        blocks.insert(i, block)

    def _index_pop(self, block: Block, size: int) -> None:
        """Take ``block``, indexed under ``size`` (its size, or what it was before it grew), out
        of its stream's lists.

        Keyless, ``block`` is found by bisecting the blocks on ``(size, block.offset)`` even when
        ``block.size`` already grew past ``size`` (``_index_resize``): every entry before it is
        below that pair and every entry after it above (the list was in order before it grew), and
        the grown ``block`` is above it too, so the first entry at or above the pair is still
        ``block``'s (tests/policies/test_best_fit_keys.py checks it)."""
        stream = block.segment.stream
        blocks = self._blocks_by_stream[stream]
        if self._keyless:
            i = bisect_blocks(blocks, size, block.offset)
        else:
            keys = self._keys_by_stream[stream]
            i = bisect_left(keys, self._key(size, block.offset))
        assert i < len(blocks) and blocks[i] is block, "a block that is not indexed"
        del blocks[i]
        if not self._keyless:
            del keys[i]

    def _index_remove(self, block: Block) -> None:
        self._index_pop(block, block.size)

    def _index_resize(self, block: Block, old_size: int) -> None:
        self._index_pop(block, old_size)  # already grown: see ``_index_pop``
        self._index_add(block)  # a grown range: _index_add fits the keys to it

    def _find(self, size: int, stream: int) -> Block | None:
        i = self._fit_position(size, stream)
        return None if i < 0 else self._blocks_by_stream[stream][i]

    def _take(self, size: int, stream: int) -> Block | None:
        i = self._fit_position(size, stream)
        if i < 0:
            return None
        if not self._keyless:
            del self._keys_by_stream[stream][i]
        return self._blocks_by_stream[stream].pop(i)

    def _fit_position(self, size: int, stream: int) -> int:
        """The position of the smallest free block of ``stream`` that holds ``size`` (the lowest
        offset of those), or -1."""
        blocks = self._blocks_by_stream.get(stream)
        if not blocks:
            return -1
        if self._keyless:
            # the last block is the largest; compared first as objects: ``size`` may be past a C
            # 64-bit integer (the generic path's requests), which no block's size is
            if blocks[-1].size < size:
                return -1
            return bisect_blocks(blocks, size, 0)
        keys = self._keys_by_stream[stream]
        i = bisect_left(keys, size << self._key_shift)
        return i if i < len(keys) else -1

    def check_invariants(self) -> None:
        super().check_invariants()
        order = (
            (lambda b: (b.size, b.offset))
            if self._keyless
            else (lambda b: self._key(b.size, b.offset))
        )
        free_blocks = sorted((b for b in self.blocks() if b.free), key=order)
        expected: dict[int, list[Block]] = {}
        for b in free_blocks:
            expected.setdefault(b.segment.stream, []).append(b)
        if self._keyless:
            assert self._keys_by_stream is None and self._hot_keys is None, (
                "a keyless index has keys"
            )
        else:
            assert self._keys_by_stream.keys() == self._blocks_by_stream.keys(), (
                "keys and blocks index other streams"
            )
        if (
            self._hot_blocks is not None
        ):  # (not ``_hot_stream``: a copy of the pool has a copy of the sentinel)
            assert self._hot_blocks is self._blocks_by_stream.get(self._hot_stream) and (
                self._keyless or self._hot_keys is self._keys_by_stream[self._hot_stream]
            ), "the hot lists are another stream's"
        assert expected.keys() <= self._blocks_by_stream.keys(), (
            "a stream's free blocks are not indexed"
        )
        for stream, blocks in self._blocks_by_stream.items():
            # in the index's order: sizes, then offsets (keyless: the order is the blocks' own)
            assert blocks == expected.get(stream, []), (
                f"stream {stream}: blocks differ from the free blocks in order"
            )
            if not self._keyless:
                assert self._keys_by_stream[stream] == [
                    self._key(b.size, b.offset) for b in blocks
                ], f"stream {stream}: keys differ from the blocks"

    def _index_largest_bytes(self) -> int:
        # each stream's largest block is its last: a plain loop (a monitor sample, every 256
        # calls under PyTorch; the generator and ``max`` it replaces cost 4x more)
        if self._keyless:
            largest = 0
            for blocks in self._blocks_by_stream.values():
                if blocks and blocks[-1].size > largest:
                    largest = blocks[-1].size
            return largest
        bits, units = self._offset_bits, 0
        for keys in self._keys_by_stream.values():
            if keys and keys[-1] >> bits > units:
                units = keys[-1] >> bits
        return units << self._unit_bits
