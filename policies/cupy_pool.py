"""``cupy-pool``: CuPy's ``MemoryPool`` (``cupy/cuda/memory.pyx``, ``SingleDeviceMemoryPool``).

The rules, as CuPy implements them:

- every request is rounded up to 512 B (``_round_size``, ``ALLOCATION_UNIT_SIZE``);
- one arena of free chunks per stream (``_arena(stream_ident)``); a chunk never serves another
  stream;
- best fit: the smallest free chunk at least as large as the request (``_Arena.get_chunk``,
  a lower bound on an index ordered by size); the chunk is split and the remainder, whatever
  its size, goes back to the arena unmerged;
- on a miss, ``cudaMalloc`` of exactly the rounded size: a new chunk, not a fixed-size
  segment (``_try_malloc``);
- a freed chunk merges with its free neighbours from the same ``cudaMalloc``
  (``try_merge_chunk``);
- past the limit (``set_limit`` / ``CUPY_GPU_MEMORY_LIMIT``: ``capacity_bytes`` here),
  ``_try_malloc`` raises ``OutOfMemoryError`` at once and frees nothing; only when
  ``cudaMalloc`` itself refuses (the device) does ``free_all_blocks()`` release every unsplit
  free chunk and the allocation is tried again, then fails (out of memory).

CuPy breaks ties between equal-size free chunks by the order of chunk objects in memory (an
implementation accident); here the lower address wins.

This is ``best-fit`` with CuPy's fixed settings: 512 B alignment, split whenever anything
remains, and a segment of exactly the request on a miss. CuPy has no other knobs, so the
block machinery's knobs are not parameters of this policy.
"""

from __future__ import annotations

from typing import Any

from policies.base import Segment
from policies.best_fit import BestFit
from policies.device import Device
from policies.units import round_up

__all__ = ["CupyPool", "ALLOCATION_UNIT_BYTES"]

#: CuPy's ``ALLOCATION_UNIT_SIZE``: requests are rounded up to this, and chunks split at it.
ALLOCATION_UNIT_BYTES = 512


class CupyPool(BestFit):
    """CuPy's ``MemoryPool`` (see the module docstring for the rules followed).

    Args:
        capacity_bytes: the pool's limit (CuPy's ``set_limit``); None for no limit.
        device: see ``Policy``.
    """

    name = "cupy-pool"

    def __init__(self, *, capacity_bytes: int | None = None, device: Device | None = None):
        super().__init__(
            segment_bytes=ALLOCATION_UNIT_BYTES,
            alignment_bytes=ALLOCATION_UNIT_BYTES,
            split_threshold_bytes=None,
            capacity_bytes=capacity_bytes,
            device=device,
        )

    @classmethod
    def _param_names(cls) -> list[str]:
        return ["capacity_bytes"]  # the block machinery's knobs are fixed to CuPy's values

    @classmethod
    def param_defaults(cls) -> dict[str, Any]:
        return {"capacity_bytes": None}

    def _reserve_segment(
        self, nbytes: int, stream: int = 0, *, retry: bool = True
    ) -> Segment | None:
        """``_try_malloc``: past the limit, out of memory without freeing anything; the base's
        release-and-retry runs only when the device refuses."""
        if (
            not self._frozen
            and self.capacity_bytes is not None
            and self.reserved_bytes + nbytes > self.capacity_bytes
        ):
            return None
        return super()._reserve_segment(nbytes, stream, retry=retry)

    def _segment_size_for(self, nbytes: int) -> int:
        """``cudaMalloc`` of exactly the rounded request."""
        return round_up(nbytes, ALLOCATION_UNIT_BYTES)

    def free_all_blocks(self) -> int:
        """CuPy's ``free_all_blocks()``: release every unsplit free chunk; returns the bytes."""
        return self.trim()

    def used_bytes(self) -> int:
        """CuPy's ``used_bytes()``: bytes in chunks handed out."""
        return self.allocated_bytes

    def total_bytes(self) -> int:
        """CuPy's ``total_bytes()``: bytes held from ``cudaMalloc``."""
        return self.reserved_bytes
