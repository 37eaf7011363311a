"""What can go wrong on a real pool: no GPU, out of memory, corrupted memory.

Importable without CuPy. The CUDA backend raises ``realgpu.cuda.CudaPoolOutOfMemoryError``,
which is both a ``PoolOutOfMemoryError`` and CuPy's own ``OutOfMemoryError``, so code that
catches either keeps working.
"""

from __future__ import annotations

from typing import Any

from policies.base import PoolStats
from policies.units import format_bytes

__all__ = [
    "GpuUnavailableError",
    "PoolOutOfMemoryError",
    "CorruptionError",
    "PoolError",
    "VmmDriverError",
    "oom_message",
]


class GpuUnavailableError(RuntimeError):
    """The CUDA backend cannot run here; ``str()`` is one line saying why and what to do."""


class PoolError(ValueError):
    """A bad request to a ``GpuPool`` (closed pool, unknown allocation, discontiguous pages for
    ``malloc``)."""


class VmmDriverError(RuntimeError):
    """A virtual-memory driver call failed for a reason other than running out of memory.

    ``str()`` names the call, its arguments and the driver's error (``CUDA_ERROR_INVALID_VALUE``,
    or ``errno`` on the host stand-in). The device's bookkeeping may no longer match the driver's:
    close the pool.

    Attributes:
        call: the driver call (``cuMemMap``, ``mmap``...).
        error: the driver's name for the error.
    """

    def __init__(self, message: str, *, call: str = "", error: str = ""):
        super().__init__(message)
        self.call = call
        self.error = error


class PoolOutOfMemoryError(MemoryError):
    """The policy could not place a request (within capacity, or the device refused).

    Attributes:
        nbytes: the request.
        stats: the pool's ``PoolStats`` at the failure, also spelled out in the message.
    """

    def __init__(self, message: str, nbytes: int = 0, stats: PoolStats | None = None):
        # MemoryError's own __init__, not super(): in the CUDA subclass the next class in line is
        # CuPy's OutOfMemoryError, whose __init__ wants (size, total) and writes its own message
        MemoryError.__init__(self, message)
        self.nbytes = nbytes
        self.stats = stats

    def __reduce__(self):
        return (type(self), (str(self), self.nbytes, self.stats))


class CorruptionError(RuntimeError):
    """Validation found bytes that are not what the pool wrote.

    Attributes:
        offset: pool offset (policy address space) of the first bad byte.
        address: the device (or host) address of that byte.
        region: ``"guard-before"``, ``"data"`` or ``"guard-after"``.
        allocation: the allocation's ``(offset, size_bytes, nbytes)`` as the policy gave it.
    """

    def __init__(
        self,
        message: str,
        *,
        offset: int,
        address: int,
        region: str,
        allocation: tuple[int, int, int],
    ):
        super().__init__(message)
        self.offset = offset
        self.address = address
        self.region = region
        self.allocation = allocation


def oom_message(policy_spec: str, nbytes: int, stats: PoolStats) -> str:
    """One paragraph a user can act on: what was asked, what the pool holds, how fragmented."""
    cap = (
        "no capacity limit"
        if stats.capacity_bytes is None
        else f"capacity {_b(stats.capacity_bytes)}"
    )
    return (
        f"poollab pool {policy_spec!r} is out of memory allocating {_b(nbytes)}: "
        f"live {_b(stats.live_bytes)} in {stats.num_live} allocations, "
        f"allocated {_b(stats.allocated_bytes)}, "
        f"reserved {_b(stats.reserved_bytes)} in {stats.num_segments} segments ({cap}), "
        f"free {_b(stats.free_bytes)} of which "
        f"the largest servable request is {_b(stats.largest_free_bytes)} "
        f"(external fragmentation {stats.frag_ext:.1%}); "
        f"peak reserved {_b(stats.peak_reserved_bytes)}, "
        f"{stats.num_failures} failed requests so far"
    )


def _b(nbytes: Any) -> str:
    return f"{format_bytes(nbytes)} ({int(nbytes):,} B)"
