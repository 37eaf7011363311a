"""How far from the best possible: a lower bound and an offline planner for an allocation trace.

- **Lower bound**: the peak of live bytes (bytes asked for, summed over live allocations). No pool
  can reserve less, whatever it knows.
- **Offline planner**: knows every lifetime in advance and gives each allocation an offset in one
  address range so that no two allocations live at the same time overlap, as the static memory
  planners of ML compilers do for a graph's tensors (TFLite's and XLA's "greedy by size",
  Pisarchyk and Lee, "Efficient Memory Management for Deep Neural Net Inference", 2020). Its
  peak (the highest end offset) is achievable, so it is a reference a pool can be compared with.

Greedy by size: allocations that overlap every other one in time (weights loaded before
everything and kept) are stacked at the bottom; the rest are placed largest first, each in the
smallest gap left by the allocations already placed that overlap it in time (lowest offset on
ties), or on top of them. Finding those allocations is what costs: a segment tree over time
(events) stores, at each node, the merged address ranges of the placed allocations whose
lifetime covers the node, so the ones live when an allocation starts are read on one
root-to-leaf path; those that start during its lifetime come from buckets by start event
that also keep merged ranges, with 16-fold coarser levels above (``_BornIndex``). Sizes are rounded
up to ``alignment_bytes`` (512 B by default, the rounding every built-in policy does) and time is
the event index; streams are ignored. On the 215k-event snapshot it takes about 2.5 s. With
thousands of allocations live at once (a KV cache in small chunks) its cost grows with them, so
``planner="auto"`` (the default) then uses best fit in time order over one perfectly coalescing
range instead: no lookahead, O(n log n), a slightly weaker but still achievable reference. The
result names the planner that ran.

``bounds(trace)`` returns both numbers. The summary formulas of a policy's row are
``gap_to_bound = peak_reserved_bytes / lower_bound_bytes - 1`` and
``gap_to_planner = peak_reserved_bytes / planner_peak_bytes - 1`` (negative when a pool
reserved less than the planner, which happens when it refused requests or when the greedy plan
is not optimal).
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right, insort
from typing import Any, Iterator

import numpy as np

from policies.units import round_up
from traces.events import AllocTrace
from traces.knobs import check_int

__all__ = [
    "bounds",
    "lifetimes",
    "lower_bound_bytes",
    "plan_greedy_by_size",
    "plan_best_fit_in_order",
    "check_plan",
    "greedy_work",
    "PLANNERS",
    "GREEDY_WORK_LIMIT",
]

_BORN_BUCKET_EVENTS = 64  # placed allocations are bucketed by start event in runs of this many
#: ``planner="auto"`` runs greedy by size when the allocations live at each one's start, summed,
#: stay below this (about 10 s of pure Python on a 2-core machine); else best fit in order.
GREEDY_WORK_LIMIT = 20_000_000


def lifetimes(trace: AllocTrace) -> tuple[list[int], list[int], list[int]]:
    """``(starts, ends, nbytes)`` per allocation id: the event of its alloc and of its free.

    An allocation never freed ends at ``len(trace)``.
    """
    _, is_alloc, ids, nbytes, _ = trace.arrays()
    n = len(is_alloc)
    num_ids = int(ids[is_alloc].max()) + 1 if is_alloc.any() else 0
    starts = np.full(num_ids, -1, np.int64)
    ends = np.full(num_ids, n, np.int64)
    sizes = np.zeros(num_ids, np.int64)
    events = np.arange(n)
    starts[ids[is_alloc]] = events[is_alloc]
    ends[ids[~is_alloc]] = events[~is_alloc]
    sizes[ids[is_alloc]] = nbytes[is_alloc]
    keep = starts >= 0  # ids that were never allocated (gaps in numbering) are dropped
    return starts[keep].tolist(), ends[keep].tolist(), sizes[keep].tolist()


def lower_bound_bytes(trace: AllocTrace) -> int:
    """Peak live bytes: the most bytes asked for and not yet freed at any moment."""
    _, is_alloc, _, nbytes, _ = trace.arrays()
    if not len(nbytes):
        return 0
    return int(np.cumsum(np.where(is_alloc, nbytes, -nbytes)).max(initial=0))


def _add_range(ranges: list[int], lo: int, hi: int) -> None:
    """Merge ``[lo, hi)`` into ``ranges``, a flat sorted list ``[lo0, hi0, lo1, hi1, ...]`` of
    disjoint ranges."""
    i = bisect_right(ranges, lo)
    j = bisect_left(ranges, hi)
    if i & 1:  # lo falls inside (or at the end of) a range: start there
        i -= 1
        lo = ranges[i]
    if j & 1:  # hi falls inside a range: end there
        hi = ranges[j]
        j += 1
    ranges[i:j] = [lo, hi]


class _BornIndex:
    """Placed allocations by start event, for "which placed ones start while this one lives?".

    Level 0 keeps, per bucket of ``_BORN_BUCKET_EVENTS`` events, the allocations themselves
    (checked one by one in the partial buckets at the ends of a query) and the merged address
    ranges they cover; each higher level merges 16 buckets of the level below. Every
    allocation starting inside a query's lifetime overlaps it, so whole buckets contribute
    their merged ranges: a query reads at most 30 range lists per level instead of every
    allocation (short-lived activations reuse the same addresses, so the lists stay short).
    """

    FANOUT = 16

    def __init__(self, horizon: int):
        self.widths = [_BORN_BUCKET_EVENTS]
        while self.widths[-1] < horizon:
            self.widths.append(self.widths[-1] * self.FANOUT)
        self.items: list[list[int]] = [[] for _ in range(horizon // _BORN_BUCKET_EVENTS + 1)]
        self.merged: list[list[list[int] | None]] = [
            [None] * (horizon // w + 1) for w in self.widths
        ]

    def add(self, i: int, start: int, lo: int, hi: int) -> None:
        self.items[start // _BORN_BUCKET_EVENTS].append(i)
        for level, width in zip(self.merged, self.widths):
            _file(level, start // width, lo, hi)

    def collect(
        self,
        lo: int,
        hi: int,
        starts: list[int],
        offsets: list[int],
        sizes: list[int],
        out: list[tuple[int, int]],
    ) -> None:
        """Append the address ranges of placed allocations starting in ``[lo, hi]`` to ``out``."""
        if lo > hi:
            return
        w0 = _BORN_BUCKET_EVENTS
        first, last = lo // w0, hi // w0 + 1  # half-open range of level-0 buckets
        for b in {first, last - 1}:  # partial buckets at the ends: one by one
            if (b == first and lo % w0) or (b == last - 1 and (hi + 1) % w0):
                out.extend(
                    (offsets[j], offsets[j] + sizes[j])
                    for j in self.items[b]
                    if lo <= starts[j] <= hi
                )
        if lo % w0:
            first += 1
        if (hi + 1) % w0 and last > first:
            last -= 1
        top = len(self.widths) - 1
        for k, level in enumerate(self.merged):
            if first >= last:
                return
            if k == top:
                whole = range(first, last)
            else:
                left = min(last, round_up(first, self.FANOUT))
                right = max(left, last // self.FANOUT * self.FANOUT)
                whole = [*range(first, left), *range(right, last)]
                first, last = left // self.FANOUT, right // self.FANOUT
            for b in whole:
                ranges = level[b]
                if ranges:
                    out.extend(zip(ranges[0::2], ranges[1::2]))


def plan_greedy_by_size(
    starts: list[int], ends: list[int], sizes: list[int]
) -> tuple[int, list[int]]:
    """Offsets for every allocation by greedy-by-size best-fit placement.

    Args:
        starts, ends: each allocation's lifetime ``[start, end)`` in events.
        sizes: its size in bytes (already rounded as wanted).

    Returns:
        ``(peak_bytes, offsets)``: the highest end offset and each allocation's offset.
    """
    n = len(sizes)
    offsets = [0] * n
    if n == 0:
        return 0, offsets
    min_end, max_start = min(ends), max(starts)
    everlasting = sorted(
        (i for i in range(n) if starts[i] < min_end and ends[i] > max_start),
        key=lambda i: (-sizes[i], starts[i]),
    )
    base = 0
    for i in everlasting:  # they overlap everything: a band of their own at the bottom
        offsets[i] = base
        base += sizes[i]
    skip = set(everlasting)
    order = sorted((i for i in range(n) if i not in skip), key=lambda i: (-sizes[i], starts[i]))
    horizon = max(ends) + 1
    width = 1
    while width < horizon:
        width <<= 1
    tree: list[list[int] | None] = [None] * (2 * width)  # node -> merged address ranges
    born = _BornIndex(horizon)
    peak = base
    for i in order:
        s, e, size = starts[i], ends[i], sizes[i]
        taken: list[tuple[int, int]] = []
        node = s + width  # placed allocations live at event s
        while node:
            ranges = tree[node]
            if ranges:
                taken.extend(zip(ranges[0::2], ranges[1::2]))
            node >>= 1
        born.collect(
            s + 1, e - 1, starts, offsets, sizes, taken
        )  # and those starting while it lives
        taken.sort()
        best, best_gap, top = -1, 0, 0
        for lo, hi in taken:
            gap = lo - top
            if gap >= size and (best < 0 or gap < best_gap):
                best, best_gap = top, gap
            if hi > top:
                top = hi
        offset = best if best >= 0 else top
        offsets[i] = offset
        end = offset + size
        peak = max(peak, base + end)
        born.add(i, s, offset, end)
        lo, hi = s + width, e + width  # file [offset, end) at the nodes that cover [s, e)
        while lo < hi:
            if lo & 1:
                _file(tree, lo, offset, end)
                lo += 1
            if hi & 1:
                hi -= 1
                _file(tree, hi, offset, end)
            lo >>= 1
            hi >>= 1
    for i in order:
        offsets[i] += base
    return peak, offsets


def _file(table: list, key: int, lo: int, hi: int) -> None:
    ranges = table[key]
    if ranges is None:
        table[key] = [lo, hi]
    else:
        _add_range(ranges, lo, hi)


def plan_best_fit_in_order(
    starts: list[int], ends: list[int], sizes: list[int]
) -> tuple[int, list[int]]:
    """Offsets by best fit in time order over one perfectly coalescing range (no lookahead).

    What an ideal online allocator without rounding, segments or streams would reach; a cheap
    second reference. Returns ``(peak_bytes, offsets)`` like ``plan_greedy_by_size``.
    """
    n = len(sizes)
    offsets = [0] * n
    gaps: list[tuple[int, int]] = []  # (size, offset), sorted
    gap_at: dict[int, int] = {}  # offset -> size
    gap_ending: dict[int, int] = {}  # end -> offset
    top = peak = 0

    def drop(offset: int) -> None:
        size = gap_at.pop(offset)
        del gap_ending[offset + size]
        del gaps[bisect_left(gaps, (size, offset))]

    def add(offset: int, size: int) -> None:
        gap_at[offset] = size
        gap_ending[offset + size] = offset
        insort(gaps, (size, offset))

    for is_start, i in _time_order(starts, ends):
        size = sizes[i]
        if is_start:
            k = bisect_left(gaps, (size, -1))
            if k < len(gaps):
                gap, offset = gaps[k]
                drop(offset)
                if gap > size:
                    add(offset + size, gap - size)
            elif top in gap_ending:  # extend the free range at the top
                offset = gap_ending[top]
                drop(offset)
                top = offset + size
            else:
                offset, top = top, top + size
            offsets[i] = offset
            peak = max(peak, top)
        else:
            offset = offsets[i]
            if offset in gap_ending:
                left = gap_ending[offset]
                size += gap_at[left]
                drop(left)
                offset = left
            if offset + size in gap_at:
                right = offset + size
                size += gap_at[right]
                drop(right)
            if offset + size == top:
                top = offset
            else:
                add(offset, size)
    return peak, offsets


def _time_order(starts: list[int], ends: list[int]) -> Iterator[tuple[bool, int]]:
    """``(is_start, i)`` of every allocation's start and end in the order of
    ``sorted((time, is_start, i))``: by time, an end before a start at the same time, then by
    index. Sorted by NumPy and handed out a piece at a time, not as a list of a tuple an event
    (about 100 MB for a million events, held by the worker that computes the bounds)."""
    n = len(starts)
    times = np.concatenate([np.asarray(ends, np.int64), np.asarray(starts, np.int64)])
    index = np.arange(2 * n, dtype=np.int64)  # ends are 0..n-1, starts n..2n-1
    order = np.lexsort((index % n if n else index, index >= n, times))
    del times, index
    for lo in range(0, 2 * n, _ORDER_PIECE):
        for k in order[lo : lo + _ORDER_PIECE].tolist():
            yield (True, k - n) if k >= n else (False, k)


_ORDER_PIECE = 65_536

#: planner name -> function ``(starts, ends, sizes) -> (peak_bytes, offsets)``
PLANNERS = {"greedy-by-size": plan_greedy_by_size, "best-fit-in-order": plan_best_fit_in_order}


def check_plan(starts: list[int], ends: list[int], sizes: list[int], offsets: list[int]) -> int:
    """Assert no two allocations live at the same time overlap in address; returns the plan's peak.

    A sweep over events with the live allocations in address order: O(n log n).
    """
    from sortedcontainers import SortedList

    events = sorted(
        [(e, 0, i) for i, e in enumerate(ends)] + [(s, 1, i) for i, s in enumerate(starts)]
    )
    live = SortedList()
    peak = 0
    for _, is_start, i in events:
        lo, hi = offsets[i], offsets[i] + sizes[i]
        if not is_start:
            live.remove((lo, hi, i))
            continue
        k = live.bisect_left((lo, hi, i))
        if k > 0 and live[k - 1][1] > lo:
            raise AssertionError(
                f"allocation {i} [{lo}, {hi}) "
                f"overlaps allocation {live[k - 1][2]} {live[k - 1][:2]}"
            )
        if k < len(live) and live[k][0] < hi:
            raise AssertionError(
                f"allocation {i} [{lo}, {hi}) overlaps allocation {live[k][2]} {live[k][:2]}"
            )
        live.add((lo, hi, i))
        peak = max(peak, hi)
    return peak


def greedy_work(starts: list[int], ends: list[int]) -> int:
    """What greedy by size costs: allocations live at each one's start (itself included),
    summed; those overlapping every other one are left out (they are stacked apart)."""
    if not starts:
        return 0
    s, e = np.asarray(starts), np.asarray(ends)
    keep = ~((s < e.min()) & (e > s.max()))
    s, e = s[keep], e[keep]
    delta = np.zeros(int(e.max(initial=0)) + 2, np.int64)
    np.add.at(delta, s, 1)
    np.add.at(delta, e, -1)
    return int(np.cumsum(delta)[s].sum())


def bounds(
    trace: AllocTrace, *, alignment_bytes: int = 512, planner: str = "auto"
) -> dict[str, Any]:
    """The lower bound and the offline planner's peak for ``trace``.

    Args:
        trace: the allocation events.
        alignment_bytes: the planner rounds sizes up to a multiple of this.
        planner: ``"greedy-by-size"``, ``"best-fit-in-order"`` or ``"auto"`` (default): greedy by
            size unless ``greedy_work`` exceeds ``GREEDY_WORK_LIMIT`` (thousands of allocations
            live at once, as with a KV cache in small chunks), then best fit in order.

    Returns:
        ``lower_bound_bytes`` (peak live bytes as asked), ``planner_peak_bytes``, ``planner``
        (its name), ``aligned_lower_bound_bytes`` (peak live bytes after rounding: the planner
        cannot beat it), ``num_allocations`` and ``planner_s`` (seconds this call took: the
        lifetimes, the choice of planner and the plan; the replay summary's ``planner_s``).
    """
    if planner not in PLANNERS and planner != "auto":
        raise ValueError(f"planner(={planner!r}) must be one of auto, {', '.join(PLANNERS)}")
    check_int("alignment_bytes", alignment_bytes)
    t0 = time.perf_counter()
    starts, ends, raw = lifetimes(trace)
    sizes = [round_up(n, alignment_bytes) for n in raw]
    if planner == "auto":
        planner = (
            "greedy-by-size"
            if greedy_work(starts, ends) <= GREEDY_WORK_LIMIT
            else "best-fit-in-order"
        )
    peak, _ = PLANNERS[planner](starts, ends, sizes)
    out = {
        "lower_bound_bytes": lower_bound_bytes(trace),
        "planner_peak_bytes": peak,
        "planner": planner,
        "aligned_lower_bound_bytes": _peak_live(starts, ends, sizes),
        "num_allocations": len(sizes),
    }
    out["planner_s"] = time.perf_counter() - t0
    return out


def _peak_live(starts: list[int], ends: list[int], sizes: list[int]) -> int:
    if not sizes:
        return 0
    horizon = max(ends) + 1
    delta = np.zeros(horizon + 1, np.int64)
    np.add.at(delta, np.asarray(starts), np.asarray(sizes, np.int64))
    np.add.at(delta, np.asarray(ends), -np.asarray(sizes, np.int64))
    return int(np.cumsum(delta).max(initial=0))
