"""``torch-caching``: PyTorch's rounding, pools, best fit, split and merge rules, retries, GC and
seeding."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.errors import PolicyError
from policies.testing import check_invariants
from policies.torch_caching import (
    TorchCaching,
    allocation_size,
    parse_roundup_power2_divisions,
    round_size,
    roundup_power2_next_division,
)

KiB, MiB = 1 << 10, 1 << 20


def seg_sizes(pool):
    return [s.nbytes for s in pool.segments()]


# ----------------------------------------------------------------- sizes
def test_round_size_is_512_multiples_with_a_512_floor():
    assert [round_size(n) for n in (1, 512, 513, 1000, 4096)] == [512, 512, 1024, 1024, 4096]


def test_power2_divisions_round_to_the_next_division():
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(1024, 4) == 1024
    assert round_size(5 * MiB + 1, 4) == 6 * MiB  # divisions of [4, 8) MiB are 4, 5, 6, 7 MiB


def test_divisions_apply_only_above_512_times_divisions():
    assert round_size(1500, 4) == 1536  # 1500 <= 512 * 4: plain 512 B rounding


def test_per_interval_divisions_follow_pytorchs_list_syntax():
    table = parse_roundup_power2_divisions("256:1,512:2,>:8")
    assert table[:8] == (1,) * 8 and table[8] == 1 and table[9] == 2 and table[10:] == (8,) * 6
    assert round_size(600 * MiB + 1, table) == 768 * MiB  # 2 divisions of [512 MiB, 1 GiB)
    assert round_size(3 * MiB + 1, table) == 3 * MiB + 512  # 1 division: plain rounding


@pytest.mark.parametrize("bad", [3, -2, "256:3", "300:2", "1024", True, 2.0])
def test_bad_roundup_divisions_are_refused(bad):
    with pytest.raises(PolicyError, match="roundup_power2_divisions"):
        TorchCaching(roundup_power2_divisions=bad)


def test_allocation_sizes_are_pytorchs_segments():
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(21 * MiB + 1) == 22 * MiB


# ----------------------------------------------------------------- pools and splitting
def test_small_requests_pack_into_one_2mib_segment():
    pool = TorchCaching()
    allocs = [pool.allocate(100 * KiB) for _ in range(20)]
    assert seg_sizes(pool) == [2 * MiB]
    assert [a.offset - allocs[0].offset for a in allocs[:3]] == [0, 100 * KiB, 200 * KiB]


def test_a_1_to_10_mib_request_splits_a_20mib_segment():
    pool = TorchCaching()
    a = pool.allocate(3 * MiB)
    b = pool.allocate(3 * MiB)
    assert seg_sizes(pool) == [20 * MiB] and b.offset == a.offset + 3 * MiB


def test_large_pool_keeps_a_remainder_of_at_most_1mib_in_the_block():
    pool = TorchCaching()
    a = pool.allocate(19 * MiB)  # 20 MiB segment, 1 MiB left: not split off
    assert a.size_bytes == 20 * MiB
    assert pool.free_extents() == []


def test_small_pool_splits_when_512_bytes_remain():
    pool = TorchCaching()
    pool.allocate(MiB)
    a = pool.allocate(MiB - 512 - 300)
    b = pool.allocate(512)
    assert a.size_bytes == MiB - 512 and b.offset == a.offset + a.size_bytes
    assert pool.segments()[0].nbytes == 2 * MiB and len(pool.segments()) == 1


def test_best_fit_takes_the_smallest_block_then_the_lowest_address():
    pool = TorchCaching()
    a, b, c, d, e, rest = (
        pool.allocate(n * MiB) for n in (3, 4, 3, 2, 3, 5)
    )  # fills a 20 MiB segment
    pool.free(b)  # a 4 MiB hole at 3 MiB
    pool.free(d)  # a 2 MiB hole at 10 MiB
    assert (
        pool.allocate(2 * MiB).offset == d.offset
    )  # the 2 MiB hole, though the 4 MiB one is lower
    f = pool.allocate(2 * MiB)
    pool.free(rest)
    pool.free(e)  # a 10 MiB hole after the 2 MiB left of b's hole: equal sizes now go lowest first
    assert (f.offset, pool.allocate(2 * MiB).offset) == (b.offset, b.offset + 2 * MiB)


def test_another_streams_free_block_is_never_used():
    pool = TorchCaching()
    a = pool.allocate(4096, stream=0)
    pool.free(a)
    b = pool.allocate(4096, stream=1)
    assert len(pool.segments()) == 2 and b.offset != a.offset


def test_freeing_merges_with_both_neighbours():
    pool = TorchCaching()
    a, b, c = (pool.allocate(3 * MiB) for _ in range(3))
    pool.free(a)
    pool.free(c)
    pool.free(b)
    assert pool.free_extents() == [(a.offset, 20 * MiB)]


# ----------------------------------------------------------------- max_split_size
def test_a_request_below_max_split_does_not_take_an_oversize_block():
    pool = TorchCaching(max_split_size_bytes=40 * MiB)
    big = pool.allocate(60 * MiB)
    pool.free(big)
    pool.allocate(30 * MiB)
    assert sorted(seg_sizes(pool)) == [30 * MiB, 60 * MiB]


def test_an_oversize_request_takes_an_oversize_block_only_within_the_rounding_limit():
    pool = TorchCaching(max_split_size_bytes=30 * MiB)
    pool.free(pool.allocate(60 * MiB))
    near = pool.allocate(50 * MiB)  # 60 < 50 + 20: reused whole, not split
    assert near.size_bytes == 60 * MiB and seg_sizes(pool) == [60 * MiB]
    pool.free(near)
    far = pool.allocate(31 * MiB)  # 60 >= 31 + 20: a new segment
    assert far.size_bytes == 32 * MiB


def test_release_available_frees_oversize_blocks_before_giving_up():
    pool = TorchCaching(max_split_size_bytes=40 * MiB, capacity_bytes=120 * MiB)
    pool.free(pool.allocate(100 * MiB))
    a = pool.allocate(50 * MiB)  # 100 >= 50 + 20 is refused, 100 + 50 > 120: release it, then fits
    assert a is not None and seg_sizes(pool) == [50 * MiB]
    assert pool.num_alloc_retries == 0


@pytest.mark.parametrize("bad", [20 * MiB, 0, -1, 1.5, True])
def test_max_split_size_must_exceed_20mib(bad):
    with pytest.raises(PolicyError, match="max_split_size_bytes"):
        TorchCaching(max_split_size_bytes=bad)


# ----------------------------------------------------------------- out of memory and empty_cache
def test_out_of_memory_frees_unsplit_cached_segments_and_retries():
    pool = TorchCaching(capacity_bytes=40 * MiB)
    pool.free(pool.allocate(30 * MiB))
    a = pool.allocate(35 * MiB)
    assert a is not None and seg_sizes(pool) == [36 * MiB] and pool.num_alloc_retries == 1


def test_a_failure_releases_cached_segments_as_pytorch_does_but_touches_nothing_live():
    # the Policy.allocate failure contract: PyTorch empties its cache before reporting out of memory
    pool = TorchCaching(capacity_bytes=64 * MiB)
    keep = pool.allocate(3 * MiB)  # in a 20 MiB segment
    pool.free(pool.allocate(25 * MiB))  # a 26 MiB segment of its own, cached whole
    before, extents = pool.stats(), keep.extents
    assert pool.allocate(50 * MiB) is None  # 20 + 50 > 64 even with the cache emptied
    after = check_invariants(pool, [keep])
    assert seg_sizes(pool) == [20 * MiB] and after.shrunk_bytes - before.shrunk_bytes == 26 * MiB
    assert (keep.extents, after.live_bytes, after.allocated_bytes, after.num_failures) == (
        extents,
        before.live_bytes,
        before.allocated_bytes,
        before.num_failures + 1,
    )


def test_a_split_cached_segment_is_not_released():
    pool = TorchCaching(capacity_bytes=40 * MiB)
    keep = pool.allocate(3 * MiB)
    pool.free(pool.allocate(3 * MiB))
    assert pool.allocate(30 * MiB) is None
    assert seg_sizes(pool) == [20 * MiB] and keep.live


def test_empty_cache_releases_only_whole_free_segments():
    pool = TorchCaching()
    keep = pool.allocate(3 * MiB)
    pool.allocate(4096)
    pool.free(pool.allocate(30 * MiB))
    assert pool.empty_cache() == 30 * MiB
    assert sorted(seg_sizes(pool)) == [2 * MiB, 20 * MiB] and keep.live


# ----------------------------------------------------------------- garbage collection
def test_garbage_collection_releases_old_cached_blocks_past_the_threshold():
    pool = TorchCaching(garbage_collection_threshold=0.4, capacity_bytes=100 * MiB)
    pool.free(pool.allocate(24 * MiB))  # cached, then never used again: it ages
    pool.free(pool.allocate(26 * MiB))
    for _ in range(5):
        pool.free(pool.allocate(25 * MiB))  # takes and returns the 26 MiB block: it stays young
    pool.allocate(30 * MiB)  # a miss with 50 MiB reserved > 40 MiB: GC frees the old block first
    assert sorted(seg_sizes(pool)) == [26 * MiB, 30 * MiB]


def test_garbage_collection_needs_a_capacity():
    pool = TorchCaching(garbage_collection_threshold=0.5)
    pool.free(pool.allocate(30 * MiB))
    pool.allocate(40 * MiB)
    assert sorted(seg_sizes(pool)) == [30 * MiB, 40 * MiB]


# ----------------------------------------------------------------- seeding
def test_seed_segment_places_blocks_and_leaves_the_gaps_free():
    pool = TorchCaching()
    a, b = pool.seed_segment(
        20 * MiB, small=False, blocks=[(8 * MiB, 4 * MiB, 4 * MiB - 100), (0, 2 * MiB, 2 * MiB)]
    )
    base = pool.segments()[0].offset
    assert (b.offset - base, b.size_bytes, a.offset - base, a.nbytes) == (
        0,
        2 * MiB,
        8 * MiB,
        4 * MiB - 100,
    )
    assert pool.free_extents() == [(base + 2 * MiB, 6 * MiB), (base + 12 * MiB, 8 * MiB)]
    check_invariants(pool, [a, b])


def test_seeded_allocations_free_and_merge_like_any_other():
    pool = TorchCaching()
    a, b = pool.seed_segment(
        20 * MiB, small=False, blocks=[(0, 2 * MiB, 2 * MiB), (8 * MiB, 4 * MiB, 4 * MiB)]
    )
    pool.free(a)
    pool.free(b)
    assert pool.free_extents() == [(pool.segments()[0].offset, 20 * MiB)]
    assert pool.stats().num_frees == 2 and pool.trim() == 20 * MiB


def test_a_request_fills_a_seeded_gap_by_best_fit():
    pool = TorchCaching()
    (a,) = pool.seed_segment(20 * MiB, small=False, blocks=[(4 * MiB, 16 * MiB, 16 * MiB)])
    b = pool.allocate(3 * MiB)
    assert b.offset == pool.segments()[0].offset and len(pool.segments()) == 1


@pytest.mark.parametrize(
    "blocks",
    [
        [(0, 4 * MiB, 4 * MiB), (2 * MiB, 4 * MiB, 4 * MiB)],  # overlap
        [(0, 4 * MiB, 5 * MiB)],  # asked for more than the block
        [(100, 4 * MiB, 4 * MiB)],  # not 512-aligned
        [(18 * MiB, 4 * MiB, 4 * MiB)],  # past the end
        [(0, 4 * MiB)],
    ],
)
def test_a_bad_seed_layout_is_refused_before_anything_changes(blocks):
    pool = TorchCaching()
    before = pool.stats()
    with pytest.raises(PolicyError, match="seed_segment"):
        pool.seed_segment(20 * MiB, small=False, blocks=blocks)
    assert pool.stats() == before


def test_a_seed_beyond_capacity_is_refused():
    pool = TorchCaching(capacity_bytes=16 * MiB)
    with pytest.raises(PolicyError, match="refused"):
        pool.seed_segment(20 * MiB, small=False)


# ----------------------------------------------------------------- expandable segments
def test_expandable_segments_map_20_mib_pages_into_one_range_and_split_any_remainder():
    p = TorchCaching(expandable_segments=True)
    a = p.allocate(30 * MiB)
    c = p.allocate(5 * MiB)  # the 10 MiB left of the second page: split (>= 512 B), no new mapping
    assert p.reserved_bytes == 40 * MiB and p.device.physical_bytes == 40 * MiB
    assert c.extents[0][0] == a.extents[0][0] + 30 * MiB
    small = p.allocate(100)
    assert p.reserved_bytes == 42 * MiB  # a 2 MiB page in the small pool's own range
    check_invariants(p, [a, c, small])


def test_empty_cache_unmaps_only_whole_free_pages_and_a_miss_maps_into_the_hole():
    p = TorchCaching(expandable_segments=True)
    a, c = p.allocate(30 * MiB), p.allocate(5 * MiB)
    p.free(a)
    assert p.reserved_bytes == 40 * MiB  # a free unmaps nothing
    assert p.empty_cache() == 20 * MiB  # [0, 20) is a whole free page; [20, 30) is not
    assert len(p.segments()) == 1 and p.segments()[0].nbytes == 20 * MiB
    d = p.allocate(25 * MiB)  # the lowest unmapped room joined with the free 10 MiB after it
    assert p.reserved_bytes == 40 * MiB and d.extents[0][0] == a.extents[0][0]
    p.free(c), p.free(d)
    assert p.empty_cache() == 40 * MiB and p.reserved_bytes == 0 and p.segments() == []
    assert p.device.virtual_bytes == 0  # an empty range is given back


def test_best_fit_prefers_a_block_that_fits_to_a_growable_tail():
    p = TorchCaching(expandable_segments=True)
    a, b, c = p.allocate(14 * MiB), p.allocate(2 * MiB), p.allocate(12 * MiB)  # 28 of 40 MiB mapped
    p.free(a)  # 14 MiB free inside; exactly 12 MiB free at the tail, before unmapped space
    again = p.allocate(12 * MiB)
    assert again.extents[0][0] == a.extents[0][0]
    check_invariants(p, [b, c, again])


def test_expandable_is_torch_caching_with_expandable_segments():
    import policies

    ops = [30 * MiB, 100, 5 * MiB, 7 * MiB]
    seen = []
    for spec in ("expandable", "torch-caching:expandable_segments=true"):
        p = policies.create(spec)
        seen.append([p.allocate(n).extents for n in ops] + [p.reserved_bytes])
    assert seen[0] == seen[1]


# ----------------------------------------------------------------- against a brute-force model
class _Model:
    """The same rules by brute force: segments as lists of [size, allocated] blocks, no index."""

    def __init__(self):
        self.segs = []  # [small, stream, base, blocks]
        self.base = 0

    def malloc(self, n, stream):
        size = round_size(n)
        small = size <= MiB
        cands = [
            (b[0], s[2] + sum(x[0] for x in s[3][:i]), s, i)
            for s in self.segs
            if s[0] == small and s[1] == stream
            for i, b in enumerate(s[3])
            if not b[1] and b[0] >= size
        ]
        if cands:
            _, addr, seg, i = min(cands, key=lambda c: (c[0], c[1]))
        else:
            seg = [small, stream, self.base, [[allocation_size(size), False]]]
            self.base += allocation_size(size) + 64 * MiB
            self.segs.append(seg)
            addr, i = seg[2], 0
        block = seg[3][i]
        rest = block[0] - size
        if (rest >= 512) if small else (rest > MiB):
            seg[3][i : i + 1] = [[size, True], [rest, False]]
        else:
            block[1] = True
        return addr

    def free(self, addr):
        for seg in self.segs:
            off = seg[2]
            for i, b in enumerate(seg[3]):
                if off == addr:
                    b[1] = False
                    blocks = seg[3]
                    if i + 1 < len(blocks) and not blocks[i + 1][1]:
                        b[0] += blocks.pop(i + 1)[0]
                    if i > 0 and not blocks[i - 1][1]:
                        blocks[i - 1][0] += blocks.pop(i)[0]
                    return
                off += b[0]

    def layout(self):
        return [[tuple(b) for b in s[3]] for s in self.segs]


def _layout(pool):
    out = []
    for seg in pool.segments():
        blocks, ptr = [], seg.offset
        free = dict(pool.free_extents())
        live = {a.offset: a.size_bytes for a in _layout.live}
        while ptr < seg.end:
            if ptr in free:
                blocks.append((free[ptr], False))
                ptr += free[ptr]
            else:
                blocks.append((live[ptr], True))
                ptr += live[ptr]
        out.append(blocks)
    return out


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.booleans(),
            st.integers(1, 24 * MiB),
            st.sampled_from([0, 0, 1]),
            st.integers(0, 1 << 16),
        ),
        max_size=60,
    )
)
def test_layout_matches_a_brute_force_model_of_the_rules(ops):
    pool, model = TorchCaching(), _Model()
    live, addrs = [], []
    for is_alloc, n, stream, pick in ops:
        if is_alloc or not live:
            live.append(pool.allocate(n, stream=stream))
            addrs.append(model.malloc(n, stream))
        else:
            k = pick % len(live)
            pool.free(live.pop(k))
            model.free(addrs.pop(k))
        _layout.live = live
        assert _layout(pool) == model.layout()
    check_invariants(pool, live)


# ----------------------------------------------------------------- the free-block index
def _assert_index_consistent(pool: TorchCaching) -> None:
    """Every cached block sits in its own (pool, small, stream) list, which ``_Block.keys`` and,
    for the default pool, ``_default_keys`` name; every key is a cached block's."""
    for b in pool._free_at.values():
        keys = pool._keys[(b.pool, b.small, b.stream)]
        assert b.keys is keys and b.size << 64 | b.ptr in keys
    for (in_pool, small, stream), keys in pool._keys.items():
        assert keys == sorted(keys)
        assert all(pool._free_at[k & ((1 << 64) - 1)].keys is keys for k in keys)
        if in_pool == (0, 0):
            assert pool._default_keys[small][stream] is keys
    assert sum(len(k) for k in pool._keys.values()) == len(pool._free_at)


@settings(max_examples=60, deadline=None)
@given(
    expandable=st.booleans(),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "alloc", "alloc", "free", "free", "capture", "end", "empty"]),
            st.integers(1, 24 * MiB),
            st.integers(0, 2),
            st.integers(0, 1000),
        ),
        max_size=80,
    ),
)
def test_the_free_block_index_stays_consistent_over_streams_pools_and_empty_cache(expandable, ops):
    pool = TorchCaching(expandable_segments=expandable, capacity_bytes=256 * MiB)
    live, captures, pool_ids = [], [], itertools.count(1)

    def alloc(nbytes, stream, pick):
        a = pool.allocate(nbytes, stream=stream)
        live.extend([a] if a is not None else [])

    def capture(nbytes, stream, pick):
        captures.append((next(pool_ids), 0))  # a fresh private pool id: a released one is refused
        pool.begin_allocate_to_pool(captures[-1], stream)

    def end(nbytes, stream, pick):
        pool_id = captures.pop(pick % len(captures))
        pool.end_allocate_to_pool(pool_id)
        pool.release_pool(pool_id)

    steps = {
        "alloc": alloc,
        "free": lambda nbytes, stream, pick: pool.free(live.pop(pick % len(live))),
        "capture": capture,
        "end": end,
        "empty": lambda nbytes, stream, pick: pool.empty_cache(),
    }
    for op, nbytes, stream, pick in ops:
        if (op != "free" or live) and (op != "end" or captures):
            steps[op](nbytes, stream, pick)
        _assert_index_consistent(pool)
        assert pool.gauges()[4] == len(pool.segments())  # expandable: its runs, counted apart
    check_invariants(pool, live)


@pytest.mark.parametrize("request_mib", [13, 20])
def test_a_split_rest_keeps_its_block_place_in_the_index_or_moves_before_a_larger_key(request_mib):
    """A cached 30 MiB segment split for a request: its rest (17 or 10 MiB) takes the block's
    place in the free-key list when the key before it (a cached 12 MiB block) is smaller (13),
    else it moves before that one (20); either way the index stays sorted and whole."""
    pool = TorchCaching()
    p = pool.allocate(8 * MiB)  # a 20 MiB segment: p, then a 12 MiB cached block
    r = pool.allocate(30 * MiB)  # a segment of its own, cached whole once freed
    pool.free(r)
    a = pool.allocate(request_mib * MiB)
    assert a.offset == r.offset  # the best fit: the 30 MiB block (the 12 MiB one is too small)
    rest_bytes = (30 - request_mib) * MiB
    rest = pool._free_at[r.offset + request_mib * MiB]
    assert rest.size == rest_bytes
    sizes = [k >> 64 for k in rest.keys]
    assert sizes == sorted([12 * MiB, rest_bytes])
    _assert_index_consistent(pool)
    check_invariants(pool, [p, a])
