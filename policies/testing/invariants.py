"""``check_invariants``: a pool's state recounted by brute force and compared with what it
reports."""

from __future__ import annotations

import bisect
import operator
from itertools import chain, repeat
from typing import Iterable

from policies.base import Allocation, Policy, PoolStats, Segment, gauges_mismatch
from policies.testing._common import fail as _fail


def _shared_ranges(policy: Policy) -> list[tuple[int, int]]:
    """The policy's shared ``[start, end)`` ranges, merged: sorted and disjoint."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((o, o + n) for o, n in policy.shared_extents()):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _covered(start: int, end: int, ranges: list[tuple[int, int]]) -> bool:
    """Is ``[start, end)`` inside one of the merged ``ranges``?"""
    i = bisect.bisect_right(ranges, (start, float("inf"))) - 1
    return i >= 0 and ranges[i][0] <= start and end <= ranges[i][1]


class _Where:
    """Formats as the policy's repr, built only when a message is (a repr builds a spec)."""

    __slots__ = ("policy",)

    def __init__(self, policy: Policy):
        self.policy = policy

    def __format__(self, spec: str) -> str:
        return repr(self.policy)


def check_invariants(
    policy: Policy, live_allocations: Iterable[Allocation], *, free_extents: bool = True
) -> PoolStats:
    """Recount ``policy``'s state by brute force and compare it with what the policy reports.

    Args:
        policy: the pool.
        live_allocations: every allocation it handed out that is still live (all of them:
            counts are compared).
        free_extents: also walk ``policy.free_extents()`` (O(free ranges): order, placement,
            no overlap with live bytes, coalescing). A long soak of a pool that lists about
            10^4 free blocks and checks its own accounting cheaply turns it off between
            periodic full recounts (``policies.testing.soak``).

    Returns:
        The policy's stats, checked.

    Raises:
        AssertionError: naming the first invariant that does not hold.
    """
    live = list(live_allocations)
    stats = policy.stats()
    where = _Where(policy)

    # the levels a monitor samples (``gauges``) are the snapshot's, for a policy that overrides
    # either
    mismatch = gauges_mismatch(policy, stats)
    if mismatch:
        _fail(f"{where}: {mismatch}")

    # segments: address order, disjoint, summed by the counters
    segs = policy.segments()
    for a, b in zip(segs, segs[1:]):
        if a.end > b.offset:
            _fail(
                f"{where}: segments [{a.offset}, {a.end}) and [{b.offset}, {b.end}) overlap "
                "or are out of address order"
            )
    if any(s.nbytes <= 0 for s in segs):
        _fail(f"{where}: a segment has no bytes")
    reserved = sum(s.nbytes for s in segs)
    if stats.reserved_bytes != reserved:
        _fail(f"{where}: reserved_bytes={stats.reserved_bytes} but segments add up to {reserved}")
    if stats.num_segments != len(segs):
        _fail(f"{where}: num_segments={stats.num_segments} but segments() lists {len(segs)}")
    if stats.grown_bytes - stats.shrunk_bytes != reserved:
        _fail(
            f"{where}: grown_bytes - shrunk_bytes = {stats.grown_bytes - stats.shrunk_bytes} != "
            f"reserved {reserved}"
        )
    if stats.num_grows - stats.num_shrinks != len(segs):
        _fail(
            f"{where}: num_grows - num_shrinks = {stats.num_grows - stats.num_shrinks} "
            f"!= {len(segs)} segments"
        )
    for cap in {stats.capacity_bytes, policy.capacity_bytes} - {None}:
        if reserved > cap:
            _fail(f"{where}: reserved {reserved} B exceeds capacity_bytes={cap}")

    # live allocations: well formed
    if len({id(a) for a in live}) != len(live):
        _fail(f"{where}: the same allocation is listed twice as live")
    extents: list[tuple[int, int]] = []
    for a in live:
        if not isinstance(a, Allocation):
            _fail(f"{where}: allocate() returned {type(a).__name__}, not an Allocation")
        if not a.live:
            _fail(
                f"{where}: allocation of {a.nbytes} B at {a.extents} is listed live but was freed"
            )
        if a.size_bytes < a.nbytes:
            _fail(f"{where}: size_bytes={a.size_bytes} < nbytes={a.nbytes}")
        if not a.extents or any(n <= 0 for _, n in a.extents):
            _fail(f"{where}: allocation of {a.nbytes} B has empty extents {a.extents}")
        if sum(n for _, n in a.extents) != a.size_bytes:
            _fail(f"{where}: extents {a.extents} do not add up to size_bytes={a.size_bytes}")
        if policy.contiguous and len(a.extents) != 1:
            _fail(f"{where}: contiguous policy handed out {len(a.extents)} extents")
        extents.extend((off, off + n) for off, n in a.extents)

    # ... inside segments, disjoint except shared pages
    extents.sort()
    seg_has_live, union, union_bytes = _place_live_extents(
        extents, segs, _shared_ranges(policy), where
    )
    for seg, has_live in zip(segs, seg_has_live):
        if has_live != (seg.num_live > 0):
            _fail(
                f"{where}: segment at {seg.offset} has num_live={seg.num_live} "
                f"but {'holds' if has_live else 'holds no'} live allocations"
            )

    # the counters against the recount
    live_bytes = sum(a.nbytes for a in live)
    if stats.live_bytes != live_bytes:
        _fail(f"{where}: live_bytes={stats.live_bytes} but live allocations ask for {live_bytes}")
    if stats.num_live != len(live):
        _fail(f"{where}: num_live={stats.num_live} but {len(live)} allocations are live")
    if stats.allocated_bytes != union_bytes:
        _fail(
            f"{where}: allocated_bytes={stats.allocated_bytes} "
            f"but live extents cover {union_bytes} B"
        )
    if stats.free_bytes != stats.reserved_bytes - stats.allocated_bytes:
        _fail(f"{where}: free_bytes={stats.free_bytes} != reserved - allocated")
    if not 0 <= stats.largest_free_bytes <= stats.free_bytes:
        _fail(
            f"{where}: largest_free_bytes={stats.largest_free_bytes} outside [0, "
            f"free_bytes={stats.free_bytes}]"
        )
    if stats.num_allocs - stats.num_frees != stats.num_live:
        _fail(
            f"{where}: num_allocs - num_frees = {stats.num_allocs - stats.num_frees} != "
            f"num_live={stats.num_live}"
        )
    for peak, now in (
        ("peak_live_bytes", "live_bytes"),
        ("peak_allocated_bytes", "allocated_bytes"),
        ("peak_reserved_bytes", "reserved_bytes"),
    ):
        if getattr(stats, peak) < getattr(stats, now):
            _fail(f"{where}: {peak}={getattr(stats, peak)} < {now}={getattr(stats, now)}")
    for field in ("num_failures", "num_grows", "num_shrinks", "grown_bytes", "shrunk_bytes"):
        if getattr(stats, field) < 0:
            _fail(f"{where}: {field} is negative")

    if free_extents:
        _check_free_extents(policy, stats, segs, union, where)
    return stats


def _segment_numbers(starts: list[int], ends: list[int], segs: list[Segment]) -> list[int] | None:
    """For sorted ranges, 1 + the index of the segment holding each; None if one lies outside.

    C-level ``map``s over the ranges: the checks run after every step of a workload and a
    size-class pool can list ten thousand free blocks.
    """
    seg_starts = [s.offset for s in segs]
    seg_ends = [0] + [s.end for s in segs]  # seg_ends[k]: end of the segment numbered k
    numbers = list(map(bisect.bisect_right, repeat(seg_starts), starts))
    if numbers and min(numbers) == 0:
        return None
    if not all(map(operator.le, ends, map(seg_ends.__getitem__, numbers))):
        return None
    return numbers


def _place_live_extents(
    extents: list[tuple[int, int]],
    segs: list[Segment],
    shared: list[tuple[int, int]],
    where: _Where,
) -> tuple[list[bool], list[tuple[int, int]], int]:
    """Check sorted live ``[start, end)`` extents lie in segments and overlap only where shared.

    Returns which segments hold live bytes, the union of the extents (sorted, disjoint) and its
    size.
    """
    starts = [x for x, _ in extents]
    ends = [x for _, x in extents]
    numbers = _segment_numbers(starts, ends, segs)
    if numbers is not None and all(map(operator.le, ends[:-1], starts[1:])):
        held = set(numbers)
        return [i + 1 in held for i in range(len(segs))], extents, sum(ends) - sum(starts)
    # an overlap or a stray extent: walk in address order to allow shared pages or say where
    num_segs, si = len(segs), 0
    seg_has_live = [False] * num_segs
    union: list[tuple[int, int]] = []
    union_bytes, run_end = 0, -1
    for start, end in extents:
        while si < num_segs and segs[si].end <= start:
            si += 1
        if si == num_segs or segs[si].offset > start or end > segs[si].end:
            _fail(f"{where}: extent [{start}, {end}) lies outside every reserved segment")
        seg_has_live[si] = True
        if start < run_end:
            if not _covered(start, min(end, run_end), shared):
                _fail(f"{where}: live allocations overlap at [{start}, {min(end, run_end)})")
            if end > run_end:
                union[-1] = (union[-1][0], end)
                union_bytes += end - run_end
                run_end = end
            continue
        union.append((start, end))
        union_bytes += end - start
        run_end = end
    return seg_has_live, union, union_bytes


def _overlaps_any(rng: tuple[int, int], starts: list[int], ends: list[int]) -> bool:
    """Does ``[start, end)`` overlap one of the sorted, disjoint ranges ``starts``/``ends``?"""
    j = bisect.bisect_right(ends, rng[0])
    return j < len(starts) and starts[j] < rng[1]


def _check_free_extents(
    policy: Policy,
    stats: PoolStats,
    segs: list[Segment],
    union: list[tuple[int, int]],
    where: _Where,
) -> None:
    """Free extents: in address order, inside segments, clear of live bytes, merged if promised."""
    try:
        free = policy.free_extents()
    except NotImplementedError:
        return
    flat = list(chain.from_iterable(free))
    starts, lengths = flat[0::2], flat[1::2]
    ends = list(map(operator.add, starts, lengths))
    if (
        (not lengths or min(lengths) > 0)
        and all(map(operator.le, ends[:-1], starts[1:]))
        and not (policy.coalesces and any(map(operator.eq, ends[:-1], starts[1:])))
        and _segment_numbers(starts, ends, segs) is not None
        and not any(_overlaps_any(u, starts, ends) for u in union)
    ):
        total = sum(lengths)
        if total > stats.free_bytes:
            _fail(
                f"{where}: free extents add up to {total} B, "
                f"more than free_bytes={stats.free_bytes}"
            )
        return
    # something is wrong (or free extents touch across segments): walk them to say what
    num_segs, num_union = len(segs), len(union)
    si = ui = total = 0
    prev_end, prev_si = -1, -1
    for off, n in free:
        end = off + n
        if n <= 0:
            _fail(f"{where}: free extent ({off}, {n}) is empty")
        if off < prev_end:
            _fail(f"{where}: free extents overlap or are out of address order at {off}")
        while si < num_segs and segs[si].end <= off:
            si += 1
        if si == num_segs or segs[si].offset > off or end > segs[si].end:
            _fail(f"{where}: free extent [{off}, {end}) lies outside every reserved segment")
        if off == prev_end and si == prev_si and policy.coalesces:
            _fail(f"{where}: free extents touch at {off} although the policy coalesces")
        while ui < num_union and union[ui][1] <= off:
            ui += 1
        if ui < num_union and union[ui][0] < end:
            _fail(f"{where}: free extent [{off}, {end}) overlaps live bytes {union[ui]}")
        total += n
        prev_end, prev_si = end, si
    if total > stats.free_bytes:
        _fail(f"{where}: free extents add up to {total} B, more than free_bytes={stats.free_bytes}")
