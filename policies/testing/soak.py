"""``soak``: a long randomized run over one policy, the battery's invariants checked after every
operation.

Where ``check_policy`` runs short, aimed workloads, ``soak(factory, num_ops)`` throws a long
random mix at a pool: requests of every size (tiny to 160 MiB, one byte off powers of two and
off the thresholds of the built-in policies, now and then one no device holds), frees, several
streams and tags, capacities that force failures, ``trim``, ``grow``, ``freeze``/``unfreeze``,
``reset``, bad sizes, double frees and, where the policy shares pages, ``fork``. After every
operation ``check_invariants`` recounts the pool and each operation's own contract is checked
(a failure changes nothing live, ``trim`` returns what it released, a frozen pool never grows,
``reset`` gives a fresh pool, ...), plus the policy's own ``check_invariants()`` where it has
one.

A violation (any exception that is not a refusal the contract promises) is recorded with the
seed, episode and operation index that reproduce it, and the run goes on with a new pool: the
report counts violations rather than stopping at the first. Runs are seeded, so a report can
be replayed exactly.
"""

from __future__ import annotations

import random
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from policies.base import Allocation, Policy
from policies.device import MAX_DEVICE_BYTES
from policies.testing._common import BAD_SIZES, MiB, PolicyFactory, fail as _fail
from policies.testing.battery import (
    _differences,
    _expect_error,
    _expect_failure_unchanged,
    _holdings,
    random_size,
)
from policies.testing.invariants import check_invariants

__all__ = [
    "SoakReport",
    "soak",
    "soak_size",
    "soak_specs",
    "SOAK_CAPACITIES",
    "BOUNDARY_SIZES",
    "ACTIVE_SPECS",
]

GiB = 1 << 30

#: capacities a soak episode picks from: no limit, and limits that make large requests fail
SOAK_CAPACITIES: tuple[int | None, ...] = (None, 96 * MiB, 256 * MiB, GiB)
_STREAMS = (0, 0, 0, 1, 2)
#: besides each registered policy's defaults, configurations that make wrappers and options act
#: often
ACTIVE_SPECS: tuple[str, ...] = (
    "elastic:patience=2,grow_bytes=4MiB",
    "tag-limits:limits=[kv=64MiB]",
    "compacting:threshold=0.1,check_every=4,min_free_bytes=1MiB",
    "elastic:base=[paged],patience=2",
    "torch-caching:max_split_size_bytes=40MiB,roundup_power2_divisions=4,garbage_collection_threshold=0.5",
    "best-fit:virtual=true",
    "first-fit:virtual=true",
    "elastic:base=[page-pool]",
)


def soak_specs() -> list[str]:
    """What a full soak covers: every registered policy (third-party ones too), then
    ``ACTIVE_SPECS``."""
    from policies.registry import available  # the registry imports every policy module: late

    return [*available(), *ACTIVE_SPECS]


_TAGS = (None, "kv", "kv", "act", "weights")
#: free ranges a pool may list and still have them all walked after every soak operation
FREE_RECOUNT_RANGES = 256


def _boundaries() -> tuple[int, ...]:
    """Sizes where policies change their minds: one byte around powers of two from 256 B to
    128 MiB, around PyTorch's 1/10/20 MiB thresholds, and around 512 B multiples."""
    sizes = set()
    for k in range(8, 28):
        for d in (-1, 0, 1):
            sizes.add((1 << k) + d)
        sizes.add((1 << k) + (1 << (k - 4)) + 1)  # just past a second-level class of tlsf
    for base in (MiB, 10 * MiB, 20 * MiB, 32 * MiB, 64 * MiB, 131_072_000):
        sizes.update((base - 512, base - 1, base, base + 1, base + 512))
    return tuple(sorted(sizes))


#: request sizes on or one byte off the boundaries of the built-in policies
BOUNDARY_SIZES: tuple[int, ...] = _boundaries()


def soak_size(rng: random.Random) -> int:
    """A request size: the battery's mix, boundary sizes, and rarely one no device holds."""
    r = rng.random()
    if r < 0.6:
        return random_size(rng)
    if r < 0.995:
        return rng.choice(BOUNDARY_SIZES)
    return rng.choice((MAX_DEVICE_BYTES + 1, 1 << 62, 1 << 64))


@dataclass
class SoakReport:
    """What ``soak`` saw. ``num_failures`` are refused requests (expected under a capacity);
    ``violations`` holds the first few violation messages, each saying how to reproduce it."""

    spec: str
    num_ops: int = 0
    num_violations: int = 0
    num_failures: int = 0
    num_episodes: int = 0
    seconds: float = 0.0
    seed: int = 0
    violations: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Episode:
    """One pool under soak: the operations, each followed by the checks."""

    def __init__(
        self, factory: PolicyFactory, rng: random.Random, capacity: int | None, max_live: int
    ):
        self.factory, self.rng, self.capacity, self.max_live = factory, rng, capacity, max_live
        self.policy: Policy = factory(capacity_bytes=capacity)
        self.fresh_stats = factory(capacity_bytes=capacity).stats()
        self.live: list[Allocation] = []
        self.freed: list[Allocation] = []  # a few freed allocations, for double frees
        self.num_failures = 0
        own = getattr(self.policy, "check_invariants", None)
        self.own_check: Callable[[], None] | None = own if callable(own) else None
        self.can_fork = callable(getattr(self.policy, "fork", None))
        self.steps_to_recount = 1

    # ---------------------------------------------------------------- operations
    def step(self) -> None:
        r = self.rng.random()
        live = self.live
        if self.policy.frozen and r < 0.05:  # stay frozen for about 20 operations
            self.policy.unfreeze()
            r = self.rng.random()
        if live and (r < 0.36 or len(live) >= self.max_live):
            self.free()
        elif r < 0.86:
            self.allocate()
        elif r < 0.90:
            self.trim()
        elif r < 0.92:
            self.grow()
        elif r < 0.93:
            self.policy.freeze()
        elif r < 0.95:
            self.grow()
        elif r < 0.96 and self.can_fork and live:
            self.fork()
        elif r < 0.97:
            self.bad_size()
        elif r < 0.98 and self.freed:
            self.double_free()
        elif r < 0.984:
            self.reset()
        else:
            self.allocate()
        self.steps_to_recount -= 1
        recount = self.steps_to_recount <= 0
        check_invariants(
            self.policy, self.live, free_extents=recount
        )  # not ``live``: reset() starts a new list
        if self.own_check is not None:
            self.own_check()
        if recount:
            self.schedule_recount()

    def schedule_recount(self) -> None:
        """When the next full walk of the free extents is due.

        After every operation, unless the pool checks its own accounting (``own_check``) and
        lists many free ranges: then every ``1 + ranges // FREE_RECOUNT_RANGES`` operations, so
        the walk costs about as much per operation as for a pool with that many ranges
        (size-class caches ~10^4 blocks: a walk after each operation took ~3 ms).
        """
        every = 1
        if self.own_check is not None:
            try:
                every += len(self.policy.free_extents()) // FREE_RECOUNT_RANGES
            except NotImplementedError:
                pass
        self.steps_to_recount = every

    def allocate(self) -> None:
        policy, rng = self.policy, self.rng
        n = soak_size(rng)
        before, held = policy.stats(), _holdings(self.live)
        frozen = policy.frozen
        a = policy.allocate(n, stream=rng.choice(_STREAMS), tag=rng.choice(_TAGS))
        if a is None:
            self.num_failures += 1
            _expect_failure_unchanged(policy, before, f"a refused allocate({n})", self.live, held)
            if (
                self.capacity is None
                and not frozen
                and n <= MAX_DEVICE_BYTES
                and not self._limited_by_tag()
            ):
                _fail(f"{policy!r}: allocate({n}) failed with no capacity limit")
            return
        if n > MAX_DEVICE_BYTES:
            _fail(f"{policy!r}: allocate({n}) succeeded, more than any device holds")
        if frozen and policy.stats().num_grows != before.num_grows:
            _fail(f"{policy!r}: allocate({n}) grew a frozen pool")
        self.live.append(a)

    def _limited_by_tag(self) -> bool:
        """A pool with per-tag limits may refuse with no capacity: tag-limits' own rule."""
        return bool(getattr(self.policy, "limits", ""))

    def free(self) -> None:
        live, rng = self.live, self.rng
        i = rng.randrange(len(live))
        live[i], live[-1] = live[-1], live[i]
        a = live.pop()
        self.policy.free(a)
        self.freed = (self.freed + [a])[-4:]

    def trim(self) -> None:
        policy = self.policy
        max_bytes = self.rng.choice((None, 0, MiB, 64 * MiB))
        before, held = policy.stats(), _holdings(self.live)
        released = policy.trim(max_bytes)
        after = policy.stats()
        if released != before.reserved_bytes - after.reserved_bytes or released < 0:
            _fail(
                f"{policy!r}: trim({max_bytes}) returned {released} "
                f"but reserved went {before.reserved_bytes} -> {after.reserved_bytes}"
            )
        # grown_bytes, not num_grows: unmapping a hole in an expandable range adds a segment, no
        # memory
        if (after.live_bytes, after.allocated_bytes, after.grown_bytes) != (
            before.live_bytes,
            before.allocated_bytes,
            before.grown_bytes,
        ) or _holdings(self.live) != held:
            _fail(f"{policy!r}: trim({max_bytes}) changed live allocations or grew")

    def grow(self) -> None:
        policy = self.policy
        n = soak_size(self.rng)
        before, held = policy.stats(), _holdings(self.live)
        ok = policy.grow(n)
        after = policy.stats()
        if ok and (policy.frozen or n > MAX_DEVICE_BYTES):
            _fail(
                f"{policy!r}: "
                f"grow({n}) succeeded {'while frozen' if policy.frozen else 'past any device'}"
            )
        if ok and after.grown_bytes - before.grown_bytes < n:
            _fail(
                f"{policy!r}: grow({n}) returned True "
                f"but reserved {after.grown_bytes - before.grown_bytes} B"
            )
        if (after.live_bytes, after.allocated_bytes, after.num_allocs) != (
            before.live_bytes,
            before.allocated_bytes,
            before.num_allocs,
        ) or _holdings(self.live) != held:
            _fail(f"{policy!r}: grow({n}) changed live allocations")

    def fork(self) -> None:
        a = self.rng.choice(self.live)
        before = self.policy.stats()
        b = self.policy.fork(a)
        if b.extents != a.extents or self.policy.stats().allocated_bytes != before.allocated_bytes:
            _fail(f"{self.policy!r}: fork() made new pages or moved bytes")
        self.live.append(b)

    def bad_size(self) -> None:
        bad = self.rng.choice(BAD_SIZES)
        _expect_error(self.policy, lambda: self.policy.allocate(bad), f"allocate({bad!r})")

    def double_free(self) -> None:
        a = self.rng.choice(self.freed)
        _expect_error(self.policy, lambda: self.policy.free(a), "a double free")

    def reset(self) -> None:
        self.policy.reset()
        diff = _differences(self.fresh_stats, self.policy.stats())
        if diff:
            _fail(f"{self.policy!r}: after reset() the pool differs from a fresh one: {diff}")
        stale = self.live[:1]
        self.live, self.freed = [], []
        for a in stale:
            _expect_error(
                self.policy,
                lambda: self.policy.free(a),
                "free() of an allocation made before reset()",
            )


def soak(
    factory: PolicyFactory,
    num_ops: int,
    *,
    seed: int = 0,
    spec: str = "",
    episode_ops: int = 20_000,
    max_live: int = 160,
    max_messages: int = 5,
) -> SoakReport:
    """Run ``num_ops`` random operations against pools built by ``factory``, checking after each.

    Args:
        factory: ``factory(capacity_bytes=None, device=None) -> Policy`` (as for ``check_policy``).
        num_ops: operations in total, over every episode.
        seed: the run's seed; the same seed replays the same operations.
        spec: a name for the report (the policy's spec when empty).
        episode_ops: operations before a new pool (with a capacity drawn from ``SOAK_CAPACITIES``)
            is built; a violation also ends an episode.
        max_live: most allocations live at once.
        max_messages: violation messages kept in the report (all are counted).

    Returns:
        A ``SoakReport``; ``num_violations`` is 0 when every check held.
    """
    rng = random.Random(seed)
    report = SoakReport(spec=spec, seed=seed)
    start = time.perf_counter()
    done = 0
    while done < num_ops:
        episode_index = report.num_episodes
        report.num_episodes += 1
        episode = _Episode(factory, rng, rng.choice(SOAK_CAPACITIES), max_live)
        if not report.spec:
            report.spec = episode.policy.spec
        last_op = min(episode_ops, num_ops - done) - 1
        for op_index in range(last_op + 1):
            done += 1
            if op_index == last_op:
                episode.steps_to_recount = 1  # an episode ends on a full recount
            try:
                episode.step()
            except Exception as exc:  # noqa: BLE001 - any escape from a policy is a violation
                report.num_violations += 1
                if len(report.violations) < max_messages:
                    where = traceback.extract_tb(exc.__traceback__)[-1]
                    report.violations.append(
                        f"seed {seed}, episode {episode_index} (capacity {episode.capacity}), "
                        f"op {op_index}: {type(exc).__name__}: "
                        f"{exc} [{where.filename.rsplit('/', 1)[-1]}:{where.lineno}]"
                    )
                break
        report.num_failures += episode.num_failures
    report.num_ops = done
    report.seconds = time.perf_counter() - start
    return report
