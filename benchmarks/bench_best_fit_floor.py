"""How cheap can a pure-Python best fit be? Best fit against a blockless boundary-tag floor.

    PYTHONPATH=. python benchmarks/bench_best_fit_floor.py [TRACE] [--repeat 5] [--clock cpu]

Issue 16 asks pure best fit for at most 2x the do-nothing policy. ``BestFit`` keeps every free
and handed-out range as a ``Block`` in a chain; this benchmark asks whether that chain is what
costs. ``BoundaryTagBestFit`` is the leanest best fit written here: no block objects at all, a
free range is two dict entries (its start -> size, its end -> start) and one key in a sorted list
(``size << 48 | offset``, as ``BestFit``'s index), an allocation carries its offset, and nothing
else: one stream, the default knobs (256 B alignment, 32 MiB segments, larger requests in
segments of their own rounded to 2 MiB), no virtual segments, no release of free segments, no
invariant checks. It is a floor, not a policy to register.

The benchmark first replays TRACE through both and checks that every allocation lands at the
same offset (else it exits 1: a floor that places differently measures something else), then
runs ``bench_replay.py``'s bare loops with their floor rows, ``best-fit`` and this floor,
interleaved in one process.
"""

from __future__ import annotations

import argparse
import sys
from bisect import bisect_left
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_replay  # noqa: E402  (puts the repository on the path)

import policies  # noqa: E402
from policies.base import Allocation, Policy  # noqa: E402
from policies.registry import unregister  # noqa: E402
from sim.replay.costs import CostedDevice, CostModel  # noqa: E402
from sim.replay.trace_replay import trace_events  # noqa: E402
from traces import read_alloc_trace  # noqa: E402

FLOOR = "boundary-tag-best-fit"
_SEGMENT_BYTES = 32 << 20
_OVERSIZE_MULTIPLE = 2 << 20
_SHIFT = 48  # key = size << 48 | offset: offsets below 2**48
_OFFSET_MASK = (1 << _SHIFT) - 1


class BoundaryTagBestFit(Policy):
    """Best fit with no block objects: smallest free range that fits, lowest offset on ties,
    split and coalesced at once, over dicts of free starts and ends (see the module docstring)."""

    name = FLOOR

    def _reset_state(self) -> None:
        self._keys: list[int] = []  # every free range's size << _SHIFT | offset, sorted
        self._size_by_start: dict[int, int] = {}  # free range start -> its size
        self._start_by_end: dict[int, int] = {}  # free range end -> its start
        self._segment_starts: set[int] = set()  # free ranges of two segments never merge

    def _add_segment(self, segment) -> None:
        self._segment_starts.add(segment.offset)
        self._put(segment.offset, segment.nbytes)

    def _put(self, offset: int, size: int) -> None:
        key = size << _SHIFT | offset
        self._keys.insert(bisect_left(self._keys, key), key)
        self._size_by_start[offset] = size
        self._start_by_end[offset + size] = offset

    def _release_free_segments(self, max_bytes) -> int:
        return 0

    def free_extents(self) -> list[tuple[int, int]]:
        return sorted(self._size_by_start.items())

    def _allocate(self, nbytes: int, stream: int, tag: str | None) -> Allocation | None:
        if stream != 0:
            raise ValueError(f"{FLOOR} serves stream 0 only, not {stream}")
        size = (nbytes + 255) & ~255
        keys = self._keys
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            bytes_ = (
                _SEGMENT_BYTES
                if size <= _SEGMENT_BYTES
                else -(-size // _OVERSIZE_MULTIPLE) * _OVERSIZE_MULTIPLE
            )
            segment = self._reserve_segment(bytes_, stream)
            if segment is None:
                return None
            self._add_segment(segment)
            i = bisect_left(keys, size << _SHIFT)
        key = keys[i]
        offset = key & _OFFSET_MASK
        free_bytes = key >> _SHIFT
        rest = free_bytes - size
        del self._size_by_start[offset]
        if (
            rest
        ):  # the rest stays free above the request; it keeps the key's place when the order allows
            rest_offset = offset + size
            self._size_by_start[rest_offset] = rest
            self._start_by_end[rest_offset + rest] = rest_offset
            rest_key = rest << _SHIFT | rest_offset
            if i == 0 or keys[i - 1] < rest_key:
                keys[i] = rest_key
            else:
                del keys[i]
                keys.insert(bisect_left(keys, rest_key), rest_key)
        else:
            del self._start_by_end[offset + free_bytes], keys[i]
        self.allocated_bytes += size
        a = Allocation.__new__(Allocation)
        a.nbytes = nbytes
        a.size_bytes = size
        a._extents = None  # not read by the bare loop; a real policy would build or compute it
        a.stream = stream
        a.tag = tag
        a.handle = offset
        return a

    def _free(self, allocation: Allocation) -> None:
        offset = allocation.handle
        size = allocation.size_bytes
        self.allocated_bytes -= size
        end = offset + size
        size_by_start, start_by_end, keys = self._size_by_start, self._start_by_end, self._keys
        next_bytes = size_by_start.get(end)
        if next_bytes is not None and end not in self._segment_starts:  # merge the free range above
            del size_by_start[end], start_by_end[end + next_bytes]
            del keys[bisect_left(keys, next_bytes << _SHIFT | end)]
            size += next_bytes
            end += next_bytes
        prev_offset = start_by_end.get(offset)
        if (
            prev_offset is not None and offset not in self._segment_starts
        ):  # merge into the free range below
            prev_bytes = size_by_start[prev_offset]
            i = bisect_left(keys, prev_bytes << _SHIFT | prev_offset)
            del start_by_end[offset]
            size += prev_bytes
            offset = prev_offset
            key = size << _SHIFT | offset
            if i + 1 == len(keys) or keys[i + 1] > key:
                keys[i] = key
            else:
                del keys[i]
                keys.insert(bisect_left(keys, key), key)
        else:
            key = size << _SHIFT | offset
            keys.insert(bisect_left(keys, key), key)
        size_by_start[offset] = size
        start_by_end[end] = offset


def check_same_placements(events, costs) -> int:
    """Replay ``events`` through best fit and the floor; the number of allocations, all placed
    alike."""
    best = policies.create("best-fit", device=CostedDevice(costs))
    floor = BoundaryTagBestFit(device=CostedDevice(costs))
    live_best, live_floor = {}, {}
    num_allocs = 0
    for i, (is_alloc, key, nbytes, stream, tag) in enumerate(events):
        if is_alloc:
            a = best.allocate(nbytes, stream=stream, tag=tag)
            b = floor.allocate(nbytes, stream=stream, tag=tag)
            if (a is None) != (b is None) or (
                a is not None and (a.offset, a.size_bytes) != (b.handle, b.size_bytes)
            ):
                raise SystemExit(
                    f"event {i}: best fit placed {a and (a.offset, a.size_bytes)}, "
                    f"the floor {b and (b.handle, b.size_bytes)}: the floor is not best fit"
                )
            if a is not None:
                live_best[key], live_floor[key] = a, b
                num_allocs += 1
        elif key in live_best:
            best.free(live_best.pop(key))
            floor.free(live_floor.pop(key))
    return num_allocs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=bench_replay.DEFAULT_TRACE)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--clock", choices=sorted(bench_replay.CLOCKS), default="cpu")
    args = ap.parse_args(argv)
    events = bench_replay.request_events(trace_events(read_alloc_trace(args.trace)))
    num_allocs = check_same_placements(events, CostModel.load())
    print(f"# {FLOOR} placed all {num_allocs:,} allocations of the trace where best-fit did")
    policies.register(FLOOR, BoundaryTagBestFit, replace=True)
    try:
        return bench_replay.main(
            [
                args.trace,
                "-p",
                "best-fit",
                "-p",
                FLOOR,
                "--bare-only",
                "--repeat",
                str(args.repeat),
                "--clock",
                args.clock,
            ]
        )
    finally:
        unregister(FLOOR)


if __name__ == "__main__":
    from poollab.cli import run_script  # bad input: one line, exit status 2

    run_script(main)
