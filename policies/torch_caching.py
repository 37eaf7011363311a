"""``torch-caching``: PyTorch's CUDA caching allocator, rule for rule.

Follows ``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/core/AllocatorConfig.cpp`` (PyTorch 2.x,
read with the search tool; function names below are theirs):

- sizes round up to 512 B (``round_size``), or to power-of-two divisions where
  ``roundup_power2_divisions`` sets them for the size's interval
  (``roundup_power2_next_division``; intervals are the powers of two from 1 MiB to 32 GiB);
- requests <= 1 MiB use the small pool, packed into 2 MiB segments; 1-10 MiB requests get a
  20 MiB segment; >= 10 MiB are rounded to 2 MiB and get a segment of their own
  (``get_allocation_size``);
- best fit over free blocks ordered by (stream, size, address); another stream's blocks are
  never used (``get_free_block``); with ``max_split_size`` a request below it never takes an
  oversize block and a request above it takes an oversize block only when less than
  ``max_non_split_rounding`` larger;
- the allocated block is cut from the front of the free one; the small pool splits when
  >= 512 B remain, the large pool when > 1 MiB remains and the request is below
  ``max_split_size`` (``should_split``, ``alloc_found_block``);
- a freed block merges with its free neighbours in the segment (``free_block``);
- on a miss (``malloc``): ``garbage_collect_cached_blocks`` when ``garbage_collection_threshold``
  is set (PyTorch needs a memory fraction for it: here, ``capacity_bytes``), then ``cudaMalloc``;
  on failure ``release_available_cached_blocks`` (oversize blocks, only with ``max_split_size``)
  and a retry, then ``release_cached_blocks`` (every unsplit cached segment, what
  ``empty_cache()`` does) and a last try, then out of memory.

``capacity_bytes`` is PyTorch's ``allowed_memory_maximum`` (``set_per_process_memory_fraction``)
and the device's memory at once: a segment that would pass it is refused.

Replay fidelity: ``seed_segment`` rebuilds a segment that existed before a trace began (its
blocks at their real offsets), and ties between equal-size free blocks are broken by address as
in PyTorch, so a device that hands out the recorded ``cudaMalloc`` addresses reproduces the real
allocator's decisions (``sim.replay.fidelity``).

Private pools (``beginAllocateToPool`` / ``endAllocateToPool`` / ``releasePool``, what a CUDA
graph capture and ``torch.cuda.MemPool`` use): while a capture into pool P is underway on stream
S, requests on S are served from P's own free lists and segments (``get_pool``); a block freed
later goes back to the pool it came from. ``release_cached_blocks`` (``empty_cache()``, the last
retry of ``malloc``) releases the default pool's unsplit blocks and those of private pools no
longer in use (``use_count == 0``, after ``release_pool``); the retry does not run while a
capture is underway (``captures_underway.empty()`` guards it in PyTorch).

``expandable_segments=True`` (``ExpandableSegment``; also the ``expandable`` policy) runs over
a page-mapped device (``policies.mapped_device``): one virtual range per (pool, small/large,
stream), reserved on first use (1 1/8 of the device's memory), into which 2 MiB (small) or
20 MiB (large) pages are mapped on demand:

- a miss maps pages (``try_allocate_expandable_block``: the lowest unmapped range of the stream
  and pool, joined with the free block just before it; ``map_block`` maps the pages covering
  what is missing, one ``segment_map`` per call, and merges with free mapped neighbours);
- best fit treats a free block followed by unmapped space as being as large as it can grow
  (``expandable_size``), so it prefers a free block elsewhere that is merely large enough;
- a block splits whenever >= 512 B remain, in both pools (``should_split``);
- ``release_cached_blocks`` (``empty_cache()``, the last retry) unmaps every whole page inside
  each free block (``unmap_block``: one ``segment_unmap`` per block), and gives a range that
  is left with nothing mapped back. A plain free unmaps nothing.

Not emulated: CUDA events and ``record_stream`` (a free is complete at once).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from policies.base import Allocation, Policy, Segment
from policies.device_kind import DeviceKind
from policies.errors import PolicyError
from traces.knobs import check_flag, check_int
from traces.spec_grammar import parse_items
from policies.mapped_device import as_page_mapped
from policies.spec import format_spec
from policies.units import round_up

__all__ = [
    "TorchCaching",
    "round_size",
    "allocation_size",
    "roundup_power2_next_division",
    "parse_roundup_power2_divisions",
    "NUM_ROUNDUP_INTERVALS",
    "DEFAULT_POOL",
    "params_from_settings",
    "spec_from_settings",
]

MiB = 1 << 20
K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 * MiB
K_SMALL_BUFFER = 2 * MiB
K_LARGE_BUFFER = 20 * MiB
K_MIN_LARGE_ALLOC = 10 * MiB
K_ROUND_LARGE = 2 * MiB
#: device memory assumed for an expandable range's size when neither capacity nor device says (H200)
_DEFAULT_DEVICE_BYTES = 141 * (1 << 30)
#: ``MempoolId_t{0, 0}``: the default pool; private pools have any other hashable id.
DEFAULT_POOL = (0, 0)
#: ``kRoundUpPowerOfTwoIntervals``: one divisions setting per power of two from 1 MiB to 32 GiB.
NUM_ROUNDUP_INTERVALS = 16
_INTERVAL_START_LOG2 = 20  # the first interval starts at 1 MiB
_KEY_BITS = 64  # free-block keys pack size << 64 | address (addresses are below 2**64)
_PTR_MASK = (1 << _KEY_BITS) - 1


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


def _interval_of(size: int) -> int:
    """Index of ``size``'s power-of-two interval (``roundup_power2_divisions(size)``)."""
    return min(max(size.bit_length() - 1 - _INTERVAL_START_LOG2, 0), NUM_ROUNDUP_INTERVALS - 1)


def round_size(size: int, divisions: int | tuple[int, ...] = 0) -> int:
    """``round_size``: the block size PyTorch sets aside for a request of ``size`` bytes.

    ``divisions`` is one setting for every size or a tuple with one per interval
    (``parse_roundup_power2_divisions``).
    """
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    d = divisions[_interval_of(size)] if isinstance(divisions, tuple) else divisions
    if d > 1 and size > K_MIN_BLOCK * d:
        return roundup_power2_next_division(size, d)
    return round_up(size, K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: segment bytes ``cudaMalloc`` is asked for when a rounded request
    misses."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return round_up(size, K_ROUND_LARGE)


def _is_pow2_or_zero(value: int) -> bool:
    return value >= 0 and value & (value - 1) == 0


def parse_roundup_power2_divisions(value: int | str) -> tuple[int, ...]:
    """The per-interval divisions table, from an int or PyTorch's list syntax.

    ``4`` sets 4 divisions for every size; ``"256:1,512:2,1024:4,>:8"`` (boundaries in MiB, powers
    of two, as in ``PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:[...]``) sets 1 division up
    to the 256 MiB interval, 2 for [512 MiB, 1 GiB), 4 for [1 GiB, 2 GiB) and 8 above;
    sizes below the first boundary take its value (``parseRoundUpPower2Divisions``).
    """
    where = f"roundup_power2_divisions(={value!r})"
    if isinstance(value, bool):
        raise PolicyError(f"{where} must be an integer or a list such as '256:1,512:2,>:8'")
    if isinstance(value, int):
        if not _is_pow2_or_zero(value):
            raise PolicyError(f"{where} must be 0 or a power of two")
        return (value,) * NUM_ROUNDUP_INTERVALS
    if not isinstance(value, str):
        raise PolicyError(f"{where} must be an integer or a list such as '256:1,512:2,>:8'")
    text = value.strip().removeprefix("[").removesuffix("]")
    table = [0] * NUM_ROUNDUP_INTERVALS
    first, last_index = True, 0
    for item in text.split(","):
        boundary, sep, divs = item.partition(":")
        boundary, divs = boundary.strip(), divs.strip()
        if not sep or not divs.isdigit() or not _is_pow2_or_zero(int(divs)):
            raise PolicyError(
                f"{where}: {item.strip()!r} is not 'MiB:divisions' with divisions 0 "
                "or a power of two"
            )
        d = int(divs)
        if boundary == ">":
            table[last_index + 1 :] = [d] * (NUM_ROUNDUP_INTERVALS - last_index - 1)
            continue
        if not boundary.isdigit() or int(boundary) <= 0 or not _is_pow2_or_zero(int(boundary)):
            raise PolicyError(f"{where}: boundary {boundary!r} must be a power of two (MiB) or '>'")
        index = min(int(boundary).bit_length() - 1, NUM_ROUNDUP_INTERVALS - 1)
        if first:
            table[:index] = [d] * index
            first = False
        table[index] = d
        last_index = index
    return tuple(table)


@dataclass(slots=True, eq=False)
class _Block:
    """``Block``: a range of one segment, free or allocated; ``prev``/``next`` are its address
    neighbours."""

    ptr: int
    size: int
    stream: int
    small: bool
    segment: Segment
    pool: Any = (0, 0)  # MempoolId of the BlockPool it belongs to; (0, 0) is the default pool
    prev: "_Block | None" = None
    next: "_Block | None" = None
    allocated: bool = False
    gc_count_base: int = 0  # the pool's get_free_block calls when the block was cached
    mapped: bool = True  # False: address space of an expandable range with no pages behind it
    # the sorted free-key list of (pool, small, stream), set when first cached: every block of a
    # chain keeps its pool, size class and stream for life, so the hot paths skip the dict lookup
    keys: "list[int] | None" = None

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class TorchCaching(Policy):
    """PyTorch's CUDA caching allocator (see the module docstring for the rules followed).

    Args:
        max_split_size_bytes: blocks at least this large are never split (``max_split_size_mb``;
            None: no limit, PyTorch's default). Must exceed 20 MiB, as in PyTorch.
        max_non_split_rounding_bytes: an oversize cached block serves a request at or above
            ``max_split_size`` only when less than this much larger (``max_non_split_rounding_mb``;
            default 20 MiB, PyTorch's ``kLargeBuffer``).
        roundup_power2_divisions: round sizes up to this many divisions per power of two: 0 (plain
            512 B rounding), a power of two for every size, or PyTorch's per-interval list
            ``"256:1,512:2,>:8"`` (boundaries in MiB; in a spec string, write it in brackets).
        garbage_collection_threshold: fraction 0..1 of ``capacity_bytes``; past it, before a new
            segment, cached unsplit large blocks unused for longest are released. Needs
            ``capacity_bytes`` (PyTorch needs a memory fraction).
        expandable_segments: map pages into one growing virtual range per stream and pool
            (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; needs a page-mapped device,
            see the module docstring).
        capacity_bytes, device: see ``Policy``.

    Index of free blocks: per (pool, stream), a sorted ``list`` of int keys
    ``size << 64 | address``, so the first key at or after ``size << 64`` is PyTorch's best fit
    (a C-level bisect; ``insort``/``del`` beat a ``SortedList`` at the few thousand free blocks
    real pools hold). Why this structure: one int compare per bisect step in C and one memmove
    per insert or delete, where any tree or heap written in Python costs a call per step; each
    block holds its own list (``_Block.keys``) and the default pool's lists are also kept by
    size class and stream (``_default_keys``), so no per-event lookup hashes a nested tuple.
    """

    name = "torch-caching"
    can_seed_segments = True
    has_private_pools = True
    coalesces = True

    def __init__(
        self,
        *,
        max_split_size_bytes: int | None = None,
        max_non_split_rounding_bytes: int = K_LARGE_BUFFER,
        roundup_power2_divisions: int | str = 0,
        garbage_collection_threshold: float = 0.0,
        expandable_segments: bool = False,
        capacity_bytes: int | None = None,
        device=None,
    ):
        if max_split_size_bytes is not None and (
            isinstance(max_split_size_bytes, bool)
            or not isinstance(max_split_size_bytes, int)
            or max_split_size_bytes <= K_LARGE_BUFFER
        ):
            raise PolicyError(
                f"max_split_size_bytes(={max_split_size_bytes!r}) must be None "
                "or an integer > 20 MiB, as in PyTorch"
            )
        check_int(
            "max_non_split_rounding_bytes",
            max_non_split_rounding_bytes,
            low=K_LARGE_BUFFER,
            error=PolicyError,
        )
        parse_roundup_power2_divisions(roundup_power2_divisions)
        if (
            isinstance(garbage_collection_threshold, bool)
            or not isinstance(garbage_collection_threshold, (int, float))
            or not 0.0 <= garbage_collection_threshold < 1.0
        ):
            raise PolicyError(
                f"garbage_collection_threshold(={garbage_collection_threshold!r}) must be in [0, 1)"
            )
        check_flag("expandable_segments", expandable_segments, error=PolicyError)
        self.max_split_size_bytes = max_split_size_bytes
        self.max_non_split_rounding_bytes = max_non_split_rounding_bytes
        self.roundup_power2_divisions = roundup_power2_divisions
        self.garbage_collection_threshold = garbage_collection_threshold
        self.expandable_segments = expandable_segments
        super().__init__(capacity_bytes=capacity_bytes, device=device)

    @classmethod
    def device_kind_for(cls, params: dict[str, Any]) -> DeviceKind:
        expandable = params.get("expandable_segments", cls.param_defaults()["expandable_segments"])
        return DeviceKind.PAGE_MAPPED if expandable else DeviceKind.SEGMENT

    def _reset_state(self) -> None:
        if self.expandable_segments:
            self._mapped_device = as_page_mapped(self.device)
            self.device = self._mapped_device
        # expandable: (pool, small, stream) -> that range's Segment (nbytes: the bytes mapped in it)
        self._ranges: dict[tuple[Any, bool, int], Segment] = {}
        self._heads: dict[
            int, _Block
        ] = {}  # range start -> its first block (the chain walks the range)
        self._spans: dict[int, int] = {}  # range start -> its reserved bytes
        self._keys: dict[
            tuple[Any, bool, int], list[int]
        ] = {}  # (pool, small, stream) -> sorted size << 64 | ptr
        self._free_at: dict[int, _Block] = {}  # ptr -> cached (free) block
        # the default pool's lists of ``_keys`` again, [small][stream]: the hot path's lookup
        self._default_keys: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})
        table = parse_roundup_power2_divisions(self.roundup_power2_divisions)
        self._divisions: int | tuple[int, ...] = table[0] if len(set(table)) == 1 else table
        self._max_split = (
            self.max_split_size_bytes if self.max_split_size_bytes is not None else 1 << 64
        )
        self._gc_on = self.garbage_collection_threshold > 0 and self.capacity_bytes is not None
        self._free_block_calls = {True: 0, False: 0}  # BlockPool::get_free_blocks_call_count
        self.num_alloc_retries = 0  # release_cached_blocks ran to satisfy a request
        self.num_ooms = 0
        self._use_count: dict[Any, int] = {}  # private pool -> PrivatePool::use_count
        self._captures: list[
            tuple[Any, int]
        ] = []  # captures_underway: (pool, stream), oldest first
        self._num_pool_segments: dict[
            Any, int
        ] = {}  # private pool -> PrivatePool::cudaMalloc_count

    # ------------------------------------------------------------------ the free-block index
    def _keys_of(self, pool: Any, small: bool, stream: int) -> list[int]:
        """The sorted free-key list of (``pool``, ``small``, ``stream``), made on first use."""
        keys = self._keys.get((pool, small, stream))
        if keys is None:
            keys = self._keys[(pool, small, stream)] = []
            if pool == DEFAULT_POOL:
                self._default_keys[small][stream] = keys
        return keys

    def _insert(self, b: _Block) -> None:
        """``insert_into_blocks``: cache a free block (and stamp it for garbage collection).

        ``_free`` and the split in ``_allocate`` run the same steps inline (the hot paths: a
        call each per event); a change here goes there too."""
        if self._gc_on:  # the counts move only with garbage collection on: else the stamp stays 0
            b.gc_count_base = self._free_block_calls[b.small]
        keys = b.keys
        if keys is None:
            keys = b.keys = self._keys_of(b.pool, b.small, b.stream)
        insort(keys, b.size << _KEY_BITS | b.ptr)
        self._free_at[b.ptr] = b

    def _remove(self, b: _Block) -> None:
        keys = b.keys
        key = b.size << _KEY_BITS | b.ptr
        i = bisect_left(keys, key)
        assert keys[i] == key, "removing a block that is not cached"
        del keys[i]
        del self._free_at[b.ptr]

    def _cached(self, small: bool, pool: Any = DEFAULT_POOL) -> Iterator[_Block]:
        """``pool``'s cached blocks in PyTorch's set order (stream, size, address), as a
        snapshot."""
        blocks = []
        for (in_pool, is_small, _stream), keys in sorted(
            self._keys.items(), key=lambda kv: kv[0][2]
        ):
            if is_small == small and in_pool == pool:
                blocks.extend(self._free_at[k & _PTR_MASK] for k in keys)
        return iter(blocks)

    def _skip_growable(self, keys: list[int], i: int) -> int:
        """``get_free_block`` with expandable segments: from the best fit on, move to the next
        block while that one could grow less (a free block before unmapped space counts as the
        size it could grow to: ``expandable_size``), so a block that merely fits is preferred to
        a growable tail."""
        free_at, last = self._free_at, len(keys) - 1
        b = free_at[keys[i] & _PTR_MASK]
        nxt = b.next
        grown = b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
        while i < last:
            c = free_at[keys[i + 1] & _PTR_MASK]
            nxt = c.next
            c_grown = c.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
            if c_grown >= grown:
                break
            i, grown = i + 1, c_grown
        return i

    # ------------------------------------------------------------------ Policy hooks
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        # plain rounding inline (``round_size`` with no divisions: up to K_MIN_BLOCK = 512 B)
        size = (
            (nbytes + 511) & -512 if self._divisions == 0 else round_size(nbytes, self._divisions)
        )
        small = size <= K_SMALL_SIZE
        if self._captures:
            pool = self._pool_for(stream)
            keys = self._keys.get((pool, small, stream))
        else:  # no capture underway: the default pool (``_pool_for``), by size class and stream
            pool = DEFAULT_POOL
            keys = self._default_keys[small].get(stream)
        # ``get_free_block``, inline (every allocation runs it): the best-fit cached block of
        # ``pool`` for the rounded ``size``, taken out of ``_free_at``, its key left at the index
        # its bisect found (``i``) until the split below knows whether the rest takes its place;
        # or None; ``keys`` is the (pool, small, stream) list of ``_keys`` (None: none made yet)
        if self._gc_on and pool == DEFAULT_POOL:
            self._free_block_calls[small] += 1
        b, i = None, -1  # i: the block's place in ``keys``, its key left there until the split
        if keys:
            i = bisect_left(keys, size << _KEY_BITS)
            if i < len(keys):
                if self.expandable_segments:
                    # the walk only where the best fit could grow (a free block before unmapped
                    # space: 4 % of the mixed snapshot's allocations): else every later key is
                    # at least its size, so the walk would stop at once (``_skip_growable``)
                    nxt = self._free_at[keys[i] & _PTR_MASK].next
                    if nxt is not None and not nxt.mapped:
                        i = self._skip_growable(keys, i)
                key = keys[i]
                found = key >> _KEY_BITS
                # a block at or above max_split_size (none when it is unset) serves a request
                # below it never, one at or above it only within max_non_split_rounding
                if found < self._max_split or (
                    size >= self._max_split and found < size + self.max_non_split_rounding_bytes
                ):
                    b = self._free_at.pop(key & _PTR_MASK)
        if b is None:
            b = self._malloc_segment(pool, small, stream, size)
            if b is None:
                self.num_ooms += 1
                return None
            i = -1  # a new segment's block: in no index
        remaining = b.size - size
        if (
            (remaining >= K_MIN_BLOCK)
            if small or self.expandable_segments
            else (size < self._max_split and remaining > K_SMALL_SIZE)
        ):
            front = _Block(
                b.ptr, size, stream, small, b.segment, pool, prev=b.prev, next=b, keys=b.keys
            )
            if b.prev is not None:
                b.prev.next = front
            b.prev = front
            b.ptr += size
            b.size = remaining
            if i < 0:
                self._insert(b)
            else:  # ``_insert`` of the rest, which was cached at ``keys[i]``
                rest_key = remaining << _KEY_BITS | b.ptr
                # smaller than the block's key, so before every later one: where the key before
                # it is smaller still, the rest takes the block's place (no list shifts twice)
                if i == 0 or keys[i - 1] < rest_key:
                    keys[i] = rest_key
                else:
                    del keys[i]
                    insort(keys, rest_key)
                if self._gc_on:
                    b.gc_count_base = self._free_block_calls[small]
                self._free_at[b.ptr] = b
            b = front
        elif i >= 0:
            del keys[i]
        b.allocated = True
        b.segment.num_live += 1
        self.allocated_bytes += b.size
        return Allocation(nbytes, b.size, ((b.ptr, b.size),), stream, tag, b)

    def _malloc_segment(self, pool: Any, small: bool, stream: int, size: int) -> _Block | None:
        """The miss path of ``malloc``: garbage collection, ``alloc_block`` and its two retries.

        Returns the new segment's block, not cached, or None (out of memory). The last retry
        (``release_cached_blocks``) does not run while a capture is underway, as in PyTorch.
        """
        alloc_bytes = size if self.expandable_segments else allocation_size(size)
        if self._frozen:  # refused at once (Policy.freeze): no GC, no emptied cache, no retry
            return self._alloc_block(pool, small, stream, alloc_bytes)
        if self._gc_on:
            self._garbage_collect()
        b = self._alloc_block(pool, small, stream, alloc_bytes)
        if b is None and self._release_available_cached_blocks(pool, small, stream, size):
            b = self._alloc_block(pool, small, stream, alloc_bytes)
        if b is None and not self._captures:
            self.num_alloc_retries += 1
            self._release_free_segments(None)
            b = self._alloc_block(pool, small, stream, alloc_bytes)
        return b

    def _alloc_block(self, pool: Any, small: bool, stream: int, alloc_bytes: int) -> _Block | None:
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, small, stream, alloc_bytes)
        seg = self._reserve_segment(alloc_bytes, stream, retry=False)
        if seg is None:
            return None
        seg.handle = small
        self._count_pool_segment(pool, +1)
        return _Block(seg.offset, alloc_bytes, stream, small, seg, pool)

    def _count_pool_segment(self, pool: Any, delta: int) -> None:
        if pool != DEFAULT_POOL:
            self._num_pool_segments[pool] = self._num_pool_segments.get(pool, 0) + delta

    # ------------------------------------------------------------------ expandable segments
    def _page_bytes(self, small: bool) -> int:
        return K_SMALL_BUFFER if small else K_LARGE_BUFFER

    def _range_span_bytes(self) -> int:
        """Address space of one range: 1 1/8 of the device's memory, as PyTorch reserves."""
        total = self.capacity_bytes or self._mapped_device.limit_bytes or _DEFAULT_DEVICE_BYTES
        return round_up(total + total // 8, K_LARGE_BUFFER)

    def _range(self, pool: Any, small: bool, stream: int) -> Segment | None:
        """The range of (pool, small/large, stream), reserved on first use with nothing mapped."""
        key = (pool, small, stream)
        seg = self._ranges.get(key)
        if seg is None:
            span = self._range_span_bytes()
            start = self._mapped_device.address_reserve(span)
            if start is None:
                return None
            seg = self._ranges[key] = Segment(start, 0, stream, handle=small)
            self._heads[start] = _Block(start, span, stream, small, seg, pool, mapped=False)
            self._spans[start] = span
            self._segments[start] = seg
            self._count_pool_segment(pool, +1)
        return seg

    def _head(self, seg: Segment) -> _Block:
        """The first block of an expandable range (a split in front of the stored one is found by
        walking back)."""
        b = self._heads[seg.offset]
        while b.prev is not None:
            b = b.prev
        self._heads[seg.offset] = b
        return b

    def _try_allocate_expandable_block(
        self, pool: Any, small: bool, stream: int, size: int
    ) -> _Block | None:
        """``try_allocate_expandable_block``: a free block of at least ``size`` made by mapping
        pages into the lowest unmapped range that, with the free block before it, has room;
        removed from the index. None when the device or ``capacity_bytes`` refuses."""
        if self._frozen:  # Policy.freeze: no page is mapped any more
            self._frozen_refusal_at = self.num_allocs + self.num_failures
            return None
        seg = self._range(pool, small, stream)
        if seg is None:
            return None
        candidate = None
        b = self._head(seg)
        while b is not None:  # find_expandable_block: unmapped blocks in address order
            if not b.mapped:
                c = b.prev if b.prev is not None and not b.prev.allocated else b
                room, walk = 0, c
                while room < size and walk is not None and not walk.allocated:
                    room, walk = room + walk.size, walk.next
                if room >= size:
                    candidate = c
                    break
            b = b.next
        if candidate is None or not self._can_map(self._bytes_to_map(candidate, size, small)):
            return None
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            self._drop_if_empty((pool, small, stream))
            return None
        while (
            candidate.size < size
        ):  # free -> unmapped: map what is missing, merging into the free block
            nxt = candidate.next
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = self._last_merged
        self._remove(candidate)
        return candidate

    def _bytes_to_map(self, candidate: _Block, size: int, small: bool) -> int:
        """The page bytes ``_try_allocate_expandable_block`` maps to make ``size`` free bytes
        from ``candidate`` on (the same walk as its mapping loop)."""
        page = self._page_bytes(small)
        room = need = 0
        walk: _Block | None = candidate
        while room < size and walk is not None:
            if walk.mapped:
                room += walk.size
            else:
                n = round_up(min(walk.size, size - room), page)
                need += n
                room += n
            walk = walk.next
        return need

    def _can_map(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more can be mapped within capacity and the device's memory. Checked
        before mapping anything, so a refused request leaves no pages behind (the failure
        contract; PyTorch keeps, cached, the pages it mapped before the refusal)."""
        if self.capacity_bytes is not None and self.reserved_bytes + nbytes > self.capacity_bytes:
            return False
        dev = self._mapped_device
        return dev.limit_bytes is None or dev.physical_bytes + nbytes <= dev.limit_bytes

    def _map_block(self, b: _Block, size: int) -> bool:
        """``map_block``: map the pages covering ``[b.ptr, b.ptr + size)`` of unmapped block ``b``,
        split off the unmapped rest and merge with free mapped neighbours (one ``segment_map``)."""
        page = self._page_bytes(b.small)
        seg = b.segment
        first = b.ptr - (b.ptr - seg.offset) % page
        assert first == b.ptr, "an unmapped block starts on a page boundary"
        nbytes = round_up(size, page)
        if self.capacity_bytes is not None and self.reserved_bytes + nbytes > self.capacity_bytes:
            return False
        if not self._mapped_device.map_new(b.ptr, nbytes, page):
            return False
        left = b.prev is not None and b.prev.mapped
        right = nbytes == b.size and b.next is not None and b.next.mapped
        self._count_runs(1 - left - right)
        if nbytes < b.size:
            rest = _Block(
                b.ptr + nbytes,
                b.size - nbytes,
                b.stream,
                b.small,
                seg,
                b.pool,
                prev=b,
                next=b.next,
                mapped=False,
            )
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = nbytes
        b.mapped = True
        seg.nbytes += nbytes
        self.reserved_bytes += nbytes
        self.grown_bytes += nbytes
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
        b = self._merge_free_neighbours(b)
        self._insert(b)
        self._last_merged = b
        return True

    def _merge_free_neighbours(self, b: _Block) -> _Block:
        """``try_merge_blocks`` with both neighbours: free ones of the same mapped state join ``b``
        (cached ones leave the index; ``b`` is returned, not cached)."""
        prev, nxt = b.prev, b.next
        if prev is not None and not prev.allocated and prev.mapped == b.mapped:
            if prev.mapped:
                self._remove(prev)
            b.ptr, b.size, b.prev = prev.ptr, prev.size + b.size, prev.prev
            if b.prev is not None:
                b.prev.next = b
            else:
                self._heads[b.segment.offset] = b
        if nxt is not None and not nxt.allocated and nxt.mapped == b.mapped:
            if nxt.mapped:
                self._remove(nxt)
            b.size += nxt.size
            b.next = nxt.next
            if b.next is not None:
                b.next.prev = b
        return b

    def _unmap_block(self, b: _Block) -> int:
        """``unmap_block``: unmap the whole pages inside cached block ``b`` (one ``segment_unmap``);
        the free edges around them stay cached. Returns the bytes unmapped."""
        page = self._page_bytes(b.small)
        seg = b.segment
        start = seg.offset + round_up(b.ptr - seg.offset, page)
        end = seg.offset + (b.ptr + b.size - seg.offset) // page * page
        if end <= start:
            return 0
        self._remove(b)
        self._mapped_device.unmap_release(start, end - start)
        left = start > b.ptr or (b.prev is not None and b.prev.mapped)
        right = b.ptr + b.size > end or (b.next is not None and b.next.mapped)
        self._count_runs(left + right - 1)
        if start > b.ptr:
            before = _Block(
                b.ptr, start - b.ptr, b.stream, b.small, seg, b.pool, prev=b.prev, next=b
            )
            if b.prev is not None:
                b.prev.next = before
            else:
                self._heads[seg.offset] = before
            b.prev = before
            self._insert(before)
        if b.ptr + b.size > end:
            after = _Block(
                end, b.ptr + b.size - end, b.stream, b.small, seg, b.pool, prev=b, next=b.next
            )
            if b.next is not None:
                b.next.prev = after
            b.next = after
            self._insert(after)
        b.ptr, b.size, b.mapped = start, end - start, False
        self._merge_free_neighbours(b)
        unmapped = end - start
        seg.nbytes -= unmapped
        self.reserved_bytes -= unmapped
        self.shrunk_bytes += unmapped
        return unmapped

    def _release_expandable(self, pool: Any, max_bytes: int | None) -> int:
        """``release_blocks`` of an expandable pool: unmap inside every cached block of ``pool``;
        a range left with nothing mapped is given back (``release_expandable_segment``)."""
        released = 0
        for b in [*self._cached(False, pool), *self._cached(True, pool)]:
            if max_bytes is not None and released >= max_bytes:
                break
            released += self._unmap_block(b)
        for key in [k for k in self._ranges if k[0] == pool]:
            self._drop_if_empty(key)
        return released

    def _count_runs(self, delta: int) -> None:
        """Segments of an expandable pool are its mapped runs (as PyTorch's snapshot lists them):
        a run started counts a grow, one merged or unmapped away a shrink; an unmapped hole that
        splits a run counts a grow with no byte reserved (``grown_bytes`` counts mappings only)."""
        if delta > 0:
            self.num_grows += delta
        else:
            self.num_shrinks -= delta

    def segments(self) -> list[Segment]:
        """Expandable: one segment per run of mapped pages (``num_live``: allocations in it)."""
        if not self.expandable_segments:
            return super().segments()
        runs: list[Segment] = []
        for seg in self._ranges.values():
            b, run = self._head(seg), None
            while b is not None:
                if not b.mapped:
                    run = None
                else:
                    if run is None:
                        run = Segment(b.ptr, 0, seg.stream)
                        runs.append(run)
                    run.nbytes += b.size
                    run.num_live += b.allocated
                b = b.next
        return sorted(runs, key=lambda r: r.offset)

    def reset(self) -> None:
        if (
            self.expandable_segments
        ):  # unmap every page and give the ranges back (not the segment protocol)
            for seg in self._ranges.values():
                span = self._spans[seg.offset]
                self._mapped_device.unmap_release(seg.offset, span)
                self._mapped_device.address_free(seg.offset, span)
                del self._segments[seg.offset]
        super().reset()

    def gauges(self) -> tuple[int, int, int, int, int]:
        live, allocated, reserved, largest_free, num_segments = super().gauges()
        if self.expandable_segments:  # a range's pages, not its cuMem chunks, are what it counts
            num_segments = self._num_runs()
        return live, allocated, reserved, largest_free, num_segments

    def _num_runs(self) -> int:
        """``len(self.segments())`` of an expandable pool, without making and sorting them (the
        monitor asks at every sample: 2 % of an expandable replay)."""
        n = 0
        for seg in self._ranges.values():
            b, in_run = self._head(seg), False
            while b is not None:
                if b.mapped:
                    if not in_run:
                        n += 1
                        in_run = True
                else:
                    in_run = False
                b = b.next
        return n

    def _drop_if_empty(self, key: tuple[Any, bool, int]) -> None:
        """``release_expandable_segment``: give back a range with nothing mapped in it."""
        seg = self._ranges[key]
        if seg.nbytes:
            return
        self._mapped_device.address_free(seg.offset, self._spans.pop(seg.offset))
        del self._ranges[key], self._segments[seg.offset], self._heads[seg.offset]
        self._count_pool_segment(key[0], -1)

    def _free(self, allocation: Allocation) -> None:
        """``free_block``: merge with free neighbours (previous first) and cache the result."""
        b: _Block = allocation.handle
        b.allocated = False
        b.segment.num_live -= 1
        self.allocated_bytes -= b.size
        # every free runs this: the merge is called only where a neighbour is free (it joins
        # nothing else), and ``_insert`` is inline
        prev, nxt = b.prev, b.next
        if (prev is not None and not prev.allocated) or (nxt is not None and not nxt.allocated):
            b = self._merge_free_neighbours(b)
        if self._gc_on:
            b.gc_count_base = self._free_block_calls[b.small]
        keys = b.keys
        if keys is None:
            keys = b.keys = self._keys_of(b.pool, b.small, b.stream)
        insort(keys, b.size << _KEY_BITS | b.ptr)
        self._free_at[b.ptr] = b

    def _release_block(self, b: _Block) -> int:
        """``release_block``: ``cudaFree`` a cached block that is a whole segment."""
        assert not b.is_split and not b.allocated
        self._remove(b)
        self._release_segment(b.segment)
        self._count_pool_segment(b.pool, -1)
        return b.size

    def _release_free_segments(self, max_bytes: int | None) -> int:
        """``release_cached_blocks``: free every cached unsplit block of the default pool (large
        first), then of each private pool no longer in use (``graph_pools_freeable``).

        With ``max_bytes``, stop once at least that many bytes are released (``trim``).
        """
        released = 0
        freeable = [p for p, n in self._use_count.items() if n == 0]
        for pool in (DEFAULT_POOL, *freeable):
            if self.expandable_segments:
                released += self._release_expandable(pool, max_bytes)
                continue
            for small in (False, True):
                for b in self._cached(small, pool):
                    if max_bytes is not None and released >= max_bytes:
                        return released
                    if not b.is_split:
                        released += self._release_block(b)
        for (
            pool
        ) in freeable:  # a freeable pool left with no segment is forgotten (cudaMalloc_count == 0)
            if not self._num_pool_segments.get(pool):
                del self._use_count[pool]
        return released

    # ------------------------------------------------------------------ private pools
    def _pool_for(self, stream: int) -> Any:
        """``get_pool``: the private pool of the first capture underway on ``stream``, else the
        default."""
        for pool, capture_stream in self._captures:
            if capture_stream == stream:
                return pool
        return DEFAULT_POOL

    def begin_allocate_to_pool(self, pool_id: Any, stream: int) -> None:
        """``beginAllocateToPool``: requests on ``stream`` go to private pool ``pool_id`` until
        ``end_allocate_to_pool``. A new pool starts in use (``use_count`` 1); a capture into an
        existing one shares it (``use_count`` + 1)."""
        if pool_id == DEFAULT_POOL:
            raise PolicyError(
                f"begin_allocate_to_pool: {pool_id!r} is the default pool, not a private one"
            )
        if pool_id in self._use_count:
            if self._use_count[pool_id] == 0:
                raise PolicyError(f"begin_allocate_to_pool: private pool {pool_id!r} was released")
            self._use_count[pool_id] += 1
        else:
            self._use_count[pool_id] = 1
        self._captures.append((pool_id, stream))

    def end_allocate_to_pool(self, pool_id: Any) -> None:
        """``endAllocateToPool``: stop routing requests to ``pool_id`` (its blocks stay in it)."""
        for i, (pool, _stream) in enumerate(self._captures):
            if pool == pool_id:
                del self._captures[i]
                return
        raise PolicyError(f"end_allocate_to_pool: no allocation to pool {pool_id!r} is underway")

    def release_pool(self, pool_id: Any) -> None:
        """``releasePool``: one user of ``pool_id`` (a graph) is gone; at zero users its cached
        segments become releasable by ``empty_cache``."""
        if not self._use_count.get(pool_id):
            raise PolicyError(f"release_pool: private pool {pool_id!r} is not in use")
        self._use_count[pool_id] -= 1

    def _release_available_cached_blocks(
        self, pool: Any, small: bool, stream: int, size: int
    ) -> bool:
        """``release_available_cached_blocks``: free oversize cached blocks, only with
        ``max_split_size``.

        One block at least as large as the request (or ``max_split_size``) if there is one, else
        the largest oversize blocks until that many bytes are freed.
        """
        if self.max_split_size_bytes is None:
            return False
        key = max(size, self._max_split)
        keys = self._keys.get((pool, small, stream), [])
        i = bisect_left(keys, key << _KEY_BITS)
        if i < len(keys):
            b = self._free_at[keys[i] & _PTR_MASK]
            if (
                b.is_split
            ):  # PyTorch would cudaFree it anyway; oversize blocks are never split in practice
                return False
            self._release_block(b)
            return True
        released = 0
        for k in reversed(keys[:i]):
            b = self._free_at[k & _PTR_MASK]
            if released >= key or b.size < self._max_split:
                break
            if not b.is_split:
                released += self._release_block(b)
        return released >= key

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: release unsplit large cached blocks of above-average
        age.

        Age is the number of large-pool lookups since the block was cached. Each pass frees
        every block at least as old as the current mean (it does not stop at the target, so GC
        runs rarely); passes repeat until ``reserved - threshold * capacity`` bytes are freed.
        """
        gc_threshold = int(self.garbage_collection_threshold * self.capacity_bytes)
        if self.reserved_bytes <= gc_threshold:
            return
        target = self.reserved_bytes - gc_threshold
        calls = self._free_block_calls[False]
        freeable = [b for b in self._cached(False) if not b.is_split]
        if not freeable:
            return
        total_age = sum(calls - b.gc_count_base for b in freeable)
        count = len(freeable)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for b in self._cached(False):
                age = calls - b.gc_count_base
                if not b.is_split and age >= age_threshold:
                    freed = True
                    reclaimed += self._release_block(b)
                    total_age -= age
                    count -= 1

    def grow(self, nbytes: int) -> bool:
        """Expandable: map fresh pages for ``nbytes`` in stream 0's range, one unmapped page past
        the last mapping so they are a free segment of their own (PyTorch has no such call)."""
        if not self.expandable_segments:
            return super().grow(nbytes)
        size = round_size(nbytes, self._divisions)
        small = size <= K_SMALL_SIZE
        seg = (
            None
            if self._frozen or nbytes > self._max_request_bytes
            else self._range(DEFAULT_POOL, small, 0)
        )
        unmapped = self._head(seg) if seg is not None else None
        page = self._page_bytes(small)
        while unmapped is not None and (unmapped.mapped or unmapped.size < size + page):
            unmapped = unmapped.next
        if (
            unmapped is not None and unmapped.prev is not None
        ):  # one page of address space apart: a segment of its own
            gap = _Block(
                unmapped.ptr,
                page,
                0,
                small,
                seg,
                DEFAULT_POOL,
                prev=unmapped.prev,
                next=unmapped,
                mapped=False,
            )
            unmapped.prev.next = gap
            unmapped.prev = gap
            unmapped.ptr += page
            unmapped.size -= page
        if unmapped is None or not self._map_block(
            unmapped, size
        ):  # fresh pages at the lowest room
            if seg is not None:
                self._drop_if_empty((DEFAULT_POOL, small, 0))
            self._frozen_refusal_at = -1  # a refused grow() is no allocation's failure
            return False
        return True

    def _add_segment(self, segment: Segment) -> None:
        """A segment from ``grow``: cached whole, in the pool its size belongs to."""
        small = segment.nbytes <= K_SMALL_BUFFER
        segment.handle = small
        self._insert(_Block(segment.offset, segment.nbytes, segment.stream, small, segment))

    def _segment_size_for(self, nbytes: int) -> int:
        return allocation_size(round_size(nbytes, self._divisions))

    # ------------------------------------------------------------------ seeding
    def seed_segment(
        self,
        nbytes: int,
        *,
        small: bool,
        stream: int = 0,
        blocks: Iterable[tuple[int, int, int]] = (),
        pool: Any = DEFAULT_POOL,
        range_offset_bytes: int = 0,
    ) -> list[Allocation]:
        """Rebuild a segment that existed before a trace began, with its live blocks in place.

        Reserves ``nbytes`` through the device (as ``cudaMalloc`` did) and lays out
        ``blocks``, each ``(offset_in_segment, block_bytes, requested_bytes)``: an allocated
        block of ``block_bytes`` (PyTorch's rounded size, an unsplit remainder included) handed
        out for a request of ``requested_bytes``. The ranges between them become free blocks.
        The returned allocations (in the order given) are live and counted like any other;
        free them with ``free``.

        Args:
            nbytes: the segment's size, a multiple of 512.
            small: True for a small-pool segment (requests <= 1 MiB), False for the large pool.
            stream: the stream the segment belongs to.
            blocks: the live blocks, in any order; they must not overlap.
            pool: the ``MempoolId`` of the pool it belongs to (a private one is taken as in use).
            range_offset_bytes: expandable segments: where in its (pool, small, stream) range the
                run of ``nbytes`` mapped bytes starts (whole pages; that stretch must be unmapped).

        Returns:
            One live ``Allocation`` per block.

        Raises:
            PolicyError: a bad size or block layout (nothing changes), or the segment does not
                fit within ``capacity_bytes`` or the device.
        """
        where = f"seed_segment(nbytes={nbytes!r})"
        if (
            isinstance(nbytes, bool)
            or not isinstance(nbytes, int)
            or nbytes <= 0
            or nbytes % K_MIN_BLOCK
        ):
            raise PolicyError(
                f"{where}: the segment size must be a positive multiple of {K_MIN_BLOCK}"
            )
        given = [tuple(b) for b in blocks]
        layout = sorted(given)
        end = 0
        for b in layout:
            if len(b) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) for x in b):
                raise PolicyError(
                    f"{where}: block {b!r} is not (offset_in_segment, block_bytes, requested_bytes)"
                )
            offset, block_bytes, requested = b
            if (
                offset < end
                or offset % K_MIN_BLOCK
                or block_bytes <= 0
                or block_bytes % K_MIN_BLOCK
            ):
                raise PolicyError(
                    f"{where}: block {b!r} overlaps the one before it or is not 512-aligned"
                )
            if not 0 < requested <= block_bytes:
                raise PolicyError(
                    f"{where}: block {b!r} must have 0 < requested_bytes <= block_bytes"
                )
            end = offset + block_bytes
        if end > nbytes:
            raise PolicyError(f"{where}: blocks reach offset {end}, past the segment's end")
        if pool != DEFAULT_POOL:
            self._use_count.setdefault(pool, 1)
        if self.expandable_segments:
            seg, base, prev, after = self._seed_mapped_run(
                where, nbytes, small, stream, pool, range_offset_bytes
            )
        else:
            seg = self._reserve_segment(nbytes, stream, retry=False)
            if seg is None:
                raise PolicyError(
                    f"{where}: the device or capacity_bytes(={self.capacity_bytes}) "
                    "refused the segment"
                )
            seg.handle = small
            self._count_pool_segment(pool, +1)
            base, prev, after = seg.offset, None, None
        made: dict[tuple, Allocation] = {}
        first_prev = prev
        cursor = base
        for offset, block_bytes, requested in layout:
            if base + offset > cursor:
                prev = self._link(
                    _Block(cursor, base + offset - cursor, stream, small, seg, pool), prev
                )
                self._insert(prev)
            prev = self._link(
                _Block(base + offset, block_bytes, stream, small, seg, pool, allocated=True), prev
            )
            cursor = prev.ptr + block_bytes
            made[(offset, block_bytes, requested)] = self._count_seeded(
                Allocation(requested, block_bytes, ((prev.ptr, block_bytes),), stream, None, prev)
            )
        if base + nbytes > cursor:
            prev = self._link(
                _Block(cursor, base + nbytes - cursor, stream, small, seg, pool), prev
            )
            self._insert(prev)
        if after is not None:
            self._link(after, prev)
        if self.expandable_segments and first_prev is None:  # the run starts the range: a new head
            head = prev
            while head.prev is not None:
                head = head.prev
            self._heads[seg.offset] = head
        return [made[b] for b in given]

    def _seed_mapped_run(
        self, where: str, nbytes: int, small: bool, stream: int, pool: Any, range_offset_bytes: int
    ):
        """Map ``nbytes`` at ``range_offset_bytes`` into the range; returns ``(range segment,
        run start, block before the run, block after it)`` with the run's own block unlinked."""
        page = self._page_bytes(small)
        if range_offset_bytes % page or nbytes % page:
            raise PolicyError(
                f"{where}: an expandable run must start and end on {page // MiB} MiB pages"
            )
        seg = self._range(pool, small, stream)
        start = seg.offset + range_offset_bytes
        u = self._head(seg)
        while u is not None and not (
            not u.mapped and u.ptr <= start and start + nbytes <= u.ptr + u.size
        ):
            u = u.next
        if u is None:
            raise PolicyError(
                f"{where}: [{range_offset_bytes}, +{nbytes}) of the range is mapped already"
            )
        if u.ptr < start:  # the unmapped stretch before the run stays a block of its own
            before = _Block(
                u.ptr, start - u.ptr, stream, small, seg, pool, prev=u.prev, next=u, mapped=False
            )
            if u.prev is not None:
                u.prev.next = before
            u.prev = before
            u.size -= start - u.ptr
            u.ptr = start
        if not self._map_block(u, nbytes):
            raise PolicyError(
                f"{where}: the device or capacity_bytes(={self.capacity_bytes}) refused the pages"
            )
        run = self._last_merged
        self._remove(run)
        return seg, run.ptr, run.prev, run.next

    @staticmethod
    def _link(b: _Block, prev: _Block | None) -> _Block:
        b.prev = prev
        if prev is not None:
            prev.next = b
        return b

    def _count_seeded(self, a: Allocation) -> Allocation:
        """Count a seeded block as handed out, as ``allocate`` counts its allocations."""
        a.handle.segment.num_live += 1
        self.allocated_bytes += a.size_bytes
        return self._hand_out(a)

    # ------------------------------------------------------------------ inspection
    def free_extents(self) -> list[tuple[int, int]]:
        return sorted((b.ptr, b.size) for b in self._free_at.values())

    def largest_free_bytes(self) -> int:
        return max((keys[-1] >> _KEY_BITS for keys in self._keys.values() if keys), default=0)

    def round_size(self, nbytes: int) -> int:
        """The block size this allocator sets aside for a request of ``nbytes``."""
        return round_size(nbytes, self._divisions)

    def empty_cache(self) -> int:
        """``torch.cuda.empty_cache()``: release every unsplit cached segment; returns the bytes."""
        return self._release_free_segments(None)

    def allocator_info(self) -> dict[str, Any]:
        """PyTorch's own counters that the base stats lack."""
        return {
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
            "num_cached_blocks": len(self._free_at),
        }


# ---------------------------------------------------------------------------- PyTorch's settings
def params_from_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``TorchCaching`` keyword arguments for a snapshot's ``allocator_settings``.

    Reads ``max_split_size`` (bytes; PyTorch reports ``SIZE_MAX`` for none),
    ``roundup_power2_divisions`` (one value per interval, keyed by interval start),
    ``garbage_collection_threshold``, ``expandable_segments``, and ``max_non_split_rounding_mb``
    from ``PYTORCH_CUDA_ALLOC_CONF``. Settings at PyTorch's default are left out.
    """
    params: dict[str, Any] = {}
    max_split = settings.get("max_split_size", -1)
    if isinstance(max_split, int) and 0 < max_split < 1 << 62:
        params["max_split_size_bytes"] = max_split
    conf = str(settings.get("PYTORCH_CUDA_ALLOC_CONF") or "")
    rounding_mb = parse_items(conf, bad_item=None, valid_key=bool, assign=":").get(
        "max_non_split_rounding_mb", ""
    )
    if rounding_mb.isdigit():
        params["max_non_split_rounding_bytes"] = int(rounding_mb) * MiB
    divisions = settings.get("roundup_power2_divisions")
    if isinstance(divisions, dict) and divisions:
        values = [int(v) for _, v in sorted(divisions.items(), key=lambda kv: int(kv[0]))]
        if len(set(values)) == 1:
            if values[0] > 1:
                params["roundup_power2_divisions"] = values[0]
        else:
            params["roundup_power2_divisions"] = ",".join(
                f"{1 << k}:{v}" for k, v in enumerate(values)
            )
    elif isinstance(divisions, int) and divisions > 1:
        params["roundup_power2_divisions"] = divisions
    gc = settings.get("garbage_collection_threshold") or 0.0
    if gc:
        params["garbage_collection_threshold"] = float(gc)
    if settings.get("expandable_segments"):
        params["expandable_segments"] = True
    return params


def spec_from_settings(settings: dict[str, Any]) -> str:
    """The ``torch-caching`` spec matching a snapshot's ``allocator_settings``
    (``params_from_settings``)."""
    return format_spec(TorchCaching.name, params_from_settings(settings))
