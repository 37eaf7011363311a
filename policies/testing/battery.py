"""The battery ``check_policy`` runs: workloads, bad requests, refusals, reset, trim, grow,
parameters."""

from __future__ import annotations

import random
from typing import Any, Callable, Iterable

from policies.base import Allocation, Policy, PoolStats
from policies.device import MAX_DEVICE_BYTES, VirtualDevice
from policies.errors import PolicyError
from policies.testing._common import BAD_SIZES, MiB, PolicyFactory, fail as _fail
from policies.testing.invariants import check_invariants


def random_size(rng: random.Random, max_bytes: int = 160 * MiB) -> int:
    """A request size from a mix of tiny, small, large and huge (up to ``max_bytes``, at least
    2 MiB) requests; huge ones start at 40 MiB, or at ``max_bytes`` when that is lower."""
    r = rng.random()
    if r < 0.4:
        return rng.randint(1, 4096)
    if r < 0.75:
        return rng.randint(4097, 2 * MiB)
    if r < 0.97:
        return rng.randint(2 * MiB, min(40 * MiB, max_bytes))
    return rng.randint(min(40 * MiB, max_bytes), max_bytes)


def _differences(before: PoolStats, after: PoolStats) -> dict[str, tuple[Any, Any]]:
    b, a = before.as_dict(), after.as_dict()
    return {k: (b[k], a[k]) for k in b if b[k] != a[k]}


def _expect_unchanged(policy: Policy, before: PoolStats, what: str) -> None:
    diff = _differences(before, policy.stats())
    if diff:
        _fail(f"{policy!r}: {what} changed the pool: {diff}")


Holdings = list[tuple[Any, ...]]


def _holdings(live: Iterable[Allocation]) -> Holdings:
    """What each live allocation holds, to compare before and after a call that must not touch
    it."""
    return [(a.extents, a.size_bytes, a.nbytes, a.stream, a.tag, a.live) for a in live]


def _expect_failure_unchanged(
    policy: Policy,
    before: PoolStats,
    what: str,
    live: Iterable[Allocation] = (),
    held: Holdings | None = None,
) -> None:
    """The ``Policy.allocate`` failure contract: one failure counted; every live allocation
    (``live``, which held ``held`` before the call) and the live and allocated byte counters
    unchanged; nothing reserved; at most fully free segments released, and none while frozen."""
    after = policy.stats()
    if after.num_failures != before.num_failures + 1:
        _fail(
            f"{policy!r}: {what} counted {after.num_failures - before.num_failures} failures, "
            "expected 1"
        )
    released = before.reserved_bytes - after.reserved_bytes
    # bytes, not num_grows: unmapping a hole in an expandable range adds a segment and reserves
    # nothing
    if released < 0 or after.grown_bytes != before.grown_bytes:
        _fail(
            f"{policy!r}: {what} reserved memory and still failed ({_differences(before, after)})"
        )
    if released != after.shrunk_bytes - before.shrunk_bytes:
        _fail(f"{policy!r}: {what} changed reserved bytes other than by releasing segments")
    if released and policy.frozen:
        _fail(
            f"{policy!r}: {what} released {released} B while frozen "
            "(memory given back could not come back)"
        )
    if held is not None and _holdings(live) != held:
        _fail(f"{policy!r}: {what} returned None but changed a live allocation")
    may_change = {
        "num_failures",
        "num_frozen_failures",
        "reserved_bytes",
        "free_bytes",
        "largest_free_bytes",
        "num_segments",
        "num_shrinks",
        "shrunk_bytes",
        "frag_ext",
        "num_grows",
    }
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


def _run_workload(
    policy: Policy, rng: random.Random, num_ops: int, live: list[Allocation], max_live: int = 120
) -> None:
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
                _fail(
                    f"{policy!r}: trim() returned {released} "
                    f"but reserved fell by {before - policy.stats().reserved_bytes}"
                )
        else:
            policy.grow(random_size(rng))
        check_invariants(policy, live)


def check_fresh_pool(factory: PolicyFactory) -> None:
    """A new pool holds nothing and has counted nothing."""
    policy = factory()
    s = check_invariants(policy, [])
    counts = {
        k: getattr(s, k)
        for k in (
            "live_bytes",
            "allocated_bytes",
            "num_live",
            "num_allocs",
            "num_frees",
            "num_failures",
            "peak_live_bytes",
            "peak_allocated_bytes",
        )
    }
    if any(counts.values()):
        _fail(f"{policy!r}: a fresh pool reports {counts}")


def check_allocation_fields(factory: PolicyFactory) -> None:
    """An allocation carries the size, stream and tag asked for, and is live until freed."""
    policy = factory()
    a = policy.allocate(1000, stream=1, tag="kv")
    if a is None:
        _fail(f"{policy!r}: allocate(1000) failed with no capacity limit")
    if (a.nbytes, a.stream, a.tag, a.live) != (1000, 1, "kv", True):
        _fail(
            f"{policy!r}: allocate(1000, stream=1, tag='kv') gave nbytes={a.nbytes}, "
            f"stream={a.stream}, "
            f"tag={a.tag!r}, live={a.live}"
        )
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
        _fail(
            f"{policy!r}: trim() with nothing live left {s.reserved_bytes} B "
            f"in {s.num_segments} segments"
        )


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
            before, held = policy.stats(), _holdings(live)
            a = policy.allocate(n)
            if a is None:
                num_refused += 1
                _expect_failure_unchanged(policy, before, f"a refused allocate({n})", live, held)
            else:
                live.append(a)
        s = check_invariants(policy, live)
        if s.peak_reserved_bytes > capacity:
            _fail(
                f"{policy!r}: "
                f"peak_reserved_bytes={s.peak_reserved_bytes} exceeds capacity_bytes={capacity}"
            )
    if num_refused == 0:
        _fail(
            f"{policy!r}: {num_ops} requests against {capacity} B never hit the limit "
            "(check the workload)"
        )


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
    for what, obj in (
        ("another pool's allocation", theirs),
        ("a hand-made Allocation", forged),
        ("an int", 4096),
        ("None", None),
    ):
        _expect_error(policy, lambda obj=obj: policy.free(obj), f"free({what})")
    check_invariants(policy, mine)
    check_invariants(other, [theirs])
    policy.reset()
    _expect_error(
        policy, lambda: policy.free(mine[0]), "free() of an allocation made before reset()"
    )


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
    before, held = policy.stats(), _holdings(live)
    if policy.allocate(remaining + 1) is not None:
        _fail(f"{policy!r}: a request for more than the unallocated capacity succeeded")
    _expect_failure_unchanged(policy, before, "allocate(unallocated capacity + 1)", live, held)
    check_invariants(policy, live)


def check_device_refusal(factory: PolicyFactory) -> None:
    """When the device itself refuses, the request fails cleanly and is counted."""
    device = VirtualDevice(limit_bytes=128 * MiB)
    policy = factory(device=device)
    live = _alloc_all(policy, [4096])
    before, held = policy.stats(), _holdings(live)
    if policy.allocate(256 * MiB) is not None:
        _fail(f"{policy!r}: allocate(256 MiB) succeeded on a 128 MiB device")
    _expect_failure_unchanged(policy, before, "allocate() refused by the device", live, held)
    check_invariants(policy, live)
    if device.used_bytes != policy.stats().reserved_bytes:
        _fail(
            f"{policy!r}: the device holds {device.used_bytes} B "
            f"but the pool reserved {policy.stats().reserved_bytes}"
        )


def check_reset(factory: PolicyFactory, seed: int = 2) -> None:
    """reset() returns the pool (and its device) to the state of a fresh pool, and it still
    works."""
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
        _expect_error(
            policy, lambda a=a: policy.free(a), "free() of an allocation made before reset()"
        )
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
        _fail(
            f"{policy!r}: trim() returned {released} "
            f"but reserved went {before.reserved_bytes} -> {after.reserved_bytes}"
        )
    if released != after.shrunk_bytes - before.shrunk_bytes:
        _fail(
            f"{policy!r}: trim() released {released} B "
            f"but shrunk_bytes grew by {after.shrunk_bytes - before.shrunk_bytes}"
        )
    if device.used_bytes != after.reserved_bytes:
        _fail(
            f"{policy!r}: the device holds {device.used_bytes} B "
            f"but the pool reserved {after.reserved_bytes}"
        )
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
        _fail(
            f"{policy!r}: grow(8 MiB) "
            f"returned False with {capacity - before.reserved_bytes} B of capacity left"
        )
    after = check_invariants(policy, live)
    if after.free_bytes - before.free_bytes < 8 * MiB or after.num_grows <= before.num_grows:
        _fail(
            f"{policy!r}: grow(8 MiB) added {after.free_bytes - before.free_bytes} B of free space"
        )
    if (after.live_bytes, after.allocated_bytes, after.num_allocs) != (
        before.live_bytes,
        before.allocated_bytes,
        before.num_allocs,
    ):
        _fail(f"{policy!r}: grow() changed live or allocated bytes")
    before = policy.stats()
    if policy.grow(capacity):
        _fail(
            f"{policy!r}: grow(capacity_bytes) "
            f"succeeded with {before.reserved_bytes} B already reserved"
        )
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
        _fail(
            f"{policy!r}: a clone from get_params() has params {clone.get_params()}, not {params}"
        )
    name, _ = parse_spec(policy.spec)
    if name != policy.name:
        _fail(
            f"{policy!r}: spec {policy.spec!r} does not start with "
            f"the policy's name {policy.name!r}"
        )
    if name in available() and get(name) is type(policy):
        rebuilt = create(policy.spec, capacity_bytes=policy.capacity_bytes)
        if rebuilt.get_params() != params:
            _fail(
                f"{policy!r}: create({policy.spec!r}) has params {rebuilt.get_params()}, "
                f"not {params}"
            )


def _allocate_checked(
    policy: Policy, nbytes: int, live: list[Allocation], stream: int = 0
) -> Allocation | None:
    """``allocate`` under the failure contract; the result joins ``live``; invariants checked."""
    before, held = policy.stats(), _holdings(live)
    a = policy.allocate(nbytes, stream=stream)
    if a is None:
        _expect_failure_unchanged(policy, before, f"a refused allocate({nbytes})", live, held)
    else:
        live.append(a)
    check_invariants(policy, live)
    return a


def _reserved_after(factory: PolicyFactory, nbytes: int, stream: int = 0) -> int:
    """Bytes a fresh pool reserves to serve one request of ``nbytes``."""
    policy = factory()
    if policy.allocate(nbytes, stream=stream) is None:
        _fail(f"{policy!r}: allocate({nbytes}) failed with no capacity limit")
    return policy.stats().reserved_bytes


def check_release_and_retry(factory: PolicyFactory) -> None:
    """A reservation whose trim-and-retry releases free segments never serves from one released.

    Issue 11's arena sequence (alloc 1 MiB, free, alloc 100 MiB, alloc 2 MiB under 128 MiB: the
    retry released the empty current arena, which was then cached and handed out again), on
    one stream and across two, with other small first sizes; and the same under a capacity
    fitted to this policy's segment sizes so that the 100 MiB request must release the first
    segment, whatever the policy's segment sizes.
    """
    big = 100 * MiB
    for first, stream in ((MiB, 0), (MiB, 1), (4096, 0), (3 * MiB, 0)):
        fitted = _reserved_after(factory, big) + _reserved_after(factory, first, stream) - 1
        for capacity in (128 * MiB, fitted):
            policy = factory(capacity_bytes=capacity)
            live: list[Allocation] = []
            if _allocate_checked(policy, first, live, stream) is None:
                _fail(f"{policy!r}: allocate({first}) failed in an empty pool")
            policy.free(live.pop())
            check_invariants(policy, live)
            for n, on in ((big, 0), (2 * MiB, 0), (first, stream)):
                _allocate_checked(policy, n, live, on)
            while live:
                policy.free(live.pop())
                check_invariants(policy, live)
            s = policy.stats()
            if s.peak_live_bytes > s.peak_reserved_bytes:
                _fail(
                    f"{policy!r}: peak_live_bytes={s.peak_live_bytes} above "
                    f"peak_reserved_bytes={s.peak_reserved_bytes}"
                )


#: sizes reused over and over by ``check_same_size_reuse``: issue 11's buffer, and sizes one
#: byte off powers of two and off the segment and pool thresholds of the built-in policies
REUSED_SIZES: tuple[int, ...] = (
    131_072_000,
    3 * MiB + 1,
    MiB,
    MiB + 1,
    2 * MiB - 1,
    10 * MiB - 512,
    20 * MiB + 1,
    33 * MiB,
    4097,
    100_000,
)


def check_same_size_reuse(factory: PolicyFactory, num_rounds: int = 24) -> None:
    """Allocating and freeing one size again and again reuses the memory freed: reserved memory
    does not grow with the number of reuses (issue 11: tlsf reserved a new segment for every
    reuse of a buffer). After ``num_rounds`` rounds the peak is at most twice the first
    round's: an arena whose first arena is pinned by a held neighbour fills it once, then takes
    a second one for good."""
    for keep in (False, True):
        for n in REUSED_SIZES:
            policy = factory()
            live = _alloc_all(policy, [4096]) if keep else []  # with a neighbour held, or not
            first_peak = 0
            for i in range(num_rounds):
                a = _alloc_all(policy, [n])[0]
                check_invariants(policy, [*live, a])
                policy.free(a)
                if i == 0:
                    first_peak = policy.stats().peak_reserved_bytes
            s = check_invariants(policy, live)
            if s.peak_reserved_bytes > 2 * first_peak:
                _fail(
                    f"{policy!r}: reusing {n} B {num_rounds} times raised peak_reserved_bytes "
                    f"from {first_peak} to {s.peak_reserved_bytes} ({s.num_grows} grows)"
                )


class _CountingDevice(VirtualDevice):
    """A ``VirtualDevice`` that counts ``reserve`` calls."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.num_reserves = 0

    def reserve(self, nbytes: int) -> int | None:
        self.num_reserves += 1
        return super().reserve(nbytes)


#: requests no device can hold (``MAX_DEVICE_BYTES`` is 4 TiB)
HUGE_SIZES: tuple[int, ...] = (MAX_DEVICE_BYTES + 1, 1 << 62, 1 << 64, 1 << 100)


def check_huge_request(factory: PolicyFactory) -> None:
    """A request larger than the device can hold fails before any work: None, one failure,
    nothing else changed, the device never asked; the pool stays usable (issue 11)."""
    for capacity, device, sizes in (
        (None, _CountingDevice(), HUGE_SIZES),
        (64 * MiB, _CountingDevice(), HUGE_SIZES),
        (None, _CountingDevice(max_bytes=64 * MiB), (64 * MiB + 1, 1 << 40)),
    ):
        policy = factory(capacity_bytes=capacity, device=device)
        live = _alloc_all(policy, [4096, 3 * MiB])
        for n in sizes:
            before, held, num_reserves = policy.stats(), _holdings(live), device.num_reserves
            if policy.allocate(n) is not None:
                _fail(
                    f"{policy!r}: allocate({n}) "
                    f"succeeded on a device of at most {device.max_bytes} B"
                )
            diff = _differences(before, policy.stats())
            if (
                diff.pop("num_failures", None) != (before.num_failures, before.num_failures + 1)
                or diff
            ):
                _fail(
                    f"{policy!r}: a refused allocate({n}) "
                    f"changed {diff or 'num_failures by other than 1'}"
                )
            if _holdings(live) != held or device.num_reserves != num_reserves:
                _fail(
                    f"{policy!r}: a refused allocate({n}) touched a live allocation "
                    "or asked the device"
                )
            before = policy.stats()
            if policy.grow(n):
                _fail(
                    f"{policy!r}: grow({n}) succeeded on a device of at most {device.max_bytes} B"
                )
            _expect_unchanged(policy, before, f"a refused grow({n})")
        check_invariants(policy, live)
        policy.free(live.pop())
        live += _alloc_all(policy, [5 * MiB, 512])
        check_invariants(policy, live)
        while live:
            policy.free(live.pop())
        policy.trim()
        s = check_invariants(policy, [])
        if s.reserved_bytes:
            _fail(
                f"{policy!r}: after huge requests, "
                f"trim() with nothing live kept {s.reserved_bytes} B"
            )


#: every check ``check_policy`` runs, in order; each takes a policy factory.
def _batched_state(policy: Policy, live: Iterable[Allocation]) -> tuple[Any, ...]:
    """What a batched call must leave as the loop of single calls does: every counter, what each
    allocation holds, and the driver calls the device saw."""
    return policy.stats().as_dict(), _holdings(live), policy.device.call_stats()


def check_batched_calls(
    factory: PolicyFactory, seed: int = 3, num_ops: int = 60, capacity_bytes: int | None = None
) -> None:
    """``allocate_each``/``free_each`` (the policy's own or the base class's loop) have exactly
    the effects of the loop of ``allocate``/``free`` calls: two pools from ``factory`` get the
    same random requests, one batched, one call by call, and must agree after each (the
    allocations' places and sizes, refusals, counters, device calls), bad frees included; once
    with no capacity limit and once under a tight one (refusals, frees that make room)."""
    for cap in (capacity_bytes, 24 * MiB) if capacity_bytes is None else (capacity_bytes,):
        rng = random.Random(seed)
        batched, single = factory(capacity_bytes=cap), factory(capacity_bytes=cap)
        live_b: list[Allocation | None] = []
        live_s: list[Allocation | None] = []
        sizes = [random_size(rng, 8 * MiB) for _ in range(4)]  # a few, repeated (a page size)
        for op in range(num_ops):
            if live_b and rng.random() < 0.35:
                picks = rng.sample(range(len(live_b)), rng.randint(1, min(6, len(live_b))))
                if rng.random() < 0.1:
                    picks.append(picks[0])  # a double free: both raise, after the same frees
                what = f"op {op}: free_each of {len(picks)}"
                outcomes = []
                for pool, live in ((batched, live_b), (single, live_s)):
                    handles = [live[i] for i in picks]
                    try:
                        if pool is batched:
                            pool.free_each(handles)
                        else:
                            for a in handles:
                                pool.free(a)
                        outcomes.append(None)
                    except PolicyError:
                        outcomes.append(PolicyError)
                for i in sorted(set(picks), reverse=True):
                    live_b.pop(i)
                    live_s.pop(i)
            else:
                nbytes = rng.choice(sizes) if rng.random() < 0.8 else random_size(rng, 8 * MiB)
                num_calls, stream = rng.randint(0, 6), rng.choice((0, 0, 1))
                tag = rng.choice((None, "kv"))
                what = f"op {op}: allocate_each({nbytes}, {num_calls}, stream={stream})"
                got = batched.allocate_each(nbytes, num_calls, stream=stream, tag=tag)
                want = [single.allocate(nbytes, stream=stream, tag=tag) for _ in range(num_calls)]
                if not isinstance(got, list) or len(got) != num_calls:
                    _fail(f"{batched!r}: {what} returned {got!r}, not a list of {num_calls}")
                if [a is None for a in got] != [a is None for a in want]:
                    _fail(f"{batched!r}: {what} refused other calls than the loop")
                live_b.extend(a for a in got if a is not None)
                live_s.extend(a for a in want if a is not None)
                outcomes = [None, None]
            if outcomes[0] is not outcomes[1]:
                _fail(f"{batched!r}: {what} raised {outcomes[0]}, the loop {outcomes[1]}")
            got_state, want_state = _batched_state(batched, live_b), _batched_state(single, live_s)
            if got_state != want_state:
                _fail(
                    f"{batched!r}: {what} left another state than the loop of single calls: "
                    f"{got_state} != {want_state}"
                )
            check_invariants(batched, live_b)


POLICY_CHECKS: tuple[Callable[[PolicyFactory], None], ...] = (
    check_fresh_pool,
    check_allocation_fields,
    check_random_workload,
    check_capacity_workload,
    check_bad_sizes,
    check_double_free,
    check_unknown_free,
    check_capacity_refusal,
    check_device_refusal,
    check_reset,
    check_trim,
    check_grow,
    check_params,
    check_release_and_retry,
    check_same_size_reuse,
    check_huge_request,
    check_batched_calls,
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


#: ``make_pool(policy) -> pool``: a real pool (``realgpu.GpuPool``, validation on) over a spec
#: string or a fresh policy object; the pool builds its own policy on its own device
RealPoolFactory = Callable[[Any], Any]


def check_real_pool(
    make_pool: RealPoolFactory, spec: str, *, seed: int = 5, num_ops: int = 48
) -> None:
    """``spec`` driving real memory, given as a spec string and as a fresh policy object.

    ``make_pool`` builds a pool that validates (``realgpu.GpuPool(..., validate=True,
    guard_bytes=0)`` on the ``host`` or ``host-vmm`` backend): every byte the policy hands out
    is written with a pattern on allocation and checked on free, inside what the device really
    holds (a range over two ``cudaMalloc`` blocks, or over pages never mapped, is refused). The
    same random requests go to ``spec`` alone, on the model of the pool's device (a
    ``PageMappedDevice`` for a page-mapped one, a ``VirtualDevice`` otherwise): the pool's
    accounting must equal it after every request, and both pools keep their invariants. The
    policy object given is left untouched (the pool builds its own from its knobs).

    Layering: ``policies`` imports nothing of ``realgpu``; the caller passes the pool.
    """
    from policies.mapped_device import PageMappedDevice
    from policies.registry import create

    for given in ("spec", "object"):
        obj = create(spec) if given == "object" else None
        pool = make_pool(obj if obj is not None else spec)
        where = (
            f"{spec!r} given as {'a policy object' if obj is not None else 'a spec string'} "
            f"to {pool!r}"
        )
        try:
            real = pool.policy
            if obj is not None and (real is obj or obj.num_allocs or obj.segments()):
                _fail(
                    f"{where}: the pool drove the object it was given instead of building its own"
                )
            device = pool.device
            model = (
                PageMappedDevice(granularity_bytes=device.granularity_bytes)
                if isinstance(device, PageMappedDevice)
                else VirtualDevice()
            )
            twin = create(spec, device=model)
            rng = random.Random(seed)
            live: list[tuple[Allocation, Allocation]] = []
            for step in range(num_ops):
                if live and (rng.random() < 0.4 or len(live) >= 24):
                    a, b = live.pop(rng.randrange(len(live)))
                    pool.free(a)  # validation: raises CorruptionError where a byte changed
                    twin.free(b)
                else:
                    # up to 24 MiB: every byte is written and read back
                    n, stream, tag = (
                        random_size(rng, 24 * MiB),
                        rng.choice((0, 0, 1)),
                        rng.choice((None, "kv", "act")),
                    )
                    a = pool.allocate(
                        n, stream=stream, tag=tag
                    )  # raises where the pool cannot place it
                    b = twin.allocate(n, stream=stream, tag=tag)
                    if b is None:
                        _fail(
                            f"{where}: allocate({n}) "
                            "failed on the model device with no capacity limit"
                        )
                    live.append((a, b))
                    if a.extents != b.extents:
                        _fail(
                            f"{where}: request {step} "
                            f"({n} B) placed at {a.extents[:4]} on the device but {b.extents[:4]} "
                            "on the model: the policy's offsets are not the device's"
                        )
                diff = _differences(twin.stats(), pool.stats())
                if diff:
                    _fail(
                        f"{where}: after request {step} the pool's accounting differs from "
                        f"the model's: {diff}"
                    )
            check_invariants(real, [a for a, _ in live])
            check_invariants(twin, [b for _, b in live])
            while live:
                a, b = live.pop()
                pool.free(a)
                twin.free(b)
        finally:
            pool.close()
