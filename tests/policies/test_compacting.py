"""The compaction adaptor (policies/compacting.py): moves, triggers, reports, and data kept
intact."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import policies
from policies.compacting import Compacting, Compaction
from policies.errors import PolicyError
from policies.testing import check_invariants

KiB = 1 << 10
MiB = 1 << 20


def compacting(**kw) -> Compacting:
    kw.setdefault("base", "best-fit:segment_bytes=1MiB")
    kw.setdefault("min_free_bytes", 0)
    kw.setdefault("check_every", 0)
    return Compacting(**kw)


def holes(p: Compacting, sizes: list[int], keep: slice = slice(1, None, 2)):
    """Allocate ``sizes`` in order, then free all but ``keep`` of them: holes between survivors."""
    allocs = [p.allocate(n) for n in sizes]
    kept = allocs[keep]
    for a in allocs:
        if a not in kept:
            p.free(a)
    return kept


class Moves:
    """An ``on_move`` that records what it is told."""

    def __init__(self):
        self.calls = []

    def __call__(self, a, old, new, nbytes):
        assert a.extents == ((new, nbytes),), "the handle is updated before the move is reported"
        self.calls.append((a, old, new, nbytes))


# ---------------------------------------------------------------------------- construction
def test_spec_round_trips_and_builds_the_base():
    p = policies.create(
        "compacting:base=[first-fit:segment_bytes=4MiB],threshold=0.3,idle_only=true"
    )
    assert (p.base_policy.name, p.base_policy.segment_bytes, p.threshold, p.idle_only) == (
        "first-fit",
        4 * MiB,
        0.3,
        True,
    )
    assert policies.create(p.spec).get_params() == p.get_params()


@pytest.mark.parametrize("base", ["paged", "size-class", "elastic", "tag-limits"])
def test_refuses_a_base_that_is_not_a_block_policy(base):
    with pytest.raises(PolicyError, match="block policy.*elastic:base=\\[compacting"):
        Compacting(base=base)


@pytest.mark.parametrize(
    "kw",
    [
        {"threshold": 1.5},
        {"threshold": True},
        {"idle_only": 1},
        {"check_every": -1},
        {"min_free_bytes": -1},
        {"base": 3},
    ],
)
def test_bad_knobs_raise_policy_error(kw):
    with pytest.raises(PolicyError):
        Compacting(**kw)


# ---------------------------------------------------------------------------- one pass
def test_slide_packs_live_blocks_at_the_segment_start_and_updates_handles():
    p = compacting()
    seg_start = p.allocate(100 * KiB).offset  # the first block stays where it is
    a, b, c = (p.allocate(100 * KiB) for _ in range(3))
    p.free(a)
    p.free(c)  # b sits alone between two holes
    rec = p.compact(force=True)
    assert b.extents == ((seg_start + 100 * KiB, 100 * KiB),) and b.handle.extents == b.extents
    assert rec.num_moves == 1 and rec.moved_bytes == 100 * KiB
    assert p.free_extents() == [(seg_start + 200 * KiB, MiB - 200 * KiB)]
    p.base_policy.check_invariants()


def test_moves_are_reported_in_order_with_old_and_new_offsets():
    p = compacting()
    moves = p.on_move = Moves()
    x, y = holes(p, [64 * KiB] * 4)  # live at 64K and 192K, holes at 0 and 128K
    old = (x.offset, y.offset)
    p.compact(force=True)
    assert [(a, o, n, size) for a, o, n, size in moves.calls] == [
        (x, old[0], old[0] - 64 * KiB, 64 * KiB),
        (y, old[1], old[1] - 128 * KiB, 64 * KiB),
    ]


def test_sparse_segment_is_emptied_into_the_others_and_released():
    p = compacting()
    full = [p.allocate(200 * KiB) for _ in range(4)]  # segment 1: 800 KiB used
    stray = p.allocate(300 * KiB)  # does not fit: segment 2
    p.free(full[1])  # segment 1 now has 424 KiB free in two pieces
    first, second = p.segments()
    rec = p.compact(force=True)
    assert (rec.num_released_segments, rec.released_bytes) == (1, MiB)
    assert p.segments() == [first] and stray.offset == first.offset + 600 * KiB
    assert p.stats().num_shrinks == 1
    check_invariants(p, [*full[:1], *full[2:], stray])
    p.base_policy.check_invariants()


def test_record_reports_fragmentation_and_largest_free_before_and_after():
    p = compacting()
    holes(p, [64 * KiB] * 8)
    s = p.stats()
    rec = p.compact(force=True)
    assert isinstance(rec, Compaction) and p.compactions == [rec]
    assert (rec.frag_before, rec.largest_free_before_bytes, rec.free_before_bytes) == (
        s.frag_ext,
        s.largest_free_bytes,
        s.free_bytes,
    )
    assert rec.frag_after == 0.0 and rec.largest_free_after_bytes == s.free_bytes
    assert rec.as_dict()["trigger"] == "explicit"


def test_a_packed_pool_is_left_alone():
    p = compacting()
    p.allocate(64 * KiB)
    assert p.compact(force=True) is None and p.compactions == []


def test_compact_needs_fragmentation_above_threshold_unless_forced():
    p = compacting(threshold=0.9)
    holes(p, [64 * KiB] * 4)  # free: two 64 KiB holes and the tail: fragmentation well below 0.9
    assert p.compact() is None
    assert p.compact(force=True) is not None


def test_compact_ignores_pools_with_little_free_memory():
    p = compacting(min_free_bytes=2 * MiB, threshold=0.0)
    holes(p, [64 * KiB] * 4)
    assert p.compact() is None


def test_blocks_stay_in_their_streams_segments():
    p = compacting()
    a0 = p.allocate(64 * KiB, stream=0)
    b1 = [p.allocate(600 * KiB, stream=1), p.allocate(64 * KiB, stream=1)]
    p.free(b1[0])
    lone = p.allocate(600 * KiB, stream=0)  # a second stream-0 segment, sparse
    p.free(a0)
    p.compact(force=True)
    for seg in p.segments():
        for a in [lone, b1[1]]:
            if seg.offset <= a.offset < seg.end:
                assert seg.stream == a.stream
    check_invariants(p, [lone, b1[1]])


# ---------------------------------------------------------------------------- triggers
def test_a_fragmented_failure_becomes_a_success():
    def run(spec):
        p = policies.create(spec, capacity_bytes=MiB)
        holes(p, [128 * KiB] * 8)  # 512 KiB free, in 128 KiB holes
        return p, p.allocate(256 * KiB)

    plain, refused = run("best-fit:segment_bytes=1MiB")
    comp, placed = run("compacting:base=[best-fit:segment_bytes=1MiB],check_every=0")
    assert refused is None and plain.stats().num_failures == 1
    assert placed is not None and comp.stats().num_failures == 0 and comp.num_rescues == 1
    assert comp.compactions[0].trigger == "failure"


def test_a_failure_slides_only_the_segment_that_frees_room_for_the_fewest_moved_bytes():
    p = compacting(capacity_bytes=2 * MiB)
    costly = [
        p.allocate(128 * KiB) for _ in range(8)
    ]  # segment 1: four 128 KiB holes, 512 KiB above them
    cheap = [
        p.allocate(128 * KiB) for _ in range(8)
    ]  # segment 2: a 256 KiB hole, 128 KiB above it, the tail
    for a in costly[0::2] + cheap[4:6] + cheap[7:]:
        p.free(a)
    before = [a.offset for a in costly]
    assert p.allocate(384 * KiB) is not None
    (rec,) = p.compactions
    assert (rec.trigger, rec.moved_bytes, rec.num_released_segments) == ("failure", 128 * KiB, 0)
    assert [a.offset for a in costly] == before  # the costlier segment was left alone


def test_a_failure_compaction_cannot_help_moves_nothing():
    p = compacting(capacity_bytes=MiB)
    holes(p, [128 * KiB] * 8)
    before = [(a.offset) for a in p._by_block.values()]
    assert p.allocate(768 * KiB) is None  # more than is free
    assert p.compactions == [] and [a.offset for a in p._by_block.values()] == before
    assert p.stats().num_failures == 1


def test_releasing_an_emptied_segment_makes_room_under_capacity():
    p = compacting(capacity_bytes=2 * MiB)
    seg1 = [p.allocate(256 * KiB) for _ in range(4)]
    seg2 = [p.allocate(256 * KiB) for _ in range(4)]
    for a in seg1[:2] + seg2[:3]:
        p.free(a)
    # 1.25 MiB free but no 1 MiB range; moving seg2's last block into seg1 empties seg2
    a = p.allocate(MiB)
    assert a is not None and p.num_rescues == 1 and p.compactions[0].num_released_segments == 1
    check_invariants(p, [*seg1[2:], seg2[3], a])


def test_idle_only_never_compacts_on_the_allocation_path():
    p = compacting(capacity_bytes=MiB, idle_only=True, check_every=1, threshold=0.0)
    holes(p, [128 * KiB] * 8)
    assert p.allocate(256 * KiB) is None and p.compactions == []
    assert p.compact() is not None
    assert p.allocate(256 * KiB) is not None


def test_threshold_check_runs_every_check_every_frees():
    p = compacting(check_every=3, threshold=0.2)
    allocs = [p.allocate(64 * KiB) for _ in range(8)]
    p.free(allocs[0])
    p.free(allocs[2])
    assert p.compactions == []
    p.free(allocs[4])  # the third free: fragmented, so a pass runs
    assert [r.trigger for r in p.compactions] == ["threshold"]


def test_modelled_time_is_the_cost_hook_over_every_move():
    p = compacting()
    p.copy_ns = lambda n: 1000 + n // KiB
    holes(p, [64 * KiB] * 6)  # three moves of 64 KiB
    rec = p.compact(force=True)
    assert rec.time_ns == 3 * (1000 + 64)
    assert p.take_compaction_ns() == rec.time_ns and p.take_compaction_ns() == 0


def test_cost_hook_defaults_to_the_devices_cost_model():
    from sim.replay.costs import CostedDevice, CostModel

    costs = CostModel.load()
    p = Compacting(base="best-fit:segment_bytes=1MiB", min_free_bytes=0, device=CostedDevice(costs))
    holes(p, [64 * KiB] * 4)
    assert p.compact(force=True).time_ns == 2 * costs.copy_ns(64 * KiB) > 0


def test_compaction_stats_add_up_the_passes():
    p = compacting(capacity_bytes=MiB)
    holes(p, [128 * KiB] * 8)
    p.allocate(256 * KiB)
    s = p.compaction_stats()
    assert s["num_compactions"] == 1 and s["num_failure_compactions"] == 1 and s["num_rescues"] == 1
    assert s["moved_bytes"] == p.compactions[0].moved_bytes > 0
    for _ in range(3):  # more passes: the running totals stay the rows' sums
        holes(p, [64 * KiB] * 4)
        p.compact(force=True)
    s, rows = p.compaction_stats(), p.compactions
    assert len(rows) > 1 and s["num_explicit_compactions"] == len(rows) - 1
    for name in ("num_moves", "moved_bytes", "released_bytes", "num_released_segments", "time_ns"):
        assert s[name] == sum(getattr(r, name) for r in rows)


def test_frozen_pool_compacts_but_keeps_emptied_segments():
    p = compacting()
    full = [p.allocate(200 * KiB) for _ in range(4)]
    p.allocate(300 * KiB)
    p.free(full[1])
    p.freeze()
    rec = p.compact(force=True)
    assert rec.num_released_segments == 0 and len(p.segments()) == 2
    assert (
        p.allocate(MiB) is not None
    )  # the emptied segment serves a request the freeze would refuse
    assert p.stats().num_grows == 2


def test_reset_forgets_passes():
    p = compacting()
    holes(p, [64 * KiB] * 4)
    p.compact(force=True)
    p.reset()
    assert p.compactions == [] and p.compaction_stats()["moved_bytes"] == 0


# ---------------------------------------------------------------------- wrappers above follow moves
def test_a_wrapper_above_sees_its_handles_moved():
    e = policies.create(
        "elastic:base=[compacting:base=[best-fit:segment_bytes=1MiB],min_free_bytes=0],high=1.0"
    )
    moves = e.on_move = Moves()
    x, y = holes(e, [64 * KiB] * 4)
    e.base_policy.compact(force=True)
    assert [m[0] for m in moves.calls] == [x, y]
    check_invariants(e, [x, y])


# ---------------------------------------------------------------------------- data stays intact
class Memory:
    """Bytes behind a pool's segments; ``on_move`` copies them like a device would (memmove)."""

    def __init__(self, policy):
        self.policy = policy
        self.buffers: dict[int, bytearray] = {}

    def _at(self, offset: int) -> tuple[bytearray, int]:
        for seg in self.policy.segments():
            if seg.offset <= offset < seg.end:
                buf = self.buffers.setdefault(seg.offset, bytearray(seg.nbytes))
                return buf, offset - seg.offset
        raise AssertionError(f"offset {offset} lies in no segment")

    def write(self, a, byte: int) -> None:
        buf, rel = self._at(a.offset)
        buf[rel : rel + a.size_bytes] = bytes([byte]) * a.size_bytes

    def holds(self, a, byte: int) -> bool:
        buf, rel = self._at(a.offset)
        return buf[rel : rel + a.size_bytes] == bytes([byte]) * a.size_bytes

    def __call__(self, a, old, new, nbytes):
        src, rs = self._at(old)
        dst, rd = self._at(new)
        dst[rd : rd + nbytes] = bytes(src[rs : rs + nbytes])


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 96 * KiB), st.sampled_from([0, 0, 1])),
        st.tuples(st.just("free"), st.integers(0, 1000), st.just(0)),
        st.tuples(st.just("compact"), st.booleans(), st.just(0)),
    ),
    min_size=10,
    max_size=80,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_OPS,
    base=st.sampled_from(["best-fit", "first-fit", "worst-fit"]),
    capacity=st.sampled_from([None, 512 * KiB, MiB]),
)
def test_moves_keep_every_byte_and_never_overlap(ops, base, capacity):
    p = Compacting(
        base=f"{base}:segment_bytes=256KiB",
        capacity_bytes=capacity,
        min_free_bytes=0,
        check_every=2,
        threshold=0.3,
    )
    memory = p.on_move = Memory(p)
    live: list[tuple] = []
    for i, (op, arg, stream) in enumerate(ops):
        if op == "alloc":
            a = p.allocate(arg, stream=stream)
            if a is not None:
                memory.write(a, i % 251 + 1)
                live.append((a, i % 251 + 1))
        elif op == "free" and live:
            p.free(live.pop(arg % len(live))[0])
        elif op == "compact":
            p.compact(force=arg)
        for seg in list(memory.buffers):  # released segments lose their bytes
            if all(s.offset != seg for s in p.segments()):
                del memory.buffers[seg]
        check_invariants(p, [a for a, _ in live])
        p.base_policy.check_invariants()
        for a, byte in live:
            assert memory.holds(a, byte), f"allocation at {a.offset} lost its bytes"


@pytest.mark.parametrize("base", ["best-fit", "first-fit", "worst-fit"])
@pytest.mark.parametrize("seed", [0, 1])
def test_long_runs_keep_every_byte_through_hundreds_of_moves(base, seed):
    import random

    rng = random.Random(seed)
    p = Compacting(
        base=f"{base}:segment_bytes=256KiB",
        capacity_bytes=MiB,
        min_free_bytes=0,
        check_every=3,
        threshold=0.3,
    )
    memory = p.on_move = Memory(p)
    live: list[tuple] = []
    for i in range(600):
        if live and rng.random() < 0.45:
            p.free(live.pop(rng.randrange(len(live)))[0])
        else:
            a = p.allocate(rng.randint(1, 96 * KiB), stream=rng.choice((0, 0, 1)))
            if a is not None:
                memory.write(a, i % 251 + 1)
                live.append((a, i % 251 + 1))
        memory.buffers = {
            k: v for k, v in memory.buffers.items() if any(s.offset == k for s in p.segments())
        }
        for a, byte in live:
            assert memory.holds(a, byte), f"step {i}: allocation at {a.offset} lost its bytes"
    check_invariants(p, [a for a, _ in live])
    s = p.compaction_stats()
    assert s["num_moves"] >= 50 and s["num_rescues"] > 0 and s["num_released_segments"] > 0, s
