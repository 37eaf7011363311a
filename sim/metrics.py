"""Pool bookkeeping shared by every backend: peaks, fragmentation, waste, the time series.

Replay, the serving simulator and the GPU pool all feed the same ``PoolMonitor`` at the same
event indices, so a simulated and a real run of the same trace and policy agree exactly on
everything here. Peaks come from the policy's own counters (exact at every event); sampled
measures (fragmentation, rounding waste) come from ``policy.stats()`` every ``sample_every``
observations, because ``largest_free_bytes`` can cost O(free ranges).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from policies.base import Policy

__all__ = ["PoolMonitor", "default_sample_every"]


def default_sample_every(num_events: int, num_samples: int = 2000) -> int:
    """Sample about ``num_samples`` times over a run of ``num_events`` events."""
    return max(1, num_events // num_samples)


class PoolMonitor:
    """Samples a policy's stats and summarises them in the report schema's terms.

    Args:
        policy: the pool to watch.
        sample_every: take a sample on every n-th ``observe`` call (the first and the last, via
            ``finish``, are always taken).
    """

    def __init__(self, policy: Policy, *, sample_every: int = 1):
        if sample_every < 1:
            raise ValueError(f"sample_every(={sample_every}) must be >= 1")
        self.policy = policy
        self.sample_every = sample_every
        self._countdown = 1
        self._rows: list[tuple[int, int, int, int, int, int, float, int]] = []
        self._last_event = -1

    def observe(self, event: int, time_us: int) -> None:
        """Call once per event (after the policy handled it)."""
        self._countdown -= 1
        if self._countdown == 0:
            self._countdown = self.sample_every
            self._sample(event, time_us)

    def _sample(self, event: int, time_us: int) -> None:
        s = self.policy.stats()
        self._rows.append((event, time_us, s.live_bytes, s.allocated_bytes, s.reserved_bytes,
                           s.largest_free_bytes, s.frag_ext, s.num_segments))
        self._last_event = event

    def finish(self, event: int, time_us: int) -> None:
        """Take the closing sample (unless this event was just sampled)."""
        if self._last_event != event:
            self._sample(event, time_us)

    def timeseries(self) -> pd.DataFrame:
        return pd.DataFrame(self._rows, columns=["event", "time_us", "live_bytes", "allocated_bytes",
                                                 "reserved_bytes", "largest_free_bytes", "frag_ext",
                                                 "num_segments"])

    def summary_fields(self) -> dict[str, Any]:
        """The pool columns of ``sim.report.SUMMARY_COLUMNS`` (latency and labels excluded)."""
        s = self.policy.stats()
        n_attempts = s.num_allocs + s.num_failures
        rows = np.array([(r[2], r[3], r[6]) for r in self._rows], dtype=np.float64).reshape(-1, 3)
        live, allocated, frag = rows[:, 0], rows[:, 1], rows[:, 2]
        total_allocated = allocated.sum()
        return {
            "n_alloc": n_attempts,
            "n_free": s.num_frees,
            "n_failed": s.num_failures,
            "failure_rate": s.num_failures / n_attempts if n_attempts else 0.0,
            "peak_live_bytes": s.peak_live_bytes,
            "peak_allocated_bytes": s.peak_allocated_bytes,
            "peak_reserved_bytes": s.peak_reserved_bytes,
            "overhead": s.peak_reserved_bytes / s.peak_live_bytes - 1.0 if s.peak_live_bytes else float("nan"),
            "frag_ext_mean": float(frag.mean()) if frag.size else 0.0,
            "frag_ext_max": float(frag.max()) if frag.size else 0.0,
            # time-averaged share of allocated bytes lost to rounding (over the samples)
            "internal_waste_frac": float((total_allocated - live.sum()) / total_allocated) if total_allocated else 0.0,
            "n_grow": s.num_grows,
            "n_shrink": s.num_shrinks,
            "grown_bytes": s.grown_bytes,
            "shrunk_bytes": s.shrunk_bytes,
        }
