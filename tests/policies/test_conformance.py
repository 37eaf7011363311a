"""The conformance suite: every registered policy (built-in, entry point or registered at run
time) passes ``policies.testing``'s battery and keeps its invariants under random operation
sequences. Also the suite's own tests: each check catches the bug it is there for."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import policies
from policies import registry, testing
from policies.base import Allocation
from policies.errors import PolicyError
from policies.testing import SegmentPerRequest, check_invariants
from policies.tlsf import TLSF

MiB = 1 << 20
#: registered at run time, the way a third-party package's policy would be
THIRD_PARTY = SegmentPerRequest.name


def _specs() -> list[str]:
    names = list(dict.fromkeys([*policies.available(), THIRD_PARTY]))
    # the elastic wrapper over every other policy, with knobs that make it act often
    wrapped = [f"elastic:base=[{n}],patience=2,grow_bytes=4MiB" for n in names if n != "elastic"]
    return names + wrapped


SPECS = _specs()


@pytest.fixture(scope="module", autouse=True)
def third_party_policy():
    registered = THIRD_PARTY not in policies.available()
    if registered:
        registry.register(THIRD_PARTY, SegmentPerRequest)
    yield
    if registered:
        registry.unregister(THIRD_PARTY)


def _factory(spec: str):
    return functools.partial(policies.create, spec)


@pytest.mark.parametrize("check", testing.POLICY_CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("spec", SPECS)
def test_policy_passes_check(spec, check):
    check(_factory(spec))


# ---------------------------------------------------------------------------- random sequences
_sizes = st.one_of(st.integers(1, 4096), st.integers(4097, 2 * MiB), st.integers(2 * MiB, 48 * MiB))


class PolicyMachine(RuleBasedStateMachine):
    """Random allocs, frees, bad requests, trims, grows and resets on one pool."""

    spec = ""

    def __init__(self):
        super().__init__()
        self.policy = None
        self.live: list[Allocation] = []

    @initialize(capacity=st.sampled_from([None, 96 * MiB, 512 * MiB]))
    def build(self, capacity):
        self.policy = policies.create(self.spec, capacity_bytes=capacity)

    @rule(nbytes=_sizes, stream=st.sampled_from([0, 0, 1]))
    def allocate(self, nbytes, stream):
        a = self.policy.allocate(nbytes, stream=stream)
        if a is None:
            assert self.policy.capacity_bytes is not None, (
                f"allocate({nbytes}) failed with no capacity limit"
            )
        else:
            assert (a.nbytes, a.stream) == (nbytes, stream)
            self.live.append(a)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 16))
    def free(self, i):
        self.policy.free(self.live.pop(i % len(self.live)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 16))
    def double_free(self, i):
        a = self.live.pop(i % len(self.live))
        self.policy.free(a)
        before = self.policy.stats()
        with pytest.raises(PolicyError):
            self.policy.free(a)
        assert self.policy.stats() == before

    @rule(bad=st.sampled_from(testing.BAD_SIZES))
    def bad_size(self, bad):
        before = self.policy.stats()
        with pytest.raises(PolicyError):
            self.policy.allocate(bad)
        assert self.policy.stats() == before

    @rule(max_bytes=st.none() | st.integers(0, 256 * MiB))
    def trim(self, max_bytes):
        before = self.policy.stats()
        released = self.policy.trim(max_bytes)
        after = self.policy.stats()
        assert released == before.reserved_bytes - after.reserved_bytes >= 0
        assert (after.allocated_bytes, after.num_live) == (before.allocated_bytes, before.num_live)

    @rule(nbytes=_sizes)
    def grow(self, nbytes):
        # a grow refused by capacity may first release free segments (the base's trim-and-retry,
        # see test_base.py), so check the new segment rather than the free bytes
        old = {s.offset for s in self.policy.segments()}
        ok = self.policy.grow(nbytes)
        new = [s for s in self.policy.segments() if s.offset not in old]
        if ok:
            assert any(s.nbytes >= nbytes and s.num_live == 0 for s in new), (
                f"grow({nbytes}) added no free segment"
            )
        else:
            assert self.policy.capacity_bytes is not None, (
                f"grow({nbytes}) refused with no capacity limit"
            )
            assert not new, f"a refused grow({nbytes}) reserved {new}"

    @rule()
    def reset(self):
        self.policy.reset()
        stale, self.live = self.live, []
        for a in stale[:1]:
            with pytest.raises(PolicyError):
                self.policy.free(a)

    @invariant()
    def invariants_hold(self):
        if self.policy is not None:
            check_invariants(self.policy, self.live)


@pytest.mark.parametrize("spec", SPECS)
def test_random_operation_sequences_keep_invariants(spec):
    machine = type("PolicyMachine", (PolicyMachine,), {"spec": spec})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=30,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# ---------------------------------------------------------------------------- the checks catch bugs
class _LeaksAllocatedBytes(SegmentPerRequest):
    def _free(self, allocation):
        super()._free(allocation)
        self.allocated_bytes += allocation.size_bytes


class _HandsOutOneRange(SegmentPerRequest):
    """Every allocation claims the first segment's range: live allocations overlap."""

    def _allocate(self, nbytes, stream, tag):
        a = super()._allocate(nbytes, stream, tag)
        if a is not None and self.segments():
            first = self.segments()[0]
            a.extents = ((first.offset, a.size_bytes),)
        return a


class _StaleSegmentCount(SegmentPerRequest):
    def _free(self, allocation):
        super()._free(allocation)
        allocation.handle.num_live = 1


class _ClaimsToCoalesce(SegmentPerRequest):
    """Says it coalesces, but reports each cached segment as two touching halves."""

    coalesces = True

    def free_extents(self):
        halves = []
        for off, n in super().free_extents():
            halves += [(off, n // 2), (off + n // 2, n - n // 2)] if n >= 1024 else [(off, n)]
        return halves


class _ReservesThenFails(SegmentPerRequest):
    """A refused request still leaves a small segment reserved."""

    def _allocate(self, nbytes, stream, tag):
        a = super()._allocate(nbytes, stream, tag)
        if a is None:
            seg = self._reserve_segment(4096, stream)
            if seg is not None:
                self._add_segment(seg)
        return a


class _RoundsFloats(SegmentPerRequest):
    def allocate(self, nbytes, **kw):
        return super().allocate(int(nbytes) if isinstance(nbytes, float) else nbytes, **kw)


class _ResetKeepsSegments(SegmentPerRequest):
    def reset(self):
        self._token = object()
        self._init_counters()
        self.reserved_bytes = sum(s.nbytes for s in self._segments.values())


class _Shares(SegmentPerRequest):
    """``fork(a)``: a second live allocation over the same segment (prefix sharing)."""

    def fork(self, a):
        a.handle.num_live += 1
        return self._hand_out(
            Allocation(a.nbytes, a.size_bytes, a.extents, a.stream, a.tag, a.handle)
        )

    def _free(self, allocation):
        seg = allocation.handle
        if seg.num_live > 1:
            seg.num_live -= 1
        else:
            super()._free(allocation)


class _ReportsShared(_Shares):
    def shared_extents(self):
        return [(s.offset, s.nbytes) for s in self.segments() if s.num_live > 1]


class _CachesReleasedSegments(SegmentPerRequest):
    """Releases free segments but keeps them cached (issue 11's arena bug in miniature)."""

    def _release_free_segments(self, max_bytes):
        cached = list(self._cached)
        released = super()._release_free_segments(max_bytes)
        self._cached[:] = cached
        return released


class _NeverReuses(SegmentPerRequest):
    """Reserves a new segment for every request (issue 11's tlsf bug in effect)."""

    def _allocate(self, nbytes, stream, tag):
        seg = self._reserve_segment(self._segment_size_for(nbytes), stream)
        if seg is None:
            return None
        seg.num_live = 1
        self.allocated_bytes += seg.nbytes
        return Allocation(nbytes, seg.nbytes, ((seg.offset, seg.nbytes),), stream, tag, seg)


class _NoSizeLimit(SegmentPerRequest):
    """Takes any request to the device, however large."""

    def _reset_state(self):
        super()._reset_state()
        self._max_request_bytes = 1 << 200


class _TouchesLiveOnFailure(SegmentPerRequest):
    """A refused request relabels the last allocation handed out."""

    _last = None

    def _allocate(self, nbytes, stream, tag):
        a = super()._allocate(nbytes, stream, tag)
        if a is not None:
            self._last = a
        elif self._last is not None:
            self._last.tag = "relabelled"
        return a


class _StatsWithoutGauges(SegmentPerRequest):
    """Overrides ``stats()`` (counts a segment twice) but not ``gauges()``, which monitors read."""

    def stats(self):
        s = super().stats()
        s.num_segments *= 2
        return s


class _BatchesInAnotherOrder(SegmentPerRequest):
    """A batched ``allocate_each`` that hands the loop's allocations out last first."""

    def allocate_each(self, nbytes, num_calls, *, stream=0, tag=None):
        return super().allocate_each(nbytes, num_calls, stream=stream, tag=tag)[::-1]


class _BatchedFreeSkipsDoubleFrees(SegmentPerRequest):
    """A batched ``free_each`` that passes over what is not live instead of raising."""

    def free_each(self, allocations):
        for a in allocations:
            if a.live:
                self.free(a)


class _BatchedFreeForgetsTheCount(SegmentPerRequest):
    """A batched ``free_each`` that frees through ``_free`` and counts nothing."""

    def free_each(self, allocations):
        for a in allocations:
            self._free(a)
            a.owner = None


@pytest.mark.parametrize(
    "broken, check, message",
    [
        (_LeaksAllocatedBytes, testing.check_random_workload, "allocated_bytes"),
        (_HandsOutOneRange, testing.check_allocation_fields, "overlap"),
        (_StaleSegmentCount, testing.check_random_workload, "num_live"),
        (_ClaimsToCoalesce, testing.check_random_workload, "touch"),
        (_ReservesThenFails, testing.check_capacity_refusal, "reserved memory"),
        (_RoundsFloats, testing.check_bad_sizes, "did not raise PolicyError"),
        (_ResetKeepsSegments, testing.check_reset, "differs from a fresh one"),
        (_CachesReleasedSegments, testing.check_release_and_retry, "outside"),
        (_NeverReuses, testing.check_same_size_reuse, "raised peak_reserved_bytes"),
        (_NoSizeLimit, testing.check_huge_request, "succeeded on a device"),
        (_TouchesLiveOnFailure, testing.check_capacity_refusal, "changed a live allocation"),
        (_StatsWithoutGauges, testing.check_allocation_fields, "gauges"),
        (_BatchesInAnotherOrder, testing.check_batched_calls, "another state than the loop"),
        (_BatchedFreeSkipsDoubleFrees, testing.check_batched_calls, "raised None, the loop"),
        (_BatchedFreeForgetsTheCount, testing.check_batched_calls, "another state than the loop"),
    ],
    ids=lambda x: getattr(x, "__name__", None) if callable(x) else None,
)
def test_check_catches_broken_policy(broken, check, message):
    with pytest.raises(AssertionError, match=message):
        check(broken)


def test_check_policy_names_the_failing_check():
    with pytest.raises(AssertionError, match="^check_allocation_fields: .*allocated_bytes"):
        testing.check_policy(_LeaksAllocatedBytes)


def test_reference_policy_passes_check_policy():
    testing.check_policy(SegmentPerRequest)


def test_overlap_is_refused_unless_the_pages_are_reported_shared():
    policy = _Shares()
    a = policy.allocate(4096)
    b = policy.fork(a)
    with pytest.raises(AssertionError, match="overlap"):
        check_invariants(policy, [a, b])


def test_shared_pages_may_overlap_and_count_once():
    policy = _ReportsShared()
    a = policy.allocate(4096)
    b = policy.fork(a)
    stats = check_invariants(policy, [a, b])
    assert (stats.allocated_bytes, stats.live_bytes) == (4096, 8192)


def test_invariants_need_every_live_allocation():
    policy = SegmentPerRequest()
    a = policy.allocate(4096)
    policy.allocate(4096)
    with pytest.raises(AssertionError, match="num_live"):
        check_invariants(policy, [a])


def test_invariants_refuse_a_freed_allocation_listed_live():
    policy = SegmentPerRequest()
    a = policy.allocate(4096)
    policy.free(a)
    with pytest.raises(AssertionError, match="was freed"):
        check_invariants(policy, [a])


class _AlignOnlyTLSF(TLSF):
    """tlsf before issue 11's fix: the request rounded to alignment only, not to its class."""

    def rounded_size(self, nbytes):
        return -(-nbytes // self.alignment_bytes) * self.alignment_bytes


def test_the_battery_catches_issue_11s_tlsf_bug():
    with pytest.raises(AssertionError, match="reusing 131072000 B"):
        testing.check_same_size_reuse(_AlignOnlyTLSF)


# ---------------------------------------------------------------------------- on a real pool
#: every registered policy (and the third-party one), on a real pool with validation (issue 29)
REAL_POOL_SPECS = list(dict.fromkeys([*policies.available(), THIRD_PARTY]))


@pytest.mark.parametrize("backend", ["host", "host-vmm"])
@pytest.mark.parametrize("spec", REAL_POOL_SPECS)
def test_policy_runs_on_a_real_pool(spec, backend):
    """``realgpu.GpuPool`` with validation, over the spec string and over a policy object: every
    byte written and checked in real (host) memory, the accounting equal to the model's."""
    from realgpu.pool import GpuPool

    testing.check_real_pool(
        lambda policy: GpuPool(policy, backend=backend, validate=True, guard_bytes=0), spec
    )
