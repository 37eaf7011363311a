"""Pool bookkeeping shared by every backend: peaks, fragmentation, waste, the time series.

Replay (``sim.replay.engine``), the serving simulator and the GPU pool all feed the same
``PoolMonitor`` at the same event indices, so a simulated and a real run of the same trace and
policy agree exactly on everything here. Peaks come from the pool's own counters (exact at every
event); sampled measures (fragmentation, rounding waste) come from its readings every
``sample_every`` observations, because ``largest_free_bytes`` can cost O(free ranges). A policy is
read through ``PolicyReadings``; a baseline allocator brings its own readings (``realgpu.replay``).
The summary columns derived from these (overhead, waste, failure rate) are
``sim.replay.schema.summary_row``'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from policies.base import Policy, frag_ext, gauges_mismatch
from policies.errors import PolicyError

__all__ = ["PoolMonitor", "PolicyReadings", "default_sample_every", "TIMESERIES_SAMPLE_COLUMNS"]

#: One monitor sample (the report's time series adds trace, policy and backend in front).
TIMESERIES_SAMPLE_COLUMNS = [
    "event",
    "time_us",
    "live_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "largest_free_bytes",
    "frag_ext",
    "num_segments",
]


def default_sample_every(num_events: int, num_samples: int = 2000) -> int:
    """Sample about ``num_samples`` times over a run of ``num_events`` events."""
    return max(1, num_events // num_samples)


class PolicyReadings:
    """What a monitor reads off a policy: ``policy.gauges()`` (the levels of ``stats()``), exact
    at every call, and ``stats()``'s counters for the totals."""

    __slots__ = ("policy",)

    def __init__(self, policy: Policy):
        self.policy = policy

    def sample(self) -> tuple:
        live, allocated, reserved, largest_free, num_segments = self.policy.gauges()
        return (
            live,
            allocated,
            reserved,
            largest_free,
            frag_ext(reserved - allocated, largest_free),
            num_segments,
        )

    def totals(self) -> dict[str, Any]:
        s = self.policy.stats()
        mismatch = gauges_mismatch(self.policy, s)
        if mismatch:  # the samples charted would contradict these totals: refuse, never report both
            raise PolicyError(f"{self.policy!r}: {mismatch}")
        return {
            "n_alloc": s.num_allocs + s.num_failures,
            "n_free": s.num_frees,
            "n_failed": s.num_failures,
            "peak_live_bytes": s.peak_live_bytes,
            "peak_allocated_bytes": s.peak_allocated_bytes,
            "peak_reserved_bytes": s.peak_reserved_bytes,
            "n_grow": s.num_grows,
            "n_shrink": s.num_shrinks,
            "grown_bytes": s.grown_bytes,
            "shrunk_bytes": s.shrunk_bytes,
        }


class PoolMonitor:
    """Samples a pool's readings and hands the samples and totals to
    ``sim.replay.schema.summary_row``.

    Args:
        policy: the pool to watch (read through ``PolicyReadings``).
        sample_every: take a sample on every n-th ``observe`` call (the first and the last, via
            ``finish``, are always taken).
        readings: any other source with ``sample() -> (live, allocated, reserved, largest_free,
            frag_ext, num_segments)`` (NaN where it cannot know) and ``totals() -> dict`` of the
            count and peak columns: a baseline allocator's own readings (``realgpu.replay``).
    """

    def __init__(
        self, policy: Policy | None = None, *, sample_every: int = 1, readings: Any = None
    ):
        if sample_every < 1:
            raise ValueError(f"sample_every(={sample_every}) must be >= 1")
        self.readings = readings if readings is not None else PolicyReadings(policy)
        self._read = self.readings.sample
        self.sample_every = sample_every
        self._countdown = 1
        self._rows: list[tuple] = []
        self._last_event = -1

    def observe(self, event: int, time_us: int) -> None:
        """Call once per event (after the pool handled it); samples events 0, n, 2n, ... of
        ``sample_every`` n."""
        self._countdown -= 1
        if self._countdown == 0:
            self._countdown = self.sample_every
            self.sample(event, time_us)

    def sample(self, event: int, time_us: int) -> None:
        """Take a sample now: a caller that knows the event indices calls this on events 0, n,
        2n, ... itself (``sim.replay.engine.run``'s ``observe_every``) and skips the calls
        between."""
        self._rows.append((event, time_us, *self._read()))
        self._last_event = event

    def finish(self, event: int, time_us: int) -> None:
        """Take the closing sample (unless this event was just sampled)."""
        if self._last_event != event:
            self.sample(event, time_us)

    def timeseries(self) -> pd.DataFrame:
        return pd.DataFrame(self._rows, columns=TIMESERIES_SAMPLE_COLUMNS)

    def samples(self) -> np.ndarray:
        """``(live, allocated, frag_ext)`` of every sample, as float rows (what the summary
        averages)."""
        return np.array([(r[2], r[3], r[6]) for r in self._rows], dtype=np.float64).reshape(-1, 3)

    def totals(self) -> dict[str, Any]:
        """The count and peak columns of the summary, read now."""
        return self.readings.totals()
