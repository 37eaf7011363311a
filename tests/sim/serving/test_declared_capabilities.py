"""The simulator's fast paths follow what a policy or a device declares, never its concrete type.

- a pool that counts its free pages (``Policy.counts_free_pages``) lets the serving simulator's
  quiet decode runs take pages at page boundaries (``Server._page_grows``); one that does not
  gets the engine's own step there. Both give the step-by-step results exactly.
- a device that declares its ``DriverClock`` (``Device.driver_clock``) has its pending time read
  off the clock by the replay loop; one that does not is asked through ``take_driver_ns``. Both
  give the same samples.
"""

import pytest

import policies
from policies.device import NO_DRIVER_TIME, DriverClock, UnmodelledDriver, VirtualDevice
from policies.mapped_device import PageMappedDevice
from policies.paged import Paged
from sim.replay import engine
from sim.replay.costs import CostedDevice, CostModel, costed_page_mapped_device
from tests.sim.replay.test_engine import TickTimer, _unknown
from tests.sim.serving.test_step_fast_path import AZURE, assert_same_results
from tests.sim.serving.test_step_fast_path import run as simulate_once
from traces.request_readers import read_request_trace

MiB = 1 << 20


class ThirdPartyPaged(Paged):
    """A third party's paged pool: ``Paged``'s pages under another class, declaring what it
    inherits."""

    name = "third-party-paged"


class UncountedPaged(Paged):
    """A paged pool that does not promise its free pages (as one that evicts or maps on allocation
    would)."""

    name = "uncounted-paged"
    counts_free_pages = False


@pytest.fixture(scope="module")
def azure():
    return read_request_trace(AZURE)


@pytest.fixture
def registered():
    for cls in (ThirdPartyPaged, UncountedPaged):
        policies.registry.register(cls.name, cls, replace=True)
    yield
    for cls in (ThirdPartyPaged, UncountedPaged):
        policies.registry.unregister(cls.name)


def test_a_policy_declaring_its_free_page_count_gets_page_grows_in_quiet_runs(azure, registered):
    slow_server, slow = simulate_once(azure, ThirdPartyPaged.name, False)
    fast_server, fast = simulate_once(azure, ThirdPartyPaged.name, True)
    assert (
        fast_server._page_grows is fast_server.pools.kv.policy
    )  # by its declaration, not its type
    assert fast_server.num_steps == slow_server.num_steps
    assert_same_results(slow, fast)
    _, uncounted = simulate_once(azure, UncountedPaged.name, True)
    paged_server, _ = simulate_once(azure, "paged", True)
    # the same pages taken inside the quiet runs as the built-in paged pool's: more steps in closed
    # form
    assert fast_server.num_quiet_steps == paged_server.num_quiet_steps


def test_a_policy_without_the_declaration_takes_the_engines_step_at_page_boundaries(
    azure, registered
):
    slow_server, slow = simulate_once(azure, UncountedPaged.name, False)
    fast_server, fast = simulate_once(azure, UncountedPaged.name, True)
    assert fast_server._page_grows is None
    assert 0 < fast_server.num_quiet_steps
    counted_server, _ = simulate_once(azure, ThirdPartyPaged.name, True)
    assert (
        fast_server.num_quiet_steps < counted_server.num_quiet_steps
    )  # the boundaries end its quiet runs
    assert_same_results(slow, fast)


def test_counting_free_pages_is_declared_not_guessed():
    assert (
        policies.create("paged").counts_free_pages
        and policies.create("paged").num_free_pages() == 0
    )
    for spec in ("best-fit", "page-pool", "elastic:base=[paged]", "tag-limits:base=[paged]"):
        policy = policies.create(spec)
        assert not policy.counts_free_pages, (
            spec
        )  # a wrapper's rules may refuse what its base would serve
        with pytest.raises(policies.PolicyError, match="does not count free pages"):
            policy.num_free_pages()


def test_granting_pages_is_declared_and_not_forwarded():
    """Only a pool that declares ``grants_pages`` hands out page grants (the quiet runs' KV
    pages: ``Target.allocate_pages``); a wrapper over one does not (its own counters would miss
    them), and its timed calls then take the allocations."""
    paged = policies.create("paged")
    assert paged.grants_pages and engine.policy_target(paged).allocate_pages is not None
    for spec in ("best-fit", "page-pool", "elastic:base=[paged]", "tag-limits:base=[paged]"):
        policy = policies.create(spec)
        assert not policy.grants_pages, spec
        assert engine.policy_target(policy).allocate_pages is None, spec
        assert engine.TimedCalls(engine.policy_target(policy)).allocate_pages(100, 1) is None
        with pytest.raises(policies.PolicyError, match="does not grant pages"):
            policy.allocate_pages(100, 1)


# ------------------------------------------------------------------ driver clocks
class _ChargingDevice:
    """A third party's device, no base class of ours: 7 ns pending per reserve, 3 per release."""

    max_bytes = 1 << 40

    def __init__(self):
        self.inner = VirtualDevice()
        self.pending_ns = self.total_ns = 0

    def _charge(self, ns):
        self.pending_ns += ns
        self.total_ns += ns

    def reserve(self, nbytes):
        self._charge(7)
        return self.inner.reserve(nbytes)

    def release(self, offset, nbytes):
        self._charge(3)
        self.inner.release(offset, nbytes)

    def take_driver_ns(self):
        ns, self.pending_ns = self.pending_ns, 0
        return ns

    @property
    def driver_ns_total(self):
        return self.total_ns

    def copy_ns(self, nbytes):
        return 0

    def call_stats(self):
        return {}


class ClockedDevice(_ChargingDevice):
    """The same device keeping its pending time in a ``DriverClock`` it declares."""

    def __init__(self):
        super().__init__()
        self.driver_clock = DriverClock()

    def _charge(self, ns):
        self.driver_clock.charge(ns, pending=True)

    def take_driver_ns(self):
        return self.driver_clock.take()

    @property
    def driver_ns_total(self):
        return self.driver_clock.total_ns


def _replay(device, share):
    policy = policies.create("first-fit:segment_bytes=2MiB", device=device, capacity_bytes=64 * MiB)
    n = 600
    ops = [engine.ALLOC] * (n // 2) + [engine.FREE] * (n // 2)
    keys = list(range(n // 2)) * 2
    sizes = [(k % 7 + 1) * 300_000 for k in keys]
    target = engine.policy_target(policy)
    run = engine.run(
        ops,
        keys,
        sizes,
        target=target,
        unknown_free=_unknown,
        timer=TickTimer(),
        latency_sample=share,
    )
    return target, run, device


@pytest.mark.parametrize("share", [1.0, 0.4])
def test_a_third_party_device_declaring_its_clock_is_read_off_the_clock(share):
    target, clocked, dev = _replay(ClockedDevice(), share)
    assert (
        target.driver_clock is dev.driver_clock
    )  # the declaration, for a type the engine never heard of
    _, plain_target_run, plain = _replay(_ChargingDevice(), share)
    assert dev.driver_ns_total == plain.driver_ns_total > 0
    assert clocked.alloc_ns.tolist() == plain_target_run.alloc_ns.tolist()
    assert clocked.free_ns.tolist() == plain_target_run.free_ns.tolist()
    assert (
        max(clocked.alloc_ns) > 10 and not dev.driver_clock.pending_ns
    )  # samples carry driver time; all drained


def test_a_device_without_the_declaration_is_asked_through_take_driver_ns():
    target, run, dev = _replay(_ChargingDevice(), 1.0)
    assert target.driver_clock is None
    assert (
        sum(run.alloc_ns) + sum(run.free_ns) - 10 * (len(run.alloc_ns) + len(run.free_ns))
        == dev.driver_ns_total
    )


class OwnTake(UnmodelledDriver):
    """A subclass that takes driver time its own way: the inherited clock must not stand for it."""

    def reserve(self, nbytes):
        return 0

    def release(self, offset, nbytes):
        pass

    def take_driver_ns(self):
        return 5


def test_every_built_in_device_declares_the_clock_its_take_driver_ns_takes_from():
    costed = CostedDevice(CostModel.load())
    assert costed.driver_clock is costed.clock
    assert VirtualDevice().driver_clock is NO_DRIVER_TIME
    mapped = costed_page_mapped_device()
    assert mapped.driver_clock is mapped.clock
    assert (
        PageMappedDevice(physical=CostedDevice()).driver_clock is None
    )  # two clocks: only the call knows
    assert OwnTake().driver_clock is None and OwnTake().take_driver_ns() == 5
