"""``size-class``: segregated free lists over geometric size classes, refilled in batches.

The design of jemalloc, tcmalloc and RMM's binning resource: a request is rounded up to the
next of a fixed set of class sizes and served from that class's free list; an empty list is
refilled with a batch of blocks carved from a segment; requests above the largest class take a
separate large-object path. Allocation is O(log #classes) and never searches free space, at the
price of rounding (internal) waste, which ``internal_waste_bytes`` reports.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass, field
from itertools import chain, islice, repeat
from operator import attrgetter

from policies.base import Allocation, Policy, Segment, check_positive_int, round_up
from policies.device import Device
from policies.errors import PolicyError

try:
    import cython
except ImportError:  # a pure install: the same names as no-ops (policies/_cython_shim.py)
    from policies._cython_shim import cython

__all__ = ["SizeClass", "make_class_sizes", "CLASS_ALIGNMENT_BYTES"]

#: Class sizes, large ranges and their offsets are multiples of this (PyTorch's and CuPy's
#: rounding).
CLASS_ALIGNMENT_BYTES = 512

_LARGE = -1  # class_index of a large range
#: The placeholders (None) below the cached blocks of a class's free list
#: (``SizeClass._reset_state``).
#: Eight, not one: a list of few blocks is then never at or below half of its storage, where
#: CPython's ``pop`` reallocates it (``list_resize`` shrinks a list that falls below half; a list
#: of one or two blocks did so on every pop, to the same size) and the compiled build's inline
#: ``pop`` (Cython's, taken while the size is above half the storage) gives way to the method
#: call: 10,751 of 19,776 pops of the snapshot's first 20,000 events took that way, ~124
#: instructions each (benchmarks/RESULTS.md, session 16)
_FREE_LIST_BASE = 8
_TABLE_MAX_BYTES = (
    32 << 20
)  # classes up to here are found by table (64 Ki entries, 512 KiB at most)
_extents_of = attrgetter("extents")


def make_class_sizes(
    min_class_bytes: int, max_class_bytes: int, classes_per_doubling: int
) -> list[int]:
    """The class sizes, ascending: ``k = classes_per_doubling`` linear steps per doubling.

    Each doubling ``[b, 2b)`` starting at ``b = min_class_bytes * 2**j`` is cut in steps of
    ``b / k`` rounded *down* to a multiple of 512 B (at least 512 B), and ``max_class_bytes``
    closes the list. So a doubling has ``k`` classes when ``b / k`` is a multiple of 512 B and
    more otherwise, never fewer, which keeps the rounding waste of a request ``r`` above
    ``min_class_bytes`` below ``max(512 B, class / (k + 1))``: the gap below a class ``b + i*s``
    is at most ``s <= b/k``, and ``s / (b + s) <= 1 / (k + 1)``.
    """
    sizes: list[int] = []
    base = min_class_bytes
    while base <= max_class_bytes:
        step = max(
            CLASS_ALIGNMENT_BYTES,
            base // classes_per_doubling // CLASS_ALIGNMENT_BYTES * CLASS_ALIGNMENT_BYTES,
        )
        sizes.extend(range(base, min(2 * base, max_class_bytes + 1), step))
        base *= 2
    if sizes[-1] != max_class_bytes:
        sizes.append(max_class_bytes)
    return sizes


class _Block:
    """A carved range, reused as is: a class block (``class_index >= 0``) or a large range.
    Slots (a ``cdef class`` in the compiled build, ``size_class.pxd``), compared by identity."""

    __slots__ = ("offset", "size_bytes", "class_index", "segment", "extents", "home")

    offset: int
    size_bytes: int
    class_index: int
    segment: Segment
    extents: tuple[tuple[int, int], ...]  # built once, handed to every allocation of this block
    home: list | None  # its class's free list (None for a large range): a free is one append

    def __init__(
        self,
        offset: int,
        size_bytes: int,
        class_index: int,
        segment: Segment,
        extents: tuple[tuple[int, int], ...],
        home: list | None,
    ):
        self.offset = offset
        self.size_bytes = size_bytes
        self.class_index = class_index
        self.segment = segment
        self.extents = extents
        self.home = home


@dataclass(slots=True, eq=False)
class _Run:
    """The class blocks of a refill not handed out yet: ``[next, end)`` of ``segment``, lowest
    first.

    A refill carves a whole batch, but a workload touches few of its blocks (on the bundled Llama
    snapshot 276 of 8,799): a block object is built when it is first handed out.
    """

    segment: Segment
    next: int
    end: int


@dataclass(slots=True, eq=False)
class _Carving:
    """``Segment.handle``: ``[bump, segment.end)`` is not carved yet; ``classes`` were carved
    here."""

    bump: int
    classes: set[int] = field(default_factory=set)


class _SizeClassCore(Policy):
    """The hot path of ``SizeClass`` (its ``_allocate`` and ``_free``), apart from its knobs.

    The compiled build makes this a ``cdef class`` (``size_class.pxd``) with typed free lists;
    ``SizeClass`` stays a Python class so that its ``__init__`` keeps the signature
    ``get_params`` reads (as ``paged._PagedCore`` does).
    """

    __slots__ = ()

    @cython.locals(
        a=Allocation,
        blk=_Block,
        blocks=list,
        n=cython.longlong,
        ci=cython.longlong,
        size=cython.longlong,
    )
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        # compiled: a C integer (``allocate`` passed at most the device's bytes): C arithmetic below
        n = nbytes
        if n <= self._table_max_bytes:
            ci = self._class_by_units[(n + 511) >> 9]  # 511, 9: CLASS_ALIGNMENT_BYTES is 2**9
        elif nbytes <= self.max_class_bytes:
            ci = bisect_left(self._class_sizes, nbytes)
        else:
            return self._allocate_large(nbytes, stream, tag)
        blocks = self._free_lists[ci]
        if blocks[-1] is not None:  # more than the placeholders (``_reset_state``)
            blk = blocks.pop()
        else:
            blk = self._take_uncut(ci, stream)
            if blk is None:
                return None
        blk.segment.num_live += 1
        size = blk.size_bytes
        self.allocated_bytes += size
        a = Allocation.__new__(Allocation)  # no __init__ frame; compiled, a direct allocation
        a.nbytes = n
        a.size_bytes = size
        a._extents = blk.extents  # the slot behind ``extents``: no property call on the hot path
        a.stream = stream
        a.tag = tag
        a.handle = blk
        return a

    def _allocate_large(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        blk = self._take_large(round_up(nbytes, self.large_granularity_bytes), stream)
        if blk is None:
            return None
        blk.segment.num_live += 1
        self.allocated_bytes += blk.size_bytes
        return Allocation(nbytes, blk.size_bytes, blk.extents, stream, tag, blk)

    @cython.locals(a=Allocation, blk=_Block)
    def _free(self, allocation: Allocation) -> None:
        a = allocation  # compiled: a C-typed local (Policy.free hands over only an Allocation)
        blk = a.handle
        blk.segment.num_live -= 1
        self.allocated_bytes -= blk.size_bytes
        home = blk.home
        if home is not None:
            home.append(blk)
        else:
            insort(self._large_cache, (blk.size_bytes, blk.offset, blk))


class SizeClass(_SizeClassCore):
    """Segregated LIFO free lists per size class, batch refill, a large-object path.

    Behaviour:

    - Classes: ``make_class_sizes(min_class_bytes, max_class_bytes, classes_per_doubling)``,
      multiples of 512 B. A request of at most ``max_class_bytes`` gets the smallest class that
      holds it; above ``min_class_bytes`` the rounding waste is below ``max(512 B, class/(k+1))``
      (20 % of a block at k=4, field notes).
    - Free lists: one list per class used as a LIFO stack: a freed block is the next one handed
      out (cache-warm, O(1)). Blocks never split or merge; a block keeps its class for the life
      of its segment.
    - Refill: an empty class carves ``max(1, refill_bytes // class)`` blocks at once from the
      uncarved tail of a segment (bump pointer): the first segment whose tail holds the whole
      batch, else the largest tail holding at least one block (fewer blocks), else a recycled
      segment (below), else a new segment of ``max(segment_bytes, batch)`` bytes (near
      ``capacity_bytes``: whatever still fits, then the batch, then one block). A batch's blocks
      are handed out lowest address first, after any freed block of the class; a block object
      is built when it is first handed out (``_Run``).
    - Recycling: before growing, the smallest segment with no live block (``num_live == 0``) is
      turned back into uncarved space: its cached blocks leave their lists, so memory moves
      between classes without a device call. Without it, blocks cached in classes a workload
      has stopped using pile up (on the bundled Llama snapshot, peak reserved fell from 3.4x to
      1.6x peak live).
    - Large path (requests above ``max_class_bytes``): rounded up to ``large_granularity_bytes``
      (R). Freed large ranges are cached, sorted by size; a request takes the smallest cached
      range S >= R when S <= R + R/k, so reuse wastes at most 1/(k+1) of the range, like the
      classes. Otherwise R is carved from the smallest segment tail that holds it (so space
      pre-reserved with ``grow`` serves large requests too), else from a recycled segment, else
      from a dedicated new segment of exactly R bytes, which a trim releases whole once the
      range is freed.
    - Trim: ``_release_free_segments`` releases segments with no live block (largest first) and
      drops their cached blocks; ``_reserve_segment`` calls it when capacity or the device
      refuses, then retries once.
    - Streams are recorded on allocations but blocks are not segregated by stream (one set of
      lists serves all; the caller orders cross-stream reuse).
    - ``largest_free_bytes`` is the largest request servable without growing: the largest class
      with a cached block, the largest cached large range, or the largest request a segment
      tail or a segment with no live block can be carved for, whichever is largest.

    Args:
        classes_per_doubling: k, the classes in each doubling of size (>= 1).
        min_class_bytes: smallest class; a multiple of 512.
        max_class_bytes: largest class (a multiple of 512, >= ``min_class_bytes``); larger
            requests take the large path.
        refill_bytes: bytes of blocks carved per refill of a class (at least one block).
        segment_bytes: bytes reserved from the device per new segment for class blocks.
        large_granularity_bytes: large requests are rounded up to a multiple of this (a
            multiple of 512; 2 MiB, CUDA's mapping granularity, by default).
        capacity_bytes: see ``Policy``.
    """

    name = "size-class"
    contiguous = True
    coalesces = False

    def __init__(
        self,
        *,
        classes_per_doubling: int = 4,
        min_class_bytes: int = 512,
        max_class_bytes: int = 16 << 20,
        refill_bytes: int = 2 << 20,
        segment_bytes: int = 32 << 20,
        large_granularity_bytes: int = 2 << 20,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        check_positive_int("classes_per_doubling", classes_per_doubling)
        for knob, value in (
            ("min_class_bytes", min_class_bytes),
            ("max_class_bytes", max_class_bytes),
            ("large_granularity_bytes", large_granularity_bytes),
        ):
            check_positive_int(knob, value, CLASS_ALIGNMENT_BYTES)
            if value % CLASS_ALIGNMENT_BYTES:
                raise PolicyError(
                    f"{knob}(={value}) must be a multiple of {CLASS_ALIGNMENT_BYTES} B"
                )
        if max_class_bytes < min_class_bytes:
            raise PolicyError(
                f"max_class_bytes(={max_class_bytes}) "
                f"must be >= min_class_bytes(={min_class_bytes})"
            )
        check_positive_int("refill_bytes", refill_bytes)
        check_positive_int("segment_bytes", segment_bytes)
        self.classes_per_doubling = classes_per_doubling
        self.min_class_bytes = min_class_bytes
        self.max_class_bytes = max_class_bytes
        self.refill_bytes = refill_bytes
        self.segment_bytes = segment_bytes
        self.large_granularity_bytes = large_granularity_bytes
        super().__init__(capacity_bytes=capacity_bytes, device=device)

    def _reset_state(self) -> None:
        self._class_sizes = make_class_sizes(
            self.min_class_bytes, self.max_class_bytes, self.classes_per_doubling
        )
        # Class index by request size in 512 B units, up to _TABLE_MAX_BYTES: one list index
        # instead of a bisect, which costs about three times as much per request.
        sizes = self._class_sizes
        self._table_max_bytes = min(self.max_class_bytes, _TABLE_MAX_BYTES)
        # Built class by class: class ``ci`` serves the units above the previous class's size up
        # to its own (``bisect_left``'s answer for each), in runs, where a bisect per unit (32 Ki
        # of them) made building the pool cost 2.7 ms.
        num_units = self._table_max_bytes // CLASS_ALIGNMENT_BYTES + 1
        self._class_by_units = table = []
        for ci, size in enumerate(sizes):
            table.extend(repeat(ci, min(size // CLASS_ALIGNMENT_BYTES + 1, num_units) - len(table)))
        # Lists as LIFO stacks: append/pop at the end are O(1) and the cheapest ops Python has.
        # Each starts with placeholders, None, that are never popped (``blocks[-1] is None``: no
        # block cached), so a list never empties: CPython moves an emptied list's storage to the
        # C allocator and back on the next append, a realloc pair that cost ~15 ns of a ~110 ns
        # compiled round trip on Python 3.11, and a fifth of the bundled snapshot's pops would
        # empty their class (benchmarks/RESULTS.md, "size-class lists that never empty"); and
        # ``_FREE_LIST_BASE`` of them, so that a short list does not shrink on every pop either.
        self._free_lists: list[list[_Block]] = [[None] * _FREE_LIST_BASE for _ in self._class_sizes]
        # per class, the blocks its last refill carved and no request has taken yet (or None);
        # a class refills only when its list and its run are both empty
        self._runs: list[_Run | None] = [None] * len(self._class_sizes)
        # Freed large ranges as (size, offset, block), ascending: few and rarely touched, so a
        # plain sorted list (bisect) beats a tree.
        self._large_cache: list[tuple[int, int, _Block]] = []
        # Segments whose uncarved tail can still hold the smallest class.
        self._open: list[Segment] = []
        self.num_recycles = 0  # fully free segments turned back into uncarved space

    # ----------------------------------------------------------------- public extras
    def class_sizes(self) -> tuple[int, ...]:
        """The class sizes in bytes, ascending."""
        return tuple(self._class_sizes)

    def rounded_size(self, nbytes: int) -> int:
        """What a request of ``nbytes`` is rounded to: its class, or a large-granularity multiple.

        A large request may still be served by a somewhat larger cached range (see the class
        docstring), so an allocation's ``size_bytes`` can exceed this for large requests.
        """
        if nbytes <= self.max_class_bytes:
            return self._class_sizes[bisect_left(self._class_sizes, nbytes)]
        return round_up(nbytes, self.large_granularity_bytes)

    def internal_waste_bytes(self) -> int:
        """Rounding waste of live allocations: bytes they hold beyond what they asked for."""
        return self.allocated_bytes - self.live_bytes

    def _take_uncut(self, ci: int, stream: int) -> _Block | None:
        """The lowest block of class ``ci``'s run, refilling it first when it is empty."""
        run = self._runs[ci]
        if run is None:
            run = self._refill(ci, stream)
            if run is None:
                return None
        size = self._class_sizes[ci]
        off = run.next
        run.next = off + size
        if run.next == run.end:
            self._runs[ci] = None
        return _Block(off, size, ci, run.segment, ((off, size),), self._free_lists[ci])

    def _refill(self, ci: int, stream: int) -> _Run | None:
        """Carve a batch of class ``ci`` blocks from a segment's tail: the class's new run."""
        size = self._class_sizes[ci]
        batch_bytes = max(1, self.refill_bytes // size) * size
        seg = self._carve_source(size, batch_bytes, stream)
        if seg is None:
            return None
        carving = seg.handle
        start = carving.bump
        end = start + min(batch_bytes, seg.end - start) // size * size
        carving.bump = end
        carving.classes.add(ci)
        self._close_if_full(seg)
        run = self._runs[ci] = _Run(seg, start, end)
        return run

    def _take_large(self, size: int, stream: int) -> _Block | None:
        cache = self._large_cache
        i = bisect_left(cache, (size,))
        if i < len(cache) and cache[i][0] <= size + size // self.classes_per_doubling:
            return cache.pop(i)[2]
        best = None
        for seg in self._open:  # smallest tail that holds it
            room = seg.end - seg.handle.bump
            if room >= size and (best is None or room < best.end - best.handle.bump):
                best = seg
        if best is None:
            best = self._recycle(size) or self._reserve_and_add(
                self._reserve_sizes(size, size), stream
            )
            if best is None:
                return None
        carving = best.handle
        off = carving.bump
        carving.bump = off + size
        carving.classes.add(_LARGE)
        self._close_if_full(best)
        return _Block(off, size, _LARGE, best, ((off, size),), None)

    def _carve_source(self, need: int, want: int, stream: int) -> Segment | None:
        """A segment whose tail holds ``want`` bytes, else the roomiest holding ``need``, else a new
        one."""
        best, best_room = None, need - 1
        for seg in self._open:
            room = seg.end - seg.handle.bump
            if room >= want:
                return seg
            if room > best_room:
                best, best_room = seg, room
        if best is not None:
            return best
        return self._recycle(need) or self._reserve_and_add(
            self._reserve_sizes(max(self.segment_bytes, want), want, need), stream
        )

    def _recycle(self, need: int) -> Segment | None:
        """Turn the smallest carved segment with no live block (and ``need`` bytes) back into a
        tail.

        The one way memory moves between classes without a device call: its cached blocks
        leave their lists and the whole segment becomes uncarved again.
        """
        best = None
        for seg in self._segments.values():
            if (
                seg.num_live == 0
                and seg.nbytes >= need
                and seg.handle.bump > seg.offset
                and (best is None or seg.nbytes < best.nbytes)
            ):
                best = seg
        if best is None:
            return None
        self._drop_cached({best})
        best.handle = _Carving(best.offset)
        if best not in self._open:
            self._open.append(best)
        self.num_recycles += 1
        return best

    def _reserve_sizes(self, preferred: int, *fallbacks: int) -> list[int]:
        """Segment sizes to try, largest first: ``preferred``, what capacity still allows,
        fallbacks."""
        sizes = [preferred]
        if self.capacity_bytes is not None:
            room = (
                (self.capacity_bytes - self.reserved_bytes)
                // CLASS_ALIGNMENT_BYTES
                * CLASS_ALIGNMENT_BYTES
            )
            if fallbacks and fallbacks[0] <= room < preferred:
                sizes.append(room)
        for nbytes in fallbacks:
            if nbytes < sizes[-1]:
                sizes.append(nbytes)
        return sizes

    def _reserve_and_add(self, sizes: list[int], stream: int) -> Segment | None:
        for nbytes in sizes:
            seg = self._reserve_segment(nbytes, stream)
            if seg is not None:
                self._add_segment(seg)
                return seg
        return None

    def _close_if_full(self, seg: Segment) -> None:
        if seg.end - seg.handle.bump < self._class_sizes[0]:
            self._open.remove(seg)

    # ----------------------------------------------------------------- segments
    def _segment_size_for(self, nbytes: int) -> int:
        return max(self.segment_bytes, round_up(nbytes, self.large_granularity_bytes))

    def _add_segment(self, segment: Segment) -> None:
        segment.handle = _Carving(segment.offset)
        if segment.nbytes >= self._class_sizes[0]:
            self._open.append(segment)

    def _release_free_segments(self, max_bytes: int | None) -> int:
        """Release segments with no live block, largest first, until ``max_bytes`` (None: all)."""
        gone = set(self._free_segments_to_release(max_bytes))
        if not gone:
            return 0
        self._drop_cached(gone)
        self._open[:] = [s for s in self._open if s not in gone]
        for seg in gone:
            self._release_segment(seg)
        return sum(seg.nbytes for seg in gone)

    def _drop_cached(self, gone: set[Segment]) -> None:
        """Remove the cached blocks and large ranges of segments with no live block."""
        for ci in set().union(*(seg.handle.classes for seg in gone)):
            if ci == _LARGE:
                self._large_cache[:] = [e for e in self._large_cache if e[2].segment not in gone]
            else:
                blocks = self._free_lists[ci]
                # in place (blocks point at the list), past the placeholders
                blocks[_FREE_LIST_BASE:] = [
                    b for b in blocks[_FREE_LIST_BASE:] if b.segment not in gone
                ]
                run = self._runs[ci]
                if run is not None and run.segment in gone:
                    self._runs[ci] = None

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Assert the byte accounting in O(classes + segments), cheap enough for every step of a
        soak.

        Every reserved byte is held by a live block, cached on a class list, in a class's run of
        blocks not handed out yet (``_Run``), in the large cache, or still uncarved in a segment
        tail; segment ``num_live`` counts add up to the live allocations; ``_open`` lists exactly
        the segments whose tail holds the smallest class. The brute-force recount of each free block
        (``policies.testing.check_invariants``, O(free blocks), about 10^4 here) checks where those
        blocks lie.
        """
        sizes = self._class_sizes
        assert all(
            blocks[:_FREE_LIST_BASE] == [None] * _FREE_LIST_BASE for blocks in self._free_lists
        ), "a free list lost its placeholders"
        cached = sum(
            (len(blocks) - _FREE_LIST_BASE) * size for blocks, size in zip(self._free_lists, sizes)
        )
        cached += sum(run.end - run.next for run in self._runs if run is not None)
        assert all(
            run.segment.offset <= run.next < run.end <= run.segment.handle.bump
            and (run.end - run.next) % size == 0
            for run, size in zip(self._runs, sizes)
            if run is not None
        ), "a class's run is malformed"
        large = sum(size for size, _, _ in self._large_cache)
        segs = self._segments.values()
        tails = sum(seg.end - seg.handle.bump for seg in segs)
        accounted = self.allocated_bytes + cached + large + tails
        assert accounted == self.reserved_bytes, (
            f"allocated {self.allocated_bytes} + cached {cached} + large {large} + tails {tails} "
            f"= {accounted} != reserved {self.reserved_bytes}"
        )
        live = sum(seg.num_live for seg in segs)
        assert live == self.num_live, f"segments count {live} live blocks, the pool {self.num_live}"
        assert all(
            seg.offset <= seg.handle.bump <= seg.end
            and (seg.handle.bump - seg.offset) % CLASS_ALIGNMENT_BYTES == 0
            for seg in segs
        ), "a segment's bump pointer lies outside it or off the 512 B grid"
        open_ids = {id(seg) for seg in self._open}
        assert len(open_ids) == len(self._open), "a segment is listed twice as open"
        should_be_open = {id(seg) for seg in segs if seg.end - seg.handle.bump >= sizes[0]}
        assert open_ids == should_be_open, (
            "_open does not list exactly the segments with room for a block"
        )
        assert all(a[:2] <= b[:2] for a, b in zip(self._large_cache, self._large_cache[1:])), (
            "the large cache is out of size order"
        )

    # ----------------------------------------------------------------- free space
    def free_extents(self) -> list[tuple[int, int]]:
        # C-level chains over the cached blocks' prebuilt extents: ~10^4 of them in a busy pool
        cached = chain.from_iterable(
            islice(blocks, _FREE_LIST_BASE, None) for blocks in self._free_lists
        )
        out = list(chain.from_iterable(map(_extents_of, cached)))
        for run, size in zip(self._runs, self._class_sizes):
            if run is not None:
                out.extend((off, size) for off in range(run.next, run.end, size))
        out.extend((off, size) for size, off, _ in self._large_cache)
        out.extend(
            (s.handle.bump, s.end - s.handle.bump)
            for s in self._segments.values()
            if s.handle.bump < s.end
        )
        out.sort()
        return out

    @cython.locals(s=Segment)
    def largest_free_bytes(self) -> int:
        # plain loops and no ``Segment.end`` property: a monitor calls this every ~100 events of a
        # replay, where the generator and property version cost ~3.5 us (~35 ns an event)
        sizes, free_lists, runs = self._class_sizes, self._free_lists, self._runs
        best = 0
        for ci in range(
            len(sizes) - 1, -1, -1
        ):  # the largest class with a block or a run to hand out
            if (
                free_lists[ci][-1] is not None or runs[ci] is not None
            ):  # a block above the placeholders
                best = sizes[ci]
                break
        if self._large_cache:
            best = max(best, self._large_cache[-1][0])
        # a tail, or a whole segment with no live block (``_recycle`` turns it back into a tail)
        room = 0
        for s in self._open:
            tail = s.offset + s.nbytes - s.handle.bump
            if tail > room:
                room = tail
        for s in self._segments.values():
            if not s.num_live and s.nbytes > room:
                room = s.nbytes
        if room >= sizes[0]:
            best = max(best, sizes[bisect_right(sizes, room) - 1])
            if room > self.max_class_bytes:  # a large request rounded to the granularity fits too
                best = max(
                    best, room // self.large_granularity_bytes * self.large_granularity_bytes
                )
        return best
