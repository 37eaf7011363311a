"""The upstream a pool reserves segments from: ``cudaMalloc``/``cudaFree`` in the abstract.

A ``Device`` only hands out address ranges. ``VirtualDevice`` (the default) invents them;
``sim`` wraps it to charge driver time per call and ``realgpu`` implements the same two methods
with real ``cudaMalloc``/``cudaFree``, mapping each segment's offset to a device pointer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Device", "VirtualDevice", "SEGMENT_ALIGNMENT_BYTES", "MAX_DEVICE_BYTES"]

#: Segments start on 2 MiB boundaries, the granularity CUDA's driver maps memory in.
SEGMENT_ALIGNMENT_BYTES = 2 << 20

#: The most bytes a device model can hold: 4 TiB, four times the largest GPU announced (1 TB of
#: HBM), yet far below 2**62, where offsets would soon overflow 64-bit addresses.
#: A request above a device's ``max_bytes`` is refused before a policy does any work.
MAX_DEVICE_BYTES = 4 << 40


@runtime_checkable
class Device(Protocol):
    """Hands out segments. May also define ``max_bytes``, the largest request it could ever
    hold (``MAX_DEVICE_BYTES`` when it does not): policies refuse larger ones up front."""

    def reserve(self, nbytes: int) -> int | None:
        """Reserve ``nbytes``; return the segment's offset in the pool address space, or None."""

    def release(self, offset: int, nbytes: int) -> None:
        """Give back a segment returned by ``reserve``."""


class VirtualDevice:
    """An address space with no memory behind it.

    Offsets only grow and a 2 MiB gap separates segments, so two segments are never adjacent
    (a policy cannot silently coalesce across them) and a released address is never reused
    (a stale allocation can never alias a new one).

    Args:
        limit_bytes: optional device memory size; ``reserve`` returns None past it.
        max_bytes: the largest request any pool on this device may make (see ``MAX_DEVICE_BYTES``).
    """

    def __init__(self, limit_bytes: int | None = None, max_bytes: int = MAX_DEVICE_BYTES):
        self.limit_bytes = limit_bytes
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._next_offset = SEGMENT_ALIGNMENT_BYTES

    def reserve(self, nbytes: int) -> int | None:
        if self.limit_bytes is not None and self.used_bytes + nbytes > self.limit_bytes:
            return None
        offset = self._next_offset
        span = -(-nbytes // SEGMENT_ALIGNMENT_BYTES) * SEGMENT_ALIGNMENT_BYTES
        self._next_offset = offset + span + SEGMENT_ALIGNMENT_BYTES
        self.used_bytes += nbytes
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        self.used_bytes -= nbytes
