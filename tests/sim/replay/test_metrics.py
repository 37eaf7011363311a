"""sim.replay.metrics: what a monitor samples is what ``stats()`` says, read through
``Policy.gauges``."""

import random

import pytest

import policies
from policies.best_fit import BestFit
from policies.errors import PolicyError
from sim.replay.metrics import PoolMonitor, PolicyReadings
from sim.replay.trace_replay import replay
from traces.events import AllocTrace, make_events

MiB = 1 << 20

# a plain pool, one that counts its own segments (expandable ranges), a wrapper over a base
SPECS = ["best-fit", "size-class", "torch-caching:expandable_segments=true", "tag-limits"]


@pytest.mark.parametrize("spec", SPECS)
def test_a_sample_is_the_levels_of_stats(spec):
    policy = policies.create(spec, capacity_bytes=512 * MiB)
    readings = PolicyReadings(policy)
    rng = random.Random(0)
    live = []
    for _ in range(300):
        if live and rng.random() < 0.45:
            policy.free(live.pop(rng.randrange(len(live))))
        else:
            a = policy.allocate(rng.randint(1, 24 * MiB), stream=rng.choice((0, 1)))
            if a is not None:
                live.append(a)
        s = policy.stats()
        assert readings.sample() == (
            s.live_bytes,
            s.allocated_bytes,
            s.reserved_bytes,
            s.largest_free_bytes,
            s.frag_ext,
            s.num_segments,
        )


def test_the_monitor_keeps_one_row_per_sample_with_its_event_and_time():
    policy = policies.create("paged")
    monitor = PoolMonitor(policy, sample_every=2)
    a = policy.allocate(MiB)
    for event in range(5):
        monitor.observe(event, 10 * event)
    policy.free(a)
    monitor.finish(5, 50)
    ts = monitor.timeseries()
    assert ts["event"].tolist() == [0, 2, 4, 5]
    assert ts["time_us"].tolist() == [0, 20, 40, 50]
    assert ts["live_bytes"].tolist() == [MiB, MiB, MiB, 0]


class _StatsWithoutGauges(BestFit):
    """Overrides ``stats()`` (counts a segment twice) but not ``gauges()``, which the monitor
    samples."""

    def stats(self):
        s = super().stats()
        s.num_segments *= 2
        return s


def test_a_replay_refuses_a_policy_whose_gauges_contradict_its_stats():
    trace = AllocTrace(
        make_events(range(4), ["alloc", "alloc", "free", "free"], [1, 2, 1, 2], [MiB] * 4), name="t"
    )
    assert replay(trace, BestFit()).summary["n_failed"] == 0  # the same trace, a consistent policy
    with pytest.raises(PolicyError, match=r"gauges\(\).*stats\(\) says"):
        replay(trace, _StatsWithoutGauges())
