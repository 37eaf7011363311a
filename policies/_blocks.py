"""Blocks and segments for contiguous policies: splitting, coalescing, growth and shrink.

Every contiguous policy (first fit, best fit, worst fit, the PyTorch and CuPy emulations) keeps
each reserved segment as a chain of blocks that tile it exactly, in address order. A
policy differs from another only in where it places a request, so ``ContiguousPolicy``
implements the ``Policy`` hooks around an abstract index of free blocks and a subclass fills in
``_index_reset``, ``_index_add``, ``_index_remove`` and ``_find``.

Invariants (``ContiguousPolicy.check_invariants`` asserts them; the tests call it after
random operation sequences):

- the blocks of a segment tile ``[segment.offset, segment.end)`` with no gap or overlap;
- a block is in the free index exactly when ``block.free`` is true (subclasses extend
  ``check_invariants`` with their index's own checks);
- no two free blocks of a segment touch (freeing coalesces at once), so a segment with no live
  allocation (``segment.num_live == 0``) is a single free block and can be released in O(1);
- ``segment.handle`` is the segment's first block (a block cut from it for a request takes its
  place, as does a free block merged down over it: ``merge_down``);
- every block size is a multiple of ``alignment_bytes`` (so every block starts aligned: segments
  start on 2 MiB boundaries).

**Virtual segments that grow in place** (``virtual=True``, any contiguous policy: "the same
policy, virtual-memory-backed"): the design of PyTorch's expandable segments, for any placement
rule. Each stream's pool is ONE virtual range reserved on a page-mapped device
(``policies.mapped_device``; ``VIRTUAL_RANGE_BYTES``, far beyond any capacity: address space
is free), and its ``Segment`` is the mapped prefix of that range. A miss maps just enough
granule pages at the end (``map_new``: create, map, one set-access) for the request to fit in
the free block already at the end, which the new pages extend: so the free tail coalesces with
them and a block may span pages mapped at different times. ``trim`` unmaps and releases the
whole free pages at the end (fully free pages inside a range stay mapped: PyTorch unmaps those
too, which would leave holes in a segment; not modelled). Capacity counts mapped (physical)
bytes. Counters: ``num_grows``/``num_shrinks`` count ranges coming and going (a segment is a
range), ``grown_bytes``/``shrunk_bytes`` every page mapped and unmapped; the device's ``n_map``
counts each mapping call.
"""

from __future__ import annotations

import abc
import inspect
from typing import ClassVar, Iterator

from policies.base import Allocation, Policy, Segment, check_positive_int
from policies.device import SEGMENT_ALIGNMENT_BYTES, Device
from policies.device_kind import DeviceKind
from policies.errors import PolicyError
from traces.knobs import check_flag
from policies.mapped_device import as_page_mapped
from policies.units import round_up

try:
    import cython
except ImportError:  # a pure install: the same names as no-ops (policies/_cython_shim.py)
    from policies._cython_shim import cython

__all__ = [
    "NO_STREAM",
    "OFFSET_BITS",
    "Block",
    "ContiguousPolicy",
    "VIRTUAL_RANGE_BYTES",
    "bisect_blocks",
    "bisect_ints",
    "cut_block",
    "merge_down",
]

#: The virtual range a ``virtual=True`` pool reserves per stream: 1 TiB, past any GPU's memory
#: (reserving costs microseconds and no physical memory), so a range never has to move.
VIRTUAL_RANGE_BYTES = 1 << 40

_DEFAULT_SEGMENT_BYTES = (
    32 << 20
)  # 32 MiB: between PyTorch's 20 MiB large segments and RMM's doubling pools
_DEFAULT_ALIGNMENT_BYTES = 256  # RMM's pool alignment (field notes; PyTorch and CuPy round to 512)
#: Offsets are below 2**64 (device pointers are), so indexes may pack them into int keys.
OFFSET_BITS = 64
#: The hot stream of a free-block index that has none (best and first fit keep the lists of the
#: stream their hot paths used last): no stream is this object, so no call takes it for its own.
NO_STREAM = object()


@cython.locals(lo=cython.longlong, hi=cython.longlong, mid=cython.longlong, v=cython.longlong)
def bisect_ints(values: list[int], value: int) -> int:
    """``bisect_left(values, value)`` over ints that fit a C 64-bit integer (block offsets and
    sizes: ``Block``'s are C fields in the compiled build; best fit's keys, which its hot paths
    check); compiled, a C loop with C comparisons that boxes nothing, where ``bisect_left`` would
    get ``value`` boxed and compare Python ints. Interpreted it is ``bisect_left`` itself (rebound
    below: the C-implemented one beats this loop). Shared by best and first fit's hot paths."""
    lo = 0  # the first index whose value may be >= value
    hi = len(values)
    while lo < hi:
        mid = (lo + hi) >> 1
        v = values[mid]
        if v < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


if not cython.compiled:  # interpreted: the C-implemented bisect module (one call instead of a loop)
    from bisect import bisect_left as bisect_ints  # noqa: F811


class Block(Allocation):
    """A range ``[offset, offset + size)`` of one segment, free or handed out: handed out, it IS
    the ``Allocation`` (one object per request, not a block and an allocation).

    ``prev``/``next`` are the address neighbours inside the same segment (None at its ends),
    so coalescing a freed block is O(1). Compared by identity (``Allocation`` has ``eq=False``).

    Every request gets a fresh block, which takes the place in the chain of the free block it
    was cut from: a block freed once is never handed out again, so a stale reference to it
    still fails as a double free, and it never moves (its ``offset`` stays where it was): the
    free block keeps the remainder of a split only if it was never handed out, else a fresh
    block does and it is dropped; for the same reason a freed block merges into a free block
    above it that was never handed out, which moves down (``merge_down``). The ``Allocation``
    fields are set when the block is handed out (``cut_block``; ``extents`` is computed from
    ``offset`` and ``size_bytes`` when read, see the property); while it is
    handed out, ``handle`` is the block itself (a field, not a property: the compiled build
    declares ``Block`` a ``cdef class`` over ``Allocation``'s fields, ``_blocks.pxd``), so code
    that reaches a block through ``allocation.handle`` (wrappers, allocations a subclass builds
    around a block) works on either; freeing clears it (no block keeps a cycle to itself) and a
    block never handed out has None. ``offset`` is a field here, where ``Allocation.offset`` reads
    the first extent: the same value for a handed-out block, and defined for a free one.
    """

    __slots__ = ("offset", "size", "segment", "prev", "next", "free")

    offset: int
    size: int
    segment: Segment
    prev: Block | None
    next: Block | None
    free: bool

    def __init__(
        self,
        offset: int,
        size: int,
        segment: Segment,
        prev: Block | None = None,
        next: Block | None = None,
        free: bool = True,
    ):
        self.offset = offset
        self.size = size
        self.segment = segment
        self.prev = prev
        self.next = next
        self.free = free
        self.size_bytes = 0  # set when handed out: a block that never was has 0
        self.handle = None  # the block itself while handed out

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def extents(self) -> tuple[tuple[int, int], ...]:  # type: ignore[override]
        """``((offset, size_bytes),)``, computed when read (``()`` for a block never handed out;
        read-only). A handed-out block never moves except by compaction, which moves its
        ``offset``; so this is what storing it at the cut would give, without the two tuples
        and two ints per request that most requests never read (``benchmarks/RESULTS.md``)."""
        size = self.size_bytes
        return ((self.offset, size),) if size else ()

    def __repr__(self) -> str:
        state = "free" if self.free else f"live nbytes={self.nbytes}"
        return f"Block(offset={self.offset:#x}, size={self.size}, {state})"


@cython.locals(
    a=Block,
    rest=Block,
    nxt=Block,
    prev=Block,
    seg=Segment,
    offset=cython.longlong,
    rest_bytes=cython.longlong,
)
def cut_block(
    block: Block, size: int, nbytes: int, stream: int, tag: str | None, split_min_bytes: int
) -> Block:
    """Hand out the low ``size`` bytes of free ``block`` (out of the index) as a fresh block.

    The fresh block replaces ``block`` in the chain. The remainder, when at least
    ``split_min_bytes``, stays free as the fresh block's ``next`` (``block`` itself, or a fresh
    block when ``block`` was handed out before: a freed allocation never moves), and the caller
    puts it back into its index; else the whole block is handed out and ``block`` is dropped.
    Counts the block in its segment's ``num_live``; the caller counts ``allocated_bytes``.
    The one copy of the split, for every block policy (a plain function: one frame, no lookups;
    compiled, a C function that ``best_fit`` and ``first_fit`` call directly, ``_blocks.pxd``).
    """
    seg = block.segment
    prev = block.prev
    offset = block.offset
    rest_bytes = block.size - size
    a = Block.__new__(
        Block
    )  # field by field: ``Block(...)`` would run ``__init__`` as one more frame
    if rest_bytes >= split_min_bytes:  # split: the request takes the low end, the rest stays free
        if block.size_bytes:  # a freed allocation never moves: a fresh block keeps the rest
            nxt = block.next
            rest = Block.__new__(
                Block
            )  # field by field, as ``a`` below (``Block.__init__``'s fields)
            rest.offset = offset + size
            rest.size = rest_bytes
            rest.segment = seg
            rest.next = nxt
            rest.free = True
            rest.size_bytes = 0
            rest.handle = None
            if nxt is not None:
                nxt.prev = rest
            block.prev = block.next = None
            block = rest
        else:
            block.offset = offset + size
            block.size = rest_bytes
        a.next = block
        block.prev = a
    else:
        size = block.size
        nxt = a.next = block.next
        if nxt is not None:
            nxt.prev = a
        block.prev = block.next = None
    if prev is None:
        seg.handle = a
    else:
        prev.next = a
    a.offset = offset
    a.size = size
    a.segment = seg
    a.prev = prev
    a.free = False
    a.nbytes = nbytes
    a.size_bytes = size  # ``extents`` is computed from it and ``offset`` when read
    a.stream = stream
    a.tag = tag
    a.handle = a
    seg.num_live += 1
    return a


@cython.locals(block=Block, nxt=Block, prev=Block, seg=Segment)
def merge_down(block: Block, nxt: Block, prev: Block | None, seg: Segment) -> None:
    """Coalesce ``block``, being freed, into ``nxt``, the free block above it: ``nxt`` moves down
    to ``block``'s offset and takes its place in the chain, and ``block`` leaves it. The callers
    call it when ``not nxt.size_bytes and (prev is None or not prev.free)`` (``nxt`` was never
    handed out; ``prev``, ``block``'s neighbour below, is not free), and merge the usual way
    otherwise (the lowest block survives). They test that themselves: deciding inside this call
    made compiled best fit's replay 8 % slower (``benchmarks/RESULTS.md``, "the merge rule in
    one place, measured").

    Why not the other way round: a block that was handed out never moves (``cut_block``), so
    the next split of a freed ``block`` would need a fresh block for the rest; ``nxt`` splits in
    place. In the snapshot's replay a quarter of frees merge this way. The caller re-keys ``nxt``
    in its index and counts the bytes. The one copy of the relink, for the hot paths and the
    generic ``_free``.
    """
    nxt.size += block.size
    nxt.offset = block.offset
    nxt.prev = prev
    if prev is None:
        seg.handle = nxt
    else:
        prev.next = nxt
    block.prev = block.next = None


@cython.boundscheck(False)  # 0 <= mid < len(blocks): no index to check or wrap
@cython.wraparound(False)
@cython.locals(lo=cython.Py_ssize_t, hi=cython.Py_ssize_t, mid=cython.Py_ssize_t, b=Block)
def bisect_blocks(blocks: list, size: int, offset: int) -> int:
    """The first position in ``blocks`` (free blocks sorted by size, then offset: best fit's
    index) whose block is at or above ``(size, offset)``: ``bisect_left`` over the index's keys
    of the key ``(size, offset)`` makes, read from the blocks' own fields instead. Compiled, the
    fields are C integers, where ``bisect_ints`` reads each key back from a Python int (a
    two-digit one: keys are ~2**35 and up); benchmarks/RESULTS.md, session 18. Every block in
    ``blocks`` must have the size and offset its key was made from (the callers bisect before
    they resize a block, or after they took it out)."""
    lo = 0
    hi = len(blocks)
    while lo < hi:
        mid = (lo + hi) >> 1
        # unchecked: ``blocks`` holds blocks only (compiled, a type test a probe costs ~10 %)
        b = cython.cast(Block, blocks[mid])
        if b.size < size or (b.size == size and b.offset < offset):
            lo = mid + 1
        else:
            hi = mid
    return lo


#: the free-block index hooks; a class that defines one has an index of its own
_INDEX_HOOKS = ("_index_add", "_index_remove", "_index_resize", "_find", "_take", "_index_reset")


class ContiguousPolicy(Policy):
    """Base of the policies that give each request one contiguous range.

    Args:
        segment_bytes: size of the segment reserved on a miss (grow by one segment). A request
            larger than this gets a segment of its own, rounded up to 2 MiB.
        alignment_bytes: request sizes are rounded up to a multiple of this (a power of two), so
            every allocation starts on such a boundary.
        granularity_bytes: request sizes are rounded up to a multiple of this instead (a
            multiple of ``alignment_bytes``; None means ``alignment_bytes``). Coarse granularity
            is what some engines use to limit fragmentation, at the price of internal waste:
            freed blocks then fit later requests of the same rounded size exactly.
        split_threshold_bytes: a free block is split only when the remainder would be at least
            this many bytes; otherwise the whole block is handed out. None means
            ``alignment_bytes`` (split whenever anything remains).
        virtual: one virtual range per stream that grows in place in device pages (see the
            module docstring); ``segment_bytes`` is then unused. Needs a page-mapped device (a
            segment device given is wrapped: ``policies.mapped_device.as_page_mapped``).
        capacity_bytes, device: see ``Policy``.

    Subclasses implement the free-block index:

    - ``_index_add(block)``: a block became free (or was created free);
    - ``_index_remove(block)``: a free block is about to be handed out, merged or released;
    - ``_find(size, stream) -> Block | None``: the free block to serve ``size`` bytes (already
      rounded) on ``stream``, left in the index;
    - ``_index_reset()``: build the empty index.

    They may override, for speed, ``_take(size, stream)`` (find and remove in one search),
    ``_index_resize(block, old_size)`` (a free block grew by coalescing) and
    ``_index_largest_bytes()`` (default: a walk over every block).
    """

    contiguous = True
    coalesces = True
    #: the methods that make up the free-block index: a subclass that overrides one of them
    #: takes the generic ``_allocate``/``_free`` (``__init_subclass__``); a policy whose hot path
    #: inlines more of its index (best fit: its key) lists those methods too
    _index_hooks: ClassVar[tuple[str, ...]] = _INDEX_HOOKS

    def __init__(
        self,
        *,
        segment_bytes: int = _DEFAULT_SEGMENT_BYTES,
        alignment_bytes: int = _DEFAULT_ALIGNMENT_BYTES,
        granularity_bytes: int | None = None,
        split_threshold_bytes: int | None = None,
        virtual: bool = False,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        check_positive_int("alignment_bytes", alignment_bytes)
        if alignment_bytes & (alignment_bytes - 1):
            raise PolicyError(f"alignment_bytes(={alignment_bytes}) must be a power of two")
        if granularity_bytes is not None:
            check_positive_int("granularity_bytes", granularity_bytes)
            if granularity_bytes % alignment_bytes:
                raise PolicyError(
                    f"granularity_bytes(={granularity_bytes}) "
                    f"must be a multiple of alignment_bytes(={alignment_bytes})"
                )
        check_positive_int("segment_bytes", segment_bytes)
        if segment_bytes % alignment_bytes:
            raise PolicyError(
                f"segment_bytes(={segment_bytes}) "
                f"must be a multiple of alignment_bytes(={alignment_bytes})"
            )
        if split_threshold_bytes is not None:
            check_positive_int("split_threshold_bytes", split_threshold_bytes)
        self.segment_bytes = segment_bytes
        self.alignment_bytes = alignment_bytes
        self.granularity_bytes = granularity_bytes
        check_flag("virtual", virtual, error=PolicyError)
        self.split_threshold_bytes = split_threshold_bytes
        self.virtual = virtual
        super().__init__(
            capacity_bytes=capacity_bytes, device=as_page_mapped(device) if virtual else device
        )

    @classmethod
    def device_kind_for(cls, params: dict) -> DeviceKind:
        return DeviceKind.PAGE_MAPPED if params.get("virtual") is True else cls.device_kind

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # Block policies inline their own index in ``_allocate``/``_free`` (calls are what a
        # pure-Python pool pays for): a subclass that brings another index but inherits them
        # gets the generic ones, which go through the index hooks.
        if any(hook in cls.__dict__ for hook in cls._index_hooks):
            if "_allocate" not in cls.__dict__:
                cls._allocate = ContiguousPolicy._allocate  # type: ignore[method-assign]
            if "_free" not in cls.__dict__:
                cls._free = ContiguousPolicy._free  # type: ignore[method-assign]

    @classmethod
    def _param_names(cls) -> list[str]:
        # a subclass whose __init__ does not take one of these knobs fixes it (passes its own
        # value up), so it is not that subclass's knob: get_params() must rebuild the policy
        accepted = inspect.signature(cls.__init__).parameters
        if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
            return super()._param_names()
        names = (
            super()._param_names()
        )  # not inside the comprehension: Cython's super() needs the method's frame
        return [n for n in names if n in accepted]

    # ----------------------------------------------------------------- free-block index
    @abc.abstractmethod
    def _index_add(self, block: Block) -> None: ...

    @abc.abstractmethod
    def _index_remove(self, block: Block) -> None: ...

    @abc.abstractmethod
    def _find(self, size: int, stream: int) -> Block | None: ...

    def _take(self, size: int, stream: int) -> Block | None:
        """``_find`` and ``_index_remove`` in one; override when one search can do both."""
        block = self._find(size, stream)
        if block is not None:
            self._index_remove(block)
        return block

    def _index_resize(self, block: Block, old_size: int) -> None:
        """An indexed free block grew in place from ``old_size`` to ``block.size`` (same offset).

        Override when the index can often leave the block where it is.
        """
        new_size = block.size
        block.size = old_size
        self._index_remove(block)
        block.size = new_size
        self._index_add(block)

    def _index_largest_bytes(self) -> int:
        """Size of the largest free block (a walk over all blocks unless overridden)."""
        return max((b.size for b in self.blocks() if b.free), default=0)

    @abc.abstractmethod
    def _index_reset(self) -> None:
        """Build the empty index; called by ``_reset_state``."""

    # ----------------------------------------------------------------- Policy hooks
    def _reset_state(self) -> None:
        rounding = self.granularity_bytes or self.alignment_bytes
        self._rounding_bytes = rounding
        # a mask when the rounding is a power of two (the common case), else None: divide
        self._round_mask = rounding - 1 if rounding & (rounding - 1) == 0 else None
        threshold = self.split_threshold_bytes
        self._split_min_bytes = self.alignment_bytes if threshold is None else threshold
        # oversize segments: a multiple of both the driver's 2 MiB and the alignment (powers of two)
        self._oversize_multiple = max(SEGMENT_ALIGNMENT_BYTES, self.alignment_bytes)
        self._ranges: dict[
            int, Segment
        ] = {}  # virtual: stream -> its one range (the mapped prefix)
        if self.virtual:
            page = self.device.granularity_bytes
            self._range_bytes = max(VIRTUAL_RANGE_BYTES, round_up(self.capacity_bytes or 0, page))
        self._index_reset()

    def _segment_size_for(self, nbytes: int) -> int:
        if self.virtual:  # what a grow maps: whole pages
            return round_up(nbytes, self.device.granularity_bytes)
        if nbytes <= self.segment_bytes:
            return self.segment_bytes
        m = self._oversize_multiple
        return round_up(nbytes, m)

    def rounded_size(self, nbytes: int) -> int:
        """The bytes a request of ``nbytes`` takes before any unsplit remainder joins it.

        A subclass that rounds otherwise overrides this and sets ``_round_mask`` to None.
        """
        mask = self._round_mask
        if mask is not None:
            return (nbytes + mask) & ~mask
        m = self._rounding_bytes
        return round_up(nbytes, m)

    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        mask = self._round_mask
        if mask is not None:  # inlined rounded_size: the hottest path of every replay
            size = (nbytes + mask) & ~mask
        else:
            size = self.rounded_size(nbytes)
        block = self._take(size, stream)
        if block is None:
            block = self._miss(size, stream)
            if block is None:
                return None
        return self._cut(block, size, nbytes, stream, tag)

    def _miss(self, size: int, stream: int) -> Block | None:
        """No free block holds ``size``: a free block made by growing (out of the index), or
        None."""
        if self.virtual:
            return self._grow_in_place(size, stream)
        seg = self._reserve_segment(self._segment_size_for(size), stream)
        return None if seg is None else self._segment_block(seg)

    @cython.locals(a=Block, rest=Block)
    def _cut(self, block: Block, size: int, nbytes: int, stream: int, tag: str | None) -> Block:
        """Hand out the low ``size`` bytes of free ``block`` (out of the index): ``cut_block``,
        with the remainder of a split put back into the index."""
        a = cut_block(block, size, nbytes, stream, tag, self._split_min_bytes)
        rest = a.next
        if rest is not None and rest.free:  # a split (a free block never follows a free one)
            self._index_add(rest)
        self.allocated_bytes += a.size
        return a

    @cython.locals(block=Block, nxt=Block, prev=Block, after=Block, old_size=cython.longlong)
    def _free(self, allocation: Allocation) -> None:
        block: Block = (
            allocation.handle
        )  # the block itself, or the block a subclass's allocation wraps
        assert not block.free and block.size == allocation.size_bytes
        block.handle = None
        self.allocated_bytes -= block.size
        block.segment.num_live -= 1
        # Coalesce at once. The survivor is the lowest of the merged blocks, except a free block
        # above that was never handed out (``merge_down``); absorbed blocks are unlinked so no
        # cycle keeps them alive.
        nxt = block.next
        prev = block.prev
        if nxt is not None and nxt.free:
            self._index_remove(nxt)
            if not nxt.size_bytes and (prev is None or not prev.free):  # ``nxt`` absorbs the block
                merge_down(block, nxt, prev, block.segment)
                self._index_add(nxt)
                return
            block.size += nxt.size
            after = block.next = nxt.next
            if after is not None:
                after.prev = block
            nxt.prev = nxt.next = None
        if prev is not None and prev.free:
            old_size = prev.size
            prev.size = old_size + block.size
            after = prev.next = block.next
            if after is not None:
                after.prev = prev
            block.prev = block.next = None
            self._index_resize(prev, old_size)
        else:
            block.free = True
            self._index_add(block)

    def _add_segment(self, segment: Segment) -> None:
        self._index_add(self._segment_block(segment))

    @staticmethod
    def _segment_block(segment: Segment) -> Block:
        """The one free block spanning a fresh segment (not yet indexed)."""
        assert segment.end <= 1 << OFFSET_BITS, (
            f"segment end {segment.end:#x} does not fit in {OFFSET_BITS} bits"
        )
        block = Block(segment.offset, segment.nbytes, segment)
        segment.handle = block
        return block

    def _release_free_segments(self, max_bytes: int | None) -> int:
        """Release segments with no live allocation, in reservation order, until at least
        ``max_bytes`` are released (all of them when None). Virtual: unmap free end pages."""
        if self.virtual:
            return self._unmap_free_tails(max_bytes)
        released = 0
        for seg in [s for s in self._segments.values() if s.num_live == 0]:
            if max_bytes is not None and released >= max_bytes:
                break
            block: Block = seg.handle
            assert block.free and block.size == seg.nbytes and block.next is None
            self._index_remove(block)
            self._release_segment(seg)
            released += seg.nbytes
        return released

    # ----------------------------------------------------------------- virtual: in-place growth
    def _tail_block(self, seg: Segment) -> Block:
        """The last block of ``seg`` (a walk: only misses and trims need it)."""
        block = seg.handle
        while block.next is not None:
            block = block.next
        return block

    def _map_in_place(self, stream: int, nbytes: int, *, retry: bool) -> Segment | None:
        """Map ``nbytes`` (whole pages) at the end of ``stream``'s range, reserving the range on
        first use; the caller extends the blocks. None when frozen or refused by capacity or the
        device (with ``retry``, after unmapping every free tail once, as a segment pool releases
        its free segments before giving up)."""
        if self._frozen:
            self._frozen_refusal_at = self.num_allocs + self.num_failures
            return None
        device, span = self.device, self._range_bytes
        seg = self._ranges.get(stream)
        if (seg.nbytes if seg is not None else 0) + nbytes > span:
            return None  # past the range: more than any capacity
        for attempt in range(
            0 if retry else 1, 2
        ):  # range: Cython mistypes a conditional of tuple literals
            if self.capacity_bytes is None or self.reserved_bytes + nbytes <= self.capacity_bytes:
                if seg is None:
                    start = device.address_reserve(span)
                    if start is not None and device.map_new(start, nbytes):
                        seg = self._ranges[stream] = Segment(start, nbytes, stream)
                        self._segments[start] = seg
                        self.num_grows += 1
                        break
                    if start is not None:
                        device.address_free(start, span)
                elif device.map_new(seg.end, nbytes):
                    seg.nbytes += nbytes
                    break
            # the stream's own free tail is counted in ``nbytes`` already: unmap the others'
            if attempt == 0 and self._unmap_free_tails(None, skip_stream=stream) == 0:
                return None
        else:
            return None
        self.reserved_bytes += nbytes
        self.grown_bytes += nbytes
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
        return seg

    def _grow_in_place(self, size: int, stream: int) -> Block | None:
        """A free block of at least ``size`` at the end of ``stream``'s range, made by mapping
        the pages it lacks; removed from the index (as ``_take`` leaves it). None if refused."""
        page = self.device.granularity_bytes
        seg = self._ranges.get(stream)
        tail = self._tail_block(seg) if seg is not None else None
        tail_free = tail.size if tail is not None and tail.free else 0
        need = round_up(size - tail_free, page)
        seg = self._map_in_place(stream, need, retry=True)
        if seg is None:
            return None
        if seg.handle is None:  # a fresh range
            return self._segment_block(seg)
        tail = self._tail_block(seg)
        if tail.free:
            self._index_remove(tail)
            tail.size += seg.end - tail.end
            return tail
        block = Block(tail.end, seg.end - tail.end, seg, tail)
        tail.next = block
        return block

    def _unmap_free_tails(self, max_bytes: int | None, skip_stream: int | None = None) -> int:
        """Unmap the whole free pages at the end of each range (a range left empty is given
        back) until at least ``max_bytes`` are unmapped (all of them when None)."""
        device = self.device
        page = device.granularity_bytes
        released = 0
        for stream, seg in list(self._ranges.items()):
            if max_bytes is not None and released >= max_bytes:
                break
            if stream == skip_stream:
                continue
            tail = self._tail_block(seg)
            if not tail.free:
                continue
            cut_from = round_up(tail.offset, page)
            if cut_from >= seg.end:
                continue
            cut = seg.end - cut_from
            device.unmap_release(cut_from, cut)
            self._index_remove(tail)
            seg.nbytes -= cut
            tail.size -= cut
            if tail.size:
                self._index_add(tail)
            elif tail.prev is not None:
                tail.prev.next = None
                tail.prev = None
            else:  # the range is empty: give its address space back
                device.address_free(seg.offset, self._range_bytes)
                del self._segments[seg.offset], self._ranges[stream]
                self.num_shrinks += 1
            self.reserved_bytes -= cut
            self.shrunk_bytes += cut
            released += cut
        return released

    def grow(self, nbytes: int) -> bool:
        """Virtual: map at least ``nbytes`` more free space at the end of stream 0's range."""
        if not self.virtual:
            return super().grow(nbytes)
        if nbytes > self._max_request_bytes:
            return False
        old = self._ranges.get(0)
        old_end = old.end if old is not None else 0
        seg = self._map_in_place(0, self._segment_size_for(nbytes), retry=False)
        if seg is None:
            self._frozen_refusal_at = -1  # a refused grow() is no allocation's failure
            return False
        if old is None:
            self._index_add(self._segment_block(seg))
            return True
        tail = self._tail_block(seg)
        if tail.free:
            old_size = tail.size
            tail.size += seg.end - old_end
            self._index_resize(tail, old_size)
        else:
            tail.next = Block(old_end, seg.end - old_end, seg, tail)
            self._index_add(tail.next)
        return True

    def reset(self) -> None:
        # unmap and give back the ranges here: the segment protocol would free only their mapped
        # part
        if self.virtual:
            for seg in self._ranges.values():
                self.device.unmap_release(seg.offset, seg.nbytes)
                self.device.address_free(seg.offset, self._range_bytes)
                del self._segments[seg.offset]
        super().reset()

    # ----------------------------------------------------------------- inspection
    def blocks(self) -> Iterator[Block]:
        """Every block, free or not, in address order (segment by segment)."""
        for seg in self.segments():
            block = seg.handle
            while block is not None:
                yield block
                block = block.next

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants and the byte accounting (for tests;
        O(blocks))."""
        allocated = free = 0
        for seg in self.segments():
            block, end, live, prev_free = seg.handle, seg.offset, 0, False
            assert block.prev is None, f"segment {seg.offset:#x}: first block has a prev"
            while block is not None:
                assert block.segment is seg and block.offset == end and block.size > 0, (
                    f"gap or overlap at {end:#x}"
                )
                assert block.size % self.alignment_bytes == 0, (
                    f"block at {block.offset:#x} is not aligned"
                )
                assert block.next is None or block.next.prev is block, (
                    f"broken chain at {block.offset:#x}"
                )
                if block.free:
                    assert not prev_free, f"free blocks touch at {block.offset:#x}"
                    free += block.size
                else:
                    allocated += block.size
                    live += 1
                prev_free = block.free
                end += block.size
                block = block.next
            assert end == seg.end, (
                f"segment {seg.offset:#x}: blocks end at {end:#x}, not {seg.end:#x}"
            )
            assert live == seg.num_live, (
                f"segment {seg.offset:#x}: num_live {seg.num_live} != {live}"
            )
        assert allocated == self.allocated_bytes, (
            f"allocated_bytes {self.allocated_bytes} != {allocated}"
        )
        assert allocated + free == self.reserved_bytes, "free + allocated != reserved"
        assert self.largest_free_bytes() == max(
            (b.size for b in self.blocks() if b.free), default=0
        )

    def free_extents(self) -> list[tuple[int, int]]:
        return [(b.offset, b.size) for b in self.blocks() if b.free]

    def largest_free_bytes(self) -> int:
        return self._index_largest_bytes()
