"""When a compacting pool compacted during a replay: one row per monitor sample interval with
passes.

A policy does not know the replay's clock, and the engine's loop must not pay for a check per
event, so ``CompactionLog`` reads the policy's own totals (``Policy.compaction_stats``) at the
monitor's sample points (``sim.replay.engine.run``'s ``observe`` calls, every ``sample_every``
events) and writes a row wherever they grew: the passes of that interval, stamped with the sample's
event and time (a pass happened after the previous sample and at or before this one). Only a policy
that declares ``can_compact`` gets a log (``sim.replay.trace_replay.replay``), so every other replay
runs the code it ran before. The table (``COMPACTION_COLUMNS`` after the run keys trace, policy,
backend) is ``compactions.parquet`` in a replay's result folder; the interactive report marks its
times on the timelines.
"""

from __future__ import annotations

import pandas as pd

from policies.base import Policy

__all__ = ["COMPACTION_COLUMNS", "CompactionLog"]

#: Columns of the compaction table (after the run keys): the sample that first saw the passes,
#: and what they did in total.
COMPACTION_COLUMNS = [
    "event",
    "time_us",
    "num_compactions",
    "num_moves",
    "moved_bytes",
    "released_bytes",
]
#: ``compaction_stats`` keys behind the counted columns, in ``COMPACTION_COLUMNS`` order.
_STATS = ("num_compactions", "num_moves", "moved_bytes", "released_bytes")


class CompactionLog:
    """Rows of ``COMPACTION_COLUMNS``: the growth of ``policy.compaction_stats()`` per sample.

    A list of tuples: a row is appended only where a pass happened, and the table is built once.
    """

    def __init__(self, policy: Policy):
        self.policy = policy
        self.rows: list[tuple] = []
        self._seen = self._totals()

    def _totals(self) -> tuple[int, ...]:
        stats = self.policy.compaction_stats()
        return tuple(int(stats.get(k, 0)) for k in _STATS)

    def observe(self, event: int, time_us: int) -> None:
        """At a monitor sample point (and at the end): a row when passes ran since the last one."""
        totals = self._totals()
        if totals[0] != self._seen[0]:
            self.rows.append((event, time_us, *(a - b for a, b in zip(totals, self._seen))))
            self._seen = totals

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=COMPACTION_COLUMNS).astype("int64")
