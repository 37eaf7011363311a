"""The CPU backend: host byte arrays stand in for ``cudaMalloc``'d segments.

Same interface and same offsets as the CUDA backend, so CI exercises the pool logic, the
validation patterns and the replay without a GPU. ``HostMemoryPointer`` plays the part of
``cupy.cuda.MemoryPointer`` for ``GpuPool.malloc``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from realgpu.segments import SegmentDevice

__all__ = ["HostDevice", "HostMemory", "HostMemoryPointer"]

_TOUCH_BYTES = 64
#: Validation fills and checks in pieces of this many bytes (a multiple of 4, so every piece
#: starts at the same phase of the word): one small pattern buffer serves a region of any size,
#: and the piece stays in cache while it is copied or compared.
_PIECE_BYTES = 1 << 16


def _load_memcmp():
    """libc's ``memcmp`` (the clean-case check reads each byte once, copying nothing), or None
    where this process's C library cannot be opened by name (then numpy compares)."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_memcmp = _load_memcmp()


class HostMemory:
    """The memory operations of a host backend, over ``view(offset, nbytes)`` (a writable
    ``uint8`` array): shared by the segment stand-in and the page-mapped one
    (``realgpu.host_vmm``)."""

    kind = "numpy"

    def fill(self, offset: int, nbytes: int, word: int, phase: int) -> None:
        """Write ``word`` (little-endian, starting at byte ``phase`` of it) over ``[offset, offset +
        nbytes)``."""
        if nbytes <= 0:
            return
        view, pattern = self.view(offset, nbytes), _pattern(min(nbytes, _PIECE_BYTES), word, phase)
        for start in range(0, nbytes, _PIECE_BYTES):
            piece = view[start : start + _PIECE_BYTES]
            piece[:] = pattern[: len(piece)]

    def first_mismatch(self, offset: int, nbytes: int, word: int, phase: int) -> int:
        """Index of the first byte of ``[offset, offset + nbytes)`` that ``fill`` with the same
        arguments would not have written, or -1: ``memcmp`` piece by piece (no copy of the
        region), then numpy within the first piece that differs."""
        if nbytes <= 0:
            return -1
        view, pattern = self.view(offset, nbytes), _pattern(min(nbytes, _PIECE_BYTES), word, phase)
        base, expected = view.ctypes.data, pattern.ctypes.data
        for start in range(0, nbytes, _PIECE_BYTES):
            length = min(_PIECE_BYTES, nbytes - start)
            piece = view[start : start + length]
            if (
                _memcmp(base + start, expected, length)
                if _memcmp is not None
                else not np.array_equal(piece, pattern[:length])
            ):
                return start + int(np.flatnonzero(piece != pattern[:length])[0])
        return -1

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        return self.view(offset, nbytes).tobytes()

    def touch(self, offset: int, nbytes: int) -> None:
        view = self.view(offset, nbytes)
        k = min(nbytes, _TOUCH_BYTES)
        view[:k] = 0x5A
        view[nbytes - k :] = 0x5A

    def synchronize(self) -> None:
        """Host writes are done when they return."""


class HostDevice(HostMemory, SegmentDevice):
    """Segments are ``numpy.uint8`` arrays.

    Args:
        limit_bytes: most bytes held at once; ``reserve`` returns None past it, the way
            ``cudaMalloc`` fails when the GPU is full. None for no limit.
    """

    def __init__(self, *, limit_bytes: int | None = None):
        super().__init__()
        self.limit_bytes = limit_bytes

    def _map(self, nbytes: int) -> tuple[int, Any] | None:
        if self.limit_bytes is not None and self.used_bytes + nbytes > self.limit_bytes:
            return None
        # zeros: calloc'd, so the OS maps pages only where they are written (a replay of a
        # 2 GB trace touches a few bytes per allocation, not 2 GB)
        buf = np.zeros(nbytes, dtype=np.uint8)
        return buf.ctypes.data, buf

    def _unmap(self, buffer: Any) -> None:
        pass  # the array goes with the last reference to it

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable ``uint8`` view of ``[offset, offset + nbytes)``, which must lie in one segment
        (``check_range``: a slice past the array's end would silently come back shorter)."""
        self.check_range(offset, nbytes)
        seg, rel = self.locate(offset)
        return self._buffers[seg][rel : rel + nbytes]


def _pattern(nbytes: int, word: int, phase: int) -> np.ndarray:
    """``nbytes`` bytes of ``word`` repeated (little-endian), the first being its byte ``phase %
    4``."""
    k = phase % 4
    words = np.full(nbytes // 4 + 2, word & 0xFFFFFFFF, dtype="<u4")
    return words.view(np.uint8)[k : k + nbytes]


class HostMemoryPointer:
    """What ``GpuPool.malloc`` returns on the host backend (CuPy's ``MemoryPointer`` on CUDA).

    Attributes:
        ptr: host address of the first byte.
        size: bytes requested.
        array: a ``uint8`` view of the memory.
    Dropping the last reference frees the allocation in the policy (through ``owner``).
    """

    __slots__ = ("ptr", "size", "array", "owner")

    def __init__(self, ptr: int, size: int, array: np.ndarray | None, owner: Any):
        self.ptr = ptr
        self.size = size
        self.array = array
        self.owner = owner

    def __int__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"<HostMemoryPointer 0x{self.ptr:x} size={self.size}>"
