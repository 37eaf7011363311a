"""Compaction on a real pool: the bytes move with the allocations, and are checked.

A ``compacting`` policy decides the moves and updates the handles (``policies.compacting``);
on a real pool somebody must copy the bytes. This module does it through the pool's public API
(``pool.policy``, ``pool.device.view``), so ``GpuPool`` needs no change:

- ``DeviceMover(pool)``: an ``on_move`` callback that copies each move on the pool's device
  (``cudaMemcpyAsync`` device to device on CUDA) and compares the destination with what was
  copied, 8-byte words at a time (``CorruptionError`` on a difference).
  Overlapping moves (a slide shorter than the block) go through a staging buffer, chunk by
  chunk in the safe direction, since a device-to-device copy over overlapping ranges is
  undefined. Temporaries come from ``cudaMalloc`` directly (``cupy.cuda.using_allocator()``),
  never from the pool being compacted, even when it is CuPy's current allocator.
- ``attach(pool) -> DeviceMover``: wires a mover into the outermost layer of ``pool.policy``
  that moves allocations (the policy itself: wrappers pass moves up, so it sees the handles
  the pool holds). Attach before the first
  allocation when the policy compacts on the allocation path (a failure-triggered pass).
- ``compact(pool, force=False) -> GpuCompaction``: runs a pass now and measures it.

Only allocations held as handles (``GpuPool.allocate``) can move. Pointers ``GpuPool.malloc``
handed to CuPy are raw addresses that would dangle: do not compact a pool used through
``cupy.cuda.set_allocator``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.base import Allocation
from policies.compacting import Compaction
from realgpu.errors import CorruptionError, PoolError
from traces.knobs import check_int

__all__ = ["DeviceMover", "GpuCompaction", "attach", "compact", "DEFAULT_STAGING_BYTES"]

#: Largest chunk copied (and compared) at once: bounds the staging buffer and the comparison's
#: temporary (64 MiB: about 70 us of HBM traffic on an H200, so per-chunk overhead is noise).
DEFAULT_STAGING_BYTES = 64 << 20


@dataclass(slots=True)
class GpuCompaction:
    """One pass on a real pool: the policy's record plus what the device measured."""

    record: Compaction | None  # None: nothing to do
    wall_ns: int  # the whole pass, device copies and checks included (synchronised)
    copy_ns: int  # of which the moves' copies and checks

    @property
    def moved_bytes(self) -> int:
        return self.record.moved_bytes if self.record is not None else 0

    @property
    def bytes_per_s(self) -> float:
        """Achieved move throughput (bytes moved per second of copy time; verification included)."""
        return self.moved_bytes / (self.copy_ns * 1e-9) if self.copy_ns else float("nan")


class DeviceMover:
    """The ``on_move`` callback that copies moved allocations on a pool's device.

    Args:
        pool: the ``GpuPool`` whose device holds the bytes.
        verify: compare every destination chunk with its source after the copy.
        staging_bytes: largest chunk copied at once.

    Attributes:
        num_moves, moved_bytes: what it copied.
        copy_ns: wall time spent copying and checking (each move synchronised).
    """

    def __init__(
        self, pool: Any, *, verify: bool = True, staging_bytes: int = DEFAULT_STAGING_BYTES
    ):
        check_int("staging_bytes", staging_bytes, error=PoolError)
        self.pool = pool
        self.device = pool.device
        self.verify = verify
        self.staging_bytes = staging_bytes
        self.num_moves = 0
        self.moved_bytes = 0
        self.copy_ns = 0
        self._staging: Any = None
        self._cupy = None
        if self.device.kind == "cupy":
            import cupy

            self._cupy = cupy

    def __call__(
        self, allocation: Allocation, old_offset: int, new_offset: int, nbytes: int
    ) -> None:
        t0 = time.perf_counter_ns()
        with self._raw_temporaries():
            chunk = min(self.staging_bytes, nbytes)
            overlap = abs(new_offset - old_offset) < nbytes
            # copying low to high is safe when moving down (the next source lies above every
            # destination so far), high to low when moving up
            starts = range(0, nbytes, chunk)
            if new_offset > old_offset:
                starts = reversed(starts)
            for start in starts:
                n = min(chunk, nbytes - start)
                self._move_chunk(allocation, old_offset + start, new_offset + start, n, overlap)
        self.device.synchronize()
        self.copy_ns += time.perf_counter_ns() - t0
        self.num_moves += 1
        self.moved_bytes += nbytes

    def _move_chunk(
        self, a: Allocation, src_offset: int, dst_offset: int, n: int, overlap: bool
    ) -> None:
        view = self.device.view
        dst = view(dst_offset, n)
        if overlap:
            source = self._stage(n)
            self._copy(source, view(src_offset, n))
        else:
            source = view(src_offset, n)
        self._copy(dst, source)
        if self.verify and not self._equal(dst, source):
            self._raise(a, src_offset, dst_offset, dst, source)

    def _copy(self, dst: Any, src: Any) -> None:
        if self._cupy is not None:  # cudaMemcpyAsync device to device: copy-engine speed, no kernel
            dst.data.copy_from_device_async(src.data, dst.nbytes)
        else:
            dst[...] = src

    @staticmethod
    def _equal(a: Any, b: Any) -> bool:
        if a.nbytes % 8 == 0:  # compare 8-byte words: an eighth of the elements
            a, b = a.view(np.uint64), b.view(np.uint64)
        return bool((a == b).all())

    def _stage(self, n: int) -> Any:
        if self._staging is None or self._staging.size < n:
            size = min(self.staging_bytes, max(n, 1))
            if self._cupy is not None:
                cp = self._cupy
                self._staging = cp.ndarray(
                    (size,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(cp.cuda.Memory(size), 0)
                )
            else:
                self._staging = np.empty(size, dtype=np.uint8)
        return self._staging[:n]

    def _raw_temporaries(self):
        """Temporaries from ``cudaMalloc`` directly, on the pool's GPU (a no-op on the host)."""
        cp = self._cupy
        if cp is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(cp.cuda.Device(self.device.device_id))
        stack.enter_context(cp.cuda.using_allocator())
        return stack

    def _raise(
        self, a: Allocation, src_offset: int, dst_offset: int, dst: Any, source: Any
    ) -> None:
        k = int(np.flatnonzero(np.asarray(self._host(dst)) != np.asarray(self._host(source)))[0])
        offset = dst_offset + k
        raise CorruptionError(
            f"compaction moved {a.size_bytes:,} B of the allocation now at pool offset {a.offset} "
            f"and the copy differs: the byte at pool offset {offset} "
            f"(address 0x{self.device.address(offset):x}) "
            f"is 0x{int(self._host(dst[k : k + 1])[0]):02x}, "
            f"its source at {src_offset + k} held 0x{int(self._host(source[k : k + 1])[0]):02x}",
            offset=offset,
            address=self.device.address(offset),
            region="moved",
            allocation=(a.offset, a.size_bytes, a.nbytes),
        )

    def _host(self, array: Any) -> np.ndarray:
        return array.get() if self._cupy is not None else array

    def close(self) -> None:
        """Give the staging buffer back."""
        self._staging = None


def attach(pool: Any, **kwargs: Any) -> DeviceMover:
    """Make ``pool``'s compactions real copies: a ``DeviceMover`` becomes the policy's ``on_move``.

    Args:
        pool: a ``GpuPool`` over a compacting policy (or a wrapper over one).
        **kwargs: ``DeviceMover`` options (``verify``, ``staging_bytes``).

    Raises:
        PoolError: the policy never moves allocations, or a mover is attached already.
    """
    layer = pool.policy
    if not layer.moves_allocations:
        raise PoolError(
            f"policy {pool.policy.spec!r} never moves allocations; "
            "compaction needs a compacting policy, e.g. 'compacting:base=[best-fit]'"
        )
    if layer.on_move is not None:
        raise PoolError(f"policy {pool.policy.spec!r} already has an on_move callback; attach once")
    mover = DeviceMover(pool, **kwargs)
    layer.on_move = mover
    return mover


def compact(pool: Any, *, force: bool = False) -> GpuCompaction:
    """Run a compaction pass on ``pool`` now (when fragmented, or always with ``force``).

    Raises:
        PoolError: no compacting layer, or no ``DeviceMover`` attached (moving handles without
            copying the bytes would lose data).
    """
    policy = pool.policy
    if not (policy.moves_allocations and policy.can_compact):
        raise PoolError(
            f"policy {pool.policy.spec!r} cannot compact; use e.g. 'compacting:base=[best-fit]'"
        )
    mover = policy.on_move
    if not isinstance(mover, DeviceMover):
        raise PoolError(
            "attach(pool) first: a pass would move allocations without copying their bytes"
        )
    copy_before = mover.copy_ns
    t0 = time.perf_counter_ns()
    record = policy.compact(force=force)
    pool.device.synchronize()
    return GpuCompaction(
        record=record, wall_ns=time.perf_counter_ns() - t0, copy_ns=mover.copy_ns - copy_before
    )
