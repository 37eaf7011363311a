"""Growth freeze (``Policy.freeze`` in policies/base.py): no segment grows, refusals counted."""

from __future__ import annotations

import random

import pytest

import policies
from policies.best_fit import BestFit
from policies.testing import check_invariants, random_size

KiB = 1 << 10
MiB = 1 << 20


def warm(p, sizes=(100 * KiB, 200 * KiB)):
    return [p.allocate(n) for n in sizes]


def test_a_request_that_fits_reserved_memory_still_succeeds():
    p = BestFit(segment_bytes=MiB)
    warm(p)
    p.freeze()
    assert p.frozen and p.allocate(300 * KiB) is not None
    assert p.stats().num_frozen_failures == 0


def test_a_request_that_needs_a_grow_fails_and_is_counted():
    p = BestFit(segment_bytes=MiB)
    warm(p)
    p.freeze()
    before = p.stats()
    assert p.allocate(2 * MiB) is None
    s = p.stats()
    assert (s.num_failures, s.num_frozen_failures, s.num_grows, s.reserved_bytes) == (
        1,
        1,
        before.num_grows,
        before.reserved_bytes,
    )


def test_capacity_failures_before_the_freeze_are_not_frozen_failures():
    p = BestFit(segment_bytes=MiB, capacity_bytes=MiB)
    warm(p)
    assert p.allocate(2 * MiB) is None
    assert (p.stats().num_failures, p.stats().num_frozen_failures) == (1, 0)


def test_grow_is_refused_and_is_no_failure():
    p = BestFit(segment_bytes=MiB)
    p.freeze()
    assert not p.grow(MiB)
    assert p.allocate(4 * KiB) is None  # nothing reserved: the next request needs a grow
    assert (p.stats().num_failures, p.stats().num_frozen_failures) == (1, 1)


def test_a_refusal_does_not_release_free_segments():
    p = BestFit(segment_bytes=MiB, capacity_bytes=2 * MiB)
    keep = warm(p, [512 * KiB])
    p.grow(MiB)  # a fully free segment: an unfrozen pool would release it to retry
    p.freeze()
    assert p.allocate(MiB + 1) is None and p.stats().reserved_bytes == 2 * MiB
    check_invariants(p, keep)


def test_unfreeze_allows_grows_again():
    p = BestFit(segment_bytes=MiB)
    p.freeze()
    p.unfreeze()
    assert not p.frozen and p.allocate(2 * MiB) is not None


def test_reset_unfreezes_and_clears_the_count():
    p = BestFit(segment_bytes=MiB)
    p.freeze()
    p.allocate(4 * KiB)
    p.reset()
    assert not p.frozen and p.stats().num_frozen_failures == 0


def test_a_wrapper_freezes_its_base_and_counts_one_failure_per_request():
    e = policies.create("elastic:base=[best-fit:segment_bytes=1MiB],high=1.0")
    warm(e)
    e.freeze()
    assert e.base_policy.frozen
    assert e.allocate(2 * MiB) is None
    assert (e.stats().num_failures, e.stats().num_frozen_failures) == (1, 1)


def test_a_frozen_elastic_pool_does_not_trim():
    e = policies.create("elastic:base=[best-fit:segment_bytes=1MiB],high=1.0,patience=1,low=0.5")
    live = [e.allocate(MiB) for _ in range(4)]
    e.freeze()
    for a in live:
        e.free(a)
    assert e.stats().reserved_bytes == 4 * MiB and e.num_unmaps == 0


def test_tag_limit_refusals_are_not_frozen_failures():
    p = policies.create("tag-limits:base=[best-fit],limits=[kv=1MiB]")
    p.freeze()
    assert p.allocate(2 * MiB, tag="kv") is None
    assert (p.stats().num_failures, p.stats().num_frozen_failures) == (1, 0)


@pytest.mark.parametrize(
    "spec", [n for n in policies.available()] + ["elastic:base=[paged]", "compacting"]
)
def test_every_policy_stops_growing_once_frozen(spec):
    rng = random.Random(7)
    p = policies.create(spec)
    live = [a for a in (p.allocate(random_size(rng)) for _ in range(30)) if a is not None]
    for a in live[::2]:
        p.free(a)
    live = live[1::2]
    p.freeze()
    frozen = p.stats()
    for _ in range(60):
        if live and rng.random() < 0.4:
            p.free(live.pop(rng.randrange(len(live))))
        else:
            a = p.allocate(random_size(rng))
            if a is not None:
                live.append(a)
        s = check_invariants(p, live)
        assert s.num_grows == frozen.num_grows and s.reserved_bytes <= frozen.reserved_bytes
    assert p.allocate(4 << 30) is None  # more than any pool here holds
    s = p.stats()
    # no capacity limit: every refusal once frozen is one the freeze caused
    assert s.num_frozen_failures == s.num_failures - frozen.num_failures > 0


@pytest.mark.parametrize(
    "spec",
    [n for n in policies.available()]
    + ["torch-caching:garbage_collection_threshold=0.5", "elastic:base=[torch-caching]"],
)
def test_no_policy_releases_memory_to_serve_a_frozen_request(spec):
    # found by the soak: torch-caching emptied its cache (and ran GC) before failing a frozen
    # request
    p = policies.create(spec, capacity_bytes=1 << 30)
    keep = warm(p)
    p.free(p.allocate(40 * MiB))  # a fully free segment an unfrozen pool would release to retry
    p.freeze()
    before = p.stats()
    assert p.allocate(900 * MiB) is None
    after = check_invariants(p, keep)
    assert (after.reserved_bytes, after.num_shrinks) == (before.reserved_bytes, before.num_shrinks)
