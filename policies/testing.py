"""Checks every policy must pass, callable by any policy author (like Gymnasium's ``check_env``).

``check_invariants(policy, live_allocations)`` recounts a pool's state by brute force and
compares it with what the policy reports; ``check_policy(policy_factory)`` runs the whole
battery in ``POLICY_CHECKS`` (random workloads, bad requests, refusals, reset, trim, grow,
parameters). Every check raises ``AssertionError`` naming what is wrong (not ``assert``, so the
checks survive ``python -O``).

A *policy factory* is any callable ``factory(capacity_bytes=None, device=None) -> Policy``: a
policy class, ``functools.partial(policies.create, "best-fit:...")`` or a lambda.

Policies that let several live allocations hold the same pages (prefix sharing) report those
ranges through an optional ``shared_extents() -> list[(offset, length)]`` method; overlaps are
allowed inside them and the shared bytes count once in ``allocated_bytes``.

``SegmentPerRequest`` is the plainest policy that honours the whole contract; the suite's own
tests and wrapper tests use it so they do not depend on any built-in policy.

Pure Python, like the rest of ``policies``: no hypothesis here (the property tests in
``tests/policies`` drive these checks with it).
"""

from __future__ import annotations

import bisect
import operator
import random
from itertools import chain, repeat
from typing import Any, Callable, Iterable

from policies.base import Allocation, Policy, PoolStats, Segment, check_positive_int, round_up
from policies.device import Device, VirtualDevice
from policies.errors import PolicyError

__all__ = [
    "check_invariants", "check_policy", "POLICY_CHECKS", "SegmentPerRequest", "random_size",
    "check_fresh_pool", "check_allocation_fields", "check_random_workload", "check_capacity_workload",
    "check_bad_sizes", "check_double_free", "check_unknown_free", "check_capacity_refusal",
    "check_device_refusal", "check_reset", "check_trim", "check_grow", "check_params",
]

PolicyFactory = Callable[..., Policy]
MiB = 1 << 20

#: sizes a request may have that every policy must refuse with PolicyError
BAD_SIZES: tuple[Any, ...] = (0, -1, -4096, 1.5, 4096.0, "10", True, False, None, b"1", [8])


def _fail(message: str) -> None:
    raise AssertionError(message)


# ---------------------------------------------------------------------------- reference policy
class SegmentPerRequest(Policy):
    """Every request gets a segment of its own; freed segments are cached and reused whole.

    A request takes the smallest cached segment of its stream that fits (never split) or a new
    segment of ``round_up(nbytes, rounding_bytes)``. ``trim(max_bytes)`` gives cached segments
    back, largest first, never more than ``max_bytes`` in total (the built-ins read it as a
    target and may release one segment more: the contract allows both). The cache is a plain
    list: this policy exists to test checks and wrappers, not to be fast.
    """

    name = "segment-per-request"

    def __init__(self, *, rounding_bytes: int = 512, capacity_bytes: int | None = None,
                 device: Device | None = None):
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


# ---------------------------------------------------------------------------- invariants
def _shared_ranges(policy: Policy) -> list[tuple[int, int]]:
    """The policy's shared ``[start, end)`` ranges, merged: sorted and disjoint."""
    fn = getattr(policy, "shared_extents", None)
    merged: list[tuple[int, int]] = []
    for start, end in sorted((o, o + n) for o, n in (fn() if fn is not None else ())):
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


def check_invariants(policy: Policy, live_allocations: Iterable[Allocation]) -> PoolStats:
    """Recount ``policy``'s state by brute force and compare it with what the policy reports.

    Args:
        policy: the pool.
        live_allocations: every allocation it handed out that is still live (all of them:
            counts are compared).

    Returns:
        The policy's stats, checked.

    Raises:
        AssertionError: naming the first invariant that does not hold.
    """
    live = list(live_allocations)
    stats = policy.stats()
    where = _Where(policy)

    # segments: address order, disjoint, summed by the counters
    segs = policy.segments()
    for a, b in zip(segs, segs[1:]):
        if a.end > b.offset:
            _fail(f"{where}: segments [{a.offset}, {a.end}) and [{b.offset}, {b.end}) overlap "
                  "or are out of address order")
    if any(s.nbytes <= 0 for s in segs):
        _fail(f"{where}: a segment has no bytes")
    reserved = sum(s.nbytes for s in segs)
    if stats.reserved_bytes != reserved:
        _fail(f"{where}: reserved_bytes={stats.reserved_bytes} but segments add up to {reserved}")
    if stats.num_segments != len(segs):
        _fail(f"{where}: num_segments={stats.num_segments} but segments() lists {len(segs)}")
    if stats.grown_bytes - stats.shrunk_bytes != reserved:
        _fail(f"{where}: grown_bytes - shrunk_bytes = {stats.grown_bytes - stats.shrunk_bytes} != reserved {reserved}")
    if stats.num_grows - stats.num_shrinks != len(segs):
        _fail(f"{where}: num_grows - num_shrinks = {stats.num_grows - stats.num_shrinks} != {len(segs)} segments")
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
            _fail(f"{where}: allocation of {a.nbytes} B at {a.extents} is listed live but was freed")
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
    seg_has_live, union, union_bytes = _place_live_extents(extents, segs, _shared_ranges(policy), where)
    for seg, has_live in zip(segs, seg_has_live):
        if has_live != (seg.num_live > 0):
            _fail(f"{where}: segment at {seg.offset} has num_live={seg.num_live} but "
                  f"{'holds' if has_live else 'holds no'} live allocations")

    # the counters against the recount
    live_bytes = sum(a.nbytes for a in live)
    if stats.live_bytes != live_bytes:
        _fail(f"{where}: live_bytes={stats.live_bytes} but live allocations ask for {live_bytes}")
    if stats.num_live != len(live):
        _fail(f"{where}: num_live={stats.num_live} but {len(live)} allocations are live")
    if stats.allocated_bytes != union_bytes:
        _fail(f"{where}: allocated_bytes={stats.allocated_bytes} but live extents cover {union_bytes} B")
    if stats.free_bytes != stats.reserved_bytes - stats.allocated_bytes:
        _fail(f"{where}: free_bytes={stats.free_bytes} != reserved - allocated")
    if not 0 <= stats.largest_free_bytes <= stats.free_bytes:
        _fail(f"{where}: largest_free_bytes={stats.largest_free_bytes} outside [0, free_bytes={stats.free_bytes}]")
    if stats.num_allocs - stats.num_frees != stats.num_live:
        _fail(f"{where}: num_allocs - num_frees = {stats.num_allocs - stats.num_frees} != num_live={stats.num_live}")
    for peak, now in (("peak_live_bytes", "live_bytes"), ("peak_allocated_bytes", "allocated_bytes"),
                      ("peak_reserved_bytes", "reserved_bytes")):
        if getattr(stats, peak) < getattr(stats, now):
            _fail(f"{where}: {peak}={getattr(stats, peak)} < {now}={getattr(stats, now)}")
    for field in ("num_failures", "num_grows", "num_shrinks", "grown_bytes", "shrunk_bytes"):
        if getattr(stats, field) < 0:
            _fail(f"{where}: {field} is negative")

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


def _place_live_extents(extents: list[tuple[int, int]], segs: list[Segment], shared: list[tuple[int, int]],
                        where: _Where) -> tuple[list[bool], list[tuple[int, int]], int]:
    """Check sorted live ``[start, end)`` extents lie in segments and overlap only where shared.

    Returns which segments hold live bytes, the union of the extents (sorted, disjoint) and its size.
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


def _check_free_extents(policy: Policy, stats: PoolStats, segs: list[Segment], union: list[tuple[int, int]],
                        where: _Where) -> None:
    """Free extents: in address order, inside segments, clear of live bytes, merged if promised."""
    try:
        free = policy.free_extents()
    except NotImplementedError:
        return
    flat = list(chain.from_iterable(free))
    starts, lengths = flat[0::2], flat[1::2]
    ends = list(map(operator.add, starts, lengths))
    if ((not lengths or min(lengths) > 0) and all(map(operator.le, ends[:-1], starts[1:]))
            and not (policy.coalesces and any(map(operator.eq, ends[:-1], starts[1:])))
            and _segment_numbers(starts, ends, segs) is not None
            and not any(_overlaps_any(u, starts, ends) for u in union)):
        total = sum(lengths)
        if total > stats.free_bytes:
            _fail(f"{where}: free extents add up to {total} B, more than free_bytes={stats.free_bytes}")
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


# ---------------------------------------------------------------------------- the battery
def random_size(rng: random.Random) -> int:
    """A request size from a mix of tiny, small, large and huge (up to 160 MiB) requests."""
    r = rng.random()
    if r < 0.4:
        return rng.randint(1, 4096)
    if r < 0.75:
        return rng.randint(4097, 2 * MiB)
    if r < 0.97:
        return rng.randint(2 * MiB, 40 * MiB)
    return rng.randint(40 * MiB, 160 * MiB)


def _differences(before: PoolStats, after: PoolStats) -> dict[str, tuple[Any, Any]]:
    b, a = before.as_dict(), after.as_dict()
    return {k: (b[k], a[k]) for k in b if b[k] != a[k]}


def _expect_unchanged(policy: Policy, before: PoolStats, what: str) -> None:
    diff = _differences(before, policy.stats())
    if diff:
        _fail(f"{policy!r}: {what} changed the pool: {diff}")


def _expect_failure_unchanged(policy: Policy, before: PoolStats, what: str) -> None:
    """A refused request counts one failure; at most it released fully free segments."""
    after = policy.stats()
    if after.num_failures != before.num_failures + 1:
        _fail(f"{policy!r}: {what} counted {after.num_failures - before.num_failures} failures, expected 1")
    released = before.reserved_bytes - after.reserved_bytes
    if released < 0 or after.num_grows != before.num_grows:
        _fail(f"{policy!r}: {what} reserved memory and still failed ({_differences(before, after)})")
    if released != after.shrunk_bytes - before.shrunk_bytes:
        _fail(f"{policy!r}: {what} changed reserved bytes other than by releasing segments")
    may_change = {"num_failures", "reserved_bytes", "free_bytes", "largest_free_bytes", "num_segments",
                  "num_shrinks", "shrunk_bytes", "frag_ext"}
    diff = {k: v for k, v in _differences(before, after).items() if k not in may_change}
    if diff:
        _fail(f"{policy!r}: {what} returned None but changed {diff}")


def _expect_error(policy: Policy, fn: Callable[[], Any], what: str) -> None:
    before = policy.stats()
    try:
        fn()
    except PolicyError:
        pass
    else:
        _fail(f"{policy!r}: {what} did not raise PolicyError")
    _expect_unchanged(policy, before, what)


def _alloc_all(policy: Policy, sizes: Iterable[int]) -> list[Allocation]:
    out = []
    for n in sizes:
        a = policy.allocate(n)
        if a is None:
            _fail(f"{policy!r}: allocate({n}) failed with no capacity limit")
        out.append(a)
    return out


def _run_workload(policy: Policy, rng: random.Random, num_ops: int, live: list[Allocation],
                  max_live: int = 120) -> None:
    """Random allocs, frees, trims and grows, with the invariants checked after every step."""
    for _ in range(num_ops):
        r = rng.random()
        if live and (r < 0.4 or len(live) >= max_live):
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            policy.free(live.pop())
        elif r < 0.93:
            n, stream = random_size(rng), rng.choice((0, 0, 0, 1))
            a = policy.allocate(n, stream=stream, tag=rng.choice((None, "kv", "act")))
            if a is not None:
                live.append(a)
            elif policy.capacity_bytes is None:
                _fail(f"{policy!r}: allocate({n}) failed with no capacity limit")
        elif r < 0.97:
            before = policy.stats().reserved_bytes
            released = policy.trim()
            if before - policy.stats().reserved_bytes != released:
                _fail(f"{policy!r}: trim() returned {released} but reserved fell by "
                      f"{before - policy.stats().reserved_bytes}")
        else:
            policy.grow(random_size(rng))
        check_invariants(policy, live)


def check_fresh_pool(factory: PolicyFactory) -> None:
    """A new pool holds nothing and has counted nothing."""
    policy = factory()
    s = check_invariants(policy, [])
    counts = {k: getattr(s, k) for k in ("live_bytes", "allocated_bytes", "num_live", "num_allocs", "num_frees",
                                         "num_failures", "peak_live_bytes", "peak_allocated_bytes")}
    if any(counts.values()):
        _fail(f"{policy!r}: a fresh pool reports {counts}")


def check_allocation_fields(factory: PolicyFactory) -> None:
    """An allocation carries the size, stream and tag asked for, and is live until freed."""
    policy = factory()
    a = policy.allocate(1000, stream=1, tag="kv")
    if a is None:
        _fail(f"{policy!r}: allocate(1000) failed with no capacity limit")
    if (a.nbytes, a.stream, a.tag, a.live) != (1000, 1, "kv", True):
        _fail(f"{policy!r}: allocate(1000, stream=1, tag='kv') gave nbytes={a.nbytes}, stream={a.stream}, "
              f"tag={a.tag!r}, live={a.live}")
    b = policy.allocate(1000)
    if b is a:
        _fail(f"{policy!r}: two allocations are the same object")
    check_invariants(policy, [a, b])
    policy.free(a)
    if a.live:
        _fail(f"{policy!r}: an allocation is still live after free()")
    check_invariants(policy, [b])


def check_random_workload(factory: PolicyFactory, seed: int = 0, num_ops: int = 200) -> None:
    """Random requests of every size class; then everything freed and trimmed away."""
    rng = random.Random(seed)
    policy = factory()
    live: list[Allocation] = []
    _run_workload(policy, rng, num_ops, live)
    rng.shuffle(live)
    while live:
        policy.free(live.pop())
        check_invariants(policy, live)
    s = policy.stats()
    if s.allocated_bytes or s.live_bytes or any(seg.num_live for seg in policy.segments()):
        _fail(f"{policy!r}: bytes still held after every allocation was freed: {s}")
    policy.trim()
    s = check_invariants(policy, [])
    if s.reserved_bytes or s.num_segments:
        _fail(f"{policy!r}: trim() with nothing live left {s.reserved_bytes} B in {s.num_segments} segments")


def check_capacity_workload(factory: PolicyFactory, seed: int = 1, num_ops: int = 200) -> None:
    """Under a tight capacity, refusals return None, change nothing else and never overrun it."""
    rng = random.Random(seed)
    capacity = 192 * MiB
    policy = factory(capacity_bytes=capacity)
    live: list[Allocation] = []
    num_refused = 0
    for _ in range(num_ops):
        if live and rng.random() < 0.35:
            policy.free(live.pop(rng.randrange(len(live))))
        else:
            n = random_size(rng)
            before = policy.stats()
            a = policy.allocate(n)
            if a is None:
                num_refused += 1
                _expect_failure_unchanged(policy, before, f"a refused allocate({n})")
            else:
                live.append(a)
        s = check_invariants(policy, live)
        if s.peak_reserved_bytes > capacity:
            _fail(f"{policy!r}: peak_reserved_bytes={s.peak_reserved_bytes} exceeds capacity_bytes={capacity}")
    if num_refused == 0:
        _fail(f"{policy!r}: {num_ops} requests against {capacity} B never hit the limit (check the workload)")


def check_bad_sizes(factory: PolicyFactory) -> None:
    """Sizes that are not positive integers raise PolicyError and change nothing."""
    policy = factory()
    live = _alloc_all(policy, [512, 3 * MiB])
    for bad in BAD_SIZES:
        _expect_error(policy, lambda bad=bad: policy.allocate(bad), f"allocate({bad!r})")
    check_invariants(policy, live)


def check_double_free(factory: PolicyFactory) -> None:
    """Freeing twice raises PolicyError and changes nothing."""
    policy = factory()
    a, b = _alloc_all(policy, [4096, 4096])
    policy.free(a)
    _expect_error(policy, lambda: policy.free(a), "a double free")
    check_invariants(policy, [b])


def check_unknown_free(factory: PolicyFactory) -> None:
    """Freeing what this pool did not hand out (or handed out before a reset) raises PolicyError."""
    policy, other = factory(), factory()
    mine = _alloc_all(policy, [4096])
    theirs = _alloc_all(other, [4096])[0]
    forged = Allocation(4096, 4096, ((mine[0].offset, 4096),))
    for what, obj in (("another pool's allocation", theirs), ("a hand-made Allocation", forged),
                      ("an int", 4096), ("None", None)):
        _expect_error(policy, lambda obj=obj: policy.free(obj), f"free({what})")
    check_invariants(policy, mine)
    check_invariants(other, [theirs])
    policy.reset()
    _expect_error(policy, lambda: policy.free(mine[0]), "free() of an allocation made before reset()")


def check_capacity_refusal(factory: PolicyFactory) -> None:
    """A request beyond capacity returns None, counts a failure and changes nothing else."""
    capacity = 64 * MiB
    policy = factory(capacity_bytes=capacity)
    before = policy.stats()
    if policy.allocate(capacity + 1) is not None:
        _fail(f"{policy!r}: allocate(capacity_bytes + 1) succeeded")
    _expect_failure_unchanged(policy, before, "allocate(capacity_bytes + 1)")
    live = _alloc_all(policy, [MiB, 10 * MiB, 4096])
    policy.trim()
    remaining = capacity - policy.stats().allocated_bytes
    before = policy.stats()
    if policy.allocate(remaining + 1) is not None:
        _fail(f"{policy!r}: a request for more than the unallocated capacity succeeded")
    _expect_failure_unchanged(policy, before, "allocate(unallocated capacity + 1)")
    check_invariants(policy, live)


def check_device_refusal(factory: PolicyFactory) -> None:
    """When the device itself refuses, the request fails cleanly and is counted."""
    device = VirtualDevice(limit_bytes=128 * MiB)
    policy = factory(device=device)
    live = _alloc_all(policy, [4096])
    before = policy.stats()
    if policy.allocate(256 * MiB) is not None:
        _fail(f"{policy!r}: allocate(256 MiB) succeeded on a 128 MiB device")
    _expect_failure_unchanged(policy, before, "allocate() refused by the device")
    check_invariants(policy, live)
    if device.used_bytes != policy.stats().reserved_bytes:
        _fail(f"{policy!r}: the device holds {device.used_bytes} B but the pool reserved {policy.stats().reserved_bytes}")


def check_reset(factory: PolicyFactory, seed: int = 2) -> None:
    """reset() returns the pool (and its device) to the state of a fresh pool, and it still works."""
    device, fresh_device = VirtualDevice(), VirtualDevice()
    policy, fresh = factory(device=device), factory(device=fresh_device)
    live: list[Allocation] = []
    _run_workload(policy, random.Random(seed), 80, live)
    policy.reset()
    diff = _differences(fresh.stats(), policy.stats())
    if diff:
        _fail(f"{policy!r}: after reset() the pool differs from a fresh one: {diff}")
    if device.used_bytes != fresh_device.used_bytes:
        _fail(f"{policy!r}: after reset() the device still holds {device.used_bytes} B")
    for a in live[:3]:
        _expect_error(policy, lambda a=a: policy.free(a), "free() of an allocation made before reset()")
    again = _alloc_all(policy, [4096, 5 * MiB])
    check_invariants(policy, again)


def check_trim(factory: PolicyFactory) -> None:
    """trim() releases only fully free segments and returns what it released."""
    device = VirtualDevice()
    policy = factory(device=device)
    live = _alloc_all(policy, [4096, 40 * MiB, 3 * MiB, 100, 64 * MiB, 7 * MiB])
    for a in live[1::2]:
        policy.free(a)
    live = live[0::2]
    before = policy.stats()
    released = policy.trim()
    after = check_invariants(policy, live)
    if released != before.reserved_bytes - after.reserved_bytes or released < 0:
        _fail(f"{policy!r}: trim() returned {released} but reserved went {before.reserved_bytes} -> {after.reserved_bytes}")
    if released != after.shrunk_bytes - before.shrunk_bytes:
        _fail(f"{policy!r}: trim() released {released} B but shrunk_bytes grew by {after.shrunk_bytes - before.shrunk_bytes}")
    if device.used_bytes != after.reserved_bytes:
        _fail(f"{policy!r}: the device holds {device.used_bytes} B but the pool reserved {after.reserved_bytes}")
    if (after.live_bytes, after.allocated_bytes) != (before.live_bytes, before.allocated_bytes):
        _fail(f"{policy!r}: trim() changed live or allocated bytes")
    again = policy.trim()
    if again != 0:
        _fail(f"{policy!r}: a second trim() released {again} B more")
    for a in live:
        policy.free(a)
    policy.trim()
    s = check_invariants(policy, [])
    if s.reserved_bytes or device.used_bytes:
        _fail(f"{policy!r}: trim() with nothing live kept {s.reserved_bytes} B reserved")


def check_grow(factory: PolicyFactory) -> None:
    """grow(n) reserves at least n bytes of free space; beyond capacity it returns False."""
    capacity = 256 * MiB
    policy = factory(capacity_bytes=capacity)
    live = _alloc_all(policy, [4096])
    before = policy.stats()
    if not policy.grow(8 * MiB):
        _fail(f"{policy!r}: grow(8 MiB) returned False with {capacity - before.reserved_bytes} B of capacity left")
    after = check_invariants(policy, live)
    if after.free_bytes - before.free_bytes < 8 * MiB or after.num_grows <= before.num_grows:
        _fail(f"{policy!r}: grow(8 MiB) added {after.free_bytes - before.free_bytes} B of free space")
    if (after.live_bytes, after.allocated_bytes, after.num_allocs) != (before.live_bytes, before.allocated_bytes,
                                                                        before.num_allocs):
        _fail(f"{policy!r}: grow() changed live or allocated bytes")
    before = policy.stats()
    if policy.grow(capacity):
        _fail(f"{policy!r}: grow(capacity_bytes) succeeded with {before.reserved_bytes} B already reserved")
    after = check_invariants(policy, live)
    if after.num_grows != before.num_grows or after.reserved_bytes > before.reserved_bytes:
        _fail(f"{policy!r}: a refused grow() reserved memory")


def check_params(factory: PolicyFactory) -> None:
    """Knobs are stored unchanged, a clone from get_params() is equal, and spec names the policy."""
    from policies.registry import available, create, get
    from policies.spec import parse_spec

    policy = factory(capacity_bytes=512 * MiB)
    params = policy.get_params()
    if list(params) != type(policy)._param_names():
        _fail(f"{policy!r}: get_params() keys {list(params)} differ from __init__'s keywords")
    clone = type(policy)(**params, device=VirtualDevice())
    if clone.get_params() != params:
        _fail(f"{policy!r}: a clone from get_params() has params {clone.get_params()}, not {params}")
    name, _ = parse_spec(policy.spec)
    if name != policy.name:
        _fail(f"{policy!r}: spec {policy.spec!r} does not start with the policy's name {policy.name!r}")
    if name in available() and get(name) is type(policy):
        rebuilt = create(policy.spec, capacity_bytes=policy.capacity_bytes)
        if rebuilt.get_params() != params:
            _fail(f"{policy!r}: create({policy.spec!r}) has params {rebuilt.get_params()}, not {params}")


#: every check ``check_policy`` runs, in order; each takes a policy factory.
POLICY_CHECKS: tuple[Callable[[PolicyFactory], None], ...] = (
    check_fresh_pool, check_allocation_fields, check_random_workload, check_capacity_workload,
    check_bad_sizes, check_double_free, check_unknown_free, check_capacity_refusal, check_device_refusal,
    check_reset, check_trim, check_grow, check_params,
)


def check_policy(policy_factory: PolicyFactory) -> None:
    """Run every check in ``POLICY_CHECKS`` against pools built by ``policy_factory``.

    Args:
        policy_factory: ``factory(capacity_bytes=None, device=None) -> Policy``; a policy class
            or ``functools.partial(policies.create, spec)`` both qualify.

    Raises:
        AssertionError: from the first check that fails, naming the check.
    """
    for check in POLICY_CHECKS:
        try:
            check(policy_factory)
        except AssertionError as exc:
            raise AssertionError(f"{check.__name__}: {exc}") from exc
