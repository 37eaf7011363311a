"""First fit (policies/first_fit.py): the lowest-address free block that fits.

The shared block machinery (splitting, coalescing, growth, trim) is tested in test_blocks.py.
"""

from __future__ import annotations

import copy
import pickle
import random

import pytest

import policies
from policies import first_fit
from policies.first_fit import FirstFit

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


def test_registered_as_first_fit():
    assert policies.get("first-fit") is FirstFit
    p = policies.create("first-fit:segment_bytes=4MiB,split_threshold_bytes=4096")
    assert (
        isinstance(p, FirstFit) and p.segment_bytes == 4 * MiB and p.split_threshold_bytes == 4096
    )
    assert policies.create(p.spec).get_params() == p.get_params()


def test_picks_the_lowest_address_even_when_a_tighter_block_exists():
    p = FirstFit(segment_bytes=1 * MiB)
    big, _, tight, _ = _holes(
        p, [(64 * KiB, True), (4 * KiB, False), (16 * KiB, True), (4 * KiB, False)]
    )
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
    small, _, fits, _ = _holes(
        p, [(20 * KiB, True), (4 * KiB, False), (30 * KiB, True), (4 * KiB, False)]
    )
    assert p.allocate(24 * KiB).offset == fits.offset


def test_a_larger_bucket_block_at_a_lower_address_wins_over_its_own_bucket():
    p = FirstFit(segment_bytes=1 * MiB)
    small, _, big, _, fits, _ = _holes(
        p,
        [
            (20 * KiB, True),
            (4 * KiB, False),
            (64 * KiB, True),
            (4 * KiB, False),
            (30 * KiB, True),
            (4 * KiB, False),
        ],
    )
    assert p.allocate(24 * KiB).offset == big.offset


def test_power_of_two_request_takes_the_first_block_of_its_bucket():
    p = FirstFit(segment_bytes=1 * MiB)
    first, _, second, _ = _holes(
        p, [(20 * KiB, True), (4 * KiB, False), (16 * KiB, True), (4 * KiB, False)]
    )
    assert p.allocate(16 * KiB).offset == first.offset


def test_free_tail_serves_requests_larger_than_every_hole():
    p = FirstFit(segment_bytes=1 * MiB)
    allocs = _holes(p, [(16 * KiB, True), (4 * KiB, False)])
    assert p.allocate(32 * KiB).offset == allocs[1].offset + 4 * KiB


def test_largest_free_bytes_scans_the_top_bucket():
    p = FirstFit(segment_bytes=1 * MiB)
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
    assert p.largest_free_bytes() == 60 * KiB and p.free_extents()[1] == (
        p.free_extents()[1][0],
        60 * KiB,
    )


def _lowest_fit(p, size, stream=0):
    """The reference: the lowest offset of a free block of ``stream`` that holds ``size``, off the
    chains."""
    return min(
        (b.offset for b in p.blocks() if b.free and b.segment.stream == stream and b.size >= size),
        default=None,
    )


def _replay_against_reference(p, rng, num_steps, sizes, num_streams=1):
    """Random allocate/free traffic; every placement checked against ``_lowest_fit``.

    Returns the set of index kinds the streams were seen in ("flat", "chunked") and the live
    allocations.
    """
    live, kinds = [], set()
    for step in range(num_steps):
        if live and rng.random() < 0.4:
            p.free(live.pop(rng.randrange(len(live))))
        else:
            stream = rng.randrange(num_streams)
            nbytes = rng.choice(sizes)
            expected = _lowest_fit(p, p.rounded_size(nbytes), stream)
            a = p.allocate(nbytes, stream=stream)
            if a is None:  # over capacity: only when no free block holds it
                assert expected is None, (
                    f"step {step}: {nbytes} B refused with a fit at {expected:#x}"
                )
                continue
            if expected is not None:  # else a fresh segment serves it
                assert a.offset == expected, (
                    f"step {step}: {nbytes} B at {a.offset:#x}, not {expected:#x}"
                )
            live.append(a)
        kinds |= {"chunked"} if p._chunked_by_stream else set()
        kinds |= {"flat"} if p._free_by_stream else set()
        if step % 100 == 0:
            p.check_invariants()
    p.check_invariants()
    return kinds, live


def test_thousands_of_small_holes_place_as_the_reference():
    # 3,000 holes of 512 B under every larger request: the scan passes CHUNKED_FROM_ENTRIES, so
    # the stream's free list turns chunked; placements must not change
    p = FirstFit(segment_bytes=64 * MiB)
    pairs = [(p.allocate(512), p.allocate(512)) for _ in range(3000)]
    for hole, _ in pairs:
        p.free(hole)
    assert len(p.free_extents()) == 3001
    rng = random.Random(7)
    kinds, live = _replay_against_reference(
        p, rng, 1200, [256, 512, 1024, 3 * KiB, 8 * KiB, 200 * KiB]
    )
    assert "chunked" in kinds
    for a in live + [keep for _, keep in pairs]:  # the holes merge away: the list turns flat again
        p.free(a)
    p.check_invariants()
    ((start, length),) = p.free_extents()
    assert not p._chunked_by_stream and length == 64 * MiB
    assert p.allocate(4 * KiB).offset == start


@pytest.mark.parametrize("virtual", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_chunked_index_with_tiny_chunks_follows_the_reference(monkeypatch, seed, virtual):
    # tiny thresholds: streams go chunked and flat again many times, chunks split and join;
    # a capacity makes misses release free segments (or unmap free end pages) under the index
    monkeypatch.setattr(first_fit, "CHUNKED_FROM_ENTRIES", 6)
    monkeypatch.setattr(first_fit, "CHUNK_ENTRIES", 2)
    rng = random.Random(seed)
    p = FirstFit(
        segment_bytes=1 * MiB,
        split_threshold_bytes=rng.choice([None, 4 * KiB]),
        virtual=virtual,
        capacity_bytes=24 * MiB,
    )
    sizes = [512, 1 * KiB, 3 * KiB, 8 * KiB, 40 * KiB, 300 * KiB, 2 * MiB]
    kinds, _ = _replay_against_reference(p, rng, 2000, sizes, num_streams=2)
    assert kinds == {"flat", "chunked"}


def test_the_hot_lists_follow_the_stream_in_use_through_chunking_and_a_reset(monkeypatch):
    """The hot paths keep the flat lists of the stream they used last (``_hot_lists``: one identity
    test instead of a dict lookup a call). Streams that alternate and turn chunked and flat again,
    given as equal but distinct int objects (past CPython's cached small ints), still place as the
    reference, with the hot lists the dict's own after every step; a reset forgets them."""
    monkeypatch.setattr(first_fit, "CHUNKED_FROM_ENTRIES", 6)
    monkeypatch.setattr(first_fit, "CHUNK_ENTRIES", 2)
    rng = random.Random(5)
    p = FirstFit(segment_bytes=1 * MiB)
    base = 1 << 40
    live, kinds = [], set()
    for step in range(800):
        if live and rng.random() < 0.4:
            p.free(live.pop(rng.randrange(len(live))))
        else:
            stream = int(str(base + rng.randrange(2)))  # a fresh int object each call
            nbytes = rng.choice([512, 1 * KiB, 3 * KiB, 40 * KiB])
            expected = _lowest_fit(p, p.rounded_size(nbytes), stream)
            live.append(p.allocate(nbytes, stream=stream))
            assert expected is None or live[-1].offset == expected, f"step {step}"
        kinds |= {"chunked"} if p._chunked_by_stream else set()
        p.check_invariants()  # the hot lists are the dict's lists of the hot stream
    assert "chunked" in kinds
    for a in live:  # the holes merge away: both streams turn flat again
        p.free(a)
    p.free(p.allocate(5000, stream=base + 1))
    assert not p._chunked_by_stream and p._hot_stream == base + 1
    p.check_invariants()
    p.reset()
    assert p._hot_stream not in (base, base + 1) and p._hot_lists is None
    p.free(p.allocate(5000, stream=base))
    p.check_invariants()
    for fresh in (
        copy.deepcopy(FirstFit()),
        pickle.loads(pickle.dumps(FirstFit())),
    ):  # a copy of the sentinel
        fresh.check_invariants()
        fresh.free(fresh.allocate(5000))
        fresh.check_invariants()


def test_the_compiled_scan_finds_the_first_size_that_holds_the_request():
    from policies.first_fit import _first_at_least

    sizes = [512, 4096, 1024, 8192, 8192]
    assert [_first_at_least(sizes, n) for n in (1, 512, 513, 4096, 4097, 8192, 8193)] == [
        0,
        0,
        1,
        1,
        3,
        3,
        -1,
    ]
    assert _first_at_least([], 1) == -1
    assert _first_at_least(sizes, 1 << 70) == -1  # larger than any block can be
