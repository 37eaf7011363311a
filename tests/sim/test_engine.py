"""The one replay loop: what it times, when it observes, how it reads driver time."""

import numpy as np
import pytest

import policies
from policies.device import DriverClock, UnmodelledDriver, VirtualDevice
from sim import engine
from sim.costs import CostedDevice, CostModel
from sim.metrics import PoolMonitor
from traces.events import AllocTrace, make_events
from sim.replay import trace_events

MiB = 1 << 20


def _unknown(i, key):
    return KeyError(f"event {i}: {key}")


def _random_trace(num_events, seed=0):
    rng = np.random.default_rng(seed)
    ops, ids, sizes, live, next_id = [], [], [], [], 0
    while len(ops) < num_events:
        if live and rng.random() < 0.45:
            i, n = live.pop(int(rng.integers(len(live))))
            ops.append("free"), ids.append(i), sizes.append(n)
        else:
            n = int(rng.integers(1, 2 * MiB))
            live.append((next_id, n))
            ops.append("alloc"), ids.append(next_id), sizes.append(n)
            next_id += 1
    return AllocTrace(make_events(range(len(ops)), ops, ids, sizes), name="random")


class TickTimer:
    """A clock that advances 10 ns a read: every call then measures exactly 10 ns."""

    def __init__(self):
        self.now = 0

    def __call__(self):
        self.now += 10
        return self.now


@pytest.mark.parametrize("every", [1, 3, 7, 1000])
def test_sampling_at_chunk_ends_takes_the_samples_observe_takes(every):
    ev = trace_events(_random_trace(500))
    tables = []
    for per_event in (True, False):
        policy = policies.create("best-fit")
        monitor = PoolMonitor(policy, sample_every=every)
        engine.run(ev.ops, ev.keys, ev.sizes, times_us=ev.times_us, target=engine.policy_target(policy),
                   observe=monitor.observe if per_event else monitor.sample,
                   observe_every=1 if per_event else every, unknown_free=_unknown)
        monitor.finish(len(ev.ops) - 1, ev.times_us[-1])
        tables.append(monitor.timeseries())
    assert tables[0].equals(tables[1])
    assert tables[0]["event"].tolist()[:2] == [0, min(every, 499)]


def test_latency_is_call_time_plus_the_driver_time_it_caused():
    costs = CostModel.load()
    policy = policies.create("first-fit:segment_bytes=8MiB", device=CostedDevice(costs))
    run = engine.run([engine.ALLOC, engine.ALLOC, engine.FREE, engine.FREE], [1, 2, 1, 2], [1000] * 4,
                     target=engine.policy_target(policy), unknown_free=_unknown, timer=TickTimer())
    assert run.alloc_ns.tolist() == [10 + costs.malloc_ns(8 * MiB), 10]
    assert run.free_ns.tolist() == [10, 10]
    assert run.alloc_ns.dtype == np.int64


class CustomDriver(UnmodelledDriver):
    """A device type the engine does not know: driver time only through ``take_driver_ns``."""

    def __init__(self):
        self.inner = VirtualDevice()
        self.pending = 0

    def reserve(self, nbytes):
        self.pending += 7
        return self.inner.reserve(nbytes)

    def release(self, offset, nbytes):
        self.inner.release(offset, nbytes)

    def take_driver_ns(self):
        ns, self.pending = self.pending, 0
        return ns


def test_driver_clock_is_read_only_off_devices_known_to_keep_one():
    assert engine.policy_target(policies.create("paged", device=CostedDevice())).driver_clock is not None
    assert isinstance(engine.policy_target(policies.create("paged")).driver_clock, DriverClock)  # never charged
    custom = CustomDriver()
    policy = policies.create("first-fit:segment_bytes=8MiB", device=custom)
    target = engine.policy_target(policy)
    assert target.driver_clock is None  # its take_driver_ns is its own: called after every call
    custom.pending = 100  # accrued before the run: belongs to no call
    run = engine.run([engine.ALLOC, engine.FREE], [1, 1], [1000, 1000], target=target, unknown_free=_unknown,
                     timer=TickTimer())
    assert run.alloc_ns.tolist() == [10 + 7]


class Handle:
    """A handle whose release is its last reference going (a CuPy pointer, a torch tensor)."""

    def __init__(self, log, timer):
        self.log, self.timer = log, timer

    def __del__(self):
        self.log.append(self.timer.now)


def test_a_dropping_target_frees_inside_the_timed_region():
    timer, log = TickTimer(), []
    target = engine.Target(allocate=lambda nbytes: Handle(log, timer), free=None, sized_only=True)
    run = engine.run([engine.ALLOC, engine.FREE], [1, 1], [64, 64], target=target, unknown_free=_unknown,
                     timer=timer)
    assert log == [30]  # between the free's two clock reads (20: after the alloc; 30, 40: the free)
    assert run.free_ns.tolist() == [10] and not run.live


def test_an_empty_stream_and_a_refusal_oom():
    class Oom(Exception):
        pass

    def refuse(nbytes):
        raise Oom

    target = engine.Target(allocate=refuse, free=lambda h: None, oom_errors=(Oom,), sized_only=True)
    run = engine.run([engine.ALLOC, engine.FREE], [5, 5], [64, 64], target=target, unknown_free=_unknown)
    assert run.num_failed == 1 and run.alloc_ns.size == 1 and run.free_ns.size == 0
    empty = engine.run([], [], [], target=target, unknown_free=_unknown, observe=lambda i, t: None,
                       observe_every=4)
    assert empty.alloc_ns.size == 0 and empty.free_ns.size == 0


def test_observe_every_must_be_positive():
    with pytest.raises(ValueError, match="observe_every"):
        engine.run([], [], [], target=engine.Target(allocate=int, free=None), unknown_free=_unknown,
                   observe_every=0)
