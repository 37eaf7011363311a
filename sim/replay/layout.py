"""An optional recorder of a pool's segment layout during a replay, and PyTorch's recorded one.

``LayoutRecorder`` is off unless a replay asks for it
(``sim.replay.trace_replay.replay(record_layout=True)``): it rides on the engine's existing
callbacks (``observe`` at the monitor's sample points and ``before`` ahead of each event), so a
replay without it runs the same code as before. It keeps at most ``max_samples`` layouts (every k-th
monitor sample) plus the layout at the first ``max_failures`` refused requests. A layout is the
policy's ``segments()`` and ``free_extents()`` (live blocks are a segment minus its free holes),
written as one tidy table (``LAYOUT_COLUMNS``, ``layout.parquet`` in the result folder):

- ``kind`` ``"segment"``: a reserved segment ``[offset_bytes, offset_bytes + length_bytes)``;
- ``kind`` ``"free"``: a free hole inside a segment;
- ``kind`` ``"request"``: only in a layout taken at a refusal: the refused request's size
  (``length_bytes``; ``offset_bytes`` is -1).

``pytorch_layout`` rebuilds, from a snapshot's recorded ``segment_*`` events and the recorded
address of every block (``traces.pytorch_snapshot.snapshot_to_trace`` keeps both in
``trace.meta``), the segments PyTorch's caching allocator held at given times and the gaps
between the live blocks in them, as rows of the same table.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pandas as pd

from policies.base import Policy
from traces.events import ALLOC_OP, FREE_OP

__all__ = [
    "LAYOUT_COLUMNS",
    "LayoutRecorder",
    "pytorch_layout",
    "RECORDED_POLICY",
    "MAX_LAYOUT_SAMPLES",
]

#: Columns of the layout table (after the run keys trace, policy, backend).
LAYOUT_COLUMNS = [
    "sample",
    "event",
    "time_us",
    "at_failure",
    "kind",
    "offset_bytes",
    "length_bytes",
]
#: Layouts kept per run by default: a slider of 200 steps, and a table that stays small.
MAX_LAYOUT_SAMPLES = 200
#: Refusals whose layout is kept (the first ones: the first failure is the one that matters).
MAX_FAILURES = 20
#: ``policy`` of the rows ``pytorch_layout`` makes.
RECORDED_POLICY = "pytorch (recorded)"


class LayoutRecorder:
    """Segment layouts of ``policy`` at sample points and at refusals (see the module docstring).

    Rows go to a list of tuples (``LAYOUT_COLUMNS``): appending is cheap and the table is built
    once at the end.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        num_monitor_samples: int,
        max_samples: int = MAX_LAYOUT_SAMPLES,
        max_failures: int = MAX_FAILURES,
    ):
        self.policy = policy
        self.every = max(
            1, -(-num_monitor_samples // max(1, max_samples))
        )  # monitor samples per layout
        self.max_failures = max_failures
        self.num_failures = 0
        self.rows: list[tuple] = []
        self._countdown = 1
        self._num_samples = 0
        self._last_event = -1
        self._event = 0  # the event being handled (``before``)
        self._time_us: list[int] | None = None

    # -- the engine's callbacks --
    def before(self, event: int) -> None:
        self._event = event

    def observe(self, event: int, time_us: int) -> None:
        """At a monitor sample point: keep every ``every``-th one."""
        self._countdown -= 1
        if self._countdown == 0:
            self._countdown = self.every
            self.take(event, time_us)

    def finish(self, event: int, time_us: int) -> None:
        if self._last_event != event:
            self.take(event, time_us)

    def wrap_allocate(
        self, allocate: Callable[..., Any], times_us: list[int]
    ) -> Callable[..., Any]:
        """``allocate`` that also records the layout when it refuses (the pool as the request found
        it: a refusal leaves the pool unchanged, so reading it after the call is the same)."""

        def recording_allocate(nbytes: int, stream: int = 0, tag: str | None = None):
            a = allocate(nbytes, stream=stream, tag=tag)
            if a is None:
                self.num_failures += 1
                if self.num_failures <= self.max_failures:
                    self.take(self._event, times_us[self._event], request_bytes=nbytes)
            return a

        return recording_allocate

    # -- the layout --
    def take(self, event: int, time_us: int, *, request_bytes: int | None = None) -> None:
        sample, failure = self._num_samples, request_bytes is not None
        self._num_samples += 1
        if not failure:
            self._last_event = event
        rows = self.rows
        for s in self.policy.segments():
            rows.append((sample, event, time_us, failure, "segment", s.offset, s.nbytes))
        try:
            holes = self.policy.free_extents()
        except NotImplementedError:  # a policy that does not track free space by range
            holes = []
        for offset, length in holes:
            rows.append((sample, event, time_us, failure, "free", offset, length))
        if failure:
            rows.append((sample, event, time_us, True, "request", -1, request_bytes))

    def table(self) -> pd.DataFrame:
        return _frame(self.rows)


def _frame(rows: list[tuple]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=LAYOUT_COLUMNS)
    return df.astype(
        {
            "sample": np.int32,
            "event": np.int64,
            "time_us": np.int64,
            "at_failure": bool,
            "offset_bytes": np.int64,
            "length_bytes": np.int64,
        }
    )


def pytorch_layout(
    meta: dict[str, Any], samples: list[tuple[int, int]], events: pd.DataFrame | None = None
) -> pd.DataFrame | None:
    """What PyTorch held at each ``(event, time_us)`` of ``samples``, from a snapshot's
    ``segment_events`` and final ``segments`` table (``trace.meta``); None when it has neither.

    The final table is walked back over every recorded event to the start (a segment freed in
    the trace was held before; one allocated was not), then forward to each sample time.

    With ``events`` (the trace's event table, whose rows ``meta["event_addresses"]`` gives the
    recorded address of), each layout also has the gaps between PyTorch's live blocks (rows
    ``"free"``), so a segment minus its gaps is its live blocks, as for a policy: the blocks live
    after event ``event``, each at its recorded address and of the size asked (PyTorch rounds a
    block up, so a gap includes that slack). The live block bytes of a layout are the trace's
    live bytes after that event.
    """
    seg_events, final = meta.get("segment_events"), meta.get("segments")
    if seg_events is None or final is None:
        return None
    held = {int(a): int(n) for a, n in zip(final["address"], final["total_size"])}
    actions = seg_events["action"].tolist()
    addrs, sizes, times = (
        seg_events[c].astype("int64").tolist() for c in ("addr", "size", "time_us")
    )
    grow = ("segment_alloc", "segment_map")
    shrink = ("segment_free", "segment_unmap")
    for action, addr, size in zip(reversed(actions), reversed(addrs), reversed(sizes)):
        if action in grow:
            held.pop(addr, None)
        elif action in shrink:
            held[addr] = size
    blocks = _LiveBlocks(events, meta.get("event_addresses"))
    rows: list[tuple] = []
    k = 0
    for sample, (event, time_us) in enumerate(sorted(samples, key=lambda s: s[1])):
        while k < len(actions) and times[k] <= time_us:
            if actions[k] in grow:
                held[addrs[k]] = sizes[k]
            elif actions[k] in shrink:
                held.pop(addrs[k], None)
            k += 1
        segs = sorted(held.items())
        rows.extend((sample, event, time_us, False, "segment", a, n) for a, n in segs)
        if blocks.known:
            rows.extend(
                (sample, event, time_us, False, "free", a, n)
                for a, n in blocks.gaps_after(event, segs)
            )
    return _frame(rows)


class _LiveBlocks:
    """PyTorch's live blocks as the trace's events open and close them, advanced event by event.

    A dict address -> bytes: an address holds one live block at a time (the parser checks it).
    """

    def __init__(self, events: pd.DataFrame | None, addresses: Any):
        self.known = events is not None and addresses is not None and len(addresses) == len(events)
        if not self.known:
            return
        self._is_alloc = (events["op"] == ALLOC_OP).to_numpy().tolist()
        self._is_free = (events["op"] == FREE_OP).to_numpy().tolist()
        self._nbytes = events["nbytes"].to_numpy(np.int64).tolist()
        self._addresses = np.asarray(addresses, np.int64).tolist()
        self.live: dict[int, int] = {}
        self._next = 0  # the first event not applied yet

    def gaps_after(self, event: int, segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(offset, length)`` of every part of ``segments`` (sorted by address) no block covers,
        once events up to ``event`` are applied."""
        live = self.live
        while self._next <= event:
            i = self._next
            if self._is_alloc[i]:
                live[self._addresses[i]] = self._nbytes[i]
            elif self._is_free[i]:
                live.pop(self._addresses[i], None)
            self._next += 1
        blocks = sorted(live.items())
        gaps, j = [], 0
        for start, length in segments:
            cursor, end = start, start + length
            while j < len(blocks) and blocks[j][0] < start:
                j += 1
            while j < len(blocks) and blocks[j][0] < end:
                if blocks[j][0] > cursor:
                    gaps.append((cursor, blocks[j][0] - cursor))
                cursor = max(cursor, blocks[j][0] + blocks[j][1])
                j += 1
            if cursor < end:
                gaps.append((cursor, end - cursor))
        return gaps
