"""Worst fit (policies/worst_fit.py): the largest free block, lowest address on ties."""

from __future__ import annotations

import policies
from policies.worst_fit import WorstFit

KiB = 1 << 10
MiB = 1 << 20


def test_registered_and_built_from_a_spec():
    p = policies.create(
        "worst-fit:alignment_bytes=4096,granularity_bytes=8192", capacity_bytes=1 << 30
    )
    assert isinstance(p, WorstFit) and (p.alignment_bytes, p.granularity_bytes) == (4096, 8192)


def test_serves_from_the_largest_hole():
    p = WorstFit(segment_bytes=MiB)
    a, _, c, _ = (p.allocate(n) for n in (64 * KiB, 4 * KiB, 128 * KiB, 4 * KiB))
    p.free(a)  # holes: 64 KiB, 128 KiB and the tail (MiB - 200 KiB)
    p.free(c)
    tail = max(p.free_extents(), key=lambda e: e[1])
    assert p.allocate(16 * KiB).offset == tail[0]


def test_ties_go_to_the_lowest_address():
    p = WorstFit(segment_bytes=MiB)
    allocs = [p.allocate(256 * KiB) for _ in range(4)]  # the segment is full
    p.free(allocs[2])
    p.free(allocs[0])
    assert p.allocate(4 * KiB).offset == allocs[0].offset


def test_a_request_larger_than_every_hole_grows():
    p = WorstFit(segment_bytes=MiB)
    p.allocate(768 * KiB)
    b = p.allocate(512 * KiB)
    assert len(p.segments()) == 2 and b.offset == p.segments()[1].offset
