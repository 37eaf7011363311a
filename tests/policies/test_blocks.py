"""The machinery every contiguous policy shares (policies/_blocks.py).

Each behaviour runs on both built-ins and on ``LinearFirstFit``, a minimal index defined here
that exercises the base class's default ``_take``, ``_index_resize`` and ``_index_largest_bytes``.
"""

from __future__ import annotations

import gzip
import pickle
from bisect import bisect_left

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import PolicyError
from policies._blocks import Block, ContiguousPolicy, bisect_blocks
from policies.base import Allocation, Segment
from policies.best_fit import BestFit
from policies.first_fit import FirstFit
from policies.worst_fit import WorstFit
from traces.bundled import bundled_path

KiB = 1 << 10
MiB = 1 << 20


class LinearFirstFit(ContiguousPolicy):
    """First fit by a linear scan over a dict of free blocks: the smallest possible index."""

    name = "linear-first-fit"

    def _index_reset(self) -> None:
        self._free_blocks: dict[int, Block] = {}

    def _index_add(self, block: Block) -> None:
        self._free_blocks[block.offset] = block

    def _index_remove(self, block: Block) -> None:
        del self._free_blocks[block.offset]

    def _find(self, size: int, stream: int) -> Block | None:
        fits = [
            b for b in self._free_blocks.values() if b.size >= size and b.segment.stream == stream
        ]
        return min(fits, key=lambda b: b.offset, default=None)


@pytest.fixture(params=[FirstFit, BestFit, LinearFirstFit], ids=lambda c: c.__name__)
def cls(request):
    return request.param


def _snapshot(p: ContiguousPolicy) -> tuple:
    s = p.stats().as_dict()
    s.pop("num_failures")
    return s, p.free_extents(), [(seg.offset, seg.nbytes, seg.num_live) for seg in p.segments()]


# ----------------------------------------------------------------- knobs
def test_knobs_are_stored_unchanged(cls):
    p = cls(
        segment_bytes=4 * MiB,
        alignment_bytes=1024,
        granularity_bytes=3072,
        split_threshold_bytes=8 * KiB,
        capacity_bytes=64 * MiB,
    )
    assert p.get_params() == {
        "segment_bytes": 4 * MiB,
        "alignment_bytes": 1024,
        "granularity_bytes": 3072,
        "split_threshold_bytes": 8 * KiB,
        "virtual": False,
        "capacity_bytes": 64 * MiB,
    }


def test_defaults_are_32mib_segments_256b_alignment():
    p = FirstFit()
    assert (p.segment_bytes, p.alignment_bytes, p.granularity_bytes, p.split_threshold_bytes) == (
        32 * MiB,
        256,
        None,
        None,
    )
    assert FirstFit.coalesces and BestFit.coalesces and FirstFit.contiguous


@pytest.mark.parametrize(
    "knobs, named",
    [
        ({"alignment_bytes": 0}, "alignment_bytes"),
        ({"alignment_bytes": 768}, "alignment_bytes"),
        ({"segment_bytes": 1000}, "segment_bytes"),
        ({"segment_bytes": 0}, "segment_bytes"),
        ({"segment_bytes": True}, "segment_bytes"),
        ({"split_threshold_bytes": 0}, "split_threshold_bytes"),
        ({"split_threshold_bytes": 1.5}, "split_threshold_bytes"),
    ],
)
def test_bad_knob_raises_policy_error_naming_it(cls, knobs, named):
    with pytest.raises(PolicyError, match=named):
        cls(**knobs)


# ----------------------------------------------------------------- rounding and splitting
@pytest.mark.parametrize(
    "nbytes, alignment, expected",
    [(1, 512, 512), (512, 512, 512), (513, 512, 1024), (1, 4096, 4096), (5000, 4096, 8192)],
)
def test_request_size_is_rounded_up_to_alignment(cls, nbytes, alignment, expected):
    a = cls(alignment_bytes=alignment).allocate(nbytes)
    assert (a.nbytes, a.size_bytes, a.extents) == (nbytes, expected, ((a.offset, expected),))


def test_first_request_grows_one_segment_and_splits_it(cls):
    p = cls(segment_bytes=1 * MiB)
    a = p.allocate(1000)
    (seg,) = p.segments()
    assert a.offset == seg.offset and seg.nbytes == 1 * MiB and seg.num_live == 1
    assert p.free_extents() == [(seg.offset + 1024, MiB - 1024)]
    assert isinstance(a.handle, Block) and a.handle.segment is seg


def test_remainder_below_split_threshold_stays_with_the_allocation(cls):
    p = cls(segment_bytes=1 * MiB, split_threshold_bytes=64 * KiB)
    a = p.allocate(MiB - 32 * KiB)
    assert a.size_bytes == MiB and p.free_extents() == []
    assert p.stats().allocated_bytes == MiB and p.stats().live_bytes == MiB - 32 * KiB


def test_remainder_equal_to_split_threshold_is_split_off(cls):
    p = cls(segment_bytes=1 * MiB, split_threshold_bytes=64 * KiB)
    a = p.allocate(MiB - 64 * KiB)
    assert a.size_bytes == MiB - 64 * KiB and p.free_extents() == [
        (a.offset + a.size_bytes, 64 * KiB)
    ]


def test_freeing_an_unsplit_block_returns_all_of_it(cls):
    p = cls(segment_bytes=1 * MiB, split_threshold_bytes=64 * KiB)
    p.free(p.allocate(MiB - 32 * KiB))
    assert p.free_extents() == [(p.segments()[0].offset, MiB)] and p.stats().allocated_bytes == 0


# ----------------------------------------------------------------- coalescing
def _four_blocks(cls):
    """Four 4 KiB allocations a, b, c, d at the start of a 1 MiB segment, the rest free."""
    p = cls(segment_bytes=1 * MiB)
    return p, [p.allocate(4 * KiB) for _ in range(4)]


def test_free_coalesces_with_left_neighbour(cls):
    p, (a, b, c, d) = _four_blocks(cls)
    p.free(a)
    p.free(b)
    assert p.free_extents()[0] == (a.offset, 8 * KiB)
    p.check_invariants()


def test_free_coalesces_with_right_neighbour(cls):
    p, (a, b, c, d) = _four_blocks(cls)
    p.free(b)
    p.free(a)
    assert p.free_extents()[0] == (a.offset, 8 * KiB)
    p.check_invariants()


def test_free_coalesces_with_both_neighbours(cls):
    p, (a, b, c, d) = _four_blocks(cls)
    p.free(a)
    p.free(c)
    p.free(b)
    assert p.free_extents()[0] == (a.offset, 12 * KiB) and len(p.free_extents()) == 2
    p.check_invariants()


def test_freeing_the_block_before_the_free_tail_merges_into_it(cls):
    p, (a, b, c, d) = _four_blocks(cls)
    p.free(d)
    assert p.free_extents() == [(d.offset, MiB - 12 * KiB)]


def test_freeing_everything_leaves_one_free_block_per_segment(cls):
    p, allocs = _four_blocks(cls)
    for a in (allocs[2], allocs[0], allocs[3], allocs[1]):
        p.free(a)
    (seg,) = p.segments()
    assert p.free_extents() == [(seg.offset, MiB)] and seg.num_live == 0 and seg.handle.next is None


def test_largest_free_bytes_is_the_largest_hole(cls):
    p, (a, b, c, d) = _four_blocks(cls)
    p.free(d)
    assert p.largest_free_bytes() == MiB - 12 * KiB
    p.allocate(MiB - 12 * KiB)
    p.free(a)
    p.free(b)
    assert p.largest_free_bytes() == 8 * KiB and p.stats().frag_ext == 0.0


# ----------------------------------------------------------------- growth and shrink
def test_miss_reserves_a_new_segment_and_places_there(cls):
    p = cls(segment_bytes=1 * MiB)
    p.allocate(768 * KiB)
    b = p.allocate(512 * KiB)
    first, second = p.segments()
    assert b.offset == second.offset and second.nbytes == MiB and p.stats().num_grows == 2


def test_oversize_request_gets_its_own_segment_rounded_to_2mib(cls):
    p = cls(segment_bytes=1 * MiB)
    a = p.allocate(5 * MiB + 1)
    (seg,) = p.segments()
    assert seg.nbytes == 6 * MiB and a.offset == seg.offset and a.size_bytes == 5 * MiB + 256
    assert p.free_extents() == [(seg.offset + 5 * MiB + 256, MiB - 256)]


def test_grow_adds_a_free_segment(cls):
    p = cls(segment_bytes=1 * MiB)
    assert p.grow(100) and p.grow(3 * MiB)
    assert [s.nbytes for s in p.segments()] == [MiB, 4 * MiB]
    assert [length for _, length in p.free_extents()] == [MiB, 4 * MiB]
    a = p.allocate(2 * MiB)  # served from the grown segment, no new reservation
    assert p.stats().num_grows == 2 and a.offset == p.segments()[1].offset


def test_capacity_refusal_returns_none_and_changes_nothing(cls):
    p = cls(segment_bytes=1 * MiB, capacity_bytes=2 * MiB)
    p.allocate(768 * KiB)
    p.allocate(768 * KiB)
    before = _snapshot(p)
    assert p.allocate(512 * KiB) is None
    assert _snapshot(p) == before and p.stats().num_failures == 1
    p.check_invariants()


def test_capacity_refusal_trims_fully_free_segments_and_retries(cls):
    p = cls(segment_bytes=1 * MiB, capacity_bytes=2 * MiB)
    p.allocate(768 * KiB)
    p.free(p.allocate(768 * KiB))  # the second segment is now fully free
    a = p.allocate(64 * KiB, stream=1)  # no stream-1 block: needs a segment, only after trimming
    assert a is not None and p.stats().num_shrinks == 1 and p.stats().reserved_bytes == 2 * MiB
    p.check_invariants()


def test_trim_releases_only_fully_free_segments(cls):
    p = cls(segment_bytes=1 * MiB)
    keep = p.allocate(768 * KiB)
    p.free(p.allocate(768 * KiB))
    p.grow(1)
    assert p.trim() == 2 * MiB
    (seg,) = p.segments()
    assert seg.offset == keep.offset and p.free_extents() == [(keep.offset + 768 * KiB, 256 * KiB)]
    assert p.stats().num_shrinks == 2 and p.stats().shrunk_bytes == 2 * MiB
    p.check_invariants()


def test_trim_stops_once_max_bytes_are_released(cls):
    p = cls(segment_bytes=1 * MiB)
    p.grow(1)
    p.grow(1)
    assert p.trim(1) == MiB and len(p.segments()) == 1
    assert p.trim(0) == 0 and len(p.segments()) == 1


def test_freed_space_is_reused_without_growing(cls):
    p = cls(segment_bytes=1 * MiB)
    a = p.allocate(300 * KiB)
    p.allocate(300 * KiB)
    p.free(a)
    assert p.allocate(200 * KiB).offset == a.offset and p.stats().num_grows == 1


def test_blocks_serve_only_their_own_stream(cls):
    p = cls(segment_bytes=1 * MiB)
    p.free(p.allocate(4 * KiB, stream=0))
    b = p.allocate(4 * KiB, stream=1)
    assert (
        len(p.segments()) == 2
        and b.offset == p.segments()[1].offset
        and p.segments()[1].stream == 1
    )


def test_reset_releases_everything(cls):
    p = cls(segment_bytes=1 * MiB)
    p.allocate(4 * KiB)
    p.reset()
    assert p.segments() == [] and p.free_extents() == [] and p.largest_free_bytes() == 0
    assert p.allocate(4 * KiB) is not None
    p.check_invariants()


def test_double_free_raises_and_changes_nothing(cls):
    p, (a, b, c, d) = _four_blocks(cls)
    p.free(b)
    before = _snapshot(p)
    with pytest.raises(PolicyError, match="double free"):
        p.free(b)
    assert _snapshot(p) == before


def test_block_is_slotted_and_compared_by_identity():
    seg = Segment(0, MiB)
    a, b = Block(0, MiB, seg), Block(0, MiB, seg)
    assert a != b and a == a and not hasattr(a, "__dict__") and a.end == MiB


# ----------------------------------------------------------------- properties
_SIZES = st.one_of(st.integers(1, 16 * KiB), st.integers(1, 512 * KiB), st.integers(1, 3 * MiB))
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), _SIZES, st.sampled_from([0, 0, 0, 7])),
        st.tuples(st.just("free"), st.integers(0, 10_000), st.just(0)),
        st.tuples(st.just("trim"), st.sampled_from([None, 1, 2 * MiB]), st.just(0)),
        st.tuples(st.just("grow"), st.integers(1, 3 * MiB), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(
    ops=_OPS,
    policy=st.sampled_from([FirstFit, BestFit, LinearFirstFit]),
    threshold=st.sampled_from([None, 4 * KiB, 256 * KiB]),
    capacity=st.sampled_from([None, 4 * MiB, 8 * MiB]),
)
def test_random_operations_keep_every_invariant(ops, policy, threshold, capacity):
    p = policy(segment_bytes=1 * MiB, split_threshold_bytes=threshold, capacity_bytes=capacity)
    live = []
    for op, arg, stream in ops:
        if op == "alloc":
            a = p.allocate(arg, stream=stream)
            if a is not None:
                live.append(a)
        elif op == "free" and live:
            p.free(live.pop(arg % len(live)))
        elif op == "trim":
            p.trim(arg)
        elif op == "grow":
            p.grow(arg)
        p.check_invariants()
    # live allocations: disjoint, each inside one segment of its stream, exactly the used blocks
    spans = sorted((a.offset, a.offset + a.size_bytes) for a in live)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for a in live:
        seg = a.handle.segment
        assert (
            seg.offset <= a.offset and a.offset + a.size_bytes <= seg.end and seg.stream == a.stream
        )
    used = sorted((b.offset, b.offset + b.size) for b in p.blocks() if not b.free)
    assert used == spans
    s = p.stats()
    assert s.free_bytes == sum(length for _, length in p.free_extents())
    assert s.allocated_bytes == sum(a.size_bytes for a in live) and s.num_live == len(live)


def _llama_slice_ops() -> list[tuple[bool, int, int]]:
    """The bundled PyTorch snapshot slice (one real ``generate`` call) as (is_alloc, address,
    size)."""
    with gzip.open(bundled_path("llama1b_generate_slice.pickle.gz")) as f:
        snapshot = pickle.load(f)
    return [
        (e["action"] == "alloc", e["addr"], e["size"])
        for e in snapshot["device_traces"][0]
        if e["action"] in ("alloc", "free_completed")
    ]


@pytest.mark.parametrize("policy", [FirstFit, BestFit])
def test_real_trace_replay_keeps_invariants_and_reuses_memory(policy):
    p = policy()
    live = {}
    for is_alloc, addr, size in _llama_slice_ops():
        if is_alloc:
            live[addr] = p.allocate(size)
        elif addr in live:  # frees of blocks allocated before recording began are skipped
            p.free(live.pop(addr))
    p.check_invariants()
    s = p.stats()
    assert s.num_allocs > 10_000 and s.num_failures == 0 and s.num_live == len(live)
    assert s.peak_allocated_bytes <= s.peak_reserved_bytes < 2 * s.peak_allocated_bytes


_ORACLE_SIZES = st.one_of(
    st.integers(1, 8 * KiB), st.integers(1, 256 * KiB), st.integers(1, 2 * MiB)
)

#: Each placement rule as the key a brute-force scan minimises over the free blocks that fit.
_PLACEMENT_RULES = {
    FirstFit: lambda b: (b.offset,),  # lowest address
    BestFit: lambda b: (b.size, b.offset),  # smallest block, then lowest address
    WorstFit: lambda b: (-b.size, b.offset),  # largest block, then lowest address
}


@pytest.mark.parametrize("cls", list(_PLACEMENT_RULES), ids=lambda c: c.name)
@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), _ORACLE_SIZES, st.sampled_from([0, 0, 3])), max_size=120)
)
def test_places_exactly_where_a_brute_force_scan_would(cls, ops):
    rule = _PLACEMENT_RULES[cls]
    p = cls(segment_bytes=1 * MiB)
    live = []
    for is_alloc, n, stream in ops:
        if is_alloc or not live:
            size = -(-n // 256) * 256
            # (key, offset) taken now: allocate() reshapes the Block objects themselves
            fits = [
                (rule(b), b.offset)
                for b in p.blocks()
                if b.free and b.size >= size and b.segment.stream == stream
            ]
            a = p.allocate(n, stream=stream)
            if fits:
                assert a.offset == min(fits)[1]
            else:
                assert (
                    a.offset == p.segments()[-1].offset
                )  # grew: placed at the new segment's start
            live.append(a)
        else:
            p.free(live.pop(n % len(live)))
        p.check_invariants()


def test_an_allocation_is_its_block_and_a_freed_one_is_never_handed_out_again(cls):
    p = cls(segment_bytes=1 * MiB)
    a = p.allocate(300 * KiB)
    assert isinstance(a, Block) and a.handle is a and a.extents == ((a.offset, a.size_bytes),)
    where = a.offset
    p.free(a)
    b = p.allocate(300 * KiB)  # the same place, a new object
    assert b is not a and b.offset == where
    assert a.offset == where and a.extents == (
        (where, 300 * KiB),
    )  # a freed allocation never moves
    with pytest.raises(PolicyError, match="double free"):
        p.free(a)
    assert b.live and p.stats().num_live == 1
    p.check_invariants()


def test_a_block_is_its_handle_only_while_handed_out(cls):
    """``handle`` is Allocation's field (so the compiled build can declare ``Block`` a cdef
    class): the block itself while live, None once freed (no cycle) and on a block never handed
    out."""
    p = cls(segment_bytes=1 * MiB)
    a, b = p.allocate(100 * KiB), p.allocate(200 * KiB)
    assert a.handle is a and b.handle is b
    assert [blk.handle for blk in p.blocks() if blk.free] == [None]  # the segment's free tail
    p.free(a)
    assert a.handle is None and b.handle is b
    assert (
        Allocation.offset.__get__(b) == b.offset == b.extents[0][0]
    )  # the field and the extent agree
    p.free(b)
    assert b.handle is None and all(blk.handle is None for blk in p.blocks())
    p.check_invariants()


def test_a_freed_block_merges_into_a_free_block_above_that_was_never_handed_out(cls):
    """``merge_down``: the free block above (never handed out) moves down over the freed one and
    stays the merged range's block, so the next split cuts it in place (no fresh block for the
    rest); the freed block leaves the chain and a stale reference to it still fails."""
    p = cls(segment_bytes=1 * MiB)
    a = p.allocate(100 * KiB)
    rest = a.next
    assert rest.free and not rest.size_bytes  # the segment's own block, never handed out
    p.free(a)
    seg = a.segment
    assert seg.handle is rest and rest.offset == seg.offset and rest.size == seg.nbytes
    assert a.prev is None and a.next is None and a.handle is None
    p.check_invariants()
    b = p.allocate(200 * KiB)
    assert b.next is rest and rest.offset == b.offset + b.size_bytes  # split in place
    with pytest.raises(PolicyError):
        p.free(a)
    # below a live block, the same: the survivor links to it
    c = p.allocate(100 * KiB)
    p.free(c)
    assert b.next is rest and rest.prev is b and rest.offset == b.offset + b.size_bytes
    p.check_invariants()


def test_a_freed_block_merges_into_a_handed_out_free_block_above_as_before(cls):
    """A free block above that was handed out before does not move: the freed block absorbs it."""
    p = cls(segment_bytes=1 * MiB)
    a, b, c = p.allocate(100 * KiB), p.allocate(100 * KiB), p.allocate(100 * KiB)
    p.free(b)  # free now, but handed out before: it never moves
    p.free(a)  # so a, below it, absorbs it (the lowest block survives)
    assert a.segment.handle is a and a.free and a.size == 200 * KiB and a.next is c
    p.check_invariants()


def test_a_wrapped_block_is_freed_through_its_handle(cls):
    """A subclass's allocation around a block (``handle=block``) frees it as the block would."""
    p = cls(segment_bytes=1 * MiB)
    a = p.allocate(100 * KiB)
    wrapper = Allocation(a.nbytes, a.size_bytes, a.extents, a.stream, a.tag, a)
    p._free(wrapper)  # the hook a subclass's own free calls (vmm-stitch frees its chunks so)
    assert a.handle is None and p.allocated_bytes == 0
    seg = a.segment
    assert seg.handle.free and seg.handle.size == seg.nbytes, "the segment is one free block again"
    p.check_invariants()


def test_the_inlined_policies_keep_their_knobs_and_hot_paths():
    for policy_cls in (BestFit, FirstFit):
        assert policy_cls._allocate is not ContiguousPolicy._allocate, policy_cls
        assert policy_cls._free is not ContiguousPolicy._free, policy_cls
        assert policy_cls(alignment_bytes=512).get_params()["alignment_bytes"] == 512


def test_a_subclass_with_its_own_index_gets_the_generic_paths():
    assert (
        WorstFit._free is ContiguousPolicy._free
        and WorstFit._allocate is ContiguousPolicy._allocate
    )
    assert BestFit._free is not ContiguousPolicy._free
    assert LinearFirstFit._free is ContiguousPolicy._free


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(st.integers(1, 64), st.integers(0, 1 << 20)), unique_by=lambda b: b[1]
    ),
    size=st.integers(0, 65),
    offset=st.integers(0, (1 << 20) + 1),
)
def test_bisect_blocks_is_bisect_left_over_best_fits_keys(blocks, size, offset):
    """Best fit's compiled hot paths find positions by ``bisect_blocks`` over the blocks' own
    size and offset: the position ``bisect_left`` gives over the index's keys (size above offset),
    at every probe, between and on the blocks (compiled too: test_compiled runs this file)."""
    seg = Segment(0, 1 << 30, 0)
    index = sorted(blocks)
    free_blocks = [Block(o, s * 256, seg) for s, o in index]
    keys = [s * 256 << 21 | o for s, o in index]
    assert bisect_blocks(free_blocks, size * 256, offset) == bisect_left(
        keys, size * 256 << 21 | offset
    )
    for i, (s, o) in enumerate(index):  # every block is found at its own position
        assert bisect_blocks(free_blocks, s * 256, o) == i
