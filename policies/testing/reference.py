"""``SegmentPerRequest``: the plainest policy that honours the whole contract."""

from __future__ import annotations

from policies.base import Allocation, Policy, Segment, check_positive_int, round_up
from policies.device import Device


class SegmentPerRequest(Policy):
    """Every request gets a segment of its own; freed segments are cached and reused whole.

    A request takes the smallest cached segment of its stream that fits (never split) or a new
    segment of ``round_up(nbytes, rounding_bytes)``. ``trim(max_bytes)`` gives cached segments
    back, largest first, never more than ``max_bytes`` in total (the built-ins read it as a
    target and may release one segment more: the contract allows both). The cache is a plain
    list: this policy exists to test checks and wrappers, not to be fast.
    """

    name = "segment-per-request"

    def __init__(
        self,
        *,
        rounding_bytes: int = 512,
        capacity_bytes: int | None = None,
        device: Device | None = None,
    ):
        check_positive_int("rounding_bytes", rounding_bytes)
        self.rounding_bytes = rounding_bytes
        super().__init__(capacity_bytes=capacity_bytes, device=device)

    def _reset_state(self) -> None:
        self._cached: list[Segment] = []

    def _segment_size_for(self, nbytes: int) -> int:
        return round_up(nbytes, self.rounding_bytes)

    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        size = self._segment_size_for(nbytes)
        fits = [s for s in self._cached if s.nbytes >= size and s.stream == stream]
        if fits:
            seg = min(fits, key=lambda s: (s.nbytes, s.offset))
            self._cached.remove(seg)
        else:
            seg = self._reserve_segment(size, stream)
            if seg is None:
                return None
        seg.num_live = 1
        self.allocated_bytes += seg.nbytes
        return Allocation(nbytes, seg.nbytes, ((seg.offset, seg.nbytes),), stream, tag, seg)

    def _free(self, allocation: Allocation) -> None:
        seg = allocation.handle
        seg.num_live = 0
        self.allocated_bytes -= seg.nbytes
        self._cached.append(seg)

    def _add_segment(self, segment: Segment) -> None:
        self._cached.append(segment)

    def _release_free_segments(self, max_bytes: int | None) -> int:
        released = 0
        for seg in sorted(self._cached, key=lambda s: s.nbytes, reverse=True):
            if max_bytes is not None and released + seg.nbytes > max_bytes:
                continue
            self._cached.remove(seg)
            self._release_segment(seg)
            released += seg.nbytes
        return released

    def free_extents(self) -> list[tuple[int, int]]:
        return sorted((s.offset, s.nbytes) for s in self._cached)
