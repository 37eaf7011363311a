"""First fit (policies/first_fit.py): the lowest-address free block that fits.

The shared block machinery (splitting, coalescing, growth, trim) is tested in test_blocks.py.
"""

from __future__ import annotations

import policies
from policies.first_fit import FirstFit

KiB = 1 << 10
MiB = 1 << 20


def _holes(p, layout):
    """Allocate ``layout``'s sizes back to back, then free those marked True; return the allocations."""
    allocs = [p.allocate(size) for size, _ in layout]
    assert all(b.offset == a.offset + a.size_bytes for a, b in zip(allocs, allocs[1:]))
    for a, (_, hole) in zip(allocs, layout):
        if hole:
            p.free(a)
    return allocs


def test_registered_as_first_fit():
    assert policies.get("first-fit") is FirstFit
    p = policies.create("first-fit:segment_bytes=4MiB,split_threshold_bytes=4096")
    assert isinstance(p, FirstFit) and p.segment_bytes == 4 * MiB and p.split_threshold_bytes == 4096
    assert policies.create(p.spec).get_params() == p.get_params()


def test_picks_the_lowest_address_even_when_a_tighter_block_exists():
    p = FirstFit(segment_bytes=1 * MiB)
    big, _, tight, _ = _holes(p, [(64 * KiB, True), (4 * KiB, False), (16 * KiB, True), (4 * KiB, False)])
    assert p.allocate(16 * KiB).offset == big.offset


def test_picks_the_lower_segment_first():
    p = FirstFit(segment_bytes=1 * MiB)
    low = p.allocate(512 * KiB)
    p.allocate(512 * KiB)  # the first segment is full
    high = p.allocate(8 * KiB)  # in the second segment, with a large free tail after it
    p.free(low)
    assert high.offset > low.offset
    assert p.allocate(8 * KiB).offset == low.offset


def test_skips_blocks_of_the_same_size_bucket_that_are_too_small():
    p = FirstFit(segment_bytes=1 * MiB)
    # 20 KiB and 30 KiB holes share the 16-32 KiB bucket; a 24 KiB request fits only the second
    small, _, fits, _ = _holes(p, [(20 * KiB, True), (4 * KiB, False), (30 * KiB, True), (4 * KiB, False)])
    assert p.allocate(24 * KiB).offset == fits.offset


def test_a_larger_bucket_block_at_a_lower_address_wins_over_its_own_bucket():
    p = FirstFit(segment_bytes=1 * MiB)
    small, _, big, _, fits, _ = _holes(p, [(20 * KiB, True), (4 * KiB, False), (64 * KiB, True),
                                           (4 * KiB, False), (30 * KiB, True), (4 * KiB, False)])
    assert p.allocate(24 * KiB).offset == big.offset


def test_power_of_two_request_takes_the_first_block_of_its_bucket():
    p = FirstFit(segment_bytes=1 * MiB)
    first, _, second, _ = _holes(p, [(20 * KiB, True), (4 * KiB, False), (16 * KiB, True), (4 * KiB, False)])
    assert p.allocate(16 * KiB).offset == first.offset


def test_free_tail_serves_requests_larger_than_every_hole():
    p = FirstFit(segment_bytes=1 * MiB)
    allocs = _holes(p, [(16 * KiB, True), (4 * KiB, False)])
    assert p.allocate(32 * KiB).offset == allocs[1].offset + 4 * KiB


def test_largest_free_bytes_scans_the_top_bucket():
    p = FirstFit(segment_bytes=1 * MiB)
    _holes(p, [(40 * KiB, True), (4 * KiB, False), (60 * KiB, True), (4 * KiB, False), (MiB - 108 * KiB, False)])
    assert p.largest_free_bytes() == 60 * KiB and p.free_extents()[1] == (p.free_extents()[1][0], 60 * KiB)

