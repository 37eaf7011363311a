"""Best fit (policies/best_fit.py): the smallest free block that fits, lowest address on ties.

The shared block machinery (splitting, coalescing, growth, trim) is tested in test_blocks.py.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import policies
from policies.best_fit import BestFit

KiB = 1 << 10
MiB = 1 << 20


def _holes(p, layout):
    """Allocate ``layout``'s sizes back to back, then free those marked True; return the
    allocations."""
    allocs = [p.allocate(size) for size, _ in layout]
    assert all(b.offset == a.offset + a.size_bytes for a, b in zip(allocs, allocs[1:]))
    for a, (_, hole) in zip(allocs, layout):
        if hole:
            p.free(a)
    return allocs


def test_registered_as_best_fit():
    assert policies.get("best-fit") is BestFit
    p = policies.create("best-fit:alignment_bytes=4096", capacity_bytes=1 << 30)
    assert isinstance(p, BestFit) and p.alignment_bytes == 4096 and p.capacity_bytes == 1 << 30
    assert policies.create(p.spec).get_params() == {**p.get_params(), "capacity_bytes": None}


def test_picks_the_smallest_block_that_fits():
    p = BestFit(segment_bytes=1 * MiB)
    _, _, tight, _, mid, _ = _holes(
        p,
        [
            (64 * KiB, True),
            (4 * KiB, False),
            (16 * KiB, True),
            (4 * KiB, False),
            (20 * KiB, True),
            (4 * KiB, False),
        ],
    )
    assert p.allocate(16 * KiB).offset == tight.offset
    assert p.allocate(17 * KiB).offset == mid.offset


def test_ties_go_to_the_lowest_address():
    p = BestFit(segment_bytes=1 * MiB)
    low, _, high, _ = _holes(
        p, [(16 * KiB, True), (4 * KiB, False), (16 * KiB, True), (4 * KiB, False)]
    )
    assert p.allocate(12 * KiB).offset == low.offset


def test_ties_across_segments_go_to_the_lowest_address():
    p = BestFit(segment_bytes=1 * MiB)
    p.allocate(MiB - 16 * KiB)
    first_tail = p.allocate(16 * KiB)
    p.allocate(MiB - 16 * KiB)
    second_tail = p.allocate(16 * KiB)
    p.free(second_tail)
    p.free(first_tail)
    assert p.allocate(16 * KiB).offset == first_tail.offset


def test_request_larger_than_every_hole_uses_the_free_tail():
    p = BestFit(segment_bytes=1 * MiB)
    allocs = _holes(p, [(16 * KiB, True), (4 * KiB, False)])
    assert p.allocate(32 * KiB).offset == allocs[1].offset + 4 * KiB


def test_split_threshold_hands_out_a_whole_near_fit():
    p = BestFit(segment_bytes=1 * MiB, split_threshold_bytes=8 * KiB)
    hole, _ = _holes(p, [(20 * KiB, True), (4 * KiB, False)])
    a = p.allocate(16 * KiB)  # 4 KiB would remain: below the threshold, so the block stays whole
    assert (a.offset, a.size_bytes) == (hole.offset, 20 * KiB)


def test_largest_free_bytes_is_the_last_key():
    p = BestFit(segment_bytes=1 * MiB)
    _holes(
        p,
        [
            (40 * KiB, True),
            (4 * KiB, False),
            (60 * KiB, True),
            (4 * KiB, False),
            (MiB - 108 * KiB, False),
        ],
    )
    assert p.largest_free_bytes() == 60 * KiB


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "trim"]), st.integers(1, 3 * MiB), st.integers(0, 2)
        ),
        max_size=120,
    )
)
def test_largest_free_bytes_equals_the_largest_free_block_on_any_stream(ops):
    # the gauge a monitor sample reads (a loop over each stream's last key) against the brute
    # force: every block walked, the largest free one, whatever its stream
    p = BestFit(segment_bytes=2 * MiB, alignment_bytes=512)
    live = []
    for op, n, stream in ops:
        if op == "alloc":
            live.append(p.allocate(n, stream=stream))
        elif op == "free" and live:
            p.free(live.pop(n % len(live)))
        elif op == "trim":
            p.trim()
        assert p.largest_free_bytes() == max((b.size for b in p.blocks() if b.free), default=0)
