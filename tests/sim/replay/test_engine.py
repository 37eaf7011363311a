"""The one replay loop: what it times, when it observes, how it reads driver time."""

import numpy as np
import pytest

import policies
from policies.device import DriverClock, UnmodelledDriver, VirtualDevice
from sim.replay import engine
from sim.replay.costs import CostedDevice, CostModel
from sim.replay.metrics import PoolMonitor
from traces.events import AllocTrace, make_events
from sim.replay.trace_replay import trace_events

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
        engine.run(
            ev.ops,
            ev.keys,
            ev.sizes,
            times_us=ev.times_us,
            target=engine.policy_target(policy),
            observe=monitor.observe if per_event else monitor.sample,
            observe_every=1 if per_event else every,
            unknown_free=_unknown,
        )
        monitor.finish(len(ev.ops) - 1, ev.times_us[-1])
        tables.append(monitor.timeseries())
    assert tables[0].equals(tables[1])
    assert tables[0]["event"].tolist()[:2] == [0, min(every, 499)]


def test_latency_is_call_time_plus_the_driver_time_it_caused():
    costs = CostModel.load()
    policy = policies.create("first-fit:segment_bytes=8MiB", device=CostedDevice(costs))
    run = engine.run(
        [engine.ALLOC, engine.ALLOC, engine.FREE, engine.FREE],
        [1, 2, 1, 2],
        [1000] * 4,
        target=engine.policy_target(policy),
        unknown_free=_unknown,
        timer=TickTimer(),
    )
    assert run.alloc_ns.tolist() == [10 + costs.malloc_ns(8 * MiB), 10]
    assert run.free_ns.tolist() == [10, 10]
    assert run.alloc_ns.dtype == np.int64


def test_a_page_mapped_device_over_a_costed_one_charges_the_physical_time_to_its_call():
    """A VMM policy handed a ``CostedDevice`` maps pages whose physical memory that device
    reserves (and charges): the sample of the call that caused it carries it, as
    ``take_driver_ns`` of the page-mapped device reports it."""
    costs = CostModel.load()
    policy = policies.create("vmm-stitch", device=CostedDevice(costs))
    assert policy.device.physical is not None
    target = engine.policy_target(policy)
    assert target.driver_clock is None  # two clocks behind one take_driver_ns: call it
    run = engine.run(
        [engine.ALLOC, engine.ALLOC, engine.FREE, engine.FREE],
        [1, 2, 1, 2],
        [3 * MiB, 1000, 0, 0],
        target=target,
        unknown_free=_unknown,
        timer=TickTimer(),
    )
    driver_ns = [
        n - 10 for n in run.alloc_ns.tolist() + run.free_ns.tolist()
    ]  # every call timed (4 events)
    assert driver_ns[0] > 0 and sum(driver_ns) == policy.device.driver_ns_total


class CustomDriver(UnmodelledDriver):
    """A device taking driver time its own way, declaring no clock: driver time only through
    ``take_driver_ns``."""

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


def test_driver_clock_is_read_only_off_devices_that_declare_one():
    assert (
        engine.policy_target(policies.create("paged", device=CostedDevice())).driver_clock
        is not None
    )
    assert isinstance(
        engine.policy_target(policies.create("paged")).driver_clock, DriverClock
    )  # never charged
    custom = CustomDriver()
    policy = policies.create("first-fit:segment_bytes=8MiB", device=custom)
    target = engine.policy_target(policy)
    assert target.driver_clock is None  # its take_driver_ns is its own: called after every call
    custom.pending = 100  # accrued before the run: belongs to no call
    run = engine.run(
        [engine.ALLOC, engine.FREE],
        [1, 1],
        [1000, 1000],
        target=target,
        unknown_free=_unknown,
        timer=TickTimer(),
    )
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
    run = engine.run(
        [engine.ALLOC, engine.FREE],
        [1, 1],
        [64, 64],
        target=target,
        unknown_free=_unknown,
        timer=timer,
    )
    assert log == [30]  # between the free's two clock reads (20: after the alloc; 30, 40: the free)
    assert run.free_ns.tolist() == [10] and not run.live


def test_an_empty_stream_and_a_refusal_oom():
    class Oom(Exception):
        pass

    def refuse(nbytes):
        raise Oom

    target = engine.Target(allocate=refuse, free=lambda h: None, oom_errors=(Oom,), sized_only=True)
    run = engine.run(
        [engine.ALLOC, engine.FREE], [5, 5], [64, 64], target=target, unknown_free=_unknown
    )
    assert run.num_failed == 1 and run.alloc_ns.size == 1 and run.free_ns.size == 0
    empty = engine.run(
        [], [], [], target=target, unknown_free=_unknown, observe=lambda i, t: None, observe_every=4
    )
    assert empty.alloc_ns.size == 0 and empty.free_ns.size == 0


def test_observe_every_must_be_positive():
    with pytest.raises(ValueError, match="observe_every"):
        engine.run(
            [],
            [],
            [],
            target=engine.Target(allocate=int, free=None),
            unknown_free=_unknown,
            observe_every=0,
        )


def test_latency_sample_mask_is_seeded_uniform_and_none_for_every_call():
    mask = engine.latency_sample_mask(200_000, 0.1)
    assert mask == engine.latency_sample_mask(200_000, 0.1)  # the same events every run
    assert len(mask) == 200_000 and set(mask) == {0, 1}
    assert abs(sum(mask) / 200_000 - 0.1) < 0.005
    # uniform along the trace: no stride a periodic trace could alias (each tenth within 10 %)
    tenths = [sum(mask[k * 20_000 : (k + 1) * 20_000]) for k in range(10)]
    assert max(tenths) < 1.1 * 2_000 and min(tenths) > 0.9 * 2_000
    assert engine.latency_sample_mask(10, 1.0) is None
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="latency_sample"):
            engine.latency_sample_mask(10, bad)


def test_default_latency_sample_times_every_call_of_a_short_run_and_about_20k_of_a_long_one():
    assert engine.default_latency_sample(engine.LATENCY_SAMPLE_CALLS) == 1.0
    assert engine.default_latency_sample(10 * engine.LATENCY_SAMPLE_CALLS) == pytest.approx(0.1)


class EventStampTimer:
    """A clock whose first read in an event is 0 and second is the event's index times 10**12:
    a latency sample then reads as (event index, driver time of that call)."""

    def __init__(self):
        self.event, self.reads = 0, 0

    def before(self, i):
        self.event, self.reads = i, 0

    def __call__(self):
        self.reads += 1
        return 0 if self.reads == 1 else self.event * 10**12


class CallStampTimer:
    """``EventStampTimer`` for the tight loop, which has no ``before`` hook: the target's wrapped
    calls walk the events as the engine does (a free of a refused allocation makes no call) and
    set the event; the clock's reads come in pairs, 0 then the event index times 10**12."""

    def __init__(self, ev):
        self.ops, self.keys = ev.ops, ev.keys
        self.event = self.next = self.reads = 0
        self.refused = set()

    def __call__(self):
        self.reads += 1
        return 0 if self.reads % 2 else self.event * 10**12

    def _at_next_call(self):
        j = self.next
        while self.ops[j] == engine.FLUSH or (
            self.ops[j] == engine.FREE and self.keys[j] in self.refused
        ):
            j += 1
        self.event, self.next = j, j + 1

    def wrap(self, target):
        allocate, free = target.allocate, target.free

        def stamped_allocate(nbytes, stream=0, tag=None):
            self._at_next_call()
            a = allocate(nbytes, stream=stream, tag=tag)
            if a is None:
                self.refused.add(self.keys[self.event])
            return a

        def stamped_free(a):
            self._at_next_call()
            free(a)

        target.allocate, target.free = stamped_allocate, stamped_free
        return target


@pytest.mark.parametrize("loop", ["general", "tight"])
def test_a_sampled_run_times_the_chosen_calls_each_with_its_own_driver_time(loop):
    """Every event still runs (same pool state); the timed calls are exactly the chosen events
    (refused allocations included, frees of refused ones skipped), and each sample carries the
    driver time of its own call: an untimed call's never leaks into the next timed one. Both
    loops of ``run``: the general one (a ``before`` hook) and the tight one."""
    ev = trace_events(_random_trace(3000, seed=3))
    samples, pools, failed = {}, {}, {}
    for share in (1.0, 0.3):
        policy = policies.create(
            "first-fit:segment_bytes=4MiB",
            device=CostedDevice(CostModel.load()),
            capacity_bytes=64 * MiB,
        )
        target = engine.policy_target(policy)
        if loop == "general":
            timer = EventStampTimer()
            hooks = {"before": timer.before}
        else:
            timer = CallStampTimer(ev)
            target, hooks = timer.wrap(target), {}
        assert engine._tight_loop_serves(
            target, before=hooks.get("before"), on_alloc=None, on_free=None, every_event=None
        ) == (loop == "tight")
        run = engine.run(
            ev.ops,
            ev.keys,
            ev.sizes,
            target=target,
            unknown_free=_unknown,
            timer=timer,
            latency_sample=share,
            **hooks,
        )
        assert (
            policy.device.clock.pending_ns == 0
        )  # every call's driver time drained, sampled or not
        samples[share] = {
            op: dict(divmod(int(ns), 10**12) for ns in arr)
            for op, arr in (("alloc", run.alloc_ns), ("free", run.free_ns))
        }
        pools[share], failed[share] = policy.stats().as_dict(), run.num_failed
        assert run.num_frees == policy.num_frees  # every free counted, timed or not
    assert pools[1.0] == pools[0.3] and failed[1.0] == failed[0.3] > 0  # refusals happen
    full, part = samples[1.0], samples[0.3]
    assert max(full["alloc"].values()) > 0  # some calls cost driver time
    mask = engine.latency_sample_mask(len(ev.ops), 0.3)
    for op in ("alloc", "free"):
        assert set(part[op]) == {i for i in full[op] if mask[i]}  # the chosen events, no others
        assert part[op] == {i: full[op][i] for i in part[op]}  # each with its own driver time
    assert 0.2 < len(part["alloc"]) / len(full["alloc"]) < 0.4


def test_a_replay_reports_the_share_of_calls_it_timed():
    from sim.replay.trace_replay import replay

    trace = _random_trace(3000, seed=4)
    rows = {
        share: replay(trace, "best-fit", latency_sample=share).summary
        for share in (None, 1.0, 0.25)
    }
    assert (
        rows[None]["latency_sampled_frac"] == rows[1.0]["latency_sampled_frac"] == 1.0
    )  # short: every call
    assert 0.2 < rows[0.25]["latency_sampled_frac"] < 0.3
    timing = {
        "alloc_p50_us",
        "alloc_p99_us",
        "free_p50_us",
        "free_p99_us",
        "latency_sampled_frac",
        "wall_s",
    }
    assert {k: v for k, v in rows[0.25].items() if k not in timing} == {
        k: v for k, v in rows[1.0].items() if k not in timing
    }


def _trace_with_flushes(num_events, seed):
    """A random trace's events with ``FLUSH`` ops spread through them (every ~50 events)."""
    ev = trace_events(_random_trace(num_events, seed=seed))
    rng = np.random.default_rng(seed)
    ops, keys, sizes, times_us = [], [], [], []
    for op, key, nbytes, t in zip(ev.ops, ev.keys, ev.sizes, ev.times_us):
        if rng.random() < 0.02:
            ops.append(engine.FLUSH), keys.append(-1), sizes.append(0), times_us.append(t)
        ops.append(op), keys.append(key), sizes.append(nbytes), times_us.append(t)
    return ops, keys, sizes, times_us


@pytest.mark.parametrize("device", ["clock", "custom"])
@pytest.mark.parametrize("share", [1.0, 0.3])
def test_the_tight_loop_replays_exactly_as_the_general_one(share, device):
    """The tight loop (a policy, no per-event hook) and the general one (here a no-op ``before``
    hook) give the same samples, refusals, frees, flushes, live map, pool, monitor time series and
    driver-time totals, on a trace with refusals and ``empty_cache`` flushes: on a device whose
    ``DriverClock`` the engine reads, and on one it knows only by ``take_driver_ns``."""
    ops, keys, sizes, times_us = _trace_with_flushes(4000, seed=5)
    streams = [k % 3 for k in range(len(ops))]
    tags = [("kv" if k % 5 else None) for k in range(len(ops))]
    outcomes = []
    for before in (None, lambda i: None):
        dev = CostedDevice(CostModel.load()) if device == "clock" else CustomDriver()
        policy = policies.create("torch-caching", device=dev, capacity_bytes=96 * MiB)
        assert (engine.policy_target(policy).driver_clock is None) == (device == "custom")
        monitor = PoolMonitor(policy, sample_every=7)
        run = engine.run(
            ops,
            keys,
            sizes,
            streams=streams,
            tags=tags,
            times_us=times_us,
            target=engine.policy_target(policy),
            observe=monitor.sample,
            observe_every=7,
            before=before,
            unknown_free=_unknown,
            timer=TickTimer(),
            latency_sample=share,
        )
        monitor.finish(len(ops) - 1, times_us[-1])
        outcomes.append(
            {
                "alloc_ns": run.alloc_ns.tolist(),
                "free_ns": run.free_ns.tolist(),
                "counts": (run.num_failed, run.num_frees, run.num_flushes),
                "live": sorted(run.live),
                "pool": policy.stats().as_dict(),
                "timeseries": monitor.timeseries(),
                "driver": (
                    (dev.driver_ns_total, dev.clock.pending_ns)
                    if device == "clock"
                    else (dev.pending,)
                ),
                "calls": policy.device.call_stats(),
            }
        )
    tight, general = outcomes
    assert tight["counts"][0] > 0 and tight["counts"][2] > 0  # refusals and flushes happen
    assert (
        max(tight["alloc_ns"]) > 10 and not tight["driver"][-1]
    )  # samples carry driver time; all drained
    assert tight["timeseries"].equals(general.pop("timeseries"))
    del tight["timeseries"]
    assert tight == general


def test_the_tight_loop_names_the_event_of_an_unknown_free():
    policy = policies.create("best-fit")
    ops = [engine.ALLOC, engine.FREE, engine.ALLOC, engine.FREE, engine.FREE]
    for share in (
        1.0,
        0.3,
    ):  # the double free timed, then untimed (the mask at 0.3 is 0, 0, 0, 1, 0)
        with pytest.raises(KeyError, match="event 4: 7"):
            engine.run(
                ops,
                [7, 7, 8, 8, 7],
                [64] * 5,
                target=engine.policy_target(policy),
                unknown_free=_unknown,
                latency_sample=share,
            )


@pytest.mark.parametrize(
    "device", [lambda: CostedDevice(CostModel.load()), CustomDriver], ids=["clock", "take"]
)
def test_calls_made_in_one_go_are_timed_each_as_one_call(device):
    """``allocate_each``/``free_each`` (the serving simulator's page grows and a finished
    request's pages) of a policy with no batched calls of its own: the same handles, samples
    and driver time as one ``allocate``/``free`` per call, with a clock or with
    ``take_driver_ns`` only."""
    results = []
    for each in (False, True):
        policy = policies.create("size-class", device=device())
        alloc_ns, free_ns = [], []
        calls = engine.TimedCalls(
            engine.policy_target(policy), timer=TickTimer(), alloc_ns=alloc_ns, free_ns=free_ns
        )
        if each:
            handles = calls.allocate_each(3 * MiB, 5, "kv")
        else:
            handles = [calls.allocate(3 * MiB, 0, "kv") for _ in range(5)]
        extents = [h.extents for h in handles]
        pending = calls.take_driver_ns()
        if each:
            calls.free_each(handles[::-1])
        else:
            for h in handles[::-1]:
                calls.free(h)
        results.append((extents, alloc_ns, free_ns, pending, policy.stats().num_frees))
    assert results[0] == results[1]
    extents, alloc_ns, free_ns, pending, num_frees = results[1]
    assert len(alloc_ns) == 5 and free_ns == [10] * 5 and num_frees == 5
    assert pending > 0 and sum(alloc_ns) == 50 + pending  # each grow's driver time on its call


@pytest.mark.parametrize(
    "device", [lambda: CostedDevice(CostModel.load()), CustomDriver], ids=["clock", "take"]
)
def test_a_policys_own_batched_call_is_timed_as_one_call_split_evenly(device):
    """Paged overrides ``allocate_each``/``free_each`` (a fused page loop): ``TimedCalls`` makes
    one call to it, timed once, and splits the time (with the driver time it left) evenly
    among the calls it stands for, the remainder to the first; the pages and the driver time
    are the loop's."""
    results = []
    for each in (False, True):
        policy = policies.create("paged:segment_bytes=8MiB", device=device())
        alloc_ns, free_ns = [], []
        calls = engine.TimedCalls(
            engine.policy_target(policy), timer=TickTimer(), alloc_ns=alloc_ns, free_ns=free_ns
        )
        first = [calls.allocate(1 * MiB, 0, "kv")]  # a segment grown: free pages to take
        if each:
            handles = calls.allocate_each(1 * MiB, 3, "kv")
        else:
            handles = [calls.allocate(1 * MiB, 0, "kv") for _ in range(3)]
        pending = calls.take_driver_ns()
        extents = [h.extents for h in first + handles]
        if each:
            calls.free_each(handles[::-1])
        else:
            for h in handles[::-1]:
                calls.free(h)
        results.append((extents, pending, policy.stats().as_dict(), alloc_ns, free_ns))
    assert results[0][:3] == results[1][:3]
    assert results[0][3:] == ([10 + results[0][1]] + [10] * 3, [10] * 3)
    alloc_ns, free_ns = results[1][3:]
    assert alloc_ns == [10 + results[1][1], 4, 3, 3] and free_ns == [4, 3, 3]
    assert engine.policy_target(policies.create("best-fit")).allocate_each is None


def test_trace_events_tags_are_the_few_strings_and_none_for_no_tag():
    def tags_of(tags):
        return trace_events(
            AllocTrace(
                make_events(
                    range(len(tags)),
                    ["alloc"] * len(tags),
                    range(len(tags)),
                    [512] * len(tags),
                    tag=tags,
                ),
                "t",
            )
        ).tags

    got = tags_of(["kv", "", "weights", "kv", ""])
    assert got == ["kv", None, "weights", "kv", None]
    assert got[0] is got[3]  # one object a distinct tag, not one a row
    assert tags_of(["", ""]) is None and tags_of([]) is None
