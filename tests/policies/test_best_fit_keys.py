"""BestFit's index keys are sized to the pool (an offset field as wide as the highest segment
end), so that the compiled build bisects C integers: placements stay best fit wherever the
segments lie, the keys are re-made when a segment ends past the field, and a pool whose keys
cannot fit 63 bits takes the generic path (tests/policies/test_compiled.py runs these compiled,
where the index keeps no keys, only its blocks in the keys' order: ``BestFit._keyless``)."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies._blocks import Block
from policies.best_fit import BestFit
from policies.device import VirtualDevice

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


class _OffsetDevice(VirtualDevice):
    """A ``VirtualDevice`` whose offsets start at ``base`` (device pointers, not a pool's own
    addresses from 2 MiB up); ``base`` may be moved between reservations."""

    def __init__(self, base: int, limit_bytes: int | None = None):
        super().__init__(max_bytes=1 << 62, limit_bytes=limit_bytes)
        self.base = base

    def reserve(self, nbytes: int) -> int | None:
        offset = super().reserve(nbytes)
        return None if offset is None else offset + self.base

    def release(self, offset: int, nbytes: int) -> None:
        super().release(offset - self.base, nbytes)


def _check_placement(p: BestFit, n: int, stream: int):
    """Allocate ``n`` and check it lands where a brute-force best-fit scan says."""
    size = -(-n // 256) * 256
    fits = [
        ((b.size, b.offset), b.offset)
        for b in p.blocks()
        if b.free and b.size >= size and b.segment.stream == stream
    ]
    a = p.allocate(n, stream=stream)
    if fits:
        assert a.offset == min(fits)[1]
    else:
        assert a.offset == p.segments()[-1].offset  # grew: placed at the new segment's start
    return a


# a rare request of GiBs gets a segment too large for 63-bit keys above 2**40 (the generic path)
_SIZES = st.one_of(
    st.integers(1, 8 * KiB),
    st.integers(1, 256 * KiB),
    st.integers(1, 2 * MiB),
    st.sampled_from([3 * GiB, 1]),
)


@pytest.mark.parametrize("base", [0, 1 << 40, 1 << 62], ids=["low", "2**40", "2**62"])
@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), _SIZES, st.sampled_from([0, 0, 3])), max_size=100))
def test_places_best_fit_wherever_the_segments_lie(base, ops):
    p = BestFit(segment_bytes=1 * MiB, device=_OffsetDevice(base))
    live = []
    for is_alloc, n, stream in ops:
        if is_alloc or not live:
            live.append(_check_placement(p, n, stream))
        else:
            p.free(live.pop(n % len(live)))
        p.check_invariants()  # the keys are exactly the free blocks', sorted
    for a in live:
        p.free(a)
    p.check_invariants()


def test_the_hot_lists_follow_the_stream_in_use_and_a_reset():
    """The hot paths keep the lists of the stream they used last (``_hot_keys``, ``_hot_blocks``:
    one identity test instead of two dict lookups a call). Streams that alternate, and stream ids
    that are equal but distinct int objects (past CPython's cached small ints), still place best
    fit and leave the index as the dicts say; a reset forgets the hot stream."""
    p = BestFit(segment_bytes=1 * MiB)
    base = 1 << 40
    live = []
    for i in range(90):
        stream = int(
            str(base + i % 3)
        )  # a fresh int object each call, equal to the last one of its stream
        live.append(_check_placement(p, 1000 + 4099 * (i % 7), stream))
        assert p._hot_stream == stream
        if i % 3 == 2:
            p.free(live.pop(i % len(live)))  # maybe another stream's block: that stream becomes hot
        p.check_invariants()  # the hot lists are the dicts' lists of the hot stream
    assert sorted(p._blocks_by_stream) == [base, base + 1, base + 2]
    p.reset()
    assert p._hot_stream != base and p._hot_keys is None and p._hot_blocks is None
    p.free(_check_placement(p, 5000, base))
    p.check_invariants()
    for fresh in (
        copy.deepcopy(BestFit()),
        pickle.loads(pickle.dumps(BestFit())),
    ):  # a copy of the sentinel
        fresh.check_invariants()
        fresh.free(fresh.allocate(5000))
        fresh.check_invariants()


def test_a_segment_past_the_offset_field_re_keys_the_free_blocks():
    device = _OffsetDevice(0)
    p = BestFit(segment_bytes=1 * MiB, device=device)
    low = [p.allocate(n * 4 * KiB) for n in (1, 2, 3, 4, 5, 6)]
    for a in low[::2]:
        p.free(a)  # free blocks of 4, 12 and 20 KiB in the low segment, and its tail
    device.base = 1 << 45
    far = p.allocate(2 * MiB)  # no free block holds it: a segment far above the others
    assert far.offset >= 1 << 45
    p.check_invariants()
    assert p.allocate(10 * KiB).offset == low[2].offset  # the 12 KiB block: still the best fit
    p.free(far)
    p.check_invariants()
    assert p.largest_free_bytes() == p.segments()[-1].nbytes
    assert p.allocate(1 * MiB + 4 * KiB).offset == far.offset  # the far segment, whole again


def test_a_pool_whose_keys_cannot_fit_63_bits_still_places_best_fit():
    p = BestFit(segment_bytes=1 * MiB, device=_OffsetDevice(1 << 62))
    a, b, c = (p.allocate(n * KiB) for n in (64, 16, 64))
    p.free(a)
    p.free(c)  # merges with the segment's tail
    assert p.allocate(8 * KiB).offset == a.offset  # 64 KiB is the smallest free block
    p.free(b)
    p.check_invariants()
    assert p.largest_free_bytes() == 1 * MiB - 8 * KiB


class _NoRequestLimit(BestFit):
    """Best fit on a device that takes any request, however large (past C 64-bit integers)."""

    def _reset_state(self):
        super()._reset_state()
        self._max_request_bytes = 1 << 200


@pytest.mark.parametrize(
    "nbytes",
    [(1 << 63) - 1, (1 << 63) - 256, 1 << 63, 1 << 70],
    ids=["2**63-1", "2**63-256", "2**63", "2**70"],
)
def test_a_request_near_or_past_2_63_bytes_is_refused_without_an_overflow(nbytes):
    # compiled, the hot path rounds in C: a request within the mask of 2**63 must not reach it
    p = _NoRequestLimit(
        segment_bytes=1 * MiB, alignment_bytes=512, device=VirtualDevice(limit_bytes=64 * MiB)
    )
    small = p.allocate(1000)
    assert p.allocate(nbytes) is None  # the device refuses it; the pool does not overflow
    assert p.num_failures == 1 and small.size_bytes == 1024
    p.free(small)
    assert p.allocate(700).size_bytes == 1024
    p.check_invariants()


class _CountsKeys(BestFit):
    """Best fit whose key is its own method (the same layout), counting the keys it makes."""

    num_keys = 0

    def _key(self, size, offset):
        type(self).num_keys += 1
        return super()._key(size, offset)


def test_a_subclass_with_its_own_key_takes_the_generic_path_that_makes_keys_with_it():
    from policies import testing
    from policies._blocks import ContiguousPolicy

    assert (
        BestFit._allocate is not ContiguousPolicy._allocate
    )  # BestFit's own, with the key inlined
    assert (
        _CountsKeys._allocate is ContiguousPolicy._allocate
        and _CountsKeys._free is ContiguousPolicy._free
    )
    testing.check_policy(_CountsKeys)
    pool = _CountsKeys(segment_bytes=2 * MiB)
    _CountsKeys.num_keys = 0
    a = pool.allocate(64 * KiB)  # the segment's rest goes back into the index under a key of ours
    pool.free(a)
    assert _CountsKeys.num_keys >= 2


def test_the_index_keeps_keys_interpreted_and_for_an_index_of_its_own_only():
    from policies import best_fit
    from policies.cupy_pool import CupyPool
    from policies.vmm_stitch import VmmStitch
    from policies.worst_fit import WorstFit

    compiled = not best_fit.__file__.endswith(".py")  # an extension module
    assert BestFit._keyless is compiled  # compiled: the blocks lists alone
    # best fit's own index (and hot paths) in its subclasses; worst fit's keys are its own
    assert CupyPool._keyless is VmmStitch._keyless is compiled
    assert WorstFit._keyless is False and _CountsKeys._keyless is False
    for cls in (BestFit, WorstFit, _CountsKeys):
        p = cls(segment_bytes=1 * MiB)
        p.free(p.allocate(5000))
        assert (p._keys_by_stream is None) is cls._keyless
        p.check_invariants()


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(
        st.tuples(st.integers(1, 64), st.integers(0, 3000)),  # within the segment
        min_size=1,
        max_size=40,
        unique_by=lambda e: e[1],
    ),
    pick=st.integers(0, 1 << 16),
    growth=st.integers(1, 1000),
    cls=st.sampled_from([BestFit, _CountsKeys]),
)
def test_a_grown_block_is_found_under_its_old_size_and_re_placed(entries, pick, growth, cls):
    """``_index_resize(block, old_size)`` runs after ``block.size`` grew: the keyless index finds
    it by bisecting on the old ``(size, offset)`` (every entry before it is below that pair, the
    grown block and every entry after it are not), takes it out and puts it back in order."""
    p = cls(segment_bytes=1 * MiB)
    seg = p._reserve_segment(1 * MiB, 0)
    p._fit_keys(seg)
    blocks = [
        Block(seg.offset + offset * 256, size * 256, seg) for size, offset in entries
    ]  # free blocks of one stream (not a tiling of the segment: only the index is checked)
    for b in blocks:
        p._index_add(b)
    indexed = p._blocks_by_stream[0]
    assert indexed == sorted(blocks, key=lambda b: (b.size, b.offset))
    block = indexed[pick % len(indexed)]
    old_size = block.size
    block.size += growth * 256
    p._index_resize(block, old_size)
    assert indexed == sorted(blocks, key=lambda b: (b.size, b.offset))
    assert indexed.count(block) == 1 and len(indexed) == len(blocks)
    if not p._keyless:
        assert p._keys_by_stream[0] == [p._key(b.size, b.offset) for b in indexed]
