"""Compaction on a real pool (realgpu/compaction.py): bytes move with the handles, and are checked.

Every behaviour runs on the host backend; the ``gpu``-marked test repeats the end-to-end check on
CUDA where there is a device.
"""

from __future__ import annotations

import numpy as np
import pytest

from realgpu.compaction import DeviceMover, attach, compact
from realgpu.errors import CorruptionError, PoolError
from realgpu.pool import GpuPool

KiB = 1 << 10
MiB = 1 << 20
SPEC = "compacting:base=[best-fit:segment_bytes=1MiB],min_free_bytes=0,check_every=0"


def pool_with_holes(spec=SPEC, backend="host", sizes=(64 * KiB,) * 8, **kw):
    """A pool whose every other allocation was freed; the survivors hold distinct bytes."""
    pool = GpuPool(spec, backend=backend, **kw)
    mover = attach(pool)
    allocs = [pool.allocate(n) for n in sizes]
    for a in allocs[::2]:
        pool.free(a)
    kept = allocs[1::2]
    if not pool.validate:
        for i, a in enumerate(kept):
            write(pool, a, expected(a, i))
    return pool, mover, kept


def write(pool, a, data: bytes) -> None:
    array = np.frombuffer(data, dtype=np.uint8)
    if pool.device.kind == "cupy":
        import cupy

        array = cupy.asarray(array)
    pool.device.view(a.offset, a.size_bytes)[:] = array


def contents(pool, a) -> bytes:
    return pool.device.read_bytes(a.offset, a.size_bytes)


def expected(a, i) -> bytes:
    return (np.arange(a.size_bytes, dtype=np.uint64) * 7 + i).astype(np.uint8).tobytes()


def test_a_pass_moves_the_bytes_with_the_handles():
    pool, mover, kept = pool_with_holes()
    old = [a.offset for a in kept]
    result = compact(pool, force=True)
    assert [a.offset for a in kept] != old
    assert all(contents(pool, a) == expected(a, i) for i, a in enumerate(kept))
    assert (
        (mover.num_moves, mover.moved_bytes)
        == (result.record.num_moves, result.moved_bytes)
        == (4, 256 * KiB)
    )
    assert result.wall_ns >= result.copy_ns > 0


@pytest.mark.parametrize("staging_bytes", [16 * KiB, 256 * KiB, 4 * MiB])
def test_an_overlapping_slide_is_copied_safely_in_any_chunk_size(staging_bytes):
    # a 512 KiB block slides down by 64 KiB: source and destination overlap
    pool = GpuPool(SPEC, backend="host")
    mover = attach(pool, staging_bytes=staging_bytes)
    hole, big = pool.allocate(64 * KiB), pool.allocate(512 * KiB)
    write(pool, big, (np.arange(big.size_bytes, dtype=np.uint64) % 251).astype(np.uint8).tobytes())
    pool.free(hole)
    compact(pool, force=True)
    assert big.offset == pool.policy.segments()[0].offset
    assert (
        contents(pool, big)
        == (np.arange(512 * KiB, dtype=np.uint64) % 251).astype(np.uint8).tobytes()
    )
    assert mover.num_moves == 1


def test_validated_pool_finds_patterns_and_guards_intact_after_moves():
    pool, _, kept = pool_with_holes(validate=True)
    compact(pool, force=True)
    for a in kept:
        pool.free(a)  # checks every pattern and guard at the new place
    pool.check()


def test_a_failure_on_the_allocation_path_is_rescued_with_real_copies():
    pool, mover, kept = pool_with_holes(capacity_bytes=MiB, sizes=(128 * KiB,) * 8)
    a = pool.allocate(256 * KiB)  # fits only once the holes are merged
    assert a is not None and mover.num_moves > 0 and pool.policy.num_rescues == 1
    assert all(contents(pool, b) == expected(b, i) for i, b in enumerate(kept))


def test_emptied_segments_are_released_after_their_bytes_are_copied():
    pool = GpuPool(SPEC, backend="host", validate=True)
    attach(pool)
    full = [pool.allocate(200 * KiB) for _ in range(4)]
    stray = pool.allocate(300 * KiB)
    pool.free(full[1])
    result = compact(pool, force=True)
    assert result.record.num_released_segments == 1 and pool.device.num_segments == 1
    for a in [*full[::2], full[3], stray]:
        pool.free(a)


def test_a_wrapper_above_gets_the_mover_and_its_handles_move():
    spec = f"elastic:base=[{SPEC}],high=1.0"
    pool, _, kept = pool_with_holes(spec=spec)
    assert pool.policy.on_move is not None and pool.policy.base_policy.on_move is None
    compact(pool, force=True)
    assert all(contents(pool, a) == expected(a, i) for i, a in enumerate(kept))


def test_a_bad_copy_raises_corruption_error():
    class Lossy(DeviceMover):
        def _move_chunk(self, a, src_offset, dst_offset, n, overlap):
            dst = self.device.view(dst_offset, n)
            dst[...] = self.device.view(src_offset, n)
            dst[n // 2] ^= 0xFF  # one flipped byte on the way
            if not bool((dst == self.device.view(src_offset, n)).all()):
                self._raise(a, src_offset, dst_offset, dst, self.device.view(src_offset, n))

    pool = GpuPool(SPEC, backend="host")
    pool.policy.on_move = Lossy(pool)
    allocs = [pool.allocate(64 * KiB) for _ in range(4)]
    pool.free(allocs[0])
    with pytest.raises(CorruptionError, match="compaction moved") as err:
        compact(pool, force=True)
    assert err.value.region == "moved"


def test_attach_refuses_a_policy_that_never_moves():
    with pytest.raises(PoolError, match="never moves"):
        attach(GpuPool("best-fit", backend="host"))


def test_attach_twice_is_refused():
    pool = GpuPool(SPEC, backend="host")
    attach(pool)
    with pytest.raises(PoolError, match="attach once"):
        attach(pool)


def test_compact_without_a_mover_is_refused():
    with pytest.raises(PoolError, match="attach"):
        compact(GpuPool(SPEC, backend="host"))


def test_nothing_to_do_moves_nothing():
    pool = GpuPool(SPEC, backend="host")
    attach(pool)
    pool.allocate(KiB)
    result = compact(pool, force=True)
    assert result.record is None and result.moved_bytes == 0


@pytest.mark.gpu
def test_cuda_pass_moves_and_verifies_bytes():
    pool, mover, kept = pool_with_holes(
        backend="cuda",
        capacity_bytes=64 * MiB,
        sizes=(3 * MiB,) * 10,
        spec="compacting:base=[best-fit:segment_bytes=32MiB],min_free_bytes=0",
    )
    result = compact(pool, force=True)
    assert result.moved_bytes > 0 and mover.num_moves == result.record.num_moves
    assert all(contents(pool, a) == expected(a, i) for i, a in enumerate(kept))
    pool.close()
