"""``arena``: bump allocation in arenas that are reset when everything in them is freed.

Each stream allocates from its *current* arena by moving a pointer: no search, no free list,
no split. When a request does not fit in what is left of the current arena, that arena is
retired and a new current one is taken (a cached empty arena if one is large enough, else a
new segment of ``arena_bytes``, or of the request when it is larger). A retired arena keeps its
memory until its last allocation is freed, then goes back to the cache whole; the current
arena is rewound to its start when its last allocation is freed. Freed space inside an arena
that still holds live data is not reused: the price of O(1) allocation, and why arenas suit
data that dies together (one forward pass's activations, one step's scratch).
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Allocation, Policy, Segment, check_positive_int, round_up
from policies.device import SEGMENT_ALIGNMENT_BYTES, Device
from policies.errors import PolicyError

__all__ = ["Arena"]

_DEFAULT_ARENA_BYTES = 64 << 20


@dataclass(slots=True, eq=False)
class _ArenaState:
    """The bump pointer of one arena (its segment's ``handle``)."""

    segment: Segment
    top: int = 0  # bytes handed out from the start, live or dead
    current: bool = False


class Arena(Policy):
    """Bump allocation per stream; an arena is reused once everything in it is freed.

    Args:
        arena_bytes: size of a new arena (larger requests get an arena of their own size,
            rounded up to 2 MiB).
        alignment_bytes: every request is rounded up to a multiple of this (a power of two).
        capacity_bytes, device: see ``Policy``.

    ``free_extents()`` lists only what can still be handed out (the tail of each current arena
    and every cached arena); space freed inside a retired arena counts as free bytes but not as
    a free extent, so external fragmentation shows it.
    """

    name = "arena"
    contiguous = True

    def __init__(
        self,
        *,
        arena_bytes: int = _DEFAULT_ARENA_BYTES,
        alignment_bytes: int = 512,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        check_positive_int("arena_bytes", arena_bytes)
        check_positive_int("alignment_bytes", alignment_bytes)
        if alignment_bytes & (alignment_bytes - 1):
            raise PolicyError(f"alignment_bytes(={alignment_bytes}) must be a power of two")
        if arena_bytes % alignment_bytes:
            raise PolicyError(
                f"arena_bytes(={arena_bytes}) "
                f"must be a multiple of alignment_bytes(={alignment_bytes})"
            )
        self.arena_bytes = arena_bytes
        self.alignment_bytes = alignment_bytes
        super().__init__(capacity_bytes=capacity_bytes, device=device)

    def _reset_state(self) -> None:
        self._current: dict[int, _ArenaState] = {}  # stream -> its current arena
        self._cached: dict[int, list[_ArenaState]] = {}  # stream -> empty arenas, oldest first
        self.num_resets = 0  # arenas rewound or cached because their last allocation was freed

    def _segment_size_for(self, nbytes: int) -> int:
        if nbytes <= self.arena_bytes:
            return self.arena_bytes
        return round_up(nbytes, max(SEGMENT_ALIGNMENT_BYTES, self.alignment_bytes))

    # ------------------------------------------------------------------ Policy hooks
    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        size = round_up(nbytes, self.alignment_bytes)
        arena = self._current.get(stream)
        if arena is None or arena.segment.nbytes - arena.top < size:
            fresh = self._take_arena(size, stream)
            if fresh is None:
                return None
            # read it again: a reservation's trim-and-retry may have released an empty current arena
            arena = self._current.get(stream)
            if arena is not None:
                self._retire(arena)
            fresh.current = True
            self._current[stream] = arena = fresh
        offset = arena.segment.offset + arena.top
        arena.top += size
        arena.segment.num_live += 1
        self.allocated_bytes += size
        return Allocation(nbytes, size, ((offset, size),), stream, tag, arena)

    def _take_arena(self, size: int, stream: int) -> _ArenaState | None:
        """An empty arena of at least ``size`` bytes: a cached one (the first that fits) or a new
        one."""
        cached = self._cached.get(stream, [])
        for i, arena in enumerate(cached):
            if arena.segment.nbytes >= size:
                return cached.pop(i)
        seg = self._reserve_segment(self._segment_size_for(size), stream)
        if seg is None:
            return None
        seg.handle = _ArenaState(seg)
        return seg.handle

    def _retire(self, arena: _ArenaState) -> None:
        arena.current = False
        if arena.segment.num_live == 0:
            self._cache(arena)

    def _cache(self, arena: _ArenaState) -> None:
        arena.top = 0
        self._cached.setdefault(arena.segment.stream, []).append(arena)

    def _free(self, allocation: Allocation) -> None:
        arena: _ArenaState = allocation.handle
        seg = arena.segment
        seg.num_live -= 1
        self.allocated_bytes -= allocation.size_bytes
        if seg.num_live == 0:
            self.num_resets += 1
            if arena.current:
                arena.top = 0  # rewind in place
            else:
                self._cache(arena)

    def _add_segment(self, segment: Segment) -> None:
        segment.handle = _ArenaState(segment)
        self._cache(segment.handle)

    def _release_free_segments(self, max_bytes: int | None) -> int:
        """Release empty arenas (cached ones, then empty current ones), oldest first."""
        released = 0
        for seg in [s for s in self._segments.values() if s.num_live == 0]:
            if max_bytes is not None and released >= max_bytes:
                break
            arena: _ArenaState = seg.handle
            if arena.current:
                del self._current[seg.stream]
            else:
                self._cached[seg.stream].remove(arena)
            self._release_segment(seg)
            released += seg.nbytes
        return released

    # ------------------------------------------------------------------ inspection
    def free_extents(self) -> list[tuple[int, int]]:
        out = [
            (a.segment.offset + a.top, a.segment.nbytes - a.top)
            for a in self._current.values()
            if a.top < a.segment.nbytes
        ]
        out += [
            (a.segment.offset, a.segment.nbytes) for arenas in self._cached.values() for a in arenas
        ]
        return sorted(out)

    def largest_free_bytes(self) -> int:
        return max((n for _, n in self.free_extents()), default=0)
